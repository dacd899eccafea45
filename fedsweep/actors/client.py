"""ClientActor: one frozen base model, the state of one or more clients, local training.

The base model and its LoRA wrapper are loaded once. Each hosted client keeps its own
adapter tensors, optimiser state and algorithm state; before a client trains or is
evaluated its adapter is copied into the shared LoRA modules (``clients_per_actor > 1``
packs many clients on one base). Randomness of a client's round (batch order, dropout)
is derived from (seed, round, client), so results do not depend on which actor hosts a
client, in which order clients run, or whether the run was resumed.

This is a plain class: ``actors.remote`` wraps it for Ray; tests may use it in-process.
"""

from __future__ import annotations

import contextlib
import math
import os
import uuid
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedsweep import checkpoint as ckpt
from fedsweep.actors import dp as dpsgd
from fedsweep.actors.objectives import dpo_loss, sequence_logps
from fedsweep.actors.text import (Example, collate, encode_preference, encode_prompts_left, encode_sft, target_loss_sum,
                                  token_loss_sum)
from fedsweep.algorithms import registry
from fedsweep.algorithms.base import BASE_PREFIX, ClientContext, ClientResult, Params, Payload, clone, upload_bytes
from fedsweep.data.bundled import score
from fedsweep.actors.text import IGNORE
from fedsweep.models import loading
from fedsweep.models.adapters import make_adapters
from fedsweep.storage import location, reuse_file


def derive_seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


@dataclass
class ClientSlot:
    cid: int
    train: list[dict]
    test: list[dict]
    train_enc: list[Example]
    test_enc: list[Example]
    params: Params
    rank: int = 8
    opt_state: dict | None = None
    algo_state: Params = field(default_factory=dict)
    rounds_trained: int = 0
    train_pref: list[dict] = field(default_factory=list)
    test_pref: list[dict] = field(default_factory=list)
    ref_logps: dict[str, torch.Tensor] = field(default_factory=dict)
    """DPO reference log-probs per split, (n, 2): the base is frozen, so computed once."""
    val_enc: list[Example] = field(default_factory=list)
    algo_meta: dict[str, Any] = field(default_factory=dict)
    """The method's JSON per-client state (``ClientContext.meta``), checkpointed with the client."""
    saved_as: str | None = None
    """The round folder (``round_0003``) holding exactly this state: set when saved or restored,
    cleared by training. Only then are that round's files reused instead of rewritten."""


