"""The study progress view and the MLflow saved view, without Ray or a browser."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from fedsweep.config.sweep import SweepConfig, run_name
from fedsweep.orchestrator.tracking.ui import experiment_path, view_state
from fedsweep.orchestrator.study_view import StudyView, clock, last_error_line, remaining_seconds


def _sweep(variants=("fedavg", "fedicu"), space=("fedicu.tau",)) -> SweepConfig:
    return SweepConfig(name="s", experiment="e.yaml", variants={v: {"algorithm": v} for v in variants} or None,
                       space={k: {"grid": [0.1]} for k in space})


def _view(tmp_path, total=4, mode="min", sweep=None):
    sweep = sweep or _sweep()
    out = Console(file=io.StringIO(), width=200, force_terminal=False)
    return StudyView(total, "test_loss", mode, rounds=2, name_of=lambda p: run_name(sweep, p, {}),
                     log=tmp_path / "study.log", out=out), out


def test_run_name_is_the_comparison_row_and_the_seed():
    assert run_name(_sweep(space=()), {"variant": "fedavg", "seed": 1}, {}) == "fedavg seed 1"
    assert run_name(_sweep(("drift",), ("drift.delta",)), {"variant": "drift", "drift.delta": 0.123456, "seed": 0},
                    {}) == "drift drift.delta=0.1235 seed 0"
    assert run_name(_sweep((), ("fedicu.tau",)), {"seed": 2, "fedicu.tau": 3}, {"algorithm": "fedicu"}) == \
        "fedicu fedicu.tau=3 seed 2"  # without variants, the method names the row


def test_remaining_time_extrapolates_the_throughput_so_far():
    assert remaining_seconds(100.0, 0, 7) is None            # nothing ended: no estimate
    assert remaining_seconds(100.0, 2, 7) == pytest.approx(250.0)  # 50 s per trial, 5 left
    assert remaining_seconds(100.0, 7, 7) == 0.0
    assert clock(None) == "?" and clock(59.6) == "1:00" and clock(3725) == "1:02:05"


def test_error_line_is_the_innermost_exception():
    text = "Traceback (most recent call last):\n  File x\nray.exceptions.RayTaskError: outer\n" \
           "  File y\nValueError: the real reason\n"
    assert last_error_line(text) == "ValueError: the real reason"
    assert last_error_line("") == "unknown error"


def test_view_counts_best_and_lines(tmp_path):
    view, out = _view(tmp_path)
    with view:
        view.sync({"a": "PENDING", "b": "PENDING", "c": "PENDING", "d": "PENDING"})
        view.started("a", {"variant": "fedavg", "seed": 0, "fedicu.tau": 0.1})
        view.started("b", {"variant": "fedicu", "seed": 0, "fedicu.tau": 0.1})
        view.sync({"a": "RUNNING", "b": "RUNNING", "c": "PENDING", "d": "PENDING"})
        assert view.counts() == (0, 2, 2, 0)
        view.result("a", {"variant": "fedavg", "seed": 0, "fedicu.tau": 0.1}, {"round": 1, "test_loss": 1.0})
        assert view.best is None  # a round before the last is not a trial's result
        view.result("a", {"variant": "fedavg", "seed": 0, "fedicu.tau": 0.1}, {"round": 2, "test_loss": 3.0})
        view.result("b", {"variant": "fedicu", "seed": 0, "fedicu.tau": 0.1}, {"round": 2, "test_loss": 2.5})
        view.result("b", {"variant": "fedicu", "seed": 0, "fedicu.tau": 0.1}, {"round": 2, "test_loss": float("nan")})
        view.ended("a", {"variant": "fedavg", "seed": 0, "fedicu.tau": 0.1}, None)
        view.ended("b", {"variant": "fedicu", "seed": 0, "fedicu.tau": 0.1},
                   "Traceback ...\nRuntimeError: client 3 ran out of memory\n")
        view.sync({"a": "TERMINATED", "b": "ERROR", "c": "RUNNING", "d": "PENDING"})
        assert view.counts() == (2, 1, 1, 1)
        assert view.best == (2.5, "fedicu fedicu.tau=0.1 seed 0")
        line = view.line()
    text = out.file.getvalue()
    assert "✓ fedavg fedicu.tau=0.1 seed 0: test_loss 3 after round 2" in text
    assert "✗ fedicu fedicu.tau=0.1 seed 0 failed: RuntimeError: client 3 ran out of memory" in text
    assert "Traceback" not in text
    assert "1 running · 1 pending · 1 failed · best fedicu fedicu.tau=0.1 seed 0: test_loss 2.5" in line
    log = (tmp_path / "study.log").read_text()
    assert "Traceback ...\nRuntimeError: client 3 ran out of memory" in log and "round 2" in log


def test_view_of_a_resumed_study_estimates_from_this_run_only(tmp_path):
    view, _ = _view(tmp_path, total=4, mode="max", sweep=_sweep(("x", "y"), ()))
    with view:
        view.sync({"a": "TERMINATED", "b": "TERMINATED", "c": "PENDING", "d": "PENDING"})
        assert view.resumed == 2 and view.counts() == (2, 0, 2, 0)
        assert "~?" in view.line()  # none ended in this run yet
        view.result("c", {"variant": "x", "seed": 0}, {"round": 2, "test_loss": 1.0})
        view.result("d", {"variant": "y", "seed": 0}, {"round": 2, "test_loss": 2.0})
        assert view.best[1] == "y seed 0"  # mode max


def test_saved_view_sorts_by_the_metric_and_charts_it_first():
    state = view_state("accuracy", "max", ["test_loss", "accuracy"])
    assert state["orderByKey"] == "metrics.`accuracy`" and state["orderByAsc"] is False
    assert [c["metricKey"] for c in state["compareRunCharts"]] == ["accuracy", "test_loss"]
    assert {c["metricSectionId"] for c in state["compareRunCharts"]} == {state["compareRunSections"][0]["uuid"]}
    assert state["selectedColumns"][:2] == ["metrics.`accuracy`", "metrics.`test_loss`"]
    json.dumps(state)
    assert experiment_path("7") == "/experiments/7/runs?workflowType=machine_learning&viewStateShareKey=fedsweep"
    assert experiment_path("7", charts=True).endswith("&compareRunsMode=CHART")


def test_runs_command_without_a_store_is_one_line(tmp_path, capsys):
    from fedsweep.cli import main

    assert main(["runs", "--uri", f"sqlite:///{tmp_path / 'none.db'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no MLflow store at" in err and not (tmp_path / "none.db").exists()
    assert main(["runs", "--limit", "0"]) == 2
