"""LoRA computed from stacked factors: the one way a LoRA adapter computes, for 1 or K clients.

Every LoRA-wrapped linear module of a peft model gets its clients' factors stacked: A of shape
(K, r, d_in) and B of shape (K, d_out, r), zero-padded to the largest rank r among the K clients.
The stacks are views of one (K, P) buffer per kind (trained, frozen: ``models.flat``), row k client
k's factors end to end, so a group's start is written and its result read in one call each.
peft's own adapter layers are switched off for good (they only give the adapter its names and its
initial values); while a :class:`StackedLora` is attached, a forward hook on each module's frozen
base layer adds, to every row i owned by client k (:meth:`StackedLora.rows`), that client's update

    h_i = W₀ x_i + (α / r_k) · B_k A_k · dropout(x_i)          (LoRA, Hu et al. 2021, eq. 3)

with one matmul pair where every row has one owner, ``torch.bmm`` over equal contiguous row groups,
or per row with gathered factors where the groups differ. The base runs once over all rows.

Padded rows of A_k and columns of B_k get exactly zero gradients (the padded column of B meets a
zero row of A and vice versa), so a zero-initialised padding stays exactly zero under AdamW.

Dropout (``lora.dropout > 0``) is keyed, not drawn from a running generator: the mask of a row is a
function of the row's *draw* — (a seed key, the row's place in its set, the set's rows and width),
the set being one client's batch of one stream at one step — and of the module. A client's masks
are therefore the same whichever rows share its forward, however a step's rows are cut into
forwards, and when gradient checkpointing recomputes a layer in backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

from fedsweep.algorithms.tensors import Params, RowSets
from fedsweep.lazy import no_grad, torch
from fedsweep.models.flat import FlatStack
from fedsweep.models.transfer import tensor_on
from fedsweep.salts import dropout_mask_seed


AUTOCAST_DEVICES = ("cuda", "cpu", "xpu", "mps")
"""Device types torch's autocast knows (asking of another, e.g. the planner's ``meta``, raises)."""


@dataclass(frozen=True)
class Draw:
    """Where a row's dropout mask comes from: row ``row`` of a set of ``rows`` rows of ``width``
    tokens whose masks are seeded by ``seed`` (one client's batch of one stream at one step)."""

    seed: int
    row: int
    rows: int
    width: int


LORA_SLOT = "_fedsweep_lora"
"""Where an attached :class:`StackedLora` leaves, on each wrapped module's frozen base layer, the module's
place in forward order and its stacked factors (A, B): a plain attribute, not a registered parameter."""


def lora_modules(model) -> list[tuple[str, object]]:
    """(clean module name, peft LoRA layer) of every LoRA-wrapped module, in forward order."""
    return [(n.removeprefix("base_model.model."), m) for n, m in model.named_modules()
            if hasattr(m, "base_layer") and hasattr(m, "lora_A")]


class StackedLora:
    """The factors of ``ranks`` (one per stacked client) for every LoRA module of ``model``."""

    def __init__(self, model, ranks: list[int], alpha: float, dropout: float, device, dtype,
                 trained: Callable[[str], bool] = lambda key: True, modules: list[tuple[str, object]] | None = None):
        """``modules``: :func:`lora_modules` of ``model`` where the caller keeps them (a walk of every
        module of the model otherwise)."""
        self.model = model
        self.ranks = list(ranks)
        self.width = max(ranks)
        self.uniform = all(r == self.width for r in ranks)
        """Every client at the full width: a client's tensors are exactly its rows of the stacks."""
        self.dropout = float(dropout)
        self.modules = modules if modules is not None else lora_modules(model)
        k = len(ranks)
        shapes = {}
        for name, m in self.modules:
            base = m.base_layer
            shapes[f"{name}.lora_A.weight"] = (self.width, base.in_features)
            shapes[f"{name}.lora_B.weight"] = (base.out_features, self.width)
        # the trained tensors in one (K, P) buffer, the frozen ones (a method's, e.g. FFA-LoRA's A) in another
        self.trained = FlatStack({key: v for key, v in shapes.items() if trained(key)}, k, device, dtype)
        self.frozen = FlatStack({key: v for key, v in shapes.items() if not trained(key)}, k, device, dtype)
        params = {**self.trained.parameters(), **self.frozen.parameters()}
        self._tensors = {key: params[key] for key in shapes}
        self.a = {name: params[f"{name}.lora_A.weight"] for name, _ in self.modules}
        self.b = {name: params[f"{name}.lora_B.weight"] for name, _ in self.modules}
        self.scale = torch.tensor([alpha / r for r in ranks], device=device, dtype=dtype).view(k, 1, 1)
        self._scales = [alpha / r for r in ranks]
        self._bound = False  # (per forward) whether rows() laid this forward's rows out
        self._draws: list[Draw] | None = None
        self._single: int | None = None  # (per forward) the one owner of every row
        self._pick: torch.Tensor | None = None  # (per forward) the clients of equal contiguous row groups
        self._every = False  # (per forward) whether those are every client, in order
        self._owner: torch.Tensor | None = None  # (per forward) each row's client, where groups differ
        self._off = False
        self._handles = []

    # ----------------------------------------------------------------- naming
    def tensors(self) -> dict[str, torch.nn.Parameter]:
        """Every stacked tensor by its per-client key (``<module>.lora_A.weight``), A before B per module."""
        return dict(self._tensors)

    def view(self, tensor: torch.Tensor, key: str, k: int) -> torch.Tensor:
        """Client ``k``'s part of a stacked tensor (or of one shaped like it): rows of A, columns of B
        up to its rank."""
        r = self.ranks[k]
        return tensor[k, :r] if "lora_A" in key else tensor[k, :, :r]

    def client(self, k: int) -> dict[str, torch.Tensor]:
        """Client ``k``'s factors as views of the stacks (gradients flow to the stacks)."""
        return {key: self.view(t, key, k) for key, t in self.tensors().items()}

    def _check(self, params: Params) -> None:
        """Refuse a client's set whose keys are not the stacks'."""
        if set(params) != set(self._tensors):
            extra, missing = sorted(set(params) - set(self._tensors))[:3], sorted(set(self._tensors) - set(params))[:3]
            raise ValueError(f"adapter mismatch: unexpected {extra}, missing {missing}")

    @no_grad
    def write(self, k: int, params: Params) -> None:
        """Set client ``k``'s factors (its padding stays zero)."""
        self._check(params)
        for key, t in self._tensors.items():
            self.view(t, key, k).copy_(params[key])

    def read(self, k: int) -> Params:
        """A CPU copy of client ``k``'s factors (what ``lora.read_adapter`` returns for its adapter)."""
        return {key: v.detach().to("cpu", copy=True) for key, v in self.client(k).items()}

    def write_all(self, sets: list[Params]) -> None:
        """Set every client's factors, ``sets[k]`` client k's: at the full width one copy per buffer."""
        if not self.uniform:
            for k, params in enumerate(sets):
                self.write(k, params)
            return
        for params in sets:
            self._check(params)
        for flat in (self.trained, self.frozen):
            if flat.width:
                flat.write_rows(flat.values, sets)

    @no_grad
    def write_rows(self, sets: RowSets) -> None:
        """Every client's factors from ``sets`` (row k client k's; every client at the full width): one copy per tensor."""
        if not self.uniform or set(sets.layout.shapes) != set(self._tensors):
            raise ValueError("stacked rows take every client at the full width, with the stacks' keys")
        for key, t in self._tensors.items():
            t.copy_(sets.part(key))

    def read_all(self) -> list[Params]:
        """CPU copies of every client's factors (:meth:`read` of each), at the full width one copy per buffer."""
        if not self.uniform:
            return [self.read(k) for k in range(len(self.ranks))]
        if not self.frozen.width and list(self.trained.shapes) == list(self._tensors):  # (every tensor trained)
            return self.trained.read_rows(self.trained.values)
        parts = [flat.read_rows(flat.values) if flat.width else [{}] * len(self.ranks)
                 for flat in (self.trained, self.frozen)]
        merged = [{**t, **f} for t, f in zip(*parts)]
        return [{key: m[key] for key in self._tensors} for m in merged]

    # --------------------------------------------------------------- forward
    def attach(self) -> None:
        """Route every LoRA module through the stacks (peft's own layers stay off). Every module's hook
        is one function, and what differs between modules (its place, its factors) is read from the
        module (``LORA_SLOT``), so a compiled decoder layer (``models.compiled``) is one graph for
        every layer of the model, not one a layer."""
        hook = self._hook()
        for i, (name, m) in enumerate(self.modules):
            m.base_layer.__dict__[LORA_SLOT] = (i, self.a[name], self.b[name])
        self._handles = [m.base_layer.register_forward_hook(hook) for _, m in self.modules]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for _, m in self.modules:
            m.base_layer.__dict__.pop(LORA_SLOT, None)

    @contextlib.contextmanager
    def rows(self, owners: list[int], draws: list[Draw] | None = None):
        """Forward (and backward: a checkpointed layer is recomputed in it) passes inside compute row
        i with client ``owners[i]``'s factors; ``draws[i]`` keys its dropout mask. Which factors a
        row takes is worked out here, once per forward, not in every module's hook."""
        device = self.scale.device
        self._bound, self._draws = True, draws
        self._single = self._pick = self._owner = None
        runs = _runs(owners)
        if len(runs) == 1:
            self._single = owners[0]
        elif len({n for _, n in runs}) == 1 and len({k for k, _ in runs}) == len(runs):
            self._pick = tensor_on([k for k, _ in runs], device)
            self._every = [k for k, _ in runs] == list(range(len(self.ranks)))
        else:
            self._owner = tensor_on(list(owners), device)
        try:
            yield
        finally:
            self._bound = False
            self._draws = self._single = self._pick = self._owner = None

    @contextlib.contextmanager
    def off(self):
        """Forward passes inside compute the frozen base alone (DPO's reference policy)."""
        self._off = True
        try:
            yield
        finally:
            self._off = False

    def _hook(self):
        def add_update(module, args, output):
            if self._off:
                return output
            if not self._bound:
                raise RuntimeError("a LoRA forward outside StackedLora.rows(): the engine lays out every forward")
            index, a, b = module.__dict__[LORA_SLOT]
            return (output + self._update(index, a, b, args[0])).to(output.dtype)

        return add_update

    def _dropped(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if not self.dropout or not self.model.training:
            return x
        if self._draws is None:
            raise RuntimeError("lora.dropout in training needs each row's draw (StackedLora.rows(draws=...))")
        p, width = self.dropout, x.shape[1]
        noise = torch.ones(x.shape, dtype=x.dtype)
        sets: dict[tuple, list[tuple[int, int]]] = {}
        for i, d in enumerate(self._draws):
            sets.setdefault((d.seed, d.rows, d.width), []).append((i, d.row))
        for (seed, rows, set_width), members in sets.items():
            gen = torch.Generator().manual_seed(dropout_mask_seed(seed, index))
            mask = torch.empty((rows, set_width) + tuple(x.shape[2:]), dtype=x.dtype)
            mask.bernoulli_(1 - p, generator=gen).div_(1 - p)
            w = min(width, set_width)
            for i, row in members:
                noise[i, :w] = mask[row, :w]
        return x * noise.to(x.device)

    def _update(self, index: int, a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(α/r_k) B_k A_k dropout(x_i) for every row i, of shape (N, T, d_out).

        The scale multiplies B_k (d_out × r), not the (N, T, d_out) product: one small op instead of
        one over every position. Under autocast the input keeps its half dtype: the matmuls cast to
        it anyway (peft's cast of x to the factors' float32 would be undone at once), so the only
        float32 copy is of the factors; without autocast, or with dropout in training (its mask is
        applied in float32, as peft does), x takes the factors' dtype."""
        scale = self.scale
        kind = x.device.type
        if kind not in AUTOCAST_DEVICES or not torch.is_autocast_enabled(kind) or (self.dropout and self.model.training):
            x = x.to(a.dtype)
        x = self._dropped(index, x)
        if self._single is not None:  # every row one client's: one matmul pair, as peft computes it
            k = self._single
            if a.shape[0] == 1:  # a view whose backward is a view too (a select's scatters a copy)
                ak, bk = a.view(a.shape[1:]), b.view(b.shape[1:])
            else:
                ak, bk = a[k], b[k]
            return torch.nn.functional.linear(torch.nn.functional.linear(x, ak), bk * self._scales[k])
        n, t = x.shape[0], x.shape[1]
        if self._pick is not None:  # equal contiguous row groups: one bmm per factor over (clients, rows·T)
            if not self._every:  # (all clients in order: the stacks themselves, no gather)
                a, b, scale = a.index_select(0, self._pick), b.index_select(0, self._pick), scale.index_select(0, self._pick)
            groups = self._pick.numel()
            h = torch.bmm(x.reshape(groups, n // groups * t, -1), a.transpose(1, 2))
            return torch.bmm(h, (b * scale).transpose(1, 2)).reshape(n, t, -1)
        owner = self._owner
        h = torch.bmm(x, a.index_select(0, owner).transpose(1, 2))
        return torch.bmm(h, (b * scale).index_select(0, owner).transpose(1, 2))


def _runs(owners: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of equal owners as (owner, length)."""
    out: list[tuple[int, int]] = []
    for k in owners:
        if out and out[-1][0] == k:
            out[-1] = (k, out[-1][1] + 1)
        else:
            out.append((k, 1))
    return out
