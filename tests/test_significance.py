"""Intervals and paired tests against independent computations, and a report on a planted store."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fedsweep.reports.significance import bootstrap_interval, holm, min_attainable_p, paired_test, t_interval


def test_t_interval_matches_the_hand_computation():
    # x = 1..5: mean 3, s = sqrt(2.5); t_{0.975, 4} = 2.776445105 (table value)
    iv = t_interval([1, 2, 3, 4, 5])
    half = 2.776445105 * math.sqrt(2.5) / math.sqrt(5)
    assert iv.kind == "t" and iv.n == 5
    assert iv.mean == 3 and iv.low == pytest.approx(3 - half, rel=1e-9) and iv.high == pytest.approx(3 + half, rel=1e-9)
    # two seeds: t_{0.975, 1} = 12.70620474; 90 % level: t_{0.95, 1} = 6.313751515
    iv = t_interval(np.array([0.25, 0.35], dtype=np.float32))
    assert iv.half_width == pytest.approx(12.70620474 * 0.0707106781 / math.sqrt(2), rel=1e-6)
    assert t_interval([0.25, 0.35], level=0.9).half_width == pytest.approx(6.313751515 * 0.05, rel=1e-6)
    same = t_interval([0.7, 0.7, 0.7])  # identical seeds: a zero-width interval (up to rounding)
    assert same.low == pytest.approx(0.7, abs=1e-12) and same.high == pytest.approx(0.7, abs=1e-12)
    assert t_interval([2.0]).kind == "point"


def _brute_force_wilcoxon(d: np.ndarray) -> float:
    """Exact two-sided p of the signed-rank statistic: all 2ⁿ sign flips (distinct |d|, no zeros)."""
    d = d[d != 0]
    ranks = np.argsort(np.argsort(np.abs(d))) + 1.0
    observed = ranks[d > 0].sum()
    n = len(d)
    mean = n * (n + 1) / 4
    stats = [sum(r for r, s in zip(ranks, signs) if s) for signs in itertools.product([0, 1], repeat=n)]
    extreme = sum(abs(s - mean) >= abs(observed - mean) - 1e-12 for s in stats)
    return extreme / 2 ** n


@pytest.mark.parametrize("diffs", [
    [0.3, -0.1, 0.25, 0.4, 0.05, 0.33, 0.12, 0.21],           # mostly positive
    [0.01, -0.02, 0.03, -0.04, 0.05, -0.06, 0.07, -0.08, 0.09],  # balanced: far from significant
    [1e-7, 2e-7, 3e-7, 4e-7, 5e-7, 6e-7],                       # one sign, tiny: the smallest p for n=6
])
def test_wilcoxon_matches_brute_force_enumeration(diffs):
    d = np.array(diffs)
    base = np.linspace(1.0, 2.0, len(d))
    res = paired_test(base + d, base)
    assert res.n == len(d) and res.mean_diff == pytest.approx(d.mean(), abs=1e-12)
    assert res.p == pytest.approx(_brute_force_wilcoxon(np.array(diffs)), rel=1e-9)


def test_wilcoxon_drops_zero_differences_and_all_zero_is_p_one():
    d = np.array([0.0, 0.0, 0.5, 0.2, -0.1, 0.3, 0.4, 0.6, 0.7])
    res = paired_test(d, np.zeros_like(d))
    assert res.n == 9
    assert res.p == pytest.approx(_brute_force_wilcoxon(d), rel=1e-9)
    same = paired_test([0.3, 0.3, 0.3], [0.3, 0.3, 0.3])  # identical clients: no evidence of a difference
    assert same.p == 1.0 and same.mean_diff == 0.0
    with pytest.raises(ValueError):
        paired_test([1.0, 2.0], [1.0])


def test_min_attainable_p_is_the_one_sided_extreme():
    for n in (4, 5, 6, 8):
        assert min_attainable_p(n) == pytest.approx(_brute_force_wilcoxon(np.arange(1.0, n + 1)))
    assert min_attainable_p(5) > 0.05 > min_attainable_p(6)


def test_holm_against_the_hand_computation():
    # sorted 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 → running max 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert holm([0.2, 0.2]) == pytest.approx([0.4, 0.4])  # exact ties


def _exact_bootstrap(x, w, level):
    """Every one of the nⁿ equally likely resamples: the exact bootstrap distribution's quantiles."""
    n = len(x)
    means = []
    for idx in itertools.product(range(n), repeat=n):
        ws = w[list(idx)]
        means.append(float(np.dot(ws, x[list(idx)]) / ws.sum()))
    return np.quantile(means, [0.5 - level / 2, 0.5 + level / 2])


