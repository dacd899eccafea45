"""``fedsweep tune``: hyperparameter studies with Ray Tune, one full experiment per trial.

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

Each trial runs the whole experiment (server and client actors) inside the trial's own
placement group — a bundle for the trial driver, one for the server, one per client
actor — so trials never starve each other; per-round metrics go to Tune. MLflow holds
one parent run per study and one child run per trial. An interrupted study continues
with ``--resume`` (Tune's restore); a trial cut mid-way resumes from its own checkpoint.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedsweep.orchestrator.config import ConfigError, apply_override, read_yaml, validate
from fedsweep.storage import AnyPath, is_uri, location

DRIVER_BUNDLE = {"CPU": 0.05}
DISTRIBUTIONS = ("grid", "choice", "uniform", "loguniform")


class Dimension(BaseModel):
    model_config = ConfigDict(extra="forbid")
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

    def tune(self):
        from ray import tune

        if self.grid is not None:
            return tune.grid_search(self.grid)
        if self.choice is not None:
            return tune.choice(self.choice)
        if self.uniform is not None:
            return tune.uniform(*self.uniform)
        return tune.loguniform(*self.loguniform)


class Asha(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grace_period: int = Field(1, ge=1)
    reduction_factor: float = Field(2.0, gt=1)


class SweepConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
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
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"{path}: {where}: {err['msg']}") from None
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
    """A relative sqlite URI made absolute against the driver's directory (trials run elsewhere)."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri.removeprefix("sqlite:///")).resolve())
    return uri


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


def check_space(sweep: SweepConfig, base: dict[str, Any], where: Path) -> None:
    """Validate every variant with every example value of the space (and that each trial will
    produce the study's metric) before any trial starts."""
    def check(params: dict[str, Any], what: str) -> None:
        try:
            cfg = validate(trial_raw(base, sweep, params))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {what}: {exc}") from None
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


def param_space(sweep: SweepConfig) -> dict[str, Any]:
    from ray import tune

    space: dict[str, Any] = {"seed": tune.grid_search(sweep.seeds)}
    if sweep.variants:
        space["variant"] = tune.grid_search(list(sweep.variants))
    for key, dim in sweep.space.items():
        space[key] = dim.tune()
    return space


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


# ------------------------------------------------------------------------------ trials


def trial_bundles(raw: dict[str, Any]) -> tuple[list[dict[str, float]], str]:
    from fedsweep.actors.remote import bundle

    cfg = validate(raw)
    return ([DRIVER_BUNDLE, bundle(cfg.server.resources)] + [bundle(cfg.clients.resources)] * cfg.num_actors,
            cfg.clients.placement_strategy)


def run_trial(params: dict[str, Any], sweep: SweepConfig, base: dict[str, Any], study_dir: str,
              parent_run_id: str | None) -> None:
    """One Tune trial: the full experiment in this trial's placement group, reporting every round."""
    import ray
    from ray import tune

    from fedsweep.orchestrator.runner import run

    ctx = tune.get_context()
    trial_id = ctx.get_trial_id()
    raw = trial_raw(base, sweep, params)
    row = label(sweep, params, raw)
    raw["checkpoint"] = {**raw.get("checkpoint", {}), "dir": str(location(study_dir) / "trials" / trial_id)}
    raw["tracking"] = {**raw.get("tracking", {}), "uri": sweep.tracking_uri, "experiment": sweep.name,
                       "run_name": f"{row} seed={params['seed']}", "parent_run_id": parent_run_id,
                       "tags": {"fedsweep.label": row, "fedsweep.trial_id": trial_id,
                                "fedsweep.swept": json.dumps(sorted(sweep.space))}}
    cfg = validate(raw)
    resume = any((p / "run.json").exists() for p in (location(cfg.checkpoint.dir) / cfg.name).glob("*"))
    last: dict[str, float] = {}

    def on_event(kind: str, data: Any) -> None:
        if kind != "round":
            return
        last.update({k: v for k, v in data["metrics"].items() if isinstance(v, (int, float))})
        report = {k: float(v) for k, v in last.items()}
        report["round"] = data["round"]
        report.setdefault(sweep.metric, math.nan)
        tune.report(report)

    run(cfg, resume=resume, on_event=on_event, placement_group=ray.util.get_current_placement_group(),
        bundle_offset=1)


class InterruptAfter:
    """A Tune callback that interrupts the study like Ctrl-C once ``n`` trials have finished
    (SIGINT: Tune saves its state and stops; ``--resume`` continues). Used to test resumption."""

    def __init__(self, n: int):
        from ray.tune import Callback

        outer = self
        self.n, self.finished = n, 0

        class _Interrupt(Callback):
            def on_trial_complete(self, iteration, trials, trial, **info):
                outer.finished += 1
                if outer.finished == outer.n:
                    import signal

                    os.kill(os.getpid(), signal.SIGINT)

        self.callback = _Interrupt()


# ------------------------------------------------------------------------------ study


def study_dir(sweep: SweepConfig) -> AnyPath:
    return location(sweep.storage).resolve() / sweep.name


