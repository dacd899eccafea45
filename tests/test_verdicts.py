"""The reproduction cards' verdict logic against hand-computed cases (exact Wilcoxon p-values of
one-signed samples are 2/2ⁿ; t quantiles from tables), and the refusal to pair clients that do
not hold the same data."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedsweep.errors import ConfigError
from fedsweep.orchestrator.reports import verdicts as vd
from fedsweep.orchestrator.reports.pairing import data_signature
from fedsweep.orchestrator.reproduce import RowValues, paired_values


def _decide(outcomes, diffs=None, values=None, bounds=None, higher=None):
    return vd.decide(outcomes, diffs or {}, values or {}, bounds or {}, 0.05, higher)


def test_minimum_detectable_effect_by_hand():
    """n = 10, s = 1, one hypothesis: (t_.975,9 + t_.80,9) · 1/√10 · √(π/3) =
    (2.262157 + 0.883404) · 0.316228 · 1.023327 = 1.01792; two-sample, n = 10 + 10, s = 1:
    (2.100922 + 0.862049) · √0.2 · 1.023327 = 1.35599."""
    d = np.array([1.0, -1.0] * 5)
    d = d / d.std(ddof=1)  # s = 1 exactly
    assert vd.mde(d, 0.05, 1) == pytest.approx(1.01792, rel=1e-5)
    a, b = np.array([1.0, -1.0] * 5), np.array([2.0, 0.0] * 5)
    a, b = a / a.std(ddof=1), (b - 1) / b.std(ddof=1)
    assert vd.mde_unpaired(a, b, 0.05, 1) == pytest.approx(1.35599, rel=1e-5)
    assert vd.mde(d, 0.05, 2) > vd.mde(d, 0.05, 1)  # Holm's first step: α/m


def test_one_signed_samples_give_the_exact_wilcoxon_p_and_the_verdict_follows_the_sign():
    up = np.arange(1.0, 11.0)  # ten positive differences: p = 2/2^10
    o = vd.paired("h", "greater", up, np.zeros(10))
    assert o.p == pytest.approx(2 / 1024)
    assert _decide([o], {"h": up})[0].verdict == vd.REPRODUCED
    o = vd.paired("h", "less", up, np.zeros(10))
    assert _decide([o], {"h": up})[0].verdict == vd.CONTRADICTED
    five = np.arange(1.0, 6.0)  # p = 2/32 = 0.0625: cannot be significant
    o = _decide([vd.paired("h", "greater", five, np.zeros(5))], {"h": five})[0]
    assert o.p == pytest.approx(0.0625) and o.verdict == vd.NOT_DETECTED
    assert o.mde == pytest.approx(vd.mde(five, 0.05, 1))


def test_holm_within_the_card_decides_significance():
    """p = 2/2^7 and 2/2^6 adjust to 0.03125 and 0.03125 (both reproduced); with 2/2^5 the pair
    adjusts to 0.0625 and 0.0625 (neither)."""
    def case(n1, n2):
        d1, d2 = np.arange(1.0, n1 + 1), np.arange(1.0, n2 + 1)
        out = [vd.paired("a", "greater", d1, np.zeros(n1)), vd.paired("b", "greater", d2, np.zeros(n2))]
        return _decide(out, {"a": d1, "b": d2})

    both = case(7, 6)
    assert [o.p_holm for o in both] == pytest.approx([0.03125, 0.03125])
    assert {o.verdict for o in both} == {vd.REPRODUCED}
    neither = case(6, 5)
    assert [o.p_holm for o in neither] == pytest.approx([0.0625, 0.0625])
    assert {o.verdict for o in neither} == {vd.NOT_DETECTED}


def test_not_worse_within_a_margin_and_worse_beyond_it():
    """Test loss (lower is better), margin 0.1: worse by 0.01 everywhere is within the margin
    (one-sided p = 1/2^10: reproduced); worse by 0.5 everywhere is significantly worse (contradicted);
    mixed small differences decide nothing."""
    base = np.full(10, 3.0)
    o = vd.paired("h", "not_worse", base + 0.01, base, margin=0.1, higher_is_better=False)
    assert o.p == pytest.approx(1 / 1024)
    assert _decide([o], {"h": np.full(10, 0.01)}, higher={"h": False})[0].verdict == vd.REPRODUCED
    o = vd.paired("h", "not_worse", base + 0.5, base, margin=0.1, higher_is_better=False)
    assert _decide([o], {"h": np.full(10, 0.5)}, higher={"h": False})[0].verdict == vd.CONTRADICTED
    noisy = np.array([0.3, -0.3, 0.2, -0.25, 0.15, -0.1])
    o = vd.paired("h", "not_worse", base[:6] + noisy, base[:6], margin=0.1, higher_is_better=False)
    assert _decide([o], {"h": noisy}, higher={"h": False})[0].verdict == vd.NOT_DETECTED


def test_thresholds_by_their_interval():
    """Bytes ratio ≥ 100: [150, 160, 155] is wholly above (reproduced), [40, 45, 50] wholly below
    (contradicted), [60, 200] straddles (not detected); time share ≤ 0.05 likewise."""
    for vals, kind, bound, want in [([150, 160, 155], "at_least", 100, vd.REPRODUCED),
                                    ([40, 45, 50], "at_least", 100, vd.CONTRADICTED),
                                    ([60, 200], "at_least", 100, vd.NOT_DETECTED),
                                    ([0.01, 0.02, 0.015], "at_most", 0.05, vd.REPRODUCED),
                                    ([0.2, 0.25, 0.22], "at_most", 0.05, vd.CONTRADICTED)]:
        x = np.asarray(vals, dtype=float)
        o = _decide([vd.threshold("h", kind, x, bound)], values={"h": x}, bounds={"h": bound})[0]
        assert o.verdict == want, (vals, kind)
    one = np.array([120.0])
    o = _decide([vd.threshold("h", "at_least", one, 100)], values={"h": one}, bounds={"h": 100})[0]
    assert o.verdict == vd.REPRODUCED and "one trial" in " ".join(o.notes)


def test_unpaired_rows_use_mann_whitney():
    from scipy import stats

    a, b = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), np.array([7.0, 8.0, 9.0, 10.0, 11.0, 12.0])
    o = vd.unpaired("h", "less", a, b)
    assert o.p == pytest.approx(stats.mannwhitneyu(a, b, alternative="two-sided").pvalue)
    assert o.estimate == pytest.approx(-6.0) and o.low < -6.0 < o.high
    assert _decide([o], {"h": (a, b)})[0].verdict == vd.REPRODUCED  # p = 2/924 < 0.05


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
    from fedsweep.orchestrator.reports.compare import RunRow, paired_tests, unpaired_rows

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
    its sweep; a budget giving both forms is refused in one line."""
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
                            "treatment": "a", "baseline": "b"}],
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
    rows = set(shipped.budgets["cpu"].study["variants"])
    assert len(rows) == 44 and all({h.treatment, h.baseline} <= rows for h in shipped.hypotheses)


