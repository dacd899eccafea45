"""``fedsweep bench memory`` and ``fedsweep bench throughput``: one ClientActor, measured in-process.

``memory`` hosts K clients of a config on one base (packed) and, for comparison, up to M clients
each on its own base (separate), runs one round (train + evaluate every client) and records the
device memory: on CUDA ``torch.cuda.max_memory_allocated`` (independent of the planner); on CPU the
tensor bytes that :class:`~fedsweep.models.memory.LiveBytes` sees. The planner's estimate of the
same layout sits beside each measurement.

``throughput`` trains one client for the config's steps and the *same* batches in a plain loop
(transformers + peft + torch.optim, no fedsweep around it): tokens per second of both, the floor
being the plain loop. Repeats alternate the two; medians are reported. With ``--clients 1,10,50``
it instead packs K clients on one actor and trains one round of all of them in groups (the batch
plan of ``train.batch_clients: auto``: one step loop over all their rows) and one at a time (groups
of one) on the same actor and batches, alternating: tokens/s of both, the peak memory of each, and
the real and padding tokens of their forwards.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from fedsweep.engine.base import device_of
from fedsweep.orchestrator.bench.synthetic import machine


def _device(cfg) -> torch.device:
    return device_of(cfg.clients.resources)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _hosted(cfg, clients) -> list[dict]:
    return [{"cid": c.cid, "train": c.train, "test": c.test, "val": c.val} for c in clients]


def model_config(cfg) -> dict:
    """The architecture of ``model.name``: ``configs/models/<name>.json``, else the model's own config.json."""
    import json

    from fedsweep.models import loading
    from fedsweep.models.shapes import architecture

    if loading.is_tiny(cfg.model.name):  # the very config the ClientActor builds the tiny model from
        return loading.tiny_config(loading.tiny_shape(cfg.model), len(loading.tiny_tokenizer())).to_dict()
    arch = architecture(cfg.model)  # configs/models/<name>.json or a local model directory
    if arch is not None:
        return arch
    from pathlib import Path

    return json.loads((Path(loading.resolve(cfg.model.name, cfg.model.cache_dir)) / "config.json").read_text())


def _round(actor, rnd: int, payload) -> float:
    t0 = time.perf_counter()
    for cid in sorted(actor.slots):
        actor.train(rnd, cid, payload)
        actor.evaluate(rnd, cid, payload)
    return time.perf_counter() - t0


