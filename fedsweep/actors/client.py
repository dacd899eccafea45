"""ClientActor: one frozen base model, the state of one or more clients, their rounds.

The base model and its adapter modules are loaded once (:class:`~fedsweep.engine.base.FrozenBase`).
Each hosted client keeps its own adapter tensors, optimiser state and algorithm state
(:class:`~fedsweep.actors.client_state.ClientSlot`); a call binds the adapters of the clients it
computes (``clients_per_actor > 1`` packs many clients on one base). Training runs the engine's
one step loop over groups of up to ``train.batch_clients`` clients (``engine.training``), and
evaluation its one evaluation path (``engine.evaluation``). Randomness of a client's round (batch
order, dropout) is derived from (seed, round, client), so results do not depend on which actor
hosts a client, which clients share its steps, or whether the run was resumed.

This class is the Ray-facing part: it runs the method's client hooks around the engine.
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

from fedsweep.actors.client_state import SAVE_THREADS, ClientSlot, DeferredSave, restore_slots, save_slots, stage_slots
from fedsweep.actors.heap import built_then_frozen
from fedsweep.algorithms import registry
from fedsweep.algorithms.base import Algorithm
from fedsweep.algorithms.tensors import Params, clone
from fedsweep.algorithms.attacks import attack, attackers
from fedsweep.algorithms.compression import RESIDUAL, SENT, SHAPE, compress
from fedsweep.algorithms.types import ClientContext, ClientResult, Payload, Upload, upload_bytes
from fedsweep.config import ExperimentConfig
from fedsweep.config.batching import BatchPlan
from fedsweep.data.bundled import score
from fedsweep.engine import dp as dpsgd
from fedsweep.engine.base import FrozenBase, device_of
from fedsweep.engine.evaluation import EvalClient, evaluate_group, mean_loss
from fedsweep.engine.rows import chunks
from fedsweep.engine.text import Example
from fedsweep.engine.training import Job, Trained, batch_order, derive_seed, local_steps, train_group
from fedsweep.errors import one_line
from fedsweep.lazy import torch

MODULE_READY = time.time()  # fedsweep and transformers' config side imported (torch: at its first use, in __init__)


class ClientActor:
    @built_then_frozen  # (in its own process: construction without cyclic collections, then frozen)
    def __init__(self, cfg: ExperimentConfig, clients: list[dict[str, Any]], restore_from: str | None = None,
                 pool: list[dict] | None = None, group=None, faults=None):
        """``cfg``: the validated experiment config (its batch plan resolved, else resolved here as the
        driver would: ``config.batching``); ``clients``: ``[{"cid", "train", "test"[, "val"]}]``;
        ``restore_from``: the checkpoint round folder to start from (the runner verified it; after a
        restart the server moves the actor to the round it last committed); ``pool``: the held-out
        validation pool (methods whose capabilities ask for one); ``group``: this process's
        :class:`~fedsweep.actors.shard_group.ShardGroup` in a sharded client (``actors.sharded``);
        ``faults``: the armed fault points of the recovery tests (``actors.faults``), None in a run."""
        if not isinstance(cfg, ExperimentConfig):
            raise TypeError(f"ClientActor takes a validated ExperimentConfig, got {type(cfg).__name__}")
        self.started = {"module_ready": MODULE_READY, "init_start": time.time()}
        res = cfg.clients.resources
        torch.set_num_threads(res.torch_threads or max(1, int(res.num_cpus)))
        self.device = device_of(res)
        models = {cfg.client_models()[c["cid"]] for c in clients} or {cfg.model.name}
        if len(models) > 1:
            raise ValueError(f"one ClientActor hosts clients of one base model, got {sorted(models)}")
        all_ranks = cfg.client_ranks() if cfg.adapter == "lora" else [cfg.reft.rank] * cfg.clients.num_clients
        ranks = sorted({all_ranks[c["cid"]] for c in clients}) or [all_ranks[0]]
        self.base = FrozenBase(cfg, models.pop(), ranks, self.device, group)
        self.cfg = cfg = self._with_batch_plan(cfg, len(clients))
        self.base.cfg = cfg
        self.batch_plan = BatchPlan(int(cfg.train.batch_clients), cfg.train.batch_reason)
        self.faults = faults
        self.algo = registry.create(cfg.algorithm, cfg.algo_params)
        self.caps = self.algo.capabilities
        self.init_params = {r: self.adapters.initial(r) for r in ranks}
        self.base_version: int | None = None
        self._base0: dict[str, torch.Tensor] = {}
        self.preference = cfg.data.kind == "preference"
        self.slots: dict[int, ClientSlot] = {}
        for c in clients:
            rank = all_ranks[c["cid"]]
            enc = self.base.encode
            slot = ClientSlot(c["cid"], c["train"], c["test"], enc(c["train"]), enc(c["test"]),
                              clone(self.init_params[rank]), rank, val_enc=enc(c.get("val", [])))
            if self.preference:
                slot.train_pref = self.base.encode_preferences(c["train"])
                slot.test_pref = self.base.encode_preferences(c["test"])
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
        self._trained_since_save = threading.Event()  # (the ``write`` fault point waits for it)
        b = cfg.clients.byzantine
        self._attackers = set(attackers(cfg.seed, cfg.clients.num_clients, b.fraction)) if b.fraction else set()
        if self.batch_plan.reason and len(clients) > 1:
            print(f"fedsweep: clients of this actor train one at a time: {self.batch_plan.reason}",
                  file=sys.stderr, flush=True)
        if restore_from and not restarted():  # the one restore rule: see :func:`restarted`
            self.restore(restore_from)
        self.started["init_end"] = time.time()

    def _with_batch_plan(self, cfg: ExperimentConfig, hosted: int) -> ExperimentConfig:
        """``cfg`` with ``train.batch_clients`` a number: as the driver resolved it, or (a config made
        in-process, still ``auto``) resolved here the same way (``config.batching.resolve``)."""
        from fedsweep.config.batching import resolve, why_alone

        if isinstance(cfg.train.batch_clients, int) and (cfg.train.batch_clients > 1 or cfg.train.batch_reason):
            return cfg

        limit = None
        if self.device.type == "cuda" and cfg.train.batch_clients == "auto" and why_alone(cfg) is None:
            from fedsweep.models.memory import plan

            share = min(1.0, cfg.clients.resources.num_gpus)
            memory = plan(cfg, self.model.get_base_model().config.to_dict())
            limit = memory.batch_limit(torch.cuda.get_device_properties(self.device).total_memory * share, hosted)
        return cfg.with_batch_plan(resolve(cfg, hosted, limit))

    # the model side, for callers that inspect it
    @property
    def model(self):
        return self.base.model

    @property
    def adapters(self):
        return self.base.adapters

    @property
    def tokenizer(self):
        return self.base.tokenizer

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
            self._pool_enc = self.base.encode(self.pool)
        return mean_loss(self.base, slot.rank, params, [self._pool_enc[i] for i in indices])

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
                             generate=lambda prompts, max_new_tokens, **kw: self._generate(
                                 slot, prompts, max_new_tokens, seed=derive_seed(self.cfg.seed, rnd, slot.cid, 9), **kw))

    def _generate(self, slot: ClientSlot, prompts: list[str], max_new_tokens: int, **kw):
        """Completions of ``prompts`` with the client's adapter as it stands (its trained one, in
        ``client_upload``)."""
        with self.base.bind([slot.rank], [slot.params]) as binding:
            return self.base.generate(prompts, max_new_tokens, rows=lambda a, b: binding.rows([0] * (b - a)), **kw)

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

    def _job(self, rnd: int, b: "_Begun") -> Job:
        """The engine's job of a begun client: its data, start, optimiser state and loss hook."""
        slot, payload = b.slot, b.ctx.payload
        return Job(cid=slot.cid, rnd=rnd, rank=slot.rank, steps=b.steps, start=b.start, opt_state=slot.opt_state,
                   examples=slot.train_enc, pairs=slot.train_pref,
                   reference=self._reference(slot, "train") if self.preference else None,
                   extra=self.base.encode_extra(payload.extra_train) if payload.extra_train else [],
                   extra_weight=float(payload.extra_weight), dp=payload.dp,
                   loss_hook=(lambda raw, own, ctx=b.ctx: self.algo.client_loss(ctx, raw, own))
                   if self.algo.adds_loss_term() else None)

    def _reference(self, slot: ClientSlot, split: str) -> torch.Tensor:
        """DPO reference log-probs (the frozen base's) of every pair of ``slot``'s ``split``, computed once."""
        if split not in slot.ref_logps:
            slot.ref_logps[split] = self.base.reference_logps(slot.train_pref if split == "train" else slot.test_pref)
        return slot.ref_logps[split]

    def _finish(self, begun: "_Begun", out: Trained, seconds: float, batched: int) -> ClientResult:
        """Keep a client's trained adapter and optimiser state; its upload and metrics."""
        slot, ctx, steps, payload = begun.slot, begun.ctx, begun.steps, begun.ctx.payload
        slot.params = out.params
        slot.opt_state = out.optimizer_state
        slot.rounds_trained += 1
        slot.saved_as = None
        losses = out.losses
        ctx.train_loss = float(np.mean(losses))
        upload = self._as_sent(slot, payload, self.algo.client_upload(ctx, out.params), ctx.rnd)
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

    def _as_sent(self, slot: ClientSlot, payload: Payload, upload: Upload, rnd: int) -> Upload:
        """The upload as it leaves the client: an attacker's update replaced (``clients.byzantine``),
        then compressed (``clients.upload``). Both act on the update relative to what the server sent
        (the payload's parameters; zero for keys it did not send), which the server adds back."""
        cc = self.cfg.clients
        if upload.params is None or (slot.cid not in self._attackers and cc.upload.compression == "none"):
            return upload
        ref = {k: (payload.params[k] if payload.params is not None and k in payload.params else torch.zeros_like(v))
               for k, v in upload.params.items()}
        delta = {k: v - ref[k] for k, v in upload.params.items()}
        if slot.cid in self._attackers:
            b = cc.byzantine
            delta = attack(delta, b.attack, b.scale, b.sigma, derive_seed(self.cfg.seed, rnd, slot.cid, 29))
            upload.metrics["byzantine"] = 1.0
        if cc.upload.compression == "none":
            upload.params = {k: ref[k] + d for k, d in delta.items()}
            return upload
        u = cc.upload
        residual = {k[len(RESIDUAL):]: v for k, v in slot.algo_state.items() if k.startswith(RESIDUAL)}
        sent, nbytes, kept = compress(delta, u.compression, u.block_size, u.topk_fraction, residual)
        if kept is not None:  # topk's error feedback: the client's residual, checkpointed with its state
            slot.algo_state.update({RESIDUAL + k: v for k, v in kept.items()})
        extra = sum(t.numel() * t.element_size() for t in upload.tensors.values())
        dense = sum(d.numel() * 4 for d in delta.values())
        if upload.nbytes is not None and u.compression != "topk":
            # a method that sends only some entries (FedICU's importance mask) sends those compressed:
            # its own share of the dense bytes, applied to the compressed encoding
            nbytes = math.ceil(nbytes * min(1.0, upload.nbytes / max(dense, 1)))
        upload.tensors = {**upload.tensors, **{SENT + k: v for k, v in sent.items()},
                          **{SHAPE + k: torch.tensor(list(v.shape), dtype=torch.int64) for k, v in delta.items()}}
        upload.params = None
        upload.nbytes = nbytes + extra
        upload.metrics["upload_bytes_dense"] = float(dense)
        return upload

    def _train_group(self, rnd: int, work: list[tuple[int, Payload]]) -> dict[int, ClientResult]:
        """Local training of ``work`` (clients with their payloads; one base version) as one group of
        the engine (``engine.training``): one step loop over all of them, each with its own adapter.
        Each client's ``train_seconds`` is an equal share of the whole."""
        self._wait_copied()
        for cid, _ in work:  # a client's raise fails its group: each of its clients is retried alone
            self._fault("train_start", rnd, cid)
            self._fault("raise", rnd, cid)
        self._trained_since_save.set()
        t0 = time.perf_counter()
        begun = [self._begin(rnd, cid, payload) for cid, payload in work]
        trained = train_group(self.base, [self._job(rnd, b) for b in begun], self.algo.frozen)
        share = (time.perf_counter() - t0) / len(work)
        results = {b.slot.cid: self._finish(b, t, share, len(work)) for b, t in zip(begun, trained)}
        for cid in results:
            if self._fault("poison", rnd, cid):  # a diverged client
                slot, up = self.slots[cid], results[cid].upload
                slot.params = {k: v * 1e4 for k, v in slot.params.items()}
                up.params = {k: v * 1e4 for k, v in up.params.items()} if up.params else up.params
            self._fault("train_end", rnd, cid)
        return results

    def train(self, rnd: int, cid: int, payload: Payload) -> ClientResult:
        """One round of local training for client ``cid`` alone (a group of one); returns its upload
        and metrics. Errors are raised, not reported."""
        return self._train_group(rnd, [(cid, payload)])[cid]

    def train_many(self, rnd: int, items: list[tuple[int, int]], *payloads: Payload) -> tuple[str, list[tuple[int, ClientResult | str]]]:
        """Local training of several of this actor's clients in one call: ``items`` pairs a client with
        the index of its payload in ``payloads`` (clients sharing a payload share one object). Clients
        train in groups of up to the batch plan's size (``train.batch_clients``; clients of one base
        version; a payload with DP-SGD alone), the groups one after another. A client whose
        training raises does not stop the others: its entry is the error's one-line description
        instead of a result (a failed group: each of its clients', for the server to retry alone).
        Returns this actor's incarnation token (the server replays what a since-restarted
        incarnation trained) and the entries."""
        done: dict[int, ClientResult | str] = {}
        for group in self._training_groups(items, payloads):
            try:
                done.update(self._train_group(rnd, group))
            except Exception as exc:  # noqa: BLE001  (each of its clients is retried alone)
                done.update(dict.fromkeys([cid for cid, _ in group], one_line(exc)))
        return self.incarnation_token, [(cid, done[cid]) for cid, _ in items]

    def _training_groups(self, items: list[tuple[int, int]], payloads: tuple) -> list[list[tuple[int, Payload]]]:
        """``items`` as the engine's groups: by base version, at most the batch plan's size; a payload
        with DP-SGD trains alone (``config.batching.why_alone`` says so from the config; a payload
        can still carry it)."""
        size = self.batch_plan.clients
        together: dict[Any, list[tuple[int, Payload]]] = {}
        alone = []
        for cid, which in items:
            payload = payloads[which]
            if size > 1 and payload.dp is None:
                together.setdefault(payload.base_version, []).append((cid, payload))
            else:
                alone.append([(cid, payload)])
        return [chunk for group in together.values() for chunk in chunks(group, size)] + alone

    def local_steps(self, cid: int) -> int:
        """``train.steps``, or ``train.epochs`` over client ``cid``'s training examples in batches."""
        return local_steps(self.cfg.train, len(self.slots[cid].train_enc))

    def batch_order(self, rnd: int, cid: int, steps: int) -> torch.Tensor:
        """Indices into client ``cid``'s training examples for ``steps`` batches of round ``rnd``."""
        return batch_order(self.cfg, rnd, cid, len(self.slots[cid].train_enc), steps)

    # ---------------------------------------------------------------- evaluation
    def _mean_loss(self, slot: ClientSlot, params: Params, split: str) -> float:
        if split == "val" and not slot.val_enc:
            raise ValueError(f"client {slot.cid} has no validation examples (data.val_fraction is 0 or its "
                             f"training split has a single record): a validation loss cannot be computed")
        examples = {"test": slot.test_enc, "val": slot.val_enc}.get(split, slot.train_enc)
        return mean_loss(self.base, slot.rank, params, examples)

    def evaluate(self, rnd: int, cid: int, payload: Payload) -> dict[str, float]:
        """Test loss over the client's whole test split and, unless ``eval.max_new_tokens`` is 0, task
        accuracy (greedy generation, the task's scorer) on its first ``eval.max_examples`` test
        records; DPO reward margins of its test pairs (an evaluation group of one)."""
        return self.evaluate_many(rnd, [([cid], payload)])[1][cid]

    def evaluate_many(self, rnd: int, groups: list[tuple[list[int], Payload]]) -> tuple[str, dict[int, dict[str, float]]]:
        """:meth:`evaluate` for several of this actor's clients in one call: ``groups`` pairs clients
        with the evaluation payload they share. Clients of one group evaluated with that payload's own
        adapter (the method keeps :meth:`Algorithm.client_eval_params`' default) and of one rank are
        one evaluation group with one adapter; clients evaluated with their own adapters form groups
        of up to the batch plan's size (one adapter each). A group's ``eval_seconds`` is divided
        equally among its clients. Returns this actor's incarnation token (the server re-asks a life
        it has not adopted) and the metrics by client."""
        self._wait_copied()  # (a method's evaluation hooks see the clients' state)
        for cids, _ in groups:
            for cid in cids:
                self._fault("evaluate", rnd, cid)
        out: dict[int, dict[str, float]] = {}
        own: dict[Any, list[tuple[int, Payload]]] = {}
        for cids, payload in groups:
            if self._shares_adapter(cids, payload):
                out.update(self._evaluate_group(rnd, [(cid, payload) for cid in cids], shared=True))
            else:
                for cid in cids:
                    own.setdefault(payload.base_version, []).append((cid, payload))
        size = self.batch_plan.clients if self.adapters.groups else 1
        for members in own.values():
            for chunk in chunks(members, max(1, size)):
                out.update(self._evaluate_group(rnd, chunk, shared=False))
        return self.incarnation_token, out

    def _shares_adapter(self, cids: list[int], payload: Payload) -> bool:
        own_default = type(self.algo).client_eval_params is Algorithm.client_eval_params
        return own_default and payload.params is not None and len({self.slots[c].rank for c in cids}) == 1

    def _evaluate_group(self, rnd: int, members: list[tuple[int, Payload]], shared: bool) -> dict[int, dict[str, float]]:
        """``members`` (clients with their payloads; one base version) evaluated as one group of the
        engine (``engine.evaluation``): with the payload's adapter for all (``shared``), or each with
        its own (``client_eval_params``)."""
        slots = [self.slots[cid] for cid, _ in members]
        self._apply_base(members[0][1])
        if shared:
            ranks, params = [slots[0].rank], [members[0][1].params]
        else:
            ranks = [s.rank for s in slots]
            params = [self.algo.client_eval_params(self._context(rnd, s, p), p) for s, (_, p) in zip(slots, members)]
        t0 = time.perf_counter()
        generating = self.cfg.eval.max_new_tokens > 0
        tests = [self._generated_records(s) if generating else [] for s in slots]
        clients = [EvalClient(0 if shared else k, examples=s.test_enc, prompts=[r["prompt"] for r in test],
                              pairs=s.test_pref if self.preference else [],
                              reference=self._reference(s, "test") if self.preference and s.test_pref else None)
                   for k, (s, test) in enumerate(zip(slots, tests))]
        results = evaluate_group(self.base, ranks, params, clients)
        share = (time.perf_counter() - t0) / len(slots)
        out = {}
        for s, test, r in zip(slots, tests, results):
            m = {"test_loss": r.loss, "num_test_loss": float(len(s.test_enc))}
            if generating:
                m.update(accuracy(test, r.answers))
            if r.margins is not None:
                m["dpo_reward_margin"] = float(r.margins.mean())
                m["dpo_reward_accuracy"] = float((r.margins > 0).float().mean())
                m["num_test_pref"] = float(len(s.test_pref))
            m["eval_seconds"] = share
            out[s.cid] = m
        return out

    def _generated_records(self, slot: ClientSlot) -> list[dict]:
        """The test records whose answers are generated for accuracy: the first ``eval.max_examples``."""
        return slot.test[: self.cfg.eval.max_examples] if self.cfg.eval.max_examples else slot.test

    def _fault(self, point: str, rnd: int, cid: int) -> bool:
        """Fire the fault armed at ``point`` for (round, client), if any (``actors.faults``; a run has none)."""
        return self.faults is not None and self.faults.at(point, rnd, cid)

    # ---------------------------------------------------------------- checkpoints
    def save(self, directory: str, previous: str | None = None, defer: bool = False) -> dict[str, Any]:
        """Write every hosted client's state into ``directory`` (see :func:`client_state.save_slots`).

        ``defer``: answer at once (``{"written", "reused", "deferred": True, "token"}``); the state is
        copied out and written on this actor's writer threads (whatever changes a client waits for
        the copies first), and :meth:`saved` returns the digests once the files are on disk
        (``checkpoint.overlap``)."""
        if self.faults is not None:
            self.faults.before_save(directory, self.slots)
        self._wait_deferred()  # a save never overtakes an earlier one
        if not defer:
            return {**save_slots(self.slots, directory, previous), "token": self.incarnation_token}
        pending = stage_slots(self.slots, directory, previous, self._writer())
        with self._deferred_lock:
            self._deferred[directory] = pending
        if self.faults is not None:
            self.faults.after_deferred_save(self, directory, pending)
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

    def rewind(self, directory: str | None) -> int:
        """Back to the committed round in ``directory`` for a new server actor (the one that asked for
        the deferred saves died): every deferred save's files written and forgotten, then
        :meth:`restore`; ``None`` (no round committed yet): every client as it was built, before round
        1, and the base at W_0. The round restored."""
        self._wait_deferred(written=True)
        with self._deferred_lock:
            self._deferred.clear()
        if directory is not None:
            self.restore(directory)
            return self.restored_round
        weights = self.adapters.base_weights() if self._base0 else {}
        with torch.no_grad():
            for module, w0 in self._base0.items():
                weights[module].copy_(w0)
        self.base_version = None
        for slot in self.slots.values():
            slot.params, slot.opt_state, slot.algo_state = clone(self.init_params[slot.rank]), None, {}
            slot.algo_meta, slot.rounds_trained, slot.saved_as = {}, 0, None
            slot.ref_logps.clear()
        self.restored_round = 0
        return 0


