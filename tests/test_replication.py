"""Replications: the card's own on its declared fresh seeds, and one run outside the project on seeds its
runner chose (``fedsweep reproduce NAME --replicate [--seeds … --label …]``).

Each is the registered study with nothing changed but its seeds and its name (the study files compared
key by key); an outside replication's seeds are refused where the project draws its own, where they
repeat, or where they are fewer than the design's runs; its report names it and its seeds, and the ledger
counts how many of the original's decided verdicts it agrees with.
"""

from __future__ import annotations

import json

import pytest
import yaml

from fedsweep.cli.commands.reproduce import parse_seeds
from fedsweep.config.card import OUTSIDE_SEEDS_FROM, PILOT_SEEDS, Card
from fedsweep.errors import ConfigError
from fedsweep.reports import verdicts as vd
from fedsweep.reproduce import card_report, ledger
from fedsweep.reproduce.card_run import Outside, study_file


def _card(seeds=(0, 1, 2), replication=(200, 201, 202)) -> Card:
    study = {"experiment": "x.yaml", "variants": {"a": {}, "b": {}}, "seeds": list(seeds)}
    return Card.model_validate({
        "card": "c", "version": 2, "paper": "p", "registered": "2026-11-29",
        "hypotheses": [{"id": "diff", "paper": "T1", "claim": "a < b", "metric": "test_loss", "kind": "less",
                        "treatment": "a", "baseline": "b", "effect": 0.2, "role": "claim", "effect_basis": "a stated reason"}],
        "budgets": {"cpu": {"differs": "d", "study": study, "replication_seeds": list(replication)}}})


def _studies(tmp_path, **kind) -> tuple[dict, dict]:
    card = _card()
    path = tmp_path / "c.yaml"
    path.write_text("card: c\n")
    return (yaml.safe_load(study_file(card, "cpu", path, tmp_path).read_text()),
            yaml.safe_load(study_file(card, "cpu", path, tmp_path, **kind).read_text()))


def _same_but_seeds_and_name(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k not in ("name", "seeds")} == \
        {k: v for k, v in b.items() if k not in ("name", "seeds")}


def test_the_declared_replication_is_the_registered_study_on_its_declared_seeds(tmp_path):
    real, rep = _studies(tmp_path, replication=True)
    assert rep["name"] == "reproduce-c-cpu-v2-replication" and rep["seeds"] == [200, 201, 202]
    assert _same_but_seeds_and_name(real, rep)


def test_an_outside_replication_is_the_registered_study_on_its_own_seeds_under_its_label(tmp_path):
    real, rep = _studies(tmp_path, replication=True, outside=Outside((1000, 1001, 1002), "lab-x"))
    assert rep["name"] == "reproduce-c-cpu-v2-replication-lab-x" and rep["seeds"] == [1000, 1001, 1002]
    assert _same_but_seeds_and_name(real, rep)


@pytest.mark.parametrize("seeds, label, refusal", [
    ([1000, 1001, 1002], "lab-x", None),
    ([1000, 1001, 1002, 1003, 1004], "a1", None),  # more runs than the design: more power, allowed
    ([999, 1000, 1001], "lab-x", "below 1000"),  # where the project draws its own
    ([200, 201, 202], "lab-x", "below 1000"),  # the card's declared block
    ([1000, 1000, 1001], "lab-x", "distinct"),
    ([1000, 1001], "lab-x", "fewer than the 3 runs"),
    ([1000, 1001, 1002], "Lab X", "--label"),
    ([1000, 1001, 1002], "", "--label"),
])
def test_outside_seeds_are_refused_where_the_project_draws_where_they_repeat_or_are_too_few(seeds, label, refusal):
    problem = _card().outside_seeds_problem("cpu", seeds, label)
    if refusal is None:
        assert problem is None
    else:
        assert problem and refusal in problem


def test_the_project_s_own_seeds_stay_below_the_outside_block():
    assert max(PILOT_SEEDS) < OUTSIDE_SEEDS_FROM
    with pytest.raises(Exception, match="left to replications run outside"):
        _card(replication=(200, 1000, 1001))
    with pytest.raises(Exception, match="left to replications run outside"):
        _card(seeds=(0, 1, 1500))


