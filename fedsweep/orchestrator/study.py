"""``fedsweep tune``: a Ray Tune study, one full experiment per trial (the file: ``config.sweep``).

Each trial runs the whole experiment (server and client actors) inside the trial's own
placement group — a bundle for the trial driver, one for the server, one per client
actor — so trials never starve each other; per-round metrics go to Tune. MLflow holds
one parent run per study and one child run per trial. An interrupted study continues
with ``--resume`` (Tune's restore); a trial cut mid-way resumes from its own checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from typing import Any

from pathlib import Path

import yaml

from fedsweep.config import ConfigError
from fedsweep.errors import RunError
from fedsweep.config.sweep import (Dimension, SweepConfig, corner_samples, label, run_name, trial_count, trial_raw,
                                   validated)
from fedsweep.storage import (AnyPath, is_uri, location, private_dir, redacted, sqlite_file, without_userinfo,
                              write_atomic)

DRIVER_BUNDLE = {"CPU": 0.05}
STUDY_WAIT_S = 900.0
"""How long a study's driver waits, at its end, for the tracking server to take the study run's own
writes (each trial waits for its own up to its ``tracking.wait_s``)."""


def domain(dim: Dimension):
    """A sweep dimension as a Tune search domain."""
    from ray import tune

    if dim.grid is not None:
        return tune.grid_search(dim.grid)
    if dim.choice is not None:
        return tune.choice(dim.choice)
    if dim.uniform is not None:
        return tune.uniform(*dim.uniform)
    return tune.loguniform(*dim.loguniform)


def param_space(sweep: SweepConfig) -> dict[str, Any]:
    from ray import tune

    space: dict[str, Any] = {"seed": tune.grid_search(sweep.seeds)}
    if sweep.variants:
        space["variant"] = tune.grid_search(list(sweep.variants))
    for key, dim in sweep.space.items():
        space[key] = domain(dim)
    return space


# ------------------------------------------------------------------------------ trials


def trial_config(raw: dict[str, Any], free: dict[str, float] | None, share: float = 1.0):
    """A trial's validated config with its actor layout chosen for the study's cluster: ``free`` is
    the snapshot of Ray's free resources taken when the study started (so the driver, sizing the
    trial's placement group, and the trial itself choose the same layout), ``share`` the part of it
    one trial may use (1 / ``max_concurrent_trials``). Validated once per distinct ``raw`` in a
    process (:func:`~fedsweep.config.sweep.validated`): the driver's sizing of the placement group
    and the trial's own run are one validation each."""
    from fedsweep.orchestrator.runtime.placement import cluster_view
    from fedsweep.plan.resolve import resolve_layout

    cfg = validated(raw)
    cfg, _ = resolve_layout(cfg, cluster_view(cfg, free, DRIVER_BUNDLE["CPU"], share))  # a set one is checked
    return cfg


def trial_bundles(cfg) -> tuple[list[dict[str, float]], str]:
    """A trial's placement group: its driver's bundle, then the experiment's (server, client actors)."""
    from fedsweep.orchestrator.runtime.placement import experiment_bundles

    return [DRIVER_BUNDLE] + experiment_bundles(cfg), cfg.clients.placement_strategy


def explicit_cpus(raw: dict[str, Any]) -> float:
    """CPUs of a trial whose layout is set in its file (0 for the actors of an ``auto`` layout)."""
    cfg = validated(raw)
    actors = cfg.num_actors * cfg.clients.resources.num_cpus if cfg.layout_chosen else 0.0
    return DRIVER_BUNDLE["CPU"] + cfg.server.resources.num_cpus + actors


