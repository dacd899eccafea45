"""Verdicts of a reproduction card's pre-registered hypotheses: reproduced, not detected, contradicted.

**The unit is the run** (one trial, one seed). The clients of a run share its aggregate (and, under
the task split, two clients share a task): they are not independent, so every test here takes one
value per run — the mean over the run's clients of a per-client metric, or the run's own value —
and client-level statistics are description only.

Every hypothesis becomes a location test of per-run values x_s against a reference, the claim
saying on which side the mean must lie:

* ``greater`` / ``less`` (treatment − baseline > 0 / < 0): x_s = the treatment's run mean − the
  baseline's, paired by seed (the two rows' runs of one seed hold the same data); reference 0.
* ``not_worse`` (the treatment no worse than the baseline by more than ``margin``): x_s = how much
  worse the treatment's run is (in the metric's bad direction) − margin; claimed < 0. Contradicted
  only when significantly worse *than the margin*.
* ``at_least`` / ``at_most`` a ``bound``: x_s = the run's value − bound; claimed > 0 / < 0. At least
  :data:`MIN_UNITS` runs: fewer are refused (no interval of two values can clear a bound honestly).
* rows whose runs hold different data (another partition) cannot be paired: Welch's two-sample t
  test of the two rows' run means.

The test is Student's t (one-sample on x, or Welch's): unlike a signed-rank test over n runs, whose
smallest two-sided p is 2/2ⁿ (0.0625 at n = 5), it can reach any level with few units. Its p is
two-sided; **Holm** adjusts the p of every hypothesis of the card (thresholds included). With the
adjusted p < α the sign of the mean decides: **reproduced** on the claimed side, **contradicted** on
the other; otherwise **not detected**, with the smallest effect this budget could have detected at
80 % power at Holm's first-step level α/m:

    MDE = (t_{1−α/(2m), ν} + t_{0.80, ν}) · SE        (one sample: ν = n − 1, SE = s/√n; Welch: its ν and SE)

The *decision interval* is the mean's interval at level 1 − α/m (Bonferroni, the most conservative
step of Holm's), on the estimate's scale. Pure numpy/scipy: values in, verdicts out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fedsweep.reports.significance import holm

POWER = 0.80
MIN_UNITS = 3
"""The fewest runs a threshold is decided on."""

REPRODUCED, NOT_DETECTED, CONTRADICTED = "reproduced", "not detected", "contradicted"
UNIT = "run (seed)"


@dataclass
class Outcome:
    """One hypothesis's result."""

    id: str
    kind: str
    n: int
    estimate: float
    """The mean on the claim's scale: treatment − baseline (paired and unpaired kinds), or the row's
    value (thresholds)."""
    low: float
    high: float
    """Its 95 % interval."""
    p: float
    """The deciding two-sided p of the test against the reference (before Holm)."""
    se: float = math.nan
    df: float = math.nan
    """The estimate's standard error and its t distribution's degrees of freedom."""
    p_holm: float = math.nan
    verdict: str = NOT_DETECTED
    mde: float | None = None
    """The smallest effect this budget could have detected (not detected only)."""
    test: str = "paired t over runs"
    unit: str = UNIT
    reference: float = 0.0
    """What the estimate is tested against: 0, the margin line, or the bound."""
    claim_sign: float = 1.0
    """+1: the claim is estimate > reference; −1: estimate < reference."""
    decision_low: float = math.nan
    decision_high: float = math.nan
    """The estimate's interval at level 1 − α/m (set by :func:`decide`)."""
    notes: list[str] = field(default_factory=list)

    def interval(self, level: float) -> tuple[float, float]:
        """The estimate's t interval at ``level``."""
        from scipy import stats

        if not (self.df > 0 and self.se >= 0):
            return math.nan, math.nan
        half = float(stats.t.ppf(1 - (1 - level) / 2, self.df) * self.se)
        return self.estimate - half, self.estimate + half


def _t(estimate: float, reference: float, se: float, df: float) -> float:
    """Two-sided p of a t statistic (estimate − reference) / se with ``df`` degrees of freedom (no
    spread: 1 where the estimate is the reference, else 0)."""
    from scipy import stats

    if not df > 0:
        return 1.0
    if se == 0.0:
        return 1.0 if estimate == reference else 0.0
    return float(2 * stats.t.sf(abs(estimate - reference) / se, df))


def mde(diffs, alpha: float, m: int, power: float = POWER) -> float:
    """The minimum detectable shift at ``power`` (module docstring) for ``diffs``' spread and count."""
    d = np.asarray(diffs, dtype=float)
    if d.size < 2:
        return math.inf
    return _mde(float(d.std(ddof=1) / math.sqrt(d.size)), d.size - 1, alpha, m, power)


