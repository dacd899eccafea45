"""Config validation: every error is one line naming the field, the value and what is allowed."""

from __future__ import annotations

import pytest
import yaml

from fedsweep.cli import main
from fedsweep.config import ConfigError, apply_override, load_config, validate


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate(raw)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_defaults_validate():
    cfg = validate({"name": "x"})
    assert cfg.algorithm == "fedavg" and cfg.train.steps == 10
    assert cfg.clients.clients_per_actor == "auto" and cfg.clients.num_actors == "auto" and not cfg.layout_chosen


def test_unknown_key_names_the_path_and_allowed_keys():
    msg = _error({"name": "x", "clients": {"num_clinets": 3}})
    assert "clients.num_clinets" in msg and "num_clients" in msg


def test_unknown_top_level_key_lists_sections_and_algorithms():
    msg = _error({"name": "x", "lorra": {}})
    assert "'lorra'" in msg and "lora" in msg and "fedavg" in msg


def test_out_of_range_names_field_value_and_bound():
    msg = _error({"name": "x", "clients": {"fraction": 1.5}})
    assert msg.startswith("clients.fraction = 1.5") and "less than or equal to 1" in msg


def test_choice_lists_allowed_values():
    msg = _error({"name": "x", "partition": {"scheme": "random"}})
    assert "partition.scheme = 'random'" in msg and "'dirichlet'" in msg and "'mixed_task'" in msg


def test_unknown_algorithm_lists_registered_methods():
    msg = _error({"name": "x", "algorithm": "fedmagic"})
    assert "fedmagic" in msg and "fedavg" in msg and "local" in msg


def test_algorithm_section_is_validated_against_the_plugin():
    assert "fedavg.mu" in _error({"name": "x", "fedavg": {"mu": 0.1}})


def test_steps_and_epochs_are_exclusive():
    assert "exactly one of steps or epochs" in _error({"name": "x", "train": {"steps": 3, "epochs": 1}})
    assert validate({"name": "x", "train": {"epochs": 2}}).train.steps is None


def test_task_split_needs_a_client_per_task():
    msg = _error({"name": "x", "partition": {"scheme": "task"}, "clients": {"num_clients": 2}})
    assert "num_clients" in msg and "(2)" in msg


def test_set_overrides_nested_fields_with_yaml_values(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump({"name": "e", "clients": {"num_clients": 4}}))
    cfg = load_config(path, ["clients.num_clients=8", "train.learning_rate=1e-4", "lora.target_modules=[q_proj]",
                             "partition.scheme=dirichlet", "partition.dirichlet_beta=0.1"])
    assert cfg.clients.num_clients == 8 and cfg.train.learning_rate == 1e-4
    assert cfg.lora.target_modules == ["q_proj"] and cfg.partition.dirichlet_beta == 0.1


def test_set_rejects_malformed_and_bad_values(tmp_path):
    raw: dict = {"name": "e", "rounds": 3}
    with pytest.raises(ConfigError, match="path=value"):
        apply_override(raw, "rounds")
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_override(raw, "rounds.x=1")
    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"rounds = 0"):
        load_config(path, ["rounds=0"])


def test_cli_validate_fails_with_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nlora: {r: 0}\n")
    assert main(["validate", str(path)]) == 2
    out = capsys.readouterr().err.strip()
    assert "lora.r = 0" in out and "greater than or equal to 1" in out


def test_every_error_of_a_file_is_reported_at_once_one_line_each(tmp_path, capsys):
    """Three independent mistakes (a section field, an unknown key, a method hyperparameter): all three
    are reported by one validation, each on its own line naming its field; nothing else is printed."""
    raw = {"name": "x", "algorithm": "drift", "lora": {"r": 0}, "clients": {"num_clinets": 3},
           "drift": {"delta": -1.0}}
    with pytest.raises(ConfigError) as info:
        validate(raw)
    problems = info.value.problems
    assert len(problems) == 3 and all("\n" not in p for p in problems)
    assert any(p.startswith("lora.r = 0") for p in problems)
    assert any("clients.num_clinets" in p and "num_clients" in p for p in problems)
    assert any(p.startswith("drift.delta = -1.0") for p in problems)
    path = tmp_path / "three.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith(f"error: {path}: ") for line in lines)


def test_cli_validate_smoke_config(capsys):
    assert main(["validate", "configs/experiments/smoke.yaml"]) == 0
    assert "4 clients" in capsys.readouterr().out


