"""The batch plan: how many of an actor's clients share one training step, and why only one where so.

The engine trains a group of 1..K clients with one step loop: each step is one pass over every
group member's rows, each row computed with its own client's adapter. Whether clients may share a
step is decided here, in one function, from the config alone (:func:`why_alone`); how many do is
decided once, on the driver, next to the actor layout (:func:`resolve`), and written into the run's
resolved config as ``train.batch_clients: N`` with ``train.batch_reason`` where N is 1. The server
(one training call per actor where groups form) and the actors read it from there
(``ExperimentConfig.batch_plan``), and refuse a config where it is not resolved.
"""

from __future__ import annotations

from fedsweep.config.schema import BatchPlan


def why_alone(cfg) -> str | None:
    """Why this config's clients cannot share a training step; None where they can. The one place
    this is decided."""
    tc = cfg.train
    if tc.batch_clients == "off" or tc.batch_clients == 1:
        return "train.batch_clients is off" if tc.batch_clients == "off" else "train.batch_clients is 1"
    if cfg.adapter == "reft" and cfg.reft.dropout > 0:
        return "reft.dropout draws its masks from the running generator, which a group's clients would share"
    if cfg.clients.shards > 1:
        return "a sharded client trains alone"
    if getattr(cfg.algo_params, "dp", None) is not None:
        return f"{cfg.algorithm}.dp: DP-SGD clips each example's gradient, one client at a time"
    if tc.optimizer == "adamw_8bit":
        return "train.optimizer=adamw_8bit keeps block-wise state that is not per client"
    if tc.autocast == "fp16":
        return "fp16's gradient scaler would skip a step of every client when one overflows"
    return None


def resolve(cfg, clients_per_actor: int, limit: int | None = None) -> BatchPlan:
    """The batch plan of ``cfg`` for actors of ``clients_per_actor`` clients. ``limit``: the most
    clients one step may take on the actor's device (the memory planner's
    :meth:`~fedsweep.models.memory.MemoryPlan.batch_limit` on a GPU; None on the CPU, where ``auto``
    takes all of an actor's clients)."""
    reason = why_alone(cfg)
    if reason is not None:
        return BatchPlan(1, reason)
    setting = cfg.train.batch_clients
    most = clients_per_actor if setting == "auto" else min(int(setting), clients_per_actor)
    if limit is not None and limit < most:
        most = max(1, limit)
        if most == 1:
            return BatchPlan(1, "the memory planner fits one client's step beside the base on this GPU")
    if most <= 1:
        return BatchPlan(1, "one client per actor")
    return BatchPlan(most)


def plans_memory(cfg) -> bool:
    """Whether resolving ``cfg``'s batch plan on a GPU takes a memory plan: ``auto`` for clients that
    can share a step (a LoReFT base, or clients that train alone, need none)."""
    return cfg.train.batch_clients == "auto" and why_alone(cfg) is None


def resolve_for(cfg, clients_per_actor: int, device_bytes: float | None = None, memory=None) -> BatchPlan:
    """:func:`resolve` on a device of ``device_bytes`` (None: the CPU) with the memory plan ``memory``
    (``models.memory``): the limit is the plan's batch limit for the actor's share of the device. Called
    by the run's plan only (``plan.resolve``: a run's layout, or one actor built in-process); an actor refuses a config whose plan is not resolved (``ExperimentConfig.batch_plan``)."""
    limit = None
    if memory is not None and device_bytes and plans_memory(cfg):
        limit = memory.batch_limit(device_bytes * min(1.0, cfg.clients.resources.num_gpus), clients_per_actor)
    return resolve(cfg, clients_per_actor, limit)