def run_trial(params: dict[str, Any], sweep: SweepConfig, base: dict[str, Any], study_dir: str,
              parent_run_id: str | None, free: dict[str, float] | None = None, share: float = 1.0) -> None:
    """One Tune trial: the full experiment in this trial's placement group, reporting every round."""
    import ray
    from ray import tune

    from fedsweep.orchestrator.runner import run

    ctx = tune.get_context()
    trial_id = ctx.get_trial_id()
    raw = trial_raw(base, sweep, params)
    row = label(sweep, params, raw)  # the comparison row: run_name without the seed
    raw["checkpoint"] = {**raw.get("checkpoint", {}), "dir": str(location(study_dir) / "trials" / trial_id)}
    raw["tracking"] = {**raw.get("tracking", {}), "uri": sweep.tracking_uri, "experiment": sweep.name,
                       "run_name": run_name(sweep, params, raw), "parent_run_id": parent_run_id,
                       "tags": {"fedsweep.label": row, "fedsweep.trial_id": trial_id, "fedsweep.kind": "trial",
                                "fedsweep.study": sweep.name,
                                "variant": params.get("variant") or raw.get("algorithm", "fedavg"),
                                "fedsweep.swept": json.dumps(sorted(sweep.space))}}
    cfg = trial_config(raw, free, share)
    earlier = sorted(p for p in (location(cfg.checkpoint.dir) / cfg.name).glob("*") if (p / "run.json").exists())
    # a trial cut short (its study's driver killed) resumes from its own last committed round, with the
    # metrics its rounds so far reported (their records)
    last, done = rounds_so_far(earlier[-1]) if earlier else ({}, 0)
    reported = []

    def report(rnd: int) -> None:
        out = {k: float(v) for k, v in last.items()}
        out["round"] = rnd
        out.setdefault(sweep.metric, math.nan)
        tune.report(out)
        reported.append(rnd)

    def on_event(kind: str, data: Any) -> None:
        if kind != "round":
            return
        add_totals(last, data["metrics"])
        last.update({k: v for k, v in data["metrics"].items() if isinstance(v, (int, float))})
        report(data["round"])

    # (a trial without checkpoints starts again: its cut run is marked KILLED by ``run_dirs.abandoned``)
    run(cfg, resume=bool(earlier) and cfg.checkpoint.enabled, on_event=on_event, placement_group=ray.util.get_current_placement_group(),
        bundle_offset=1)
    if not reported:  # every round was committed before this trial restarted: where it ended, once more
        report(done)


def rounds_so_far(run_dir) -> tuple[dict[str, float], int]:
    """The newest value of each metric over a run's committed rounds (their records in the journal)
    and the last committed round: what a trial reported before its driver died."""
    from fedsweep import checkpoint as ckpt

    last: dict[str, float] = {}
    done = max(ckpt.complete_rounds(run_dir / "checkpoints"), default=0)
    for rnd in range(1, done + 1):
        record = ckpt.read_record(run_dir / "checkpoints", rnd)
        if record is not None:
            add_totals(last, record["metrics"])
            last.update({k: v for k, v in record["metrics"].items() if isinstance(v, (int, float))})
    return last, done


TOTALLED = ("round_seconds", "final_update_seconds", "phase/aggregate_s", "phase/prepare_host_s")
"""A round's metrics a trial reports summed over its rounds so far (``total/<key>``), with every ``work/*``:
what the study's ideal reads (``bench.study_ideal``)."""


def add_totals(totals: dict[str, float], metrics: dict[str, Any]) -> None:
    """A round's :data:`TOTALLED` and ``work/*`` metrics added into ``totals`` (as ``total/<key>``)."""
    for key, value in metrics.items():
        if (key in TOTALLED or key.startswith("work/")) and isinstance(value, (int, float)):
            totals[f"total/{key}"] = totals.get(f"total/{key}", 0.0) + float(value)


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
               verbose: int = 0, progress: bool = False):
    """Run (or resume) a study; returns (Tune ResultGrid, parent MLflow run id). ``verbose``: Tune's
    own reporter (0 quiet); ``progress``: fedsweep's progress view on the console, Tune's events and
    every trial's rounds and errors in ``<study dir>/study.log``."""
    import ray
    from ray import tune

    from fedsweep.orchestrator.runtime import ray_runtime

    root = study_dir(sweep)
    parent = _parent_run(sweep, base, root, _study_folder(sweep, base, root, resume))
    started = ray_runtime.ensure(max(explicit_cpus(trial_raw(base, sweep, sample)) for sample in corner_samples(sweep)),
                                 log_to_driver=verbose > 0 or not progress)
    free = dict(ray.available_resources())  # one snapshot: every trial's auto layout is chosen from it
    share = 1.0 / sweep.max_concurrent_trials if sweep.max_concurrent_trials else 1.0

    def resources(config: dict[str, Any]):
        bundles, strategy = trial_bundles(trial_config(trial_raw(base, sweep, config), free, share))
        return tune.PlacementGroupFactory(bundles, strategy=strategy)

    trainable = tune.with_resources(
        tune.with_parameters(run_trial, sweep=sweep, base=base, study_dir=str(root), parent_run_id=parent.run_id,
                             free=free, share=share),
        resources)
    interrupt = InterruptAfter(stop_after_trials) if stop_after_trials else None
    callbacks = [interrupt.callback] if interrupt else []
    view = None
    if progress:
        from fedsweep.orchestrator.study_view import StudyCallback, StudyView

        view = StudyView(trial_count(sweep), sweep.metric, sweep.mode, _rounds(base),
                         lambda params: run_name(sweep, params, trial_raw(base, sweep, params)), root / "study.log")
        if not resume:  # a resumed study's callbacks come back with it, and feed this view
            callbacks.append(StudyCallback())
    courier = _courier(sweep, root, view)
    status = "FAILED"
    try:
        tuner = _tuner(sweep, base, root, trainable, resume, verbose, callbacks)
        with quiet_tune(verbose == 0), view or contextlib.nullcontext():
            results = tuner.fit()
        unfinished = [r for r in results if not r.metrics or r.metrics.get("round", 0) < _rounds(base)]
        status = "FINISHED" if not results.errors and not unfinished else "RUNNING"
        return results, parent.run_id
    finally:
        if courier is not None:  # what the trials left for the server, before the study's own end
            left = courier.finish(STUDY_WAIT_S)
            if left:
                from fedsweep.orchestrator.terminal import console

                console.print(f"[yellow]tracking[/]: {left} trial record(s) still wait below {root}: "
                              f"`fedsweep runs --sync --root {root}` sends them", highlight=False, soft_wrap=True)
        if status in ("FINISHED", "FAILED"):
            parent.finish(status, STUDY_WAIT_S)
        else:
            parent.outbox.drain(STUDY_WAIT_S)
            parent.outbox.close()
        if started:
            ray.shutdown()


