"""A grouped round of K packed clients (``bench.grouped.packed_actor``) with transformers' KV cache object
built in every training forward (the engine today: ``use_cache`` left on) and without it: ``aten::`` calls
of one round after a warm-up round, in the order on, off, on (``bench.ops.count_ops``), then round seconds, medians of 4 alternating, heap frozen.
Usage: python kv_cache_grouped.py CONFIG K [OVERRIDE ...]"""
import sys, time, statistics, torch
from fedsweep.config import load_config
from fedsweep.orchestrator.bench import grouped
from fedsweep.orchestrator.bench.ops import count_ops
from fedsweep.algorithms.types import Payload
from fedsweep.actors.heap import frozen_heap

cfg = load_config(sys.argv[1], sys.argv[3:])
k = int(sys.argv[2])
actor = grouped.packed_actor(cfg, k)
items = [(c, 0) for c in sorted(actor.slots)]
conf = actor.model.get_base_model().config
def rnd(flag):
    conf.use_cache = flag
    t = time.perf_counter(); _, a = actor.train_many(1, items, Payload()); return time.perf_counter() - t, a
rnd(True)  # warm-up: the first round also builds optimiser state and tokenised data
for flag in (True, False, True):
    print("use_cache", flag, "aten calls of a round", count_ops(lambda: rnd(flag))["aten_calls"])
ts = {True: [], False: []}
with frozen_heap():
    for r in range(4):
        for flag in ((True, False) if r % 2 == 0 else (False, True)):
            ts[flag].append(rnd(flag)[0])
print("median round seconds", {f: statistics.median(v) for f, v in ts.items()}, "all", ts)
