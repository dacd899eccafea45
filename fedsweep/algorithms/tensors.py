"""Tensor-set helpers shared by the plugins: sizes, copies, weighted means, compact pickling, and a
parameter set laid out as one row (:class:`FlatLayout`: many clients' sets as one (K, P) tensor)."""

from __future__ import annotations

import itertools
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


WIRE_ALONE_BYTES = 1 << 16
"""A tensor of at least this many bytes travels in a buffer of its own, without a copy on the sending
side; smaller ones are packed. Packing large tensors costs more in copies and fresh pages than it
saves: a Llama-3.1-8B r=16 adapter (256 tensors of 64–256 KiB, 52 MiB) took 35–43 ms to pickle and
unpickle packed against 13 ms a tensor at a time (``fedsweep bench transport``, fresh processes)."""

WIRE_CHUNK_BYTES = 1 << 20
"""A packed buffer holds at most about this many bytes."""


@dataclass(frozen=True)
class WireSet:
    """A tensor set as it crosses processes. Its plain tensors (dense, on the CPU, needing no
    gradient) travel as numpy byte buffers, which Ray (pickle protocol 5) moves out of band: a small
    one packed with the others of its dtype end to end, in buffers of about :data:`WIRE_CHUNK_BYTES`,
    a large one (:data:`WIRE_ALONE_BYTES`) alone; anything else (a tensor that needs a gradient,
    lives on a GPU or is sparse, a non-tensor value) is pickled as it is, tensors :func:`compact`-ed.

    torch's own pickling goes through ``torch.save`` per tensor: a 135M model's LoRA r=8 adapter
    (120 tensors of 6–18 KiB) took 24 ms to pickle and unpickle, one numpy buffer per tensor 3.4 ms,
    packed 2.0 ms (``fedsweep bench transport``; benchmarks/notebook.md), three times per client and
    round (payload at the actor, upload out of it, upload at the server)."""

    chunks: tuple[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]], ...]
    """Per buffer, its dtype name and its tensors' (key, shape) in the order their elements lie in it."""
    buffers: tuple[np.ndarray, ...]
    """The buffers' bytes (uint8), one per chunk."""
    others: dict[str, Any]
    """What is not packed, by key."""
    order: tuple[str, ...]
    """Every key, in the set's order."""


def _packable(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided
            and not t.requires_grad and t.element_size() > 0)


