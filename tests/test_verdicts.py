"""The reproduction cards' verdict logic with the run (seed) as the unit, against hand-computed cases
and scipy's own tests (t quantiles from tables); planted data where clients look significant but runs
do not; Holm over every hypothesis, thresholds included; not_worse against its margin; the refusal of
thresholds decided on too few runs and of pairing clients that do not hold the same data;
``--verify`` recomputing a report from its CSV."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from fedsweep.errors import ConfigError
from fedsweep.reports import verdicts as vd
from fedsweep.reports.run_values import RowValues, paired_values
from fedsweep.reproduce.card_units import group, judge, run_level
from fedsweep.reports.pairing import data_signature


def _card(hypotheses, variants):
    from fedsweep.config.card import Card

    hypotheses = [{"role": "claim", "effect": 0.1, "effect_basis": "a reason stated for the test", **h}
                  for h in hypotheses]
    return Card.model_validate({"card": "c", "version": 1, "paper": "p", "registered": "2026-11-27",
                                "hypotheses": hypotheses,
                                "budgets": {"cpu": {"differs": "d", "study": {"variants": {v: {} for v in variants}}}}})


def _runs(units):
    """The per-run values the tests took, derived from the (run, client) rows as the card does."""
    return [r for rows in group(units).values() for r in run_level(rows)]


def _row(label, seed, metric, per_client, final=None):
    return SimpleNamespace(label=label, seed=str(seed), params={"data.tasks": "[a]"},
                           per_client={metric: dict(per_client)}, final={metric: final} if final is not None else {},
                           run_metrics={})


def test_minimum_detectable_effect_by_hand():
    """n = 10, s = 1, one hypothesis: (t_.975,9 + t_.80,9) · 1/√10 = (2.262157 + 0.883404) · 0.316228
    = 0.994718; with m = 2 Holm's first step uses α/2 and needs more."""
    d = np.array([1.0, -1.0] * 5)
    d = d / d.std(ddof=1)  # s = 1 exactly
    assert vd.mde(d, 0.05, 1) == pytest.approx(0.994718, rel=1e-5)
    assert vd.mde(d, 0.05, 2) > vd.mde(d, 0.05, 1)
    assert vd.mde([1.0], 0.05, 1) == math.inf


def test_paired_runs_by_hand_and_against_scipy():
    """Differences 1, 2, 3, 2, 1.5: mean 1.9, s² = 2.2/4 = 0.55, SE = 0.331662, t = 5.72872 on 4 df:
    two-sided p = 0.004597 (scipy's ttest_1samp agrees); the 95 % interval 1.9 ± 2.776445 · SE."""
    from scipy import stats

    d = np.array([1.0, 2.0, 3.0, 2.0, 1.5])
    o = vd.decide([vd.paired("h", "greater", d + 5.0, np.full(5, 5.0))])[0]
    assert (o.n, o.estimate, o.se, o.df) == (5, pytest.approx(1.9), pytest.approx(0.331662, rel=1e-5), 4)
    assert o.p == pytest.approx(0.004597, rel=1e-3) and o.p == pytest.approx(stats.ttest_1samp(d, 0).pvalue)
    assert (o.low, o.high) == pytest.approx((1.9 - 2.776445 * 0.331662, 1.9 + 2.776445 * 0.331662), rel=1e-5)
    assert o.verdict == vd.REPRODUCED and o.unit == vd.UNIT and o.mde is None
    assert vd.decide([vd.paired("h", "less", d, np.zeros(5))])[0].verdict == vd.CONTRADICTED
    five = vd.decide([vd.paired("h", "greater", np.arange(1.0, 6.0), np.zeros(5))])[0]
    assert five.p < 0.0625 and five.verdict == vd.REPRODUCED  # five runs can decide (a signed-rank test could not)


def test_clients_significant_but_runs_not_is_not_detected():
    """Planted pseudo-replication: three runs of 20 clients; each run's clients share its effect
    (+0.5, +0.4, −0.1) up to ±0.01. Over the 60 (seed, client) pairs the signed-rank test is highly
    significant; over the 3 runs t = 0.2667 / (0.3215/√3) = 1.437 on 2 df, p = 0.29: not detected where
    the card's smallest effect of interest (1.5) was within reach, undecided where it (0.5) was not."""
    from scipy import stats

    gen = np.random.default_rng(0)
    effects = {0: 0.5, 1: 0.4, 2: -0.1}
    rows = []
    for seed, effect in effects.items():
        noise = gen.uniform(-0.01, 0.01, 20)
        rows.append(_row("base", seed, "test_loss", {c: 3.0 for c in range(20)}))
        rows.append(_row("treat", seed, "test_loss", {c: 3.0 + effect + noise[c] for c in range(20)}))
    card = _card([{"id": "h", "paper": "T", "claim": "c", "metric": "test_loss", "kind": "greater",
                   "treatment": "treat", "baseline": "base", "effect": 1.5}], ["treat", "base"])
    outcomes, units = judge(card, rows)
    (o,) = outcomes
    small = _card([{"id": "h", "paper": "T", "claim": "c", "metric": "test_loss", "kind": "greater",
                    "treatment": "treat", "baseline": "base", "effect": 0.5}], ["treat", "base"])
    (u,), _ = judge(small, rows)  # the runs could not have detected 0.5: undecided at this budget
    assert u.verdict == vd.UNDECIDED and u.mde == pytest.approx(o.mde) and 0.5 < u.mde < 1.5
    a, b = paired_values(*(RowValues({(r.seed, c): v for r in rows if r.label == lab
                                      for c, v in r.per_client["test_loss"].items()}, {}, {}) for lab in ("treat", "base")),
                         "h")
    assert len(a) == 60 and stats.wilcoxon(np.subtract(a, b)).pvalue < 1e-4  # the clients would "show" it
    assert o.n == 3 and o.p == pytest.approx(0.29, abs=0.01) and o.verdict == vd.NOT_DETECTED
    assert o.mde > 0.5 and any("description" in n for n in o.notes)
    assert [u["seed"] for u in _runs(units)] == ["0", "1", "2"] and len(units) == 60  # a row per (run, client)
    assert [u["value"] for u in _runs(units)] == pytest.approx([0.5, 0.4, -0.1], abs=0.01)


