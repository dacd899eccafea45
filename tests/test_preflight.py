"""What a command does while Ray starts (``orchestrator.preflight``): the config's validation, and for
a config that tracks, MLflow's import and the store's schema check in a thread of their own, which
the run then takes instead of repeating."""

import json
import os
import subprocess
import sys
import sqlite3
import textwrap

import pytest

SMOKE = "configs/experiments/smoke.yaml"


def _tables(db) -> set[str]:
    with sqlite3.connect(db) as con:
        return {r[0] for r in con.execute("select name from sqlite_master where type = 'table'")}


def test_a_tracking_config_has_its_store_prepared_taken_once(tmp_path):
    from fedsweep.orchestrator import preflight

    db = tmp_path / "store" / "mlflow.db"
    uri = f"sqlite:///{db}"
    cfg = preflight.load_experiment(SMOKE, [f"tracking.uri={uri}"])
    assert cfg.tracking.uri == uri
    assert preflight.store_prepared(uri) is True  # waits for the thread
    assert {"experiments", "runs", "metrics", "alembic_version"} <= _tables(db)  # the schema, made there
    assert preflight.store_prepared(uri) is False  # taken: a second run prepares its own


def test_an_untracked_config_prepares_no_store(tmp_path):
    from fedsweep.orchestrator import preflight

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    preflight.load_experiment(SMOKE, [f"tracking.uri={uri}", "tracking.enabled=false"])
    assert preflight.store_prepared(uri) is False
    assert not (tmp_path / "mlflow.db").exists()


def test_a_failed_preparation_is_left_to_the_run_to_repeat_and_report(tmp_path):
    from fedsweep.orchestrator import preflight
    from fedsweep.orchestrator.tracking.tracker import prepare_store

    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    uri = f"sqlite:///{blocked / 'mlflow.db'}"  # its folder cannot be made
    preflight.prepare_store_soon(uri)
    assert preflight.store_prepared(uri) is False  # no error here: the run repeats the preparation and reports it
    with pytest.raises(OSError):  # the run's own call raises the error itself
        prepare_store(uri)


def test_a_study_has_its_store_prepared(tmp_path):
    from fedsweep.orchestrator import preflight

    db = tmp_path / "study.db"
    sweep, _ = preflight.load_study("configs/sweeps/smoke.yaml", [f"sweep.tracking_uri=sqlite:///{db}"])
    assert sweep.tracking_uri == f"sqlite:///{db}"
    assert preflight.store_prepared(sweep.tracking_uri) is True
    assert "experiments" in _tables(db)


RACE = textwrap.dedent("""
    import json, sys
    from fedsweep.orchestrator import preflight
    preflight.prepare_store_soon(sys.argv[1])
    # what `fedsweep tune` and a run do next, while the thread is still importing MLflow
    from fedsweep.reports.compare import collect
    from fedsweep.orchestrator.tracking.mlflow_api import MlflowClient
    names = [e.name for e in MlflowClient(tracking_uri=sys.argv[1]).search_experiments()]
    print(json.dumps({"taken": preflight.store_prepared(sys.argv[1]), "experiments": names}))
""")


def test_the_driver_imports_mlflow_beside_the_store_s_thread_safely(tmp_path):
    """The main thread imports MLflow (through ``orchestrator.tracking``) while the store's thread is
    still importing it: it waits for that import instead of meeting a half-initialised module."""
    for attempt in range(3):
        uri = f"sqlite:///{tmp_path / f'{attempt}.db'}"
        done = subprocess.run([sys.executable, "-c", RACE, uri], capture_output=True, text=True, timeout=300,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1]) == {"taken": True, "experiments": ["Default"]}
