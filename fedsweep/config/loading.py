"""Reading and validating experiment files: YAML, ``--set`` overrides, every error at once.

Any problem ends in one :class:`~fedsweep.errors.ConfigError` whose message lists every
error found in the file, one line each, naming the field, the value and what is allowed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from fedsweep.algorithms import registry
from fedsweep.config.schema import ExperimentConfig
from fedsweep.errors import ConfigError




def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``--set path.to.field=value`` (value parsed as YAML) to ``raw`` in place."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected path=value, e.g. --set clients.num_clients=8")
    path, _, text = assignment.partition("=")
    keys = [k for k in path.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"--set {assignment!r}: empty path")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {path}: cannot parse value {text!r}: {exc}") from None
    node = raw
    for i, key in enumerate(keys[:-1]):
        nxt = node.get(key)
        if nxt is None:
            nxt = node[key] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {path}: {'.'.join(keys[: i + 1])} is a value, not a section")
        node = nxt
    node[keys[-1]] = value


def _format_error(err: dict[str, Any], prefix: str, model: type[BaseModel]) -> str:
    """One pydantic error as one line: the dotted field, the value, what is allowed."""
    loc = [str(p) for p in err["loc"]]
    field = ".".join([prefix, *loc] if prefix else loc) or prefix or "config"
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(model, loc[:-1])
        if not prefix and not loc[:-1]:
            allowed = sorted(set(allowed) | set(registry.names()))
        return f"unknown key '{field}' (allowed here: {', '.join(allowed) or 'none'})"
    if err["type"] == "missing":
        return f"{field}: required field is missing"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error" and not loc:
        return msg
    return f"{field} = {err.get('input')!r}: {msg}"


def _problems(exc: ValidationError, prefix: str, model: type[BaseModel]) -> list[str]:
    return list(dict.fromkeys(_format_error(e, prefix, model) for e in exc.errors()))


def _allowed_keys(model: type[BaseModel], loc: list[str]) -> list[str]:
    for key in loc:
        field = model.model_fields.get(key)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return [k for k in model.model_fields if k != "hparams"]


def _apply_method_defaults(raw: dict[str, Any]) -> None:
    """The chosen method's own config defaults (``Algorithm.config_defaults``) where the file is silent."""
    algo_name = raw.get("algorithm")
    if not (isinstance(algo_name, str) and algo_name in registry.names()):
        return
    for path, value in registry.get(algo_name).config_defaults.items():
        head, _, leaf = path.rpartition(".")
        node = raw
        for part in head.split(".") if head else []:
            node = node.setdefault(part, {}) if isinstance(node, dict) else node
        if isinstance(node, dict) and leaf not in node:
            node[leaf] = value


def validate(raw: dict[str, Any]) -> ExperimentConfig:
    """Validate plain data into an :class:`ExperimentConfig`.

    Raises one :class:`ConfigError` listing every problem found (sections and every method's
    hyperparameters), one line each; the method's own checks run once the rest is valid."""
    if not isinstance(raw, dict):
        raise ConfigError(f"an experiment file must be a mapping of sections, got {type(raw).__name__}")
    raw = copy.deepcopy(raw)
    clash = set(registry.names()) & set(ExperimentConfig.model_fields)
    if clash:  # a plugin named like a config section would be ambiguous
        raise ConfigError(f"algorithm names clash with config sections: {sorted(clash)}")
    sections = {k: raw.pop(k) for k in list(raw) if k in registry.names()}
    _apply_method_defaults(raw)
    problems: list[str] = []
    cfg = None
    try:
        cfg = ExperimentConfig.model_validate(raw)
    except ValidationError as exc:
        problems += _problems(exc, "", ExperimentConfig)
    algorithm = cfg.algorithm if cfg is not None else raw.get("algorithm", "fedavg")
    if isinstance(algorithm, str) and algorithm not in registry.names():
        problems.append(f"algorithm = {algorithm!r}: unknown method (allowed: {', '.join(registry.names())})")
    hparams: dict[str, Any] = {}
    wanted = set(sections) | ({algorithm} if isinstance(algorithm, str) and algorithm in registry.names() else set())
    for name in sorted(wanted):
        model = registry.get(name).Params
        section = sections.get(name) or {}
        if not isinstance(section, dict):
            problems.append(f"{name} = {section!r}: expected a mapping of hyperparameters")
            continue
        try:
            hparams[name] = model.model_validate(section)
        except ValidationError as exc:
            problems += _problems(exc, name, model)
    if problems:
        raise ConfigError(problems=problems)
    cfg.hparams = hparams
    try:
        registry.get(cfg.algorithm).check_config(cfg)
        cfg.check_shard_method()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a YAML experiment file, apply ``--set`` overrides, validate."""
    path = Path(path)
    raw = read_yaml(path, "config file", "an experiment file")
    for assignment in overrides or []:
        if not isinstance(raw, dict):
            break
        apply_override(raw, assignment)
    try:
        return validate(raw)
    except ConfigError as exc:
        raise in_file(exc, path) from None


def in_file(exc: ConfigError, where: Any) -> ConfigError:
    """``exc`` with every problem prefixed by the file (or sweep trial) it was found in."""
    return ConfigError(problems=[f"{where}: {p}" for p in exc.problems])


def read_yaml(path: Path, what: str = "file", kind: str = "a config file") -> Any:
    """The YAML document in ``path``; a missing file, bytes that are not UTF-8 and YAML syntax
    errors are one-line ``ConfigError``s naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); save the file as UTF-8") from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        context = getattr(exc, "context", None)
        raise ConfigError(f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be {kind}") from None