class ClientActor:
    def __init__(self, config: dict[str, Any], clients: list[dict[str, Any]], restore_from: str | None = None,
                 pool: list[dict] | None = None):
        """``clients``: ``[{"cid", "train", "test"}]``; ``restore_from``: the checkpoint round folder to
        start from (the runner verified it; after a restart the server moves the actor to the round it
        last committed);
        ``pool``: the held-out validation pool (methods with ``uses_validation_pool``)."""
        from fedsweep.orchestrator.config import validate

        self.cfg = validate(config)
        res = self.cfg.clients.resources
        torch.set_num_threads(res.torch_threads or max(1, int(res.num_cpus)))
        self.device = actor_device(res)
        models = {self.cfg.client_models()[c["cid"]] for c in clients} or {self.cfg.model.name}
        if len(models) > 1:
            raise ValueError(f"one ClientActor hosts clients of one base model, got {sorted(models)}")
        model_cfg = self.cfg.model.model_copy(update={"name": models.pop()})
        self.tokenizer = loading.load_tokenizer(model_cfg)
        base = prepare_base(loading.load_base_model(model_cfg, self.cfg.seed, len(self.tokenizer), str(self.device)),
                            self.cfg)
        all_ranks = self.cfg.client_ranks() if self.cfg.adapter == "lora" else [self.cfg.reft.rank] * self.cfg.clients.num_clients
        ranks = sorted({all_ranks[c["cid"]] for c in clients}) or [all_ranks[0]]
        self.adapters = make_adapters(base, self.cfg, self.cfg.seed, ranks)
        self.model = self.adapters.model
        if self.cfg.model.quantization == "none":  # adapter modules follow the base (a quantised one refuses .to)
            self.model.to(self.device)
        self.model.eval()
        self.algo = registry.create(self.cfg.algorithm, self.cfg.algo_params)
        self.init_params = {r: self.adapters.read(r) for r in ranks}
        self.base_version: int | None = None
        self._base0: dict[str, torch.Tensor] = {}
        max_len = self.cfg.train.max_length
        self.slots: dict[int, ClientSlot] = {}
        self.system = self.cfg.data.system_prompt
        self._logits_to_keep = True  # cleared if the model's forward does not take logits_to_keep
        self.preference = self.cfg.data.kind == "preference"
        for c in clients:
            enc = lambda rs: [encode_sft(self.tokenizer, r["prompt"], r["response"], max_len, system=self.system)  # noqa: E731
                              for r in rs]
            rank = all_ranks[c["cid"]]
            slot = ClientSlot(c["cid"], c["train"], c["test"], enc(c["train"]), enc(c["test"]),
                              clone(self.init_params[rank]), rank, val_enc=enc(c.get("val", [])))
            if self.preference:
                pref = lambda rs: [encode_preference(self.tokenizer, r, max_len, self.system) for r in rs]  # noqa: E731
                slot.train_pref, slot.test_pref = pref(c["train"]), pref(c["test"])
            self.slots[c["cid"]] = slot
        self.pool = list(pool or [])
        uses_pool = self.algo.uses_validation_pool  # the texts a method embeds, built once
        self._pool_texts = [_as_text(r) for r in self.pool] if uses_pool else []
        self._local_texts = {cid: [_as_text(r) for r in s.train] for cid, s in self.slots.items()} if uses_pool else {}
        self._pool_enc: list[Example] | None = None
        self._embed = None
        self.restored_round = 0
        self.incarnation_token = uuid.uuid4().hex  # a restarted actor is a new incarnation
        if restore_from:
            self.restore(restore_from)

    # ------------------------------------------------------------------ plumbing
    def ping(self) -> list[int]:
        return sorted(self.slots)

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

    def _activate(self, slot: ClientSlot) -> dict[str, torch.nn.Parameter]:
        """Make ``slot``'s adapter the active one; its live parameters."""
        return self.adapters.activate(slot.rank)

    def _forward(self, batch: dict[str, torch.Tensor], prompt_lengths: torch.Tensor, offsets: torch.Tensor,
                 keep: torch.Tensor | None = None):
        """Model logits, with ReFT interventions at the prompt positions of each row; ``keep``: only
        at these sequence positions (``logits_to_keep``)."""
        extra = {} if keep is None else {"logits_to_keep": keep}
        with self.adapters.positions(prompt_lengths=prompt_lengths.cpu(), offsets=offsets.cpu(),
                                     width=batch["input_ids"].shape[1]), self._autocast():
            return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra).logits

    def _autocast(self):
        """``train.autocast``: mixed precision for forward passes (backward follows the forward's casts)."""
        mode = self.cfg.train.autocast
        if mode == "none":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16 if mode == "bf16" else torch.float16)

    def _sft_logits(self, batch: dict[str, torch.Tensor], keep: torch.Tensor | None = None) -> torch.Tensor:
        """Right-padded prompt+response rows: the prompt is the leading run of IGNORE labels."""
        plen = (batch["labels"] != IGNORE).int().argmax(dim=1)
        return self._forward(batch, plen, torch.zeros_like(plen), keep)

    def _sft_loss_sum(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Summed next-token loss over the supervised (response) tokens, and their count.

        The vocabulary projection runs only at the positions that predict a supervised token in
        some row (``logits_to_keep``): it is a fifth of a 135M model's compute and most positions
        are prompt. Models whose forward lacks ``logits_to_keep`` get full logits."""
        targets = batch["labels"][:, 1:]
        keep = (targets != IGNORE).any(dim=0).nonzero().squeeze(1)
        if self._logits_to_keep and 0 < keep.numel() < targets.shape[1]:
            try:
                logits = self._sft_logits(batch, keep)
                if logits.shape[1] == keep.numel():
                    return target_loss_sum(logits, targets[:, keep])
            except TypeError:  # this architecture's forward has no logits_to_keep
                pass
            self._logits_to_keep = False
        return token_loss_sum(self._sft_logits(batch), batch["labels"])

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
        version = payload.data.get("base_version")
        if version is None or version == self.base_version:
            return
        weights = self.adapters.base_weights()
        with torch.no_grad():
            for key, delta in payload.tensors.items():
                if not key.startswith(BASE_PREFIX):
                    continue
                module = key[len(BASE_PREFIX):]
                w = weights[module]
                if module not in self._base0:
                    self._base0[module] = w.detach().clone()
                w.copy_(self._base0[module] + delta.to(w.device, w.dtype))
        self.base_version = version
        for slot in self.slots.values():
            slot.ref_logps.clear()  # the reference policy is the (changed) base

    def _pool_loss(self, slot: ClientSlot, params: Params, indices: list[int]) -> float:
        if self._pool_enc is None:  # tokenised once per actor, shared by its clients
            self._pool_enc = [encode_sft(self.tokenizer, r["prompt"], r["response"], self.cfg.train.max_length,
                                         system=self.system)
                              for r in self.pool]
        return self._loss_on(slot, params, [self._pool_enc[i] for i in indices])

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
                             embed=self._embed_cached if self.algo.client_encoder_name() else None,
                             seed=derive_seed(self.cfg.seed, rnd, slot.cid, 11),
                             eval_loss=lambda params, split: self._mean_loss(slot, params, split),
                             rank=slot.rank, lora_scale=self.cfg.lora.alpha / slot.rank, steps=steps,
                             learning_rate=self.cfg.train.learning_rate, fresh_params=lambda: self._fresh(slot, rnd),
                             generate=lambda prompts, max_new_tokens, **kw: self.generate(
                                 prompts, max_new_tokens, seed=derive_seed(self.cfg.seed, rnd, slot.cid, 9), **kw))

    def _batches(self, examples: list[Example], size: int):
        for i in range(0, len(examples), size):
            yield {k: v.to(self.device) for k, v in collate(examples[i:i + size], self.tokenizer.pad_token_id).items()}

    # ------------------------------------------------------------------ training
    def train(self, rnd: int, cid: int, payload: Payload) -> ClientResult:
        """One round of local training for client ``cid``; returns its upload and metrics."""
        fault_point("train_start", rnd, cid)
        slot = self.slots[cid]
        tc = self.cfg.train
        t0 = time.perf_counter()
        self._apply_base(payload)
        n = len(slot.train_enc)
        if n == 0:
            raise ValueError(f"client {cid} has no training examples")
        steps = self.local_steps(cid) * int(payload.data.get("steps_scale", 1))
        ctx = self._context(rnd, slot, payload, steps)
        start = self.algo.client_prepare(ctx, payload)
        live = self._activate(slot)
        self.adapters.write(start, slot.rank)
        params = {k: p for k, p in live.items() if not self.algo.frozen(k)}
        for k, p in live.items():
            p.requires_grad_(k in params)
        opt = make_optimizer(tc, list(params.values()))
        if slot.opt_state is not None:
            opt.load_state_dict(slot.opt_state)  # moves parked (CPU) state to the parameters' device
        scaler = torch.amp.GradScaler(self.device.type) if tc.autocast == "fp16" else None
        pool = slot.train_enc
        extra = payload.data.get("extra_train") or []
        dp = payload.data.get("dp")  # DP-SGD settings (actors/dp.py), or None
        if (extra or dp) and tc.objective == "dpo":
            raise ValueError("public pseudo-labels and DP-SGD need the sft objective")
        # e.g. FedCoFiT's pseudo-labelled public prompts: a second stream sampled every step, its
        # token-mean loss weighted extra_weight against the private one's (½ and ½ in FedCoFiT)
        public = [encode_sft(self.tokenizer, r["prompt"], r["response"], tc.max_length, eos=r.get("eos", True),
                             system=self.system)
                  for r in extra]
        extra_w = float(payload.data.get("extra_weight", 0.5)) if public else 0.0
        seed = derive_seed(self.cfg.seed, rnd, cid)
        torch.manual_seed(seed)  # LoRA dropout
        order = self.batch_order(rnd, cid, steps)
        if public:
            pgen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, rnd, cid, 13))
            porder = torch.cat([torch.randperm(len(public), generator=pgen)
                                for _ in range(math.ceil(steps * tc.batch_size / len(public)))])
        if dp:
            rate = min(1.0, tc.batch_size / n)
            dgen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, rnd, cid, 17))
        dpo = tc.objective == "dpo"
        if dpo:
            self._reference(slot, "train")
        losses, margins = [], []
        self.model.train()

        def sft_loss(examples):
            batch = {k: v.to(self.device) for k, v in collate(examples, self.tokenizer.pad_token_id).items()}
            total, count = self._sft_loss_sum(batch)
            return total / max(count, 1)

        for step in range(steps):
            idx = order[step * tc.batch_size:(step + 1) * tc.batch_size].tolist()
            pub = [public[i] for i in porder[step * tc.batch_size:(step + 1) * tc.batch_size].tolist()] if public else []
            opt.zero_grad(set_to_none=True)
            if dp:  # DP-SGD on the private stream; the public stream is not private
                noisy, rec_losses = dpsgd.noisy_clipped_gradient(
                    lambda i: sft_loss([pool[i]]), dpsgd.poisson_batch(n, rate, dgen), params, dp["max_grad_norm"],
                    dp["noise_multiplier"], tc.batch_size, dgen)
                loss = torch.tensor(float(np.mean(rec_losses)) if rec_losses else 0.0)
                if pub:
                    pub_loss = sft_loss(pub)
                    (extra_w * pub_loss).backward()
                    loss = (1 - extra_w) * loss + extra_w * pub_loss.detach()
                for k, p in params.items():
                    g = noisy[k].to(p.dtype) * (1 - extra_w if pub else 1.0)
                    p.grad = g if p.grad is None else p.grad + g
            else:
                if dpo:
                    raw, margin = self._dpo_loss(slot, "train", idx)
                    margins.append(float(margin.mean()))
                else:
                    raw = sft_loss([pool[i] for i in idx])
                    if pub:
                        raw = (1 - extra_w) * raw + extra_w * sft_loss(pub)
                loss = self.algo.client_loss(ctx, raw, params)
                (scaler.scale(loss) if scaler else loss).backward()
                if scaler:
                    scaler.unscale_(opt)
                if tc.grad_clip:
                    torch.nn.utils.clip_grad_norm_(list(params.values()), tc.grad_clip)
            if scaler:
                scaler.step(opt)  # skipped when a gradient overflowed fp16
                scaler.update()
            else:
                opt.step()
            self.adapters.post_step()
            losses.append(float(loss.detach()))
        self.model.eval()
        for p in live.values():
            p.requires_grad_(True)
        trained = self.adapters.read(slot.rank)
        if fault_point("poison", rnd, cid):
            trained = {k: v * 1e4 for k, v in trained.items()}
        slot.params = trained
        slot.opt_state = _detach_state(opt.state_dict(), "cpu" if self.cfg.clients.park == "cpu" else None)
        slot.rounds_trained += 1
        slot.saved_as = None
        ctx.train_loss = float(np.mean(losses))
        upload = self.algo.client_upload(ctx, trained)
        seconds = time.perf_counter() - t0
        metrics = {"train_loss": float(np.mean(losses)), "train_loss_first": losses[0], "train_loss_last": losses[-1],
                   "steps": float(steps),
                   "train_seconds": seconds, **upload.metrics}
        if margins:
            metrics["dpo_reward_margin"] = float(np.mean(margins))
        fault_point("train_end", rnd, cid)
        if dp:  # ε composed over every step of every round so far (Opacus RDP accountant)
            history = slot.algo_meta.setdefault("dp_history", [])
            history.append([dp["noise_multiplier"], rate, steps])
            metrics["dp_epsilon"] = dpsgd.epsilon(history, dp["delta"])
        return ClientResult(cid=cid, num_examples=n, upload=upload, bytes_up=upload_bytes(upload), metrics=metrics)

    def local_steps(self, cid: int) -> int:
        """``train.steps``, or ``train.epochs`` over client ``cid``'s training examples in batches."""
        tc = self.cfg.train
        return tc.steps or max(1, math.ceil(tc.epochs * len(self.slots[cid].train_enc) / tc.batch_size))

    def batch_order(self, rnd: int, cid: int, steps: int) -> torch.Tensor:
        """Indices into client ``cid``'s training examples for ``steps`` batches of round ``rnd``: shuffled
        epochs back to back, seeded by (seed, round, client)."""
        n = len(self.slots[cid].train_enc)
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, rnd, cid))
        return torch.cat([torch.randperm(n, generator=gen)
                          for _ in range(math.ceil(steps * self.cfg.train.batch_size / n))])

    # ----------------------------------------------------------------------- DPO
    def _pref_batch(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        batch = DataCollatorForPreference(pad_token_id=self.tokenizer.pad_token_id)(examples)
        return {k: batch[k].to(self.device) for k in ("input_ids", "attention_mask", "completion_mask")}

    def _logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        plen = batch["completion_mask"].int().argmax(dim=1)
        logits = self._forward(batch, plen, torch.zeros_like(plen))
        return sequence_logps(logits, batch["input_ids"], batch["completion_mask"])

    @torch.no_grad()
    def _reference(self, slot: ClientSlot, split: str) -> torch.Tensor:
        """Reference log-probs (adapter disabled = the frozen base) of every pair, computed once."""
        if split not in slot.ref_logps:
            pairs = slot.train_pref if split == "train" else slot.test_pref
            rows = []
            was_training = self.model.training
            self.model.eval()
            with self.adapters.disabled():
                for i in range(0, len(pairs), self.cfg.eval.batch_size):
                    chosen, rejected = self._logps(self._pref_batch(pairs[i:i + self.cfg.eval.batch_size])).chunk(2)
                    rows.append(torch.stack([chosen, rejected], dim=1).cpu())
            self.model.train(was_training)
            slot.ref_logps[split] = torch.cat(rows)
        return slot.ref_logps[split]

    def _dpo_loss(self, slot: ClientSlot, split: str, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = slot.train_pref if split == "train" else slot.test_pref
        ref = self._reference(slot, split)[idx].to(self.device)
        chosen, rejected = self._logps(self._pref_batch([pairs[i] for i in idx])).chunk(2)
        return dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], self.cfg.train.dpo_beta)

    # ---------------------------------------------------------------- evaluation
    def _mean_loss(self, slot: ClientSlot, params: Params | None, split: str) -> float:
        if split == "val" and not slot.val_enc:
            raise ValueError(f"client {slot.cid} has no validation examples (data.val_fraction is 0 or its "
                             f"training split has a single record): a validation loss cannot be computed")
        examples = {"test": slot.test_enc, "val": slot.val_enc}.get(split, slot.train_enc)
        return self._loss_on(slot, params, examples)

    @torch.no_grad()
    def _loss_on(self, slot: ClientSlot, params: Params | None, examples: list[Example]) -> float:
        """Mean token loss of ``params`` (``None``: the slot's active adapter) over ``examples``."""
        self._activate(slot)
        if params is not None:
            self.adapters.write(params, slot.rank)
        total, count = 0.0, 0
        for batch in self._batches(examples, self.cfg.eval.batch_size):
            s, c = self._sft_loss_sum(batch)
            total, count = total + float(s), count + c
        return total / max(count, 1)

    @torch.no_grad()
    def generate(self, prompts: list[str], max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0, with_truncation: bool = False):
        """Completions of ``prompts`` with the adapter currently loaded (greedy unless ``do_sample``).
        ``with_truncation``: also return, per completion, whether it was cut by ``max_new_tokens``
        (no end-of-sequence token generated)."""
        out, cut = [], []
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if do_sample else {"do_sample": False}
        if do_sample:
            torch.manual_seed(seed)
        for i in range(0, len(prompts), self.cfg.eval.batch_size):
            enc = {k: v.to(self.device) for k, v in
                   encode_prompts_left(self.tokenizer, prompts[i:i + self.cfg.eval.batch_size],
                                       self.cfg.train.max_length, self.system).items()}
            lengths = enc["attention_mask"].sum(dim=1)
            with self.adapters.positions(prompt_lengths=lengths.cpu(), offsets=(enc["input_ids"].shape[1] - lengths).cpu(),
                                         width=enc["input_ids"].shape[1]), self._autocast():
                gen = self.model.generate(**enc, max_new_tokens=max_new_tokens, **sampling, use_cache=True,
                                          pad_token_id=self.tokenizer.pad_token_id,
                                          eos_token_id=self.tokenizer.eos_token_id)
            new = gen[:, enc["input_ids"].shape[1]:]
            out.extend(self.tokenizer.batch_decode(new, skip_special_tokens=True))
            finished = (new == self.tokenizer.eos_token_id).any(dim=1)
            cut.extend(bool(not f and new.shape[1] >= max_new_tokens) for f in finished.tolist())
        return (out, cut) if with_truncation else out

    def evaluate(self, rnd: int, cid: int, payload: Payload) -> dict[str, float]:
        """Test loss over the client's whole test split and, unless ``eval.max_new_tokens`` is 0, task
        accuracy (greedy generation, the task's scorer) on its first ``eval.max_examples`` test records."""
        fault_point("evaluate", rnd, cid)
        slot = self.slots[cid]
        self._apply_base(payload)
        params = self.algo.client_eval_params(self._context(rnd, slot, payload), payload)
        t0 = time.perf_counter()
        loss = self._mean_loss(slot, params, "test")  # always the whole test split: cheap, no generation
        out = {"test_loss": loss, "num_test_loss": float(len(slot.test_enc))}
        if self.cfg.eval.max_new_tokens > 0:  # accuracy: greedy generation on the first max_examples
            test = slot.test[: self.cfg.eval.max_examples] if self.cfg.eval.max_examples else slot.test
            answers = self.generate([r["prompt"] for r in test], self.cfg.eval.max_new_tokens)
            out["accuracy"] = float(np.mean([score(r, a) for r, a in zip(test, answers)]))
            out["num_test"] = float(len(test))
        if self.preference and slot.test_pref:
            with torch.no_grad():
                idx = list(range(len(slot.test_pref)))
                margins = torch.cat([self._dpo_loss(slot, "test", idx[i:i + self.cfg.eval.batch_size])[1]
                                     for i in range(0, len(idx), self.cfg.eval.batch_size)])
            out["dpo_reward_margin"] = float(margins.mean())
            out["dpo_reward_accuracy"] = float((margins > 0).float().mean())
            out["num_test_pref"] = float(len(idx))
        out["eval_seconds"] = time.perf_counter() - t0
        return out

    # ---------------------------------------------------------------- checkpoints
    def save(self, directory: str, previous: str | None = None) -> dict[str, list[int]]:
        """Write every hosted client's state into ``directory`` (a staging round folder).

        A client unchanged since it was saved into (or restored from) ``previous``, the last
        complete round, gets that round's files linked or copied instead of re-serialised: with
        partial participation most clients sit a round out. Returns {"written": cids, "reused": cids}.
        """
        out: dict[str, list[int]] = {"written": [], "reused": []}
        round_name = location(directory).name.removesuffix(".partial")
        fault_point("save", int(round_name.split("_")[-1]) if round_name.split("_")[-1].isdigit() else -1,
                    min(self.slots) if self.slots else -1)
        for cid, slot in self.slots.items():
            base = location(directory) / f"client_{cid:05d}"
            # reuse only what this state was saved as: a staged round that never committed does not count
            if previous is not None and slot.saved_as == location(previous).name:
                old = location(previous) / f"client_{cid:05d}"
                for suffix in (".safetensors", ".json"):
                    reuse_file(old.with_suffix(suffix), base.with_suffix(suffix))
                out["reused"].append(cid)
                slot.saved_as = round_name
                continue
            groups = {"params": slot.params, "algo": slot.algo_state}
            opt_meta = None
            if slot.opt_state is not None:
                groups["opt"], opt_meta = ckpt.optimizer_to_tensors(slot.opt_state)
            ckpt.write_tensors(base.with_suffix(".safetensors"), ckpt.flatten(groups))
            ckpt.write_json(base.with_suffix(".json"), {"cid": cid, "rounds_trained": slot.rounds_trained,
                                                        "optimizer": opt_meta, "algo_meta": slot.algo_meta})
            slot.saved_as = round_name
            out["written"].append(cid)
        return out

    def restore(self, directory: str) -> None:
        for cid, slot in self.slots.items():
            base = location(directory) / f"client_{cid:05d}"
            groups = ckpt.nest(ckpt.read_tensors(base.with_suffix(".safetensors")))
            meta = ckpt.read_json(base.with_suffix(".json"))
            slot.params = groups.get("params", slot.params)
            slot.algo_state = groups.get("algo", {})
            slot.rounds_trained = meta["rounds_trained"]
            slot.algo_meta = meta.get("algo_meta") or {}
            slot.saved_as = location(directory).name
            slot.opt_state = (ckpt.optimizer_from_tensors(groups.get("opt", {}), meta["optimizer"])
                              if meta["optimizer"] else None)
        self.restored_round = ckpt.read_json(location(directory) / "COMPLETE")["round"]


