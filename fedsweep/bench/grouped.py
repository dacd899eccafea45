"""``fedsweep bench throughput --clients K,...``: K packed clients trained as one group, against one
at a time and against the ceiling; ``--ops``: the operator calls of the same rounds.

Per K, one actor hosts K clients (in-process) and trains one round of all of them three ways on the
same batches, alternating, medians reported:

- **grouped**: the batch plan of ``train.batch_clients: auto`` (one step loop over all their rows);
- **one at a time**: groups of one on the same actor;
- **bare**: the ceiling, a bare transformers + peft loop (one LoRA adapter, ``torch.optim.AdamW``,
  the same precision) over the same rows: at each step every client's batch of that step as one
  batch. Grouping K adapters on one base costs under 1 % more FLOPs than one adapter on the same
  rows, so the bare loop is what the grouped step can reach;
- with ``padding_free``, **bare padding-free**: the same bare loop over the same sequences packed into rows
  without padding (``bench.padding_free``), the **careful** bare loop (packed rows, scored logits only,
  fused AdamW, TF32 for fp32), and **grouped packed**: the grouped step with its own padding-free rows
  (``train.pack_tokens`` = the bare loop's row width, ``engine.packing``) on the same actor, where the
  config can pack (SFT or DPO with LoRA, no dropout): the setting's GPU default is decided by this row.

The timed rounds run with the heap frozen after the warm-up (``actors.heap.frozen_heap``), as a
client actor's process is after construction: otherwise a full collection of the ~500,000 objects
of torch, transformers and the model (0.2–0.3 s) lands in whichever round crosses its threshold.

``--ops`` counts instead of timing (``bench.ops``): per K, a round of the config's S steps and a round
of 2S steps under ``torch.profiler``; the step's calls are their difference over S, the round's
set-up (payload in, optimiser state, results out) the rest; and the method's whole round on the actor
(``bench.method_round``: its preparation, training, upload work and evaluation, ``round_model_aten_calls``;
its host work apart, ``round_host_aten_calls``).
"""

from __future__ import annotations

from fedsweep.bench.one_actor import packed_config

import statistics
import time
from typing import Any, Callable

import torch

from fedsweep.actors.heap import frozen_heap
from fedsweep.bench.actor import BareLoop, _device, _hosted, _sync, lora_flops_per_token, model_config, peak_flops
from fedsweep.bench.synthetic import machine
from fedsweep.models.loading import AUTOCAST

MODES = {"grouped": "batched", "sequential": "sequential", "bare": "bare", "bare_padding_free": "bare_padding_free",
         "bare_careful": "bare_careful", "grouped_packed": "batched_packed"}
"""Each timed mode, in the order its first repeat runs, and the prefix of its fields in a JSON row."""


def packed_actor(cfg, k: int):
    """A ClientActor (in this process) hosting ``k`` clients of ``cfg`` (:func:`packed_config`)."""
    from fedsweep.actors.client import ClientActor
    from fedsweep.orchestrator.experiment_data import prepare_clients

    from fedsweep.plan.resolve import for_actor

    kcfg = packed_config(cfg, k)
    data, _ = prepare_clients(kcfg)
    return ClientActor(for_actor(kcfg, k, _device(kcfg).type), _hosted(kcfg, data))


def group_batches(actor, rnd: int) -> list[dict[str, torch.Tensor]]:
    """The rows of each step of round ``rnd``'s group step as one batch: every client still training
    at that step contributes its batch of that step (its own batch order), on the actor's device."""
    from fedsweep.engine.text import collate

    bs = actor.cfg.train.batch_size
    steps = {cid: actor.local_steps(cid) for cid in sorted(actor.slots)}
    orders = {cid: actor.batch_order(rnd, cid, n).tolist() for cid, n in steps.items()}
    out = []
    for step in range(max(steps.values())):
        rows = [actor.slots[cid].train_enc[i] for cid, n in steps.items() if step < n
                for i in orders[cid][step * bs:(step + 1) * bs]]
        out.append({key: v.to(actor.device) for key, v in collate(rows, actor.tokenizer.pad_token_id).items()})
    return out


def _round(actor, plan, items, device, memory: bool = False, pack_tokens: int | None = None) -> dict[str, float]:
    """One round of training of ``items`` under batch ``plan`` (``pack_tokens``: in padding-free rows of
    at most that width, else as the config says): seconds, peak bytes (CUDA; on the CPU only with ``memory``:
    its tracker sees every op in Python, so timed runs go without it), clients per group step, real and
    padding tokens."""
    import dataclasses

    actor.batch_plan = plan
    settings = actor.base.settings
    if pack_tokens:
        actor.base.settings = dataclasses.replace(settings, pack_tokens=pack_tokens)
    try:
        return _timed_round(actor, items, device, memory)
    finally:
        actor.base.settings = settings