def _mde(se: float, df: float, alpha: float, m: int, power: float = POWER) -> float:
    from scipy import stats

    if not df > 0:
        return math.inf
    level = alpha / max(m, 1)
    return float((stats.t.ppf(1 - level / 2, df) + stats.t.ppf(power, df)) * se)


def _one_sample(hid: str, kind: str, values: np.ndarray, reference: float, claim_sign: float, test: str) -> Outcome:
    """``values`` (one per run) tested against ``reference``."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return Outcome(hid, kind, 0, math.nan, math.nan, math.nan, 1.0, test=test, reference=reference,
                       claim_sign=claim_sign, notes=["no values"])
    mean = float(x.mean())
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else math.nan
    df = x.size - 1
    out = Outcome(hid, kind, int(x.size), mean, math.nan, math.nan, _t(mean, reference, se, df), se=se, df=df,
                  test=test, reference=reference, claim_sign=claim_sign)
    out.low, out.high = out.interval(0.95)
    return out


def paired(hid: str, kind: str, treatment, baseline, margin: float = 0.0, higher_is_better: bool = True) -> Outcome:
    """``kind`` greater | less | not_worse over per-run values paired by seed (in the same order):
    the differences d = treatment − baseline tested against 0, or for ``not_worse`` against the
    margin line (−margin where higher is better, +margin where lower is), claimed on the good side."""
    a, b = np.asarray(treatment, dtype=float), np.asarray(baseline, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError("paired: treatment and baseline need one value per run, in the same order")
    if kind == "not_worse":
        line, claim = (-margin, 1.0) if higher_is_better else (margin, -1.0)
        return _one_sample(hid, kind, a - b, line, claim, "paired t over runs, against the margin")
    return _one_sample(hid, kind, a - b, 0.0, 1.0 if kind == "greater" else -1.0, "paired t over runs")


def welch_se_df(sd_a: float, n_a: int, sd_b: float, n_b: int) -> tuple[float, float]:
    """Welch's standard error of a difference of two means and its Welch–Satterthwaite degrees of
    freedom, ν = (v_a + v_b)² / (v_a²/(n_a − 1) + v_b²/(n_b − 1)), v = s²/n (n_a + n_b − 2 with no spread)."""
    va, vb = sd_a ** 2 / n_a, sd_b ** 2 / n_b
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1)) if se > 0 else n_a + n_b - 2
    return se, df


def unpaired(hid: str, kind: str, treatment, baseline) -> Outcome:
    """Rows whose runs hold different data: Welch's t test of the two rows' per-run values."""
    a, b = np.asarray(treatment, dtype=float), np.asarray(baseline, dtype=float)
    claim = 1.0 if kind == "greater" else -1.0
    if a.size < 2 or b.size < 2:
        return Outcome(hid, kind, int(min(a.size, b.size)), math.nan, math.nan, math.nan, 1.0,
                       test="Welch t over runs", claim_sign=claim, notes=["needs two runs a row"])
    diff = float(a.mean() - b.mean())
    se, df = welch_se_df(float(a.std(ddof=1)), a.size, float(b.std(ddof=1)), b.size)
    out = Outcome(hid, kind, int(min(a.size, b.size)), diff, math.nan, math.nan, _t(diff, 0.0, se, df), se=se, df=df,
                  test="Welch t over runs", claim_sign=claim, notes=[f"unpaired: {a.size} vs {b.size} runs"])
    out.low, out.high = out.interval(0.95)
    return out


def threshold(hid: str, kind: str, values, bound: float) -> Outcome:
    """``kind`` at_least | at_most ``bound`` over per-run values; fewer than :data:`MIN_UNITS` runs are
    refused (ValueError)."""
    x = np.asarray(values, dtype=float)
    if x.size < MIN_UNITS:
        raise ValueError(f"hypothesis {hid}: a threshold is decided on at least {MIN_UNITS} runs, got {x.size}")
    return _one_sample(hid, kind, x, bound, 1.0 if kind == "at_least" else -1.0, "one-sample t over runs")


def decide(outcomes: list[Outcome], alpha: float = 0.05) -> list[Outcome]:
    """Holm over every hypothesis of the card (thresholds included); each verdict, the detectable
    effect where nothing was detected, and the decision interval (level 1 − α/m)."""
    m = len(outcomes)
    for o, p in zip(outcomes, holm([o.p for o in outcomes])):
        o.p_holm = p
    for o in outcomes:
        o.decision_low, o.decision_high = o.interval(1 - alpha / max(m, 1))
        side = (o.estimate - o.reference) * o.claim_sign
        if o.p_holm < alpha and not math.isnan(side) and side != 0:
            o.verdict = REPRODUCED if side > 0 else CONTRADICTED
        else:
            o.verdict = NOT_DETECTED
            o.mde = _mde(o.se, o.df, alpha, m) if o.se == o.se else math.inf
    return outcomes
