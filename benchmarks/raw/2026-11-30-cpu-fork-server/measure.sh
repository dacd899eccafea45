#!/bin/bash
# Issue #76's set-up (process start -> round 1) with Ray's Python workers forked from fedsweep's fork server
# (F, as shipped) against workers started as Ray starts them (R, FEDSWEEP_WORKER_FORKS=0); 2 cores, alone;
# the demo's settings on the tiny model, K = 50 on one actor, 3 rounds, no checkpoints, no tracking;
# alternating, R first. Run from the repository root:  bash benchmarks/raw/2026-11-30-cpu-fork-server/measure.sh OUT [N]
set -u
OUT=${1:-results/bench/fork-server}; N=${2:-5}
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
K50="--set model.name=tiny --set clients.num_clients=50 --set clients.clients_per_actor=50 --set train.batch_clients=auto
     --set tracking.enabled=false --set rounds=3 --set checkpoint.enabled=false"
bench() { local name=$1 dir=$2; shift 2
  env "$@" .venv/bin/python -m fedsweep.cli bench run configs/experiments/demo.yaml $K50 --set name=$name --out "$OUT/$dir" > /dev/null 2>&1; }
for i in $(seq 1 "$N"); do
  bench r$i R FEDSWEEP_WORKER_FORKS=0
  bench f$i F FEDSWEEP_WORKER_FORKS=1
done
