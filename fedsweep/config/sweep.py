"""The study file of ``fedsweep tune``: a base experiment and what varies, validated before any trial.

A sweep file names a base experiment and what varies::

    name: drift_delta
    experiment: configs/experiments/drift_sp.yaml
    set: [rounds=2, clients.num_clients=4]      # overrides of the base (small CPU defaults)
    variants:                                   # named override sets: a grid dimension
      fedavg: {algorithm: fedavg}
      drift:  {algorithm: drift}
    space:                                      # any config path
      drift.delta: {grid: [0.0, 0.2, 0.4]}      # grid | choice | uniform | loguniform
    seeds: [0, 1]                               # a grid dimension over `seed`
    num_samples: 1
    metric: accuracy
    mode: max
    scheduler: none                             # or asha (over rounds)
    searcher: random                            # or optuna / ax where installed

Every variant with every example value of the space is validated against the base here, so a
bad trial fails before the study starts. The Tune run itself is ``orchestrator.study``.
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from fedsweep.config.schema import Strict
from fedsweep.config.loading import apply_override, in_file, read_yaml, validate
from fedsweep.errors import ConfigError
from fedsweep.storage import SQLITE, location, sqlite_file

DISTRIBUTIONS = ("grid", "choice", "uniform", "loguniform")


class Dimension(Strict):
    grid: list[Any] | None = None
    choice: list[Any] | None = None
    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "Dimension":
        given = [k for k in DISTRIBUTIONS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(DISTRIBUTIONS)}")
        if self.loguniform is not None and min(self.loguniform) <= 0:
            raise ValueError("loguniform bounds must be positive")
        return self

    def examples(self) -> list[Any]:
        """Values to validate the base config with."""
        if self.grid is not None:
            return self.grid
        if self.choice is not None:
            return self.choice
        return list(self.uniform if self.uniform is not None else self.loguniform)


class Asha(Strict):
    grace_period: int = Field(1, ge=1)
    reduction_factor: float = Field(2.0, gt=1)


class Question(Strict):
    """The one question a study asks, answered in its report: do ``rows`` differ from the baseline row
    (``fedsweep compare --baseline``, default fedavg) on ``metric`` in the ``better`` direction?"""

    text: str
    metric: str = "test_loss"
    rows: list[str] = Field(min_length=1)


class SweepConfig(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    experiment: str
    set: list[str] = Field(default_factory=list)
    variants: dict[str, dict[str, Any]] | None = None
    space: dict[str, Dimension] = Field(default_factory=dict)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    num_samples: int = Field(1, ge=1)
    metric: str = "accuracy"
    mode: Literal["max", "min"] = "max"
    scheduler: Literal["none", "asha"] = "none"
    asha: Asha = Asha()
    searcher: Literal["random", "optuna", "ax"] = "random"
    max_concurrent_trials: int | None = Field(None, ge=1)
    tracking_uri: str = "sqlite:///results/mlflow.db"
    storage: str = "results/tune"
    report_metrics: list[str] = Field(default_factory=list)
    """Run-level metrics shown as columns of the study's report beside ``metric`` (each run's
    last-round value), e.g. ``drift_neighbours_mean`` for a δ sweep."""
    question: Question | None = None
    """Answered in the study's report: each row's verdict, or the effect the study could have detected."""

    @model_validator(mode="after")
    def _question_rows_run(self) -> "SweepConfig":
        if self.question and self.variants and not self.space:  # rows are the variants' names
            missing = [r for r in self.question.rows if r not in self.variants]
            if missing:
                raise ValueError(f"question.rows: {', '.join(missing)} is not a variant "
                                 f"({', '.join(self.variants)})")
        return self


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> tuple[SweepConfig, dict[str, Any]]:
    """The validated sweep and the base experiment as plain data (with its and the CLI's overrides).

    ``--set`` paths apply to the base experiment; paths starting with ``sweep.`` to the sweep file.
    Every variant and every value of the space is validated against the base before a trial starts.
    """
    path = Path(path)
    raw = read_yaml(path, "sweep file", "a sweep file")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a sweep file is a mapping (name, experiment, variants, …)")
    base_sets = []
    for item in overrides or []:
        if item.startswith("sweep."):
            apply_override(raw, item.removeprefix("sweep."))
        else:
            base_sets.append(item)
    try:
        sweep = SweepConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(problems=[f"{path}: {'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                                    for e in exc.errors()]) from None
    exp_path = Path(sweep.experiment)
    if not exp_path.is_file() and (path.parent / exp_path).is_file():
        exp_path = path.parent / exp_path
    if not exp_path.is_file():
        raise ConfigError(f"{path}: experiment file not found: {sweep.experiment}")
    base = read_yaml(exp_path, "experiment file", "an experiment file")
    for item in sweep.set + base_sets:
        apply_override(base, item)
    check_space(sweep, base, path)
    sweep.tracking_uri = absolute_uri(sweep.tracking_uri)
    sweep.storage = str(location(sweep.storage).resolve())
    return sweep, absolute_paths(base)


def absolute_uri(uri: str) -> str:
    """A sqlite URI made absolute (``~`` expanded, a relative path against the driver's directory:
    trials run elsewhere)."""
    db = sqlite_file(uri)
    return SQLITE + str(db.resolve()) if db is not None else uri


def absolute_paths(raw: dict[str, Any]) -> dict[str, Any]:
    """Paths in an experiment resolved against the driver's directory, as a Tune trial's cwd differs."""
    raw = copy.deepcopy(raw)
    for section, key in (("data", "path"), ("model", "cache_dir"), ("checkpoint", "dir")):
        value = (raw.get(section) or {}).get(key)
        if value and not str(value).startswith(("/", "s3://", "gs://", "hf://")) and Path(value).exists():
            raw[section][key] = str(Path(value).resolve())
    tracking = raw.get("tracking") or {}
    if tracking.get("uri"):
        tracking["uri"] = absolute_uri(tracking["uri"])
    return raw


def trial_raw(base: dict[str, Any], sweep: SweepConfig, params: dict[str, Any]) -> dict[str, Any]:
    """The experiment of one trial: base + variant overrides + sampled values + seed."""
    raw = copy.deepcopy(base)
    if sweep.variants:
        for key, value in sweep.variants[params["variant"]].items():
            apply_override(raw, f"{key}={json.dumps(value)}")
    for key in sweep.space:
        apply_override(raw, f"{key}={json.dumps(params[key])}")
    raw["seed"] = params["seed"]
    raw["name"] = sweep.name
    return raw


_VALIDATED: dict[str, Any] = {}
_VALIDATED_MAX = 512


def validated(raw: dict[str, Any]):
    """``validate(raw)``, once per distinct experiment in this process: the study's driver checks the
    space, sizes each trial's placement group and reads its CPUs from the same trial experiments, and
    Tune may ask a trial's resources more than once. Keyed by the experiment's canonical JSON (a
    changed raw is validated anew); the validated config is shared, so callers copy before changing
    it (``model_copy``, as ``with_layout`` does)."""
    key = json.dumps(raw, sort_keys=True, default=str)
    cfg = _VALIDATED.get(key)
    if cfg is None:
        cfg = validate(raw)
        if len(_VALIDATED) >= _VALIDATED_MAX:
            _VALIDATED.pop(next(iter(_VALIDATED)))
        _VALIDATED[key] = cfg
    return cfg


def check_space(sweep: SweepConfig, base: dict[str, Any], where: Path) -> None:
    """Validate every variant with every example value of the space (and that each trial will
    produce the study's metric) before any trial starts."""
    def check(params: dict[str, Any], what: str) -> None:
        try:
            cfg = validated(trial_raw(base, sweep, params))
        except ConfigError as exc:
            raise in_file(exc, f"{where}: {what}") from None
        if sweep.metric == "accuracy" and cfg.eval.max_new_tokens == 0:
            raise ConfigError(f"{where}: {what}: metric 'accuracy' needs generation, but eval.max_new_tokens is 0 "
                              f"(use metric: test_loss, mode: min)")

    for variant in list(sweep.variants or {"_": {}}):
        for key, dim in sweep.space.items():
            for value in dim.examples():
                params = {"variant": variant, "seed": sweep.seeds[0], key: value}
                params.update({k: d.examples()[0] for k, d in sweep.space.items() if k != key})
                check(params, f"variant {variant!r}, {key}={value!r}")
        if not sweep.space:
            check({"variant": variant, "seed": sweep.seeds[0]}, f"variant {variant!r}")


def trial_count(sweep: SweepConfig) -> int:
    grid = len(sweep.seeds) * len(sweep.variants or {"_": 0})
    for dim in sweep.space.values():
        if dim.grid is not None:
            grid *= len(dim.grid)
    return grid * sweep.num_samples


def label(sweep: SweepConfig, params: dict[str, Any], raw: dict[str, Any]) -> str:
    """What a comparison row is called: the variant (or the method) and the swept values, not the seed."""
    parts = [params["variant"]] if sweep.variants else [raw.get("algorithm", "fedavg")]
    parts += [f"{k}={params[k]:.4g}" if isinstance(params[k], float) else f"{k}={params[k]}" for k in sweep.space]
    return " ".join(parts)


def run_name(sweep: SweepConfig, params: dict[str, Any], raw: dict[str, Any]) -> str:
    """A trial's MLflow run name (and its line on the console): its comparison row and its seed."""
    return f"{label(sweep, params, raw)} seed {params['seed']}"


def corner_samples(sweep: SweepConfig) -> list[dict[str, Any]]:
    """Every variant × every value of every grid dimension's extremes: to size the local runtime."""
    out = []
    variants = list(sweep.variants or {"_": {}})
    dims = {k: [d.examples()[0], d.examples()[-1]] for k, d in sweep.space.items()}
    for variant, combo in itertools.product(variants, itertools.product(*dims.values()) if dims else [()]):
        out.append({"variant": variant, "seed": sweep.seeds[0], **dict(zip(dims, combo))})
    return out
