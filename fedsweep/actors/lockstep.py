"""Lockstep local training: the LoRA clients packed on one actor train together, one batch per step.

Each step is one forward and one backward over every active client's batch on the shared frozen
base (:class:`~fedsweep.models.stacked_lora.StackedLora` computes each row with its own client's
factors). The loss is Σ_k ℓ_k, each client's own loss as its sequential step computes it (token-mean
SFT or DPO, the extra stream mixed as (1 − w)·private + w·extra, then the method's ``client_loss``
on the client's own tensors); the clients' tensors are disjoint, so ∂(Σ ℓ)/∂θ_k = ∂ℓ_k/∂θ_k:
each client gets its solo gradient. Clipping is per client (its own norm) and AdamW is K
independent AdamWs (:mod:`~fedsweep.actors.stacked_adamw`). A client's batch order, extra-stream
order and dropout generator are seeded exactly as its sequential training seeds them, and a client
whose steps are done leaves the batch, so a lockstep round equals the sequential one up to float
rounding (``tests/test_lockstep.py`` checks adapters and AdamW moments after two rounds).

Where it cannot batch, :func:`why_sequential` says why and the actor trains one client at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fedsweep.actors.client_state import ClientSlot
from fedsweep.actors.objectives import dpo_loss
from fedsweep.actors.stacked_adamw import StackedAdamW, clip_per_client
from fedsweep.actors.text import IGNORE, Example, collate
from fedsweep.actors.trainer import StepsResult, Trainer, derive_seed
from fedsweep.algorithms.tensors import Params
from fedsweep.algorithms.types import Payload
from fedsweep.lazy import torch
from fedsweep.models.stacked_lora import RowGroup, StackedLora


@dataclass
class Job:
    """One client's local training of a round, prepared by the actor."""

    slot: ClientSlot
    rnd: int
    steps: int
    payload: Payload
    start: Params
    """The adapter it starts from (the method's ``client_prepare``)."""
    loss_hook: Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
    """(raw loss, the client's trainable tensors) -> its loss (the method's ``client_loss``)."""


def why_sequential(trainer: Trainer, payload: Payload | None = None) -> str | None:
    """Why clients of this actor (with ``payload``) train one at a time; None where they can batch."""
    reason = trainer.cfg.sequential_reason()
    if reason is None and trainer.group is not None:
        reason = "a sharded client trains alone"
    if reason is None and payload is not None and payload.dp:
        reason = "DP-SGD clips per sample"
    return reason


def chunk_size(trainer: Trainer, n: int) -> int:
    """Clients per lockstep batch: ``train.batch_clients`` (a number caps it; ``auto``: on a GPU the
    most the memory planner fits beside this actor's base, :meth:`MemoryPlan.batch_limit`; on the
    CPU all of them)."""
    setting = trainer.cfg.train.batch_clients
    if setting == "off":
        return n
    if setting == "auto":
        return min(n, trainer.lockstep_limit(n))
    return max(1, min(n, int(setting)))


def lockstep_chunks(trainer: Trainer, items: list, key: Callable) -> list[list]:
    """``items`` (clients, with what they need) grouped by ``key(item)`` (one frozen base version per
    group), each group cut into chunks of :func:`chunk_size`; only chunks of two or more are kept (a
    client left alone takes the one-at-a-time path)."""
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    out = []
    for group in groups.values():
        size = chunk_size(trainer, len(group))
        out += [group[i:i + size] for i in range(0, len(group), size) if len(group[i:i + size]) > 1]
    return out


def _padded(batches: list[dict[str, torch.Tensor]], pads: dict[str, int]) -> dict[str, torch.Tensor]:
    """Right-pad each batch to the widest and stack their rows (``pads``: the fill per key)."""
    width = max(b["input_ids"].shape[1] for b in batches)
    out = {}
    for key, fill in pads.items():
        out[key] = torch.cat([torch.nn.functional.pad(b[key], (0, width - b[key].shape[1]), value=fill)
                              for b in batches])
    return out


