"""Resumes that refuse a changed run or study, before anything starts (``run_dirs.resumable_run``,
``study.study_change``): the field is named, the resumable changes pass."""

from __future__ import annotations

import argparse
import copy
import json

import pytest

from fedsweep.errors import ConfigError, RunError


def _earlier_run(smoke_raw):
    """A run folder as a run of ``smoke_raw`` leaves it (run.json with its resolved config)."""
    from fedsweep.config import validate
    from fedsweep.orchestrator.run_dirs import new_run_dir, write_run_info

    cfg = validate(smoke_raw)
    folder = new_run_dir(cfg)
    write_run_info(folder, {"config": cfg.to_dict(), "run_id": "abc", "driver": None})
    return folder


def test_a_resume_names_the_changed_field_and_accepts_the_resumable_ones(smoke_raw):
    from fedsweep.config import validate
    from fedsweep.orchestrator.run_dirs import resumable_run

    folder = _earlier_run(smoke_raw)
    same, info = resumable_run(validate(smoke_raw))
    assert same == folder and info["run_id"] == "abc"
    longer = copy.deepcopy(smoke_raw)
    longer["rounds"] = smoke_raw["rounds"] + 3
    longer["tracking"]["wait_s"] = 5.0
    assert resumable_run(validate(longer))[0] == folder
    for path, value, field in ((("tracking", "uri"), "sqlite:////elsewhere/mlflow.db", "tracking.uri"),
                               (("train", "learning_rate"), 0.5, "train.learning_rate"), (("seed",), 99, "seed")):
        changed = copy.deepcopy(smoke_raw)
        node = changed
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
        with pytest.raises(ConfigError, match=rf"--resume: the config differs .*: {field}:"):
            resumable_run(validate(changed))


def test_a_resume_with_checkpoints_off_or_no_earlier_run_is_refused(smoke_raw):
    from fedsweep.config import validate
    from fedsweep.orchestrator.run_dirs import resumable_run

    with pytest.raises(RunError, match="no earlier run"):
        resumable_run(validate(smoke_raw))
    _earlier_run(smoke_raw)
    off = copy.deepcopy(smoke_raw)
    off["checkpoint"]["enabled"] = False
    with pytest.raises(ConfigError, match="checkpoint.enabled"):
        resumable_run(validate(off))


def test_run_resume_refuses_before_ray_starts(smoke_raw, tmp_path, monkeypatch):
    """``fedsweep run --resume`` of a changed config: refused with no Ray start (which would fail here)."""
    import yaml

    from fedsweep.cli.commands import run as run_command
    from fedsweep.orchestrator.runtime import ray_runtime

    _earlier_run(smoke_raw)

    def no_ray(*args, **kw):
        raise AssertionError("Ray started for a refused resume")

    monkeypatch.setattr(ray_runtime, "start_while", no_ray)
    monkeypatch.setattr(ray_runtime, "ensure", no_ray)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(smoke_raw))
    args = argparse.Namespace(config=str(path), overrides=["tracking.uri=sqlite:////x/other.db"], resume=True,
                              quiet=True)
    with pytest.raises(ConfigError, match="tracking.uri"):
        run_command.cmd_run(args)


def _sweep(raw_base, **over):
    from fedsweep.config.sweep import SweepConfig

    return SweepConfig.model_validate({"name": "s", "experiment": "base.yaml", "metric": "eval/accuracy",
                                       "space": {"train.learning_rate": {"grid": [0.1, 0.2]}}, **over})


def test_a_study_resume_refuses_a_changed_sweep_or_base_naming_the_field(smoke_raw):
    from fedsweep.orchestrator.study import study_change, study_state

    sweep = _sweep(smoke_raw)
    state = json.loads(json.dumps(study_state(sweep, smoke_raw, "parent")))
    study_change(state, sweep, copy.deepcopy(smoke_raw))  # the same study: accepted
    waits = copy.deepcopy(smoke_raw)
    waits["tracking"]["wait_s"] = 3.0
    study_change(state, sweep, waits)  # how long to wait may change
    more = copy.deepcopy(smoke_raw)
    more["rounds"] = smoke_raw["rounds"] + 2
    with pytest.raises(ConfigError, match=r"differs from the one interrupted: rounds: "):
        study_change(state, sweep, more)
    with pytest.raises(ConfigError, match=r"sweep\.experiment: 'base.yaml' .*'other.yaml'"):
        study_change(state, _sweep(smoke_raw, experiment="other.yaml"), smoke_raw)
    with pytest.raises(ConfigError, match=r"sweep\.space\.train\.learning_rate"):
        study_change(state, _sweep(smoke_raw, space={"train.learning_rate": {"grid": [0.1, 0.3]}}), smoke_raw)
    study_change({"parent_run_id": "old"}, _sweep(smoke_raw, experiment="x.yaml"), more)  # an old study.json
