"""The answer to the one question a study asks (``question:`` in its sweep file), in words.

**The run is the unit**, as for the reproduction cards (``reports.verdicts``): the clients of a run
share its aggregate, so a row is compared with the baseline by a paired t test over the seeds of
each run's mean over its clients (the two rows' runs of one seed hold the same data), with Holm over
the question's rows. The answer per row is **yes** (significant, in the asked direction), **no —
the opposite** or **not detected**, with the smallest difference the study could have detected at
80 % power at Holm's first level (``verdicts``' rule). A row with fewer than two runs a side is
**not tested at the run level**; its client-level mean difference is printed as description, never
as a test.
"""

from __future__ import annotations

import json
import math

import numpy as np

from fedsweep.reports import verdicts as vd


def _interval(o: vd.Outcome) -> str:
    return f"{o.estimate:+.3g} [{o.low:+.3g}, {o.high:+.3g}]"


def _described(row: str, baseline: str, d: list[float], n_runs: int) -> str:
    text = f"{n_runs} run a row" if n_runs == 1 else f"{n_runs} runs a row"
    said = (f"; description only: {row} − {baseline} = {float(np.mean(d)):+.3g} averaged over {len(d)} client × "
            f"seed pairs, which share their run's aggregate and are not independent") if d else ""
    return (f"- **{row}: not tested at the run level** — {text} (a run-level test needs two or more seeds, "
            f"e.g. --set sweep.seeds=[0,1,2]){said}.")


def answer(question: dict, runs: dict[str, tuple[list[float], list[float]]], client_diffs: dict[str, list[float]],
           baseline: str, alpha: float, lower_is_better: bool) -> list[str]:
    """Markdown lines: the question, then one line per row. ``runs``: each row's per-run means and the
    baseline's, paired by seed (the clients both rows evaluated); ``client_diffs``: each row's
    client-level differences (description)."""
    metric = question.get("metric", "test_loss")
    words = metric.replace("_", " ")
    lines = [f"**{question['text']}** (each row against {baseline} on {words}, the run as the unit; "
             f"{'lower' if lower_is_better else 'higher'} is better)", ""]
    kind = "less" if lower_is_better else "greater"
    tested = {row: vd.paired(row, kind, *runs[row]) for row in question["rows"]
              if row in runs and len(runs[row][0]) >= 2}
    outcomes = {o.id: o for o in vd.decide(list(tested.values()), alpha)} if tested else {}
    verdicts = {}
    for row in question["rows"]:
        if row not in runs:
            lines.append(f"- **{row}**: not tested (the row did not run, or its clients hold other data than "
                         f"{baseline}'s).")
            verdicts[row] = "not tested"
            continue
        if row not in outcomes:
            lines.append(_described(row, baseline, client_diffs.get(row, []), len(runs[row][0])))
            verdicts[row] = "not tested at the run level"
            continue
        o = outcomes[row]
        where = (f"{row} − {baseline} = {_interval(o)} over {o.n} runs (paired t, p = {o.p:.2g}, "
                 f"Holm {o.p_holm:.2g})")
        word = {vd.REPRODUCED: "yes", vd.CONTRADICTED: "no, the opposite"}.get(o.verdict, "not detected")
        verdicts[row] = word
        if word == "not detected":
            effect = "∞" if not math.isfinite(o.mde) else f"{o.mde:.3g}"
            lines.append(f"- **{row}: not detected** — {where}; the smallest mean difference these runs could have "
                         f"detected at 80 % power is {effect}.")
        else:
            lines.append(f"- **{row}: {word}** — {where}.")
    said: dict[str, list[str]] = {}
    for row, v in verdicts.items():
        said.setdefault(v, []).append(row)
    lines += ["", "Answer: " + "; ".join(f"{v} for {', '.join(rows)}" for v, rows in said.items()) + "."]
    return lines


def from_tag(tags: dict[str, str]) -> dict | None:
    raw = tags.get("fedsweep.question")
    return json.loads(raw) if raw else None
