"""Intervals and Holm against independent computations; a report and a study's question on planted stores,
the run as the unit (one statistics: ``reports.verdicts``)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fedsweep.reports.significance import bootstrap_interval, holm, t_interval


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


def _plant(uri: str, experiment: str, seeds: list[int], shifts=None) -> dict:
    """A study with fedavg, ``better`` (every client 0.2 lower test loss: a planted difference) and
    ``same`` (fresh ± noise around fedavg in every run: a planted null), 8 clients per seed; ``shifts``
    {label: {seed: per-client shift}} replaces the two. Returns {label: {seed: per-client test loss}}."""
    import json as _json

    from fedsweep.orchestrator.tracking.tracker import Tracker

    parent = Tracker(uri, experiment, run_name="study", tags={"fedsweep.kind": "study"})
    rng = np.random.default_rng(0)
    planted: dict = {}
    for seed in seeds:
        base = rng.uniform(1.0, 4.0, size=8)  # clients differ far more than the methods do
        acc = rng.uniform(0.0, 0.6, size=8)
        rows = {"better": -0.2 - rng.uniform(0, 0.02, 8), "same": rng.normal(0.0, 0.03, 8)}
        if shifts is not None:
            rows = {label: np.asarray(by_seed[seed], dtype=float) for label, by_seed in shifts.items()}
        for label, loss in (("fedavg", base), *((k, base + d) for k, d in rows.items())):
            planted.setdefault(label, {})[seed] = loss
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
    return planted


def _holm_here(p: dict) -> dict:
    """Holm's step-down adjustment, written out independently of ``reports.significance.holm``."""
    order, out, running = sorted(p, key=p.get), {}, 0.0
    for i, k in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * p[k]))
        out[k] = running
    return out


def test_report_marks_exactly_the_planted_difference(tracking_uri, tmp_path):
    """Three seeds: ``better`` is bold and significant by scipy's paired t over the run means (Holm over
    the two rows, computed here); ``same`` and the identical accuracy are not marked."""
    from scipy import stats

    from fedsweep.reports.compare import compare

    planted = _plant(tracking_uri, "planted_3", [0, 1, 2])
    report, table, _ = compare("planted_3", tracking_uri, str(tmp_path), "test_loss")
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert set(rows) == {"fedavg (baseline)", "better", "same"}
    test_loss_cell = lambda lab: rows[lab].split("|")[5]  # noqa: E731 method|seeds|interval|examples|test loss
    assert "**" in test_loss_cell("better") and "▲" in test_loss_cell("better")
    assert "**" not in rows["same"] and "**" not in rows["fedavg (baseline)"]
    assert "**" not in rows["better"].split("|")[6]  # accuracy is identical over runs: undecided, not marked
    assert "t over seeds" in rows["better"] and "48 · 96" in rows["better"]  # examples per seed, over 8 clients
    means = {lab: [float(np.mean(planted[lab][s])) for s in (0, 1, 2)] for lab in planted}
    p = {lab: stats.ttest_rel(means[lab], means["fedavg"]).pvalue for lab in ("better", "same")}
    holm_p = _holm_here(p)
    assert holm_p["better"] < 0.05 < holm_p["same"]
    text = report.read_text()
    found = text.split("## What is significant")[1].split("## Paired tests")[0]
    assert "**better** has a lower test loss than fedavg (better)" in found
    assert f"paired t p = {p['better']:.3g} (Holm {holm_p['better']:.3g})" in found
    assert "same vs fedavg on test loss" in found.split("Not significant")[1]
    assert "better vs fedavg on accuracy" in found.split("Undecided")[1]  # every run's accuracy identical
    assert "Wilcoxon" not in text and "client × seed pairs" not in found
    import csv

    values = list(csv.DictReader((report.parent / "run_values.csv").open()))
    mine = [float(v["value"]) for v in values if v["method"] == "better" and v["seed"] == "1" and v["metric"] == "test_loss"]
    assert mine == pytest.approx(list(planted["better"][1])) and "run_values.csv" in text  # the values behind it
    for png in ("test_loss_per_round.png", "test_loss_per_client.png", "communication_vs_test_loss.png"):
        assert (report.parent / png).stat().st_size > 5000 and f"]({png})" in text


def test_one_seed_is_undecided_however_many_clients_agree(tracking_uri, tmp_path):
    """One seed: eight clients 0.2 better are eight clients of one run, not eight runs — no p-value,
    nothing bold, the client difference shown as description only."""
    from fedsweep.reports.compare import compare

    _plant(tracking_uri, "planted_1", [0])
    report, table, _ = compare("planted_1", tracking_uri, str(tmp_path), "test_loss")
    assert "**" not in table and "bootstrap over clients" in table
    found = report.read_text().split("## What is significant")[1].split("## Paired tests")[0]
    assert "No difference is significant" in found
    assert "better vs fedavg on test loss (fewer than 3 runs a row; client pairs: -0.2" in found.split("Undecided")[1]


