"""The model side of a ClientActor: one frozen base with adapters, and everything computed on it.

Loss steps (SFT on response tokens, DPO against the frozen base), the local training loop
(optimiser, mixed precision, DP-SGD, an extra example stream), evaluation losses and
generation. It knows clients only as :class:`~fedsweep.actors.client_state.ClientSlot`
values handed to it; which client runs when, and the method's hooks, are the actor's.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from fedsweep.actors import dp as dpsgd
from fedsweep.actors.client_state import ClientSlot
from fedsweep.actors.objectives import dpo_loss, sequence_logps
from fedsweep.actors.shard_group import ShardGroup
from fedsweep.actors.text import (IGNORE, Example, collate, encode_preference, encode_prompts_left, encode_sft,
                                  token_loss_rows, token_loss_sum)
from fedsweep.algorithms.tensors import Params
from fedsweep.algorithms.types import Payload
from fedsweep.config import ExperimentConfig
from fedsweep.lazy import no_grad, torch
from fedsweep.models import loading
from fedsweep.models.adapters import make_adapters


def derive_seed(*parts: int) -> int:
    """A 32-bit seed that is a pure function of ``parts`` (config seed, round, client, purpose)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def actor_device(resources) -> torch.device:
    """The device a ClientActor with these resources computes on: CUDA where it was given a GPU."""
    return torch.device("cuda" if resources.num_gpus > 0 and torch.cuda.is_available() else "cpu")


def prepare_base(base, cfg: ExperimentConfig):
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


@dataclass
class StepsResult:
    """What a run of local steps produced."""

    losses: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    """DPO reward margins per step (DPO only)."""
    optimizer_state: dict | None = None
    dp_rate: float | None = None
    """DP-SGD's Poisson sampling rate (DP only)."""


