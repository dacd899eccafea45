import sys, time, statistics, functools, collections, gc, os
import torch
from fedsweep.config import load_config
from fedsweep.orchestrator.bench.grouped import packed_actor
from fedsweep.algorithms.types import Payload
import fedsweep.engine.training as tr, fedsweep.engine.optim as op, fedsweep.actors.client_training as ct, fedsweep.models.stacked_lora as sl, fedsweep.models.flat as fl
acc = collections.defaultdict(float)
def wrap(obj, name):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[f"{obj.__name__}.{name}"] += time.perf_counter() - t
    setattr(obj, name, g)
for obj, name in [(tr.GroupTraining, "__init__"), (tr.GroupTraining, "_forwards"), (op._Stacked, "client_states"), (op.StackedAdamW, "step"),
                  (sl.StackedLora, "read_all"), (ct.ClientTraining, "_finish"), (ct.ClientTraining, "_begin"), (ct.ClientTraining, "_job"),
                  (op._Stacked, "load_all"), (fl.FlatStack, "write_rows"), (fl.FlatStack, "read_rows"), (tr.GroupTraining, "close"), (ct.ClientTraining, "train_group")]:
    wrap(obj, name)
k = int(sys.argv[1]); extra = sys.argv[2:]
cfg = load_config("configs/experiments/demo.yaml", ["model.name=tiny@16x30", "data.examples_per_task=160", "train.steps=2",
    "train.batch_clients=auto", "train.forwards=one", "train.max_length=32"] + extra)
actor = packed_actor(cfg, k)
items = [(cid, 0) for cid in sorted(actor.slots)]
actor.train_many(1, items, Payload())
if os.environ.get('FREEZE'): gc.collect(); gc.freeze()
acc.clear()
n = 5
for _ in range(n): actor.train_many(2, items, Payload())
for key, v in sorted(acc.items(), key=lambda kv: -kv[1]): print(f"{key:40s} {v/n*1e3:8.1f} ms")
