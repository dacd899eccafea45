"""LoReFT interventions of K clients stacked: the one way an intervention computes, for 1 or K clients.

Every intervention tensor of one client (``reft.layers.<l>.<g>.<W|R|b>``, and a classification head's
``reft.head.*``) gets the group's clients on dim 0 — W and R of shape (K, r, d), b of shape (K, r) —
as views of one (K, P) buffer per kind (trained, frozen: ``models.flat``), so the engine's stacked
optimisers, clipping and copies are one call over the group as for LoRA. While attached
(``models.reft.ReftHooks`` calls :meth:`StackedReft.delta` from each intervened layer's forward hook),
row i of a forward owned by client k (:meth:`StackedReft.rows`) gets client k's intervention

    Φ_k(h) = h + R_kᵀ(W_k h + b_k − R_k h)                 (LoReFT; FedReFT+ eq. 1)

at its intervened positions: one matmul chain where every row has one owner (the expression a
client alone computes), ``torch.bmm`` over equal contiguous row groups, or per row with gathered
tensors where the groups differ. The classification head (FedReFT+ eq. 3) is per row's owner too.
Rows of different clients never mix: each row's result equals its client's alone up to float
rounding (``tests/test_lockstep.py``).
"""

from __future__ import annotations

import contextlib
from typing import Callable

from fedsweep.algorithms.fedreft import retract_rows
from fedsweep.algorithms.tensors import Params, RowSets
from fedsweep.lazy import no_grad, torch
from fedsweep.models.flat import FlatStack
from fedsweep.models.transfer import tensor_on


