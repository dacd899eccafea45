"""K independent AdamWs over stacked tensors (one client per leading index), and per-client clipping.

AdamW is elementwise, so one update over a stacked tensor is K clients' AdamWs side by side, as
long as what is per client stays per client: the step count t_k (clients that trained different
numbers of rounds differ), hence the bias corrections, and which clients step at all (a client
that finished its steps leaves the batch: its tensors and moments are left untouched). The update
is ``torch.optim.AdamW``'s (Loshchilov & Hutter 2019, Algorithm 2, as PyTorch implements it):

    θ ← θ(1 − ηλ);  m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²
    θ ← θ − η/(1−β₁ᵗ) · m / (√v / √(1−β₂ᵗ) + ε)

Each client's moments load from and return to its own ``torch.optim.AdamW`` state dict, so a
client trains batched in one round and alone in the next (or after a resume) without a seam.
"""

from __future__ import annotations

import math

from fedsweep.lazy import no_grad, torch


def clip_per_client(grads: list[torch.Tensor], views, active: list[int], max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_`` for each active client over its own part of ``grads``
    (``views(tensor, i, k)``: client ``k``'s part of the i-th tensor): each client's gradient is
    scaled by min(1, max_norm / (‖g_k‖ + 1e-6)), ‖g_k‖ its norm over all its tensors."""
    for k in active:
        parts = [views(g, i, k) for i, g in enumerate(grads)]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p) for p in parts]))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in parts:
            p.mul_(coef)


class StackedAdamW:
    """AdamW over ``params`` (stacked tensors, dim 0 = client) with per-client step counts."""

    def __init__(self, params: list[torch.Tensor], lr: float, weight_decay: float, betas=(0.9, 0.999),
                 eps: float = 1e-8):
        self.params = params
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]
        self.steps = [0.0] * (params[0].shape[0] if params else 0)

    @no_grad
    def step(self, active: list[int]) -> None:
        """One AdamW step of the clients ``active`` (their gradients in ``p.grad``)."""
        k = len(self.steps)
        every = len(active) == k
        pick = None if every else torch.tensor(active, device=self.params[0].device)
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

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    # ------------------------------------------------------------- per-client state
    @no_grad
    def load(self, k: int, state: dict | None, view) -> None:
        """Client ``k``'s moments and step count from its ``torch.optim.AdamW`` state dict (``None``:
        a fresh optimiser); ``view(tensor, i, k)``: client ``k``'s part of the i-th stacked tensor."""
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

    def state_dict(self, k: int, view, groups: list[dict], device: str | None = None) -> dict:
        """Client ``k``'s state as its own ``torch.optim.AdamW.state_dict()`` would be (``groups``:
        that optimiser's ``param_groups``), tensors copied (to ``device`` if given)."""
        def copy(t):
            return t.detach().to(device or t.device, copy=True)

        state = {}
        if self.steps[k]:
            for i, (m, v) in enumerate(zip(self.exp_avg, self.exp_avg_sq)):
                state[i] = {"step": torch.tensor(self.steps[k], dtype=torch.float32),
                            "exp_avg": copy(view(m, i, k)), "exp_avg_sq": copy(view(v, i, k))}
        return {"state": state, "param_groups": [dict(g) for g in groups]}
