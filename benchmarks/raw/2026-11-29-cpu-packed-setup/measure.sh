#!/bin/bash
# The GPU study's CPU criteria after packed rows and the scorers' warm-up, on 2 cores, alone
# (2026-11-29; JSON of every run packed into results.json beside this script):
# 1. the first evaluation's warm-up: the demo's settings on the tiny model, K = 50 on one actor, 3 rounds,
#    no checkpoints, no tracking; A = this commit (the scorers load beside round 1's training), B = b692e03
#    (they load in round 1's evaluation); alternating A, B, three times each
# 2. the set-up's sequential parts, each alone in a fresh process, 3 times: Ray's local runtime, torch,
#    transformers' Llama modules with peft, reasoning-gym (floor.py, below)
# 3. the engine's packed rows beside its padded step (bench throughput --padding-free, the demo's rows)
# Run from the repository root: bash benchmarks/raw/2026-11-29-cpu-packed-setup/measure.sh OUT B_CHECKOUT
set -u
OUT=${1:-results/bench/packed-setup}; B=${2:?a checkout of b692e03}
mkdir -p "$OUT"
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
K50="--set model.name=tiny --set clients.num_clients=50 --set clients.clients_per_actor=50 --set train.batch_clients=auto
     --set tracking.enabled=false --set rounds=3 --set checkpoint.enabled=false"
A=$PWD
for i in 1 2 3; do
  for side in A B; do
    dir=$A; [ $side = B ] && dir=$B
    (cd $dir && PYTHONPATH=$dir $A/.venv/bin/python -m fedsweep.cli bench run configs/experiments/demo.yaml $K50 \
       --set name=warm-$side-$i --out "$OUT/$side")
  done
done
.venv/bin/python - <<'PY' > "$OUT/floor.json"
import json, statistics, subprocess, sys
def timed(code):
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])
parts = {
    "ray_start_s": "import time; t=time.perf_counter(); from fedsweep.orchestrator.runtime import ray_runtime; "
                   "ray_runtime.ensure(0.0, log_to_driver=False); print(time.perf_counter()-t); import ray; ray.shutdown()",
    "torch_import_s": "import time; t=time.perf_counter(); import torch; print(time.perf_counter()-t)",
    "transformers_peft_import_s": "import torch, time; t=time.perf_counter(); import transformers.models.llama.modeling_llama, peft; print(time.perf_counter()-t)",
    "reasoning_gym_import_s": "import time; t=time.perf_counter(); import reasoning_gym; print(time.perf_counter()-t)",
}
runs = {k: [timed(c) for _ in range(3)] for k, c in parts.items()}
print(json.dumps({"runs": runs, "medians": {k: statistics.median(v) for k, v in runs.items()}}, indent=1))
PY
.venv/bin/python -m fedsweep.cli bench throughput configs/experiments/demo.yaml --set model.name=tiny --clients 4 \
  --repeats 3 --padding-free --sequential-max 0 --set name=packed-tiny-k4 --out "$OUT"