def _timed_round(actor, items, device, memory: bool) -> dict[str, float]:
    """:func:`_round`'s measurement under the actor's settings as they are."""
    from fedsweep.algorithms.types import Payload
    from fedsweep.models.memory import LiveBytes

    tracker, before = None, 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    elif memory:
        tracker = LiveBytes(exclude=list(actor.model.parameters()))
        tracker.__enter__()
    _sync(device)
    t0 = time.perf_counter()
    try:
        _, answers = actor.train_many(1, items, Payload())
        _sync(device)
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    seconds = time.perf_counter() - t0
    bad = [a for _, a in answers if isinstance(a, str)]
    if bad:
        raise RuntimeError(f"bench throughput: a client's training failed: {bad[0]}")
    peak = (torch.cuda.max_memory_allocated() - before) if device.type == "cuda" else (tracker.peak if tracker else 0)
    metric = lambda name: sum(a.metrics[name] for _, a in answers)  # noqa: E731
    return {"seconds": seconds, "peak": peak, "clients": max(a.metrics["batched_clients"] for _, a in answers),
            "real": int(metric("train_tokens")), "padded": int(metric("train_padded_tokens"))}


def _bare(loop: BareLoop, batches, device) -> dict[str, float]:
    """The bare loop over ``batches``: seconds and peak bytes (CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    seconds = loop.run(batches)
    return {"seconds": seconds, "peak": torch.cuda.max_memory_allocated() - before if device.type == "cuda" else 0}


def measure_k(cfg, k: int, repeats: int, progress: Callable[[str], None], sequential: bool = True,
              padding_free: bool = False) -> dict[str, Any]:
    """Grouped, one at a time (unless not ``sequential``), bare and (with ``padding_free``) bare
    padding-free for ``k`` clients: a warm-up of each (with its peak memory), then ``repeats``
    alternating rounds; one row of the result (a mode not measured has ``None`` in its fields)."""
    from fedsweep.config.schema import BatchPlan
    from fedsweep.bench.padding_free import ROW_TOKENS, cells, pack_batch

    actor = packed_actor(cfg, k)
    device = actor.device
    items = [(cid, 0) for cid in sorted(actor.slots)]
    plans = {"grouped": actor.batch_plan, "sequential": BatchPlan(1, "one at a time (the comparison)")}
    batches = group_batches(actor, 1)
    rows_padding_free = [pack_batch(b, actor.tokenizer.pad_token_id) for b in batches] if padding_free else []
    bare = BareLoop(actor.cfg, device)
    careful = BareLoop(actor.cfg, device, careful=True) if padding_free else None
    run = {"grouped": lambda memory=False: _round(actor, plans["grouped"], items, device, memory),
           "sequential": lambda memory=False: _round(actor, plans["sequential"], items, device, memory),
           "bare": lambda memory=False: _bare(bare, batches, device),
           "bare_padding_free": lambda memory=False: _bare(bare, rows_padding_free, device),
           "bare_careful": lambda memory=False: _bare(careful, rows_padding_free, device),
           "grouped_packed": lambda memory=False: _round(actor, plans["grouped"], items, device, memory, ROW_TOKENS)}
    can_pack = padding_free and actor.cfg.packing_refusal() is None
    modes = tuple(m for m in MODES if (sequential or m != "sequential")
                  and (padding_free or m not in ("bare_padding_free", "bare_careful"))
                  and (can_pack or m != "grouped_packed"))
    warm = {mode: run[mode](memory=True) for mode in modes}
    tokens = warm["grouped"]["real"]
    bare_tokens = int(sum(int(b["attention_mask"].sum()) for b in batches))
    if bare_tokens != tokens:
        raise RuntimeError(f"bench throughput: the bare loop's rows hold {bare_tokens} tokens, the round's {tokens}")
    got: dict[str, list] = {mode: [] for mode in modes}
    with frozen_heap():  # (as an actor's process is after construction: no full collection walks the model's objects)
        for rep in range(repeats):
            for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:  # each mode first in turn
                got[mode].append(run[mode]())
            progress(f"K={k} repeat {rep + 1}: " + ", ".join(f"{m} {tokens / got[m][-1]['seconds']:,.0f} tok/s" for m in modes))
    med = {m: statistics.median(v["seconds"] for v in got[m]) for m in modes}
    peak = {m: max([warm[m]["peak"]] + [v["peak"] for v in got[m]]) for m in modes}
    last = {m: got[m][-1] for m in modes}
    row = {"clients": k, "partition": actor.cfg.partition.scheme, "tokens": tokens,
           "batched_clients": last["grouped"]["clients"], "forwards": actor.cfg.train.forwards,
           "pack_tokens": actor.cfg.train.pack_tokens,
           "bare_padded_tokens": cells(batches) - tokens,
           "grouped_over_bare": med["bare"] / med["grouped"],
           "speedup": med["sequential"] / med["grouped"] if sequential else None}
    for mode, key in MODES.items():
        seen = mode in modes
        row[f"{key}_seconds"] = [v["seconds"] for v in got[mode]] if seen else []
        row[f"{key}_tokens_per_s"] = tokens / med[mode] if seen else None
        row[f"{key}_peak_bytes"] = peak[mode] if seen else None
        if mode not in ("bare", "bare_padding_free", "bare_careful"):  # (the engine's modes count their padding)
            row[f"{key}_padded_tokens"] = last[mode]["padded"] if seen else None
            row[f"{key}_padding_share"] = last[mode]["padded"] / max(tokens, 1) if seen else None
    if padding_free:
        row["bare_padding_free_padded_tokens"] = cells(rows_padding_free) - tokens
        row["bare_padding_free_rows"] = [int(b["input_ids"].shape[0]) for b in rows_padding_free]
        row["bare_padding_free_over_bare"] = med["bare"] / med["bare_padding_free"]
        # the ceiling a careful user's loop sets: packed rows, scored logits only, fused AdamW, TF32 for fp32
        row["grouped_over_careful"] = med["bare_careful"] / med["grouped"]
        if can_pack:  # the engine's own padding-free rows, against the same ceilings
            row["grouped_packed_over_careful"] = med["bare_careful"] / med["grouped_packed"]
            row["grouped_packed_over_grouped"] = med["grouped"] / med["grouped_packed"]
            row["pack_tokens_measured"] = ROW_TOKENS
        careful.close()
    bare.close()
    del actor
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def bench_batched(cfg, clients: list[int], repeats: int = 3, progress: Callable[[str], None] | None = None,
                  sequential_max: int | None = None, padding_free: bool = False) -> dict[str, Any]:
    """Per K in ``clients``: :func:`measure_k` (one at a time only for K ≤ ``sequential_max`` where given:
    50 clients one at a time take minutes on a GPU and are not the ceiling; the bare loop without padding
    too with ``padding_free``), with FLOP/s and MFU of each mode."""
    from fedsweep.models.shapes import base_parameters

    progress = progress or (lambda line: None)
    device = _device(cfg)
    rows = [measure_k(cfg, k, repeats, progress, sequential_max is None or k <= sequential_max, padding_free)
            for k in clients]
    arch = model_config(cfg)
    flops = lora_flops_per_token(arch)
    compute = AUTOCAST.get(cfg.train.autocast, cfg.model.dtype)
    peak = peak_flops(torch.cuda.get_device_name(), compute, torch.backends.cuda.matmul.allow_tf32) \
        if device.type == "cuda" else None
    for row in rows:
        for mode in MODES.values():
            rate = row[f"{mode}_tokens_per_s"]
            row[f"{mode}_flops_per_s"] = rate * flops if rate is not None else None
            row[f"{mode}_mfu"] = rate * flops / peak if peak and rate is not None else None
        row["batched_peak_bytes_per_client"] = row["batched_peak_bytes"] / row["clients"]
    out = {"benchmark": "throughput_batched", "algorithm": cfg.algorithm, "device": device.type,
           "model": cfg.model.name, "dtype": cfg.model.dtype, "autocast": cfg.train.autocast,
           "steps": cfg.train.steps, "batch_size": cfg.train.batch_size, "base_parameters": base_parameters(arch),
           "decoder_matmul_parameters": flops // 4, "model_flops_per_token": flops, "peak_flops_per_s": peak,
           "flops_note": "4 FLOPs per decoder matmul parameter per token (forward 2, backward through the frozen "
                         "base 2; no weight gradients); attention scores, the LoRA factors and the vocabulary "
                         "projection are left out, so MFU is a lower bound",
           "bare_note": "the bare loop: transformers + peft, one LoRA adapter, torch.optim.AdamW, the same precision, "
                        "each step's rows of all clients as one batch (full logits, as ten lines of a user's loop)",
           "bare_padding_free_note": "bare_padding_free (--padding-free): the same loop over the same sequences "
                               "packed into rows of 512 tokens (or the batch's width if more) by first-fit "
                               "decreasing, positions from 0 per sequence, block-diagonal attention through a "
                               "mask, no KV cache object; a measurement, not a training mode",
           "rows": rows, "config": cfg.to_dict(), "machine": machine(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    return out


def count_round(actor, rnd: int, scale: int) -> dict[str, Any]:
    """The operator calls of round ``rnd`` of every client of ``actor`` as one group, its steps × ``scale``."""
    from fedsweep.algorithms.types import Payload
    from fedsweep.bench.ops import count_ops

    items = [(cid, 0) for cid in sorted(actor.slots)]
    return count_ops(lambda: actor.train_many(rnd, items, Payload(steps_scale=scale)))


def ops_of(actor) -> dict[str, Any]:
    """Operator calls of a round of the actor's clients as one group: the round, a step, the set-up."""
    count_round(actor, 1, 1)  # warm-up: tokenised data, optimiser state
    steps = max(actor.local_steps(cid) for cid in actor.slots)
    once, twice = count_round(actor, 2, 1), count_round(actor, 2, 2)  # the same round: the same batches first
    out = {"steps": steps}
    for kind in ("aten_calls", "compute_calls"):
        step = (twice[kind] - once[kind]) / steps
        out[f"round_{kind}"] = once[kind]
        out[f"step_{kind}"] = step
        out[f"setup_{kind}"] = once[kind] - steps * step
    out["top_calls"], out["top_compute_calls"] = once["top_calls"], once["top_compute_calls"]
    evaluation = eval_ops_of(actor)
    out.update({f"round_eval_{kind}": evaluation[kind] for kind in ("aten_calls", "compute_calls")})
    out["top_eval_calls"] = evaluation["top_calls"]
    if actor.device.type == "cuda":
        out["gpu"] = gpu_round_profile(actor)
    return out


