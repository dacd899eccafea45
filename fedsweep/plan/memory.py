"""A run's memory plan: what one GPU client actor of a config holds (``models.memory`` counts the
bytes and simulates the steps; this module reads the config and asks it).

Per actor hosting n clients (see ``models.memory`` for each term)::

    base + live adapters + optimiser × (n if park == gpu else 1) + max(train step(m), evaluation)
"""

from __future__ import annotations

from fedsweep.lazy import torch
from fedsweep.models.memory import (MemoryPlan, adapter_parameters_per_client, base_bytes, kv_cache_bytes, meta_model,
                                    step_peak, unit_bytes)
from fedsweep.models.shapes import OPTIMIZER_BYTES
from fedsweep.plan.batching import why_alone


def plan(cfg, model_config: dict) -> MemoryPlan:
    """The memory plan of ``cfg`` (an ExperimentConfig) for the architecture ``model_config``."""
    from fedsweep.models.loading import AUTOCAST, torch_dtype

    weights = torch_dtype(cfg.model.dtype)
    # a quantised base computes in bf16 (fp32 asked) or the given half type; autocast computes in its type
    compute = torch.bfloat16 if cfg.model.quantization != "none" and weights == torch.float32 else weights
    compute = torch_dtype(AUTOCAST.get(cfg.train.autocast)) or compute
    model = meta_model(model_config, compute, cfg, cfg.model.attn_implementation)
    sizes = adapter_parameters_per_client(model, cfg)
    adapters, per_client = sum(sizes.values()), max(sizes.values())
    optimizer = int(per_client * OPTIMIZER_BYTES[cfg.train.optimizer])
    shards = cfg.clients.shards
    rows = -(-cfg.train.batch_size // shards)  # a sharded client's process computes its share of each batch
    train = step_peak(model, rows, cfg.train.max_length, train=True, cfg=cfg) + optimizer
    together, slope, stacked = 1, 0, 0
    if why_alone(cfg) is None:  # groups: a step over two clients' batches gives the slope
        together = None if cfg.train.batch_clients == "auto" else cfg.train.batch_clients
        slope = max(0, step_peak(model, 2 * rows, cfg.train.max_length, train=True, cfg=cfg) + optimizer - train)
        stacked = per_client * 4 * 4  # float32 factors, gradients, AdamW's two moments
    evaluation = evaluation_peak(model, model_config, cfg, -(-cfg.eval.batch_size // shards), compute.itemsize)
    eval_slope = 0
    if cfg.eval.forwards in ("one", "auto") and shards == 1:  # (a GPU's auto is one forward: the plan is a GPU's)
        rows = test_rows_per_client(cfg)
        one = evaluation_peak(model, model_config, cfg, rows, compute.itemsize)
        eval_slope = max(0, evaluation_peak(model, model_config, cfg, 2 * rows, compute.itemsize) - one)
        evaluation = max(evaluation, one)
    base = base_bytes(model, cfg.model.quantization, weights.itemsize)
    gathered = 0
    if shards > 1:
        units = sorted(unit_bytes(model, weights.itemsize), reverse=True)
        gathered = sum(units[:2])
        base = 0 if cfg.clients.shard.offload == "cpu" else -(-base // shards)
    return MemoryPlan(base=base, live_adapters=adapters * 4, optimizer_per_client=optimizer, train_step=train,
                      evaluation=evaluation, park=cfg.clients.park, shards=shards, gathered=gathered,
                      batch_slope=slope, stacked_per_client=stacked, batch_clients=together,
                      evaluation_slope=eval_slope)


def test_rows_per_client(cfg) -> int:
    """A client's test rows as the data section makes them (each task's test share, spread over the
    clients; at least one)."""
    per_task = max(1, round(cfg.data.examples_per_task * cfg.data.test_fraction))
    return max(1, -(-per_task * len(cfg.data.tasks) // cfg.clients.num_clients))


def evaluation_peak(model, model_config: dict, cfg, rows: int, itemsize: int) -> int:
    """Peak of evaluating ``rows`` rows at once: the test-loss forward (no gradients) or generation's KV
    cache with the last position's logits, the larger."""
    peak = step_peak(model, rows, cfg.train.max_length, train=False, cfg=cfg)
    if cfg.eval.max_new_tokens:
        gen = kv_cache_bytes(model_config, rows, cfg.train.max_length + cfg.eval.max_new_tokens, itemsize)
        gen += rows * model_config["vocab_size"] * 4 * 2  # last-position logits and their softmax
        peak = max(peak, gen)
    return peak
