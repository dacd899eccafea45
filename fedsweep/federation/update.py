"""The update: what a client changed of what the server sent it, built once on each side.

A client's upload is relative to its start θ_start — the parameters the server sent (the payload's
``params``; zero for an uploaded key the server did not send) — so the update is

    Δ_k = θ_k − θ_start,k

and the server reads the client's parameters back as θ̂_k = θ_start,k + Δ_k. :func:`start_of` and
:func:`Update.of` are the one place that subtraction happens; the client's chain (attack, codec) and
the server's (decode, screen, robust rule) both work on :class:`Update`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsweep.algorithms.tensors import Params
from fedsweep.lazy import torch


def start_of(sent: Params | None, params: Params) -> Params:
    """θ_start for each key of ``params``: what the server sent, zero where it sent no tensor of that
    name and shape (there the update is the parameter itself). The one rule of θ_start: the chains'
    updates and screening's norms (``screening.start_vector``) both take it from here."""
    sent = sent or {}
    return {k: sent[k] if k in sent and sent[k].shape == v.shape else torch.zeros_like(v) for k, v in params.items()}


@dataclass
class Update:
    """Client ``cid``'s update: its start (what the server sent), Δ, and the bytes it took on the wire."""

    cid: int
    start: Params
    delta: Params
    nbytes: int = 0

    @classmethod
    def of(cls, cid: int, sent: Params | None, params: Params, nbytes: int = 0) -> "Update":
        """The update of uploaded ``params`` against what the server ``sent``."""
        start = start_of(sent, params)
        return cls(cid, start, {k: v - start[k] for k, v in params.items()}, nbytes)

    @classmethod
    def received(cls, cid: int, sent: Params | None, delta: Params, nbytes: int = 0) -> "Update":
        """The update a decoded message carries (Δ already known), against what the server ``sent``."""
        return cls(cid, start_of(sent, delta), delta, nbytes)

    def params(self) -> Params:
        """θ̂ = θ_start + Δ."""
        return {k: self.start[k] + d for k, d in self.delta.items()}

    def with_delta(self, delta: Params) -> "Update":
        """The same client's update with Δ replaced (an attack, a norm bound)."""
        return Update(self.cid, self.start, delta, self.nbytes)