def eval_ops_of(actor) -> dict[str, Any]:
    """Operator calls of a round's evaluation of the actor's clients with one global model (one
    evaluation group, ``ClientActor.evaluate_many``), after a warm-up evaluation."""
    from fedsweep.algorithms.types import Payload
    from fedsweep.bench.ops import count_ops

    groups = [(sorted(actor.slots), Payload(params=actor.initial_params()))]
    actor.evaluate_many(1, groups)
    return count_ops(lambda: actor.evaluate_many(2, groups))


def gpu_round_profile(actor) -> dict[str, Any]:
    """On a GPU: a round of the actor's clients as one group (:func:`_round`) and the bare loop over
    the same rows, each timed unprofiled (median of 3 after a warm-up), then once under the profiler
    with CUDA activity (``bench.ops.profile_kernels``); ``busy_share`` is the kernels' device time
    over the unprofiled wall time (the share of the round the GPU computes)."""
    from fedsweep.bench.ops import profile_kernels

    items = [(cid, 0) for cid in sorted(actor.slots)]
    bare = BareLoop(actor.cfg, actor.device)
    batches = group_batches(actor, 1)
    work = {"grouped": lambda: _round(actor, actor.batch_plan, items, actor.device)["seconds"],
            "bare": lambda: bare.run(batches)}
    out = {}
    for name, job in work.items():
        job()  # warm-up
        with frozen_heap():
            wall = statistics.median(job() for _ in range(3))
        prof = profile_kernels(job)
        out[name] = {"round_seconds": wall, "busy_share": prof["kernel_seconds"] / wall, **prof}
    bare.close()
    return out


