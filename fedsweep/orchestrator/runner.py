"""Experiment lifecycle: data -> placement group -> actors -> rounds -> tracking -> clean-up.

The driver never touches a GPU. It validates and partitions before any actor starts
(so bad config or data fail in one line, early), starts the client and server actors
in one placement group sized from the config, drives the ServerActor round by round,
logs every round to MLflow, and cleans up whatever happens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fedsweep import checkpoint as ckpt
from fedsweep.data import bundled
from fedsweep.data.partition import ClientData, make_clients, return_holdout, split_holdout
from fedsweep.data.records import Record, load_hf, load_jsonl
from fedsweep.orchestrator.config import ConfigError, ExperimentConfig, validate
from fedsweep.orchestrator.tracking import Tracker, flatten, prepare_store
from fedsweep.storage import AnyPath, location

# keys that may differ between a run and its resumption
RESUMABLE_CHANGES = ("rounds", "eval_every", "tracking", "server.call_timeout_s", "eval", "checkpoint.keep")


class RunError(RuntimeError):
    pass


@dataclass
class Outcome:
    run_dir: AnyPath
    run_id: str | None
    tracking_uri: str | None
    rounds: list[dict[str, Any]] = field(default_factory=list)
    clients: list[ClientData] = field(default_factory=list)

    @property
    def last_eval(self) -> dict[str, Any] | None:
        return next((r for r in reversed(self.rounds) if r["evaluated"]), None)


# ------------------------------------------------------------------------------ data


def load_records(cfg: ExperimentConfig) -> list[Record]:
    d = cfg.data
    if d.source == "reasoning_gym" and d.kind == "preference":
        records = bundled.generate_preferences(d.tasks, d.examples_per_task, cfg.seed)
    elif d.source == "reasoning_gym":
        records = bundled.generate(d.tasks, d.examples_per_task, cfg.seed)
    elif d.source == "jsonl":
        records = load_jsonl(d.path, d.kind, d.max_record_bytes, d.columns)
    else:
        records = load_hf(d.path, d.split, d.kind, d.columns)
    if d.kind == "preference":  # SFT, test loss and generation use the preferred answer
        records = [{**r, "response": r["chosen"]} for r in records]
    return records


def prepare_clients(cfg: ExperimentConfig) -> tuple[list[ClientData], list[Record]]:
    """Per-client train/test splits and the held-out pool, deterministic in the seed."""
    clients, holdout, _ = prepare_data(cfg)
    return clients, holdout


def prepare_data(cfg: ExperimentConfig) -> tuple[list[ClientData], list[Record], list[Record]]:
    """(clients, held-out pool, public prompts): the public prompts a method asks for are drawn
    from the data first and so never appear in any client's split."""
    import numpy as np

    from fedsweep.algorithms import registry

    records = load_records(cfg)
    m = registry.get(cfg.algorithm).public_prompt_count(cfg.algo_params)
    public: list[Record] = []
    if m:
        if m >= len(records) // 2:
            raise ConfigError(f"{cfg.algorithm}.public_prompts = {m}: too many for {len(records)} records")
        pick = set(np.random.default_rng([cfg.seed, 4]).choice(len(records), size=m, replace=False).tolist())
        public = [r for i, r in enumerate(records) if i in pick]
        records = [r for i, r in enumerate(records) if i not in pick]
    rest, holdout = split_holdout(records, cfg.data.holdout_fraction, np.random.default_rng([cfg.seed, 0]))
    p = cfg.partition
    clients = make_clients(rest, p.scheme, cfg.clients.num_clients, seed=cfg.seed,
                           test_fraction=cfg.data.test_fraction, beta=p.dirichlet_beta,
                           tasks_per_client=p.tasks_per_client, min_examples=p.min_examples,
                           val_fraction=cfg.data.val_fraction)
    if cfg.data.holdout_for == "pool_methods" and not registry.get(cfg.algorithm).uses_validation_pool:
        return_holdout(clients, holdout, cfg.seed)  # trains on the original data; no pool is handed out
    if registry.get(cfg.algorithm).centralized:  # one trainer with the union; everyone keeps its test split
        union = [r for c in clients for r in c.train]
        for c in clients:
            c.train = union if c.cid == 0 else []
    return clients, holdout, public


# ------------------------------------------------------------------------------- ray


def ensure_ray(cfg: ExperimentConfig) -> bool:
    """Connect to Ray (RAY_ADDRESS) or start a local runtime sized for the run; True if started here."""
    from fedsweep.orchestrator import ray_runtime

    return ray_runtime.ensure(cfg.server.resources.num_cpus + cfg.num_actors * cfg.clients.resources.num_cpus)


