"""CPU consumed by each process of a bench run's tree up to round 1, sampled every 0.25 s (what competes with the fork server).

Run from the repository root: .venv/bin/python benchmarks/raw/2026-11-30-cpu-fork-server/census.py 1|0 OUT (FEDSWEEP_WORKER_FORKS, output folder)."""
import json, subprocess, sys, time, os
import psutil
env = dict(os.environ, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
env["FEDSWEEP_WORKER_FORKS"] = sys.argv[1]
out = sys.argv[2]
K50 = "--set model.name=tiny --set clients.num_clients=50 --set clients.clients_per_actor=50 --set train.batch_clients=auto --set tracking.enabled=false --set rounds=3 --set checkpoint.enabled=false".split()
t0 = time.time()
p = subprocess.Popen([".venv/bin/python", "-m", "fedsweep.cli", "bench", "run", "configs/experiments/demo.yaml", *K50, "--set", "name=census", "--out", out + "/json"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
root = psutil.Process(p.pid)
samples = []
while p.poll() is None and time.time() - t0 < 15:
    snap = {}
    try:
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        procs = []
    for q in procs:
        try:
            c = q.cpu_times()
            snap[q.pid] = (" ".join(q.cmdline())[:120], round(c.user + c.system, 2), round(q.create_time() - t0, 2))
        except psutil.Error:
            pass
    samples.append((round(time.time() - t0, 2), snap))
    time.sleep(0.25)
p.wait()
json.dump(samples, open(out + "/samples.json", "w"))
