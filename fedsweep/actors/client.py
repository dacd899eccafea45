"""ClientActor: one frozen base model, the state of one or more clients, local training.

The base model and its adapters are loaded once (:class:`~fedsweep.actors.trainer.Trainer`).
Each hosted client keeps its own adapter tensors, optimiser state and algorithm state
(:class:`~fedsweep.actors.client_state.ClientSlot`); before a client trains or is evaluated
its adapter is copied into the shared adapter modules (``clients_per_actor > 1`` packs many
clients on one base). Randomness of a client's round (batch order, dropout) is derived from
(seed, round, client), so results do not depend on which actor hosts a client, in which
order clients run, or whether the run was resumed.

This class is the Ray-facing part: it runs the method's client hooks around the trainer.
It is a plain class: ``actors.remote`` wraps it for Ray; tests may use it in-process.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from fedsweep.actors import dp as dpsgd
from fedsweep.actors.client_state import (SAVE_THREADS, ClientSlot, DeferredSave, detach_state, restore_slots, save_slots,
                                          stage_slots)
from fedsweep.actors.heap import built_then_frozen
from fedsweep.actors.text import Example
from fedsweep.actors.lockstep import Job, Lockstep, lockstep_chunks, why_sequential
from fedsweep.actors.stacked_evaluation import StackedEvaluation, regroup
from fedsweep.actors.trainer import StepsResult, Trainer, actor_device, derive_seed
from fedsweep.algorithms import registry
from fedsweep.algorithms.base import Algorithm
from fedsweep.algorithms.tensors import Params, clone
from fedsweep.algorithms.types import ClientContext, ClientResult, Payload, upload_bytes
from fedsweep.config import ExperimentConfig
from fedsweep.errors import one_line
from fedsweep.data.bundled import score
from fedsweep.lazy import torch

MODULE_READY = time.time()  # fedsweep and transformers' config side imported (torch: at its first use, in __init__)


class ClientActor:
    @built_then_frozen  # (in its own process: construction without cyclic collections, then frozen)
    def __init__(self, cfg: ExperimentConfig, clients: list[dict[str, Any]], restore_from: str | None = None,
                 pool: list[dict] | None = None, group=None):
        """``cfg``: the validated experiment config; ``clients``: ``[{"cid", "train", "test"[, "val"]}]``;
        ``restore_from``: the checkpoint round folder to start from (the runner verified it; after a
        restart the server moves the actor to the round it last committed); ``pool``: the held-out
        validation pool (methods whose capabilities ask for one); ``group``: this process's
        :class:`~fedsweep.actors.shard_group.ShardGroup` in a sharded client (``actors.sharded``)."""
        if not isinstance(cfg, ExperimentConfig):
            raise TypeError(f"ClientActor takes a validated ExperimentConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.started = {"module_ready": MODULE_READY, "init_start": time.time()}
        res = cfg.clients.resources
        torch.set_num_threads(res.torch_threads or max(1, int(res.num_cpus)))
        self.device = actor_device(res)
        models = {cfg.client_models()[c["cid"]] for c in clients} or {cfg.model.name}
        if len(models) > 1:
            raise ValueError(f"one ClientActor hosts clients of one base model, got {sorted(models)}")
        all_ranks = cfg.client_ranks() if cfg.adapter == "lora" else [cfg.reft.rank] * cfg.clients.num_clients
        ranks = sorted({all_ranks[c["cid"]] for c in clients}) or [all_ranks[0]]
        self.trainer = Trainer(cfg, models.pop(), ranks, self.device, group)
        self.algo = registry.create(cfg.algorithm, cfg.algo_params)
        self.caps = self.algo.capabilities
        self.init_params = {r: self.adapters.read(r) for r in ranks}
        self.base_version: int | None = None
        self._base0: dict[str, torch.Tensor] = {}
        self.preference = cfg.data.kind == "preference"
        self.slots: dict[int, ClientSlot] = {}
        for c in clients:
            rank = all_ranks[c["cid"]]
            enc = self.trainer.encode
            slot = ClientSlot(c["cid"], c["train"], c["test"], enc(c["train"]), enc(c["test"]),
                              clone(self.init_params[rank]), rank, val_enc=enc(c.get("val", [])))
            if self.preference:
                slot.train_pref = self.trainer.encode_preferences(c["train"])
                slot.test_pref = self.trainer.encode_preferences(c["test"])
            self.slots[c["cid"]] = slot
        self.pool = list(pool or [])
        uses_pool = self.caps.validation_pool  # the texts a method embeds, built once
        self._pool_texts = [_as_text(r) for r in self.pool] if uses_pool else []
        self._local_texts = {cid: [_as_text(r) for r in s.train] for cid, s in self.slots.items()} if uses_pool else {}
        self._pool_enc: list[Example] | None = None
        self._embed = None
        self.restored_round = 0
        self.incarnation_token = uuid.uuid4().hex  # a restarted actor is a new incarnation
        self._deferred: dict[str, DeferredSave] = {}  # deferred saves by round folder, until collected
        self._deferred_lock = threading.Lock()
        self._write_pool: ThreadPoolExecutor | None = None
        self._said: set[str] = set()  # why clients train one at a time, printed once each
        if restore_from:
            self.restore(restore_from)
        self.started["init_end"] = time.time()

    # the model side, for callers that inspect it
    @property
    def model(self):
        return self.trainer.model

    @property
    def adapters(self):
        return self.trainer.adapters

    @property
    def tokenizer(self):
        return self.trainer.tokenizer

    # ------------------------------------------------------------------ plumbing
    def ping(self) -> list[int]:
        return sorted(self.slots)

    def start_times(self) -> dict[str, float]:
        """Epoch seconds of this process's start, its imports done, and construction begun and done."""
        from fedsweep.process_start import process_start_epoch

        return {"process_start": process_start_epoch(), **self.started}

    def frozen_objects(self) -> int:
        """How many objects this process's construction froze (:mod:`fedsweep.actors.heap`)."""
        import gc

        return gc.get_freeze_count()

    def incarnation(self) -> dict[str, Any]:
        """Which life of this actor answers, and the checkpoint round it restored its clients from."""
        return {"token": self.incarnation_token, "restored_round": self.restored_round}

    def node_id(self) -> str:
        """The Ray node this actor runs on (empty outside Ray)."""
        try:
            import ray

            return ray.get_runtime_context().get_node_id()
        except Exception:
            return ""

    def initial_params(self) -> Params:
        """θ_0 of the first hosted client's rank (the global start of global methods)."""
        first = self.slots[min(self.slots)] if self.slots else None
        return clone(self.init_params[first.rank if first else min(self.init_params)])

    def client_params(self, cid: int) -> Params:
        return clone(self.slots[cid].params)

    def _fresh(self, slot: ClientSlot, rnd: int) -> Params:
        """A new adapter of ``slot``'s rank: A Kaiming-uniform (seeded by seed, round, client), B zero."""
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, rnd, slot.cid, 7))
        out = {}
        for k, v in self.init_params[slot.rank].items():
            if "lora_A" in k:
                bound = 1.0 / math.sqrt(v.shape[1])
                out[k] = (torch.rand(v.shape, generator=gen) * 2 - 1).mul_(bound).to(v.dtype)
            else:
                out[k] = torch.zeros_like(v)
        return out

    def _apply_base(self, payload: Payload) -> None:
        """Keep the frozen base at W_0 + the payload's cumulative update (once per version)."""
        version = payload.base_version
        if version is None or version == self.base_version:
            return
        weights = self.adapters.base_weights()
        with torch.no_grad():
            for module, delta in payload.base_deltas.items():
                w = weights[module]
                if module not in self._base0:
                    self._base0[module] = w.detach().clone()
                w.copy_(self._base0[module] + delta.to(w.device, w.dtype))
        self.base_version = version
        for slot in self.slots.values():
            slot.ref_logps.clear()  # the reference policy is the (changed) base

    def _pool_loss(self, slot: ClientSlot, params: Params, indices: list[int]) -> float:
        if self._pool_enc is None:  # tokenised once per actor, shared by its clients
            self._pool_enc = self.trainer.encode(self.pool)
        return self.trainer.loss_on(slot.rank, params, [self._pool_enc[i] for i in indices])

    def _embed_cached(self, texts: list[str]) -> torch.Tensor:
        """Sentence embeddings from the method's client encoder (loaded once per actor); the four
        most recently used text lists are memoised, so clients packed on one actor embed the pool once."""
        if self._embed is None:
            from fedsweep.models.encoder import load_encoder

            self._embed = load_encoder(self.algo.client_encoder_name(), device=str(self.device))
            self._embedded: dict[int, torch.Tensor] = {}
        key = hash(tuple(texts))
        value = self._embedded.pop(key, None)  # least recently used first: the shared pool stays
        if value is None:
            if len(self._embedded) >= 4:
                self._embedded.pop(next(iter(self._embedded)))
            value = self._embed(texts)
        self._embedded[key] = value
        return value

    def _context(self, rnd: int, slot: ClientSlot, payload: Payload, steps: int = 0) -> ClientContext:
        return ClientContext(cid=slot.cid, rnd=rnd, num_examples=len(slot.train), local_params=slot.params,
                             state=slot.algo_state, payload=payload, meta=slot.algo_meta,
                             local_texts=self._local_texts.get(slot.cid, []), pool_texts=self._pool_texts,
                             pool_loss=lambda params, indices: self._pool_loss(slot, params, indices),
                             embed=self._embed_cached if self.caps.client_encoder else None,
                             seed=derive_seed(self.cfg.seed, rnd, slot.cid, 11),
                             eval_loss=lambda params, split: self._mean_loss(slot, params, split),
                             rank=slot.rank, lora_scale=self.cfg.lora.alpha / slot.rank, steps=steps,
                             learning_rate=self.cfg.train.learning_rate, fresh_params=lambda: self._fresh(slot, rnd),
                             generate=lambda prompts, max_new_tokens, **kw: self.trainer.generate(
                                 prompts, max_new_tokens, seed=derive_seed(self.cfg.seed, rnd, slot.cid, 9), **kw))

    # ------------------------------------------------------------------ training
    def _begin(self, rnd: int, cid: int, payload: Payload) -> "_Begun":
        """What a client's training of round ``rnd`` starts from: its context, the method's start
        adapter (``client_prepare``), its step count."""
        slot = self.slots[cid]
        t0 = time.perf_counter()
        self._apply_base(payload)
        if not slot.train_enc:
            raise ValueError(f"client {cid} has no training examples")
        steps = self.local_steps(cid) * int(payload.steps_scale)
        ctx = self._context(rnd, slot, payload, steps)
        return _Begun(slot, ctx, self.algo.client_prepare(ctx, payload), steps, t0)

    def _finish(self, begun: "_Begun", trained: Params, out: StepsResult, seconds: float,
                batched: int = 1) -> ClientResult:
        """Keep a client's trained adapter and optimiser state; its upload and metrics."""
        slot, ctx, steps, payload = begun.slot, begun.ctx, begun.steps, begun.ctx.payload
        slot.params = trained
        slot.opt_state = detach_state(out.optimizer_state, "cpu" if self.cfg.clients.park == "cpu" else None)
        slot.rounds_trained += 1
        slot.saved_as = None
        losses = out.losses
        ctx.train_loss = float(np.mean(losses))
        upload = self.algo.client_upload(ctx, trained)
        metrics = {"train_loss": float(np.mean(losses)), "train_loss_first": losses[0], "train_loss_last": losses[-1],
                   "steps": float(steps), "train_seconds": seconds, "batched_clients": float(batched), **upload.metrics}
        if out.margins:
            metrics["dpo_reward_margin"] = float(np.mean(out.margins))
        if payload.dp:  # ε composed over every step of every round so far (Opacus RDP accountant)
            history = slot.algo_meta.setdefault("dp_history", [])
            history.append([payload.dp.noise_multiplier, out.dp_rate, steps])
            metrics["dp_epsilon"] = dpsgd.epsilon(history, payload.dp.delta)
        return ClientResult(cid=slot.cid, num_examples=len(slot.train_enc), upload=upload, bytes_up=upload_bytes(upload),
                            metrics=metrics)

    def train(self, rnd: int, cid: int, payload: Payload) -> ClientResult:
        """One round of local training for client ``cid`` alone; returns its upload and metrics."""
        self._wait_copied()
        begun = self._begin(rnd, cid, payload)
        slot = begun.slot
        live = self.adapters.activate(slot.rank)
        self.adapters.write(begun.start, slot.rank)
        params = {k: p for k, p in live.items() if not self.algo.frozen(k)}
        for k, p in live.items():
            p.requires_grad_(k in params)
        out = self.trainer.run_steps(slot, rnd, begun.steps, payload, params,
                                     lambda raw: self.algo.client_loss(begun.ctx, raw, params))
        for p in live.values():
            p.requires_grad_(True)
        return self._finish(begun, self.adapters.read(slot.rank), out, time.perf_counter() - begun.t0)

    def train_lockstep(self, rnd: int, work: list[tuple[int, Payload]]) -> dict[int, ClientResult]:
        """Local training of several clients in lockstep (:mod:`fedsweep.actors.lockstep`): one batch
        per step over all of them, each with its own adapter; equal to :meth:`train` of each up to
        float rounding. Each client's ``train_seconds`` is an equal share of the whole."""
        self._wait_copied()
        t0 = time.perf_counter()
        begun = [self._begin(rnd, cid, payload) for cid, payload in work]
        jobs = [Job(b.slot, rnd, b.steps, b.ctx.payload, b.start,
                    lambda raw, own, ctx=b.ctx: self.algo.client_loss(ctx, raw, own)) for b in begun]
        together = Lockstep(self.trainer, jobs, self.algo.frozen)
        outs = together.run()
        share = (time.perf_counter() - t0) / len(work)
        results = {}
        for k, (b, out) in enumerate(zip(begun, outs)):
            trained = together.read(k)
            self.adapters.activate(b.slot.rank)  # live, as after its sequential training: a method's
            self.adapters.write(trained, b.slot.rank)  # upload may generate with it (FedCoFiT)
            results[b.slot.cid] = self._finish(b, trained, out, share, len(work))
        return results

    def train_many(self, rnd: int, items: list[tuple[int, int]], *payloads: Payload) -> tuple[str, list[tuple[int, ClientResult | str]]]:
        """:meth:`train` for several of this actor's clients in one call: ``items`` pairs a client with
        the index of its payload in ``payloads`` (clients sharing a payload share one object). LoRA
        clients train in lockstep where they can (``train.batch_clients``; up to that many per
        batched step, clients sharing the base's version), the others one after another in the order
        given (the reason is printed once per actor). A client whose training raises does not stop the
        others: its entry is the error's one-line description instead of a result (a failed lockstep
        batch: each of its clients', for the server to retry alone). Returns this actor's incarnation
        token (the server replays what a since-restarted incarnation trained) and the entries."""
        done: dict[int, ClientResult | str] = {}
        batchable: list[tuple[int, Payload]] = []
        for cid, which in items:
            why = why_sequential(self.trainer, payloads[which])
            if why is None:
                batchable.append((cid, payloads[which]))
            elif len(items) > 1 and why not in self._said:
                self._said.add(why)
                print(f"fedsweep: clients of this actor train one at a time: {why}", file=sys.stderr, flush=True)
        for chunk in lockstep_chunks(self.trainer, batchable, lambda item: item[1].base_version):
            try:
                done.update(self.train_lockstep(rnd, chunk))
            except Exception as exc:  # noqa: BLE001  (each of its clients is retried alone)
                done.update(dict.fromkeys([cid for cid, _ in chunk], one_line(exc)))
        for cid, which in items:
            if cid in done:
                continue
            try:
                done[cid] = self.train(rnd, cid, payloads[which])
            except Exception as exc:  # noqa: BLE001  (reported per client; the server retries it alone)
                done[cid] = one_line(exc)
        return self.incarnation_token, [(cid, done[cid]) for cid, _ in items]

    def local_steps(self, cid: int) -> int:
        """``train.steps``, or ``train.epochs`` over client ``cid``'s training examples in batches."""
        return self.trainer.local_steps(self.slots[cid])

    def batch_order(self, rnd: int, cid: int, steps: int) -> torch.Tensor:
        """Indices into client ``cid``'s training examples for ``steps`` batches of round ``rnd``."""
        return self.trainer.batch_order(rnd, cid, len(self.slots[cid].train_enc), steps)

    # ---------------------------------------------------------------- evaluation
    def _mean_loss(self, slot: ClientSlot, params: Params | None, split: str) -> float:
        if split == "val" and not slot.val_enc:
            raise ValueError(f"client {slot.cid} has no validation examples (data.val_fraction is 0 or its "
                             f"training split has a single record): a validation loss cannot be computed")
        examples = {"test": slot.test_enc, "val": slot.val_enc}.get(split, slot.train_enc)
        return self.trainer.loss_on(slot.rank, params, examples)

    def evaluate(self, rnd: int, cid: int, payload: Payload) -> dict[str, float]:
        """Test loss over the client's whole test split and, unless ``eval.max_new_tokens`` is 0, task
        accuracy (greedy generation, the task's scorer) on its first ``eval.max_examples`` test records."""
        self._wait_copied()
        slot = self.slots[cid]
        self._apply_base(payload)
        params = self.algo.client_eval_params(self._context(rnd, slot, payload), payload)
        t0 = time.perf_counter()
        loss = self._mean_loss(slot, params, "test")  # always the whole test split: cheap, no generation
        out = {"test_loss": loss, "num_test_loss": float(len(slot.test_enc))}
        if self.cfg.eval.max_new_tokens > 0:  # accuracy: greedy generation on the first max_examples
            test = self._generated_records(slot)
            out.update(accuracy(test, self.trainer.generate([r["prompt"] for r in test], self.cfg.eval.max_new_tokens)))
        if self.preference and slot.test_pref:
            margins = self.trainer.dpo_margins(slot, "test")
            out["dpo_reward_margin"] = float(margins.mean())
            out["dpo_reward_accuracy"] = float((margins > 0).float().mean())
            out["num_test_pref"] = float(len(slot.test_pref))
        out["eval_seconds"] = time.perf_counter() - t0
        return out

    def evaluate_many(self, rnd: int, groups: list[tuple[list[int], Payload]]) -> tuple[str, dict[int, dict[str, float]]]:
        """:meth:`evaluate` for several of this actor's clients in one call: ``groups`` pairs clients
        with the evaluation payload they share. Clients of one group evaluated with that payload's
        own adapter (the method keeps :meth:`Algorithm.client_eval_params`' default) and of one rank
        share their forward passes: test loss in batches across the clients, and the prompts of
        all of them generated together. Otherwise each client is evaluated alone. A shared
        evaluation's ``eval_seconds`` is divided equally among its clients. Returns this actor's
        incarnation token (the server re-asks a life it has not adopted) and the metrics by client."""
        out: dict[int, dict[str, float]] = {}
        self._wait_copied()  # (a method's evaluation hooks see the clients' state)
        alone: list[tuple[int, Payload]] = []
        for cids, payload in groups:
            if len(cids) > 1 and self._can_share_evaluation(cids, payload):
                out.update(self._evaluate_shared(rnd, cids, payload))
            else:
                alone.extend((cid, payload) for cid in cids)
        if self._can_stack_evaluation():
            for chunk in lockstep_chunks(self.trainer, alone, lambda item: item[1].base_version):
                out.update(self._evaluate_stacked(rnd, chunk))
        out.update({cid: self.evaluate(rnd, cid, payload) for cid, payload in alone if cid not in out})
        return self.incarnation_token, out

    def _generated_records(self, slot: ClientSlot) -> list[dict]:
        """The test records whose answers are generated for accuracy: the first ``eval.max_examples``."""
        return slot.test[: self.cfg.eval.max_examples] if self.cfg.eval.max_examples else slot.test

    def _can_share_evaluation(self, cids: list[int], payload: Payload) -> bool:
        own_default = type(self.algo).client_eval_params is Algorithm.client_eval_params
        return (own_default and payload.params is not None and not self.preference
                and self.trainer.group is None and len({self.slots[c].rank for c in cids}) == 1)

    def _can_stack_evaluation(self) -> bool:
        """Whether clients evaluated with their own adapters share batches, each row with its own
        client's factors (as lockstep training: LoRA, unsharded, ``train.batch_clients`` not off;
        DPO's reward margins are computed per client)."""
        return (self.cfg.adapter == "lora" and self.cfg.train.batch_clients != "off" and self.trainer.group is None
                and not self.preference)

    def _evaluate_stacked(self, rnd: int, items: list[tuple[int, Payload]]) -> dict[int, dict[str, float]]:
        """:meth:`evaluate` of clients that each have their own adapter (``items``: client, payload; one
        base version), in shared batches (:class:`~fedsweep.actors.stacked_evaluation.StackedEvaluation`)."""
        slots = [self.slots[cid] for cid, _ in items]
        self._apply_base(items[0][1])
        params = [self.algo.client_eval_params(self._context(rnd, slot, payload), payload)
                  for slot, (_, payload) in zip(slots, items)]
        t0 = time.perf_counter()
        stacked = StackedEvaluation(self.trainer, [s.rank for s in slots], params)
        return self._evaluate_together(slots, stacked.loss_sums, stacked.generate, t0)

    def _evaluate_shared(self, rnd: int, cids: list[int], payload: Payload) -> dict[int, dict[str, float]]:
        slots = [self.slots[c] for c in cids]
        self._apply_base(payload)
        t0 = time.perf_counter()
        n = self.cfg.eval.max_new_tokens
        return self._evaluate_together(
            slots, lambda sets: self.trainer.loss_sums(slots[0].rank, payload.params, sets),
            lambda sets: regroup(self.trainer.generate([p for some in sets for p in some], n), sets), t0)

    def _evaluate_together(self, slots: list[ClientSlot], loss_sums, generate, t0: float) -> dict[int, dict[str, float]]:
        """Test loss and accuracy of ``slots`` computed together: ``loss_sums(example sets)`` -> (sum,
        count) per set, ``generate(prompt sets)`` -> answers per set; each client's ``eval_seconds``
        is an equal share of the time since ``t0``."""
        out = {s.cid: {"test_loss": total / max(count, 1), "num_test_loss": float(len(s.test_enc))}
               for s, (total, count) in zip(slots, loss_sums([s.test_enc for s in slots]))}
        if self.cfg.eval.max_new_tokens > 0:
            tests = [self._generated_records(s) for s in slots]
            answers = generate([[r["prompt"] for r in test] for test in tests])
            for s, test, some in zip(slots, tests, answers):
                out[s.cid].update(accuracy(test, some))
        share = (time.perf_counter() - t0) / len(slots)
        for metrics in out.values():
            metrics["eval_seconds"] = share
        return out

    # ---------------------------------------------------------------- checkpoints
    def save(self, directory: str, previous: str | None = None, defer: bool = False) -> dict[str, Any]:
        """Write every hosted client's state into ``directory`` (see :func:`client_state.save_slots`).

        ``defer``: answer at once (``{"written", "reused", "deferred": True, "token"}``); the state is
        copied out and written on this actor's writer threads (whatever changes a client waits for
        the copies first), and :meth:`saved` returns the digests once the files are on disk
        (``checkpoint.overlap``)."""
        self._wait_deferred()  # a save never overtakes an earlier one
        if not defer:
            return {**save_slots(self.slots, directory, previous), "token": self.incarnation_token}
        pending = stage_slots(self.slots, directory, previous, self._writer())
        with self._deferred_lock:
            self._deferred[directory] = pending
        return {**pending.staged(), "deferred": True, "token": self.incarnation_token}

    @ray.method(concurrency_group="checkpoint")
    def saved(self, directory: str) -> dict[str, Any]:
        """The digests of a deferred :meth:`save` into ``directory``, once its files are written (runs
        beside training, in its own concurrency group). Raises LookupError when this incarnation has
        no such save (the one that made it died)."""
        with self._deferred_lock:
            pending = self._deferred.get(directory)
        if pending is None:
            raise LookupError(f"no deferred checkpoint of {directory} in this actor's incarnation")
        out = pending.result()
        with self._deferred_lock:
            self._deferred.pop(directory, None)
        return out

    def _writer(self) -> ThreadPoolExecutor:
        if self._write_pool is None:
            self._write_pool = ThreadPoolExecutor(SAVE_THREADS, thread_name_prefix="checkpoint")
        return self._write_pool

    def _wait_copied(self) -> None:
        """Before a slot changes: every deferred save has copied its state out."""
        self._wait_deferred(written=False)

    def _wait_deferred(self, written: bool = True) -> None:
        """Every deferred save's files on disk (``written``), or its state copied out."""
        with self._deferred_lock:
            pending = list(self._deferred.values())
        for p in pending:
            if written:
                p.result()
            else:
                p.copied()

    def restore(self, directory: str) -> None:
        self._wait_copied()
        self.restored_round = restore_slots(self.slots, directory)


@dataclass
class _Begun:
    """A client's training of a round, begun (:meth:`ClientActor._begin`)."""

    slot: ClientSlot
    ctx: ClientContext
    start: Params
    steps: int
    t0: float


def accuracy(records: list[dict], answers: list[str]) -> dict[str, float]:
    """The share of ``answers`` the task's scorer accepts for ``records``, and how many were scored."""
    return {"accuracy": float(np.mean([score(r, a) for r, a in zip(records, answers)])), "num_test": float(len(records))}


def _as_text(record: dict) -> str:
    """A record as one text (prompt, then response) for a sentence encoder."""
    return f"{record['prompt']}\n{record['response']}"
