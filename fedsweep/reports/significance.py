"""Intervals and paired tests behind every comparison fedsweep reports.

* ``t_interval``: mean over seeds with Student's t interval, x̄ ± t_{1-α/2, n-1} · s/√n
  (s the sample standard deviation, n-1 in its denominator).
* ``bootstrap_interval``: with one seed there is no spread over seeds to use; the interval is
  then the percentile bootstrap over clients of the (example-weighted) mean across clients,
  Σ wᵢ xᵢ / Σ wᵢ resampled with replacement (Efron & Tibshirani 1993, ch. 13).
* ``holm``: Holm's step-down adjustment of p-values within one family (one metric, every
  method against the baseline; a card's hypotheses), so "significant" keeps its meaning with many.

The tests themselves, with the run as the unit, are ``reports.verdicts``' (a client-level signed-rank
test over client × seed pairs was used by the comparison table until 2026-11-28: the clients of a run
share its aggregate, so they are not independent units). All functions are pure numpy/scipy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int
    kind: str
    """``t`` (over seeds), ``bootstrap`` (over clients, one seed) or ``point`` (a single value)."""

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def t_interval(values, level: float = 0.95) -> Interval:
    """Mean of ``values`` with the two-sided Student-t interval at ``level``."""
    from scipy import stats

    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("t_interval needs at least one value")
    mean = float(x.mean())
    if x.size == 1:
        return Interval(mean, mean, mean, 1, "point")
    half = float(stats.t.ppf(0.5 + level / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return Interval(mean, mean - half, mean + half, int(x.size), "t")


def bootstrap_interval(values, weights=None, level: float = 0.95, resamples: int = 10_000,
                       seed: int = 0) -> Interval:
    """Weighted mean of ``values`` (clients) with the percentile-bootstrap interval at ``level``."""
    x = np.asarray(values, dtype=float)
    w = np.ones_like(x) if weights is None else np.asarray(weights, dtype=float)
    if x.size == 0 or x.shape != w.shape:
        raise ValueError("bootstrap_interval needs values and weights of one non-zero length")
    if np.any(w < 0) or w.sum() <= 0:
        raise ValueError("bootstrap_interval needs non-negative weights with a positive sum")
    mean = float(np.dot(w, x) / w.sum())
    if x.size == 1:
        return Interval(mean, mean, mean, 1, "point")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(resamples, x.size))
    ws = w[idx]
    total = ws.sum(axis=1)
    keep = total > 0  # a resample of only zero-weight clients has no mean
    means = (ws * x[idx]).sum(axis=1)[keep] / total[keep]
    low, high = np.quantile(means, [0.5 - level / 2, 0.5 + level / 2])
    return Interval(mean, float(min(low, mean)), float(max(high, mean)), int(x.size), "bootstrap")


def holm(pvalues) -> list[float]:
    """Holm-adjusted p-values: sorted ascending, p₍ᵢ₎·(m−i+1), running maximum, capped at 1."""
    p = np.asarray(pvalues, dtype=float)
    order = np.argsort(p, kind="stable")
    m = p.size
    adjusted = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, p[i] * (m - rank)))
        adjusted[i] = running
    return adjusted.tolist()
