#!/bin/bash
# Would importing torch, transformers' Llama modules and peft in Ray's workers as they start (before an
# actor is assigned) shorten the set-up? 2026-11-29, 2 cores, alone: the demo's settings on the tiny model,
# K = 50 on one actor, 3 rounds, no checkpoints, no tracking; P = Ray's worker set-up hook
# (__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR) runs preload_hook.preload in every worker, N = as shipped;
# alternating P, N, three times each. Run from the repository root:
#   bash benchmarks/raw/2026-11-29-cpu-worker-preload/measure.sh OUT
set -u
OUT=${1:-results/bench/worker-preload}; HERE=$(dirname "$0")
mkdir -p "$OUT/P" "$OUT/N" "$OUT/preload-log"
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
K50="--set model.name=tiny --set clients.num_clients=50 --set clients.clients_per_actor=50 --set train.batch_clients=auto
     --set tracking.enabled=false --set rounds=3 --set checkpoint.enabled=false"
for i in 1 2 3; do
  PYTHONPATH=$HERE:$PWD PRELOAD_LOG=$OUT/preload-log __RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR=preload_hook.preload \
    .venv/bin/python -m fedsweep.cli bench run configs/experiments/demo.yaml $K50 --set name=p$i --out "$OUT/P"
  .venv/bin/python -m fedsweep.cli bench run configs/experiments/demo.yaml $K50 --set name=n$i --out "$OUT/N"
done
