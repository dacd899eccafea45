"""DP-SGD for a client's private data: Poisson sampling, per-sample clipping, Gaussian noise, and
ε from Opacus' RDP accountant (Abadi et al. 2016, "Deep Learning with Differential Privacy";
Mironov 2017 for the Rényi accounting).

One noisy step on a Poisson batch I (each record in with probability q = B/n):

    g̃ = (Σ_{i∈I} g_i · min(1, C/‖g_i‖) + N(0, σ²C² I)) / B

with g_i the gradient of record i's loss and B the expected batch size, as Opacus does. The
accounting composes the subsampled Gaussian mechanism over every step of every round; the
history (σ, q, steps) per round is plain JSON, so it survives checkpoints.
"""

from __future__ import annotations

from typing import Callable

from fedsweep.lazy import torch


def poisson_batch(n: int, rate: float, gen: torch.Generator) -> list[int]:
    """Indices of the records drawn independently with probability ``rate``."""
    return torch.nonzero(torch.rand(n, generator=gen) < rate).flatten().tolist()


def noisy_clipped_gradient(record_loss: Callable[[int], torch.Tensor], indices: list[int],
                           params: dict[str, torch.nn.Parameter], max_grad_norm: float, noise_multiplier: float,
                           expected_batch: float, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], list[float]]:
    """(g̃ per parameter, the records' losses). Leaves ``.grad`` of ``params`` set to None."""
    sums = {k: torch.zeros_like(p, dtype=torch.float32) for k, p in params.items()}
    losses = []
    for i in indices:
        for p in params.values():
            p.grad = None
        loss = record_loss(i)
        loss.backward()
        losses.append(float(loss.detach()))
        grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).float() for k, p in params.items()}
        norm = float(torch.sqrt(sum(g.square().sum() for g in grads.values())))
        factor = min(1.0, max_grad_norm / (norm + 1e-6))
        for k, g in grads.items():
            sums[k].add_(g, alpha=factor)
    for p in params.values():
        p.grad = None
    std = noise_multiplier * max_grad_norm
    out = {}
    for k, s in sums.items():
        noise = torch.randn(s.shape, generator=gen) * std if std > 0 else torch.zeros_like(s)
        out[k] = (s + noise.to(s.device)) / expected_batch
    return out, losses


def epsilon(history: list[list[float]], delta: float) -> float:
    """ε at ``delta`` after every (noise_multiplier, sample_rate, steps) entry of ``history``,
    composed by Opacus' RDP accountant."""
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = [(float(s), float(q), int(t)) for s, q, t in history]
    return float(acc.get_epsilon(delta=delta)) if history else 0.0
