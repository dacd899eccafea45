"""A card report is stale by its numbers: the fingerprint (a short trial per arm) at the report's commit
against HEAD's decides where the file rule says code changed (fedsweep/reproduce/fingerprint.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedsweep.config.card import load_card
from fedsweep.reproduce import card_report, fingerprint
from fedsweep.reproduce.numerics_paths import code_units

ROOT = Path(__file__).resolve().parents[1]


def _arm(digests: dict, metrics: dict) -> dict:
    return {"round": "round_0002", "digests": digests, "metrics": metrics}


def _print(**arms) -> dict:
    return {"commit": "c" * 40, "recipe": fingerprint.RECIPE_VERSION, "arms": arms}


def test_equal_fingerprints_have_no_differences_and_each_difference_is_named():
    a = _arm({"client_00000.safetensors:lora_A": "aa", "server.json": "bb"}, {"0": {"test_loss": 1.25}})
    same = _print(fedavg=a, fedicu=a)
    assert fingerprint.differences(same, json.loads(json.dumps(same))) == []
    changed = _arm({"client_00000.safetensors:lora_A": "ab", "server.json": "bb"}, {"0": {"test_loss": 1.5}})
    out = fingerprint.differences(same, _print(fedavg=a, fedicu=changed))
    assert len(out) == 1 and out[0].startswith("fedicu:")
    assert "client_00000.safetensors:lora_A" in out[0] and "server.json" not in out[0]
    assert "client 0 test_loss 1.25 → 1.5" in out[0] and "1 tensors or files and 1 values" in out[0]


def test_a_value_only_one_side_has_is_named_but_a_new_metric_is_no_difference():
    a = _arm({"t": "aa"}, {"0": {"test_loss": 1.0}})
    b = _arm({"t": "aa"}, {"0": {"test_loss": 1.0, "new_metric": 3.0}})
    assert fingerprint.differences(_print(x=a), _print(x=b)) == []
    assert fingerprint.differences(_print(x=a, y=a), _print(x=a)) == ["y: only then"]
    extra = _arm({"t": "aa", "u": "cc"}, {"0": {"test_loss": 1.0}, "1": {"test_loss": 2.0}})
    out = fingerprint.differences(_print(x=a), _print(x=extra))
    assert out == ["x: 1 tensors or files and 1 values differ (clients ['0'] → ['0', '1']; u)"]


def test_a_share_of_wall_clock_time_is_never_compared_nor_recorded(tmp_path):
    """pFedGPT's ``hbo_share`` (HBO seconds over a client's seconds) moves between two runs of the same
    numbers like the seconds it divides: a store that recorded it compares equal to a HEAD that differs only
    there, and a record's metrics leave it out (with seconds and execution counts), keeping the loss."""
    then = _arm({"t": "aa"}, {"0": {"test_loss": 1.0, "hbo_share": 1.2325201266048684}})
    now = _arm({"t": "aa"}, {"0": {"test_loss": 1.0, "hbo_share": 1.3047726307794143}})
    assert fingerprint.differences(_print(pfedgpt=then), _print(pfedgpt=now)) == []
    moved = _arm({"t": "aa"}, {"0": {"test_loss": 1.5, "hbo_share": 1.3047726307794143}})
    assert fingerprint.differences(_print(pfedgpt=then), _print(pfedgpt=moved)) == [
        "pfedgpt: 0 tensors or files and 1 values differ (client 0 test_loss 1.0 → 1.5)"]
    records = tmp_path / "records"
    records.mkdir()
    (records / "round_0002.json").write_text(json.dumps({"client_metrics": {"0": {
        "test_loss": 2.5, "hbo_share": 0.7, "hbo_share_run": 0.6, "hbo_seconds": 3.0, "batched_clients": 4}}}))
    assert fingerprint.record_metrics(tmp_path) == {"0": {"test_loss": 2.5}}


def test_a_failed_arm_or_another_recipe_is_never_current():
    a = _arm({}, {})
    failed = {"error": "ConfigError: no such field", "seconds": 1.0}
    assert fingerprint.differences(_print(x=a), _print(x=failed)) == ["x: failed now (ConfigError: no such field)"]
    other = {**_print(x=a), "recipe": fingerprint.RECIPE_VERSION + 1}
    assert "not comparable" in fingerprint.differences(other, _print(x=a))[0]


