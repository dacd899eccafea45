"""``fedsweep bench memory`` and ``fedsweep bench throughput``: one ClientActor, measured in-process.

``memory`` hosts K clients of a config on one base (packed) and, for comparison, up to M clients
each on its own base (separate), runs one round (train + evaluate every client) and records the
device memory: on CUDA ``torch.cuda.max_memory_allocated`` (independent of the planner); on CPU the
tensor bytes that :class:`~fedsweep.models.memory.LiveBytes` sees. The planner's estimate of the
same layout sits beside each measurement.

``throughput`` trains one client for the config's steps and the *same* batches in a plain loop
(transformers + peft + torch.optim, no fedsweep around it): tokens per second of both, the floor
being the plain loop. Repeats alternate the two; medians are reported. With ``--clients 1,10,50``
(K clients on one actor, grouped against one at a time and the bare loop on the same rows) and
``--ops``: ``bench.grouped``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from fedsweep.bench.synthetic import machine
from fedsweep.engine.base import device_of
from fedsweep.plan.resolve import for_actor


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
    config = for_actor(config, per_actor, device.type)
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
    from fedsweep.plan.memory import plan
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


class BareLoop:
    """The floor and the ceiling: the same model, LoRA, optimiser and precision in a bare
    transformers + peft loop (one adapter, ``torch.optim.AdamW``, full logits and a token-mean loss,
    clipping as configured), built once; :meth:`run` times its steps over given batches.

    ``careful``: the loop a careful user writes for speed: logits only at the positions whose
    prediction is scored (the vocabulary projection of the rest is never computed), AdamW's fused
    kernel on a GPU, TF32 matrix products where the model computes in float32 on a GPU that has them;
    given packed rows (``bench.padding_free``) it is the ceiling a grouped step is measured against."""

    def __init__(self, cfg, device: torch.device, careful: bool = False):
        from peft import LoraConfig, get_peft_model

        from fedsweep.actors.engine_setup import prepare_base
        from fedsweep.models import loading

        tok = loading.load_tokenizer(cfg.model)
        model = prepare_base(loading.load_base_model(cfg.model, cfg.seed, len(tok), str(device)), cfg)
        self.model = get_peft_model(model, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                                      target_modules=list(cfg.lora.target_modules),
                                                      task_type="CAUSAL_LM"))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        fused = {"fused": True} if careful and device.type == "cuda" else {}
        self.opt = torch.optim.AdamW(self.params, lr=cfg.train.learning_rate, **fused)
        self.amp = loading.torch_dtype(loading.AUTOCAST.get(cfg.train.autocast))
        self.clip = cfg.train.grad_clip or 1e9
        self.device = device
        self.careful = careful
        self.tf32 = careful and device.type == "cuda" and self.amp is None and cfg.model.dtype == "float32"

    def run(self, batches: list[dict[str, torch.Tensor]]) -> float:
        """Seconds for one step per batch (right-padded with an attention mask, or packed with position
        ids: ``bench.padding_free``)."""
        from fedsweep.engine.text import token_loss_sum

        device = self.device
        self.model.train()
        was_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = was_tf32 or self.tf32
        _sync(device)
        t0 = time.perf_counter()
        try:
            for batch in batches:
                self.opt.zero_grad(set_to_none=True)
                # packed rows: transformers finds their sequences from the positions only without a mask or a cache
                rows = ({"position_ids": batch["position_ids"], "use_cache": False} if "position_ids" in batch
                        else {"attention_mask": batch["attention_mask"], **({"use_cache": False} if self.careful else {})})
                with torch.autocast(device.type, dtype=self.amp, enabled=self.amp is not None):
                    if self.careful:
                        loss = self._scored_loss(batch, rows)
                    else:
                        total, count = token_loss_sum(self.model(input_ids=batch["input_ids"], **rows).logits,
                                                      batch["labels"])
                        loss = total / max(count, 1)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params, self.clip)
                self.opt.step()
            _sync(device)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = was_tf32
        return time.perf_counter() - t0

    def _scored_loss(self, batch, rows) -> torch.Tensor:
        """The token-mean loss with the vocabulary projection only at the positions that predict a
        supervised token (a pre-hook gathers their hidden states)."""
        from fedsweep.engine.text import IGNORE

        labels = batch["labels"]
        where = (labels[:, 1:] != IGNORE).nonzero(as_tuple=True)
        head = self.model.get_output_embeddings()
        handle = head.register_forward_pre_hook(lambda module, args: (args[0][where[0], where[1]], *args[1:]))
        try:
            logits = self.model(input_ids=batch["input_ids"], **rows).logits
        finally:
            handle.remove()
        targets = labels[:, 1:][where]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets)

    def close(self) -> None:
        del self.model, self.opt, self.params
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


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
    actor = ClientActor(for_actor(cfg, 1, device.type), one)
    slot = actor.slots[one[0]["cid"]]
    tc = cfg.train
    steps = actor.local_steps(slot.cid)
    order = actor.batch_order(1, slot.cid, steps)[:steps * tc.batch_size].tolist()  # round 1's batches
    batches = [{k: v.to(device) for k, v in collate([slot.train_enc[i] for i in order[i:i + tc.batch_size]],
                                                     actor.tokenizer.pad_token_id).items()}
               for i in range(0, len(order), tc.batch_size)]
    tokens = int(sum(int(b["attention_mask"].sum()) for b in batches))
    actor.train(1, slot.cid, Payload())  # warm-up (kernels, allocator)
    plain = BareLoop(cfg, device)
    plain.run(batches[:2])
    ours, floor = [], []
    for rep in range(repeats):
        _sync(device)
        ours.append(actor.train(1, slot.cid, Payload()).metrics["train_seconds"])  # round 1: the batches above
        floor.append(plain.run(batches))
        progress(f"repeat {rep + 1}: fedsweep {tokens / ours[-1]:,.0f} tok/s, plain loop {tokens / floor[-1]:,.0f} tok/s")
    med_ours, med_floor = statistics.median(ours), statistics.median(floor)
    return {"benchmark": "throughput", "algorithm": cfg.algorithm, "device": device.type, "model": cfg.model.name,
            "dtype": cfg.model.dtype, "autocast": cfg.train.autocast, "steps": steps, "batch_size": tc.batch_size,
            "tokens": tokens, "fedsweep_seconds": ours, "plain_seconds": floor,
            "fedsweep_tokens_per_s": tokens / med_ours, "plain_tokens_per_s": tokens / med_floor,
            "fedsweep_over_plain": med_ours / med_floor, "config": cfg.to_dict(), "machine": machine(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


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
    from pathlib import Path

    from fedsweep.bench.record import write_json

    return write_json(result, Path(out_dir) / f"{result['benchmark']}_{name}_{result['device']}.json")