def check_gpus(cfg: ExperimentConfig) -> None:
    """Refuse, before any actor starts, a run that asks for GPUs on a Ray cluster that has none
    (Ray would wait for them for ever)."""
    import ray

    wanted = cfg.clients.resources.num_gpus * cfg.num_actors + cfg.server.resources.num_gpus
    have = ray.cluster_resources().get("GPU", 0)
    if wanted and not have:
        needs = cfg.cuda_requirements()
        why = f" ({', '.join(needs)} need{'s' if len(needs) == 1 else ''} CUDA)" if needs else ""
        raise RunError(f"clients.resources.num_gpus={cfg.clients.resources.num_gpus:g}{why}, but the Ray cluster "
                       f"has no GPU: run on a GPU node or set clients.resources.num_gpus=0")


def placement(cfg: ExperimentConfig, timeout: float = 120.0):
    import ray
    from ray.util.placement_group import placement_group

    from fedsweep.actors.remote import bundle

    bundles = [bundle(cfg.server.resources)] + [bundle(cfg.clients.resources)] * cfg.num_actors
    pg = placement_group(bundles, strategy=cfg.clients.placement_strategy)
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
        total: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0) + v
        raise RunError(f"placement group of {len(bundles)} bundles ({total}) not schedulable within {timeout:g}s; "
                       f"cluster has {ray.cluster_resources()}") from None
    return pg


# --------------------------------------------------------------------------- run dirs


def checkpoint_base(cfg: ExperimentConfig) -> AnyPath:
    """``checkpoint.dir/name``: a local folder (made absolute) or a pyarrow URI (shared storage)."""
    return location(cfg.checkpoint.dir).resolve() / cfg.name


def new_run_dir(cfg: ExperimentConfig) -> AnyPath:
    base = checkpoint_base(cfg)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, i = base / stamp, 1
    while path.exists():
        path, i = base / f"{stamp}-{i}", i + 1
    path.mkdir(parents=True)
    return path


def latest_run_dir(cfg: ExperimentConfig) -> AnyPath:
    base = checkpoint_base(cfg)
    runs = sorted(p for p in base.glob("*") if (p / "run.json").exists()) if base.is_dir() else []
    if not runs:
        raise RunError(f"--resume: no earlier run of '{cfg.name}' under {base}")
    return runs[-1]


def _diff(a: Any, b: Any, path: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else key
            if any(sub == k or sub.startswith(k + ".") for k in RESUMABLE_CHANGES):
                continue
            found = _diff(a.get(key), b.get(key), sub)
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} in the run, {b!r} now"


# ------------------------------------------------------------------------------- run


