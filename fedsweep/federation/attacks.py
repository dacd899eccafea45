"""Byzantine clients for studying robust aggregation (``clients.byzantine``): the first step of the
client's chain (``federation.chain``). Pure tensor code.

A seeded ⌊fraction · K + ½⌋ of the clients attack (:func:`attackers`; a pure function of the run's
seed: the same clients every round). An attacker trains as usual, then replaces its update
Δ = θ − θ_start before it uploads:

* ``sign_flip`` — −λ·Δ (λ = ``scale``, default 1);
* ``scale`` — λ·Δ;
* ``gaussian`` — Δ + N(0, σ²) in every entry (seeded by seed, round, client: ``salts.ATTACK_NOISE``);
* ``same_value`` — every entry set to λ: all attackers send the very same update (collusion: they
  form a tight cluster, which distance-based rules such as Krum favour).
"""

from __future__ import annotations

import numpy as np

from fedsweep.algorithms.tensors import Params
from fedsweep.lazy import torch
from fedsweep import salts



def attackers(seed: int, num_clients: int, fraction: float) -> list[int]:
    """The attacking clients: ⌊fraction · K + ½⌋ of them, drawn once from the run's seed."""
    count = int(np.floor(fraction * num_clients + 0.5))
    if count == 0:
        return []
    return sorted(np.random.default_rng([seed, salts.ATTACKERS]).choice(num_clients, size=count, replace=False).tolist())


def sign_flip(delta: Params, scale: float, sigma: float, seed: int) -> Params:
    """−λ·Δ."""
    return {k: -scale * v for k, v in delta.items()}


def scaled(delta: Params, scale: float, sigma: float, seed: int) -> Params:
    """λ·Δ."""
    return {k: scale * v for k, v in delta.items()}


def gaussian(delta: Params, scale: float, sigma: float, seed: int) -> Params:
    """Δ + N(0, σ²) in every entry, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v + sigma * torch.randn(v.shape, generator=gen, dtype=torch.float32).to(v.dtype)
            for k, v in sorted(delta.items())}


def same_value(delta: Params, scale: float, sigma: float, seed: int) -> Params:
    """Every entry λ."""
    return {k: torch.full_like(v, scale) for k, v in delta.items()}


ATTACKS = {"sign_flip": sign_flip, "scale": scaled, "gaussian": gaussian, "same_value": same_value}
"""The one registry of attacks, by ``clients.byzantine.attack`` (the schema's choices are its keys)."""


def attack(delta: Params, kind: str, scale: float = 1.0, sigma: float = 1.0, seed: int = 0) -> Params:
    """The update an attacker sends instead of its honest ``delta``."""
    if kind not in ATTACKS:
        raise ValueError(f"clients.byzantine.attack: unknown attack {kind!r} (one of {', '.join(ATTACKS)})")
    return ATTACKS[kind](delta, scale, sigma, seed)
