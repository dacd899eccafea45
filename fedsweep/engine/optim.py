"""The optimisers of a group of clients: each client's own optimiser, whatever the group's layout.

Over stacked tensors (dim 0 = client; LoRA) :class:`StackedAdamW` and :class:`StackedSGD` are K
independent optimisers side by side: the update is elementwise, so one update over a stack is the
K clients' updates, as long as what is per client stays per client — the step count t_k (clients
that trained different numbers of rounds differ), hence AdamW's bias corrections, and which clients
step at all (a client that finished its steps leaves the group: its tensors and moments are left
untouched). Over one client's own tensors (LoReFT, bitsandbytes' 8-bit AdamW) :class:`TorchOptimizer`
is the torch optimiser itself. All three read and write a client's state as its own
``torch.optim`` optimiser's ``state_dict()`` (tensors in the client's shapes), so a client trains
in a group in one round and alone in the next (or after a resume) without a seam.

AdamW is ``torch.optim.AdamW``'s (Loshchilov & Hutter 2019, Algorithm 2, as PyTorch implements it)::

    θ ← θ(1 − ηλ);  m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²
    θ ← θ − η/(1−β₁ᵗ) · m / (√v / √(1−β₂ᵗ) + ε)

SGD is ``torch.optim.SGD`` without momentum: θ ← θ − η(g + λθ).
"""

from __future__ import annotations

import math
from typing import Callable

from fedsweep.lazy import no_grad, torch

View = Callable[..., "torch.Tensor"]
"""``view(tensor, i, k)``: client ``k``'s part of (a tensor shaped like) the i-th stepped tensor."""


def clip_per_client(grads: list[torch.Tensor], views: View, active: list[int], max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_`` for each active client over its own part of ``grads``:
    each client's gradient is scaled by min(1, max_norm / (‖g_k‖ + 1e-6)), ‖g_k‖ its norm over all
    its tensors."""
    for k in active:
        parts = [views(g, i, k) for i, g in enumerate(grads) if g is not None]
        if not parts:
            continue
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p) for p in parts]))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in parts:
            p.mul_(coef)


class _Stacked:
    """What the stacked optimisers share: per-client step counts, the active clients' rows."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = list(params)
        self.steps = [0.0] * (self.params[0].shape[0] if self.params else 0)

    def _rows(self, active: list[int]):
        """(every client active, index of the active rows or None)."""
        every = len(active) == len(self.steps)
        return every, (None if every else torch.tensor(active, device=self.params[0].device))

    def clip(self, max_norm: float, active: list[int], view: View) -> None:
        clip_per_client([p.grad for p in self.params], view, active, max_norm)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _group(self) -> list[dict]:
        """``param_groups`` of one client's own torch optimiser (what its state dict carries)."""
        raise NotImplementedError


class StackedAdamW(_Stacked):
    """AdamW over ``params`` (stacked tensors, dim 0 = client) with per-client step counts."""

    def __init__(self, params: list[torch.Tensor], lr: float, weight_decay: float, betas=(0.9, 0.999),
                 eps: float = 1e-8):
        super().__init__(params)
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]

    @no_grad
    def step(self, active: list[int]) -> None:
        """One AdamW step of the clients ``active`` (their gradients in ``p.grad``)."""
        every, pick = self._rows(active)
        lr, (beta1, beta2), eps, wd = self.lr, self.betas, self.eps, self.weight_decay
        for c in active:
            self.steps[c] += 1
        first = self.params[0]  # the stacks share a dtype and device: the per-client factors are made once
        size = torch.tensor([lr / (1 - beta1 ** self.steps[c]) for c in active], dtype=first.dtype, device=first.device)
        corr = torch.tensor([math.sqrt(1 - beta2 ** self.steps[c]) for c in active], dtype=first.dtype,
                            device=first.device)
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            if p.grad is None:
                continue
            shape = (len(active),) + (1,) * (p.dim() - 1)
            size_p, corr_p = size.view(shape), corr.view(shape)
            if every:
                pp, mm, vv, g = p.data, m, v, p.grad
            else:
                pp, mm, vv, g = (t.index_select(0, pick) for t in (p.data, m, v, p.grad))
            if wd:
                pp.mul_(1 - lr * wd)
            mm.lerp_(g, 1 - beta1)
            vv.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (vv.sqrt() / corr_p).add_(eps)
            pp.sub_(mm * size_p / denom)
            if not every:
                p.data.index_copy_(0, pick, pp)
                m.index_copy_(0, pick, mm)
                v.index_copy_(0, pick, vv)

    def _group(self) -> list[dict]:
        return torch.optim.AdamW([torch.zeros(1)], lr=self.lr, weight_decay=self.weight_decay).state_dict()["param_groups"]

    @no_grad
    def load(self, k: int, state: dict | None, view: View) -> None:
        """Client ``k``'s moments and step count from its ``torch.optim.AdamW`` state dict (``None``:
        a fresh optimiser)."""
        self.steps[k] = 0.0
        for i, (m, v) in enumerate(zip(self.exp_avg, self.exp_avg_sq)):
            own = (state or {}).get("state", {}).get(i)
            mv, vv = view(m, i, k), view(v, i, k)
            if own is None:
                mv.zero_()
                vv.zero_()
                continue
            mv.copy_(own["exp_avg"])
            vv.copy_(own["exp_avg_sq"])
            self.steps[k] = float(own["step"])

    def client_state(self, k: int, view: View, device: str | None = None) -> dict:
        """Client ``k``'s state as its own ``torch.optim.AdamW.state_dict()`` would be, tensors copied
        (to ``device`` if given)."""
        def copy(t):
            return t.detach().to(device or t.device, copy=True)

        state = {}
        if self.steps[k]:
            for i, (m, v) in enumerate(zip(self.exp_avg, self.exp_avg_sq)):
                state[i] = {"step": torch.tensor(self.steps[k], dtype=torch.float32),
                            "exp_avg": copy(view(m, i, k)), "exp_avg_sq": copy(view(v, i, k))}
        return {"state": state, "param_groups": self._group()}