def run(cfg: ExperimentConfig, *, resume: bool = False, on_event: Callable[[str, Any], None] | None = None,
        stop_after: int | None = None, placement_group=None, bundle_offset: int = 0) -> Outcome:
    """Run (or resume) one experiment to completion. ``stop_after`` ends the run after that round
    as a crash would (checkpoint written, tracking run left FAILED): used to test resumption.
    ``placement_group``: place the actors in this existing group (a Tune trial's), server at
    bundle ``bundle_offset`` and client actors after it; otherwise a group is made here."""
    import ray

    emit = on_event or (lambda kind, data: None)
    clients, holdout, public = prepare_data(cfg)
    from fedsweep.algorithms import registry
    from fedsweep.models.loading import is_tiny, resolve

    pool = holdout if registry.get(cfg.algorithm).uses_validation_pool else None

    for name in sorted(set(cfg.client_models())):
        if not is_tiny(name):
            emit("status", f"preparing model {name}")
            resolve(name, cfg.model.cache_dir)  # converts bundled weights once, before actors start

    if resume:
        run_dir = latest_run_dir(cfg)
        info = json.loads((run_dir / "run.json").read_text())
        diff = _diff(info["config"], cfg.to_dict())
        if diff:
            raise ConfigError(f"--resume: the config differs from the run in {run_dir}: {diff}")
    else:
        run_dir = new_run_dir(cfg)
        info = {"config": cfg.to_dict(), "run_id": None}
    state_root = run_dir / "checkpoints"
    last, skipped = ckpt.latest_intact(state_root)
    if skipped and last is None:
        raise RunError(f"--resume: no intact checkpoint round under {state_root} ({'; '.join(skipped)})")
    if skipped:
        emit("warning", f"checkpoint {'; '.join(skipped)}: resuming from {last.name} instead")
    start = int(last.name.split("_")[-1]) + 1 if last is not None else 1

    tracker = None
    if cfg.tracking.enabled:
        prepare_store(cfg.tracking.uri)
        tracker = Tracker(cfg.tracking.uri, cfg.tracking.experiment or cfg.name,
                          run_name=cfg.tracking.run_name or f"{cfg.name}-{cfg.algorithm}",
                          run_id=info.get("run_id"), parent_run_id=cfg.tracking.parent_run_id,
                          tags={"algorithm": cfg.algorithm, "fedsweep.run_dir": str(run_dir), **cfg.tracking.tags})
        if not info.get("run_id"):
            params = flatten(cfg.to_dict())
            tracker.log_params(params)
            tracker.log_text(cfg.to_yaml(), "config.yaml")
            tracker.log_text(json.dumps([{"cid": c.cid, "tasks": c.tasks, "train": len(c.train), "test": len(c.test)}
                                         for c in clients], indent=1), "clients.json")
    info["run_id"] = tracker.run_id if tracker else None
    (run_dir / "run.json").write_text(json.dumps(info, indent=1))
    (run_dir / "config.yaml").write_text(cfg.to_yaml())

    outcome = Outcome(run_dir, info["run_id"], cfg.tracking.uri if tracker else None, clients=clients)
    started = ensure_ray(cfg)
    pg, actors, server, status = None, [], None, "FAILED"
    owned_pg = placement_group is None
    try:
        from fedsweep.actors import remote

        emit("status", f"starting {cfg.num_actors} client actor(s) for {cfg.clients.num_clients} clients")
        check_gpus(cfg)
        pg = placement(cfg) if owned_pg else placement_group
        config = cfg.to_dict()
        groups = cfg.actor_groups()
        assignment = {cid: a for a, group in enumerate(groups) for cid in group}
        for a in range(len(groups)):
            hosted = [{"cid": c.cid, "train": c.train, "test": c.test, "val": c.val}
                      for c in clients if assignment[c.cid] == a]
            actors.append(remote.client_actor(cfg, pg, bundle_offset + a + 1).remote(
                config, hosted, str(last) if last is not None else None, pool))
        try:
            ray.get([a.ping.remote() for a in actors], timeout=600)
        except ray.exceptions.RayActorError as exc:
            raise RunError(f"a client actor failed to start: {root_cause(exc)}") from None
        emit("actors", actors)
        nodes = ray.get([a.node_id.remote() for a in actors], timeout=60)
        if tracker:
            tracker.client.set_tag(tracker.run_id, "fedsweep.actor_nodes", ",".join(nodes))
        ranks = cfg.client_ranks()
        infos = [{"cid": c.cid, "num_examples": len(c.train), "tasks": c.tasks, "rank": ranks[c.cid],
                  "lora_scale": cfg.lora.alpha / ranks[c.cid]} for c in clients]
        server = remote.server_actor(cfg, pg, bundle_offset).remote(config, infos, actors, assignment,
                                                                    str(state_root), public,
                                                                    str(last) if last is not None else None)
        completed = ray.get(server.completed_rounds.remote(), timeout=600)
        if completed != start - 1:
            raise RunError(f"server restored round {completed}, expected {start - 1}")
        emit("start", {"first": start, "rounds": cfg.rounds})
        for rnd in range(start, cfg.rounds + 1):
            future = server.run_round.remote(rnd)
            while True:
                ready, _ = ray.wait([future], timeout=0.5)
                if ready:
                    break
                emit("progress", ray.get(server.progress.remote(), timeout=60))
            try:
                summary = ray.get(future, timeout=60)
            except ray.exceptions.RayTaskError as exc:  # the round itself failed: one line, not a traceback
                raise RunError(f"round {rnd} failed: {root_cause(exc)}") from None
            outcome.rounds.append(summary)
            if tracker:
                tracker.log_round(summary)
            emit("round", summary)
            if stop_after is not None and rnd >= stop_after and rnd < cfg.rounds:
                raise RunError(f"stopped after round {rnd} (stop_after)")
        status = "FINISHED"
        return outcome
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if tracker:
            tracker.finish(status)
        for handle in actors + ([server] if server is not None else []):
            try:
                ray.kill(handle)
            except Exception:
                pass
        if pg is not None and owned_pg:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(pg)
        if started:
            ray.shutdown()


def root_cause(exc: BaseException) -> str:
    """The last line of the innermost error a Ray failure carries (the actor's own exception)."""
    lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
    errors = [l for l in lines if l.split(":")[0].endswith(("Error", "Exception"))]
    return errors[-1] if errors else (lines[-1] if lines else type(exc).__name__)


def validate_file(path: str, overrides: list[str]) -> tuple[ExperimentConfig, list[ClientData]]:
    """Config and data checks that ``fedsweep validate`` runs (no actors, no tracking)."""
    from fedsweep.orchestrator.config import load_config

    cfg = load_config(path, overrides)
    clients, _, _ = prepare_data(cfg)
    return cfg, clients


__all__ = ["Outcome", "RunError", "prepare_clients", "run", "validate", "validate_file"]