def test_cli_algorithms_lists_plugins(capsys):
    assert main(["algorithms"]) == 0
    out = capsys.readouterr().out
    assert "fedavg" in out and "local" in out


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "experiments").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_experiment_validates(path):
    cfg = load_config(str(path), [])
    assert cfg.name


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "sweeps").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_sweep_validates_with_all_its_variants(path):
    from fedsweep.config.sweep import load_sweep, trial_count

    sweep, base = load_sweep(str(path))  # validates every variant and space value against the base
    assert trial_count(sweep) >= 1


@pytest.mark.parametrize("path,value", [
    ("seed", -1), ("seed", True), ("train.steps", True), ("rounds", 1e30), ("train.max_length", 10 ** 30),
    ("eval.batch_size", 10 ** 30), ("clients.resources.num_cpus", 1e30), ("lora.alpha", float("inf")),
    ("lora.alpha", 1e30), ("train.learning_rate", float("nan")), ("rounds", False),
])
def test_absurd_numbers_are_refused_in_one_line(path, value):
    raw = {"name": "x", "data": {"tasks": ["gcd"]}}
    node = raw
    parts = path.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    with pytest.raises(ConfigError) as err:
        validate(raw)
    assert parts[-1] in str(err.value) and "\n" not in str(err.value)


def test_non_utf8_config_file_is_one_line(tmp_path):
    from fedsweep.config import load_config

    p = tmp_path / "bad.yaml"
    p.write_bytes("name: caf".encode() + b"\xe9\nrounds: 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:1: not UTF-8"):
        load_config(p)


def _params_json(capsys, *extra: str) -> dict:
    import json

    assert main(["params", "--model-config", "smollm2-135m-instruct", "--adapter", "reft", "--rank", "4", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_params_reft_counts_what_a_config_gets_unless_told(capsys):
    """``fedsweep params --adapter reft`` follows the config default (reft.tied: false, one intervention
    per position group per layer) and says so; --tied / --untied choose."""
    from fedsweep.config.schema import ReftSection

    layers, d, r = 30, 576, 4  # SmolLM2-135M
    assert ReftSection().tied is False
    default = _params_json(capsys)
    assert default["tied"] is False and default["tied_from"] == "config default (reft.tied)"
    assert default["interventions"] == 2 * layers  # first and last positions
    assert default["trainable_params"] == 2 * layers * (2 * r * d + r)
    tied = _params_json(capsys, "--tied")
    assert tied["tied"] is True and tied["interventions"] == layers and tied["tied_from"] == "--tied"
    assert _params_json(capsys, "--untied")["interventions"] == 2 * layers
    with pytest.raises(SystemExit):
        main(["params", "--model-config", "smollm2-135m-instruct", "--adapter", "reft", "--tied", "--untied"])


def test_a_study_driver_validates_each_distinct_trial_experiment_once(monkeypatch):
    """``config.sweep.validated``: the space check, the trial's CPUs and its placement group read one
    validation per distinct experiment; an experiment that differs in one value is validated anew."""
    import copy

    from fedsweep.config import sweep as sweep_module

    calls = []
    monkeypatch.setattr(sweep_module, "_VALIDATED", {})
    monkeypatch.setattr(sweep_module, "validate", lambda raw: calls.append(raw) or validate(raw))
    raw = {"name": "memo", "algorithm": "fedprox", "fedprox": {"mu": 0.1}, "rounds": 2}
    first = sweep_module.validated(raw)
    again = sweep_module.validated(copy.deepcopy({"rounds": 2, "fedprox": {"mu": 0.1}, "algorithm": "fedprox", "name": "memo"}))
    assert again is first and len(calls) == 1  # same experiment, keys in another order
    other = sweep_module.validated({**raw, "fedprox": {"mu": 0.2}})
    assert len(calls) == 2 and other.algo_params.mu == 0.2 and first.algo_params.mu == 0.1
    with pytest.raises(ConfigError):  # a bad experiment raises every time, and is not kept
        sweep_module.validated({**raw, "rounds": 0})
    assert len(sweep_module._VALIDATED) == 2


def test_batch_clients_off_written_bare_in_yaml_means_off():
    """YAML 1.1 reads ``batch_clients: off`` as false: the config takes it as ``off``; numbers and
    ``auto`` pass, and the default is ``auto`` (groups where clients can share a step)."""
    import yaml

    from fedsweep.config import validate

    raw = yaml.safe_load("name: x\ntrain: {batch_clients: off}\n")
    assert raw["train"]["batch_clients"] is False
    assert validate(raw).train.batch_clients == "off"
    assert validate({"name": "x", "train": {"batch_clients": 3}}).train.batch_clients == 3
    assert validate({"name": "x"}).train.batch_clients == "auto"