def test_not_worse_is_contradicted_only_beyond_the_margin():
    """Test loss (lower is better), margin 0.1. Worse by 0.04–0.06 in every run: significantly worse
    than 0 (the old rule's "contradicted") but significantly within the margin: reproduced. Worse by
    0.3 everywhere: contradicted. Differences around the margin itself: not detected."""
    from scipy import stats

    base = np.full(5, 3.0)
    within = np.array([0.04, 0.05, 0.06, 0.05, 0.05])
    assert stats.ttest_1samp(within, 0).pvalue < 0.001
    o = vd.decide([vd.paired("h", "not_worse", base + within, base, margin=0.1, higher_is_better=False)])[0]
    assert o.verdict == vd.REPRODUCED and o.reference == 0.1 and o.estimate == pytest.approx(0.05)
    assert o.p == pytest.approx(stats.ttest_1samp(within - 0.1, 0).pvalue)
    beyond = vd.decide([vd.paired("h", "not_worse", base + 0.3 + within - 0.05, base, margin=0.1,
                                  higher_is_better=False)])[0]
    assert beyond.verdict == vd.CONTRADICTED
    around = vd.decide([vd.paired("h", "not_worse", base + np.array([0.0, 0.2, 0.1, 0.15, 0.05]), base,
                                  margin=0.1, higher_is_better=False)])[0]
    assert around.verdict == vd.NOT_DETECTED
    # accuracy (higher is better): 0.02 lower than the baseline is within a 0.05 margin
    acc = vd.decide([vd.paired("h", "not_worse", base - within / 2.5, base, margin=0.05)])[0]
    assert acc.reference == -0.05 and acc.verdict == vd.REPRODUCED


def test_fewer_than_three_runs_or_no_spread_is_undecided():
    """No p-value from one or two runs, or from runs whose values are all the same (a zero spread once
    read as p = 0): undecided, outside Holm's family, so the others keep their level."""
    one, two = vd.threshold("h1", "at_least", [120.0], 100), vd.threshold("h2", "at_least", [120.0, 130.0], 100)
    flat = vd.paired("h3", "less", [1.0, 1.5, 2.0], [1.2, 1.7, 2.2])  # −0.2 each, up to rounding
    flat_exact = vd.paired("h4", "less", [1.0, 2.0, 3.0], [1.5, 2.5, 3.5])  # −0.5 exactly in binary
    clear = vd.paired("h5", "less", [1.0, 2.0, 3.0, 4.0], [1.6, 2.5, 3.7, 4.4])
    assert flat.se > 0  # 1.0 − 1.2 and 2.0 − 2.2 differ in the last bits: a t statistic of ~1e15
    out = {o.id: o for o in vd.decide([one, two, flat, flat_exact, clear])}
    for hid in ("h1", "h2", "h3", "h4"):
        assert out[hid].verdict == vd.UNDECIDED and math.isnan(out[hid].p) and math.isnan(out[hid].p_holm)
    assert "a test needs 3" in out["h1"].notes[0] and "no spread" in out["h4"].notes[0]
    from scipy import stats

    assert out["h5"].p_holm == pytest.approx(stats.ttest_rel([1.0, 2.0, 3.0, 4.0], [1.6, 2.5, 3.7, 4.4]).pvalue)
    rows = [_row("m", s, "share", {0: 0.1}, final=0.1) for s in (0, 1)]
    card = _card([{"id": "h", "paper": "T", "claim": "c", "metric": "share", "kind": "at_most", "bound": 0.5,
                   "treatment": "m"}], ["m"])
    (o,), _ = judge(card, rows)
    assert o.verdict == vd.UNDECIDED and o.n == 2


