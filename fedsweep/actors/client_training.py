"""A client actor's local training: its clients' rounds as one group of the engine.

For each client of a group: the method's start adapter (``client_prepare``) and context, the engine's
job (data, start, optimiser state, loss hook), one step loop over every member
(``engine.training.train_group``), then each client's trained state kept and its upload sent through
the client chain (``federation.chain``: attack, codec). Each client's ``train_seconds`` is an equal
share of the group's time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from fedsweep.actors.client_state import ClientSlot
from fedsweep.algorithms.tensors import Params
from fedsweep.algorithms.types import ClientContext, ClientResult, Payload, upload_bytes
from fedsweep.engine import dp as dpsgd
from fedsweep.engine.training import Job, Trained, train_group


class ClientTraining:
    def __init__(self, base, algo, slots: dict[int, ClientSlot], hooks, versions, chain) -> None:
        self.base, self.algo, self.slots = base, algo, slots
        self.hooks, self.versions, self.chain = hooks, versions, chain
        self.settings = base.settings

    def train_group(self, rnd: int, work: list[tuple[int, Payload]]) -> dict[int, ClientResult]:
        """Local training of ``work`` (clients with their payloads; one base version) as one group."""
        t0 = time.perf_counter()
        begun = [self._begin(rnd, cid, payload) for cid, payload in work]
        trained = train_group(self.base, [self._job(rnd, b) for b in begun], self.algo.frozen)
        share = (time.perf_counter() - t0) / len(work)
        return {b.slot.cid: self._finish(b, t, share, len(work)) for b, t in zip(begun, trained)}

    def _begin(self, rnd: int, cid: int, payload: Payload) -> "_Begun":
        """What a client's training of round ``rnd`` starts from: its context, the method's start
        adapter (``client_prepare``), its step count."""
        slot = self.slots[cid]
        t0 = time.perf_counter()
        self.versions.apply(payload)
        if not slot.train_enc:
            raise ValueError(f"client {cid} has no training examples")
        steps = self.settings.steps_for(len(slot.train_enc)) * int(payload.steps_scale)
        ctx = self.hooks.context(rnd, slot, payload, steps)
        return _Begun(slot, ctx, self.algo.client_prepare(ctx, payload), steps, t0)

    def _job(self, rnd: int, b: "_Begun") -> Job:
        """The engine's job of a begun client: its data, start, optimiser state and loss hook."""
        slot, payload = b.slot, b.ctx.payload
        return Job(cid=slot.cid, rnd=rnd, rank=slot.rank, steps=b.steps, start=b.start, opt_state=slot.opt_state,
                   examples=slot.train_enc, pairs=slot.train_pref,
                   reference=self.versions.reference(slot, "train") if self.settings.preference else None,
                   extra=self.base.encode_extra(payload.extra_train) if payload.extra_train else [],
                   extra_weight=float(payload.extra_weight), dp=payload.dp,
                   loss_hook=(lambda raw, own, ctx=b.ctx: self.algo.client_loss(ctx, raw, own))
                   if self.algo.adds_loss_term() else None)

    def _finish(self, begun: "_Begun", out: Trained, seconds: float, batched: int) -> ClientResult:
        """Keep a client's trained adapter and optimiser state; its upload (through the client chain) and metrics."""
        slot, ctx, steps, payload = begun.slot, begun.ctx, begun.steps, begun.ctx.payload
        slot.params, slot.opt_state, slot.saved_as = out.params, out.optimizer_state, None
        slot.rounds_trained += 1
        losses = out.losses
        ctx.train_loss = float(np.mean(losses))
        upload, slot.codec_residual = self.chain.send(slot.cid, ctx.rnd, payload.params,
                                                      self.algo.client_upload(ctx, out.params), slot.codec_residual,
                                                      start=begun.start)
        metrics = {"train_loss": float(np.mean(losses)), "train_loss_first": losses[0], "train_loss_last": losses[-1],
                   "steps": float(steps), "train_seconds": seconds, "batched_clients": float(batched),
                   "train_tokens": float(out.tokens), "train_padded_tokens": float(out.padded), **upload.metrics}
        if out.margins:
            metrics["dpo_reward_margin"] = float(np.mean(out.margins))
        if payload.dp:  # ε composed over every step of every round so far (Opacus RDP accountant)
            history = slot.algo_meta.setdefault("dp_history", [])
            history.append([payload.dp.noise_multiplier, out.dp_rate, steps])
            metrics["dp_epsilon"] = dpsgd.epsilon(history, payload.dp.delta)
        return ClientResult(cid=slot.cid, num_examples=len(slot.train_enc), upload=upload, bytes_up=upload_bytes(upload),
                            metrics=metrics)


@dataclass
class _Begun:
    """A client's training of a round, begun (:meth:`ClientTraining._begin`)."""

    slot: ClientSlot
    ctx: ClientContext
    start: Params
    steps: int
    t0: float