def test_a_replication_outside_the_project_needs_its_seeds_label_and_replicate():
    from fedsweep.cli import build_parser
    from fedsweep.cli.commands.reproduce import _outside

    parse = build_parser().parse_args
    args = parse(["reproduce", "drift", "--replicate", "--seeds", "1000-1002,1010", "--label", "lab-x"])
    assert _outside(args) == Outside((1000, 1001, 1002, 1010), "lab-x")
    assert _outside(parse(["reproduce", "drift", "--replicate"])) is None
    for partial in (["--seeds", "1000-1002", "--label", "x"], ["--replicate", "--seeds", "1000-1002"],
                    ["--replicate", "--label", "x"]):
        with pytest.raises(ConfigError, match="takes all three"):
            _outside(parse(["reproduce", "drift", *partial]))


@pytest.mark.parametrize("text, seeds", [("1000,1001", [1000, 1001]), ("1000-1003", [1000, 1001, 1002, 1003]),
                                         (" 1005 , 1000-1001", [1005, 1000, 1001])])
def test_seeds_are_a_list_or_ranges(text, seeds):
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["", "a", "1000-", "-5", "1000,,1001", "1.5"])
def test_malformed_seeds_are_refused_in_one_line(text):
    with pytest.raises(ConfigError, match="--seeds"):
        parse_seeds(text)


def test_an_outside_report_names_its_runner_and_seeds_and_keeps_them_in_its_block():
    card = _card()
    outcomes = vd.decide([vd.paired("diff", "less", [2.6, 2.5, 2.7], [3.0, 2.9, 3.2], higher_is_better=False)],
                         effects={"diff": 0.2})
    text = card_report.report(card, "cpu", outcomes, 12.0, "fedsweep reproduce c --budget cpu --replicate --seeds "
                              "1000,1001,1002 --label lab-x", {"commit": "abc", "card_sha256": "0" * 64},
                              True, ["1000", "1001", "1002"], "lab-x")
    assert text.startswith("# Reproduction card: c (version 2, cpu budget, replication outside the project: lab-x)")
    assert "on seeds 1000, 1001, 1002, chosen by whoever ran it" in text
    assert "| diff *(claim)*: a < b |" in text and "**reproduced**" in text
    block = card_report.read_block(text)
    assert block["outside"] == "lab-x" and block["replication"] is True and block["seeds"] == ["1000", "1001", "1002"]


def _report(folder, name: str, verdicts: dict, seeds):
    block = {"provenance": {"commit": "x"}, "rules": vd.RULES, "roles": {k: "claim" for k in verdicts},
             "effects": {k: 0.1 for k in verdicts}, "seeds": list(seeds),
             "outcomes": [{"id": k, "verdict": v, "estimate": 0.0, "mde": None, "n": 3, "p": 0.01, "p_holm": 0.02}
                          for k, v in verdicts.items()]}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(f"# r\n\n{card_report.JSON_HEAD}\n\n```json\n{json.dumps(block)}\n```\n")


def test_the_ledger_counts_an_outside_replication_apart_from_the_declared_one(tmp_path):
    original = {"a": "reproduced", "b": "contradicted", "c": "undecided"}
    _report(tmp_path / "drift", "cpu-v4.md", original, ("0", "1", "2"))
    assert "No replication run outside the project has been committed yet" in ledger.table(tmp_path)
    _report(tmp_path / "drift", "cpu-v4-replication.md", {"a": "reproduced", "b": "undecided", "c": "reproduced"},
            ("200", "201", "202"))
    _report(tmp_path / "drift", "cpu-v4-replication-lab-x.md",
            {"a": "reproduced", "b": "contradicted", "c": "contradicted"}, ("1000", "1001", "1002"))
    text = ledger.table(tmp_path)
    # the declared replication alone makes the per-hypothesis column and the headline
    assert ("fresh ones): 3 — 1 decided alike in both, 0 in opposite directions, 1 decided on the registered seeds "
            "only, 1 on the fresh seeds only, 0 not replicated yet.") in text
    row = next(line for line in text.splitlines() if line.startswith("| drift | v4 | lab-x |"))
    assert row == ("| drift | v4 | lab-x | 1000, 1001, 1002 | 2 of 2 | "
                   f"[cpu-v4-replication-lab-x.md](../{(tmp_path / 'drift' / 'cpu-v4-replication-lab-x.md').as_posix()}) |")
    assert "| drift | [cpu-v4-replication-lab-x.md](" in text  # and it stands in the list of every report