def test_thresholds_by_t_over_runs():
    for vals, kind, bound, want in [([150, 160, 155], "at_least", 100, vd.REPRODUCED),
                                    ([40, 45, 50], "at_least", 100, vd.CONTRADICTED),
                                    ([60, 200, 120], "at_least", 100, vd.NOT_DETECTED),
                                    ([0.01, 0.02, 0.015], "at_most", 0.05, vd.REPRODUCED),
                                    ([0.2, 0.25, 0.22], "at_most", 0.05, vd.CONTRADICTED)]:
        o = vd.decide([vd.threshold("h", kind, np.asarray(vals, dtype=float), bound)])[0]
        assert o.verdict == want, (vals, kind)


def test_holm_counts_every_hypothesis_thresholds_included():
    """A paired hypothesis with p = 0.037 (t = 3.597 on 3 df) alone is reproduced; in a card beside a
    threshold (p ≈ 1e-4) and a flat one, Holm's second step multiplies it by 2: 0.074, not detected.
    Leaving the threshold out of the family (the old rule) would have kept it."""
    d = np.array([0.5, 1.2, 0.3, 0.9])
    alone = vd.decide([vd.paired("p", "greater", d, np.zeros(4))])[0]
    assert alone.p == pytest.approx(0.0368, abs=5e-4) and alone.verdict == vd.REPRODUCED
    thr = vd.threshold("t", "at_least", [150.0, 151.0, 152.0], 100)
    flat = vd.paired("z", "greater", np.array([0.1, -0.1, 0.05, -0.04]), np.zeros(4))
    family = vd.decide([vd.paired("p", "greater", d, np.zeros(4)), thr, flat])
    assert family[0].p_holm == pytest.approx(2 * alone.p) and family[0].verdict == vd.NOT_DETECTED
    assert family[1].verdict == vd.REPRODUCED and family[1].p_holm == pytest.approx(3 * thr.p)
    lo, hi = family[0].decision_low, family[0].decision_high  # at level 1 − α/3: wider than the 95 % one
    assert lo < family[0].low and hi > family[0].high


def test_unpaired_rows_use_welch_over_runs():
    from scipy import stats

    a, b = np.array([1.0, 2.0, 3.0, 4.0]), np.array([7.0, 8.5, 9.0, 10.0])
    o = vd.decide([vd.unpaired("h", "less", a, b)])[0]
    assert o.p == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue)
    assert o.estimate == pytest.approx(a.mean() - b.mean()) and o.low < o.estimate < o.high
    assert o.verdict == vd.REPRODUCED and o.test.startswith("Welch")


def test_verify_recomputes_a_report_from_its_csv_and_finds_a_changed_value(tmp_path):
    from fedsweep.reproduce import card_report
    from fedsweep.reproduce.card_units import to_csv

    rows = []
    for seed, effect in enumerate([0.3, 0.5, 0.4, 0.45]):
        rows.append(_row("base", seed, "test_loss", {0: 3.0, 1: 2.5}))
        rows.append(_row("treat", seed, "test_loss", {0: 3.0 - effect, 1: 2.5 - effect / 2}))
        rows.append(_row("light", seed, "bytes", {0: 1.0, 1: 2.0}))
        rows.append(_row("heavy", seed, "bytes", {0: 100.0 + seed, 1: 210.0}))
    card = _card([{"id": "better", "paper": "T", "claim": "c", "metric": "test_loss", "kind": "less",
                   "treatment": "treat", "baseline": "base"},
                  {"id": "fewer", "paper": "T", "claim": "c", "metric": "bytes", "kind": "at_least", "bound": 50,
                   "treatment": "light", "baseline": "heavy", "ratio": True, "unit": "client"},
                  {"id": "same", "paper": "T", "claim": "c", "metric": "test_loss", "kind": "not_worse",
                   "margin": 0.5, "treatment": "treat", "baseline": "base", "role": "arithmetic"}],
                 ["treat", "base", "light", "heavy"])
    outcomes, units = judge(card, rows)
    card_file = tmp_path / "card.yaml"
    card_file.write_text("card: c\n")
    text = card_report.report(card, "cpu", outcomes, 1.0, "fedsweep reproduce c",
                              card_report.provenance(card_file, [card_file]))
    assert "decision interval" in text and "run (seed)" in text and "paired t over runs" in text
    assert "| same *(arithmetic)*: c |" in text and "| better *(claim)*: c |" in text  # roles counted apart
    assert "Verdicts by role: quality claims 2 (2 reproduced); arithmetic checks 1 (1 reproduced)." in text
    report = tmp_path / "cpu-v1.md"
    report.write_text(text)
    report.with_suffix(".csv").write_text(to_csv(units))
    assert card_report.verify(report) == []
    assert [o.verdict for o in outcomes] == ["reproduced", "reproduced", "reproduced"]
    from fedsweep.cli import main

    assert main(["reproduce", "--verify", str(report)]) == 0
    for column in ("value", "treatment"):  # a tested value changed, or the run mean it came from
        changed = to_csv(units).replace(repr(units[0][column]), repr(units[0][column] + 0.2), 1)
        report.with_suffix(".csv").write_text(changed)
        assert any(p.startswith("better") for p in card_report.verify(report)), column
    report.with_suffix(".csv").write_text(to_csv(units))
    report.write_text(text.replace('"verdict": "reproduced"', '"verdict": "not detected"', 1))
    assert any("verdict" in p for p in card_report.verify(report))
    assert main(["reproduce", "--verify", str(report)]) == 1
    old = tmp_path / "old.md"
    old.write_text("# an old report\n")
    old.with_suffix(".csv").write_text(to_csv(units))
    with pytest.raises(ConfigError, match="no provenance block"):
        card_report.verify(old)


