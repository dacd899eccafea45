#!/bin/bash
# The GPU study's CPU criteria (issue: a GPU study at the speed of its work), on 2 CPU cores:
# 1. tiny model at the demo's settings, K = 50 on one actor: set-up (process start -> round 1), the rounds' parts
# 2. operator calls of a round's evaluation, K = 1 against K = 50 (bench throughput --ops)
# 3. SmolLM2-135M-shaped random model, K = 50 on one actor, one step of 32-token rows:
#    traffic_bytes per round against adapter_bytes, traffic_s against the round, partial sums on and off
# Run from the repository root: bash benchmarks/raw/2026-11-29-cpu-gpu-study/measure.sh OUT (ran at 3d09367, 2026-11-29, alone on the 2 cores)
set -u
OUT=${1:-results/bench/gpu-study-cpu}
mkdir -p "$OUT"
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
F="${PY:-.venv/bin/python} -m fedsweep.cli"
DEMO=configs/experiments/demo.yaml
K50="--set clients.num_clients=50 --set clients.clients_per_actor=50 --set train.batch_clients=auto --set tracking.enabled=false"
for i in 1 2 3; do
  $F bench run $DEMO --set model.name=tiny $K50 --set rounds=3 --set name=tiny-k50-r$i --out "$OUT"
done
$F bench throughput $DEMO --set model.name=tiny --ops --clients 1,50 --out "$OUT"
SMOL="--set model.name=random:smollm2-135m-instruct --set train.steps=1 --set train.max_length=32 --set eval.max_new_tokens=2 --set rounds=3"
for ps in true false; do
  $F bench run $DEMO $SMOL $K50 --set server.partial_sums=$ps --set name=smol-k50-partial-$ps --out "$OUT"
done