def test_the_store_keeps_each_commit_without_timings(tmp_path):
    one = {**_print(x={**_arm({"t": "aa"}, {}), "seconds": 5.0}), "commit": "a" * 40}
    two = {**_print(x={**_arm({"t": "ab"}, {}), "seconds": 6.0}), "commit": "b" * 40}
    fingerprint.store("demo", one, tmp_path)
    path = fingerprint.store("demo", two, tmp_path)
    assert path == tmp_path / "reproductions" / "demo" / fingerprint.STORE
    kept = fingerprint.stored("demo", tmp_path)
    assert set(kept) == {"a" * 40, "b" * 40} and "seconds" not in kept["a" * 40]["arms"]["x"]
    assert kept["b" * 40]["arms"]["x"]["tensors"] == "ab" and "digests" not in kept["b" * 40]["arms"]["x"]


def test_a_stored_compact_fingerprint_against_a_full_one_names_what_differs():
    """The store keeps the names as one digest and the digests as one string; HEAD's full side names the
    tensors that differ, and names that differ at all are a difference."""
    then = _arm({"b.safetensors:x": "a" * 12, "a.json": "b" * 12, "c.safetensors:y": "c" * 12}, {"0": {"loss": 1.0}})
    same = json.loads(json.dumps(then))
    moved = {**same, "digests": {**same["digests"], "c.safetensors:y": "d" * 12}}
    stored = fingerprint.compact(then)
    assert stored["tensors"] == "b" * 12 + "a" * 12 + "c" * 12  # sorted by name: a.json, b…, c…
    assert fingerprint.differences(_print(x=stored), _print(x=same)) == []
    assert fingerprint.differences(_print(x=stored), _print(x=moved)) == \
        ["x: 1 tensors or files and 0 values differ (c.safetensors:y)"]
    renamed = {**same, "digests": {"z.json": "b" * 12, **{k: v for k, v in same["digests"].items() if k != "a.json"}}}
    out = fingerprint.differences(_print(x=stored), _print(x=renamed))
    assert len(out) == 1 and "names (3 on one side) are not the same" in out[0]
    both = fingerprint.differences(_print(x=stored), _print(x=fingerprint.compact(moved)))
    assert both == ["x: 1 tensors or files and 0 values differ (#2)"]


def test_code_changed_but_numbers_unchanged_is_current_and_changed_numbers_are_stale(tmp_path):
    """The committed robustness report ran before code its card watches changed: the fingerprint decides."""
    card, _ = load_card("robustness")
    report = ROOT / "reproductions" / "robustness" / f"cpu-v{card.version}.md"
    commit = card_report.read_block(report.read_text())["provenance"]["commit"]
    assert card_report.changed_since(commit, card_report.method_paths(card))  # the file rule triggers
    asked = []

    def judge(answer):
        return lambda name, at: asked.append((name, at)) or answer

    line = card_report.staleness(card, report, judge([]))
    assert "its fingerprint unchanged: current" in line and "stale" not in line
    assert asked == [("robustness", commit.split("+")[0])]
    line = card_report.staleness(card, report, judge(["fedavg_attacked_krum: 3 tensors or files and 1 values differ"]))
    assert "its numbers changed since" in line and "fedavg_attacked_krum" in line and "stale until re-run" in line
    line = card_report.staleness(card, report, judge(None))
    assert "no fingerprint at its commit" in line and "--fingerprint --at" in line and "stale" in line
    assert "stale until re-run" in card_report.staleness(card, report)  # no judge: the file rule alone


def test_the_committed_fingerprints_cover_every_counted_report():
    """Each report the ledger counts (of its card's current version: an older one is superseded whatever its
    numbers) has its card's fingerprint at its commit, every arm of today's card."""
    from fedsweep.reproduce import ledger

    for pair in ledger.newest(ledger.reports(ROOT / "reproductions")):
        for report in filter(None, pair):
            if report.version != load_card(report.card)[0].version:
                continue
            commit = report.block["provenance"]["commit"].split("+")[0]
            kept = fingerprint.stored(report.card, ROOT).get(commit)
            assert kept is not None, f"{report.path}: no fingerprint at {commit[:12]}"
            arms = {t[1] for t in fingerprint.trials([report.card])}
            assert set(kept["arms"]) == arms, report.path
            assert not [a for a, one in kept["arms"].items() if "error" in one], report.path


def test_a_docstring_is_no_code_change_for_the_file_rule():
    text = (ROOT / "fedsweep" / "algorithms" / "fedicu.py").read_text()
    start = text.index('"""') + 3
    edited = text[:start] + "Reworded. " + text[start:]
    assert edited != text and code_units(edited) == code_units(text)


def _checkout_copy(where: Path) -> Path:
    where.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("fedsweep", "configs"):
        shutil.copytree(ROOT / name, where / name, ignore=ignore)
    return where


def _fingerprint_of(copy: Path, card: str, arms: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(copy), "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(copy / "fedsweep" / "reproduce" / "fingerprint.py"), "--cards", card,
                           "--arms", *arms, "--out", str(out)], cwd=copy, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())[card]