def test_clients_on_different_data_are_not_paired():
    same = {"data.tasks": "['a', 'b']", "partition.scheme": "task", "seed": "0", "algorithm": "x"}
    iid = {**same, "partition.scheme": "iid"}
    assert data_signature(same) == data_signature({**same, "algorithm": "y", "drift.delta": "0.2"})
    assert data_signature(same) != data_signature(iid)
    t = RowValues({("0", 0): 1.0, ("0", 1): 2.0}, {"0": data_signature(same)}, [])
    b = RowValues({("0", 0): 1.5, ("0", 1): 2.5}, {"0": data_signature(same)}, [])
    assert paired_values(t, b, "h") == ([1.0, 2.0], [1.5, 2.5])
    other = RowValues(b.per_client, {"0": data_signature(iid)}, [])
    with pytest.raises(ConfigError, match="different data") as err:
        paired_values(t, other, "hypothesis h")
    assert "\n" not in str(err.value) and "partition.scheme" in str(err.value)
    assert math.isfinite(vd.mde([0.1, 0.2, 0.3], 0.05, 3))


def test_compare_does_not_pair_rows_whose_clients_hold_other_data():
    """``fedsweep compare``: a row on an iid split is not tested client by client against a baseline on
    a task split (the report says why); rows on the same split are."""
    from fedsweep.reports.compare import RunRow, paired_tests, unpaired_rows

    def row(label, scheme, seed, values):
        params = {"partition.scheme": scheme, "data.tasks": "['a', 'b']", "clients.num_clients": "3", "seed": seed}
        return RunRow(label, label, seed, {"test_loss": float(np.mean(values))}, {}, params, {},
                      {"test_loss": dict(enumerate(values))})

    rows = [row("fedavg", "task", "0", [3.0, 2.0, 1.0]), row("local", "task", "0", [2.0, 1.0, 0.5]),
            row("local_iid", "iid", "0", [2.5, 2.4, 2.6])]
    tests = paired_tests(rows, ["test_loss"], "fedavg", 0.05)
    assert [t.label for t in tests] == ["local"]
    (refused,) = unpaired_rows(rows, "fedavg")
    assert refused[:2] == ("local_iid", "fedavg") and "partition.scheme: iid vs task" in refused[2]


def test_a_card_whose_study_is_a_sweep_file_reads_it_and_refuses_both(tmp_path):
    """budgets.cpu.sweep: the sweep file (relative to the card) becomes the study, its experiment made
    absolute and its name/metric/mode left to the card; the shipped robustness card names only rows of
    its study: FedAvg's 13 rows of the shipped 40-row sweep, each with the sweep's settings but Krum's f
    (v5: 5 clients in one actor, so f = 1 where the sweep's 10 clients have f = 2), on the sweep's data
    and training with only the clients changed; a budget giving both forms is refused in one line."""
    import yaml

    from fedsweep.config.card import load_card
    from fedsweep.errors import ConfigError

    (tmp_path / "sweeps").mkdir()
    (tmp_path / "cards").mkdir()
    (tmp_path / "sweeps" / "s.yaml").write_text(yaml.safe_dump(
        {"name": "s", "experiment": "../exp.yaml", "variants": {"a": {"algorithm": "fedavg"}, "b": {"algorithm": "local"}},
         "seeds": [0], "metric": "accuracy", "mode": "max"}))
    card = {"card": "c", "version": 1, "paper": "p", "registered": "2026-11-26",
            "hypotheses": [{"id": "h", "paper": "T", "claim": "c", "metric": "test_loss", "kind": "less",
                            "treatment": "a", "baseline": "b", "role": "claim", "effect": 0.1,
                            "effect_basis": "a reason stated for the test"}],
            "budgets": {"cpu": {"differs": "d", "sweep": "../sweeps/s.yaml"}}}
    path = tmp_path / "cards" / "c.yaml"
    path.write_text(yaml.safe_dump(card))
    loaded, _ = load_card(str(path))
    study = loaded.budgets["cpu"].study
    assert study["experiment"] == str((tmp_path / "exp.yaml").resolve())
    assert set(study) == {"experiment", "variants", "seeds"} and loaded.budgets["cpu"].sweep == "../sweeps/s.yaml"
    card["hypotheses"][0]["baseline"] = "c_missing"
    path.write_text(yaml.safe_dump(card))
    with pytest.raises(ConfigError, match="names row 'c_missing'"):
        load_card(str(path))
    card["hypotheses"][0]["baseline"] = "b"
    card["budgets"]["cpu"]["study"] = study
    path.write_text(yaml.safe_dump(card))
    with pytest.raises(ConfigError, match="not both"):
        load_card(str(path))
    shipped, _ = load_card("configs/reproductions/robustness.yaml")
    study = shipped.budgets["cpu"].study
    rows = study["variants"]
    assert len(rows) == 13 and all({h.treatment, h.baseline} <= set(rows) for h in shipped.hypotheses)
    # FedAvg's rows of the shipped 40-row sweep (the card sets the algorithm once); v5 halves the clients
    sweep = yaml.safe_load(open("configs/sweeps/robustness.yaml"))
    clients = {"clients.num_clients=10": "clients.num_clients=5"}
    assert len(sweep["variants"]) == 40
    assert [clients.get(x, x) for x in sweep["set"]] + ["algorithm=fedavg"] == study["set"]
    for name, settings in rows.items():
        expected = {k: (1 if k == "server.robust.f" else v) for k, v in sweep["variants"][name].items()}
        assert expected == {"algorithm": "fedavg", **settings}, name


