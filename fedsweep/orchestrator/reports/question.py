"""The answer to the one question a study asks (``question:`` in its sweep file), in words.

For each row the question names, the paired test against the baseline that the report already ran
(Wilcoxon over client × seed pairs, Holm within the metric) decides: **yes** (significant, in the
asked direction), **no — the opposite** (significant, the other way) or **not detected**, and then
the smallest mean difference the study could have detected at 80 % power from the pairs' spread
(the paired t test's, ``verdicts.mde``, at the Holm-corrected level α/m, inflated by √(π/3) for the
signed-rank test's asymptotic efficiency against it, 3/π): what a larger study would have to look for.
"""

from __future__ import annotations

import json
import math

import numpy as np

from fedsweep.orchestrator.reports.verdicts import mde as t_mde

WILCOXON_ARE = 3.0 / math.pi
"""Asymptotic relative efficiency of the signed-rank test against the paired t test (normal data)."""


def mde(diffs, alpha: float, m: int) -> float:
    """The signed-rank test's detectable shift: the t test's over √ARE."""
    return t_mde(diffs, alpha, m) / math.sqrt(WILCOXON_ARE)


def answer(question: dict, tests: list, diffs: dict[str, list[float]], baseline: str, alpha: float,
           lower_is_better: bool) -> list[str]:
    """Markdown lines: the question, then one line per row. ``tests``: the report's paired tests
    (``compare.Test``); ``diffs``: each row's per-pair differences row − baseline on the metric."""
    from scipy import stats

    metric = question.get("metric", "test_loss")
    words = metric.replace("_", " ")
    family = [t for t in tests if t.metric == metric]
    lines = [f"**{question['text']}** (each row against {baseline} on {words}; "
             f"{'lower' if lower_is_better else 'higher'} is better)", ""]
    verdicts = {}
    for row in question["rows"]:
        test = next((t for t in family if t.label == row), None)
        d = np.asarray(diffs.get(row, []), dtype=float)
        if test is None or d.size == 0:
            lines.append(f"- **{row}**: not tested (the row did not run, or its clients hold other data than "
                         f"{baseline}'s).")
            verdicts[row] = "not tested"
            continue
        mean = float(d.mean())
        half = float(stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else math.nan
        where = (f"{row} − {baseline} = {mean:+.3g} [{mean - half:+.3g}, {mean + half:+.3g}] over {d.size} "
                 f"client × seed pairs, p = {test.result.p:.2g}, Holm {test.p_adjusted:.2g}")
        better = (mean < 0) == lower_is_better
        if test.significant and better:
            verdicts[row] = "yes"
            lines.append(f"- **{row}: yes** — {where}.")
        elif test.significant:
            verdicts[row] = "no, the opposite"
            lines.append(f"- **{row}: no, the opposite** — {where}.")
        else:
            verdicts[row] = "not detected"
            lines.append(f"- **{row}: not detected** — {where}; the smallest mean difference this study could "
                         f"have detected at 80 % power is {mde(d, alpha, len(family)):.3g}.")
    said = {}
    for row, v in verdicts.items():
        said.setdefault(v, []).append(row)
    lines += ["", "Answer: " + "; ".join(f"{v} for {', '.join(rows)}" for v, rows in said.items()) + "."]
    return lines


def from_tag(tags: dict[str, str]) -> dict | None:
    raw = tags.get("fedsweep.question")
    return json.loads(raw) if raw else None
