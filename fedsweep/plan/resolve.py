"""A run's plan resolved for a cluster: how many client actors, how many clients each hosts, and how
many of them share a training step — decided once, on the driver, from the config, the cluster's view
(``plan.layout.Cluster``, measured by the orchestrator's runtime) and one memory plan
(``plan.memory``). Pure: nothing here starts or asks Ray."""

from __future__ import annotations

import math
from typing import Callable

from fedsweep.config import ExperimentConfig
from fedsweep.plan.layout import Cluster, Layout, choose

ACTOR_PROCESS_BYTES = 600 * 2 ** 20
"""Resident memory of a ClientActor before its model: a Ray worker with torch, transformers and peft
imported (docs/performance.md, 'The design's measurements')."""
CPU_STEP_OVERHEAD_S = 0.01
"""Seconds of one training step on one core that do not grow with the model (Python, autograd, the
optimiser's loop over tensors; docs/performance.md, 'The design's measurements')."""
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
    from fedsweep.plan.memory import plan

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
    (``plan.batching``: ``train.batch_clients`` a number): both decided here, once, on the driver,
    from one memory plan."""
    from fedsweep.plan.batching import resolve_for

    if memory is PLAN_NOT_MADE:
        memory = memory_plan(cfg) if cluster.gpu_memory else None
    layout = choose_layout(cfg, cluster, memory)
    cfg = cfg.with_layout(layout)
    per = int(cfg.clients.clients_per_actor)
    return cfg.with_batch_plan(resolve_for(cfg, per, cluster.gpu_memory, memory)), layout


def for_actor(cfg: ExperimentConfig, hosted: int, device: str = "cpu") -> ExperimentConfig:
    """``cfg`` with its batch plan resolved for one client actor built in this process hosting ``hosted``
    clients on ``device`` (benchmarks and tests build actors without a driver): the driver's resolver
    (``plan.batching.resolve_for``), on the GPU with the memory planner's plan. A config whose plan is
    already resolved comes back as it is."""
    if isinstance(cfg.train.batch_clients, int) and (cfg.train.batch_clients > 1 or cfg.train.batch_reason):
        return cfg
    from fedsweep.plan.batching import plans_memory, resolve_for

    gpu = memory = None
    if str(device).startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_properties(torch.device(device)).total_memory
        # (clients alone, or one client hosted: no plan asked)
        memory = memory_plan(cfg) if plans_memory(cfg) and hosted > 1 else None
    return cfg.with_batch_plan(resolve_for(cfg, hosted, gpu, memory))