def _ratio_rows() -> list:
    """Three runs of a heavy and a light row: client ratios (10, 20, 30), (10, 20, 30), (5, 10, 15)."""
    rows = []
    for seed, scale in enumerate([1.0, 1.0, 0.5]):
        rows.append(_row("heavy", seed, "bytes_per_round", {0: 10.0 * scale, 1: 20.0 * scale, 2: 30.0 * scale},
                         final=60.0 * scale))
        rows.append(_row("light", seed, "bytes_per_round", {0: 1.0, 1: 1.0, 2: 1.0}, final=3.0))
    return rows


def test_a_ratio_threshold_per_client_averages_each_runs_client_ratios():
    """unit: client with a ratio — within each run the baseline/treatment ratio client by client, then
    the run's mean: runs of ratios (10, 20, 30), (10, 20, 30), (5, 10, 15) give 20, 20, 10 (by hand);
    at least 2: t = (16.667 − 2) / (5.7735/√3) = 4.40 on 2 df (scipy's test agrees): reproduced; a
    run-level ratio uses the runs' own values."""
    from scipy import stats

    rows = _ratio_rows()
    hyp = {"paper": "T", "claim": "c", "metric": "bytes_per_round", "kind": "at_least", "treatment": "light",
           "baseline": "heavy", "ratio": True, "bound": 2}
    card = _card([{**hyp, "id": "per_client", "unit": "client"}], ["heavy", "light"])
    (o,), units = judge(card, rows)
    assert [u["value"] for u in units] == pytest.approx([10.0, 20.0, 30.0] * 2 + [5.0, 10.0, 15.0])
    assert [u["value"] for u in _runs(units)] == pytest.approx([20.0, 20.0, 10.0])
    assert o.n == 3 and o.estimate == pytest.approx(50 / 3)
    assert o.p == pytest.approx(stats.ttest_1samp([18.0, 18.0, 8.0], 0).pvalue) and o.verdict == vd.REPRODUCED
    (run,), units = judge(_card([{**hyp, "id": "per_run"}], ["heavy", "light"]), rows)
    assert [u["value"] for u in units] == pytest.approx([20.0, 20.0, 10.0])  # 60/3, 60/3, 30/3: one row a run
    assert all(u["client"] is None for u in units)


def test_a_log_ratio_threshold_tests_each_runs_mean_client_log_ratio_against_the_bounds_log():
    """log: true — the same rows as above on the log scale: run values mean(ln 10, ln 20, ln 30) =
    ln(6000)/3 = 2.8999 (twice) and mean(ln 5, ln 10, ln 15) = ln(750)/3 = 2.2068 (by hand), tested
    against ln 2 = 0.6931 with a one-sample t (scipy agrees); the CSV's parameter is ln 2, its values
    check as logs, and a plain ratio's value in a log row is refused."""
    import math

    from scipy import stats

    from fedsweep.errors import ConfigError
    from fedsweep.reproduce.card_units import from_csv, inconsistent, to_csv

    rows = _ratio_rows()
    hyp = {"id": "log_ratio", "paper": "T", "claim": "c", "metric": "bytes_per_round", "kind": "at_least",
           "treatment": "light", "baseline": "heavy", "ratio": True, "log": True, "bound": 2, "unit": "client"}
    (o,), units = judge(_card([hyp], ["heavy", "light"]), rows)
    runs = [math.log(6000) / 3, math.log(6000) / 3, math.log(750) / 3]
    assert [u["value"] for u in _runs(units)] == pytest.approx(runs)
    assert {u["parameter"] for u in units} == {math.log(2)}
    assert o.reference == pytest.approx(math.log(2)) and o.estimate == pytest.approx(sum(runs) / 3)
    assert o.p == pytest.approx(stats.ttest_1samp([r - math.log(2) for r in runs], 0).pvalue)
    text = to_csv(units)
    assert inconsistent(text) == [] and from_csv(text)[0].p == pytest.approx(o.p)
    wrong = text.replace(repr(units[0]["value"]), "10.0", 1)
    assert inconsistent(wrong) and "log(baseline / treatment)" in inconsistent(wrong)[0]
    with pytest.raises((ConfigError, ValueError)):
        _card([{**hyp, "ratio": False}], ["heavy", "light"])


