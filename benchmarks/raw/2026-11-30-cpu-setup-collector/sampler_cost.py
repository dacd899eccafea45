# The CPU the driver spends in bench run's memory sampler (TreeRSS.sample), printed at exit: .venv/bin/python benchmarks/raw/2026-11-30-cpu-setup-collector/sampler_cost.py bench run CONFIG [--set ...]
import sys, time, atexit
import fedsweep.bench.run as r
orig = r.TreeRSS.sample
acc = {"n": 0, "cpu": 0.0, "wall": 0.0}
def sample(self, *a, **k):
    t = time.thread_time(); w = time.perf_counter()
    out = orig(self, *a, **k)
    acc["n"] += 1; acc["cpu"] += time.thread_time() - t; acc["wall"] += time.perf_counter() - w
    return out
r.TreeRSS.sample = sample
atexit.register(lambda: print("SAMPLES", acc, file=sys.stderr))
from fedsweep.cli import main

sys.exit(main(sys.argv[1:]))
