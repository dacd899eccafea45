"""Two fresh packed actors of K clients, one with the KV cache object built in training (today), one
without: two rounds each (round 2 starts from round 1's state), every client's upload compared bit for bit.
Usage: python kv_cache_equal.py CONFIG K [OVERRIDE ...]"""
import sys, torch
from fedsweep.config import load_config
from fedsweep.orchestrator.bench import grouped
from fedsweep.algorithms.types import Payload
cfg = load_config(sys.argv[1], sys.argv[3:])
k = int(sys.argv[2])
ups = {}
for flag in (True, False):
    torch.manual_seed(0)
    actor = grouped.packed_actor(cfg, k)
    actor.model.get_base_model().config.use_cache = flag
    items = [(c, 0) for c in sorted(actor.slots)]
    for r in (1, 2):
        _, a = actor.train_many(r, items, Payload())
    ups[flag] = a
same = all(torch.equal(x.upload.params[n], y.upload.params[n]) for (_, x), (_, y) in zip(ups[True], ups[False]) for n in x.upload.params)
print("identical uploads", same, len(ups[True]))
