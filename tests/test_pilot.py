"""A card's pilot sizes its seeds: the runs each named effect needs, checked against the t
distribution directly and by simulating the card's own test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml
from scipy import stats

from fedsweep.config.card import Card
from fedsweep.reproduce import pilot
from fedsweep.reports import verdicts as vd


def detectable_effect(sd, n, alpha, m, power):
    """The detectable effect of a one-sample t over n runs, written out from scipy's t quantiles."""
    level = alpha / m
    return (stats.t.ppf(1 - level / 2, n - 1) + stats.t.ppf(power, n - 1)) * sd / math.sqrt(n)


@pytest.mark.parametrize("sd, effect, m", [(0.1, 0.2, 2), (0.074, 0.2, 2), (0.3, 0.2, 4), (1.0, 0.8, 48), (0.05, 1.0, 1)])
def test_runs_needed_is_the_fewest_runs_whose_detectable_effect_reaches_the_named_one(sd, effect, m):
    n = pilot.runs_needed(sd, effect, 0.05, m)
    assert detectable_effect(sd, n, 0.05, m, 0.8) <= effect
    if n > 2:
        assert detectable_effect(sd, n - 1, 0.05, m, 0.8) > effect


def test_the_premise_cards_sizing_five_runs_at_80_percent_six_at_90():
    """The premise card's v2 text: sd 0.1, effect 0.2, Holm's first level over 2 hypotheses."""
    assert pilot.runs_needed(0.1, 0.2, 0.05, 2, 0.80) == 5
    assert pilot.runs_needed(0.1, 0.2, 0.05, 2, 0.90) == 6


def test_at_the_sized_runs_the_cards_own_test_detects_the_effect_about_as_often_as_promised():
    """Simulate the card's test (``verdicts.paired`` then Holm with a null second hypothesis) at the
    size the pilot gives: it reaches α in ≥ 75 % of 2000 draws (the rule approximates the noncentral
    t's power; one run fewer falls short)."""
    rng = np.random.default_rng(0)
    sd, effect, m = 0.1, 0.2, 2
    n = pilot.runs_needed(sd, effect, 0.05, m)

    def hits(runs):
        count = 0
        for _ in range(2000):
            d = rng.normal(-effect, sd, runs)
            other = rng.normal(0, sd, runs)
            outs = vd.decide([vd.paired("h", "less", d, np.zeros(runs)), vd.paired("o", "less", other, np.zeros(runs))])
            count += outs[0].verdict == vd.REPRODUCED
        return count / 2000

    assert hits(n) >= 0.75
    assert hits(n - 1) < 0.75


def test_the_upper_bound_on_a_pilots_spread_covers_the_true_spread_four_times_in_five():
    """Three normal runs of sd 1, 20 000 times: the bound is ≥ 1 in 80 % of them (± 1 %)."""
    rng = np.random.default_rng(1)
    s = rng.normal(0, 1, (20000, 3)).std(axis=1, ddof=1)
    covered = np.mean([pilot.upper_sd(x, 2) >= 1.0 for x in s])
    assert abs(covered - 0.80) < 0.01


def test_a_threshold_needs_at_least_three_runs_even_when_two_would_do():
    assert pilot.runs_needed(0.001, 1.0, 0.05, 1, fewest=vd.MIN_UNITS) == 3
    assert pilot.runs_needed(0.001, 1.0, 0.05, 1) == 2


def test_an_effect_out_of_reach_is_none_and_a_zero_effect_is_refused():
    assert pilot.runs_needed(10.0, 0.01, 0.05, 4) is None
    with pytest.raises(ValueError, match="positive"):
        pilot.runs_needed(1.0, 0.0, 0.05, 1)


def test_welch_runs_use_both_rows_spreads():
    """Two rows on different data, n runs each: SE = √((s_a² + s_b²)/n) with Welch's ν."""
    n = pilot.runs_needed(0.1, 0.2, 0.05, 1, sd_b=0.2)
    se = lambda k: math.sqrt((0.1 ** 2 + 0.2 ** 2) / k)  # noqa: E731
    nu = lambda k: (0.05 / k) ** 2 / ((0.01 / k) ** 2 / (k - 1) + (0.04 / k) ** 2 / (k - 1))  # noqa: E731
    mde = lambda k: (stats.t.ppf(1 - 0.025, nu(k)) + stats.t.ppf(0.8, nu(k))) * se(k)  # noqa: E731
    assert mde(n) <= 0.2 < mde(n - 1)
    assert n > pilot.runs_needed(0.1, 0.2, 0.05, 1)  # more spread, more runs
    assert pilot.detectable(0.1, 0.05, 1, 5, sd_b=0.2) == pytest.approx(mde(5))


def _card(**extra) -> Card:
    study = {"experiment": "x.yaml", "variants": {"a": {}, "b": {}}, "seeds": [0]}
    return Card.model_validate({
        "card": "c", "version": 1, "paper": "p", "registered": "2026-11-27",
        "hypotheses": [
            {"id": "diff", "paper": "T1", "claim": "a < b", "metric": "test_loss", "kind": "less",
             "treatment": "a", "baseline": "b", "effect": 0.2, "role": "claim", "effect_basis": "the paper's gap, in its table"},
            {"id": "bound", "paper": "T2", "claim": "a ≤ 3", "metric": "test_loss", "kind": "at_most",
             "treatment": "a", "bound": 3.0, "effect": 0.5, "role": "property", "effect_basis": "a stated reason"},
            {"id": "plain", "paper": "T3", "claim": "b < a", "metric": "test_loss", "kind": "less",
             "treatment": "b", "baseline": "a", "effect": 50.0, "role": "calibration", "effect_basis": "a big one, stated"}],
        "budgets": {"cpu": {"differs": "d", "study": study}, "gpu-small": {"minutes": 8, "differs": "d", "study": study}},
        **extra})