def _courier(sweep: SweepConfig, root, view):
    """The courier of the study's trials' outboxes (a local study folder), its count on the progress line."""
    if not isinstance(root, Path):
        return None
    from fedsweep.orchestrator.tracking.courier import Courier

    on_count = view.tracking if view is not None else None
    return Courier(root / "trials", sweep.tracking_uri, on_count).start()


STUDY_RESUMABLE = ("tracking.wait_s", "server.call_timeout_s")
"""What ``tune --resume`` lets change in the base experiment: how long to wait, nothing a trial computes
(the sweep itself may not change at all)."""


def _study_folder(sweep: SweepConfig, base: dict[str, Any], root, resume: bool) -> str | None:
    """The study's folder ready (a finished study of the same name moved aside, a resumed one checked
    against the sweep and base experiment its ``study.json`` keeps); the parent MLflow run id of a
    resumed study, None for a new one."""
    from ray import tune

    state_file = root / "study.json"
    if resume:
        if not state_file.exists() or not tune.Tuner.can_restore(str(root / "tune")):
            raise ConfigError(f"--resume: no interrupted study '{sweep.name}' under {root}")
        state = json.loads(state_file.read_text())
        study_change(state, sweep, base)
        return state["parent_run_id"]
    if state_file.exists() and is_uri(root):  # object stores cannot move a folder aside cheaply
        raise ConfigError(f"a study '{sweep.name}' already exists under {root}: continue it with --resume "
                          f"or give the new one another name (--set sweep.name=...)")
    if state_file.exists():
        stamp = time.strftime("%Y%m%d-%H%M%S")
        os.replace(root, root.with_name(f"{root.name}.{stamp}"))  # keep the earlier study, start fresh
    private_dir(root)
    return None


def study_state(sweep: SweepConfig, base: dict[str, Any], parent_run_id: str | None) -> dict[str, Any]:
    """``study.json``: the parent run's id and what the study runs (the sweep and the base experiment,
    ``--set`` applied), which a resume must match."""
    return redacted({"parent_run_id": parent_run_id, "sweep": sweep.model_dump(mode="json"), "base": base})


def study_change(state: dict[str, Any], sweep: SweepConfig, base: dict[str, Any]) -> None:
    """A :class:`ConfigError` naming the first field in which the sweep or the base experiment differs
    from the study's ``study.json`` (outside :data:`STUDY_RESUMABLE`). A study from before ``study.json``
    kept them resumes unchecked."""
    from fedsweep.orchestrator.run_dirs import config_difference

    if "sweep" not in state:
        return
    now = json.loads(json.dumps(study_state(sweep, base, None)))
    diff = config_difference(state["sweep"], now["sweep"], "sweep", resumable=())
    diff = diff or config_difference(state["base"], now["base"], "", resumable=STUDY_RESUMABLE)
    if diff:
        raise ConfigError(f"--resume: the study '{sweep.name}' differs from the one interrupted: {diff}")


