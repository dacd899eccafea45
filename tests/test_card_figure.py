"""A card report's figure (``reports.card_figure``): each panel holds the per-run values its test took,
the reference and the named effect where the claim puts them, against values planted and computed
here by hand; the figure is drawn from the CSV alone, grows with the hypotheses, and the CLI refuses
what it cannot draw."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import numpy as np
import pytest

from fedsweep.errors import ConfigError
from fedsweep.reproduce import card_figure
from fedsweep.reproduce.card_units import judge, to_csv


def _card(hypotheses, variants, version=2):
    from fedsweep.config.card import Card

    hypotheses = [{"role": "claim", "effect": 0.1, "effect_basis": "a reason stated for the test", **h}
                  for h in hypotheses]
    return Card.model_validate({"card": "c", "version": version, "paper": "p", "registered": "2026-11-27",
                                "hypotheses": hypotheses,
                                "budgets": {"cpu": {"differs": "d", "study": {"variants": {v: {} for v in variants}}}}})


def _row(label, seed, metric, per_client, data="[a]"):
    return SimpleNamespace(label=label, seed=str(seed), params={"data.tasks": data},
                           per_client={metric: dict(per_client)}, final={}, run_metrics={})


EFFECTS = [0.3, 0.5, 0.4, 0.45]  # how much lower the treatment's loss is, per seed (both clients)
H_LESS = {"id": "better", "paper": "T", "claim": "c", "metric": "test_loss", "kind": "less", "effect": 0.25,
          "treatment": "treat", "baseline": "base"}
H_SAME = {"id": "same", "paper": "T", "claim": "c", "metric": "test_loss", "kind": "not_worse", "margin": 0.05,
          "effect": 0.2, "treatment": "worse", "baseline": "base"}
H_WELCH = {"id": "apart", "paper": "T", "claim": "c", "metric": "test_loss", "kind": "less", "paired": False,
           "effect": 1.0, "treatment": "other", "baseline": "base"}


def _study():
    rows = []
    for seed, effect in enumerate(EFFECTS):
        rows.append(_row("base", seed, "test_loss", {0: 3.0 + seed, 1: 2.0 + seed}))
        rows.append(_row("treat", seed, "test_loss", {0: 3.0 + seed - effect, 1: 2.0 + seed - effect}))
        rows.append(_row("worse", seed, "test_loss", {0: 3.0 + seed + 0.01 * seed, 1: 2.0 + seed}))
        rows.append(_row("other", seed, "test_loss", {0: 1.0 + 0.1 * seed, 1: 1.2}, data="[b]"))
    card = _card([H_LESS, H_SAME, H_WELCH], ["base", "treat", "worse", "other"])
    outcomes, units = judge(card, rows)
    return card, outcomes, to_csv(units)


def test_panels_hold_each_runs_value_reference_and_named_effect():
    card, outcomes, text = _study()
    by_id = {p.outcome.id: p for p in card_figure.panels(text, {h.id: h for h in card.hypotheses})}
    better = by_id["better"]
    assert [v for _, v in better.runs] == pytest.approx([-e for e in EFFECTS])  # treatment − baseline per run
    assert better.outcome.estimate == pytest.approx(-np.mean(EFFECTS))
    assert (better.outcome.reference, better.named) == (0.0, pytest.approx(-0.25))  # claimed below 0
    assert better.scale == "treat − base: test_loss"
    same = by_id["same"]  # lower is better: the margin line is +0.05, the claim below it, the effect 0.2 below that
    assert [v for _, v in same.runs] == pytest.approx([0.005 * s for s in range(4)])  # run means: (0.01 s + 0) / 2
    assert same.outcome.reference == pytest.approx(0.05) and same.named == pytest.approx(0.05 - 0.2)
    assert [p.outcome.verdict for p in by_id.values()] == [o.verdict for o in outcomes]


def test_an_unpaired_panel_shows_each_run_against_the_other_rows_mean():
    _, _, text = _study()
    apart = next(p for p in card_figure.panels(text) if p.outcome.id == "apart")
    treat = [1.1 + 0.05 * s for s in range(4)]  # run means of "other": ((1.0 + 0.1 s) + 1.2) / 2
    base = [2.5 + s for s in range(4)]
    points = dict(apart.runs)
    assert [points[f"treatment seed {s}"] for s in range(4)] == pytest.approx([t - np.mean(base) for t in treat])
    assert [points[f"baseline seed {s}"] for s in range(4)] == pytest.approx([np.mean(treat) - b for b in base])
    assert apart.outcome.estimate == pytest.approx(np.mean(treat) - np.mean(base))
    assert apart.named == pytest.approx(-1.0) and apart.scale == ""  # the CSV keeps the effect (1); no card: no axis label


def _png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_draw_report_writes_a_png_beside_the_report_that_grows_with_its_hypotheses(tmp_path):
    card, _, text = _study()
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "cpu-v2.csv").write_text(text)
    (folder / "cpu-v2.md").write_text("# report\n")
    three = card_figure.draw_report(folder / "cpu-v2.md", card)
    assert three == folder / "cpu-v2.png"
    one_csv = "\n".join(line for line in text.splitlines() if not line.startswith(("same", "apart"))) + "\n"
    (folder / "cpu-v9-rerun-abc.csv").write_text(one_csv)
    one = card_figure.draw_report(folder / "cpu-v9-rerun-abc.md", card)  # another version: drawn without the card
    (w3, h3), (w1, h1) = _png_size(three), _png_size(one)
    assert h3 > 2 * h1 * 0.8 and w3 > 0 and w1 > 0
    assert card_figure.card_hypotheses(card, 9) is None and set(card_figure.card_hypotheses(card, 2)) == {
        "better", "same", "apart"}
    with pytest.raises(ConfigError, match="CSV beside it"):
        card_figure.draw_report(folder / "cpu-v3.md", card)


def test_the_cli_draws_a_committed_report_and_refuses_a_missing_one(tmp_path, monkeypatch, capsys):
    from fedsweep.cli import main

    _, _, text = _study()
    (tmp_path / "cpu-v1.csv").write_text(text)
    (tmp_path / "cpu-v1.md").write_text("# report\n")
    monkeypatch.chdir(tmp_path)
    assert main(["reproduce", "--figure", "cpu-v1.md"]) == 0 and (tmp_path / "cpu-v1.png").is_file()
    assert main(["reproduce", "--figure", "missing.md"]) != 0
    assert "--figure missing.md: no such report" in capsys.readouterr().err
