"""The LoRA adapters of many clients on one frozen base, computed in one batch.

Every LoRA-wrapped linear module of a peft model gets its clients' factors stacked: A of shape
(K, r, d_in) and B of shape (K, d_out, r), zero-padded to the largest rank r among the K clients.
While a batch is live (:meth:`StackedLora.rows`), peft's own adapters are off and a forward hook on
each module's frozen base layer adds, to every row i of client k, that client's update

    h_i = W₀ x_i + (α / r_k) · B_k A_k · dropout_k(x_i)          (LoRA, Hu et al. 2021, eq. 3)

with ``torch.bmm`` over equal contiguous row groups (one per client), or per row with gathered
factors where the groups differ. The base runs once over all K clients' rows.

Padded rows of A_k and columns of B_k get exactly zero gradients (the padded column of B meets a
zero row of A and vice versa), so a zero-initialised padding stays exactly zero under AdamW.

Dropout (``lora.dropout > 0``) draws each client's masks from that client's own generator in the
order its own sequential forward would (module by module, one stream at a time), at the client's
own batch width, so on the CPU a client's masks are the ones its sequential training draws from
the global generator seeded the same way.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from fedsweep.algorithms.tensors import Params
from fedsweep.lazy import no_grad, torch


@dataclass(frozen=True)
class RowGroup:
    """``count`` consecutive rows of a batch belonging to stacked client ``index``; ``width``: that
    client's own batch width (its masks are drawn at it, as its sequential batch would be)."""

    index: int
    count: int
    width: int


def lora_modules(model) -> list[tuple[str, object]]:
    """(clean module name, peft LoRA layer) of every LoRA-wrapped module, in forward order."""
    return [(n.removeprefix("base_model.model."), m) for n, m in model.named_modules()
            if hasattr(m, "base_layer") and hasattr(m, "lora_A")]


