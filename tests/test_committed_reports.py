"""Every committed card report recomputes from the values beside it, and the ledger says what the
reports say (``fedsweep reproduce --verify`` and ``--ledger``, in CI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedsweep.reports import verdicts as vd
from fedsweep.reproduce import card_report, ledger
from fedsweep.reproduce.card_units import is_legacy

ROOT = Path(__file__).resolve().parents[1]
REPORTS = sorted(p for p in (ROOT / "reproductions").glob("*/*.md")
                 if ledger.NAME.match(p.name) and p.with_suffix(".csv").is_file())


def test_there_are_committed_reports():
    assert len(REPORTS) >= 21


@pytest.mark.parametrize("report", REPORTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_committed_report_recomputes_from_its_csv(report):
    """Today's reports from their (run, client) values; those written before 2026-11-28 from their run
    values, under the rules they were written with."""
    assert card_report.verify(report) == []
    block = card_report.read_block(report.read_text())
    if block.get("rules", 1) >= vd.RULES:
        assert not is_legacy(report.with_suffix(".csv").read_text())  # the clients' values are there


def test_the_ledger_in_the_docs_is_the_one_the_reports_give():
    """docs/reproductions.md's generated section, regenerated from reproductions/ (``--ledger --write``)."""
    import os

    here = os.getcwd()
    try:
        os.chdir(ROOT)
        assert ledger.section(ROOT / "docs/reproductions.md") == ledger.table(Path("reproductions"))
    finally:
        os.chdir(here)


def _report(folder: Path, name: str, outcomes: dict, roles: dict, rules: int = vd.RULES, seeds=("0", "1", "2"),
            commit: str = "x"):
    block = {"provenance": {"commit": commit}, "rules": rules, "roles": roles, "effects": {k: 0.1 for k in roles},
             "seeds": list(seeds),
             "outcomes": [{"id": k, "verdict": v, "estimate": e, "mde": None, "n": 3, "p": 0.01, "p_holm": 0.02}
                          for k, (v, e) in outcomes.items()]}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(f"# r\n\n{card_report.JSON_HEAD}\n\n```json\n{json.dumps(block)}\n```\n")


def test_the_ledger_counts_quality_claims_apart_and_says_where_a_replication_agrees(tmp_path):
    roles = {"a": "claim", "b": "claim", "c": "property", "d": "calibration", "e": "property"}
    _report(tmp_path / "drift", "cpu-v4.md", {"a": ("reproduced", 1.0), "b": ("undecided", 0.1),
                                              "c": ("contradicted", -1.0), "d": ("not detected", 0.0),
                                              "e": ("reproduced", 0.4)}, roles)
    _report(tmp_path / "drift", "cpu-v4-replication.md", {"a": ("reproduced", 0.9), "b": ("reproduced", 0.5),
                                                          "c": ("not detected", -0.2), "d": ("undecided", 0.0),
                                                          "e": ("contradicted", -0.3)},
            roles, seeds=("200", "201", "202"))
    _report(tmp_path / "drift", "cpu-v3.md", {"a": ("reproduced", 2.0)}, {"a": "claim"}, rules=1)
    _report(tmp_path / "premise", "cpu-v5.md", {"x": ("reproduced", -0.2)}, {"x": "claim"})
    text = ledger.table(tmp_path)
    assert "- **The five methods' quality claims** (a method beats a baseline on a quality metric, newest cpu " \
           "versions): 2 — 1 reproduced, 1 undecided." in text
    assert "- Other literature's claims: 1 — 1 reproduced." in text  # the premise card's, not a method's
    assert "- Properties: 2 — 1 reproduced, 1 contradicted." in text and "- Calibration checks: 1 — 1 not detected." in text
    rows = {line.split("|")[3].strip(): line for line in text.splitlines() if line.startswith("| drift | [v4]")}
    assert rows["a"].rstrip().endswith("| reproduced on seeds 200, 201, 202 | agrees |")
    assert rows["b"].rstrip().endswith("| reproduced on seeds 200, 201, 202 | replication only |")  # counted both ways
    assert rows["c"].rstrip().endswith("| not detected on seeds 200, 201, 202 | original only |")  # no reversal
    assert rows["d"].rstrip().endswith("| undecided on seeds 200, 201, 202 | — |")  # decided in neither block
    assert rows["e"].rstrip().endswith("| contradicted on seeds 200, 201, 202 | does not agree |")  # a reversal
    assert ("Agreement counted both ways (hypotheses decided in either block, the registered seeds or the "
            "replication's fresh ones): 5 — 1 decided alike in both, 1 in opposite directions, 1 decided on the "
            "registered seeds only, 1 on the fresh seeds only, 1 not replicated yet.") in text
    assert "| drift | [cpu-v3.md](" in text and "| 1 | 1 reproduced |" in text  # the older version stays listed
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{ledger.BEGIN}\nstale\n{ledger.END}\nafter\n")
    assert ledger.write(doc, tmp_path) and ledger.section(doc) == text
    assert doc.read_text().startswith("before\n") and doc.read_text().endswith("\nafter\n")
    assert not ledger.write(doc, tmp_path)  # already current