def test_a_ratio_threshold_per_client_takes_each_clients_own_ratio():
    """unit: client — the ratio baseline/treatment client by client over (seed, client) pairs: with
    two seeds of three clients, six ratios (10, 20, 30 twice) whose 99 % t-interval (Bonferroni over
    the card's two hypotheses: 1 − 0.05/2 two-sided → t(0.9875, 5) = 3.1634) is 20 ± 3.1634 · s/√6 with
    s = √80 (hand-computed): 20 − 11.55 = 8.45 clears 5, so reproduced; the run-level ratio of two seeds could not
    (one degree of freedom: t(0.9875, 1) = 25.45)."""
    from types import SimpleNamespace

    from fedsweep.config.card import Card
    from fedsweep.orchestrator.reproduce import judge

    def row(label, seed, per_client, run_value):
        return SimpleNamespace(label=label, seed=seed, params={"data.tasks": "[a]"},
                               per_client={"bytes_per_round": per_client}, final={"bytes_per_round": run_value},
                               run_metrics={})

    rows = [row("heavy", s, {0: 10.0, 1: 20.0, 2: 30.0}, 60.0 + int(s)) for s in ("0", "1")]
    rows += [row("light", s, {0: 1.0, 1: 1.0, 2: 1.0}, 3.0 + 3 * int(s)) for s in ("0", "1")]
    hyp = {"paper": "T", "claim": "c", "metric": "bytes_per_round", "kind": "at_least", "treatment": "light",
           "baseline": "heavy", "ratio": True, "bound": 5}
    card = Card.model_validate({"card": "c", "version": 1, "paper": "p", "registered": "2026-11-26",
                                "hypotheses": [{**hyp, "id": "per_client", "unit": "client"}, {**hyp, "id": "per_run"}],
                                "budgets": {"cpu": {"differs": "d", "study": {"variants": {"heavy": {}, "light": {}}}}}})
    out = {o.id: o for o in judge(card, rows)}
    half95 = 2.5706 * math.sqrt(80) / math.sqrt(6)  # the reported 95 % interval; the decision's is wider
    assert out["per_client"].estimate == pytest.approx(20.0) and 20 - 3.1634 * math.sqrt(80 / 6) > 5
    assert (out["per_client"].low, out["per_client"].high) == pytest.approx((20 - half95, 20 + half95), abs=1e-3)
    assert out["per_client"].verdict == "reproduced" and out["per_client"].n == 6
    assert out["per_run"].n == 2 and out["per_run"].verdict == "not detected"  # ratios 20 and 10.17