def test_a_threshold_per_client_that_is_not_a_ratio_takes_each_runs_mean():
    """unit: client without a ratio (pFedGPT's HBO share): each run's mean over its clients (0.2, 0.3,
    0.25), not the run's final value (0.9)."""
    rows = [_row("m", s, "share", {0: base - 0.1, 1: base, 2: base + 0.1}, final=0.9)
            for s, base in ((0, 0.2), (1, 0.3), (2, 0.25))]
    card = _card([{"id": "h", "paper": "T", "claim": "c", "metric": "share", "kind": "at_most", "bound": 0.5,
                   "treatment": "m", "unit": "client"}], ["m"])
    (o,), units = judge(card, rows)
    assert [u["value"] for u in _runs(units)] == pytest.approx([0.2, 0.3, 0.25]) and o.estimate == pytest.approx(0.25)
    assert o.verdict == vd.REPRODUCED


def test_a_report_says_when_its_methods_code_changed_since_it_ran(tmp_path):
    """``fedsweep reproduce --list``: a report at a commit older than its method's code is stale; the
    watched code is what the card's trials reach by imports (the methods its study rows run, and
    everything every trial's numbers go through: engine, actors, random streams, kernels, config
    defaults), less what moves no tested value; a report without a commit says so."""
    from fedsweep.reproduce import card_report

    card = _card([{"id": "h", "paper": "T", "claim": "c", "metric": "test_loss", "kind": "less",
                   "treatment": "a", "baseline": "b"}], ["a", "b"])
    card.budgets["cpu"].study["variants"] = {"a": {"algorithm": "drift"}, "b": {"algorithm": "fedavg"}}
    watched = card_report.method_paths(card)
    for must in ("fedsweep/engine/training.py", "fedsweep/models/stacked_lora.py", "fedsweep/federation/robust.py",
                 "fedsweep/data/partition.py", "fedsweep/algorithms/drift/plugin.py", "fedsweep/algorithms/fedavg.py",
                 # missed by the fixed list used before 2026-11-28:
                 "fedsweep/salts.py", "fedsweep/kernels/drift_fast.c", "fedsweep/actors/client_training.py",
                 "fedsweep/actors/server.py", "fedsweep/config/schema.py", "fedsweep/algorithms/base.py"):
        assert must in watched, must
    for never in ("fedsweep/algorithms/fedicu.py", "fedsweep/algorithms/pfedgpt/plugin.py",  # methods it does not run
                  "fedsweep/algorithms/__init__.py", "fedsweep/models/memory.py",
                  "fedsweep/cli/commands/reproduce.py", "fedsweep/reports/verdicts.py"):
        assert never not in watched, never
    import subprocess

    if subprocess.run(["git", "cat-file", "-e", "2d44558^{commit}"], capture_output=True).returncode != 0:
        pytest.skip("a shallow checkout: commit 2d44558 is not in it")
    # fedsweep/engine/optim.py was rewritten after 2d44558 (the flat buffers)
    assert "fedsweep/engine/optim.py" in card_report.changed_since("2d44558", ["fedsweep/engine"])
    assert card_report.changed_since("unknown", ["fedsweep/engine"]) is None
    assert card_report.changed_since("0" * 40, ["fedsweep/engine"]) is None  # not in this checkout
    report = tmp_path / "cpu-v1.md"
    report.write_text("# old\n")
    assert "written before reports carried their commit" in card_report.staleness(card, report)
    block = {"provenance": {"commit": "2d44558"}, "outcomes": []}
    report.write_text(f"# r\n\n{card_report.JSON_HEAD}\n\n```json\n{__import__('json').dumps(block)}\n```\n")
    assert "stale until re-run" in card_report.staleness(card, report)
    # the adapters' forward counts as the method's code: stacked LoRA changed after 31bc090 (the scale in B)
    if subprocess.run(["git", "cat-file", "-e", "dbd815d^{commit}"], capture_output=True).returncode == 0:
        changed = card_report.changed_since("31bc090", card_report.method_paths(card))
        assert "fedsweep/models/stacked_lora.py" in changed
        assert "fedsweep/models/memory.py" not in changed  # changed too, but the planner moves no number
        # the run's random streams were added after 2d44558; the fixed list before 2026-11-28 missed them
        assert "fedsweep/salts.py" in card_report.changed_since("2d44558", card_report.method_paths(card))