FAULT_ENV = "FEDSWEEP_FAULT"


def fault_point(point: str, rnd: int, cid: int) -> bool:
    """Fault injection for the recovery tests: ``FEDSWEEP_FAULT=point:round:client:marker[;…]`` makes
    the actor process exit at that point, once (the marker file records that it fired). Points:
    train_start, train_end (trained, result not yet returned), evaluate, save; ``poison`` does not
    exit but returns True (the caller corrupts that client's update: a diverged client)."""
    for spec in filter(None, os.environ.get(FAULT_ENV, "").split(";")):
        want, r, c, marker = spec.split(":", 3)
        if want == point and int(r) == rnd and int(c) == cid and not os.path.exists(marker):
            with open(marker, "w") as fh:
                fh.write(f"{point} round {rnd} client {cid}\n")
            if point == "poison":
                return True
            os._exit(1)
    return False


def _as_text(record: dict) -> str:
    """A record as one text (prompt, then response) for a sentence encoder."""
    return f"{record['prompt']}\n{record['response']}"


def actor_device(resources) -> torch.device:
    """The device a ClientActor with these resources computes on: CUDA where it was given a GPU."""
    return torch.device("cuda" if resources.num_gpus > 0 and torch.cuda.is_available() else "cpu")


def prepare_base(base, cfg):
    """The precision and memory options that act on the frozen base before adapters attach:
    peft's k-bit preparation of a quantised base, and gradient checkpointing (non-reentrant, so the
    frozen base needs no input gradients)."""
    checkpointing = cfg.train.gradient_checkpointing
    if cfg.model.quantization != "none":
        from peft import prepare_model_for_kbit_training

        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=checkpointing,
                                               gradient_checkpointing_kwargs={"use_reentrant": False})
    elif checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if checkpointing:
        base.config.use_cache = False  # generation turns it back on per call
    return base


def make_optimizer(tc, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
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


def _detach_state(state: dict, device: str | None = None) -> dict:
    """A deep copy of an optimiser state dict (tensors cloned; moved to ``device`` if given, e.g. parked on
    the CPU) that later steps cannot mutate."""
    def copy(v):
        return v.detach().to(device or v.device, copy=True)

    return {"state": {i: {k: (copy(v) if torch.is_tensor(v) else v) for k, v in s.items()}
                      for i, s in state["state"].items()},
            "param_groups": [dict(g) for g in state["param_groups"]]}
