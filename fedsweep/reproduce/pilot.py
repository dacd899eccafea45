"""A card's pilot: its study run on seeds the card never tests, to measure the run-level spread of
every hypothesis's tested value before the card fixes its number of seeds.

The pilot judges nothing. For each hypothesis it keeps the per-run values the card's test would use
(``card_units.judge``'s units: paired differences, threshold values, or each row's run means), their
standard deviation s, and the fewest runs n with which the card's own test could detect the effect
the hypothesis names (``Hypothesis.effect``) at 80 % (and 90 %) power at Holm's first-step level —
the same rule the verdicts use for the detectable effect (``verdicts.mde``)::

    n = min { n : (t_{1−α/(2m), ν} + t_{power, ν}) · SE(n) ≤ effect }
        one sample: ν = n − 1, SE = s/√n;   Welch, n runs a row: ν = Welch's, SE = √((s_a² + s_b²)/n)

The spread is sized from s's upper one-sided 80 % confidence bound, s · √(ν / χ²_{0.20, ν}) with ν
the pilot's degrees of freedom (about 2.1 s with three runs): the two cards whose pilots first sized
their seeds (premise v2, FedICU v2) then ran with about twice the pilot's s. The card's seeds are
the largest n over its hypotheses (a threshold needs at least ``verdicts.MIN_UNITS``). A hypothesis
without a named effect gets its spread only. For every hypothesis with a spread the pilot also
states the effect 3 to 8 runs would detect (``detectable_80``, the same rule solved for the effect):
where a named effect is out of reach, what a card of the seeds it can hold could name instead — from
the spreads alone, never the pilot's means.
"""

from __future__ import annotations

import math

import numpy as np

from fedsweep.reports import verdicts as vd

from fedsweep.config.card import PILOT_SEEDS  # noqa: F401  (re-exported: the pilot's seeds)
MAX_RUNS = 40
"""Sizes above this are reported as out of reach (None)."""
CONFIDENCE = 0.80
"""The one-sided confidence of the upper bound on the pilot's spread that the seeds are sized for."""


def upper_sd(sd: float, df: int, confidence: float = CONFIDENCE) -> float:
    """The upper one-sided ``confidence`` bound of a normal sample's standard deviation ``sd`` with
    ``df`` degrees of freedom: sd · √(df / χ²_{1 − confidence, df})."""
    from scipy import stats

    return float(sd * math.sqrt(df / stats.chi2.ppf(1 - confidence, df)))


def _se_df(n: int, sd: float, sd_b: float | None) -> tuple[float, float]:
    if sd_b is None:
        return sd / math.sqrt(n), n - 1
    return vd.welch_se_df(sd, n, sd_b, n)


def runs_needed(sd: float, effect: float, alpha: float, m: int, power: float = vd.POWER,
                fewest: int = 2, sd_b: float | None = None) -> int | None:
    """The fewest runs (a row) with which the test detects ``effect`` at ``power`` (module docstring);
    ``sd_b``: the second row's spread for Welch's test. None above :data:`MAX_RUNS`."""
    if not effect > 0:
        raise ValueError(f"runs_needed: the effect must be positive, got {effect}")
    for n in range(max(fewest, 2), MAX_RUNS + 1):
        se, df = _se_df(n, sd, sd_b)
        if vd.detectable_effect(se, df, alpha, m, power) <= effect:
            return n
    return None


DETECTABLE_RUNS = range(3, 9)
"""Run counts the pilot states each hypothesis's detectable effect for: what a card of that many seeds
could name when the effect it first named is out of reach."""


def detectable(sd: float, alpha: float, m: int, runs: int, power: float = vd.POWER,
               sd_b: float | None = None) -> float:
    """The smallest effect ``runs`` runs (a row) detect at ``power`` at Holm's first level α/m for a
    spread ``sd`` (the module docstring's rule solved for the effect)."""
    se, df = _se_df(runs, sd, sd_b)
    return float(vd.detectable_effect(se, df, alpha, m, power))


