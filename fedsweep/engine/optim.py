"""The optimisers of a group of clients: each client's own optimiser, whatever the group's layout.

Over stacked tensors (dim 0 = client; LoRA), all held in one (K, P) buffer
(``models.flat``), :class:`StackedAdamW` and :class:`StackedSGD` are K
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
from collections.abc import Mapping
from typing import Callable

from fedsweep.engine.optim_state import FlatOptimizerState
from fedsweep.lazy import no_grad, torch
from fedsweep.models.transfer import tensor_on

View = Callable[..., "torch.Tensor"]
"""``view(tensor, i, k)``: client ``k``'s part of (a tensor shaped like) the i-th stepped tensor."""


def clip_rows(grad: torch.Tensor, active: list[int], max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_`` for each active client over its own row of ``grad`` (K, P),
    every tensor of the client end to end: row k is scaled by min(1, max_norm / (‖g_k‖ + 1e-6)),
    ‖g_k‖ the norm over all its tensors. Three calls for the group, whatever K and the tensors."""
    norms = torch.linalg.vector_norm(grad, dim=1)
    coef = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
    if len(active) < grad.shape[0]:  # (a client that sat the step out keeps its gradient: zero)
        keep = torch.ones_like(coef)
        keep[active] = 0.0
        coef = torch.maximum(coef, keep)
    grad.mul_(coef.unsqueeze(1))


class _Stacked:
    """What the stacked optimisers share: the group's :class:`~fedsweep.models.flat.FlatStack`
    (parameters, gradients and moments as (K, P) buffers), per-client step counts, the active
    clients' rows, each client's state read and written as its own torch optimiser's."""

    def __init__(self, flat, params: dict[str, torch.Tensor]):
        if list(params) != list(flat.shapes):
            raise ValueError("the stepped tensors must be the flat buffer's, in its order")
        self.flat, self.params = flat, dict(params)
        self.keys = list(params)
        self.steps = [0.0] * flat.k
        self.moments: list[torch.Tensor] = []
        """(K, P) buffers laid out like the parameters (AdamW's first and second moments)."""
        self.group = self._group()

    def _rows(self, active: list[int]):
        """(every client active, index of the active rows or None)."""
        every = len(active) == len(self.steps)
        return every, (None if every else tensor_on(list(active), self.flat.values.device))

    def clip(self, max_norm: float, active: list[int]) -> None:
        clip_rows(self.flat.grad, active, max_norm)

    def zero_grad(self) -> None:
        """Zero the gradient buffer; every tensor's ``.grad`` a view of it."""
        self.flat.link_grads(self.params)

    def gathered(self) -> bool:
        """Whether the step's backward accumulated into the gradient buffer (else it is copied in)."""
        return self.flat.grads_in_place(self.params)

    def _group(self) -> list[dict]:
        """``param_groups`` of one client's own torch optimiser (what its state dict carries)."""
        raise NotImplementedError

    # ------------------------------------------------------------ each client's state
    def _state_of(self, state: dict | None) -> dict:
        return (state or {}).get("state", {})

    @no_grad
    def load_all(self, states: list[Mapping | None], view: View, uniform: bool) -> None:
        """Every client's moments and step count from its torch optimiser's state dict (``None``: a
        fresh optimiser). ``uniform``: each client's tensors fill its rows (no rank padding): the
        group's moments are written in one copy per client and buffer — of the rows themselves where
        every state is one a group left (:class:`~fedsweep.engine.optim_state.FlatOptimizerState`)."""
        if uniform and self.moments and states and all(isinstance(s, FlatOptimizerState) and s.fits(self.flat.layout)
                                                       and set(s.rows) == set(self._names) for s in states):
            for buffer, name in zip(self.moments, self._names):
                self.flat.write_flat(buffer, [s.rows[name] for s in states])
            self.steps = [s.step for s in states]
            return
        own = [self._state_of(s) for s in states]
        full = [all(i in o for i in range(len(self.keys))) for o in own]
        if uniform and self.moments and all(full):
            for buffer, name in zip(self.moments, self._names):
                self.flat.write_rows(buffer, [{key: o[i][name] for i, key in enumerate(self.keys)} for o in own])
            self.steps = [float(o[0]["step"]) for o in own]
            return
        for k, o in enumerate(own):
            if o:  # (a fresh optimiser's moments are the buffers' zeros already)
                self.load(k, states[k], view)

    @no_grad
    def load(self, k: int, state: dict | None, view: View) -> None:
        """Client ``k``'s moments and step count from its torch optimiser's state dict."""
        self.steps[k] = 0.0
        own = self._state_of(state)
        for i, key in enumerate(self.keys):
            for buffer, name in zip(self.moments, self._names):
                part = view(self.flat.part(buffer, key), i, k)
                part.copy_(own[i][name]) if i in own else part.zero_()
            if i in own:
                self.steps[k] = float(own[i]["step"])

    def client_states(self, view: View, uniform: bool, device: str | None = None) -> list[Mapping]:
        """Every client's state as its own torch optimiser's ``state_dict()`` would be, tensors copied
        (to ``device`` if given; else where they are): at the full width each client's rows of the
        moment buffers, one copy each (:class:`~fedsweep.engine.optim_state.FlatOptimizerState`)."""
        if not uniform:
            return [self.client_state(k, view, device) for k in range(self.flat.k)]
        rows = [self.flat.read_flat(buffer, device) for buffer in self.moments]
        out: list[Mapping] = []
        for k, steps in enumerate(self.steps):
            groups = [dict(g) for g in self.group]
            if steps and self.moments:
                out.append(FlatOptimizerState(self.flat.layout, {name: r[k] for name, r in zip(self._names, rows)},
                                              steps, groups))
            else:
                out.append({"state": {}, "param_groups": groups})
        return out

    def client_state(self, k: int, view: View, device: str | None = None) -> dict:
        """Client ``k``'s state as its own torch optimiser's ``state_dict()`` would be."""
        state = {}
        if self.steps[k] and self.moments:
            for i, key in enumerate(self.keys):
                state[i] = {"step": torch.tensor(self.steps[k], dtype=torch.float32),
                            **{name: view(self.flat.part(b, key), i, k).detach().to(device or b.device, copy=True)
                               for b, name in zip(self.moments, self._names)}}
        return {"state": state, "param_groups": [dict(g) for g in self.group]}

    _names: tuple[str, ...] = ()


class StackedAdamW(_Stacked):
    """AdamW over a group's flat buffer (dim 0 = client) with per-client step counts: one update of
    every tensor of every client in a handful of calls."""

    _names = ("exp_avg", "exp_avg_sq")

    def __init__(self, flat, params: dict[str, torch.Tensor], lr: float, weight_decay: float,
                 betas=(0.9, 0.999), eps: float = 1e-8):
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        super().__init__(flat, params)
        self.moments = [torch.zeros_like(flat.values), torch.zeros_like(flat.values)]

    @no_grad
    def step(self, active: list[int]) -> None:
        """One AdamW step of the clients ``active`` (their gradients in the gradient buffer)."""
        every, pick = self._rows(active)
        lr, (beta1, beta2), eps, wd = self.lr, self.betas, self.eps, self.weight_decay
        for c in active:
            self.steps[c] += 1
        p, g = self.flat.values, self.flat.grad
        m, v = self.moments
        size = tensor_on([lr / (1 - beta1 ** self.steps[c]) for c in active], p.device, p.dtype).view(-1, 1)
        corr = tensor_on([math.sqrt(1 - beta2 ** self.steps[c]) for c in active], p.device, p.dtype).view(-1, 1)
        if every:
            pp, mm, vv, gg = p, m, v, g
        else:
            pp, mm, vv, gg = (t.index_select(0, pick) for t in (p, m, v, g))
        if wd:
            pp.mul_(1 - lr * wd)
        mm.lerp_(gg, 1 - beta1)
        vv.mul_(beta2).addcmul_(gg, gg, value=1 - beta2)
        denom = (vv.sqrt() / corr).add_(eps)
        pp.sub_(mm * size / denom)
        if not every:
            p.index_copy_(0, pick, pp)
            m.index_copy_(0, pick, mm)
            v.index_copy_(0, pick, vv)

    def _group(self) -> list[dict]:
        return torch.optim.AdamW([torch.zeros(1)], lr=self.lr, weight_decay=self.weight_decay).state_dict()["param_groups"]


class StackedSGD(_Stacked):
    """SGD without momentum over a group's flat buffer: θ_k ← θ_k − η(g_k + λθ_k) for the active clients."""

    def __init__(self, flat, params: dict[str, torch.Tensor], lr: float, weight_decay: float):
        self.lr, self.weight_decay = lr, weight_decay
        super().__init__(flat, params)

    @no_grad
    def step(self, active: list[int]) -> None:
        every, pick = self._rows(active)
        for c in active:
            self.steps[c] += 1
        p = self.flat.values
        g = self.flat.grad if every else self.flat.grad.index_select(0, pick)
        pp = p if every else p.index_select(0, pick)
        if self.weight_decay:
            g = g.add(pp, alpha=self.weight_decay)
        pp.add_(g, alpha=-self.lr)
        if not every:
            p.index_copy_(0, pick, pp)

    def _group(self) -> list[dict]:
        return torch.optim.SGD([torch.zeros(1)], lr=self.lr, weight_decay=self.weight_decay).state_dict()["param_groups"]


class TorchOptimizer:
    """One client's torch optimiser (``train.optimizer``) over its own tensors: LoReFT's
    interventions, and bitsandbytes' 8-bit AdamW, whose state is not elementwise per client."""

    def __init__(self, tc, params: list[torch.Tensor]):
        self.params = params
        self.inner = make_optimizer(tc, params)

    def load_all(self, states: list[dict | None], view: View, uniform: bool) -> None:
        if states[0] is not None:
            self.inner.load_state_dict(states[0])  # moves parked (CPU) state to the parameters' device

    def gathered(self) -> bool:
        return True

    def step(self, active: list[int]) -> None:
        self.inner.step()

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)

    def clip(self, max_norm: float, active: list[int]) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def client_states(self, view: View, uniform: bool, device: str | None = None) -> list[dict]:
        return [detach_state(self.inner.state_dict(), device)]


def make_optimizer(tc, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The run's optimiser (``tc``: the engine's settings): AdamW, bitsandbytes' 8-bit AdamW, or SGD,
    over the trainable tensors."""
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


def group_optimizer(settings, tensors: dict[str, torch.Tensor], flat=None):
    """The optimiser of a group's stepped ``tensors`` (``settings``: the engine's, ``optimizer``,
    ``learning_rate``, ``weight_decay``): stacked AdamW or SGD over their flat buffer where they have
    one (``flat``), else the client's own torch optimiser."""
    if flat is not None and settings.optimizer == "adamw":
        return StackedAdamW(flat, tensors, settings.learning_rate, settings.weight_decay)
    if flat is not None and settings.optimizer == "sgd":
        return StackedSGD(flat, tensors, settings.learning_rate, settings.weight_decay)
    return TorchOptimizer(settings, list(tensors.values()))