@dataclass
class _Begun:
    """A client's training of a round, begun (:meth:`ClientActor._begin`)."""

    slot: ClientSlot
    ctx: ClientContext
    start: Params
    steps: int
    t0: float


def restarted() -> bool:
    """Whether this process is an actor Ray restarted after it died. Ray runs the constructor again
    with the arguments it was first given, whose ``restore_from`` names the round the actor was built
    from; by now pruning may have removed it. A restarted actor therefore restores nothing when built:
    the server restores every new incarnation from the newest committed round
    (``RoundCheckpoints.restore_committed``), the only round it ever tells an actor to restore from,
    which pruning never removes."""
    if not ray.is_initialized():  # an actor built in-process (benchmarks, tests): never restarted
        return False
    import warnings

    context = ray.get_runtime_context()
    if context.worker.mode != ray.WORKER_MODE:
        return False
    with warnings.catch_warnings():  # (Ray 2.60's property reads its own deprecated actor_id)
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(context.was_current_actor_reconstructed)


def accuracy(records: list[dict], answers: list[str]) -> dict[str, float]:
    """The share of ``answers`` the task's scorer accepts for ``records``, and how many were scored."""
    return {"accuracy": float(np.mean([score(r, a) for r, a in zip(records, answers)])), "num_test": float(len(records))}


def _as_text(record: dict) -> str:
    """A record as one text (prompt, then response) for a sentence encoder."""
    return f"{record['prompt']}\n{record['response']}"
