#!/bin/bash
# The local runtime's socket retry (ray_runtime.SOCKET_RETRY_ENV), 2026-11-29, 2 cores, alone: the demo's
# settings on the tiny model, K = 50 on one actor, 3 rounds, no checkpoints, no tracking.
# A = as committed (a missing socket retried every 50 ms), B = the same code with Ray's own retry set by the
# user (1,000 ms × 10), C = A with every Ray worker importing torch as it starts (torch_hook.py, through Ray's
# worker set-up hook); alternating A, B, C, five times each. gaps.txt: each run's raylet wait between its object
# store and its object manager (raylet_gap.py). Run from the repository root:
#   bash benchmarks/raw/2026-11-29-cpu-socket-retry/measure.sh OUT
set -u
OUT=${1:-results/bench/socket-retry}; HERE=$(dirname "$0")
mkdir -p "$OUT/A" "$OUT/B" "$OUT/C" "$OUT/preload-log"
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
K50="--set model.name=tiny --set clients.num_clients=50 --set clients.clients_per_actor=50 --set train.batch_clients=auto
     --set tracking.enabled=false --set rounds=3 --set checkpoint.enabled=false"
for i in 1 2 3 4 5; do
  .venv/bin/python -m fedsweep.cli bench run configs/experiments/demo.yaml $K50 --set name=a$i --out "$OUT/A"
  .venv/bin/python "$HERE/raylet_gap.py" A$i >> "$OUT/gaps.txt"
  RAY_raylet_client_connect_timeout_milliseconds=1000 RAY_raylet_client_num_connect_attempts=10 \
    .venv/bin/python -m fedsweep.cli bench run configs/experiments/demo.yaml $K50 --set name=b$i --out "$OUT/B"
  .venv/bin/python "$HERE/raylet_gap.py" B$i >> "$OUT/gaps.txt"
  PYTHONPATH=$HERE:$PWD PRELOAD_LOG=$OUT/preload-log __RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR=torch_hook.preload \
    .venv/bin/python -m fedsweep.cli bench run configs/experiments/demo.yaml $K50 --set name=c$i --out "$OUT/C"
  .venv/bin/python "$HERE/raylet_gap.py" C$i >> "$OUT/gaps.txt"
done
# then Ray's start alone (ray_start.py), A and B alternating, 12 times each
for i in $(seq 1 12); do
  .venv/bin/python "$HERE/ray_start.py" >> "$OUT/ray_start_A.jsonl"
  RAY_raylet_client_connect_timeout_milliseconds=1000 RAY_raylet_client_num_connect_attempts=10 \
    .venv/bin/python "$HERE/ray_start.py" >> "$OUT/ray_start_B.jsonl"
done
# then the bench runs again, B first in each pair, eight pairs (the first five pairs' A ran right after
# a card's run, always first)
for i in 1 2 3 4 5 6 7 8; do
  RAY_raylet_client_connect_timeout_milliseconds=1000 RAY_raylet_client_num_connect_attempts=10 \
    .venv/bin/python -m fedsweep.cli bench run configs/experiments/demo.yaml $K50 --set name=b2-$i --out "$OUT/B2"
  .venv/bin/python "$HERE/raylet_gap.py" B2-$i >> "$OUT/gaps.txt"
  .venv/bin/python -m fedsweep.cli bench run configs/experiments/demo.yaml $K50 --set name=a2-$i --out "$OUT/A2"
  .venv/bin/python "$HERE/raylet_gap.py" A2-$i >> "$OUT/gaps.txt"
done