def test_the_watched_code_is_every_module_the_trials_import(tmp_path):
    """The import walk behind ``--list`` against the standard library's own (``modulefinder`` reads the
    compiled bytecode, nested functions included): every ``fedsweep`` module it finds from the
    trials' entry points and the card's methods is watched, less :data:`NOT_NUMERICS`; the plugin
    index, which imports every method, is not followed by either."""
    import modulefinder
    from pathlib import Path

    from fedsweep.reproduce import numerics_paths as npaths

    root = Path(__file__).resolve().parents[1]

    class OnlyFedsweep(modulefinder.ModuleFinder):
        def find_module(self, name, path, parent=None):
            full = f"{parent.__name__}.{name}" if parent else name
            if name != "__init__" and full != "fedsweep" and not full.startswith("fedsweep."):
                raise ImportError(full)  # outside fedsweep: not followed
            return super().find_module(name, path, parent)

        def load_module(self, fqname, fp, pathname, file_info):
            if fqname == "fedsweep.algorithms":  # the plugin index: registered, not followed
                m = self.add_module(fqname)
                m.__file__, m.__path__ = str(Path(pathname) / "__init__.py"), [pathname]
                return m
            return super().load_module(fqname, fp, pathname, file_info)

    finder = OnlyFedsweep(path=[str(root)])
    for start in (*npaths.ENTRY_POINTS, "fedsweep/algorithms/fedicu.py", "fedsweep/algorithms/pfedgpt/__init__.py"):
        finder.run_script(str(root / start))
    found = {Path(m.__file__).resolve().relative_to(root).as_posix() for m in finder.modules.values()
             if m.__file__ and Path(m.__file__).resolve().is_relative_to(root)}
    found = {f for f in found if f.startswith("fedsweep/") and not npaths._excluded(f)} - {npaths.PLUGIN_INDEX}
    watched = set(npaths.watched_files(["fedicu", "pfedgpt"], root))
    assert len(found) > 60 and found <= watched, sorted(found - watched)
    assert "fedsweep/algorithms/pfedgpt/bayesopt.py" in watched and "fedsweep/algorithms/drift/plugin.py" not in watched


def test_the_watched_code_is_followed_by_its_content_when_it_moves(tmp_path):
    """``--list`` compares what a file computes, not where it lies: a module moved to another package
    (its imports and docstring paths rewritten) and a function moved to another module are unchanged;
    a changed constant, a changed function body and a new function are changes."""
    import subprocess

    from fedsweep.reproduce.numerics_paths import changed_code

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    pkg = tmp_path / "fedsweep"
    (pkg / "old").mkdir(parents=True)
    (pkg / "old" / "rules.py").write_text('"""Rules, in fedsweep/old."""\nfrom fedsweep.old import helpers\n\n'
                                          'SCALE = 2\n\n\ndef double(x):\n    """Twice x."""\n    return SCALE * x\n\n\n'
                                          'def half(x):\n    return x / 2\n')
    (pkg / "old" / "helpers.py").write_text("def one():\n    return 1\n")
    (pkg / "kernel.c").write_text("int f(void) { return 1; }\n")
    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "before")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    (pkg / "new").mkdir()
    (pkg / "old" / "rules.py").rename(pkg / "new" / "rules.py")
    (pkg / "new" / "rules.py").write_text('"""Rules, now in fedsweep/new."""\nfrom fedsweep.new import helpers\n\n'
                                          'SCALE = 2\n\n\ndef double(x):\n    """Twice x (moved)."""\n    return SCALE * x\n')
    (pkg / "new" / "halves.py").write_text("import math\n\n\ndef half(x):\n    return x / 2\n")  # moved here
    assert changed_code(commit, ["fedsweep/new/rules.py", "fedsweep/new/halves.py", "fedsweep/old/helpers.py",
                                 "fedsweep/kernel.c"], tmp_path) == []
    assert changed_code(commit, ["fedsweep"], tmp_path) == []  # a folder: every file below it
    (pkg / "new" / "rules.py").write_text((pkg / "new" / "rules.py").read_text().replace("SCALE = 2", "SCALE = 3"))
    (pkg / "new" / "halves.py").write_text("def half(x):\n    return x * 0.5\n")
    (pkg / "old" / "helpers.py").write_text("def one():\n    return 1\n\n\ndef two():\n    return 2\n")
    (pkg / "kernel.c").write_text("int f(void) { return 2; }\n")
    assert changed_code(commit, ["fedsweep"], tmp_path) == ["fedsweep/kernel.c", "fedsweep/new/halves.py",
                                                            "fedsweep/new/rules.py", "fedsweep/old/helpers.py"]
    assert changed_code("0" * 40, ["fedsweep"], tmp_path) is None