def test_the_plan_takes_each_hypothesis_spread_from_its_tested_values_and_sizes_the_card_by_the_largest():
    card = _card()
    diffs = {"100": -0.1, "101": -0.25, "102": -0.05}
    bounds = {"100": 2.9, "101": 2.4, "102": 2.6}
    units = ([{"hypothesis": "diff", "test": "paired t over runs", "seed": s, "value": v} for s, v in diffs.items()]
             + [{"hypothesis": "bound", "test": "one-sample t over runs", "seed": s, "value": v} for s, v in bounds.items()]
             + [{"hypothesis": "plain", "test": "paired t over runs", "seed": s, "value": -v} for s, v in diffs.items()])
    result = pilot.plan(card, units, budget_runs=4)
    h = result["hypotheses"]
    assert h["diff"]["sd"] == pytest.approx(np.std(list(diffs.values()), ddof=1))
    up = h["diff"]["sd"] * math.sqrt(2 / stats.chi2.ppf(0.2, 2))  # the upper 80 % bound, three runs
    assert h["diff"]["sd_upper"] == pytest.approx(up) and up > 2 * h["diff"]["sd"]
    assert h["diff"]["runs_80"] == pilot.runs_needed(up, 0.2, 0.05, 3)
    up_bound = np.std(list(bounds.values()), ddof=1) * math.sqrt(2 / stats.chi2.ppf(0.2, 2))
    assert h["bound"]["runs_80"] == pilot.runs_needed(up_bound, 0.5, 0.05, 3, fewest=3)
    assert h["plain"]["runs_80"] == 3  # 50 nats: any three runs detect it
    assert result["runs_needed"] == max(h["diff"]["runs_80"], h["bound"]["runs_80"], 3)
    # what the budget's 4 runs detect, said before the run: it decides an effect within reach only
    for hid, effect in (("diff", 0.2), ("bound", 0.5), ("plain", 50.0)):
        at = detectable_effect(h[hid]["sd_upper"], 4, 0.05, 3, 0.8)
        assert h[hid]["detectable_at_budget"] == pytest.approx(at) and h[hid]["budget_decides"] == (at <= effect)
    assert h["plain"]["budget_decides"] and not h["diff"]["budget_decides"]
    assert h["diff"]["runs_90"] >= h["diff"]["runs_80"]
    said = pilot.lines(result)
    assert any(line.startswith("diff:") and "undecided at this budget" in line for line in said)
    assert any(line.startswith("plain:") and "it can decide" in line for line in said)
    assert said[-1] == f"the card needs {result['runs_needed']} seeds"
    # what 3..8 runs detect, for every hypothesis with a spread (named effect or not), by the t quantiles
    # written out: a threshold from 3 runs, a difference from 3 too
    for hid in ("diff", "plain", "bound"):
        table = h[hid]["detectable_80"]
        assert list(table) == [str(n) for n in range(3, 9)]
        for n, v in table.items():
            assert v == pytest.approx(detectable_effect(h[hid]["sd_upper"], int(n), 0.05, 3, 0.8))
        assert all(a > b for a, b in zip(list(table.values()), list(table.values())[1:]))  # more runs, less
    # consistency with the sizing rule: naming what n runs detect needs exactly n runs
    for n, v in h["diff"]["detectable_80"].items():
        assert pilot.runs_needed(h["diff"]["sd_upper"], v * (1 + 1e-9), 0.05, 3) == int(n)
    assert any(line.startswith("plain:") and "4 runs detect" in line for line in said)


def test_a_card_takes_a_gpu_small_budget_and_refuses_an_unknown_one_and_a_negative_effect():
    assert "gpu-small" in _card().budgets
    with pytest.raises(Exception, match="budgets"):
        Card.model_validate({**_card().model_dump(), "budgets": {"gpu-large": {"differs": "d", "study": {"variants": {}}}}})
    raw = _card().model_dump()
    raw["hypotheses"][0]["effect"] = -0.1
    with pytest.raises(Exception, match="effect"):
        Card.model_validate(raw)


def test_the_pilot_study_is_the_cards_study_on_the_pilot_seeds_under_its_own_name(tmp_path):
    from fedsweep.reproduce.card_run import study_file

    card = _card()
    path = tmp_path / "c.yaml"
    path.write_text("card: c\n")
    real = yaml.safe_load(study_file(card, "cpu", path, tmp_path).read_text())
    trial = yaml.safe_load(study_file(card, "cpu", path, tmp_path, pilot=True).read_text())
    assert trial["name"] == real["name"] + "-pilot" == "reproduce-c-cpu-v1-pilot"
    assert trial["seeds"] == list(pilot.PILOT_SEEDS) and not set(trial["seeds"]) & set(real["seeds"])
    assert {k: v for k, v in trial.items() if k not in ("name", "seeds")} == \
        {k: v for k, v in real.items() if k not in ("name", "seeds")}
