"""Verdicts of a reproduction card's pre-registered hypotheses: reproduced, not detected, contradicted.

A hypothesis compares a *treatment* row of a study with a *baseline* row on one per-client metric,
over the (seed, client) pairs both evaluated on the same data (paired: same partition, same seed),
or checks one row's metric against a threshold.

* ``greater`` / ``less`` (the claim: treatment − baseline > 0 / < 0): the two-sided Wilcoxon
  signed-rank test on the paired differences, Holm-adjusted within the card. **reproduced**: the
  adjusted p < α and the mean difference has the claimed sign; **contradicted**: p < α, other sign;
  **not detected** otherwise, with the smallest effect this budget could have detected: at 80 %
  power, two-sided, at Holm's first-step level α/m (m hypotheses in the card), from the observed
  standard deviation s of the n paired differences,

      MDE = (t_{1−α/(2m), n−1} + t_{0.80, n−1}) · s / √n · √(π/3),

  the paired t-test's detectable shift inflated by the Wilcoxon test's asymptotic relative
  efficiency against it under normality (3/π).
* ``not_worse`` (the claim: the treatment is not worse than the baseline by more than ``margin``,
  "worse" being the metric's bad direction): **reproduced** when the one-sided Wilcoxon test of
  (difference in the worse direction − margin) < 0 is significant after Holm; **contradicted** when
  the two-sided test finds the treatment significantly worse (by any amount); **not detected**
  otherwise (MDE as above, the shift that would be needed beyond the margin).
* rows whose clients hold different data (another partition) cannot be paired: the same verdicts
  from the two-sided Mann–Whitney U test over their values, the detectable effect from the pooled
  spread, √(1/n₁ + 1/n₂) in place of 1/√n.
* ``at_least`` / ``at_most`` (a threshold on one row's metric, e.g. a bytes ratio or a time share):
  the row's values over trials with a Student-t interval at 1 − α/m; **reproduced** when the whole
  interval is on the claimed side, **contradicted** when it is wholly on the other, **not detected**
  when it straddles the threshold (one trial: its value alone decides, said so).

Pure numpy/scipy: values in, verdicts out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fedsweep.orchestrator.reports.significance import holm

ARE = 3.0 / math.pi
"""Asymptotic relative efficiency of the Wilcoxon signed-rank test against the paired t-test (normal data)."""
POWER = 0.80

REPRODUCED, NOT_DETECTED, CONTRADICTED = "reproduced", "not detected", "contradicted"


@dataclass
class Outcome:
    """One hypothesis's result."""

    id: str
    kind: str
    n: int
    estimate: float
    """Mean paired difference (treatment − baseline), or the row's mean value (thresholds)."""
    low: float
    high: float
    """Its 95 % interval (t over pairs or trials)."""
    p: float
    p_holm: float = math.nan
    verdict: str = NOT_DETECTED
    mde: float | None = None
    """The smallest effect this budget could have detected (not detected only)."""
    notes: list[str] = field(default_factory=list)


def mde(diffs, alpha: float, m: int, power: float = POWER) -> float:
    """The minimum detectable shift at ``power`` (module docstring) for ``diffs``' spread and count."""
    from scipy import stats

    d = np.asarray(diffs, dtype=float)
    n = d.size
    if n < 2:
        return math.inf
    s = float(d.std(ddof=1))
    level = alpha / max(m, 1)
    return float((stats.t.ppf(1 - level / 2, n - 1) + stats.t.ppf(power, n - 1)) * s / math.sqrt(n) / math.sqrt(ARE))


def _wilcoxon(d: np.ndarray, alternative: str = "two-sided") -> float:
    from scipy import stats

    nonzero = d[d != 0]
    if nonzero.size == 0:
        return 1.0
    return float(stats.wilcoxon(nonzero, zero_method="wilcox", alternative=alternative).pvalue)


