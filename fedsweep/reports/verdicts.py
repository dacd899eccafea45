"""The one statistics of fedsweep: a reproduction card's verdicts, a study's comparison (``reports.compare``)
and the question a study asks (``reports.question``) all test here, the run as the unit.

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
* ``at_least`` / ``at_most`` a ``bound``: x_s = the run's value − bound; claimed > 0 / < 0.
* rows whose runs hold different data (another partition) cannot be paired: Welch's two-sample t
  test of the two rows' run means.

The test is Student's t (one-sample on x, or Welch's): unlike a signed-rank test over n runs, whose
smallest two-sided p is 2/2ⁿ (0.0625 at n = 5), it can reach any level with few units. Its p is
two-sided; **Holm** adjusts the p of every hypothesis of the card (thresholds included). With the
adjusted p < α the sign of the mean decides: **reproduced** on the claimed side, **contradicted** on
the other. Otherwise the smallest effect this budget could have detected at 80 % power at Holm's
first-step level α/m,

    MDE = (t_{1−α/(2m), ν} + t_{0.80, ν}) · SE        (one sample: ν = n − 1, SE = s/√n; Welch: its ν and SE)

is held against the smallest effect of interest the card stated before its budget (its ``effect``,
with its ``effect_basis``): **not detected** where the runs could have detected it (MDE ≤ effect),
**undecided at this budget** where they could not (nothing is concluded, and the ledger does not count
it as evidence). Fewer than :data:`MIN_UNITS` runs, or runs without spread (every value the same),
give no p-value at all: undecided (a zero spread once read as p = 0, a verdict without variance).
Holm runs over the hypotheses that have a p-value. A comparison without a stated effect (a study's
table) keeps *not detected* with its MDE.

Reports written before 2026-11-28's rules (no ``rules`` in their block) are recomputed with the rules
they were written with (``legacy``: no undecided verdict, a zero spread's p from the point alone).

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
"""The fewest runs any hypothesis is decided on (fewer: undecided, no p-value)."""

REPRODUCED, NOT_DETECTED, CONTRADICTED, UNDECIDED = "reproduced", "not detected", "contradicted", "undecided"
VERDICTS = (REPRODUCED, NOT_DETECTED, CONTRADICTED, UNDECIDED)
UNIT = "run (seed)"
RULES = 2
"""The version of these rules a report is written with (1: before the undecided verdict)."""


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
    rounding: float = 0.0
    """The spread that float rounding of the values tested alone can produce (:func:`rounding_of`)."""

    @property
    def undecided(self) -> str | None:
        """Why the runs give no p-value (too few, or no spread over them beyond rounding); None where
        they give one."""
        if self.n < MIN_UNITS:
            return f"{self.n} run{'s' if self.n != 1 else ''}: a test needs {MIN_UNITS}"
        if not (self.se * math.sqrt(self.n) > self.rounding):
            return "no spread over the runs: every value the same (up to float rounding)"
        return None

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
    return detectable_effect(float(d.std(ddof=1) / math.sqrt(d.size)), d.size - 1, alpha, m, power)


def detectable_effect(se: float, df: float, alpha: float, m: int, power: float = POWER) -> float:
    """The smallest true difference a two-sided t test of standard error ``se`` and ``df`` degrees of freedom
    detects with ``power`` at Holm's first level (α / m): (t_{1−α/2m} + t_{power}) · se; ∞ without df."""
    from scipy import stats

    if not df > 0:
        return math.inf
    level = alpha / max(m, 1)
    return float((stats.t.ppf(1 - level / 2, df) + stats.t.ppf(power, df)) * se)


def rounding_of(*inputs) -> float:
    """The spread float rounding alone gives values computed from ``inputs`` (a difference of two
    float64 means, a ratio): 8 ulps of the largest input. Runs that agree to within it agree exactly
    as far as the arithmetic can tell, and a t statistic over that noise would be meaningless."""
    scale = max((float(np.max(np.abs(x))) for x in inputs if np.size(x)), default=0.0)
    return 8 * float(np.finfo(float).eps) * scale


