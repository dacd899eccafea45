"""Ray Tune studies and MLflow comparisons on the smoke setup (real Tune, real MLflow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from fedsweep.orchestrator.compare import compare
from fedsweep.config import ConfigError
from fedsweep.config.sweep import load_sweep, trial_count
from fedsweep.orchestrator.study import tune_study

ROOT = Path(__file__).resolve().parents[1]


def _sweep_file(tmp_path, tracking_uri, **extra) -> Path:
    raw = {"name": "study_" + tmp_path.name[-12:].replace("_", ""), "experiment": str(ROOT / "configs/experiments/smoke.yaml"),
           "set": ["clients.clients_per_actor=4", f"checkpoint.dir={tmp_path / 'runs'}"],
           "variants": {"fedavg": {"algorithm": "fedavg"}, "fedicu": {"algorithm": "fedicu"}},
           "seeds": [0, 1], "metric": "test_loss", "mode": "min", "tracking_uri": tracking_uri,
           "storage": str(tmp_path / "tune"), **extra}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _children(client, name):
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("fedsweep.kind") == "study"]
    return parents, [r for r in runs if r.data.tags.get("fedsweep.kind") != "study"]


def test_sweep_file_errors_name_the_variant_and_path(tmp_path, tracking_uri):
    path = _sweep_file(tmp_path, tracking_uri, space={"fedicu.tau": {"grid": [0.1, -1.0]}})
    with pytest.raises(ConfigError, match=r"fedicu.tau=-1.0.*fedicu.tau = -1.0"):
        load_sweep(path)
    path = _sweep_file(tmp_path, tracking_uri, space={"fedicu.tau": {"grid": [0.1], "uniform": [0, 1]}})
    with pytest.raises(ConfigError, match="exactly one of grid"):
        load_sweep(path)


def test_four_trial_study_tracks_parent_and_children_and_reports(ray_session, tmp_path, tracking_uri):
    sweep, base = load_sweep(_sweep_file(tmp_path, tracking_uri, space={"fedicu.tau": {"grid": [0.1]}}))
    assert trial_count(sweep) == 4
    results, parent_id = tune_study(sweep, base, verbose=0)
    assert len(results) == 4 and not results.errors
    client = MlflowClient(tracking_uri)
    parents, children = _children(client, sweep.name)
    assert [p.info.run_id for p in parents] == [parent_id] and parents[0].info.status == "FINISHED"
    assert len(children) == 4
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parent_id and child.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(child.info.run_id, "test_loss")] == [1, 2]
    assert sorted(c.data.params["seed"] for c in children) == ["0", "0", "1", "1"]
    report, table, _ = compare(sweep.name, tracking_uri, str(tmp_path / "reports"), "test_loss")
    assert "| fedavg fedicu.tau=0.1 | 2 |" in table and "| fedicu fedicu.tau=0.1 | 2 |" in table
    assert table.count("**") >= 2  # the best of each column is marked
    text = report.read_text()
    assert "test_loss_per_round.png" in text and (report.parent / "test_loss_per_client.png").exists()
    assert (report.parent / "test_loss_vs_fedicu_tau.png").exists()
    logged = {a.path for a in client.list_artifacts(parent_id, "report")}
    assert "report/report.md" in logged


def test_interrupted_study_resumes_without_rerunning_finished_trials(ray_session, tmp_path, tracking_uri):
    sweep, base = load_sweep(_sweep_file(tmp_path, tracking_uri, max_concurrent_trials=1))
    results, parent_id = tune_study(sweep, base, stop_after_trials=2, verbose=0)
    client = MlflowClient(tracking_uri)
    _, children = _children(client, sweep.name)
    done_before = {c.info.run_id for c in children if c.info.status == "FINISHED"}
    assert len(done_before) == 2
    results, parent_again = tune_study(sweep, base, resume=True, verbose=0)
    assert parent_again == parent_id
    _, children = _children(client, sweep.name)
    finished = [c for c in children if c.info.status == "FINISHED"]
    assert len(finished) == 4 and done_before <= {c.info.run_id for c in finished}
    # a finished trial ran once: its round-1 metric was logged once
    for run_id in done_before:
        assert len(client.get_metric_history(run_id, "test_loss")) == 2
    assert client.get_run(parent_id).info.status == "FINISHED"
