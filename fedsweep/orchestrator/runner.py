"""Experiment lifecycle: data -> placement group -> actors -> rounds -> tracking -> clean-up.

The driver never touches a GPU. :class:`Experiment` validates and partitions before any
actor starts (so bad config or data fail in one line, early), starts the client and
server actors in one placement group sized from the config (``setup``), drives the
ServerActor round by round and logs every round to MLflow (``run_rounds``), and cleans
up whatever happens (``teardown``). :func:`run` is the three in order.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml

from fedsweep import checkpoint as ckpt
from fedsweep.algorithms import registry
from fedsweep.config import ExperimentConfig, load_config
from fedsweep.data.partition import ClientData
from fedsweep.errors import RunError
from fedsweep.orchestrator.runtime import ray_runtime
from fedsweep.orchestrator.experiment_data import prepare_clients, prepare_data
from fedsweep.orchestrator.server_keeper import ServerKeeper, ServerLost
from fedsweep.orchestrator.runtime.placement import check_gpus, cluster_view, placement, sharded_placement
from fedsweep.plan.resolve import PLAN_NOT_MADE, resolve_layout
from fedsweep.orchestrator.run_dirs import (abandoned, checkpoint_base, lease, new_run_dir,
                                            resumable_run, write_run_info)
from fedsweep.storage import AnyPath, redacted, sqlite_file, write_atomic


@dataclass
class Outcome:
    run_dir: AnyPath
    run_id: str | None
    tracking_uri: str | None
    rounds: list[dict[str, Any]] = field(default_factory=list)
    clients: list[ClientData] = field(default_factory=list)
    server_replacements: list[dict[str, Any]] = field(default_factory=list)
    """Each server actor replaced: the round it died in, the round restored, seconds, why."""
    tracking_left: int = 0
    """Tracking records still waiting for the server when the run ended (its outbox sends them later)."""

    @property
    def last_eval(self) -> dict[str, Any] | None:
        return next((r for r in reversed(self.rounds) if r["evaluated"]), None)


def root_cause(exc: BaseException) -> str:
    """The last line of the innermost error a Ray failure carries (the actor's own exception)."""
    lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
    errors = [l for l in lines if l.split(":")[0].endswith(("Error", "Exception"))]
    return errors[-1] if errors else (lines[-1] if lines else type(exc).__name__)


class Experiment:
    """One experiment run (or resumption). ``placement_group``: place the actors in this existing group
    (a Tune trial's), server at bundle ``bundle_offset`` and client actors after it; otherwise a group
    is made here and removed in :meth:`teardown`.

    ``phases`` holds the seconds of each start-up and tear-down phase (``fedsweep bench run`` reports
    them); data preparation and the tracking run are made while Ray starts, so those overlap."""

    def __init__(self, cfg: ExperimentConfig, *, resume: bool = False,
                 on_event: Callable[[str, Any], None] | None = None, placement_group=None, bundle_offset: int = 0):
        self.cfg = cfg
        self.resume = resume
        self.emit = on_event or (lambda kind, data: None)
        self.bundle_offset = bundle_offset
        self.pg = placement_group
        self.owned_pg = placement_group is None
        self.group_pgs: list = []  # one per sharded client, made here (clients.shard)
        self.tracker = None
        self.actors: list = []
        self.server = None
        self.keeper: ServerKeeper | None = None
        self.started_ray = False
        self.outcome: Outcome | None = None
        self.first_round = 1
        self.layout = None
        self._log_params = False
        self._memory = PLAN_NOT_MADE  # the memory planner's plan of a GPU actor (made while Ray starts)
        self._tracking = None  # the future of _start_tracking
        self.state_root = None  # the run's checkpoint root (round folders, and the journal of round records)
        self._queued_through = 0  # the rounds whose records are in the tracking outbox (1.. this)
        self.phases: dict[str, float] = {}
        self._info: dict[str, Any] = {}  # run.json's content (written under _info_lock: the outbox's thread
        self._info_lock = threading.Lock()  # writes the run id when the server made the run)
        self._run_folder = None

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    # ---------------------------------------------------------------------- setup
    def setup(self) -> None:
        """Run folder; then, while Ray starts, data and (in a thread of its own, joined once the actors
        are up) the tracking run; the layout; the placement group; client and server actors started
        together."""
        cfg, emit = self.cfg, self.emit
        run_dir, info = self._run_dir()
        self.state_root = state_root = run_dir / "checkpoints"
        last, skipped = ckpt.latest_intact(state_root)
        if skipped and last is None:
            raise RunError(f"--resume: no intact checkpoint round under {state_root} ({'; '.join(skipped)})")
        if skipped:
            emit("warning", f"checkpoint {'; '.join(skipped)}: resuming from {last.name} instead")
        self.first_round = int(last.name.split("_")[-1]) + 1 if last is not None else 1
        pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fedsweep-prepare")
        prepared = pool.submit(self._prepare)
        self._tracking = pool.submit(self._start_tracking, run_dir, info, prepared)
        pool.shutdown(wait=False)
        try:
            with self.phase("ray_init"):
                self.started_ray = ray_runtime.ensure(self._cpus_asked())
            check_gpus(cfg)
        finally:
            clients, pool_records, public = prepared.result()  # its errors first: they are the user's
        self.outcome = Outcome(run_dir, None, None, clients=clients)
        if self.owned_pg or not cfg.layout_chosen:  # a set layout is checked too (a trial's, by the study)
            with self.phase("layout"):
                self.cfg, self.layout = resolve_layout(cfg, cluster_view(cfg, total=cfg.layout_chosen), self._memory)
            cfg = self.cfg
            emit("layout", self.layout)
        config_text = yaml.safe_dump(redacted(cfg.to_dict()), sort_keys=False)  # resolved once (the layout above): the run folder's and MLflow's copy, no URI's credentials
        write_atomic(run_dir / "config.yaml", config_text.encode())
        emit("status", f"starting {cfg.num_actors} client actor(s) for {cfg.clients.num_clients} clients")
        if self.owned_pg:
            with self.phase("placement_group"):
                self.pg = placement(cfg)
                self.group_pgs = sharded_placement(cfg) if cfg.clients.shard else []
        restore = str(last) if last is not None else None
        with self.phase("actors"):
            self._start_actors(clients, pool_records, str(state_root), public, restore)
        with self.phase("tracking_wait"):
            self._tracking.result()
        run_id = self.tracker.run_id if self.tracker else None  # (run.json has it since the run exists)
        self.outcome.run_id = run_id
        self.outcome.tracking_uri = cfg.tracking.uri if self.tracker else None
        if self.tracker:
            if self._log_params:  # a resumed run logged them when it started
                self.tracker.log_text(config_text, "config.yaml")
                self.tracker.log_params(flatten_config(cfg))
                if self.layout is not None:
                    self.tracker.set_tags({"fedsweep.layout": self.layout.describe()})
            import ray

            nodes = ray.get([a.node_id.remote() for a in self.actors], timeout=60)
            self.tracker.set_tags({"fedsweep.actor_nodes": ",".join(sorted(set(nodes)))})
            # a resumed run: what its last driver did not log, and what the store lacks (queued on another
            # machine, or lost with an outbox: a round is delivered when the store has it)
            self._log_committed(self.first_round - 1, self._rounds_in_store() if self.resume else None)

    def _cpus_asked(self) -> float:
        """Logical CPUs an explicit layout asks for (a local runtime is made at least this large)."""
        cfg = self.cfg
        return cfg.server.resources.num_cpus + (cfg.num_actors * cfg.clients.shards * cfg.clients.resources.num_cpus
                                                if cfg.layout_chosen else 0.0)

    def _prepare(self):
        """Data, models and the GPU memory plan (in a thread, while Ray starts)."""
        cfg = self.cfg
        with self.phase("data"):
            clients, holdout, public = prepare_data(cfg)
        pool = holdout if registry.capabilities(cfg.algorithm).validation_pool else None
        with self.phase("models"):
            self._prepare_models()
        if not cfg.layout_chosen and cfg.clients.resources.num_gpus > 0:
            with self.phase("memory_plan"):  # the planner's simulated step: the layout's GPU check, the batch plan
                from fedsweep.plan.resolve import memory_plan

                self._memory = memory_plan(cfg)
        return clients, pool, public

    def _prepare_models(self) -> None:
        from fedsweep.models.loading import resolve
        from fedsweep.models.shapes import made_in_code

        for name in sorted(set(self.cfg.client_models())):
            if not made_in_code(name):
                self.emit("status", f"preparing model {name}")
                resolve(name, self.cfg.model.cache_dir)  # converts bundled weights once, before actors start

    def _run_dir(self) -> tuple[AnyPath, dict[str, Any]]:
        """The run's folder and ``run.json`` (written at once: the run can be resumed from here on, and this
        driver holds it), a resumed run's checked against this config. A run of the same config whose
        driver is gone without ending it is marked KILLED in MLflow first (``run_dirs.abandoned``)."""
        cfg = self.cfg
        run_dir, info = resumable_run(cfg) if self.resume else (None, None)
        abandoned(checkpoint_base(cfg), self._mark_killed, keep=run_dir)
        if not self.resume:
            run_dir, info = new_run_dir(cfg), {"config": redacted(cfg.to_dict()), "run_id": None, "driver": lease()}
        else:
            info.pop("ended", None)
            info["driver"] = lease()
        write_run_info(run_dir, info)
        self._run_folder, self._info = run_dir, info
        return run_dir, info

    def _mark_killed(self, run_id: str, info: dict | None = None) -> None:
        """An abandoned run's MLflow run ended KILLED where it is still RUNNING (raises where the tracking
        server does not answer: the next command tries again)."""
        if not self.cfg.tracking.enabled:
            return
        from fedsweep.orchestrator.tracking.tracker import end_abandoned

        end_abandoned(self.cfg.tracking.uri, run_id)

    def _start_tracking(self, run_dir: AnyPath, info: dict[str, Any], prepared) -> None:
        """The MLflow run and (once ``prepared`` has them) its clients, in a thread while Ray starts and
        the actors import; ``setup`` joins it once the actors are up and logs the resolved config."""
        cfg = self.cfg
        if not cfg.tracking.enabled:
            return
        with self.phase("tracking"):
            from fedsweep.orchestrator.tracking.outbox import RUN_DIR_TAG
            from fedsweep.orchestrator.tracking.tracker import RUN_CHARTS, Tracker, prepare_store, run_tags

            try:
                prepare_store(cfg.tracking.uri)  # (begun while Ray started, or made now)
            except Exception:  # noqa: BLE001  (a server that does not answer yet: the outbox waits for it)
                if sqlite_file(cfg.tracking.uri) is not None:
                    raise
            self._log_params = not info.get("run_id")  # (params again to a run found by its folder: the same values)
            self.tracker = Tracker(cfg.tracking.uri, cfg.tracking.experiment or cfg.name,
                                   run_name=cfg.tracking.run_name or f"{cfg.name}-{cfg.algorithm}",
                                   run_id=info.get("run_id"), parent_run_id=cfg.tracking.parent_run_id,
                                   tags={**run_tags(cfg), RUN_DIR_TAG: str(run_dir), **cfg.tracking.tags},
                                   folder=_outbox_folder(run_dir), say=lambda line: self.emit("warning", line),
                                   find=self.resume or not self._log_params,
                                   view={"metric": "test_loss", "mode": "min", "charts": RUN_CHARTS, "replace": False},
                                   on_open=self._keep_run_id)
            if self.tracker.run_id:  # the run exists: its id in run.json at once (else when the server makes it)
                self._keep_run_id(self.tracker.run_id)
            if self._log_params:
                clients = prepared.result()[0]
                self.tracker.log_text(json.dumps([{"cid": c.cid, "tasks": c.tasks, "train": len(c.train),
                                                   "test": len(c.test)} for c in clients], indent=1), "clients.json")

    def _keep_run_id(self, run_id: str) -> None:
        """The MLflow run's id into ``run.json`` (atomically), the moment it is known."""
        with self._info_lock:
            if self._info.get("run_id") != run_id:
                self._info["run_id"] = run_id
                write_run_info(self._run_folder, self._info)
        if self.outcome is not None:
            self.outcome.run_id = run_id

    def _start_actors(self, clients: list[ClientData], pool, state_root: str, public, restore: str | None) -> None:
        """Every client actor and the server at once: the server imports and builds its method while
        the clients load their model, and takes θ_0 from the first client actor directly (no round
        trip through the driver)."""
        import ray

        from fedsweep.actors import remote
        from fedsweep.actors.inputs import keep

        cfg = self.cfg
        groups = cfg.actor_groups()
        self.assignment = {cid: a for a, group in enumerate(groups) for cid in group}
        # A restarted client actor's constructor gets its first arguments again: the large ones (its
        # clients' data, the validation pool) are kept in the run folder and the actor reads them there
        # (``actors.inputs``), so a restart never depends on an object-store entry a lost node took
        inputs = self._run_folder / "inputs"
        kept_pool = keep(inputs, "pool.pkl", pool) if pool is not None else None
        for a in range(len(groups)):
            hosted = [{"cid": c.cid, "train": c.train, "test": c.test, "val": c.val}
                      for c in clients if self.assignment[c.cid] == a]
            if cfg.clients.shard:
                self.actors.append(remote.sharded_client(cfg, self._process_slots(a), cfg, hosted, restore, pool))
            else:
                self.actors.append(remote.client_actor(cfg, self.pg, self.bundle_offset + a + 1).remote(
                    cfg, keep(inputs, f"actor_{a:03d}.pkl", hosted), restore, kept_pool))
        ranks = cfg.client_ranks()
        infos = [{"cid": c.cid, "num_examples": len(c.train), "tasks": c.tasks, "rank": ranks[c.cid],
                  "lora_scale": cfg.lora.alpha / ranks[c.cid]} for c in clients]
        # boxed in a list, so that Ray does not wait for θ_0 before it starts the server's process
        theta0 = [self.actors[0].initial_params.remote()] if restore is None else None
        self.keeper = ServerKeeper(cfg, self.pg, self.bundle_offset, self.actors,
                                   {"infos": infos, "assignment": self.assignment, "state_root": state_root,
                                    "public": public}, self.emit)
        self.server = self.keeper.start(restore, theta0)
        completed = self.server.completed_rounds.remote()
        try:
            ray.get([a.ping.remote() for a in self.actors], timeout=600)
        except ray.exceptions.RayActorError as exc:
            raise RunError(f"a client actor failed to start: {root_cause(exc)}") from None
        self.emit("actors", self.actors)
        try:
            completed = ray.get(completed, timeout=600)
        except ray.exceptions.RayActorError as exc:
            raise RunError(f"the server actor failed to start: {root_cause(exc)}") from None
        if completed != self.first_round - 1:
            raise RunError(f"server restored round {completed}, expected {self.first_round - 1}")

    def _process_slots(self, a: int) -> list[tuple[Any, int]]:
        """(placement group, bundle) of each process of sharded client ``a``: its own group's bundles, or
        (a trial's one placement group) its processes' bundles side by side after the server's."""
        if self.group_pgs:
            return [(self.group_pgs[a], r) for r in range(self.cfg.clients.shards)]
        first = self.bundle_offset + 1 + a * self.cfg.clients.shards
        return [(self.pg, first + r) for r in range(self.cfg.clients.shards)]

    # ---------------------------------------------------------------------- rounds
    def run_rounds(self, stop_after: int | None = None) -> Outcome:
        """Every remaining round, each logged and announced once. ``stop_after`` ends the run after that
        round as a crash would (checkpoint written, tracking run left FAILED): used to test resumption.
        A server actor that dies is replaced from the newest committed round (``orchestrator.server_keeper``)
        and the rounds after it run again; they are logged once, as their first run was."""
        cfg, emit = self.cfg, self.emit
        emit("start", {"first": self.first_round, "rounds": cfg.rounds})
        rnd = self.first_round
        while rnd <= cfg.rounds:
            try:
                summary = self._round(rnd)
            except ServerLost as lost:
                self.server, completed = self.keeper.replace(self.server, rnd, str(lost))
                if self.tracker:
                    self.tracker.log_metrics({"server_replacements": float(self.keeper.replacements)}, step=rnd)
                self._log_committed(completed)  # a round the lost server committed but never answered
                rnd = completed + 1
                continue
            if any(r["round"] == rnd for r in self.outcome.rounds):  # run again after a replacement
                self.outcome.rounds = [summary if r["round"] == rnd else r for r in self.outcome.rounds]
            else:
                self.outcome.rounds.append(summary)
                emit("round", summary)
            if self.cfg.checkpoint.enabled:
                self._log_committed(summary["committed_round"])
            elif self.tracker:  # (nothing is committed: the round is logged as it comes)
                self.tracker.log_round(summary)
            if stop_after is not None and rnd >= stop_after and rnd < cfg.rounds:
                raise RunError(f"stopped after round {rnd} (stop_after)")
            rnd += 1
        self.outcome.server_replacements = list(self.keeper.log)
        return self.outcome

    def _rounds_in_store(self) -> set[int] | None:
        """The rounds whose records the tracking store has (their ``round`` metric), None where it cannot
        be asked now (the server away, the run not opened yet)."""
        try:
            if self.tracker is None or self.tracker.run_id is None:
                return None
            return {m.step for m in self.tracker.client.get_metric_history(self.tracker.run_id, "round")}
        except Exception:  # noqa: BLE001
            return None

    def _log_committed(self, upto: int | None, in_store: set[int] | None = None) -> None:
        """Every committed round up to ``upto`` whose record is not in the tracking outbox yet (or, where
        ``in_store`` is known, that the store lacks), handed to it from the journal
        (``checkpoint.read_record``) and marked (``checkpoint.mark_queued``). A round is logged once it
        is committed, never before: a run that resumes from its last committed round logs what its
        driver did not, and a record sent twice is logged once (its timestamps)."""
        if not self.tracker or not self.cfg.checkpoint.enabled or not upto or self.state_root is None:
            return
        for rnd in range(self._queued_through + 1, upto + 1):
            if not ckpt.record_queued(self.state_root, rnd) or (in_store is not None and rnd not in in_store):
                record = ckpt.read_record(self.state_root, rnd)
                if record is None:  # committed before rounds had records (an older run), or pruned
                    continue
                self.tracker.log_round(record)
                ckpt.mark_queued(self.state_root, rnd)
            self._queued_through = rnd

    def _round(self, rnd: int) -> dict[str, Any]:
        """Round ``rnd`` on the server actor, its progress announced while it runs. Raises RunError when
        the round failed, ServerLost when the server's process died."""
        import ray

        future = self.server.run_round.remote(rnd)
        self.emit("round_start", rnd)
        try:
            while True:
                ready, _ = ray.wait([future], timeout=0.5)
                if ready:
                    break
                self.emit("progress", ray.get(self.server.progress.remote(), timeout=60))
            return ray.get(future, timeout=60)
        except ray.exceptions.RayTaskError as exc:  # the round itself failed: one line, not a traceback
            raise RunError(f"round {rnd} failed: {root_cause(exc)}") from None
        except ray.exceptions.RayActorError as exc:
            raise ServerLost(root_cause(exc)) from None

    # -------------------------------------------------------------------- teardown
    def _flush_checkpoint(self) -> None:
        """A run that stops early (a failed round, an interrupt) keeps the round whose files were still
        being written (``checkpoint.overlap``): committed now if the server and the actors answer."""
        import ray

        if self.server is None or not self.cfg.checkpoint.enabled:
            return
        try:
            ray.get(self.server.flush_checkpoint.remote(), timeout=min(self.cfg.server.call_timeout_s, 300.0))
        except Exception:
            pass

    def teardown(self, status: str) -> None:
        """Commit a round still being written, log every committed round not logged yet, kill the
        actors, remove the placement group made here, stop a Ray runtime started here, and end the
        tracking run with ``status`` once its records are delivered (waiting for the tracking server up
        to ``tracking.wait_s``; what waits longer is kept for ``fedsweep runs --sync``)."""
        import ray

        with self.phase("teardown"):
            if self._tracking is not None:  # setup failed early: let the tracking run exist, to be ended
                try:
                    self._tracking.result(timeout=120)
                except Exception:
                    pass
            if ray.is_initialized():
                self._flush_checkpoint()
                self._stop_actors()
            if self.state_root is not None and self.cfg.checkpoint.enabled:
                self._log_committed(max(ckpt.complete_rounds(self.state_root), default=0))
            if self.outcome is not None:  # the driver lets go of the run: how it ended
                try:
                    with self._info_lock:
                        self._info["ended"] = status
                        self._info.pop("driver", None)
                        write_run_info(self.outcome.run_dir, self._info)
                except OSError:
                    pass
            if self.tracker:
                # a study's trial never holds its resources for the server: its driver sends what waits
                left = self.tracker.finish(status, self.cfg.tracking.wait_s, leave_when_away=not self.owned_pg)
                if self.outcome is not None:
                    self.outcome.tracking_left, self.outcome.run_id = left, self.tracker.run_id
                if left and self.cfg.tracking.wait_s > 0:
                    self.emit("warning", f"{left} tracking record(s) still wait in {self.tracker.outbox.folder}: "
                                         f"the tracking server did not answer within tracking.wait_s="
                                         f"{self.cfg.tracking.wait_s:g}s; `fedsweep runs --sync` sends them")

    def _stop_actors(self) -> None:
        import ray

        for handle in self.actors + ([self.server] if self.server is not None else []):
            try:
                ray.kill(handle)
            except Exception:
                pass
        if self.pg is not None and self.owned_pg:
            from ray.util.placement_group import remove_placement_group

            for pg in [self.pg] + self.group_pgs:
                remove_placement_group(pg)
        if self.started_ray:
            ray.shutdown()


def run(cfg: ExperimentConfig, *, resume: bool = False, on_event: Callable[[str, Any], None] | None = None,
        stop_after: int | None = None, placement_group=None, bundle_offset: int = 0) -> Outcome:
    """Run (or resume) one experiment to completion: :class:`Experiment` setup, rounds, teardown."""
    experiment = Experiment(cfg, resume=resume, on_event=on_event, placement_group=placement_group,
                            bundle_offset=bundle_offset)
    status = "FAILED"
    try:
        experiment.setup()
        outcome = experiment.run_rounds(stop_after)
        status = "FINISHED"
        return outcome
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        experiment.teardown(status)


def _outbox_folder(run_dir: AnyPath):
    """Where a run's tracking writes wait until delivered: its folder when local (beside its journal;
    an absolute path, one per run), else a folder of this machine's named after the run's URI (an
    object store cannot hold an outbox's small renamed files)."""
    import hashlib
    from pathlib import Path

    from fedsweep.orchestrator.tracking.outbox import OUTBOX

    if isinstance(run_dir, Path):
        return run_dir.resolve() / OUTBOX
    return Path.home() / ".cache" / "fedsweep" / OUTBOX / hashlib.sha256(str(run_dir).encode()).hexdigest()[:20]


def flatten_config(cfg: ExperimentConfig) -> dict[str, str]:
    from fedsweep.orchestrator.tracking.tracker import flatten

    return flatten(redacted(cfg.to_dict()))


def validate_file(path: str, overrides: list[str]) -> tuple[ExperimentConfig, list[ClientData]]:
    """Config and data checks that ``fedsweep validate`` runs (no actors, no tracking)."""
    cfg = load_config(path, overrides)
    clients, _, _ = prepare_data(cfg)
    return cfg, clients


__all__ = ["Experiment", "Outcome", "RunError", "prepare_clients", "prepare_data", "root_cause", "run", "validate_file"]