class StackedReft:
    """The interventions of ``k`` clients, shaped like ``template`` (one client's tensors by key, in
    order); ``trained(key)``: whether a tensor is trained (the trained ones share one buffer)."""

    def __init__(self, template: Params, k: int, device, trained: Callable[[str], bool] = lambda key: True):
        shapes = {key: tuple(v.shape) for key, v in template.items()}
        dtype = next(iter(template.values())).dtype
        self.k = k
        self.trained = FlatStack({key: s for key, s in shapes.items() if trained(key)}, k, device, dtype)
        self.frozen = FlatStack({key: s for key, s in shapes.items() if not trained(key)}, k, device, dtype)
        params = {**self.trained.parameters(), **self.frozen.parameters()}
        self._tensors = {key: params[key] for key in shapes}
        self._single: int | None = None  # (per forward) the one owner of every row
        self._pick: torch.Tensor | None = None  # (per forward) the clients of equal contiguous row groups
        self._owner: torch.Tensor | None = None  # (per forward) each row's client, where groups differ
        self._bound = False

    # ----------------------------------------------------------------- naming
    def tensors(self) -> dict[str, torch.nn.Parameter]:
        """Every stacked tensor by its per-client key, in the template's order."""
        return dict(self._tensors)

    @staticmethod
    def view(tensor: torch.Tensor, key: str, k: int) -> torch.Tensor:
        return tensor[k]

    def client(self, k: int) -> dict[str, torch.Tensor]:
        """Client ``k``'s tensors as views of the stacks (gradients flow to the stacks)."""
        return {key: t[k] for key, t in self._tensors.items()}

    def write_all(self, sets: list[Params]) -> None:
        for params in sets:
            if set(params) != set(self._tensors):
                raise ValueError(f"intervention mismatch: {sorted(set(params) ^ set(self._tensors))[:3]}")
        for flat in (self.trained, self.frozen):
            if flat.width:
                flat.write_rows(flat.values, sets)

    @no_grad
    def write_rows(self, sets: RowSets) -> None:
        """Every client's tensors from ``sets`` (row k client k's): one copy per tensor."""
        if set(sets.layout.shapes) != set(self._tensors):
            raise ValueError(f"intervention mismatch: {sorted(set(sets.layout.shapes) ^ set(self._tensors))[:3]}")
        for key, t in self._tensors.items():
            t.copy_(sets.part(key))

    def read_all(self) -> list[Params]:
        """CPU copies of every client's tensors, one copy per buffer."""
        parts = [flat.read_rows(flat.values) if flat.width else [{}] * self.k for flat in (self.trained, self.frozen)]
        return [{key: {**t, **f}[key] for key in self._tensors} for t, f in zip(*parts)]

    def read(self, k: int) -> Params:
        return {key: v.detach().to("cpu", copy=True) for key, v in self.client(k).items()}

    @no_grad
    def retract(self, active: list[int] | None = None) -> None:
        """Re-orthonormalise every R of the ``active`` clients (all: None) after a step."""
        for key, t in self._tensors.items():
            if key.endswith(".R"):
                if active is None or len(active) == self.k:
                    t.copy_(retract_rows(t))
                else:
                    index = tensor_on(active, t.device)
                    t.index_copy_(0, index, retract_rows(t.index_select(0, index)))

    # --------------------------------------------------------------- forward
    @contextlib.contextmanager
    def rows(self, owners: list[int]):
        """Forward (and backward) passes inside compute row i with client ``owners[i]``'s interventions."""
        runs: list[tuple[int, int]] = []
        for k in owners:
            if runs and runs[-1][0] == k:
                runs[-1] = (k, runs[-1][1] + 1)
            else:
                runs.append((k, 1))
        device = next(iter(self._tensors.values())).device
        self._bound, self._single, self._pick, self._owner = True, None, None, None
        if len(runs) == 1:
            self._single = owners[0]
        elif len({n for _, n in runs}) == 1 and len({k for k, _ in runs}) == len(runs):
            self._pick = tensor_on([k for k, _ in runs], device)
        else:
            self._owner = tensor_on(list(owners), device)
        try:
            yield
        finally:
            self._bound, self._single, self._pick, self._owner = False, None, None, None

    def _stacks(self, prefix: str, names: tuple[str, ...]) -> list[torch.Tensor]:
        return [self._tensors[f"{prefix}.{n}"] for n in names]

    def delta(self, prefix: str, h: torch.Tensor) -> torch.Tensor:
        """R_kᵀ(W_k h + b_k − R_k h) for every row of ``h`` (N, T, d), k the row's owner (:meth:`rows`; a
        stack of one client needs none); ``prefix``: the intervention's keys (``reft.layers.<l>.<g>``)."""
        if not self._bound and self.k > 1:
            raise RuntimeError("a LoReFT forward outside StackedReft.rows(): the engine lays out every forward")
        w, r, b = self._stacks(prefix, ("W", "R", "b"))
        if self._single is not None or not self._bound:  # every row one client's: the expression of LoReFT.delta alone
            k = self._single or 0
            rk, wk, bk = r[k].to(h.dtype), w[k].to(h.dtype), b[k].to(h.dtype)
            return (h @ wk.T + bk - h @ rk.T) @ rk
        n, t = h.shape[0], h.shape[1]
        if self._pick is not None:  # equal contiguous row groups: one bmm per factor over (clients, rows·T)
            groups = self._pick.numel()
            w, r, b = (x.index_select(0, self._pick).to(h.dtype) for x in (w, r, b))
            x = h.reshape(groups, n // groups * t, -1)
            inner = torch.bmm(x, w.transpose(1, 2)) + b.unsqueeze(1) - torch.bmm(x, r.transpose(1, 2))
            return torch.bmm(inner, r).reshape(n, t, -1)
        owner = self._owner
        w, r, b = (x.index_select(0, owner).to(h.dtype) for x in (w, r, b))
        inner = torch.bmm(h, w.transpose(1, 2)) + b.unsqueeze(1) - torch.bmm(h, r.transpose(1, 2))
        return torch.bmm(inner, r)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """The classification head of each row's owner on ``z`` (N, d) (``models.reft.ClassificationHead``)."""
        if not self._bound and self.k > 1:
            raise RuntimeError("a classification head outside StackedReft.rows()")
        w_d, b_d, w_o, b_o = self._stacks("reft.head", ("W_d", "b_d", "W_o", "b_o"))
        z = z.to(w_d.dtype)
        if self._single is not None or not self._bound:
            k = self._single or 0
            return torch.tanh(z @ w_d[k].T + b_d[k]) @ w_o[k].T + b_o[k]
        owner = self._owner if self._owner is not None else \
            self._pick.repeat_interleave(z.shape[0] // self._pick.numel())
        hidden = torch.tanh(torch.bmm(w_d.index_select(0, owner), z.unsqueeze(-1)).squeeze(-1) + b_d.index_select(0, owner))
        return torch.bmm(w_o.index_select(0, owner), hidden.unsqueeze(-1)).squeeze(-1) + b_o.index_select(0, owner)