def to_wire(params: Params) -> WireSet:
    """``params`` for pickling (:class:`WireSet`): each tensor contributes its own elements only, a
    view never its whole storage. A buffer may share memory with a tensor of the set: pickle the
    result before the set changes (Ray does, as the call is made)."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    others: dict[str, Any] = {}
    for key, t in params.items():
        if _packable(t):
            groups.setdefault(str(t.dtype).removeprefix("torch."), []).append((key, t))
        else:
            others[key] = t
    chunks: list[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]]] = []
    buffers: list[np.ndarray] = []

    def emit(name: str, run: list[tuple[str, torch.Tensor]]) -> None:
        flats = [t.reshape(-1) for _, t in run]
        flat = torch.cat(flats) if len(flats) > 1 else flats[0].contiguous()
        buffers.append(flat.view(torch.uint8).numpy())
        chunks.append((name, tuple((key, tuple(t.shape)) for key, t in run)))

    for name, members in groups.items():
        run: list[tuple[str, torch.Tensor]] = []
        size = 0
        for key, t in members:
            nbytes = t.numel() * t.element_size()
            if nbytes >= WIRE_ALONE_BYTES:
                emit(name, [(key, t)])
                continue
            if run and size + nbytes > WIRE_CHUNK_BYTES:
                emit(name, run)
                run, size = [], 0
            run.append((key, t))
            size += nbytes
        if run:
            emit(name, run)
    return WireSet(tuple(chunks), tuple(buffers), compact(others), tuple(params))


def from_wire(wire: WireSet) -> Params:
    """The inverse of :func:`to_wire`: bitwise the tensors that went in (dtype, shape, values), in
    their order. A buffer's tensors are views into one writable copy of it (Ray's buffers are
    read-only), each over its own elements: writing one changes no other."""
    got: dict[str, Any] = dict(wire.others)
    for (name, members), raw in zip(wire.chunks, wire.buffers):
        typed = torch.from_numpy(raw if raw.flags.writeable else raw.copy()).view(getattr(torch, name))
        parts = typed.split([math.prod(shape) for _, shape in members]) if len(members) > 1 else (typed,)
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


class FlatLayout:
    """Where each key's tensor lies in one client's row (P,): ``shapes`` (key → slot shape, in
    order) end to end. One object per distinct layout (:meth:`of`), so a row read out of a group's
    buffer can be recognised as fitting the next group's by identity, and a client's state can keep
    its layout without keeping the group's (K, P) buffers alive."""

    _known: dict[tuple, "FlatLayout"] = {}

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = dict(shapes)
        self.sizes = [math.prod(s) for s in self.shapes.values()]
        self.offsets = dict(zip(self.shapes, itertools.accumulate(self.sizes, initial=0)))
        self.width = sum(self.sizes)
        self._strides = {key: tuple(math.prod(shape[i + 1:]) for i in range(len(shape))) for key, shape in self.shapes.items()}

    @classmethod
    def of(cls, shapes: dict[str, tuple[int, ...]]) -> "FlatLayout":
        """The one layout of ``shapes`` in this process."""
        key = tuple((k, tuple(v)) for k, v in shapes.items())
        found = cls._known.get(key)
        if found is None:
            found = cls._known[key] = cls(dict(key))
        return found

    def views(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each key's tensor in one client's contiguous row (P,), as views: one call each."""
        base = row.storage_offset()
        return {key: row.as_strided(shape, self._strides[key], base + self.offsets[key]) for key, shape in self.shapes.items()}

    def row_of(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The one contiguous row (P,) that holds ``tensors`` in this layout (each key a contiguous
        tensor of its slot's shape at its offset in one storage, as :meth:`views` makes them), or None."""
        first = tensors.get(next(iter(self.shapes))) if self.shapes else None
        if first is None or len(tensors) != len(self.shapes):
            return None
        storage, base = first.untyped_storage().data_ptr(), first.storage_offset()
        for key, shape in self.shapes.items():
            t = tensors.get(key)
            if (t is None or t.untyped_storage().data_ptr() != storage or t.storage_offset() != base + self.offsets[key]
                    or tuple(t.shape) != shape or not t.is_contiguous() or t.dtype != first.dtype):
                return None
        if first.untyped_storage().nbytes() < (base + self.width) * first.element_size():
            return None
        return first.as_strided((self.width,), (1,), base)

    def rows(self, sets: list[dict[str, torch.Tensor]], dtype=None) -> torch.Tensor:
        """``sets`` (each exactly this layout's shapes) as a (K, P) tensor: a set that is one row already
        (:meth:`row_of`) costs one call, another a concatenation of its tensors."""
        rows = []
        for s in sets:
            row = self.row_of(s)
            rows.append(row if row is not None else torch.cat([s[key].reshape(-1) for key in self.shapes]))
        out = torch.stack(rows)
        return out if dtype is None else out.to(dtype)

    @classmethod
    def of_params(cls, params: Params) -> "FlatLayout":
        """The layout of one parameter set's keys and shapes, in its order."""
        return cls.of({key: tuple(t.shape) for key, t in params.items()})


@dataclass
class RowSets:
    """K parameter sets as one (K, P) tensor: row k set k's tensors end to end in ``layout``'s order (what a
    method computes many candidate adapters as, and an adapter binding takes in a copy per tensor)."""

    rows: "torch.Tensor"
    layout: FlatLayout

    def __len__(self) -> int:
        return self.rows.shape[0]

    def part(self, key: str) -> "torch.Tensor":
        """``key``'s (K, *shape) view of the rows."""
        o, shape = self.layout.offsets[key], self.layout.shapes[key]
        return self.rows[:, o:o + math.prod(shape)].view(self.rows.shape[0], *shape)

    def sets(self) -> list[Params]:
        """Each set as its own tensors (views of its row)."""
        return [self.layout.views(row) for row in self.rows]
