"""Walks over folders where runs write (``storage.named_below``): a round's ``round_NNNN.partial`` folder is
renamed at its commit while another command walks the tree — a study's courier looking for outboxes, a
run's start looking for abandoned run folders of its config. The rename is planted between the listing
of a folder and the walk's descent into it, where ``Path.rglob`` raises FileNotFoundError (the failure a
CI run met in a test that polled a study)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _rename_under_the_walk(monkeypatch, folder, old: str, new: str) -> list:
    """``os.scandir`` of ``folder`` lists its entries, then ``old`` is renamed ``new`` before the caller
    reads them: the walk sees ``old`` and descends into a folder that is gone. Returns the renames done."""
    real, done = os.scandir, []

    class Listed:
        def __init__(self, entries):
            self.entries = iter(entries)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.entries)

    def scandir(path="."):
        if os.fspath(path) != os.fspath(folder):
            return real(path)
        with real(path) as it:
            entries = list(it)
        if (folder / old).exists():
            os.rename(folder / old, folder / new)
            done.append(old)
        return Listed(entries)

    monkeypatch.setattr(os, "scandir", scandir)
    return done


def _committing_run(run_dir):
    """A run folder whose round 2 is being committed: ``checkpoints/round_0002.partial`` with a file."""
    partial = run_dir / "checkpoints" / "round_0002.partial"
    partial.mkdir(parents=True)
    (partial / "state.bin").write_bytes(b"x")
    return run_dir / "checkpoints"


def test_the_planted_rename_breaks_rglob(tmp_path, monkeypatch):
    """(Python 3.11 and 3.12, the versions pyproject allows: their glob raises on a vanished folder.)"""
    checkpoints = _committing_run(tmp_path / "exp" / "20261207-151743")
    done = _rename_under_the_walk(monkeypatch, checkpoints, "round_0002.partial", "round_0002")
    with pytest.raises(FileNotFoundError):
        list(tmp_path.rglob("run.json"))
    assert done == ["round_0002.partial"]


def test_named_below_passes_over_a_folder_renamed_under_it(tmp_path, monkeypatch):
    from fedsweep.storage import named_below

    runs = [tmp_path / "exp" / "20261207-151743", tmp_path / "exp" / "20261207-151750"]
    checkpoints = _committing_run(runs[0])
    for run in runs:
        run.mkdir(parents=True, exist_ok=True)
        (run / "run.json").write_text("{}")
    (runs[1] / "deep" / "er").mkdir(parents=True)
    (runs[1] / "deep" / "er" / "run.json").mkdir()  # a folder of that name counts as rglob's would
    done = _rename_under_the_walk(monkeypatch, checkpoints, "round_0002.partial", "round_0002")
    got = named_below(tmp_path, "run.json")
    assert done == ["round_0002.partial"]
    assert got == sorted([runs[0] / "run.json", runs[1] / "run.json", runs[1] / "deep" / "er" / "run.json"])
    monkeypatch.undo()
    assert named_below(tmp_path, "run.json") == sorted(tmp_path.rglob("run.json"))  # unplanted: as rglob
    assert named_below(tmp_path / "absent", "run.json") == []


def test_a_runs_start_marks_abandoned_folders_while_another_run_commits(tmp_path, monkeypatch):
    """``run_dirs.abandoned`` over a config's folder where one run's driver is gone (it is marked KILLED)
    and another run, live, commits its round under the walk (left as it is)."""
    from fedsweep.orchestrator.run_dirs import abandoned, lease

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = {"host": lease()["host"], "pid": gone.pid, "started": 1.0}
    base = tmp_path / "exp"
    runs = {"dead": base / "20261207-151743", "live": base / "20261207-151750"}
    for name, run in runs.items():
        run.mkdir(parents=True)
        (run / "run.json").write_text(json.dumps({"run_id": None, "driver": dead if name == "dead" else lease()}))
    checkpoints = _committing_run(runs["live"])
    done = _rename_under_the_walk(monkeypatch, checkpoints, "round_0002.partial", "round_0002")
    marked = []
    assert abandoned(base, lambda run_id, info: marked.append(run_id)) == [runs["dead"]]
    assert done == ["round_0002.partial"] and marked == []  # (no MLflow run to end: it had no id yet)
    assert json.loads((runs["dead"] / "run.json").read_text())["ended"] == "KILLED"
    assert "ended" not in json.loads((runs["live"] / "run.json").read_text())


def test_the_courier_finds_the_outboxes_while_a_trial_commits_its_round(tmp_path, monkeypatch):
    from fedsweep.orchestrator.tracking.outbox import OUTBOX, outboxes

    trials = tmp_path / "trials"
    waiting = trials / "t1" / OUTBOX
    waiting.mkdir(parents=True)
    (waiting / "000001.json").write_text("{}")
    (trials / "t2" / OUTBOX).mkdir(parents=True)  # empty: nothing waits
    checkpoints = _committing_run(trials / "t3" / "exp" / "20261207-151743")
    done = _rename_under_the_walk(monkeypatch, checkpoints, "round_0002.partial", "round_0002")
    assert outboxes(trials) == [waiting] and done == ["round_0002.partial"]