def test_clients_significant_runs_not_is_not_marked(tracking_uri, tmp_path):
    """The regime the run as the unit exists for: within each run every client moves the same way (a
    client × seed signed-rank test, computed here with scipy, is far below 0.01), but the runs disagree
    (−0.5, −0.4, +0.3): the report marks nothing, and the study's question says not detected."""
    from scipy import stats

    from fedsweep.reports.compare import compare, paired_tests, collect
    from fedsweep.reports.question import answer
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient

    jitter = np.linspace(-0.01, 0.01, 8)
    shifts = {"mixed": {0: -0.5 + jitter, 1: -0.4 + jitter, 2: 0.3 + jitter}}
    planted = _plant(tracking_uri, "planted_mixed", [0, 1, 2], shifts)
    client_d = np.concatenate([planted["mixed"][s] - planted["fedavg"][s] for s in (0, 1, 2)])
    assert stats.wilcoxon(client_d).pvalue < 0.01  # what the client-level test said
    run_d = [float(np.mean(planted["mixed"][s] - planted["fedavg"][s])) for s in (0, 1, 2)]
    p_runs = stats.ttest_1samp(run_d, 0.0).pvalue
    assert p_runs > 0.3
    report, table, _ = compare("planted_mixed", tracking_uri, str(tmp_path), "test_loss")
    assert "**" not in table
    text = report.read_text()
    assert f"mixed vs fedavg on test loss (difference {np.mean(run_d):+.3g}, p = {p_runs:.2g}" in text
    rows, _ = collect(MlflowClient(tracking_uri=tracking_uri), "planted_mixed", "test_loss")
    tests = paired_tests(rows, ["test_loss"], "fedavg", 0.05)
    q = {"text": "Does mixed win?", "metric": "test_loss", "rows": ["mixed"]}
    lines = answer(q, {t.label: t for t in tests}, 0.05, lower_is_better=True)
    assert "**mixed: not detected**" in lines[2] and f"p = {p_runs:.2g}" in lines[2]


def test_report_without_the_baseline_marks_nothing(tracking_uri, tmp_path):
    from fedsweep.reports.compare import compare

    _plant(tracking_uri, "planted_nobase", [0])
    report, table, _ = compare("planted_nobase", tracking_uri, str(tmp_path), "test_loss", baseline="scaffold")
    assert "**" not in table and "No run is labelled 'scaffold'" in report.read_text()


def test_a_studys_question_is_answered_row_by_row_with_the_run_as_the_unit():
    """yes / no, the opposite / not detected (with the detectable effect) / undecided (one seed: client
    pairs only described) / not tested, read off compare's own tests and checked against scipy's paired
    t and Holm computed here; for a metric where lower is better and one where higher is."""
    from scipy import stats

    from fedsweep.reports.compare import RunRow, paired_tests
    from fedsweep.reports.question import answer

    base = [2.0, 2.4, 2.1, 2.6]
    shift = {"local": [-0.3 + e for e in (0.01, -0.02, 0.0, 0.015)],
             "drift": [0.25 + e for e in (0.02, 0.0, -0.01, 0.01)],
             "pfedgpt": [0.1, -0.2, 0.05, -0.1]}
    clients = np.array([-0.1, 0.0, 0.1])  # three clients around each run's value

    def row(label, seed, value):
        per = value + clients
        return RunRow(f"{label}{seed}", label, str(seed), {"test_loss": float(per.mean()), "accuracy": float(-per.mean())},
                      {}, {"seed": str(seed)}, {}, {"test_loss": dict(enumerate(per)), "accuracy": dict(enumerate(-per))})

    rows = [row("fedavg", s, b) for s, b in enumerate(base)]
    rows += [row(lab, s, b + d) for lab, ds in shift.items() for s, (b, d) in enumerate(zip(base, ds))]
    rows += [row("fedcofit", 0, base[0] - 0.133)]  # one seed
    tests = {t.label: t for t in paired_tests(rows, ["test_loss"], "fedavg", 0.05)}
    q = {"text": "Do personal models win?", "metric": "test_loss", "rows": ["local", "drift", "pfedgpt", "fedcofit", "flora"]}
    lines = answer(q, tests, 0.05, lower_is_better=True)
    by_row = {x.split("**")[1].split(":")[0]: x for x in lines if x.startswith("- **")}
    runs = {r: ([b + d for b, d in zip(base, shift[r])], base) for r in shift}
    p = {r: stats.ttest_rel(*runs[r]).pvalue for r in shift}
    holm_p = _holm_here(p)  # Holm over the three rows tested at the run level
    assert holm_p["local"] < 0.05 and holm_p["drift"] < 0.05 and holm_p["pfedgpt"] > 0.05
    assert ": yes**" in by_row["local"] and "over 4 runs" in by_row["local"]
    assert f"Holm {holm_p['local']:.2g}" in by_row["local"] and f"p = {p['local']:.2g}" in by_row["local"]
    assert ": no, the opposite**" in by_row["drift"]
    d = np.array(shift["pfedgpt"])
    effect = (stats.t.ppf(1 - 0.05 / 3 / 2, 3) + stats.t.ppf(0.8, 3)) * d.std(ddof=1) / 2
    assert ": not detected**" in by_row["pfedgpt"] and f"{effect:.3g}" in by_row["pfedgpt"]
    assert ": undecided**" in by_row["fedcofit"] and "fewer than 3 runs a row" in by_row["fedcofit"]
    assert "description only: fedcofit − fedavg = -0.133 averaged over 3 client × seed pairs" in by_row["fedcofit"]
    assert "not tested (the row did not run" in by_row["flora"]
    assert lines[-1] == ("Answer: yes for local; no, the opposite for drift; not detected for pfedgpt; "
                         "undecided for fedcofit; not tested for flora.")
    # higher is better: local's accuracy is higher — yes again, read off the accuracy tests
    acc_tests = {t.label: t for t in paired_tests(rows, ["accuracy"], "fedavg", 0.05)}
    acc = answer({**q, "metric": "accuracy", "rows": ["local", "drift"]}, acc_tests, 0.05, lower_is_better=False)
    assert ": yes**" in acc[2] and ": no, the opposite**" in acc[3]