def tune_study(sweep: SweepConfig, base: dict[str, Any], resume: bool = False, stop_after_trials: int | None = None,
               verbose: int = 1):
    """Run (or resume) a study; returns (Tune ResultGrid, parent MLflow run id)."""
    import ray
    from ray import tune

    from fedsweep.orchestrator.tracking import Tracker, prepare_store

    root = study_dir(sweep)
    state_file = root / "study.json"
    if resume:
        if not state_file.exists() or not tune.Tuner.can_restore(str(root / "tune")):
            raise ConfigError(f"--resume: no interrupted study '{sweep.name}' under {root}")
        parent_id = json.loads(state_file.read_text())["parent_run_id"]
    else:
        if state_file.exists() and is_uri(root):  # object stores cannot move a folder aside cheaply
            raise ConfigError(f"a study '{sweep.name}' already exists under {root}: continue it with --resume "
                              f"or give the new one another name (--set sweep.name=...)")
        if state_file.exists():
            stamp = time.strftime("%Y%m%d-%H%M%S")
            os.replace(root, root.with_name(f"{root.name}.{stamp}"))  # keep the earlier study, start fresh
        root.mkdir(parents=True, exist_ok=True)
        parent_id = None

    prepare_store(sweep.tracking_uri)  # the driver creates the sqlite schema before any trial
    parent = Tracker(sweep.tracking_uri, sweep.name, run_name=f"study {sweep.name}", run_id=parent_id,
                     tags={"fedsweep.kind": "study", "fedsweep.study": sweep.name})
    if parent_id is None:
        parent.log_params({"sweep.name": sweep.name, "sweep.experiment": sweep.experiment,
                           "sweep.trials": str(trial_count(sweep)), "sweep.metric": sweep.metric,
                           "sweep.mode": sweep.mode, "sweep.space": json.dumps(sorted(sweep.space)),
                           "sweep.variants": json.dumps(sorted(sweep.variants or {})),
                           "sweep.seeds": json.dumps(sweep.seeds)})
        parent.log_text(yaml.safe_dump(sweep.model_dump(mode="json"), sort_keys=False), "sweep.yaml")
        state_file.write_text(json.dumps({"parent_run_id": parent.run_id}))

    started = False
    if not ray.is_initialized():
        from fedsweep.orchestrator import ray_runtime

        ray_runtime.ensure(max(sum(b.get("CPU", 0) for b in trial_bundles(trial_raw(base, sweep, sample))[0])
                               for sample in _corner_samples(sweep)))
        started = True

    def resources(config: dict[str, Any]):
        bundles, strategy = trial_bundles(trial_raw(base, sweep, config))
        return tune.PlacementGroupFactory(bundles, strategy=strategy)

    trainable = tune.with_resources(
        tune.with_parameters(run_trial, sweep=sweep, base=base, study_dir=str(root), parent_run_id=parent.run_id),
        resources)
    interrupt = InterruptAfter(stop_after_trials) if stop_after_trials else None
    status = "FAILED"
    try:
        if resume:
            tuner = tune.Tuner.restore(str(root / "tune"), trainable=trainable, resume_unfinished=True,
                                       resume_errored=True)
        else:
            scheduler = None
            if sweep.scheduler == "asha":
                from ray.tune.schedulers import ASHAScheduler

                scheduler = ASHAScheduler(time_attr="training_iteration", grace_period=sweep.asha.grace_period,
                                          reduction_factor=sweep.asha.reduction_factor,
                                          max_t=max(int(base.get("rounds", 2)), 1))
            tuner = tune.Tuner(
                trainable, param_space=param_space(sweep),
                tune_config=tune.TuneConfig(metric=sweep.metric, mode=sweep.mode, num_samples=sweep.num_samples,
                                            scheduler=scheduler, search_alg=_searcher(sweep),
                                            max_concurrent_trials=sweep.max_concurrent_trials),
                run_config=tune.RunConfig(name="tune", storage_path=str(root), verbose=verbose,
                                          callbacks=[interrupt.callback] if interrupt else None),
            )
        results = tuner.fit()
        unfinished = [r for r in results if not r.metrics or r.metrics.get("round", 0) < _rounds(base)]
        status = "FINISHED" if not results.errors and not unfinished else "RUNNING"
        return results, parent.run_id
    finally:
        if status == "FINISHED":
            parent.finish("FINISHED")
        elif status == "FAILED":
            parent.finish("FAILED")
        if started:
            ray.shutdown()


def _rounds(base: dict[str, Any]) -> int:
    return int(base.get("rounds", 2))


def _corner_samples(sweep: SweepConfig) -> list[dict[str, Any]]:
    """Every variant × every value of every grid dimension's extremes: to size the local runtime."""
    out = []
    variants = list(sweep.variants or {"_": {}})
    dims = {k: [d.examples()[0], d.examples()[-1]] for k, d in sweep.space.items()}
    for variant, combo in itertools.product(variants, itertools.product(*dims.values()) if dims else [()]):
        out.append({"variant": variant, "seed": sweep.seeds[0], **dict(zip(dims, combo))})
    return out


def _searcher(sweep: SweepConfig):
    if sweep.searcher == "random":
        return None
    if sweep.searcher == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch
        except ImportError:
            raise ConfigError("searcher optuna needs the optuna package (pip install optuna)") from None
        return OptunaSearch()
    try:
        from ray.tune.search.ax import AxSearch
    except ImportError:
        raise ConfigError("searcher ax needs the ax-platform package") from None
    return AxSearch()