def test_the_ledger_counts_the_latest_run_of_each_block_of_the_newest_version(tmp_path):
    """A re-run of a version's design at later code (``-rerun-COMMIT``) replaces its first run in the count,
    block by block (commit times from this checkout's history: d820bfd is older than c706f3d); a re-run at
    older code than the first run does not; an outside replication never does; the first run stays listed."""
    roles = {"a": "claim"}
    old, new = "d820bfda6f831fad0223ff8d9ec30b18c195285b", "c706f3dcaf64"
    _report(tmp_path / "fedicu", "cpu-v3.md", {"a": ("undecided", 0.1)}, roles, commit=old)
    _report(tmp_path / "fedicu", "cpu-v3-rerun-c706f3d.md", {"a": ("reproduced", 0.2)}, roles, commit=new)
    _report(tmp_path / "fedicu", "cpu-v3-replication.md", {"a": ("reproduced", 0.3)}, roles, seeds=("200",),
            commit=new)
    _report(tmp_path / "fedicu", "cpu-v3-rerun-d820bfd-replication.md", {"a": ("undecided", 0.4)}, roles,
            seeds=("200",), commit=old)
    _report(tmp_path / "fedicu", "cpu-v3-replication-someone.md", {"a": ("contradicted", 0.5)}, roles,
            seeds=("1000",), commit=new)
    _report(tmp_path / "fedicu", "cpu-v2.md", {"a": ("reproduced", 0.6)}, roles, commit=new)
    (top, rep), = ledger.newest(ledger.reports(tmp_path))
    assert top.path.name == "cpu-v3-rerun-c706f3d.md" and rep.path.name == "cpu-v3-replication.md"
    text = ledger.table(tmp_path)
    assert "| fedicu | [v3](../" + (tmp_path / "fedicu" / "cpu-v3-rerun-c706f3d.md").as_posix() in text
    assert "| [cpu-v3.md](" in text  # the first run stays in the list of every report


def test_fail_stale_fails_on_a_stale_report_not_owed_and_on_an_owed_one_that_is_current():
    counted = ["reproductions/a/cpu-v1.md", "reproductions/b/cpu-v2.md"]
    assert ledger.owed_problems([], counted, {}) == []
    assert ledger.owed_problems(["reproductions/a/cpu-v1.md"], counted, {"reproductions/a/cpu-v1.md": "why"}) == []
    assert ledger.owed_problems(["reproductions/a/cpu-v1.md"], counted, {}) == \
        ["reproductions/a/cpu-v1.md: stale and not in reproductions/reruns_owed.yaml"]
    assert ledger.owed_problems([], counted, {"reproductions/b/cpu-v2.md": "why"}) == \
        ["reproductions/b/cpu-v2.md: listed in reproductions/reruns_owed.yaml but current"]
    assert ledger.owed_problems([], counted, {"reproductions/c/cpu-v1.md": "why"}) == \
        ["reproductions/c/cpu-v1.md: listed in reproductions/reruns_owed.yaml but not counted"]


def test_every_owed_rerun_names_a_counted_report_and_why():
    owed = ledger.owed(ROOT / "reproductions")
    counted = {r.path.relative_to(ROOT).as_posix() for pair in ledger.newest(ledger.reports(ROOT / "reproductions"))
               for r in pair if r}
    for path, why in owed.items():
        assert path in counted and len(why) > 40, path
