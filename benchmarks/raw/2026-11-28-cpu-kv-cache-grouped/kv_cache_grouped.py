"""A grouped round of K packed clients (``bench.grouped.packed_actor``) with transformers' KV cache object
built in every training forward (the engine today: ``use_cache`` left on) and without it, switched from
outside on the actor's model: operator calls as ``fedsweep bench throughput --ops`` counts them
(``bench.grouped.ops_of``: after a warm-up round, the round, a step and the set-up), then round seconds
(``bench.grouped._round``), medians of 4 alternating, heap frozen.
Usage: python kv_cache_grouped.py CONFIG K [OVERRIDE ...]"""
import statistics
import sys

from fedsweep.actors.heap import frozen_heap
from fedsweep.config import load_config
from fedsweep.orchestrator.bench import grouped

actor = grouped.packed_actor(load_config(sys.argv[1], sys.argv[3:]), int(sys.argv[2]))
items = [(c, 0) for c in sorted(actor.slots)]
conf = actor.model.get_base_model().config
for flag in (True, False, True):
    conf.use_cache = flag
    ops = grouped.ops_of(actor)
    print("use_cache", flag, {k: ops[k] for k in ("round_aten_calls", "step_aten_calls", "setup_aten_calls")})
seconds = {True: [], False: []}
with frozen_heap():
    for r in range(4):
        for flag in ((True, False) if r % 2 == 0 else (False, True)):
            conf.use_cache = flag
            seconds[flag].append(grouped._round(actor, actor.batch_plan, items, actor.device)["seconds"])
print("median round seconds", {f: statistics.median(v) for f, v in seconds.items()}, "all", seconds)
