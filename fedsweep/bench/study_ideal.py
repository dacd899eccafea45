"""A study's wall time over its ideal (what ``fedsweep tune`` prints at its end).

Each trial reports its rounds' work summed (``total/work/*``, and the seconds its ideal takes as measured:
aggregation, pFedGPT's Ax fits; ``orchestrator.study.add_totals``). Its ideal is that work at the best bare
rates (``bench.ideal``), measured once in this process after the study, on the study's first cell (the
trials share the model and the batch shapes). The trials run side by side: the study's ideal is its trials'
ideals over the number it ran at once (the most whose lifetimes overlapped)::

    study ideal = Σ_trials ideal_t / trials at once;      over = study wall time / study ideal

Set-up (Ray, each trial's actors) is in the wall time and in no ideal: the ratio says what a study costs
beyond its work.
"""

from __future__ import annotations

from typing import Any


def trial_round(metrics: dict[str, Any]) -> dict[str, Any]:
    """A trial's summed rounds as one round for ``bench.ideal.round_ideal``."""
    work = {k.removeprefix("total/work/"): float(v) for k, v in metrics.items() if k.startswith("total/work/")}
    return {"work": work, "aggregation": float(metrics.get("total/phase/aggregate_s", 0.0)),
            "prepare_host": float(metrics.get("total/phase/prepare_host_s", 0.0))}


def at_once(spans: list[tuple[float, float]]) -> int:
    """The most of ``spans`` ((start, end) seconds) that overlap at one moment (at least 1)."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return max(most, 1)


def study_ideal(cell_cfg, trials: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """``trials``: each finished trial's last reported metrics (Tune's, with ``timestamp`` and
    ``time_total_s``); ``cell_cfg``: the study's first cell, whose rates price every trial's work."""
    from fedsweep.bench.ideal import rates, round_ideal

    rounds = [trial_round(t) for t in trials]
    generating = any(r["work"].get("generated_new_tokens") or r["work"].get("eval_new_tokens") for r in rounds)
    r = rates(cell_cfg, generating)
    ideals = [sum(round_ideal(rnd, r).values()) for rnd in rounds]
    spans = [(float(t["timestamp"]) - float(t["time_total_s"]), float(t["timestamp"])) for t in trials
             if "timestamp" in t and "time_total_s" in t]
    together = at_once(spans)
    ideal = sum(ideals) / together
    return {"wall_s": wall_s, "ideal_s": ideal, "over_ideal": wall_s / ideal if ideal > 0 else None,
            "trials": len(trials), "trials_at_once": together, "trial_ideals_s": ideals,
            "trial_rounds_s": [float(t.get("total/round_seconds", 0.0)) + float(t.get("total/final_update_seconds", 0.0))
                               for t in trials], "rates": r}