def measure_layout(cfg, hosted: list[dict], per_actor: int, rounds: int = 1) -> dict[str, Any]:
    """Actors of ``per_actor`` clients for ``hosted``; device bytes after load and at peak, round seconds."""
    from fedsweep.actors.client import ClientActor
    from fedsweep.algorithms.types import Payload
    from fedsweep.models.memory import LiveBytes

    device = _device(cfg)
    config = cfg.model_copy(update={"clients": cfg.clients.model_copy(update={"clients_per_actor": per_actor})})
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    actors = [ClientActor(config, hosted[i:i + per_actor]) for i in range(0, len(hosted), per_actor)]
    _sync(device)
    startup = time.perf_counter() - t0
    tracker = None
    if device.type == "cuda":
        loaded = torch.cuda.memory_allocated() - start
    else:
        loaded = sum(p.numel() * p.element_size() for a in actors for p in a.model.parameters())
        tracker = LiveBytes(exclude=[p for a in actors for p in a.model.parameters()])
        tracker.__enter__()
    seconds = []
    try:
        for rnd in range(1, rounds + 1):
            seconds.append(sum(_round(a, rnd, Payload()) for a in actors))
            _sync(device)
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    peak = (torch.cuda.max_memory_allocated() - start) if device.type == "cuda" else loaded + tracker.peak
    out = {"actors": len(actors), "clients": len(hosted), "clients_per_actor": per_actor,
           "startup_seconds": startup, "round_seconds": seconds, "loaded_bytes": loaded, "peak_bytes": peak,
           "peak_bytes_per_client": peak / len(hosted)}
    del actors
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_memory(cfg, clients: list[int], separate_max: int = 8, rounds: int = 1,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from fedsweep.models.memory import plan
    from fedsweep.config import validate
    from fedsweep.orchestrator.experiment_data import prepare_clients

    progress = progress or (lambda line: None)
    estimate = plan(cfg, model_config(cfg))
    rows = []
    for k in clients:
        kcfg = validate({**cfg.to_dict(), "clients": {**cfg.to_dict()["clients"], "num_clients": k}})
        data, _ = prepare_clients(kcfg)
        hosted = _hosted(kcfg, data)
        packed = measure_layout(kcfg, hosted, per_actor=k, rounds=rounds)
        packed["planned_peak_bytes"] = estimate.per_actor(k)
        progress(f"K={k} packed: {packed['peak_bytes'] / 2 ** 20:,.0f} MiB peak "
                 f"(planned {packed['planned_peak_bytes'] / 2 ** 20:,.0f}), round {packed['round_seconds'][-1]:.1f} s")
        m = min(k, separate_max)
        separate = measure_layout(kcfg, hosted[:m], per_actor=1, rounds=rounds)
        # in one process the separate bases' transient peaks do not overlap (one client works at a time);
        # as Ray actors each process would hold its own: m × per_actor(1)
        transient = max(estimate.train_step, estimate.evaluation)
        separate["planned_peak_bytes"] = m * (estimate.per_actor(1) - transient) + transient
        separate["planned_bytes_as_separate_processes"] = m * estimate.per_actor(1)
        progress(f"K={k} separate ({m} bases): {separate['peak_bytes_per_client'] / 2 ** 20:,.0f} MiB per client, "
                 f"round {separate['round_seconds'][-1]:.1f} s for {m} clients")
        rows.append({"clients": k, "packed": packed, "separate": separate})
    return {"benchmark": "memory", "algorithm": cfg.algorithm, "device": _device(cfg).type, "model": cfg.model.name,
            "dtype": cfg.model.dtype, "autocast": cfg.train.autocast, "plan": estimate.as_dict(), "rows": rows,
            "config": cfg.to_dict(), "machine": machine(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def plain_loop(cfg, batches: list[dict[str, torch.Tensor]], device: torch.device) -> float:
    """The floor: the same model, LoRA, optimiser and batches in a bare loop; seconds for all steps."""
    from peft import LoraConfig, get_peft_model

    from fedsweep.engine.base import prepare_base
    from fedsweep.engine.text import token_loss_sum
    from fedsweep.models import loading

    tok = loading.load_tokenizer(cfg.model)
    model = prepare_base(loading.load_base_model(cfg.model, cfg.seed, len(tok), str(device)), cfg)
    model = get_peft_model(model, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                             target_modules=list(cfg.lora.target_modules), task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.train.learning_rate)
    amp = loading.torch_dtype(loading.AUTOCAST.get(cfg.train.autocast))
    _sync(device)
    t0 = time.perf_counter()
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        total, count = token_loss_sum(logits, batch["labels"])
        (total / max(count, 1)).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip or 1e9)
        opt.step()
    _sync(device)
    return time.perf_counter() - t0


def bench_throughput(cfg, repeats: int = 3, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Tokens/s of one client's local training in a ClientActor vs the plain loop on the same batches."""
    from fedsweep.actors.client import ClientActor
    from fedsweep.algorithms.types import Payload
    from fedsweep.engine.text import collate
    from fedsweep.orchestrator.experiment_data import prepare_clients

    progress = progress or (lambda line: None)
    device = _device(cfg)
    data, _ = prepare_clients(cfg)
    one = _hosted(cfg, data[:1])
    actor = ClientActor(cfg, one)
    slot = actor.slots[one[0]["cid"]]
    tc = cfg.train
    steps = actor.local_steps(slot.cid)
    order = actor.batch_order(1, slot.cid, steps)[:steps * tc.batch_size].tolist()  # round 1's batches
    batches = [{k: v.to(device) for k, v in collate([slot.train_enc[i] for i in order[i:i + tc.batch_size]],
                                                     actor.tokenizer.pad_token_id).items()}
               for i in range(0, len(order), tc.batch_size)]
    tokens = int(sum(int(b["attention_mask"].sum()) for b in batches))
    actor.train(1, slot.cid, Payload())  # warm-up (kernels, allocator)
    plain_loop(cfg, batches[:2], device)
    ours, floor = [], []
    for rep in range(repeats):
        _sync(device)
        ours.append(actor.train(1, slot.cid, Payload()).metrics["train_seconds"])  # round 1: the batches above
        floor.append(plain_loop(cfg, batches, device))
        progress(f"repeat {rep + 1}: fedsweep {tokens / ours[-1]:,.0f} tok/s, plain loop {tokens / floor[-1]:,.0f} tok/s")
    med_ours, med_floor = statistics.median(ours), statistics.median(floor)
    return {"benchmark": "throughput", "algorithm": cfg.algorithm, "device": device.type, "model": cfg.model.name,
            "dtype": cfg.model.dtype, "autocast": cfg.train.autocast, "steps": steps, "batch_size": tc.batch_size,
            "tokens": tokens, "fedsweep_seconds": ours, "plain_seconds": floor,
            "fedsweep_tokens_per_s": tokens / med_ours, "plain_tokens_per_s": tokens / med_floor,
            "fedsweep_over_plain": med_ours / med_floor, "config": cfg.to_dict(), "machine": machine(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def bench_batched(cfg, clients: list[int], repeats: int = 3,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Per K in ``clients``: one actor of K packed clients, one round of training of all of them,
    in groups (the batch plan of ``auto``) vs one at a time, on the same actor and batches
    (alternating; medians), tokens/s, the forwards' real and padding tokens, and peak bytes (CUDA:
    ``max_memory_allocated``; CPU: the live tensor bytes beyond the base's)."""
    from fedsweep.actors.client import ClientActor
    from fedsweep.algorithms.types import Payload
    from fedsweep.config import validate
    from fedsweep.config.batching import BatchPlan
    from fedsweep.models.memory import LiveBytes
    from fedsweep.orchestrator.experiment_data import prepare_clients

    progress = progress or (lambda line: None)
    device = _device(cfg)
    rows = []
    for k in clients:
        raw = cfg.to_dict()
        raw["clients"] = {**raw["clients"], "num_clients": k, "clients_per_actor": k, "num_actors": "auto"}
        raw["train"] = {**raw["train"], "batch_clients": "auto" if raw["train"]["batch_clients"] in ("off", 1)
                        else raw["train"]["batch_clients"], "batch_reason": None}
        if raw["lora"].get("ranks"):  # per-client ranks, cycled to K clients
            raw["lora"]["ranks"] = [raw["lora"]["ranks"][i % len(raw["lora"]["ranks"])] for i in range(k)]
        if raw["partition"]["scheme"] == "task" and k < len(raw["data"]["tasks"]):
            raw["partition"]["scheme"] = "iid"  # fewer clients than tasks: each holds a mix
        kcfg = validate(raw)
        data, _ = prepare_clients(kcfg)
        actor = ClientActor(kcfg, _hosted(kcfg, data))
        plans = {"batched": actor.batch_plan, "sequential": BatchPlan(1, "one at a time (the comparison)")}
        items = [(cid, 0) for cid in sorted(actor.slots)]
        base = list(actor.model.parameters())

        def once(mode: str, memory: bool = False) -> tuple[float, int, float, int, int]:
            """One round of ``mode``: seconds, peak bytes (on the CPU only with ``memory``: its tracker
            sees every op in Python, so the timed runs go without it), clients per group step, real
            and padding tokens."""
            actor.batch_plan = plans[mode]
            tracker, before = None, 0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            elif memory:
                tracker = LiveBytes(exclude=base)
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
            peak = (torch.cuda.max_memory_allocated() - before) if device.type == "cuda" else (
                tracker.peak if tracker is not None else 0)
            real = int(sum(a.metrics["train_tokens"] for _, a in answers))
            padded = int(sum(a.metrics["train_padded_tokens"] for _, a in answers))
            return seconds, peak, max(a.metrics["batched_clients"] for _, a in answers), real, padded

        # warm-up (kernels, allocator, tokenised streams), with the peak memory of each
        warm = {mode: once(mode, memory=True) for mode in ("batched", "sequential")}
        peaks = {mode: w[1] for mode, w in warm.items()}
        tokens = warm["sequential"][3]
        got: dict[str, list] = {"batched": [], "sequential": []}
        for rep in range(repeats):
            for mode in ("sequential", "batched") if rep % 2 == 0 else ("batched", "sequential"):
                got[mode].append(once(mode))
            progress(f"K={k} repeat {rep + 1}: batched {tokens / got['batched'][-1][0]:,.0f} tok/s, "
                     f"sequential {tokens / got['sequential'][-1][0]:,.0f} tok/s")
        med = {m: statistics.median(v[0] for v in got[m]) for m in got}
        rows.append({"clients": k, "partition": kcfg.partition.scheme, "tokens": tokens,
                     "batched_clients": got["batched"][-1][2],
                     "batched_padded_tokens": got["batched"][-1][4],
                     "sequential_padded_tokens": got["sequential"][-1][4],
                     "batched_padding_share": got["batched"][-1][4] / max(tokens, 1),
                     "sequential_padding_share": got["sequential"][-1][4] / max(tokens, 1),
                     "batched_seconds": [v[0] for v in got["batched"]],
                     "sequential_seconds": [v[0] for v in got["sequential"]],
                     "batched_tokens_per_s": tokens / med["batched"],
                     "sequential_tokens_per_s": tokens / med["sequential"],
                     "speedup": med["sequential"] / med["batched"],
                     "batched_peak_bytes": max([peaks["batched"]] + [v[1] for v in got["batched"]]),
                     "sequential_peak_bytes": max([peaks["sequential"]] + [v[1] for v in got["sequential"]])})
        progress(f"K={k}: batched {rows[-1]['batched_tokens_per_s']:,.0f} tok/s vs sequential "
                 f"{rows[-1]['sequential_tokens_per_s']:,.0f} ({rows[-1]['speedup']:.2f}×), padding "
                 f"{rows[-1]['batched_padding_share']:.1%} vs {rows[-1]['sequential_padding_share']:.1%} of real tokens")
        del actor
        if device.type == "cuda":
            torch.cuda.empty_cache()
    from fedsweep.models.shapes import base_parameters

    arch = model_config(cfg)
    flops = lora_flops_per_token(arch)
    compute = AUTOCAST_NAMES.get(cfg.train.autocast, cfg.model.dtype)
    peak = peak_flops(torch.cuda.get_device_name(), compute, torch.backends.cuda.matmul.allow_tf32) \
        if device.type == "cuda" else None
    for row in rows:
        for mode in ("batched", "sequential"):
            achieved = row[f"{mode}_tokens_per_s"] * flops
            row[f"{mode}_flops_per_s"] = achieved
            row[f"{mode}_mfu"] = achieved / peak if peak else None
        row["batched_peak_bytes_per_client"] = row["batched_peak_bytes"] / row["clients"]
    out = {"benchmark": "throughput_batched", "algorithm": cfg.algorithm, "device": device.type,
           "model": cfg.model.name, "dtype": cfg.model.dtype, "autocast": cfg.train.autocast,
           "steps": cfg.train.steps, "batch_size": cfg.train.batch_size, "base_parameters": base_parameters(arch),
           "decoder_matmul_parameters": flops // 4,
           "model_flops_per_token": flops, "peak_flops_per_s": peak,
           "flops_note": "4 FLOPs per decoder matmul parameter per token (forward 2, backward through the frozen "
                         "base 2; no weight gradients); attention scores, the LoRA factors and the vocabulary "
                         "projection are left out, so MFU is a lower bound",
           "rows": rows, "config": cfg.to_dict(), "machine": machine(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    return out


AUTOCAST_NAMES = {"bf16": "bfloat16", "fp16": "float16"}

PEAK_TFLOPS = (  # dense tensor-core peaks from the vendors' data sheets: (name part, bf16/fp16, tf32, fp32)
    ("H100 PCIe", 756, 378, 51), ("H100 NVL", 835, 418, 60), ("H100", 989, 494, 67), ("H200", 989, 494, 67),
    ("A100", 312, 156, 19.5), ("L40S", 362, 183, 91.6), ("A10G", 70, 35, 31.2),
)


def peak_flops(gpu_name: str, dtype: str, tf32: bool) -> float | None:
    """The GPU's dense peak FLOP/s for matmuls in ``dtype`` (float32: TF32 where ``tf32``), None if unknown."""
    for part, half, tf, single in PEAK_TFLOPS:
        if part in gpu_name:
            tflops = half if dtype in ("bfloat16", "float16") else (tf if tf32 else single)
            return tflops * 1e12
    return None


def lora_flops_per_token(arch: dict) -> int:
    """Training FLOPs per token of LoRA on a frozen base, counted as 4 per decoder matmul parameter:
    2 in the forward, 2 in the backward's input gradients (a frozen weight gets no gradient)."""
    from fedsweep.models.shapes import linear_shapes

    return 4 * arch["num_hidden_layers"] * sum(a * b for a, b in linear_shapes(arch).values())


def write(result: dict[str, Any], name: str, out_dir: str = "results/bench"):
    import json
    from pathlib import Path

    path = Path(out_dir) / f"{result['benchmark']}_{name}_{result['device']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    return path