def _one_sample(hid: str, kind: str, values: np.ndarray, reference: float, claim_sign: float, test: str,
                rounding: float | None = None) -> Outcome:
    """``values`` (one per run) tested against ``reference``; ``rounding``: of the inputs the values were
    computed from (default: of the values and the reference)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return Outcome(hid, kind, 0, math.nan, math.nan, math.nan, 1.0, test=test, reference=reference,
                       claim_sign=claim_sign, notes=["no values"])
    mean = float(x.mean())
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else math.nan
    df = x.size - 1
    out = Outcome(hid, kind, int(x.size), mean, math.nan, math.nan, _t(mean, reference, se, df), se=se, df=df,
                  test=test, reference=reference, claim_sign=claim_sign,
                  rounding=rounding_of(x, [reference]) if rounding is None else rounding)
    out.low, out.high = out.interval(0.95)
    return out


def paired(hid: str, kind: str, treatment, baseline, margin: float = 0.0, higher_is_better: bool = True) -> Outcome:
    """``kind`` greater | less | not_worse over per-run values paired by seed (in the same order):
    the differences d = treatment − baseline tested against 0, or for ``not_worse`` against the
    margin line (−margin where higher is better, +margin where lower is), claimed on the good side."""
    a, b = np.asarray(treatment, dtype=float), np.asarray(baseline, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError("paired: treatment and baseline need one value per run, in the same order")
    floor = rounding_of(a, b, [margin])
    if kind == "not_worse":
        line, claim = (-margin, 1.0) if higher_is_better else (margin, -1.0)
        return _one_sample(hid, kind, a - b, line, claim, "paired t over runs, against the margin", floor)
    return _one_sample(hid, kind, a - b, 0.0, 1.0 if kind == "greater" else -1.0, "paired t over runs", floor)


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
                  test="Welch t over runs", claim_sign=claim, notes=[f"unpaired: {a.size} vs {b.size} runs"],
                  rounding=rounding_of(a, b))
    out.low, out.high = out.interval(0.95)
    return out


def threshold(hid: str, kind: str, values, bound: float) -> Outcome:
    """``kind`` at_least | at_most ``bound`` over per-run values (fewer than :data:`MIN_UNITS`: undecided,
    :func:`decide`)."""
    x = np.asarray(values, dtype=float)
    return _one_sample(hid, kind, x, bound, 1.0 if kind == "at_least" else -1.0, "one-sample t over runs")


def holm_of(outcomes: list[Outcome]) -> list[float]:
    """Holm-adjusted p-values of ``outcomes`` (one family)."""
    return holm([o.p for o in outcomes])


def decide(outcomes: list[Outcome], alpha: float = 0.05, effects: dict[str, float | None] | None = None,
           legacy: bool = False) -> list[Outcome]:
    """Holm over every hypothesis that has a p-value (thresholds included); each verdict (module
    docstring), the detectable effect where nothing was detected, and the decision interval (level
    1 − α/m). ``effects``: each hypothesis's smallest effect of interest (None: not stated);
    ``legacy``: the rules reports were written with before 2026-11-28."""
    if legacy:
        return _decide_legacy(outcomes, alpha)
    tested = [o for o in outcomes if o.undecided is None]
    m = len(tested)
    for o, p in zip(tested, holm_of(tested)):
        o.p_holm = p
    for o in outcomes:
        if o.undecided is not None:
            o.p, o.p_holm, o.verdict, o.mde = math.nan, math.nan, UNDECIDED, math.inf
            o.notes.append(f"undecided: {o.undecided}")
            continue
        o.decision_low, o.decision_high = o.interval(1 - alpha / max(m, 1))
        side = (o.estimate - o.reference) * o.claim_sign
        if o.p_holm < alpha and not math.isnan(side) and side != 0:
            o.verdict = REPRODUCED if side > 0 else CONTRADICTED
            continue
        o.mde = detectable_effect(o.se, o.df, alpha, m)
        effect = (effects or {}).get(o.id)
        o.verdict = NOT_DETECTED if effect is None or o.mde <= effect else UNDECIDED
        if o.verdict == UNDECIDED:
            o.notes.append(f"undecided at this budget: these runs could detect {o.mde:.3g}, more than the smallest "
                           f"effect of interest {effect:g}")
    return outcomes


def _decide_legacy(outcomes: list[Outcome], alpha: float) -> list[Outcome]:
    """The rules before 2026-11-28: Holm over every hypothesis, reproduced / contradicted / not detected."""
    m = len(outcomes)
    for o, p in zip(outcomes, holm_of(outcomes)):
        o.p_holm = p
    for o in outcomes:
        o.decision_low, o.decision_high = o.interval(1 - alpha / max(m, 1))
        side = (o.estimate - o.reference) * o.claim_sign
        if o.p_holm < alpha and not math.isnan(side) and side != 0:
            o.verdict = REPRODUCED if side > 0 else CONTRADICTED
        else:
            o.verdict = NOT_DETECTED
            o.mde = detectable_effect(o.se, o.df, alpha, m) if o.se == o.se else math.inf
    return outcomes