@pytest.mark.parametrize("weights", [None, [3.0, 1.0, 1.0, 5.0, 2.0]])
def test_bootstrap_interval_matches_the_exact_bootstrap(weights):
    x = np.array([0.1, 0.4, 0.35, 0.8, 0.2], dtype=np.float32)
    w = np.ones(5) if weights is None else np.array(weights)
    iv = bootstrap_interval(x, weights, resamples=40_000, seed=3)
    low, high = _exact_bootstrap(x.astype(float), w, 0.95)
    assert iv.kind == "bootstrap" and iv.mean == pytest.approx(np.dot(w, x) / w.sum(), rel=1e-6)
    assert iv.low == pytest.approx(low, abs=0.02) and iv.high == pytest.approx(high, abs=0.02)


def test_bootstrap_interval_degenerate_cases():
    same = bootstrap_interval([0.5, 0.5, 0.5, 0.5])
    assert same.low == same.high == 0.5
    assert bootstrap_interval([0.3]).kind == "point"
    dup = bootstrap_interval([1.0, 1.0, 1.0, 2.0])  # duplicated points
    assert dup.low >= 1.0 and dup.high <= 2.0 and dup.low < dup.mean < dup.high
    with pytest.raises(ValueError):
        bootstrap_interval([1.0, 2.0], [0.0, 0.0])


# ------------------------------------------------------------------------------ the report


def _plant(uri: str, experiment: str, seeds: list[int]) -> None:
    """A study with fedavg, ``better`` (every client 0.2 lower test loss: a planted difference) and
    ``same`` (± noise of alternating sign around fedavg: a planted null), 8 clients per seed."""
    import json as _json

    from fedsweep.orchestrator.tracking.tracker import Tracker

    parent = Tracker(uri, experiment, run_name="study", tags={"fedsweep.kind": "study"})
    rng = np.random.default_rng(0)
    for seed in seeds:
        base = rng.uniform(1.0, 4.0, size=8)  # clients differ far more than the methods do
        acc = rng.uniform(0.0, 0.6, size=8)
        noise = np.array([0.03, -0.031, 0.05, -0.049, 0.02, -0.021, 0.04, -0.038])
        for label, loss in (("fedavg", base), ("better", base - 0.2 - rng.uniform(0, 0.02, 8)),
                            ("same", base + noise)):
            run = Tracker(uri, experiment, run_name=f"{label} seed={seed}", parent_run_id=parent.run_id,
                          tags={"fedsweep.label": label})
            run.log_params({"seed": str(seed), "algorithm": "fedavg"})
            run.log_text(_json.dumps([{"cid": c, "tasks": [f"task{c % 4}"], "train": 8, "test": 12} for c in range(8)]),
                         "clients.json")
            for rnd in (1, 2):
                scale = 1.0 + (2 - rnd) * 0.5
                metrics = {"test_loss": float(np.mean(loss * scale)), "accuracy": float(np.mean(acc)),
                           "round_seconds": 3.0, "eval_seconds": 1.0, "bytes_up": 1024.0 ** 2, "bytes_down": 1024.0 ** 2}
                for c in range(8):
                    metrics.update({f"client/{c:03d}/test_loss": float(loss[c] * scale), f"client/{c:03d}/accuracy":
                                    float(acc[c]), f"client/{c:03d}/num_test": 6.0, f"client/{c:03d}/num_test_loss": 12.0})
                run.log_metrics(metrics, step=rnd)
            run.finish()
    parent.finish()