class StackedSGD(_Stacked):
    """SGD without momentum over stacked tensors: θ_k ← θ_k − η(g_k + λθ_k) for the active clients."""

    def __init__(self, params: list[torch.Tensor], lr: float, weight_decay: float):
        super().__init__(params)
        self.lr, self.weight_decay = lr, weight_decay

    @no_grad
    def step(self, active: list[int]) -> None:
        every, pick = self._rows(active)
        for c in active:
            self.steps[c] += 1
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad if every else p.grad.index_select(0, pick)
            pp = p.data if every else p.data.index_select(0, pick)
            if self.weight_decay:
                g = g.add(pp, alpha=self.weight_decay)
            pp.add_(g, alpha=-self.lr)
            if not every:
                p.data.index_copy_(0, pick, pp)

    def _group(self) -> list[dict]:
        return torch.optim.SGD([torch.zeros(1)], lr=self.lr, weight_decay=self.weight_decay).state_dict()["param_groups"]

    def load(self, k: int, state: dict | None, view: View) -> None:
        self.steps[k] = 0.0  # momentum-free SGD keeps no state

    def client_state(self, k: int, view: View, device: str | None = None) -> dict:
        return {"state": {}, "param_groups": self._group()}


class TorchOptimizer:
    """One client's torch optimiser (``train.optimizer``) over its own tensors: LoReFT's
    interventions, and bitsandbytes' 8-bit AdamW, whose state is not elementwise per client."""

    def __init__(self, tc, params: list[torch.Tensor]):
        self.params = params
        self.inner = make_optimizer(tc, params)

    def load(self, k: int, state: dict | None, view: View) -> None:
        if state is not None:
            self.inner.load_state_dict(state)  # moves parked (CPU) state to the parameters' device

    def step(self, active: list[int]) -> None:
        self.inner.step()

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)

    def clip(self, max_norm: float, active: list[int], view: View) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def client_state(self, k: int, view: View, device: str | None = None) -> dict:
        return detach_state(self.inner.state_dict(), device)


def make_optimizer(tc, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """``train.optimizer``: AdamW, bitsandbytes' 8-bit AdamW, or SGD, over the trainable tensors."""
    if tc.optimizer == "sgd":
        return torch.optim.SGD(params, lr=tc.learning_rate, weight_decay=tc.weight_decay)
    if tc.optimizer == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ValueError("train.optimizer=adamw_8bit needs the bitsandbytes package on every GPU node") from None
        return bnb.optim.AdamW8bit(params, lr=tc.learning_rate, weight_decay=tc.weight_decay)
    return torch.optim.AdamW(params, lr=tc.learning_rate, weight_decay=tc.weight_decay)


def detach_state(state: dict, device: str | None = None) -> dict:
    """A deep copy of an optimiser state dict (tensors cloned; moved to ``device`` if given, e.g. parked on
    the CPU) that later steps cannot mutate."""
    def copy(v):
        return v.detach().to(device or v.device, copy=True)

    return {"state": {i: {k: (copy(v) if torch.is_tensor(v) else v) for k, v in s.items()}
                      for i, s in state["state"].items()},
            "param_groups": [dict(g) for g in state["param_groups"]]}


def group_optimizer(tc, tensors: list[torch.Tensor], stacked: bool):
    """The optimiser of a group's stepped ``tensors``: stacked AdamW or SGD where the tensors are
    stacks, else the client's own torch optimiser."""
    if stacked and tc.optimizer == "adamw":
        return StackedAdamW(tensors, tc.learning_rate, tc.weight_decay)
    if stacked and tc.optimizer == "sgd":
        return StackedSGD(tensors, tc.learning_rate, tc.weight_decay)
    return TorchOptimizer(tc, tensors)
