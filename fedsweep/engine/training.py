"""Local training of a group of 1..K clients: the one step loop.

A group shares one binding of its clients' adapters (``models.adapters``: K stacked LoRA adapters,
or one client's). Each step takes every still-active client's batch — its private examples, and
the method's extra stream if its payload carries one — lays all their units out into forwards
(``train.forwards``: all in one on a GPU, each client's rows side by side; by length on the CPU,
``engine.rows``), and for each forward computes each unit's loss with its own client's
adapter (``engine.objectives``) and back-propagates that forward's share of the loss::

    L = Σ_k ℓ_k + Σ_k penalty_k(θ_k)

ℓ_k being client k's loss as it would train alone (token-mean SFT, or DPO, with the extra stream
mixed as (1 − w)·private + w·extra) and penalty_k the term the method's ``client_loss`` adds of
k's tensors. The clients' tensors are disjoint, so ∂L/∂θ_k = ∂(ℓ_k + penalty_k)/∂θ_k: every
client gets its solo gradient. Clipping is per client (its own norm) and the optimiser is each
client's own (``engine.optim``), both over the group's (K, P) buffers (``models.flat``): a handful of
calls per step whatever the number of clients and tensors. A client's batch order, extra-stream order and dropout masks are
seeded by (seed, round, client) alone, and a client whose steps are done leaves the group, so a
group's round equals each client's round alone up to float rounding (``tests/test_lockstep.py``).

What cannot share a step (``plan.batching.why_alone``: LoReFT, DP-SGD, sharded clients, 8-bit
AdamW, fp16) runs the same loop in groups of one; DP-SGD's private stream and a sharded client's
row split and gradient average are the parts only a group of one takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from fedsweep.algorithms.tensors import Params
from fedsweep.engine import dp as dpsgd
from fedsweep.engine.objectives import Sft
from fedsweep.engine.optim import group_optimizer
from fedsweep.engine.packing import packed_rows
from fedsweep.engine.rows import MAX_PADDING, buckets
from fedsweep.engine.settings import EngineSettings
from fedsweep.engine.text import Example
from fedsweep.lazy import torch
from fedsweep.models.packing import packing_refusal
from fedsweep.models.stacked_lora import Draw
from fedsweep.models.transfer import tensor_on
from fedsweep import salts
from fedsweep.salts import derive_seed


def epochs(n: int, steps: int, batch_size: int, seed: int) -> torch.Tensor:
    """Shuffled permutations of ``n`` indices back to back, enough for ``steps`` batches."""
    gen = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randperm(n, generator=gen) for _ in range(math.ceil(steps * batch_size / n))])


def batch_order(settings: EngineSettings, rnd: int, cid: int, n: int, steps: int) -> torch.Tensor:
    """Indices into client ``cid``'s ``n`` training examples for ``steps`` batches of round ``rnd``:
    shuffled epochs back to back, seeded by (seed, round, client)."""
    return epochs(n, steps, settings.batch_size, derive_seed(settings.seed, rnd, cid, salts.BATCH_ORDER))


@dataclass
class Job:
    """One client's local training of a round, as the actor prepared it."""

    cid: int
    rnd: int
    rank: int
    steps: int
    start: Params
    """The adapter it starts from (the method's ``client_prepare``)."""
    opt_state: dict | None
    examples: list[Example]
    """Its training examples (SFT)."""
    pairs: list[dict] = field(default_factory=list)
    """Its preference pairs (DPO)."""
    reference: torch.Tensor | None = None
    """The pairs' reference log-probabilities (DPO), (n, 2)."""
    extra: list[Example] = field(default_factory=list)
    """The payload's extra stream (SFT), mixed with weight ``extra_weight``."""
    extra_weight: float = 0.0
    dp: object | None = None
    """The payload's DP-SGD settings (private stream only; groups of one)."""
    loss_hook: Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor] | None = None
    """(raw loss, the client's tensors) -> its loss (the method's ``client_loss``): raw plus a term;
    None: the raw loss (a method that adds nothing)."""


