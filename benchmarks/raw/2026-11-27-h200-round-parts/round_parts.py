"""Scratch: where a grouped round's time goes on a GPU (sync'd timers around its parts) and the
profiler's top kernels / host ops of the grouped round and of the bare loop on the same rows."""
import json, os, statistics, sys, time
from collections import defaultdict
import torch
from fedsweep.config.loading import load_config
from fedsweep.orchestrator.bench import grouped
from fedsweep.orchestrator.bench.actor import BareLoop
from fedsweep.algorithms.types import Payload
from fedsweep.engine import training, optim
from fedsweep.models import stacked_lora
from fedsweep.actors import client_training

OUT = os.environ.get("OUT", "/tmp/rp")
os.makedirs(OUT, exist_ok=True)
cuda = torch.cuda.is_available()
def sync():
    if cuda: torch.cuda.synchronize()
T = defaultdict(float)
def timed(owner, name, label):
    fn = getattr(owner, name)
    def wrap(*a, **k):
        sync(); t0 = time.perf_counter()
        try: return fn(*a, **k)
        finally:
            sync(); T[label] += time.perf_counter() - t0
    setattr(owner, name, wrap)
for owner, name, label in (
        (training.GroupTraining, "__init__", "init (bind, write, opt load)"),
        (training.GroupTraining, "_forwards", "forward+backward"),
        (training.GroupTraining, "_streams", "streams"),
        (optim.StackedAdamW, "step", "adamw step"),
        (optim.StackedAdamW, "zero_grad", "zero_grad"),
        (optim.StackedAdamW, "gathered", "gathered"),
        (optim._Stacked, "clip", "clip"),
        (optim._Stacked, "client_states", "client_states"),
        (stacked_lora.StackedLora, "read_all", "read_all"),
        (client_training.ClientTraining, "_begin", "begin (client_prepare)"),
        (client_training.ClientTraining, "_finish", "finish (upload chain)"),
        (client_training.ClientTraining, "train_group", "train_group total")):
    timed(owner, name, label)

def run(config, overrides, k, name, rounds=3):
    cfg = load_config(config, overrides)
    actor = grouped.packed_actor(cfg, k)
    items = [(cid, 0) for cid in sorted(actor.slots)]
    actor.train_many(1, items, Payload())
    T.clear()
    walls = []
    for r in range(rounds):
        sync(); t0 = time.perf_counter()
        actor.train_many(2, items, Payload())
        sync(); walls.append(time.perf_counter() - t0)
    parts = {key: v / rounds for key, v in T.items()}
    bare = BareLoop(actor.cfg, actor.device)
    batches = grouped.group_batches(actor, 2)
    bare.run(batches)
    bw = [bare.run(batches) for _ in range(3)]
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    tables = {}
    for label, job in (("grouped", lambda: actor.train_many(2, items, Payload())), ("bare", lambda: bare.run(batches))):
        with profile(activities=acts) as prof:
            job(); sync()
        ka = prof.key_averages()
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        tables[label] = ka.table(sort_by=sort, row_limit=25, max_name_column_width=70) + "\n" + \
            ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70)
    res = {"name": name, "k": k, "round_s": statistics.median(walls), "walls": walls, "bare_s": statistics.median(bw),
           "parts_s": parts, "tokens": sum(int(b["attention_mask"].sum()) for b in batches),
           "padded_cells": sum(b["attention_mask"].numel() for b in batches)}
    print(json.dumps({k_: v for k_, v in res.items()}, indent=1), flush=True)
    with open(f"{OUT}/parts_{name}.json", "w") as fh: json.dump(res, fh, indent=1)
    with open(f"{OUT}/tables_{name}.txt", "w") as fh:
        for label, t in tables.items(): fh.write(f"===== {label}\n{t}\n")
    bare.close(); del actor
    if cuda: torch.cuda.empty_cache()

DEMO = "configs/experiments/demo.yaml"
SMOL = ["model.name=random:smollm2-135m-instruct", "clients.resources.num_gpus=1", "data.examples_per_task=160",
        "train.steps=2", "train.batch_clients=auto"]
BF16 = ["model.dtype=bf16", "train.autocast=bf16"]
which = sys.argv[1:] or ["smol50"]
for w in which:
    if w == "smol50": run(DEMO, SMOL + BF16, 50, "smol-bf16-k50")
    if w == "smol1": run(DEMO, SMOL + BF16, 1, "smol-bf16-k1")
    if w == "smol10": run(DEMO, SMOL + BF16, 10, "smol-bf16-k10")
    if w == "llama16": run(DEMO, ["model.name=random:llama-3.1-8b", "model.dtype=bf16", "train.autocast=bf16", "lora.r=16",
                                  "train.gradient_checkpointing=true", "train.max_length=256", "clients.resources.num_gpus=1",
                                  "data.examples_per_task=64", "train.steps=2", "train.batch_clients=auto"], 16, "llama-k16", rounds=2)
    if w == "tiny": run("configs/experiments/smoke.yaml", ["train.forwards=one"], 4, "tiny-k4")