def test_a_threshold_per_client_that_is_not_a_ratio_takes_each_clients_value():
    """unit: client without a ratio (pFedGPT's HBO share): the threshold is judged on the (seed,
    client) values themselves, not on each run's final value. Six values 0.1, 0.2, 0.3 twice: mean
    0.2, s = √0.008; with three hypotheses on the card the decision interval is
    0.2 ± t(1 − 0.05/6, 5) · s/√6 = 0.2 ± 3.5341 · 0.036515 = [0.0710, 0.3290] (hand-computed), so
    "at most 0.5" is reproduced, "at most 0.05" contradicted and "at most 0.25" not detected — where
    the run-level values (0.9 and 0.95) would contradict all three."""
    from types import SimpleNamespace

    from fedsweep.config.card import Card
    from fedsweep.orchestrator.reproduce import judge

    rows = [SimpleNamespace(label="m", seed=s, params={"data.tasks": "[a]"},
                            per_client={"share": {0: 0.1, 1: 0.2, 2: 0.3}}, final={"share": run},
                            run_metrics={}) for s, run in (("0", 0.9), ("1", 0.95))]
    hyp = {"paper": "T", "claim": "c", "metric": "share", "kind": "at_most", "treatment": "m", "unit": "client"}
    card = Card.model_validate({"card": "c", "version": 1, "paper": "p", "registered": "2026-11-26",
                                "hypotheses": [{**hyp, "id": "half", "bound": 0.5}, {**hyp, "id": "tiny", "bound": 0.05},
                                               {**hyp, "id": "quarter", "bound": 0.25}],
                                "budgets": {"cpu": {"differs": "d", "study": {"variants": {"m": {}}}}}})
    out = {o.id: o for o in judge(card, rows)}
    assert all(o.n == 6 and o.estimate == pytest.approx(0.2) for o in out.values())
    assert 0.2 - 3.5341 * math.sqrt(0.008 / 6) == pytest.approx(0.0710, abs=1e-4)
    assert (out["half"].verdict, out["tiny"].verdict, out["quarter"].verdict) == \
        ("reproduced", "contradicted", "not detected")