@dataclass
class Trained:
    """What a client's local training produced."""

    params: Params
    losses: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    """DPO reward margins per step (DPO only)."""
    optimizer_state: dict | None = None
    dp_rate: float | None = None
    """DP-SGD's Poisson sampling rate (DP only)."""
    tokens: int = 0
    padded: int = 0
    """Real and padding tokens of its forwards' rows (a shared forward's padding is shared by its rows)."""


@dataclass
class _Stream:
    """One client's units of one step for one objective, with its weight and denominator."""

    owner: int
    items: list
    weight: float
    size: int
    reference: torch.Tensor | None = None
    seed: int = 0


class GroupTraining:
    """The local training of ``jobs`` on ``base`` (``frozen(key)``: tensors a method does not train)."""

    def __init__(self, base, jobs: list[Job], frozen: Callable[[str], bool] = lambda key: False):
        if len(jobs) > 1 and any(j.dp for j in jobs):
            raise ValueError("DP-SGD trains one client at a time (plan.batching.why_alone)")
        self.base, self.jobs = base, jobs
        self.tc = settings = base.settings
        self.objective = settings.objective
        self.binding = base.bind([j.rank for j in jobs], [j.start for j in jobs], lambda key: not frozen(key))
        tensors = self.binding.tensors()
        self.keys = [k for k in tensors if not frozen(k)]  # a client's optimiser state lists them in this order
        for key, t in tensors.items():
            t.requires_grad_(key in self.keys)
        self.stepped = [tensors[k] for k in self.keys]
        self.opt = group_optimizer(settings, {k: tensors[k] for k in self.keys}, self.binding.flat)
        self.opt.load_all([j.opt_state for j in jobs], self._view, self.binding.uniform)
        self.one_forward = self.tc.forwards == "one" or (self.tc.forwards == "auto" and base.device.type == "cuda")
        self.scaler = torch.amp.GradScaler(base.device.type) if self.tc.autocast == "fp16" else None
        # what the scaler unscales and records overflows of (its own step does nothing: lr 0)
        self._proxy = torch.optim.SGD(self.stepped, lr=0.0) if self.scaler else None
        self.group = base.group  # a sharded client's process group (groups of one)
        self.dropout = settings.lora_dropout
        self.pack_tokens = settings.pack_tokens
        if self.pack_tokens:
            why = packing_refusal(settings.objective.name, self.binding.stacked, settings.lora_dropout,
                                  self.group is not None)
            if why:
                raise ValueError(why)

    def _view(self, tensor: torch.Tensor, i: int, k: int) -> torch.Tensor:
        return self.binding.view(tensor, self.keys[i], k)

    # ------------------------------------------------------------------ a step
    def _streams(self, step: int, active: list[int]) -> list[_Stream]:
        """The step's streams of the active clients: private batch, then the extra stream."""
        bs, seed, out = self.tc.batch_size, self.tc.seed, []
        for k in active:
            job = self.jobs[k]
            picks = self.orders[k][step * bs:(step + 1) * bs]
            w = job.extra_weight if job.extra else 0.0
            drop = derive_seed(seed, job.rnd, job.cid, salts.TOKEN_DROPOUT, step)
            if not job.dp:  # (DP-SGD's private batch is drawn by its own path)
                obj, units = self.objective, self.objective.items(job)
                items = [units[i] for i in picks]
                out.append(_Stream(k, items, 1.0 - w, obj.size(items), obj.reference(job, picks), drop))
            if job.extra:
                extra = [job.extra[i] for i in self.extra_orders[k][step * bs:(step + 1) * bs]]
                out.append(_Stream(k, extra, w, Sft.size(extra), seed=drop + 1))
        return out

    def _forwards(self, streams: list[_Stream], losses: torch.Tensor, margins: dict[int, list]) -> None:
        """Every unit of ``streams`` through forwards laid out by length (or packed: ``train.pack_tokens``),
        a backward each; each unit's share of its client's loss added into ``losses`` (by client, detached)."""
        units = [(s, i) for s, stream in enumerate(streams) for i in range(len(stream.items))]
        if self.pack_tokens:  # one forward: packed rows leave no padding to cut by length
            return self._packed_forward(streams, units, losses, margins)
        obj = self.objective
        shapes = [obj.shape(streams[s].items[i]) for s, i in units]
        shard = 1.0
        if self.group is not None:  # this process's share of the rows; one forward (the group's
            mine, weight = self.group.rows(len(units))  # processes must enter the same collectives)
            units, shapes = [units[i] for i in mine], [shapes[i] for i in mine]
            shard, layout = weight * self.group.size, [list(range(len(units)))]
            self._weight = weight
        elif self.one_forward:  # every row in one forward, each client's rows together (``train.forwards``)
            layout = [list(range(len(units)))]
        else:
            layout = buckets(shapes, MAX_PADDING, min_rows=obj.rows_per_unit * self.tc.batch_size)
        per_unit = obj.rows_per_unit
        widths = [max(obj.shape(it).width for it in stream.items) for stream in streams] if self.dropout else []
        for bucket in layout:
            chosen = [units[u] for u in bucket]
            owners = [streams[s].owner for s, _ in chosen for _ in range(per_unit)]
            draws = None
            if self.dropout:  # each row's dropout mask is keyed by its place in its client's batch
                draws = [Draw(streams[s].seed, per_unit * i + row, per_unit * len(streams[s].items), widths[s])
                         for s, i in chosen for row in range(per_unit)]
            items = [streams[s].items[i] for s, i in chosen]
            with self.binding.rows(owners, draws):
                unit_losses, margin = obj.losses(self.base, items, self._reference(streams, chosen))
                self._backward(streams, chosen, unit_losses, margin, losses, margins, shard)
            width = max(shapes[u].width for u in bucket)
            for u in bucket:
                owner = streams[units[u][0]].owner
                self._tokens[owner] += shapes[u].real
                self._padded[owner] += len(shapes[u].lengths) * width - shapes[u].real

    def _packed_forward(self, streams: list[_Stream], chosen: list[tuple[int, int]], losses: torch.Tensor,
                        margins: dict[int, list]) -> None:
        """One forward of ``chosen`` units in padding-free rows (``train.pack_tokens``, ``engine.packing``:
        each client's sequences end to end; an SFT example is one sequence, a DPO pair two), a backward,
        each unit's share of its client's loss added into ``losses`` (and DPO's margins into ``margins``)."""
        obj = self.objective
        sequences, scored, owners = [], [], []
        for s, i in chosen:
            for tokens, where in obj.sequences(streams[s].items[i]):
                sequences.append(tokens), scored.append(where), owners.append(streams[s].owner)
        lengths = [len(t) for t in sequences]
        width, rows = packed_rows(lengths, owners, self.pack_tokens)
        with self.binding.rows([owner for owner, _ in rows]):
            logps = self.base.packed_logps(sequences, scored, [members for _, members in rows], width)
            unit_losses, margin = obj.packed_losses(logps, self._reference(streams, chosen))
            self._backward(streams, chosen, unit_losses, margin, losses, margins)
        for owner, members in rows:
            real = sum(lengths[q] for q in members)
            self._tokens[owner] += real
            self._padded[owner] += width - real

    @staticmethod
    def _reference(streams: list[_Stream], chosen: list[tuple[int, int]]) -> torch.Tensor | None:
        """The reference log-probabilities of ``chosen`` units (DPO), (n, 2); None for SFT."""
        refs = [streams[s].reference for s, _ in chosen]
        return torch.stack([r[i] for r, (_, i) in zip(refs, chosen)]) if refs[0] is not None else None

    def _backward(self, streams: list[_Stream], chosen: list[tuple[int, int]], unit_losses: torch.Tensor,
                  margin: torch.Tensor | None, losses: torch.Tensor, margins: dict[int, list],
                  shard: float = 1.0) -> None:
        """Each of ``chosen`` units' share of its client's loss (its stream's weight over its stream's
        size, times a sharded client's ``shard``), back-propagated as one sum; the shares added into
        ``losses`` by client (detached), each unit's margin into ``margins``."""
        scale = tensor_on([streams[s].weight * shard / max(streams[s].size, 1) for s, _ in chosen],
                          unit_losses.device, unit_losses.dtype)
        shares = unit_losses * scale
        total = shares.sum()
        (self.scaler.scale(total) if self.scaler else total).backward()
        losses.index_add_(0, tensor_on([streams[s].owner for s, _ in chosen], shares.device),
                          shares.detach().to(losses.dtype))
        if margin is not None:
            for (s, _), m in zip(chosen, margin):
                margins.setdefault(streams[s].owner, []).append(m)

    def _penalties(self, active: list[int], step: int) -> torch.Tensor:
        """Each active client's term of ``client_loss`` (its loss hook at a zero raw loss), back-
        propagated; at the first step each hook is checked to add a term (∂hook/∂raw = 1)."""
        device = self.base.device
        out = []
        zero = torch.zeros((), device=device)
        for k in active:
            if self.jobs[k].loss_hook is None:
                out.append(zero)
                continue
            own = self.binding.params(k)
            pen = self.jobs[k].loss_hook(zero, own)
            if step == 0:
                one = self.jobs[k].loss_hook(torch.ones((), device=device), own)
                if abs(float((one - pen).detach()) - 1.0) > 1e-4:
                    raise ValueError("a method's client_loss must return the loss plus a term of the client's "
                                     "tensors (the engine splits a step's loss over several forwards)")
            out.append(pen)
        total = sum(p for p in out if p.requires_grad)
        if torch.is_tensor(total) and total.requires_grad:
            (self.scaler.scale(total) if self.scaler else total).backward()
        return torch.stack([p.detach().double().reshape(()) for p in out])

    def _dp_step(self, job: Job, step: int, extra_loss: torch.Tensor) -> torch.Tensor:
        """DP-SGD's noisy clipped gradient of the private stream (group of one), added to the extra
        stream's gradient already in ``.grad``; returns the client's step loss."""
        bs = self.tc.batch_size
        params = {k: t for k, t in zip(self.keys, self.stepped)}
        kept = {k: (p.grad.clone() if p.grad is not None else None) for k, p in params.items()}

        def record_loss(i: int) -> torch.Tensor:
            draw = Draw(derive_seed(self.tc.seed, job.rnd, job.cid, salts.PREFERENCE_DROPOUT, step, i), 0, 1,
                        len(job.examples[i].input_ids))
            with self.binding.rows([0], [draw]):
                sums, counts = self.base.sft_rows([job.examples[i]])
            return sums[0] / max(counts[0], 1)

        noisy, rec_losses = dpsgd.noisy_clipped_gradient(
            record_loss, dpsgd.poisson_batch(len(job.examples), self.dp_rate, self.dp_gen), params,
            job.dp.max_grad_norm, job.dp.noise_multiplier, bs, self.dp_gen)
        w = job.extra_weight if job.extra else 0.0
        for k, p in params.items():
            g = noisy[k].to(p.dtype) * (1 - w)
            p.grad = g if kept[k] is None else kept[k] + g
        private = float(np.mean(rec_losses)) if rec_losses else 0.0
        return torch.tensor([(1 - w) * private + float(extra_loss[0])])

    # ---------------------------------------------------------------- training
    def run(self) -> list[Trained]:
        """Every job's steps; each client's trained adapter, losses and optimiser state."""
        base, tc, jobs = self.base, self.tc, self.jobs
        why = next((w for w in map(self.objective.refusal, jobs) if w), None)
        if why:
            raise ValueError(why)
        self.orders = [batch_order(tc, j.rnd, j.cid, len(self.objective.items(j)), j.steps).tolist() for j in jobs]
        self.extra_orders = [epochs(len(j.extra), j.steps, tc.batch_size,
                                    derive_seed(tc.seed, j.rnd, j.cid, salts.EXTRA_ORDER)).tolist()
                             if j.extra else None for j in jobs]
        dp = jobs[0].dp if len(jobs) == 1 else None
        if dp:
            self.dp_rate = min(1.0, tc.batch_size / len(jobs[0].examples))
            self.dp_gen = torch.Generator().manual_seed(derive_seed(tc.seed, jobs[0].rnd, jobs[0].cid, salts.DP_NOISE))
        if len(jobs) == 1:  # LoReFT's intervention dropout draws from the global generator
            torch.manual_seed(derive_seed(tc.seed, jobs[0].rnd, jobs[0].cid, salts.INTERVENTION_DROPOUT))
        out = [Trained(params={}) for _ in jobs]
        self._tokens, self._padded = [0] * len(jobs), [0] * len(jobs)
        base.model.train()
        try:
            for step in range(max(j.steps for j in jobs)):
                active = [k for k, j in enumerate(jobs) if j.steps > step]
                self.opt.zero_grad()
                losses = torch.zeros(len(jobs), device=base.device, dtype=torch.float64)
                margins: dict[int, list] = {}
                self._forwards(self._streams(step, active), losses, margins)
                if dp:
                    step_losses = self._dp_step(jobs[0], step, losses.cpu())
                elif any(self.jobs[k].loss_hook is not None for k in active):
                    step_losses = losses[active] + self._penalties(active, step).to(losses.device)
                else:  # no method adds a term: the raw losses are the step's
                    step_losses = losses[active]
                self.opt.gathered()  # the gradients in the group's buffer (DP-SGD sets its own)
                if self.group is not None:  # the group's gradient of the whole batch, and its loss
                    step_losses = step_losses.detach().clone()
                    self.group.average([t.grad for t in self.stepped if t.grad is not None] + [step_losses])
                finite = True
                if self.scaler:  # fp16 (a group of one): unscale, and skip a step whose gradient overflowed
                    self.scaler.unscale_(self._proxy)
                    finite = bool(torch.stack([torch.isfinite(t.grad).all() for t in self.stepped
                                               if t.grad is not None]).all())
                if tc.grad_clip and not dp and finite:
                    self.opt.clip(tc.grad_clip, active)
                if finite:
                    self.opt.step(active)
                if self.scaler:
                    self.scaler.step(self._proxy)  # (a no-op step: the scaler's bookkeeping of the skip)
                    self.scaler.update()
                base.adapters.post_step(active)
                for k, value in zip(active, step_losses.tolist()):  # one sync per step
                    out[k].losses.append(value)
                if margins:
                    for k, value in self._margin_means(margins).items():
                        out[k].margins.append(value)
        finally:
            base.model.eval()
        park = "cpu" if tc.park_on_cpu else None
        params = self.binding.read_all()
        states = self.opt.client_states(self._view, self.binding.uniform, park)
        for k, result in enumerate(out):
            result.params, result.optimizer_state = params[k], states[k]
            result.tokens, result.padded = self._tokens[k], self._padded[k]
            if dp:
                result.dp_rate = self.dp_rate
        return out

    def _margin_means(self, margins: dict[int, list]) -> dict[int, float]:
        """Each client's mean reward margin of the step (one transfer; a sharded client's over its group)."""
        owners = sorted(margins)
        sums = torch.stack([torch.stack(margins[k]).sum() for k in owners]).tolist()
        counts = [float(len(margins[k])) for k in owners]
        if self.group is not None:
            weight = self._weight  # (a process without rows ran one with weight 0)
            total, count = self.group.sum([sums[0] * weight, counts[0] * weight], self.base.device)
            return {owners[0]: total / max(count, 1)}
        return {k: s / c for k, s, c in zip(owners, sums, counts)}

    def close(self) -> None:
        for t in self.binding.tensors().values():
            t.requires_grad_(True)
        self.binding.close()


def train_group(base, jobs: list[Job], frozen: Callable[[str], bool] = lambda key: False) -> list[Trained]:
    """:class:`GroupTraining` of ``jobs`` run, its binding closed."""
    group = GroupTraining(base, jobs, frozen)
    try:
        return group.run()
    finally:
        group.close()
