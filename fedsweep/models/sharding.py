"""A frozen base model sharded over a torch.distributed group: DeepSpeed ZeRO-3 or PyTorch FSDP2.

Only the frozen base is sharded. It is sharded *before* adapters attach, so the adapter (LoRA
factors or ReFT interventions) stays an ordinary tensor set, whole on every process of the group:
the trainer averages its gradients over the group (:mod:`fedsweep.actors.shard_group`), every
process steps the same optimiser on the same values, and reading or writing an adapter needs no
gather or scatter. The adapter is well under 1 % of the base (LoRA r=16 on q,v of a 70B model:
~42M parameters against 70B), so replicating it and its optimiser state costs little and keeps
per-client optimiser state, packing and checkpoints exactly as for an unsharded client; a
checkpoint holds the whole adapter and resumes on any group size.

Each process computes with whole layers: ZeRO-3 and FSDP2 gather a layer's weights before its
forward (and again in backward, where the adapter's gradients flow through it) and free them after.
"""

from __future__ import annotations

from typing import Any

import torch

DEEPSPEED_MISSING = ("clients.shard.backend=deepspeed needs the deepspeed package on every node "
                     "(pip install --no-build-isolation deepspeed==0.19.8; or use backend: fsdp)")


def layer_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (decoder layers): the classes transformers names in
    ``_no_split_modules``, else the children of the largest ``ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in names]
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"clients.shard: cannot find the repeated layers of {type(model).__name__} to shard")
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def deepspeed_config(offload: str, device: torch.device) -> dict:
    """ZeRO stage 3 for a frozen module: no optimiser (fedsweep steps the replicated adapter itself)."""
    zero: dict[str, Any] = {"stage": 3}
    if offload == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
            "bf16": {"enabled": False}, "fp16": {"enabled": False}, "wall_clock_breakdown": False}


def shard_base(base: torch.nn.Module, backend: str, offload: str, device: torch.device) -> Any:
    """Shard the frozen ``base`` over the default process group, in place; returns what must live as
    long as the model (DeepSpeed's engine, which owns the gather hooks; None for FSDP2).

    ``fsdp``: ``fully_shard`` on every decoder layer, then on the root (embeddings, final norm,
    head), each parameter split in dim 0 across the group; ``offload=cpu``: shards in host memory.
    ``deepspeed``: ``deepspeed.initialize`` with ZeRO-3 and no optimiser, which partitions every
    parameter and hooks each module to gather its weights around forward and backward."""
    layers = layer_modules(base)
    if backend == "fsdp":
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload == "cpu" else OffloadPolicy()
        for layer in layers:
            fully_shard(layer, offload_policy=policy)
        fully_shard(base, offload_policy=policy)
        return None
    try:
        import deepspeed
    except ImportError:
        raise ImportError(DEEPSPEED_MISSING) from None
    engine, *_ = deepspeed.initialize(model=base, config=deepspeed_config(offload, device))
    return engine


def local_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this process holds (its shards, and whatever is not sharded): DeepSpeed
    keeps a parameter's shard in ``ds_tensor``, FSDP2's parameters are DTensors."""
    total = 0
    for p in model.parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p.data
        total += local.numel() * local.element_size()
    return total