class StackedLora:
    """The factors of ``ranks`` (one per stacked client) for every LoRA module of ``model``."""

    def __init__(self, model, ranks: list[int], alpha: float, dropout: float, device, dtype):
        self.model = model
        self.ranks = list(ranks)
        self.width = max(ranks)
        self.dropout = float(dropout)
        self.modules = lora_modules(model)
        k = len(ranks)
        self.a: dict[str, torch.nn.Parameter] = {}
        self.b: dict[str, torch.nn.Parameter] = {}
        for name, m in self.modules:
            base = m.base_layer
            self.a[name] = torch.nn.Parameter(torch.zeros(k, self.width, base.in_features, device=device, dtype=dtype))
            self.b[name] = torch.nn.Parameter(torch.zeros(k, base.out_features, self.width, device=device, dtype=dtype))
        self.scale = torch.tensor([alpha / r for r in ranks], device=device, dtype=dtype).view(k, 1, 1)
        self._groups: list[RowGroup] | None = None
        self._pick: torch.Tensor | None = None  # (per batch) the stacked clients of equal row groups, in order
        self._owner: torch.Tensor | None = None  # (per batch) each row's stacked client, where groups differ
        self._generators: list[torch.Generator] | None = None
        self._handles = []

    # ----------------------------------------------------------------- naming
    def tensors(self) -> dict[str, torch.nn.Parameter]:
        """Every stacked tensor by its per-client key (``<module>.lora_A.weight``), A before B per module."""
        out = {}
        for name, _ in self.modules:
            out[f"{name}.lora_A.weight"] = self.a[name]
            out[f"{name}.lora_B.weight"] = self.b[name]
        return out

    def view(self, tensor: torch.Tensor, key: str, k: int) -> torch.Tensor:
        """Client ``k``'s part of a stacked tensor (or of one shaped like it): rows of A, columns of B
        up to its rank."""
        r = self.ranks[k]
        return tensor[k, :r] if "lora_A" in key else tensor[k, :, :r]

    def client(self, k: int) -> dict[str, torch.Tensor]:
        """Client ``k``'s factors as views of the stacks (gradients flow to the stacks)."""
        return {key: self.view(t, key, k) for key, t in self.tensors().items()}

    @no_grad
    def write(self, k: int, params: Params) -> None:
        """Set client ``k``'s factors (its padding stays zero)."""
        stacked = self.tensors()
        if set(params) != set(stacked):
            extra, missing = sorted(set(params) - set(stacked))[:3], sorted(set(stacked) - set(params))[:3]
            raise ValueError(f"adapter mismatch: unexpected {extra}, missing {missing}")
        for key, t in stacked.items():
            self.view(t, key, k).copy_(params[key])

    def read(self, k: int) -> Params:
        """A CPU copy of client ``k``'s factors (what ``lora.read_adapter`` returns for its adapter)."""
        return {key: v.detach().to("cpu", copy=True) for key, v in self.client(k).items()}

    # --------------------------------------------------------------- forward
    def attach(self, generators: list[torch.Generator] | None = None) -> None:
        """Turn peft's adapters off and route every LoRA module through the stacks (``generators``:
        one per stacked client, for dropout)."""
        self.model.base_model.disable_adapter_layers()
        self._generators = generators
        self._handles = [m.base_layer.register_forward_hook(self._hook(name)) for name, m in self.modules]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.model.base_model.enable_adapter_layers()

    @contextlib.contextmanager
    def rows(self, groups: list[RowGroup]):
        """Forward passes inside compute each row with its group's client's factors. Which factors a
        row takes is worked out here, once per batch, not in every module's hook."""
        device = self.scale.device
        self._groups, self._pick, self._owner = groups, None, None
        if len({g.count for g in groups}) == 1:
            index = [g.index for g in groups]
            if index != list(range(len(self.ranks))):
                self._pick = torch.tensor(index, device=device)
        else:
            self._owner = torch.tensor([g.index for g in groups for _ in range(g.count)], device=device)
        try:
            yield
        finally:
            self._groups = self._pick = self._owner = None

    def _hook(self, name: str):
        def add_update(module, args, output):
            if self._groups is None:
                raise RuntimeError("a stacked LoRA forward outside StackedLora.rows()")
            return (output + self._update(name, args[0])).to(output.dtype)

        return add_update

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        if not self.dropout or not self.model.training:
            return x
        p, parts, start = self.dropout, [], 0
        for g in self._groups:
            rows = x[start:start + g.count]
            noise = torch.empty((g.count, g.width) + tuple(x.shape[2:]), dtype=x.dtype)
            noise.bernoulli_(1 - p, generator=self._generators[g.index]).div_(1 - p)
            if g.width < x.shape[1]:
                noise = torch.nn.functional.pad(noise, (0, 0, 0, x.shape[1] - g.width))
            parts.append(rows * noise.to(x.device))
            start += g.count
        return torch.cat(parts)

    def _update(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """(α/r_k) B_k A_k dropout_k(x_i) for every row i, of shape (N, T, d_out)."""
        a, b, scale = self.a[name], self.b[name], self.scale
        x = self._dropped(x.to(a.dtype))
        n, t = x.shape[0], x.shape[1]
        if self._owner is None:  # equal contiguous row groups: one bmm per factor over (clients, rows·T)
            if self._pick is not None:
                a, b, scale = a.index_select(0, self._pick), b.index_select(0, self._pick), scale.index_select(0, self._pick)
            groups = len(self._groups)
            h = torch.bmm(x.reshape(groups, n // groups * t, -1), a.transpose(1, 2))
            return (torch.bmm(h, b.transpose(1, 2)) * scale).reshape(n, t, -1)
        owner = self._owner
        h = torch.bmm(x, a.index_select(0, owner).transpose(1, 2))
        return torch.bmm(h, b.index_select(0, owner).transpose(1, 2)) * scale.index_select(0, owner)
