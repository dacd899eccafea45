"""The answer to the one question a study asks (``question:`` in its sweep file), in words.

It is read off the very tests of the study's comparison table (``reports.compare.paired_tests``): the
run as the unit, a paired t test over the seeds of each run's mean over its clients, Holm within the
metric over every row compared with the baseline (``reports.verdicts``, the cards' statistics) — one
analysis, so the question and the table never disagree. The answer per row is **yes** (significant,
in the asked direction), **no — the opposite**, **not detected** (with the smallest difference the
study could have detected at 80 % power) or **undecided** (fewer than three runs a row, or no spread
over them: no p-value); a row's client-level mean difference is printed as description, never as a
test.
"""

from __future__ import annotations

import json
import math

from fedsweep.reports import verdicts as vd


def _interval(o: vd.Outcome) -> str:
    return f"{o.estimate:+.3g} [{o.low:+.3g}, {o.high:+.3g}]"


def answer(question: dict, tests: dict, alpha: float, lower_is_better: bool) -> list[str]:
    """Markdown lines: the question, then one line per row. ``tests``: the comparison's tests on the
    question's metric by row (``reports.compare.Test``)."""
    metric = question.get("metric", "test_loss")
    words = metric.replace("_", " ")
    baseline = next((t.reference for t in tests.values()), "the baseline")
    lines = [f"**{question['text']}** (each row against {baseline} on {words}, the run as the unit; "
             f"{'lower' if lower_is_better else 'higher'} is better)", ""]
    verdicts = {}
    for row in question["rows"]:
        t = tests.get(row)
        if t is None:
            lines.append(f"- **{row}**: not tested (the row did not run, or its clients hold other data than "
                         f"{baseline}'s).")
            verdicts[row] = "not tested"
            continue
        described = (f"description only: {row} − {t.reference} = {t.client_mean_diff:+.3g} averaged over "
                     f"{t.client_pairs} client × seed pairs, which share their run's aggregate and are not independent")
        if t.undecided is not None:
            lines.append(f"- **{row}: undecided** — {t.undecided} (a run-level test needs {vd.MIN_UNITS} or more "
                         f"seeds with spread, e.g. --set sweep.seeds=[0,1,2]); {described}.")
            verdicts[row] = "undecided"
            continue
        o = t.outcome
        where = (f"{row} − {t.reference} = {_interval(o)} over {o.n} runs (paired t, p = {o.p:.2g}, "
                 f"Holm {t.p_adjusted:.2g})")
        if t.significant:
            word = "yes" if (o.estimate < 0) == lower_is_better else "no, the opposite"
            lines.append(f"- **{row}: {word}** — {where}.")
        else:
            word = "not detected"
            effect = "∞" if not math.isfinite(t.detectable) else f"{t.detectable:.3g}"
            lines.append(f"- **{row}: not detected** — {where}; the smallest mean difference these runs could have "
                         f"detected at 80 % power is {effect}.")
        verdicts[row] = word
    said: dict[str, list[str]] = {}
    for row, v in verdicts.items():
        said.setdefault(v, []).append(row)
    lines += ["", "Answer: " + "; ".join(f"{v} for {', '.join(rows)}" for v, rows in said.items()) + "."]
    return lines


def from_tag(tags: dict[str, str]) -> dict | None:
    raw = tags.get("fedsweep.question")
    return json.loads(raw) if raw else None