def _t95(x: np.ndarray) -> tuple[float, float]:
    from scipy import stats

    if x.size < 2:
        return float(x.mean()), float(x.mean())
    half = float(stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return float(x.mean() - half), float(x.mean() + half)


def paired(hid: str, kind: str, treatment, baseline, margin: float = 0.0, higher_is_better: bool = True) -> Outcome:
    """A paired hypothesis's statistics before adjustment: ``kind`` greater | less | not_worse."""
    a, b = np.asarray(treatment, dtype=float), np.asarray(baseline, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError("paired: treatment and baseline need one value per pair, in the same order")
    d = a - b
    if d.size == 0:
        return Outcome(hid, kind, 0, math.nan, math.nan, math.nan, 1.0, notes=["no paired values"])
    low, high = _t95(d)
    out = Outcome(hid, kind, int(d.size), float(d.mean()), low, high, _wilcoxon(d))
    if kind == "not_worse":
        worse = -d if higher_is_better else d  # positive: the treatment is worse
        out.p = _wilcoxon(worse - margin, "less")
        out.notes.append(f"two_sided_p={_wilcoxon(d):.6g}")
    return out


def mde_unpaired(a, b, alpha: float, m: int, power: float = POWER) -> float:
    """The minimum detectable difference of two independent samples' means (pooled spread; the
    Wilcoxon–Mann–Whitney test's ARE against the t-test, 3/π, as for the paired form)."""
    from scipy import stats

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.size < 2 or b.size < 2:
        return math.inf
    df = a.size + b.size - 2
    pooled = math.sqrt(((a.size - 1) * a.var(ddof=1) + (b.size - 1) * b.var(ddof=1)) / df)
    level = alpha / max(m, 1)
    return float((stats.t.ppf(1 - level / 2, df) + stats.t.ppf(power, df)) * pooled
                 * math.sqrt(1 / a.size + 1 / b.size) / math.sqrt(ARE))


def unpaired(hid: str, kind: str, treatment, baseline) -> Outcome:
    """An unpaired hypothesis (rows whose clients hold different data): the two-sided Mann–Whitney U
    test; the estimate is the difference of means with Welch's 95 % interval."""
    from scipy import stats

    a, b = np.asarray(treatment, dtype=float), np.asarray(baseline, dtype=float)
    if a.size == 0 or b.size == 0:
        return Outcome(hid, kind, 0, math.nan, math.nan, math.nan, 1.0, notes=["no values"])
    diff = float(a.mean() - b.mean())
    if a.size > 1 and b.size > 1:
        va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
        se = math.sqrt(va + vb)
        df = (va + vb) ** 2 / ((va ** 2 / (a.size - 1) if a.size > 1 else 0) + (vb ** 2 / (b.size - 1) if b.size > 1 else 0)
                               or 1.0)
        half = float(stats.t.ppf(0.975, df) * se)
    else:
        half = math.nan
    p = float(stats.mannwhitneyu(a, b, alternative="two-sided").pvalue)
    out = Outcome(hid, kind, int(min(a.size, b.size)), diff, diff - half, diff + half, p)
    out.notes.append(f"unpaired: {a.size} vs {b.size} values")
    return out


def threshold(hid: str, kind: str, values, bound: float) -> Outcome:
    """A threshold hypothesis's statistics: ``kind`` at_least | at_most ``bound``."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return Outcome(hid, kind, 0, math.nan, math.nan, math.nan, 1.0, notes=["no values"])
    low, high = _t95(x)
    out = Outcome(hid, kind, int(x.size), float(x.mean()), low, high, math.nan)
    out.notes.append(f"bound={bound:g}")
    return out


def decide(outcomes: list[Outcome], diffs: dict[str, np.ndarray], values: dict[str, np.ndarray],
           bounds: dict[str, float], alpha: float = 0.05, higher_is_better: dict[str, bool] | None = None
           ) -> list[Outcome]:
    """Holm within the card (over the hypotheses that have a p-value) and each verdict.
    ``diffs``: each paired hypothesis's differences (treatment − baseline); ``values``: each
    threshold hypothesis's values; ``bounds``: thresholds and not_worse margins."""
    from scipy import stats

    higher_is_better = higher_is_better or {}
    m = len(outcomes)
    tested = [o for o in outcomes if not math.isnan(o.p)]
    for o, p in zip(tested, holm([o.p for o in tested])):
        o.p_holm = p
    for o in outcomes:
        if o.kind in ("greater", "less"):
            claimed = 1.0 if o.kind == "greater" else -1.0
            if o.p_holm < alpha:
                o.verdict = REPRODUCED if o.estimate * claimed > 0 else CONTRADICTED
            elif isinstance(diffs[o.id], tuple):
                o.verdict, o.mde = NOT_DETECTED, mde_unpaired(*diffs[o.id], alpha, m)
            else:
                o.verdict, o.mde = NOT_DETECTED, mde(diffs[o.id], alpha, m)
        elif o.kind == "not_worse":
            good = higher_is_better.get(o.id, True)
            d = diffs[o.id]
            two_sided = _wilcoxon(d)
            worse = (o.estimate < 0) if good else (o.estimate > 0)
            if o.p_holm < alpha:
                o.verdict = REPRODUCED
            elif min(1.0, two_sided * m) < alpha and worse:  # Bonferroni for the second question
                o.verdict = CONTRADICTED
            else:
                o.verdict, o.mde = NOT_DETECTED, mde(d, alpha, m)
        else:
            x = values[o.id]
            bound = bounds[o.id]
            if x.size >= 2:
                half = float(stats.t.ppf(1 - alpha / (2 * m), x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
                low, high = float(x.mean()) - half, float(x.mean()) + half
            else:
                low = high = float(x.mean()) if x.size else math.nan
                o.notes.append("one trial: its value alone decides")
            above, below = low >= bound, high <= bound
            if o.kind == "at_least":
                o.verdict = REPRODUCED if above else CONTRADICTED if high < bound else NOT_DETECTED
            else:
                o.verdict = REPRODUCED if below else CONTRADICTED if low > bound else NOT_DETECTED
    return outcomes
