"""A client actor's local training: its clients' rounds as one group of the engine.

For a group: the method's start adapters of all its clients at once (``client_prepare_group``, with
the actor's tools that score candidates in shared forwards), the engine's job of each (data, start,
optimiser state, loss hook), one step loop over every member (``engine.training.train_group``), then
every client's trained state kept, the method's uploads of all of them at once
(``client_upload_group``: generation in shared batches) and each upload sent through the client
chain (``federation.chain``: attack, codec). Each client's ``train_seconds`` is an equal share of the
group's time, its ``prepare_seconds`` and ``upload_seconds`` of those parts.
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
        """Local training of ``work`` (clients with their payloads; one base version) as one group: the
        method prepares all of them at once (``client_prepare_group``), the engine trains them in one
        step loop, and they upload at once (``client_upload_group``). Each part's seconds are shared
        equally among the group's clients (``prepare_seconds``, ``upload_seconds``; ``train_seconds``
        the whole), with the work the method's tools computed (tokens scored, prompts completed)."""
        t0 = time.perf_counter()
        done: dict[str, float] = {}
        begun = self._begin_all(rnd, work, done)
        t1 = time.perf_counter()
        trained = train_group(self.base, [self._job(rnd, b) for b in begun], self.algo.frozen)
        t2 = time.perf_counter()
        uploads = self._upload_all(begun, trained, done)
        t3 = time.perf_counter()
        n = len(work)
        shares = {"train_seconds": (t3 - t0) / n, "prepare_seconds": (t1 - t0) / n, "upload_seconds": (t3 - t2) / n,
                  **{f"method_{k}": v / n for k, v in done.items()}}
        return {b.slot.cid: self._finish(b, t, up, shares, n) for b, t, up in zip(begun, trained, uploads)}

    def _begin_all(self, rnd: int, work: list[tuple[int, Payload]], done: dict[str, float]) -> list["_Begun"]:
        """What each client's training of round ``rnd`` starts from: its context, the method's start
        adapter (``client_prepare_group``, all the group's at once), its step count."""
        slots, ctxs = [], []
        for cid, payload in work:
            slot = self.slots[cid]
            self.versions.apply(payload)
            if not slot.train_enc:
                raise ValueError(f"client {cid} has no training examples")
            steps = self.settings.steps_for(len(slot.train_enc)) * int(payload.steps_scale)
            slots.append(slot)
            ctxs.append(self.hooks.context(rnd, slot, payload, steps))
        starts = self.algo.client_prepare_group(ctxs, [p for _, p in work], self.hooks.tools(slots, done))
        return [_Begun(slot, ctx, start, ctx.steps) for slot, ctx, start in zip(slots, ctxs, starts)]

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

    def _upload_all(self, begun: list["_Begun"], trained: list[Trained], done: dict[str, float]) -> list:
        """Keep every client's trained adapter and optimiser state; the method's uploads of all of them at
        once (``client_upload_group``), before each goes through the client chain."""
        for b, out in zip(begun, trained):
            b.slot.params, b.slot.opt_state, b.slot.saved_as = out.params, out.optimizer_state, None
            b.slot.rounds_trained += 1
            b.ctx.train_loss = float(np.mean(out.losses))
        return self.algo.client_upload_group([b.ctx for b in begun], [out.params for out in trained],
                                             self.hooks.tools([b.slot for b in begun], done))

    def _finish(self, begun: "_Begun", out: Trained, upload, shares: dict[str, float], batched: int) -> ClientResult:
        """A client's upload through the client chain, and its metrics."""
        slot, ctx, steps, payload = begun.slot, begun.ctx, begun.steps, begun.ctx.payload
        losses = out.losses
        upload, slot.codec_residual = self.chain.send(slot.cid, ctx.rnd, payload.params, upload, slot.codec_residual,
                                                      start=begun.start)
        metrics = {"train_loss": float(np.mean(losses)), "train_loss_first": losses[0], "train_loss_last": losses[-1],
                   "steps": float(steps), **shares, "batched_clients": float(batched),
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
    """A client's training of a round, begun (:meth:`ClientTraining._begin_all`)."""

    slot: ClientSlot
    ctx: ClientContext
    start: Params
    steps: int
