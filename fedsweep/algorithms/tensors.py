"""Tensor-set helpers shared by the plugins: sizes, copies, weighted means, compact pickling."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedsweep.lazy import torch

Params = dict[str, "torch.Tensor"]
"""A named set of tensors: an adapter's parameters, a client's state, an optimiser moment."""


def tensor_bytes(params: Params | None) -> int:
    """Exact bytes of a tensor set as transmitted (dense, its dtype)."""
    if not params:
        return 0
    return sum(t.numel() * t.element_size() for t in params.values())


def compact(params: Params) -> Params:
    """``params`` with every tensor that is a view into a larger storage copied into its own.

    Pickling (Ray's transport, checkpoints) writes a tensor's whole storage: a dict of views into
    one flat buffer (DRIFT's mixed results, FedReFT+'s split aggregates) would otherwise carry the
    buffer once per view — a 240-tensor LoRA adapter became 240 copies of itself."""
    out = {}
    for key, t in params.items():
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t = t.clone()
        out[key] = t
    return out


@dataclass(frozen=True)
class WireSet:
    """A tensor set as it crosses processes. Its plain tensors (dense, on the CPU, needing no
    gradient) travel packed end to end in one numpy byte buffer per dtype, which Ray (pickle
    protocol 5) moves as one out-of-band buffer; anything else (a tensor that needs a gradient, lives
    on a GPU or is sparse, a non-tensor value) is pickled as it is, tensors :func:`compact`-ed.

    torch's own pickling goes through ``torch.save`` per tensor: a 135M model's LoRA r=8 adapter
    (120 tensors) took 21.6 ms to pickle and unpickle, one numpy buffer per tensor 2.9 ms, and
    this packing less (``fedsweep bench transport``; docs/performance.md), three times per client
    and round (payload at the actor, upload out of it, upload at the server)."""

    packed: dict[str, tuple[tuple[str, tuple[int, ...]], ...]]
    """Per dtype name, its tensors' (key, shape) in the order their elements lie in its buffer."""
    buffers: dict[str, np.ndarray]
    """Per dtype name, the packed tensors' bytes (uint8)."""
    others: dict[str, Any]
    """What is not packed, by key."""
    order: tuple[str, ...]
    """Every key, in the set's order."""


def _packable(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided
            and not t.requires_grad and t.element_size() > 0)


def to_wire(params: Params) -> WireSet:
    """``params`` for pickling (:class:`WireSet`): each packed tensor contributes its own elements
    only, a view never its whole storage; the buffers are copies, so the set may change after this
    returns."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    others: dict[str, Any] = {}
    for key, t in params.items():
        if _packable(t):
            groups.setdefault(str(t.dtype).removeprefix("torch."), []).append((key, t))
        else:
            others[key] = t
    buffers = {name: torch.cat([t.reshape(-1) for _, t in members]).view(torch.uint8).numpy()  # a copy, even of one
               for name, members in groups.items()}
    packed = {name: tuple((key, tuple(t.shape)) for key, t in members) for name, members in groups.items()}
    return WireSet(packed, buffers, compact(others), tuple(params))


def from_wire(wire: WireSet) -> Params:
    """The inverse of :func:`to_wire`: bitwise the tensors that went in (dtype, shape, values), in
    their order. A dtype's tensors are views into one writable copy of its buffer (Ray's buffers
    are read-only), each over its own elements: writing one changes no other."""
    got: dict[str, Any] = dict(wire.others)
    for name, members in wire.packed.items():
        raw = wire.buffers[name]
        typed = torch.from_numpy(raw if raw.flags.writeable else raw.copy()).view(getattr(torch, name))
        parts = typed.split([math.prod(shape) for _, shape in members])
        got.update((key, part.view(shape)) for (key, shape), part in zip(members, parts))
    return {key: got[key] for key in wire.order}


def as_vector(params: Params, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensors of ``params`` end to end, in their order, as one vector of ``dtype`` (promoted from
    theirs when None): one copy per set rather than one operation per tensor."""
    vec = torch.cat([v.detach().reshape(-1) for v in params.values()])
    return vec if dtype is None else vec.to(dtype)


def clone(params: Params) -> Params:
    """A detached copy of every tensor."""
    return {k: v.detach().clone() for k, v in params.items()}


def weighted_mean(sets: list[Params], weights: list[float] | torch.Tensor) -> Params:
    """Σ_k w_k θ_k / Σ_k w_k, key by key, as one stacked reduction per tensor."""
    w = torch.as_tensor(weights, dtype=torch.float64)
    if w.ndim != 1 or len(w) != len(sets) or not len(sets):
        raise ValueError(f"need one weight per parameter set, got {len(w)} weights for {len(sets)} sets")
    if float(w.sum()) <= 0:
        raise ValueError("weights must sum to a positive number")
    w = w / w.sum()
    out: Params = {}
    for key in sets[0]:
        stacked = torch.stack([s[key] for s in sets])
        ww = w.to(device=stacked.device, dtype=torch.float32 if stacked.dtype != torch.float64 else torch.float64)
        out[key] = torch.tensordot(ww, stacked.to(ww.dtype), dims=1).to(stacked.dtype)
    return out