def _parent_run(sweep: SweepConfig, base: dict[str, Any], root, parent_id: str | None):
    """The study's parent MLflow run: continued (``parent_id``), or created with the sweep's parameters,
    its YAML, a note and the comparison view, and its id kept in ``study.json``."""
    from fedsweep.orchestrator.tracking.tracker import RUN_CHARTS, Tracker, prepare_store

    try:
        prepare_store(sweep.tracking_uri)  # the driver creates the sqlite schema before any trial
    except Exception:  # noqa: BLE001  (a server away: a resumed study goes on, a new one says so below)
        if sqlite_file(sweep.tracking_uri) is not None:
            raise
    from fedsweep.orchestrator.tracking.outbox import OUTBOX

    parent = Tracker(sweep.tracking_uri, sweep.name, run_name=f"study {sweep.name}", run_id=parent_id,
                     tags={"fedsweep.kind": "study", "fedsweep.study": sweep.name, "fedsweep.study_dir": str(root),
                           **({"fedsweep.question": sweep.question.model_dump_json()} if sweep.question else {})},
                     folder=(root / OUTBOX) if isinstance(root, Path) else None,
                     view={"metric": sweep.metric, "mode": sweep.mode, "charts": RUN_CHARTS, "replace": True})
    if parent_id is None:
        if parent.run_id is None:  # its trials are tagged with its id: a new study needs the server once
            parent.outbox.close()
            raise RunError(f"the tracking server at {without_userinfo(sweep.tracking_uri)} does not answer: a new "
                           f"study needs it to make its parent run (its trials then run through an outage)")
        parent.log_params({"sweep.name": sweep.name, "sweep.experiment": sweep.experiment,
                           "sweep.trials": str(trial_count(sweep)), "sweep.metric": sweep.metric,
                           "sweep.mode": sweep.mode, "sweep.space": json.dumps(sorted(sweep.space)),
                           "sweep.variants": json.dumps(sorted(sweep.variants or {})),
                           "sweep.seeds": json.dumps(sweep.seeds)})
        parent.log_text(yaml.safe_dump(redacted(sweep.model_dump(mode="json")), sort_keys=False), "sweep.yaml")
        parent.set_note(f"Study **{sweep.name}**: {trial_count(sweep)} trials of `{sweep.experiment}`, metric "
                        f"`{sweep.metric}` ({sweep.mode}). The comparison table appears here when the study ends.")
        write_atomic(root / "study.json", json.dumps(study_state(sweep, base, parent.run_id), indent=1).encode())
    return parent


def _tuner(sweep: SweepConfig, base: dict[str, Any], root, trainable, resume: bool, verbose: int, callbacks):
    """Tune's tuner of the study: restored (``resume``), or new with its scheduler and searcher."""
    from ray import tune

    if resume:
        return tune.Tuner.restore(str(root / "tune"), trainable=trainable, resume_unfinished=True, resume_errored=True)
    scheduler = None
    if sweep.scheduler == "asha":
        from ray.tune.schedulers import ASHAScheduler

        scheduler = ASHAScheduler(time_attr="training_iteration", grace_period=sweep.asha.grace_period,
                                  reduction_factor=sweep.asha.reduction_factor, max_t=max(int(base.get("rounds", 2)), 1))
    return tune.Tuner(
        trainable, param_space=param_space(sweep),
        tune_config=tune.TuneConfig(metric=sweep.metric, mode=sweep.mode, num_samples=sweep.num_samples,
                                    scheduler=scheduler, search_alg=_searcher(sweep),
                                    max_concurrent_trials=sweep.max_concurrent_trials),
        run_config=tune.RunConfig(name="tune", storage_path=str(root), verbose=verbose, callbacks=callbacks or None),
    )


@contextlib.contextmanager
def quiet_tune(quiet: bool):
    """Tune with nothing on the console: its newer output engine prints an experiment header and a
    results path even at verbosity 0, so a quiet study runs with the older reporter (silent at 0)."""
    from unittest import mock

    with mock.patch.dict(os.environ, {"RAY_AIR_NEW_OUTPUT": "0"} if quiet else {}):
        yield


def _rounds(base: dict[str, Any]) -> int:
    return int(base.get("rounds", 2))


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