@pytest.mark.parametrize("seeds", [[0, 1], [0]])
def test_report_marks_exactly_the_planted_difference(tracking_uri, tmp_path, seeds):
    from fedsweep.reports.compare import compare

    name = f"planted_{len(seeds)}"
    _plant(tracking_uri, name, seeds)
    report, table, _ = compare(name, tracking_uri, str(tmp_path), "test_loss")
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert set(rows) == {"fedavg (baseline)", "better", "same"}
    test_loss_cell = lambda lab: rows[lab].split("|")[5]  # noqa: E731 method|seeds|interval|examples|test loss
    assert "**" in test_loss_cell("better") and "▲" in test_loss_cell("better")
    assert "**" not in rows["same"] and "**" not in rows["fedavg (baseline)"]
    assert "**" not in rows["better"].split("|")[6]  # accuracy is identical: not marked
    assert ("t over seeds" if len(seeds) > 1 else "bootstrap over clients") in rows["better"]
    assert "6 · 12" not in rows["better"] and ("48 · 96" in rows["better"])  # examples per seed, over 8 clients
    text = report.read_text()
    found = text.split("## What is significant")[1].split("## Paired tests")[0]
    assert "**better** has a lower test loss than fedavg (better)" in found
    assert "same vs fedavg on test loss" in found.split("Not significant")[1]
    assert "better vs fedavg on accuracy" in found.split("Not significant")[1]
    for png in ("test_loss_per_round.png", "test_loss_per_client.png", "communication_vs_test_loss.png"):
        assert (report.parent / png).stat().st_size > 5000 and f"]({png})" in text


def test_report_without_the_baseline_marks_nothing(tracking_uri, tmp_path):
    from fedsweep.reports.compare import compare

    _plant(tracking_uri, "planted_nobase", [0])
    report, table, _ = compare("planted_nobase", tracking_uri, str(tmp_path), "test_loss", baseline="scaffold")
    assert "**" not in table and "No run is labelled 'scaffold'" in report.read_text()


def test_a_studys_question_is_answered_row_by_row_with_the_run_as_the_unit():
    """yes / no, the opposite / not detected (with the detectable effect) / not tested at the run level
    (one seed: client pairs only described) / not tested, checked against scipy's paired t and Holm
    computed here; for a metric where lower is better and one where higher is."""
    from scipy import stats

    from fedsweep.reports.question import answer

    base = [2.0, 2.4, 2.1, 2.6]
    runs = {"local": ([b - 0.3 + e for b, e in zip(base, (0.01, -0.02, 0.0, 0.015))], base),
            "drift": ([b + 0.25 + e for b, e in zip(base, (0.02, 0.0, -0.01, 0.01))], base),
            "pfedgpt": ([b + e for b, e in zip(base, (0.1, -0.2, 0.05, -0.1))], base),
            "fedcofit": ([1.9], [2.0])}
    client = {"fedcofit": [-0.3, 0.1, -0.2]}
    q = {"text": "Do personal models win?", "metric": "test_loss", "rows": ["local", "drift", "pfedgpt", "fedcofit", "flora"]}
    lines = answer(q, runs, client, "fedavg", 0.05, lower_is_better=True)
    by_row = {x.split("**")[1].split(":")[0]: x for x in lines if x.startswith("- **")}
    p = {r: stats.ttest_rel(*runs[r]).pvalue for r in ("local", "drift", "pfedgpt")}
    order = sorted(p, key=p.get)  # Holm over the three rows tested at the run level
    holm, running = {}, 0.0
    for i, r in enumerate(order):
        running = max(running, min(1.0, (3 - i) * p[r]))
        holm[r] = running
    assert holm["local"] < 0.05 and holm["drift"] < 0.05 and holm["pfedgpt"] > 0.05
    assert ": yes**" in by_row["local"] and "over 4 runs" in by_row["local"]
    assert f"Holm {holm['local']:.2g}" in by_row["local"] and f"p = {p['local']:.2g}" in by_row["local"]
    assert ": no, the opposite**" in by_row["drift"]
    d = np.subtract(*runs["pfedgpt"])
    effect = (stats.t.ppf(1 - 0.05 / 3 / 2, 3) + stats.t.ppf(0.8, 3)) * d.std(ddof=1) / 2
    assert ": not detected**" in by_row["pfedgpt"] and f"{effect:.3g}" in by_row["pfedgpt"]
    assert "not tested at the run level" in by_row["fedcofit"] and "1 run a row" in by_row["fedcofit"]
    assert "description only: fedcofit − fedavg = -0.133" in by_row["fedcofit"]
    assert "not tested (the row did not run" in by_row["flora"]
    assert lines[-1] == ("Answer: yes for local; no, the opposite for drift; not detected for pfedgpt; "
                         "not tested at the run level for fedcofit; not tested for flora.")
    # higher is better: the same negative difference is now the opposite
    acc = answer({**q, "metric": "accuracy", "rows": ["local"]}, {"local": runs["local"]}, {}, "fedavg", 0.05,
                 lower_is_better=False)
    assert ": no, the opposite**" in acc[2]
