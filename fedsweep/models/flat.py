"""K clients' tensors side by side in one (K, P) buffer: one operator call per group, not per tensor.

A stacked adapter is many tensors (two per LoRA module: 120 for SmolLM2-135M on q/v, 256 for
Llama-3.1-8B on q/k/v/o), each with the clients on dim 0. Laid out in one buffer, row k holding
client k's tensors end to end, every elementwise step over all of them — AdamW's update, each
client's gradient norm and clipping, zeroing the gradients, writing the group's start in and
reading its result out — is one call over the buffer whatever the number of tensors and clients
(on a GPU: one kernel launch instead of one per tensor, or per client and tensor).

Each tensor is a view of its columns, ``values[:, o:o + n].view(K, *shape)``. Gradients land in
the same layout: before a backward each tensor's ``.grad`` is set to the matching view of one
(K, P) gradient buffer, and autograd accumulates into an existing ``.grad`` in place (outside
``create_graph``), so the buffer holds the whole gradient after it. The engine checks this held
(:meth:`FlatStack.grads_in_place`) rather than assuming it.
"""

from __future__ import annotations

import math
import warnings

from fedsweep.algorithms.tensors import FlatLayout
from fedsweep.lazy import no_grad, torch


class FlatStack:
    """``shapes`` (key → one client's slot shape, in order) for ``k`` clients in one buffer."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], k: int, device, dtype):
        self.layout = FlatLayout.of(shapes)
        self.shapes, self.offsets, self.width = self.layout.shapes, self.layout.offsets, self.layout.width
        self.k = k
        self.values = torch.zeros(k, self.width, device=device, dtype=dtype)
        self.grad = torch.zeros_like(self.values)
        self._grads = {key: self.part(self.grad, key) for key in self.shapes}

    def part(self, buffer: torch.Tensor, key: str) -> torch.Tensor:
        """``key``'s (K, *shape) view of a buffer laid out like :attr:`values`."""
        o, shape = self.offsets[key], self.shapes[key]
        return buffer[:, o:o + math.prod(shape)].view(buffer.shape[0], *shape)

    def parameters(self) -> dict[str, torch.nn.Parameter]:
        """A leaf Parameter per key sharing :attr:`values`' memory (an update of the buffer is one of
        every key, and the other way round)."""
        return {key: torch.nn.Parameter(self.part(self.values, key)) for key in self.shapes}

    def link_grads(self, params: dict[str, torch.Tensor]) -> None:
        """Zero the gradient buffer and make every key's ``.grad`` its view of it."""
        self.grad.zero_()
        for key, p in params.items():
            if p.grad is not self._grads[key]:
                p.grad = self._grads[key]

    def grads_in_place(self, params: dict[str, torch.Tensor]) -> bool:
        """Whether every key's gradient is still its view of :attr:`grad` (a backward accumulated
        into it in place); where one was replaced (DP-SGD sets its own) its values are copied in,
        and False returned."""
        ok = True
        for key, p in params.items():
            view = self._grads[key]
            if p.grad is view or (p.grad is not None and p.grad.data_ptr() == view.data_ptr()
                                  and p.grad.stride() == view.stride()):
                continue
            ok = False
            view.copy_(p.grad) if p.grad is not None else view.zero_()
            p.grad = view
        return ok

    @no_grad
    def write_rows(self, buffer: torch.Tensor, sets: list[dict[str, torch.Tensor]]) -> None:
        """Client k's tensors of ``sets[k]`` (each exactly its slot's shape) into row k of ``buffer``.
        A set this layout made (:meth:`read_rows`) is one row already: one copy, asynchronous from
        pinned host memory; another is first concatenated where it lies (one call). One start
        shared by the group (a global method's) is copied once and broadcast over the rows."""
        shared = all(s is sets[0] for s in sets)
        rows = []
        for s in sets[:1 if shared else None]:
            row = self.row_of(s)
            if row is None:
                parts = [s[key].reshape(-1) for key in self.shapes]
                if len({t.device for t in parts}) > 1:
                    parts = [t.to(buffer.device) for t in parts]
                row = torch.cat(parts)
            rows.append(row)
        self.write_flat(buffer, rows, shared)

    @no_grad
    def write_flat(self, buffer: torch.Tensor, rows: list[torch.Tensor], shared: bool = False) -> None:
        """Rows (P,) into ``buffer``: ``rows[k]`` into row k, or (``shared``) ``rows[0]`` into every row;
        from pinned host memory without a wait per row (one at the end)."""
        pinned = False
        for k, row in enumerate(rows):
            if row.numel() != self.width:
                raise ValueError(f"client {k}'s tensors hold {row.numel()} values, its row {self.width}")
            pinned = pinned or (row.device.type == "cpu" and buffer.device.type == "cuda" and row.is_pinned())
            if shared:
                buffer.copy_(row.to(buffer.device).expand(self.k, -1))
            else:
                buffer[k].copy_(row, non_blocking=pinned)
        if pinned:  # (the host rows may change once this returns)
            torch.cuda.current_stream(buffer.device).synchronize()

    def row_of(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """:meth:`FlatLayout.row_of` of this stack's layout."""
        return self.layout.row_of(tensors)

    def read_rows(self, buffer: torch.Tensor, device: str | None = "cpu") -> list[dict[str, torch.Tensor]]:
        """Each client's tensors of ``buffer`` (to ``device``; None: where it is), views of its own
        row (:meth:`read_flat`)."""
        return [self.layout.views(row) for row in self.read_flat(buffer, device)]

    def read_flat(self, buffer: torch.Tensor, device: str | None = "cpu") -> list[torch.Tensor]:
        """Each client's row of ``buffer`` (to ``device``; None: where it is), copied into a storage of
        its own (a client's tensors never keep the others' alive). From a GPU to the host the rows
        are pinned and copied asynchronously, one wait for all (a pageable copy runs at a fraction of
        the link's speed)."""
        source = buffer.detach()
        target = torch.device(device) if device else source.device
        pin = target.type == "cpu" and source.device.type == "cuda"
        rows = []
        for k in range(self.k):
            row = torch.empty(self.width, dtype=source.dtype, device=target, pin_memory=pin)
            rows.append(row.copy_(source[k], non_blocking=pin))
        if pin:
            torch.cuda.current_stream(source.device).synchronize()
        return rows


# A (K, *shape) view of a (K, P) buffer is not dense, so autograd warns once that the gradient it
# accumulates into does not follow the layout it would pick for a fresh one; the in-place add into
# the view is what is wanted here.
warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")