def bench_ops(cfg, clients: list[int], progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Per K in ``clients`` (and K = 1, the reference): :func:`ops_of` a packed actor, with each count
    over K = 1's."""
    progress = progress or (lambda line: None)
    rows = []
    for k in sorted(set(clients) | {1}):
        actor = packed_actor(cfg, k)
        rows.append({"clients": k, "forwards": actor.cfg.train.forwards, **ops_of(actor)})
        progress(f"K={k}: a round {rows[-1]['round_aten_calls']:,} aten calls "
                 f"({rows[-1]['round_compute_calls']:,} compute), a step {rows[-1]['step_aten_calls']:,.0f}")
        del actor
    from fedsweep.bench.method_round import bench_method_ops

    for row, method in zip(rows, bench_method_ops(cfg, [r["clients"] for r in rows], progress)):  # (K = 1 first in both)
        row.update({k: v for k, v in method.items() if k != "clients"})
    one = rows[0]
    for row in rows:
        for kind in ("round_aten_calls", "round_compute_calls", "step_aten_calls", "step_compute_calls"):
            row[f"{kind}_over_one"] = row[kind] / max(one[kind], 1)
    return {"benchmark": "throughput_ops", "algorithm": cfg.algorithm, "device": _device(cfg).type,
            "model": cfg.model.name, "steps": cfg.train.steps, "batch_size": cfg.train.batch_size, "rows": rows,
            "config": cfg.to_dict(), "machine": machine(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
