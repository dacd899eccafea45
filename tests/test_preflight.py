"""What a command does while Ray starts (``orchestrator.preflight``): the config's validation and, for
a config that tracks, MLflow's import and the store's schema check, which the run then takes instead
of repeating; all of it finished when the loading returns (MLflow imported from two threads at once
can meet its circular imports half-initialised)."""

import sqlite3
import threading

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
    assert not [t.name for t in threading.enumerate() if t.name.startswith("fedsweep")]  # nothing left running
    assert preflight.store_prepared(uri) is True
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
    from fedsweep.orchestrator.tracking import prepare_store

    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    uri = f"sqlite:///{blocked / 'mlflow.db'}"  # its folder cannot be made
    preflight.prepare_store(uri)  # no error here: the run repeats the preparation and reports it
    assert preflight.store_prepared(uri) is False
    with pytest.raises(OSError):  # the run's own call raises the error itself
        prepare_store(uri)


def test_a_study_has_its_store_prepared(tmp_path):
    from fedsweep.orchestrator import preflight

    db = tmp_path / "study.db"
    sweep, _ = preflight.load_study("configs/sweeps/smoke.yaml", [f"sweep.tracking_uri=sqlite:///{db}"])
    assert sweep.tracking_uri == f"sqlite:///{db}"
    assert preflight.store_prepared(sweep.tracking_uri) is True
    assert "experiments" in _tables(db)
