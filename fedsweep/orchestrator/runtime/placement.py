"""Placement: what the Ray cluster offers a run's client actors (``cluster_view``, for the run's plan:
``plan.resolve``), the placement groups an experiment needs, and a refusal in one line when the
cluster lacks them."""

from __future__ import annotations

import os

from fedsweep.config import ExperimentConfig
from fedsweep.env import LOCAL_RUNTIME_ENV
from fedsweep.errors import RunError
from fedsweep.plan.layout import Cluster

GPU_MEMORY_GIB = {"H200": 141, "H100": 80, "A100-80G": 80, "A100-40G": 40, "A100": 40, "L40S": 48, "L40": 48,
                  "A40": 48, "A10G": 24, "L4": 24, "A10": 24, "V100": 16, "T4": 16}
"""Memory of the GPUs Ray names in its ``accelerator_type:<name>`` resource (A100 without a size: 40)."""


def cluster_view(cfg: ExperimentConfig, free: dict[str, float] | None = None, reserved_cpus: float = 0.0,
                 share: float = 1.0, total: bool = False) -> Cluster:
    """What Ray has for this experiment's client actors: its available resources (or ``free``, a
    snapshot of them; or with ``total`` all it has, for checking a set layout, which may wait for
    resources being released but must be able to fit at all) times ``share`` (a study running trials
    side by side), less the server's and ``reserved_cpus``."""
    if free is None:
        import ray

        free = ray.cluster_resources() if total else ray.available_resources()
    kinds = [k.split(":", 1)[1] for k in free if k.startswith("accelerator_type:")]
    gib = next((GPU_MEMORY_GIB[k] for k in sorted(kinds, key=len, reverse=True) if k in GPU_MEMORY_GIB), None)
    server = cfg.server.resources
    # a runtime fedsweep started on this machine (its workers, a study's trials among them, inherit the mark)
    own = os.environ.get(LOCAL_RUNTIME_ENV) == "1"
    return Cluster(cpus=max(free.get("CPU", 0.0) * share - server.num_cpus - reserved_cpus, 0.0),
                   gpus=max(free.get("GPU", 0.0) * share - server.num_gpus, 0.0),
                   memory=free.get("memory", 0.0) * share or None,
                   gpu_memory=gib * 2 ** 30 if gib else None,
                   source="the Ray cluster" if os.environ.get("RAY_ADDRESS") else "this machine",
                   cores=(os.cpu_count() or 1) * share if own else None)


def bundle(resources) -> dict[str, float]:
    """A placement-group bundle for one actor (Ray refuses empty bundles: keep a sliver of CPU)."""
    out = {"CPU": max(resources.num_cpus, 0.01)}
    if resources.num_gpus:
        out["GPU"] = resources.num_gpus
    out.update(resources.custom)
    return out


def experiment_bundles(cfg: ExperimentConfig) -> list[dict[str, float]]:
    """The server's bundle, then one per client actor process (``clients.shard``: one per process of
    each sharded client, a client's processes side by side)."""
    return [bundle(cfg.server.resources)] + [bundle(cfg.clients.resources)] * (cfg.num_actors * cfg.clients.shards)


def sharded_placement(cfg: ExperimentConfig, timeout: float = 120.0) -> list:
    """One ready placement group per sharded client: its processes' bundles, placed by
    ``clients.shard.placement_strategy`` (STRICT_PACK: on one node)."""
    bundles = [bundle(cfg.clients.resources)] * cfg.clients.shards
    return [_ready(bundles, cfg.clients.shard.placement_strategy, timeout) for _ in range(cfg.num_actors)]


def check_gpus(cfg: ExperimentConfig) -> None:
    """Refuse, before any actor starts, a run that asks for GPUs on a Ray cluster that has none
    (Ray would wait for them for ever)."""
    import ray

    wanted = cfg.clients.resources.num_gpus + cfg.server.resources.num_gpus
    have = ray.cluster_resources().get("GPU", 0)
    if wanted and not have:
        needs = cfg.cuda_requirements()
        why = f" ({', '.join(needs)} need{'s' if len(needs) == 1 else ''} CUDA)" if needs else ""
        raise RunError(f"clients.resources.num_gpus={cfg.clients.resources.num_gpus:g}{why}, but the Ray cluster "
                       f"has no GPU: run on a GPU node or set clients.resources.num_gpus=0")


def placement(cfg: ExperimentConfig, timeout: float = 120.0):
    """A ready placement group for the experiment's actors (RunError if not schedulable in ``timeout``);
    with ``clients.shard`` the server's alone (each sharded client gets its own: :func:`sharded_placement`)."""
    bundles = experiment_bundles(cfg)[:1] if cfg.clients.shard else experiment_bundles(cfg)
    return _ready(bundles, cfg.clients.placement_strategy, timeout)


def _ready(bundles: list[dict[str, float]], strategy: str, timeout: float):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        total: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0) + v
        raise RunError(f"placement group of {len(bundles)} bundles ({total}) not schedulable within {timeout:g}s; "
                       f"cluster has {ray.cluster_resources()}") from None
    return pg