@pytest.mark.xdist_group("ray_heavy")
def test_a_planted_change_in_one_method_changes_exactly_its_arms(tmp_path):
    """A one-line numeric change in FedICU (its ε in eq. 16) changes the FedICU arm's fingerprint and not
    FedAvg's beside it in the same card, while a code change that computes the same (a new statement in
    fedavg.py, which the file rule counts as changed) leaves FedAvg's fingerprint equal; the premise card
    (FedAvg and local training only) does not even watch the file the change is in."""
    before = _checkout_copy(tmp_path / "before")
    after = _checkout_copy(tmp_path / "after")
    method = after / "fedsweep" / "algorithms" / "fedicu.py"
    assert "\nEPS = 1e-6\n" in method.read_text()
    method.write_text(method.read_text().replace("\nEPS = 1e-6\n", "\nEPS = 2e-6\n"))
    fedavg = after / "fedsweep" / "algorithms" / "fedavg.py"
    fedavg.write_text(fedavg.read_text() + "\n_REFACTORED = True\n")
    assert code_units(fedavg.read_text()) != code_units((ROOT / "fedsweep" / "algorithms" / "fedavg.py").read_text())
    arms = ["fedavg", "fedicu"]
    then = _fingerprint_of(before, "fedicu", arms, tmp_path / "before.json")
    now = _fingerprint_of(after, "fedicu", arms, tmp_path / "after.json")
    differ = fingerprint.differences(then, now)
    assert [d.split(":")[0] for d in differ] == ["fedicu"], differ
    assert "test_loss" in differ[0] or "safetensors" in differ[0]
    premise, _ = load_card("premise")
    assert "fedsweep/algorithms/fedicu.py" not in card_report.method_paths(premise)
    assert "fedsweep/algorithms/fedicu.py" in card_report.method_paths(load_card("fedicu")[0])


def test_the_judge_runs_heads_fingerprint_once_per_code_state(tmp_path, monkeypatch):
    """HEAD's fingerprint is computed once and read back from the cache while the code is the same; a
    changed file of the package is a new code state (computed again)."""
    for name in ("fedsweep", "configs/reproductions"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "fedsweep" / "m.py").write_text("X = 1\n")
    head = _print(x=_arm({"t": "aa"}, {"0": {"test_loss": 1.0}}))
    runs = []
    monkeypatch.setattr(fingerprint, "collect", lambda cards, say=print, arms=None: runs.append(cards) or {"demo": head})
    fingerprint.store("demo", {**head, "commit": "a" * 40}, tmp_path)
    judge = fingerprint.Judge(tmp_path, say=lambda line: None, cache=tmp_path / "cache")
    assert judge("demo", "a" * 40) == [] and judge("demo", "b" * 40) is None
    again = fingerprint.Judge(tmp_path, say=lambda line: None, cache=tmp_path / "cache")
    assert again("demo", "a" * 40) == [] and runs == [["demo"]] and again.computed == []
    (tmp_path / "fedsweep" / "m.py").write_text("X = 2\n")
    third = fingerprint.Judge(tmp_path, say=lambda line: None, cache=tmp_path / "cache")
    assert third("demo", "a" * 40) == [] and runs == [["demo"], ["demo"]] and third.computed == ["demo"]


def test_a_checkout_whose_only_change_is_a_fingerprint_store_records_its_commit_clean(tmp_path):
    """A card run adds its fingerprint to the tracked store after its report; the card's replication run
    from the same clone must still record the commit (not ``+dirty``). Any other tracked change, also a
    file of the same name elsewhere, makes it dirty, asked from any folder of the checkout."""
    import subprocess

    from fedsweep import provenance
    from fedsweep.reproduce import fingerprint

    assert fingerprint.STORE == provenance.FINGERPRINT_STORE

    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    store = tmp_path / "reproductions" / "fedreft" / fingerprint.STORE
    elsewhere = tmp_path / "fedsweep" / fingerprint.STORE
    code = tmp_path / "fedsweep" / "method.py"
    for path in (store, elsewhere, code):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"v1")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert provenance.git_commit(tmp_path) == head
    store.write_bytes(b"v2")  # the registered run's fingerprint added
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "report.md").write_text("untracked")  # (untracked output never counts)
    assert provenance.git_commit(tmp_path) == head
    assert provenance.git_commit(tmp_path / "fedsweep") == head
    for changed in (code, elsewhere):
        before = changed.read_bytes()
        changed.write_bytes(b"v2")
        assert provenance.git_commit(tmp_path) == head + "+dirty", changed
        assert provenance.git_commit(tmp_path / "reproductions") == head + "+dirty", changed
        changed.write_bytes(before)
    assert provenance.git_commit(tmp_path) == head