def test_list_watches_the_card_and_its_configs_not_their_comments(tmp_path, monkeypatch):
    """``--list``: a report is stale where its card version's design (hypotheses, budgets, α) or an
    experiment file it ran on says something else than at its commit; a changed comment changes
    nothing; a report of an older version than the card's is superseded."""
    import json
    import subprocess

    import yaml

    from fedsweep.config.card import load_card
    from fedsweep.reproduce import card_report

    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, text=True).stdout  # noqa: E731
    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (tmp_path / "configs/reproductions/experiments").mkdir(parents=True)
    exp = tmp_path / "configs/reproductions/experiments/e.yaml"
    exp.write_text("# a comment\nname: e\nrounds: 3\n")
    card_file = tmp_path / "configs/reproductions/c.yaml"
    hyp = {"id": "h", "paper": "T", "claim": "c", "metric": "test_loss", "kind": "less", "treatment": "a",
           "baseline": "b", "role": "claim", "effect": 0.1, "effect_basis": "a stated reason here"}
    raw = {"card": "c", "version": 2, "paper": "p", "registered": "2026-11-28", "hypotheses": [hyp],
           "budgets": {"cpu": {"differs": "d", "study": {"experiment": "experiments/e.yaml",
                                                         "variants": {"a": {}, "b": {}}, "seeds": [0, 1, 2]}}}}
    card_file.write_text("# header\n" + yaml.safe_dump(raw))
    git("add", "-A")
    git("commit", "-qm", "c")
    commit = git("rev-parse", "HEAD").strip()
    monkeypatch.chdir(tmp_path)
    block = {"provenance": {"commit": commit, "card": str(card_file), "configs": {str(exp): "x"}}, "outcomes": []}
    report = tmp_path / "cpu-v2.md"
    report.write_text(f"# r\n\n{card_report.JSON_HEAD}\n\n```json\n{json.dumps(block)}\n```\n")
    card, _ = load_card(str(card_file))
    assert "card and configs unchanged since" in card_report.staleness(card, report)
    exp.write_text("# another comment\nname: e\nrounds: 3\n")
    card_file.write_text("# header, amended\n" + yaml.safe_dump(raw))
    assert "unchanged since" in card_report.staleness(card, report)
    exp.write_text("name: e\nrounds: 4\n")
    line = card_report.staleness(card, report)
    assert "stale until re-run" in line and "configs/reproductions/experiments/e.yaml" in line
    exp.write_text("name: e\nrounds: 3\n")
    # another budget (never run) added or changed: the cpu report tested nothing of it
    gpu = {"differs": "d", "study": {"experiment": "experiments/e.yaml", "variants": {"a": {}, "b": {}}, "seeds": [0, 1, 2]}}
    card_file.write_text(yaml.safe_dump({**raw, "budgets": {**raw["budgets"], "gpu-small": gpu}}))
    assert "unchanged since" in card_report.staleness(card, report)
    card_file.write_text(yaml.safe_dump({**raw, "budgets": {"cpu": {**raw["budgets"]["cpu"], "minutes": 9}}}))
    assert "stale until re-run" in card_report.staleness(card, report)  # its own budget changed
    card_file.write_text(yaml.safe_dump({**raw, "hypotheses": [{**hyp, "effect": 0.2}]}))
    line = card_report.staleness(card, report)
    assert "stale until re-run" in line and "configs/reproductions/c.yaml" in line
    older = tmp_path / "cpu-v1.md"
    older.write_text(report.read_text())
    assert "superseded by the card's version 2" in card_report.staleness(card, older)


def test_the_bitwise_check_compares_digests_less_wall_clock_seconds(tmp_path, capsys):
    """``fedsweep reproduce --bitwise``'s comparison: a checkpoint's tensors by name, dtype, shape and bytes
    (one bit of one value differing is a difference; the same values in another dtype are too), its JSON
    by content less keys that hold seconds; a trial on one side only or failed counts as a difference."""
    import torch
    from safetensors.torch import save_file

    from fedsweep.cli import main
    from fedsweep.reproduce.bitwise import compare, digests

    def round_folder(name, value, dtype=torch.float32, seconds=1.0):
        folder = tmp_path / name
        folder.mkdir()
        save_file({"a": torch.tensor([1.0, value], dtype=dtype)}, str(folder / "client_0.safetensors"))
        (folder / "server.json").write_text(f'{{"round": 2, "hbo": {{"fit_seconds": {seconds}, "pick": 3}}}}')
        return digests(folder)

    base = round_folder("base", 2.0)
    same = round_folder("same", 2.0, seconds=7.5)  # other wall-clock seconds: not compared
    flipped = round_folder("flip", float(torch.tensor(2.0).view(torch.int32).add(1).view(torch.float32)))
    wider = round_folder("wide", 2.0, torch.float64)
    assert base["server.json:timings"].startswith("not compared: hbo.fit_seconds")
    trials = lambda d: {"commit": "c", "trials": {"card/v/seed0": {"digests": d}}}  # noqa: E731
    assert compare(trials(base), trials(same)) == 0
    assert compare(trials(base), trials(flipped)) == 1 and compare(trials(base), trials(wider)) == 1
    assert compare(trials(base), {"commit": "c", "trials": {}}) == 1
    assert compare(trials(base), {"commit": "c", "trials": {"card/v/seed0": {"error": ["boom"]}}}) == 1
    out = capsys.readouterr().out
    assert "card/v/seed0: DIFFERS" in out and "client_0.safetensors:a" in out and "only in before" in out
    for name, d in (("x.json", base), ("y.json", flipped)):
        (tmp_path / name).write_text(__import__("json").dumps(trials(d)))
    assert main(["reproduce", "--bitwise", "--compare", str(tmp_path / "x.json"), str(tmp_path / "x.json")]) == 0
    assert main(["reproduce", "--bitwise", "--compare", str(tmp_path / "x.json"), str(tmp_path / "y.json")]) == 1
    assert main(["reproduce", "--bitwise"]) == 2  # neither --out nor --compare: one line, exit 2
