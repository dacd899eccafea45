"""Placement: the actor layout chosen for the cluster, the bundles an experiment needs, and a
refusal in one line when the cluster lacks them."""

from __future__ import annotations

import math
import os
from typing import Callable

from fedsweep.config import ExperimentConfig
from fedsweep.config.layout import Cluster, Layout, choose
from fedsweep.env import LOCAL_RUNTIME_ENV
from fedsweep.errors import RunError

ACTOR_PROCESS_BYTES = 600 * 2 ** 20
"""Resident memory of a ClientActor before its model: a Ray worker with torch, transformers and peft
imported (measured: 560-590 MiB on CPU, tiny model; see benchmarks/notebook.md)."""
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


CPU_STEP_OVERHEAD_S = 0.01
"""Seconds of one training step on one core that do not grow with the model (Python, autograd, the
optimiser's loop over tensors): the tiny model's steps take 15-21 ms on the 2-core VM."""
CPU_FLOPS = 5e10
"""Floating-point operations per second one core sustains in training (a nominal figure: with the
overhead above it gives the tiny model's measured step time)."""


def training_seconds(cfg: ExperimentConfig) -> float | None:
    """The run's training in single-core seconds, from shapes: rounds × sampled clients × steps, each
    step ``CPU_STEP_OVERHEAD_S`` plus 6 FLOPs per base parameter per token (forward and backward)
    at ``CPU_FLOPS``. None where the model's shape or the step count is not known before the data."""
    from fedsweep.models.shapes import architecture, base_parameters

    arch = architecture(cfg.model)
    if arch is None or cfg.model.names is not None or cfg.train.steps is None:
        return None
    tokens = cfg.train.batch_size * cfg.train.max_length
    step = CPU_STEP_OVERHEAD_S + 6 * base_parameters(arch) * tokens / CPU_FLOPS
    return cfg.rounds * cfg.clients.per_round * cfg.train.steps * step


def host_bytes(cfg: ExperimentConfig) -> Callable[[int], float] | None:
    """Host memory of one actor hosting p clients, from shapes alone: the process, then (CPU actors)
    the base weights and one training step's activations, and every client's adapter and optimiser
    state where it is kept. A coarse bound; the GPU side is the memory planner's."""
    from fedsweep.models.loading import DTYPE_BYTES
    from fedsweep.models.shapes import OPTIMIZER_BYTES, architecture, base_parameters, lora_shapes, reft_shapes

    arch = architecture(cfg.model)
    if arch is None or cfg.model.names is not None:
        return None
    on_cpu = cfg.clients.resources.num_gpus == 0
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    rank = max(cfg.client_ranks()) if cfg.adapter == "lora" else cfg.reft.rank
    try:
        shapes = lora_shapes(arch, rank, list(cfg.lora.target_modules)) if cfg.adapter == "lora" \
            else reft_shapes(arch, rank, cfg.reft.tied)
    except (ValueError, KeyError, TypeError):
        return None
    adapter = sum(math.prod(s) for s in shapes.values())
    per_client = adapter * (4 + (OPTIMIZER_BYTES[cfg.train.optimizer] if on_cpu or cfg.clients.park == "cpu" else 0))
    fixed = ACTOR_PROCESS_BYTES
    if on_cpu:
        tokens = cfg.train.batch_size * cfg.train.max_length
        activations = tokens * (arch["num_hidden_layers"] * arch["hidden_size"] * 18 + arch["vocab_size"] * 3) * 4
        fixed += base_parameters(arch) * dtype_bytes + activations
    return lambda p: fixed + p * per_client


def memory_plan(cfg: ExperimentConfig):
    """The memory planner's plan of one GPU actor of ``cfg`` (simulates a step on ``meta``; seconds):
    what the layout's GPU check and the batch plan's limit both read. None on CPU actors or where the
    architecture is not known before loading."""
    from fedsweep.models.shapes import architecture

    arch = architecture(cfg.model)
    if arch is None or cfg.model.names is not None or cfg.clients.resources.num_gpus == 0:
        return None
    from fedsweep.models.memory import plan

    return plan(cfg, arch)


PLAN_NOT_MADE = object()


def choose_layout(cfg: ExperimentConfig, cluster: Cluster, memory=PLAN_NOT_MADE) -> Layout:
    """The layout of ``cfg`` on ``cluster`` (ConfigError in one line if the asked one does not fit);
    ``memory``: the planner's :func:`memory_plan` if already made (it takes seconds: the runner makes
    it while Ray starts)."""
    c = cfg.clients
    if memory is PLAN_NOT_MADE:
        memory = memory_plan(cfg) if cluster.gpu_memory else None
    gpu = memory.per_actor if memory is not None else None
    host, g = host_bytes(cfg), c.shards
    if g > 1:  # a sharded client is G processes: an actor of the layout takes G slots, G times the memory
        host, gpu = _times(host, g), _times(gpu, g)
    return choose(c.num_clients, cfg.client_models(), c.clients_per_actor, c.num_actors, c.resources.num_cpus * g,
                  c.resources.num_gpus * g, cluster, host, gpu if cluster.gpu_memory else None,
                  work_s=training_seconds(cfg) if g == 1 else None)


def _times(f: Callable[[int], float] | None, g: int) -> Callable[[int], float] | None:
    return (lambda p: g * f(p)) if f else None


def resolve_layout(cfg: ExperimentConfig, cluster: Cluster, memory=PLAN_NOT_MADE) -> tuple[ExperimentConfig, Layout]:
    """``cfg`` with its layout chosen for ``cluster`` and its batch plan resolved for that layout
    (``config.batching``: ``train.batch_clients`` a number): both decided here, once, on the driver,
    from one memory plan."""
    from fedsweep.config.batching import resolve_for

    if memory is PLAN_NOT_MADE:
        memory = memory_plan(cfg) if cluster.gpu_memory else None
    layout = choose_layout(cfg, cluster, memory)
    cfg = cfg.with_layout(layout)
    per = int(cfg.clients.clients_per_actor)
    return cfg.with_batch_plan(resolve_for(cfg, per, cluster.gpu_memory, memory)), layout


def for_actor(cfg: ExperimentConfig, hosted: int, device: str = "cpu") -> ExperimentConfig:
    """``cfg`` with its batch plan resolved for one client actor built in this process hosting ``hosted``
    clients on ``device`` (benchmarks and tests build actors without a driver): the driver's resolver
    (``config.batching.resolve_for``), on the GPU with the memory planner's plan. A config whose plan is
    already resolved comes back as it is."""
    if isinstance(cfg.train.batch_clients, int) and (cfg.train.batch_clients > 1 or cfg.train.batch_reason):
        return cfg
    from fedsweep.config.batching import plans_memory, resolve_for

    gpu = memory = None
    if str(device).startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_properties(torch.device(device)).total_memory
        memory = memory_plan(cfg) if plans_memory(cfg) else None  # (LoReFT, clients alone: no plan asked)
    return cfg.with_batch_plan(resolve_for(cfg, hosted, gpu, memory))


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
