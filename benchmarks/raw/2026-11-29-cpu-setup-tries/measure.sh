#!/bin/bash
# Two tries at issue #76's set-up (process start -> round 1), 2 cores, alone, 2026-11-29; the demo's settings
# on the tiny model, K = 50 on one actor, 3 rounds, no checkpoints, no tracking. results.json packs every
# run's JSON. Run from the repository root:  bash benchmarks/raw/2026-11-29-cpu-setup-tries/measure.sh OUT
# 1. (at dfda09f) P = every Ray worker imports what a client actor imports as it starts
#    (probes.preload_actor_imports through Ray's worker set-up hook), N = as shipped; alternating, 3 each.
# 2. (at fb69a25, with ce7ed2f's socket retry in place) A = a missing Unix socket retried every 50 ms,
#    B = Ray's own retry set through the environment (1,000 ms x 10), C = A with every worker importing
#    torch as it starts (probes.preload_torch); alternating A, B, C, five times; then ray.init alone, A and
#    B alternating, 12 each; then eight more pairs, B first. gaps.txt: each run's raylet wait for its store.
set -u
OUT=${1:-results/bench/setup-tries}; HERE=$(cd "$(dirname "$0")" && pwd)
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
K50="--set model.name=tiny --set clients.num_clients=50 --set clients.clients_per_actor=50 --set train.batch_clients=auto
     --set tracking.enabled=false --set rounds=3 --set checkpoint.enabled=false"
# bench NAME FOLDER [VAR=VALUE ...]: one bench run, with the given environment
bench() { local name=$1 dir=$2; shift 2
  env "$@" .venv/bin/python -m fedsweep.cli bench run configs/experiments/demo.yaml $K50 --set name=$name --out "$OUT/$dir"; }
probe() { .venv/bin/python "$HERE/probes.py" "$@"; }
RAYS_RETRY=(RAY_raylet_client_connect_timeout_milliseconds=1000 RAY_raylet_client_num_connect_attempts=10)
hook() { echo PYTHONPATH=$HERE:$PWD PRELOAD_LOG=$OUT/preload-$1 __RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR=probes.$2; }
mkdir -p "$OUT/preload-P" "$OUT/preload-C"
for i in 1 2 3; do
  bench p$i P $(hook P preload_actor_imports)
  bench n$i N
done
for i in 1 2 3 4 5; do
  bench a$i A; probe gap A$i >> "$OUT/gaps.txt"
  bench b$i B "${RAYS_RETRY[@]}"; probe gap B$i >> "$OUT/gaps.txt"
  bench c$i C $(hook C preload_torch); probe gap C$i >> "$OUT/gaps.txt"
done
for i in $(seq 1 12); do
  probe ray-start >> "$OUT/ray_start_A.jsonl"
  env "${RAYS_RETRY[@]}" .venv/bin/python "$HERE/probes.py" ray-start >> "$OUT/ray_start_B.jsonl"
done
for i in 1 2 3 4 5 6 7 8; do
  bench b2-$i B2 "${RAYS_RETRY[@]}"; probe gap B2-$i >> "$OUT/gaps.txt"
  bench a2-$i A2; probe gap A2-$i >> "$OUT/gaps.txt"
done