def _spread(units: list[dict]) -> tuple[dict[str, float], float, float | None, int]:
    """(values by seed, s, the baseline row's s for Welch or None, the degrees of freedom of s) of one
    hypothesis's units."""
    sd = lambda v: float(np.std(list(v.values()), ddof=1)) if len(v) > 1 else math.nan  # noqa: E731
    if units and units[0]["test"].startswith("Welch"):
        a = {u["seed"]: u["treatment"] for u in units if u.get("treatment") is not None}
        b = {u["seed"]: u["baseline"] for u in units if u.get("baseline") is not None}
        values = {f"{s} treatment": v for s, v in a.items()} | {f"{s} baseline": v for s, v in b.items()}
        return values, sd(a), sd(b), min(len(a), len(b)) - 1
    values = {u["seed"]: u["value"] for u in units}
    return values, sd(values), None, len(values) - 1


def plan(card, units: list[dict], budget_runs: int | None = None) -> dict:
    """Each hypothesis's pilot values, spread and runs needed, and the runs the card needs. ``units``:
    the per-run values the tests take (``card_units.run_level``); ``budget_runs``: the seeds the budget
    runs, for which each hypothesis's detectable effect is stated against its effect of interest —
    where it is larger, the budget cannot decide it (*undecided at this budget*, said before the run)."""
    m = len(card.hypotheses)
    out, needs = {}, []
    for h in card.hypotheses:
        mine = [u for u in units if u["hypothesis"] == h.id]
        values, sd, sd_b, df = _spread(mine)
        entry = {"test": mine[0]["test"] if mine else None, "values": values,
                 "mean": float(np.mean([u["value"] for u in mine])) if mine and "value" in mine[0] else None,
                 "sd": sd, "effect": h.effect}
        if sd_b is not None:
            entry["sd_baseline"] = sd_b
        fewest = vd.MIN_UNITS  # fewer runs give no p-value (verdicts: undecided)
        if sd == sd and df > 0:
            up = upper_sd(sd, df)
            up_b = upper_sd(sd_b, df) if sd_b is not None else None
            entry["sd_upper"] = up
            entry["detectable_80"] = {str(n): detectable(up, card.alpha, m, n, 0.80, up_b)
                                      for n in DETECTABLE_RUNS if n >= fewest}
            if h.effect is not None:
                entry["runs_80"] = runs_needed(up, h.effect, card.alpha, m, 0.80, fewest, up_b)
                entry["runs_90"] = runs_needed(up, h.effect, card.alpha, m, 0.90, fewest, up_b)
                needs.append(entry["runs_80"])
                if budget_runs:
                    at = detectable(up, card.alpha, m, max(budget_runs, 2), 0.80, up_b)
                    entry["detectable_at_budget"] = at
                    entry["budget_decides"] = bool(budget_runs >= fewest and up > 0 and at <= h.effect)
        out[h.id] = entry
    runs = None if not needs or None in needs else max(needs)
    return {"alpha": card.alpha, "hypotheses_m": m, "confidence": CONFIDENCE, "hypotheses": out, "runs_needed": runs,
            "budget_runs": budget_runs}


def _detects(entry: dict) -> list[str]:
    return [f"{n} runs detect {v:.3g}" for n, v in entry.get("detectable_80", {}).items()]


def lines(result: dict) -> list[str]:
    """The pilot in words: one line per hypothesis and the card's runs."""
    out = []
    for hid, e in result["hypotheses"].items():
        spread = f"sd {e['sd']:.3g}" + (f" / {e['sd_baseline']:.3g}" if "sd_baseline" in e else "")
        if e["effect"] is None or "sd_upper" not in e:
            why = "no named effect" if e["effect"] is None else "too few runs for a spread"
            out.append(f"{hid}: {spread} over {len(e['values'])} values; {why}" + "".join(f"; {d}" for d in _detects(e)))
        else:
            need = lambda n: "out of reach" if n is None else f"{n} runs"  # noqa: E731
            at = ""
            if "budget_decides" in e:
                at = (f"; the budget's {result['budget_runs']} runs detect {e['detectable_at_budget']:.3g}: "
                      + ("it can decide" if e["budget_decides"] else "undecided at this budget"))
            out.append(f"{hid}: {spread} (sized for {e['sd_upper']:.3g}, its upper {result['confidence']:.0%} "
                       f"bound); effect {e['effect']:.3g} needs {need(e['runs_80'])} at 80 % power, "
                       f"{need(e['runs_90'])} at 90 %{at}; " + ", ".join(_detects(e)))
    n = result["runs_needed"]
    out.append(f"the card needs {n} seeds" if n else "the card's seeds cannot be sized from this pilot "
               "(an effect is missing or out of reach)")
    return out
