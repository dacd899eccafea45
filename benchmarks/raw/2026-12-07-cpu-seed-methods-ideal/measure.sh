#!/bin/bash
# The demo study's cells, one trial per variant at seed 0 exactly as `fedsweep tune configs/sweeps/main.yaml`
# runs it, each with its rounds beside their ideal (the same rows and work at the best bare rates).
# Run at 4e37548 from a clean worktree on the 2-core VM, alone on the machine, 2026-12-07 06:51-07:14 UTC.
# usage: bash measure.sh OUT   (from the repository root)
set -euo pipefail
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
for v in fedavg local drift_sp fedicu fedreft fedcofit pfedgpt; do
  fedsweep bench run configs/sweeps/main.yaml --variant "$v" --out "${1:-results/bench}"
done
# and the demo's settings on the tiny model at K = 50 on one actor (3 rounds):
fedsweep bench run configs/experiments/demo.yaml --set model.name=tiny --set clients.num_clients=50 \
  --set clients.clients_per_actor=50 --set train.batch_clients=auto --set rounds=3 --set tracking.enabled=false \
  --set name=demo-tiny-k50 --out "${1:-results/bench}"