class Lockstep:
    """The lockstep training of ``jobs`` on ``trainer``'s model (``frozen``: keys not trained)."""

    def __init__(self, trainer: Trainer, jobs: list[Job], frozen: Callable[[str], bool]):
        self.trainer, self.jobs = trainer, jobs
        cfg = trainer.cfg
        live = trainer.adapters.activate(jobs[0].slot.rank)
        sample = next(iter(live.values()))
        self.stack = StackedLora(trainer.model, [j.slot.rank for j in jobs], cfg.lora.alpha, cfg.lora.dropout,
                                 sample.device, sample.dtype)
        self.tensors = tensors = self.stack.tensors()
        # each client's optimiser state lists its trainable tensors in its live adapter's order
        self.keys = [k for k in live if not frozen(k)]
        for key, t in tensors.items():
            t.requires_grad_(key in self.keys)
        for k, job in enumerate(jobs):
            self.stack.write(k, job.start)
        tc = cfg.train
        self.opt = StackedAdamW([tensors[key] for key in self.keys], tc.learning_rate, tc.weight_decay)
        for k, job in enumerate(jobs):
            self.opt.load(k, job.slot.opt_state, self._view)
        self.groups = torch.optim.AdamW([torch.zeros(1) for _ in self.keys], lr=tc.learning_rate,
                                        weight_decay=tc.weight_decay).state_dict()["param_groups"]

    def _view(self, tensor: torch.Tensor, i: int, k: int) -> torch.Tensor:
        return self.stack.view(tensor, self.keys[i], k)

    # ------------------------------------------------------------------ losses
    def _sft_means(self, groups: list[tuple[int, list[Example]]]) -> dict[int, torch.Tensor]:
        """Each client's token-mean SFT loss over its examples, all clients' rows in one forward."""
        t = self.trainer
        batches = [collate(examples, t.tokenizer.pad_token_id) for _, examples in groups]
        rows = [RowGroup(k, len(ex), b["input_ids"].shape[1]) for (k, ex), b in zip(groups, batches)]
        batch = _padded(batches, {"input_ids": t.tokenizer.pad_token_id, "attention_mask": 0, "labels": IGNORE})
        counts = (batch["labels"][:, 1:] != IGNORE).sum(dim=1).tolist()  # on the host: no device sync per client
        with self.stack.rows(rows):
            sums, _ = t.sft_loss_sum({k: v.to(t.device) for k, v in batch.items()}, per_row=True)
        out, start = {}, 0
        for g in rows:
            out[g.index] = sums[start:start + g.count].sum() / max(sum(counts[start:start + g.count]), 1)
            start += g.count
        return out

    def _dpo(self, groups: list[tuple[int, list[int]]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each client's DPO loss and reward margins on its training pairs ``idx``, in one forward."""
        t = self.trainer
        batches = [t._pref_batch([self.jobs[k].slot.train_pref[i] for i in idx]) for k, idx in groups]
        rows = [RowGroup(k, 2 * len(idx), b["input_ids"].shape[1]) for (k, idx), b in zip(groups, batches)]
        batch = _padded(batches, {"input_ids": t.tokenizer.pad_token_id, "attention_mask": 0, "completion_mask": 0})
        with self.stack.rows(rows):
            logps = t._logps(batch)
        out, start = {}, 0
        for (k, idx), g in zip(groups, rows):
            chosen, rejected = logps[start:start + g.count].chunk(2)
            ref = t.reference(self.jobs[k].slot, "train")[idx].to(t.device)
            out[k] = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], t.cfg.train.dpo_beta)
            start += g.count
        return out

    # ---------------------------------------------------------------- training
    def run(self) -> list[StepsResult]:
        """Every job's steps; then each client's trained adapter is :meth:`read` and its optimiser state in
        the result."""
        t, tc, jobs = self.trainer, self.trainer.cfg.train, self.jobs
        dpo = tc.objective == "dpo"
        bs = tc.batch_size
        orders, publics, porders, weights = [], [], [], []
        for job in jobs:
            slot = job.slot
            public, porder, weight = t.extra_stream(job.payload, job.rnd, slot.cid, job.steps)
            publics.append(public)
            porders.append(porder)
            weights.append(weight)
            orders.append(t.batch_order(job.rnd, slot.cid, len(slot.train_enc), job.steps))
            if dpo:
                t.reference(slot, "train")
        generators = [torch.Generator().manual_seed(derive_seed(t.cfg.seed, j.rnd, j.slot.cid)) for j in jobs]
        out = [StepsResult() for _ in jobs]
        self.stack.attach(generators)
        t.model.train()
        try:
            for step in range(max(j.steps for j in jobs)):
                active = [k for k, j in enumerate(jobs) if j.steps > step]
                idx = {k: orders[k][step * bs:(step + 1) * bs].tolist() for k in active}
                self.opt.zero_grad()
                if dpo:
                    scored = self._dpo([(k, idx[k]) for k in active])
                    raw = {k: loss for k, (loss, _) in scored.items()}
                    margins = torch.stack([scored[k][1].detach().mean() for k in active]).tolist()  # one sync
                    for k, margin in zip(active, margins):
                        out[k].margins.append(margin)
                else:
                    raw = self._sft_means([(k, [jobs[k].slot.train_enc[i] for i in idx[k]]) for k in active])
                    mixed = [k for k in active if publics[k]]
                    if mixed:  # a second forward: each client draws its dropout masks stream by stream
                        pub = self._sft_means([(k, [publics[k][i] for i in
                                                    porders[k][step * bs:(step + 1) * bs].tolist()]) for k in mixed])
                        for k in mixed:
                            raw[k] = (1 - weights[k]) * raw[k] + weights[k] * pub[k]
                losses = {}
                for k in active:
                    own = {key: self.stack.view(self.tensors[key], key, k) for key in self.keys}
                    losses[k] = jobs[k].loss_hook(raw[k], own)
                sum(losses.values()).backward()
                if tc.grad_clip:
                    clip_per_client([p.grad for p in self.opt.params], self._view, active, tc.grad_clip)
                self.opt.step(active)
                for k, loss in zip(active, torch.stack([losses[k].detach() for k in active]).tolist()):  # one sync
                    out[k].losses.append(loss)
        finally:
            t.model.eval()
            self.stack.detach()
        park = "cpu" if t.cfg.clients.park == "cpu" else None
        for k, result in enumerate(out):
            result.optimizer_state = self.opt.state_dict(k, self._view, self.groups, park)
        return out

    def read(self, k: int) -> Params:
        """Client ``k``'s trained adapter (CPU copies, as ``Trainer``'s adapters read)."""
        return self.stack.read(k)