class Trainer:
    """One frozen base model of ``model_name`` with adapters of ``ranks`` attached, on ``device``."""

    def __init__(self, cfg: ExperimentConfig, model_name: str, ranks: list[int], device: torch.device,
                 group: ShardGroup | None = None):
        """``group``: the process group of a sharded client (``clients.shard``): the base is sharded over
        it before adapters attach, and each batch's rows are split between its processes."""
        self.cfg = cfg
        self.device = device
        self.group = group
        model_cfg = cfg.model.model_copy(update={"name": model_name})
        self.tokenizer = loading.load_tokenizer(model_cfg)
        shard = cfg.clients.shard if group is not None else None
        # FSDP2's CPU offload takes the base from host memory and keeps its shards there
        load_on = "cpu" if shard and shard.offload == "cpu" and shard.backend == "fsdp" else str(device)
        base = prepare_base(loading.load_base_model(model_cfg, cfg.seed, len(self.tokenizer), load_on), cfg)
        self._shard_handle = None  # DeepSpeed's engine: its hooks gather the base's weights
        if shard is not None:
            from fedsweep.models.sharding import shard_base

            self._shard_handle = shard_base(base, shard.backend, shard.offload, device)
        self.adapters = make_adapters(base, cfg, cfg.seed, ranks)
        self.model = self.adapters.model
        if shard is not None:  # the backend placed the base; the adapter, whole on each process, computes here
            self.adapters.to(device)
        elif cfg.model.quantization == "none":  # adapter modules follow the base (a quantised one refuses .to)
            self.model.to(device)
        self.model.eval()
        self.system = cfg.data.system_prompt
        self._gather_head = True  # cleared if this model's head cannot be given gathered hidden states
        self._plan = None  # the memory plan (lockstep_limit), made on first use
        self._said_limit: set[tuple[int, int]] = set()
        self._extra: tuple[tuple, list[Example]] = ((), [])  # the last extra stream, tokenised

    def lockstep_limit(self, clients: int) -> int:
        """``train.batch_clients: auto``: the most of ``clients`` one lockstep step takes. On a GPU the
        memory planner's :meth:`~fedsweep.models.memory.MemoryPlan.batch_limit` for this actor's share
        of the device (``clients.resources.num_gpus``; planned once); on the CPU, all."""
        if self.device.type != "cuda":
            return clients
        if self._plan is None:  # from the loaded base's own architecture
            from fedsweep.models.memory import plan

            self._plan = plan(self.cfg, self.model.get_base_model().config.to_dict())
        share = min(1.0, self.cfg.clients.resources.num_gpus)
        limit = self._plan.batch_limit(torch.cuda.get_device_properties(self.device).total_memory * share, clients)
        if limit < clients and (clients, limit) not in self._said_limit:
            self._said_limit.add((clients, limit))
            print(f"fedsweep: lockstep steps take {limit} of {clients} clients at a time (the memory planner's "
                  f"estimate for {share:g} of this GPU)", file=sys.stderr, flush=True)
        return limit

    # ------------------------------------------------------------------ encoding
    def encode(self, records: list[dict], eos_key: str | None = None) -> list[Example]:
        """SFT examples of ``records`` (prompt, response); ``eos_key``: a record field saying whether an
        end-of-sequence token follows the response (default: always)."""
        ml = self.cfg.train.max_length
        return [encode_sft(self.tokenizer, r["prompt"], r["response"], ml, eos=r.get(eos_key, True) if eos_key else True,
                           system=self.system) for r in records]

    def encode_extra(self, records: list[dict]) -> list[Example]:
        """A payload's extra stream (``Payload.extra_train``) tokenised; the last one is kept, as every
        client of a round (several on one actor) receives the same stream."""
        key = tuple((r["prompt"], r["response"], r.get("eos", True)) for r in records)
        if key != self._extra[0]:
            self._extra = (key, self.encode(records, eos_key="eos"))
        return self._extra[1]

    def encode_preferences(self, records: list[dict]) -> list[dict]:
        return [encode_preference(self.tokenizer, r, self.cfg.train.max_length, self.system) for r in records]

    def batches(self, examples: list[Example], size: int):
        for i in range(0, len(examples), size):
            yield {k: v.to(self.device) for k, v in collate(examples[i:i + size], self.tokenizer.pad_token_id).items()}

    # ------------------------------------------------------------------ forward
    def autocast(self):
        """``train.autocast``: mixed precision for forward passes (backward follows the forward's casts)."""
        dtype = loading.torch_dtype(loading.AUTOCAST.get(self.cfg.train.autocast))
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def forward(self, batch: dict[str, torch.Tensor], prompt_lengths: torch.Tensor, offsets: torch.Tensor):
        """Model logits, with ReFT interventions at the prompt positions of each row."""
        with self.adapters.positions(prompt_lengths=prompt_lengths.cpu(), offsets=offsets.cpu(),
                                     width=batch["input_ids"].shape[1]), self.autocast():
            return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    def _sft_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Right-padded prompt+response rows: the prompt is the leading run of IGNORE labels."""
        plen = (batch["labels"] != IGNORE).int().argmax(dim=1)
        return self.forward(batch, plen, torch.zeros_like(plen))

    @contextlib.contextmanager
    def _head_at(self, rows: torch.Tensor, cols: torch.Tensor):
        """Inside it the model's vocabulary projection runs only on the hidden states at positions
        (``rows[i]``, ``cols[i]``): a pre-hook on the output embedding gathers them, so the logits
        come out (1, N, V)."""
        def gather(module, args):
            return (args[0][rows, cols].unsqueeze(0), *args[1:]) if args else None

        handle = self.model.get_output_embeddings().register_forward_pre_hook(gather)
        try:
            yield
        finally:
            handle.remove()

    def logits_at(self, batch: dict[str, torch.Tensor], rows: torch.Tensor, cols: torch.Tensor,
                  prompt_lengths: torch.Tensor) -> torch.Tensor:
        """Logits (N, V) at the positions (``rows``, ``cols``) of ``batch`` only.

        The vocabulary projection is the largest single matrix of a small model (49,152 × 576 in
        SmolLM2-135M) and most positions are prompt or padding: each row pays only for the
        positions whose prediction is scored, whatever the other rows' lengths. A model whose head is
        not one module applied to the hidden states gets full logits, indexed."""
        offsets = torch.zeros_like(prompt_lengths)
        if self._gather_head and self.model.get_output_embeddings() is not None:
            with self._head_at(rows, cols):
                logits = self.forward(batch, prompt_lengths, offsets)
            if logits.shape[:2] == (1, rows.numel()):
                return logits[0]
            self._gather_head = False
        return self.forward(batch, prompt_lengths, offsets)[rows, cols]

    def sft_loss_sum(self, batch: dict[str, torch.Tensor], per_row: bool = False) -> tuple:
        """Summed next-token loss over the supervised (response) tokens, and their count (``per_row``:
        one sum and one count per row, as tensors). Logits are made only where a supervised token
        is predicted (:meth:`logits_at`)."""
        targets = batch["labels"][:, 1:]
        rows, cols = (targets != IGNORE).nonzero(as_tuple=True)
        if rows.numel() == 0:  # nothing supervised: a zero that still has a gradient
            return (token_loss_rows if per_row else token_loss_sum)(self._sft_logits(batch), batch["labels"])
        plen = (batch["labels"] != IGNORE).int().argmax(dim=1)
        losses = torch.nn.functional.cross_entropy(self.logits_at(batch, rows, cols, plen).float(),
                                                   targets[rows, cols], reduction="none")
        if not per_row:
            return losses.sum(), rows.numel()
        size = targets.shape[0]
        return losses.new_zeros(size).index_add(0, rows, losses), torch.bincount(rows, minlength=size)

    def sft_mean_loss(self, examples: list[Example]) -> torch.Tensor:
        """Token-mean SFT loss of one batch of examples (with gradients). In a sharded client, this
        process's rows' share of it times the group size (see :mod:`fedsweep.actors.shard_group`)."""
        batch = collate(examples, self.tokenizer.pad_token_id)
        if self.group is None:
            total, count = self.sft_loss_sum({k: v.to(self.device) for k, v in batch.items()})
            return total / max(count, 1)
        count = int((batch["labels"][:, 1:] != IGNORE).sum())  # the whole batch's tokens, counted on the host
        rows, weight = self.group.rows(len(examples))
        total, _ = self.sft_loss_sum({k: v[rows].to(self.device) for k, v in batch.items()})
        return total * (weight * self.group.size / max(count, 1))

    def _load(self, rank: int, params: Params | None) -> None:
        """Make the adapter of ``rank`` the live one, holding ``params`` unless they are ``None``."""
        self.adapters.activate(rank)
        if params is not None:
            self.adapters.write(params, rank)

    @no_grad
    def loss_on(self, rank: int, params: Params | None, examples: list[Example]) -> float:
        """Mean token loss of ``params`` (``None``: the adapter of ``rank`` as it stands) over ``examples``."""
        self._load(rank, params)
        total, count = 0.0, 0
        for batch in self.batches(examples, self.cfg.eval.batch_size):
            weight = 1.0
            if self.group is not None:  # this process's rows; the sums are added over the group below
                rows, weight = self.group.rows(len(batch["input_ids"]))
                batch = {k: v[rows] for k, v in batch.items()}
            s, c = self.sft_loss_sum(batch)
            total, count = total + weight * float(s), count + weight * c
        if self.group is not None:
            total, count = self.group.sum([total, count], self.device)
        return total / max(count, 1)

    @no_grad
    def loss_sums(self, rank: int | None, params: Params | None, sets: list[list[Example]],
                  rows: Callable[[int, int], contextlib.AbstractContextManager] | None = None) -> list[tuple[float, int]]:
        """For each of ``sets`` (one client's examples each), the summed token loss of ``params`` and
        the token count, computed in shared batches of ``eval.batch_size`` rows across the sets: the
        evaluation of clients packed in one actor who are evaluated with the same adapter. Right
        padding and causal attention make a row's loss independent of the rows beside it, so
        ``sum / count`` equals :meth:`loss_on` of that set alone (up to float rounding).

        ``rows(start, stop)``: a context each batch (rows ``start:stop`` of all sets' rows in order)
        is computed in, instead of loading ``params``: each client's own adapter, stacked
        (:mod:`fedsweep.actors.stacked_evaluation`)."""
        if self.group is not None:
            raise RuntimeError("loss_sums evaluates the clients of an unsharded actor; a sharded client uses loss_on")
        if rows is None:
            self._load(rank, params)
        owners = [i for i, s in enumerate(sets) for _ in s]
        examples = [e for s in sets for e in s]
        totals, counts = [0.0] * len(sets), [0] * len(sets)
        size = self.cfg.eval.batch_size
        for start, batch in zip(range(0, len(examples), size), self.batches(examples, size)):
            stop = min(start + size, len(examples))
            with rows(start, stop) if rows else contextlib.nullcontext():
                sums, n = self.sft_loss_sum(batch, per_row=True)
            for owner, s, c in zip(owners[start:stop], sums.tolist(), n.tolist()):
                totals[owner] += s
                counts[owner] += c
        return list(zip(totals, counts))

    # ----------------------------------------------------------------------- DPO
    def _pref_batch(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        batch = DataCollatorForPreference(pad_token_id=self.tokenizer.pad_token_id)(examples)
        return {k: batch[k].to(self.device) for k in ("input_ids", "attention_mask", "completion_mask")}

    def _logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Σ_t log π(x_t | x_<t) over each row's completion tokens (logits made only there)."""
        plen = batch["completion_mask"].int().argmax(dim=1)
        rows, cols = batch["completion_mask"][:, 1:].nonzero(as_tuple=True)
        if rows.numel() == 0:
            return sequence_logps(self.forward(batch, plen, torch.zeros_like(plen)), batch["input_ids"],
                                  batch["completion_mask"])
        logp = torch.log_softmax(self.logits_at(batch, rows, cols, plen).float(), dim=-1)
        token = logp.gather(-1, batch["input_ids"][:, 1:][rows, cols].unsqueeze(-1)).squeeze(-1)
        return token.new_zeros(batch["input_ids"].shape[0]).index_add(0, rows, token)

    @no_grad
    def reference(self, slot: ClientSlot, split: str) -> torch.Tensor:
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

    def dpo_loss(self, slot: ClientSlot, split: str, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """DPO loss and reward margins of pairs ``idx`` of ``slot``'s ``split`` (Rafailov et al. 2023, eq. 7)."""
        pairs = slot.train_pref if split == "train" else slot.test_pref
        ref = self.reference(slot, split)[idx].to(self.device)
        chosen, rejected = self._logps(self._pref_batch([pairs[i] for i in idx])).chunk(2)
        return dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], self.cfg.train.dpo_beta)

    def dpo_train_loss(self, slot: ClientSlot, idx: list[int]) -> tuple[torch.Tensor, float]:
        """DPO loss of training pairs ``idx`` (with gradients) and their mean reward margin; in a sharded
        client, this process's pairs' share of the loss times the group size, the margin over the group."""
        if self.group is None:
            loss, margin = self.dpo_loss(slot, "train", idx)
            return loss, float(margin.mean())
        rows, weight = self.group.rows(len(idx))
        loss, margin = self.dpo_loss(slot, "train", [idx[i] for i in rows])
        total, count = self.group.sum([weight * float(margin.sum()), weight * len(rows)], self.device)
        return loss * (weight * len(rows) * self.group.size / len(idx)), total / max(count, 1)

    @no_grad
    def dpo_margins(self, slot: ClientSlot, split: str) -> torch.Tensor:
        """Reward margins of every pair of ``slot``'s ``split``."""
        pairs = slot.train_pref if split == "train" else slot.test_pref
        idx, size = list(range(len(pairs))), self.cfg.eval.batch_size
        return torch.cat([self.dpo_loss(slot, split, idx[i:i + size])[1] for i in range(0, len(idx), size)])

    # ------------------------------------------------------------------ training
    def local_steps(self, slot: ClientSlot) -> int:
        """``train.steps``, or ``train.epochs`` over the slot's training examples in batches."""
        tc = self.cfg.train
        return tc.steps or max(1, math.ceil(tc.epochs * len(slot.train_enc) / tc.batch_size))

    def batch_order(self, rnd: int, cid: int, n: int, steps: int) -> torch.Tensor:
        """Indices into ``n`` training examples of client ``cid`` for ``steps`` batches of round ``rnd``:
        shuffled epochs back to back, seeded by (seed, round, client)."""
        return self._epochs(n, steps, derive_seed(self.cfg.seed, rnd, cid))

    def _epochs(self, n: int, steps: int, seed: int) -> torch.Tensor:
        """Shuffled permutations of ``n`` indices back to back, enough for ``steps`` batches."""
        gen = torch.Generator().manual_seed(seed)
        return torch.cat([torch.randperm(n, generator=gen)
                          for _ in range(math.ceil(steps * self.cfg.train.batch_size / n))])

    def extra_stream(self, payload: Payload, rnd: int, cid: int, steps: int) -> tuple[list[Example], torch.Tensor | None, float]:
        """The payload's extra stream for client ``cid``'s ``steps`` of round ``rnd``: its examples, their
        order (shuffled epochs, seeded by seed, round, client) and its weight w (0 without one)."""
        if payload.extra_train and self.cfg.train.objective == "dpo":
            raise ValueError("public pseudo-labels need the sft objective")
        public = self.encode_extra(payload.extra_train)
        if not public:
            return [], None, 0.0
        return public, self._epochs(len(public), steps, derive_seed(self.cfg.seed, rnd, cid, 13)), float(payload.extra_weight)

    def run_steps(self, slot: ClientSlot, rnd: int, steps: int, payload: Payload, params: dict[str, torch.nn.Parameter],
                  loss_hook: Callable[[torch.Tensor], torch.Tensor]) -> StepsResult:
        """``steps`` optimiser steps on ``params`` (the live, trainable adapter tensors of ``slot``).

        Each step's loss is SFT on a batch of the slot's examples (or DPO against the frozen base),
        mixed with the payload's extra stream as (1 − w)·private + w·extra, passed through
        ``loss_hook`` (the method's ``client_loss``); with ``payload.dp`` the private part is DP-SGD."""
        tc, cid = self.cfg.train, slot.cid
        opt = make_optimizer(tc, list(params.values()))
        if slot.opt_state is not None:
            opt.load_state_dict(slot.opt_state)  # moves parked (CPU) state to the parameters' device
        scaler = torch.amp.GradScaler(self.device.type) if tc.autocast == "fp16" else None
        pool, n = slot.train_enc, len(slot.train_enc)
        dp = payload.dp
        if dp and tc.objective == "dpo":
            raise ValueError("DP-SGD needs the sft objective")
        public, porder, extra_w = self.extra_stream(payload, rnd, cid, steps)
        torch.manual_seed(derive_seed(self.cfg.seed, rnd, cid))  # LoRA dropout
        order = self.batch_order(rnd, cid, n, steps)
        out = StepsResult()
        if dp:
            out.dp_rate = min(1.0, tc.batch_size / n)
            dgen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, rnd, cid, 17))
        dpo = tc.objective == "dpo"
        if dpo:
            self.reference(slot, "train")
        self.model.train()
        for step in range(steps):
            idx = order[step * tc.batch_size:(step + 1) * tc.batch_size].tolist()
            pub = [public[i] for i in porder[step * tc.batch_size:(step + 1) * tc.batch_size].tolist()] if public else []
            opt.zero_grad(set_to_none=True)
            if dp:  # DP-SGD on the private stream; the public stream is not private
                noisy, rec_losses = dpsgd.noisy_clipped_gradient(
                    lambda i: self.sft_mean_loss([pool[i]]), dpsgd.poisson_batch(n, out.dp_rate, dgen), params,
                    dp.max_grad_norm, dp.noise_multiplier, tc.batch_size, dgen)
                loss = torch.tensor(float(np.mean(rec_losses)) if rec_losses else 0.0)
                if pub:
                    pub_loss = self.sft_mean_loss(pub)
                    (extra_w * pub_loss).backward()
                    loss = (1 - extra_w) * loss + extra_w * pub_loss.detach()
                for k, p in params.items():
                    g = noisy[k].to(p.dtype) * (1 - extra_w if pub else 1.0)
                    p.grad = g if p.grad is None else p.grad + g
            else:
                if dpo:
                    raw, margin = self.dpo_train_loss(slot, idx)
                    out.margins.append(margin)
                else:
                    raw = self.sft_mean_loss([pool[i] for i in idx])
                    if pub:
                        raw = (1 - extra_w) * raw + extra_w * self.sft_mean_loss(pub)
                loss = loss_hook(raw)
                (scaler.scale(loss) if scaler else loss).backward()
                if self.group is not None:  # the group's gradient of the whole batch, and its loss
                    loss = loss.detach().reshape(1).clone()
                    self.group.average([p.grad for p in params.values() if p.grad is not None] + [loss])
                    loss = loss[0]
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
            out.losses.append(float(loss.detach()))
        self.model.eval()
        out.optimizer_state = opt.state_dict()
        return out

    # ---------------------------------------------------------------- generation
    @no_grad
    def generate(self, prompts: list[str], max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0, with_truncation: bool = False,
                 rows: Callable[[int, int], contextlib.AbstractContextManager] | None = None):
        """Completions of ``prompts`` with the adapter currently loaded (greedy unless ``do_sample``).
        ``with_truncation``: also return, per completion, whether it was cut by ``max_new_tokens``
        (no end-of-sequence token generated). ``rows(start, stop)``: a context each batch of prompts
        ``start:stop`` is generated in (each row with its own client's adapter, stacked)."""
        out, cut = [], []
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if do_sample else {"do_sample": False}
        if do_sample:
            torch.manual_seed(seed)
        for i in range(0, len(prompts), self.cfg.eval.batch_size):
            enc = {k: v.to(self.device) for k, v in
                   encode_prompts_left(self.tokenizer, prompts[i:i + self.cfg.eval.batch_size],
                                       self.cfg.train.max_length, self.system).items()}
            lengths = enc["attention_mask"].sum(dim=1)
            own = rows(i, i + len(enc["input_ids"])) if rows else contextlib.nullcontext()
            with own, self.adapters.positions(prompt_lengths=lengths.cpu(), offsets=(enc["input_ids"].shape[1] - lengths).cpu(),
                                         width=enc["input_ids"].shape[1]), self.autocast():
                gen = self.model.generate(**enc, max_new_tokens=max_new_tokens, **sampling, use_cache=True,
                                          pad_token_id=self.tokenizer.pad_token_id,
                                          eos_token_id=self.tokenizer.eos_token_id)
            new = gen[:, enc["input_ids"].shape[1]:]
            out.extend(self.tokenizer.batch_decode(new, skip_special_tokens=True))
            finished = (new == self.tokenizer.eos_token_id).any(dim=1)
            cut.extend(bool(not f and new.shape[1] >= max_new_tokens) for f in finished.tolist())
        return (out, cut) if with_truncation else out
