#!/bin/bash
# Rounds with the fork server in its own session (G, as shipped) against in the driver's (Z, FEDSWEEP_FORK_SESSION=0): 8 rounds each, one warm-up run discarded, then ABBA pairs. From the repository root: bash benchmarks/raw/2026-11-30-cpu-setup-collector/rounds_abba.sh OUT
# (part 6 ran the same without the warm-up run and with the orders GZ ZG GZ ZG.)
OUT=$(realpath -m "$1")
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false FEDSWEEP_WORKER_FORKS=1 
K50="--set model.name=tiny --set clients.num_clients=50 --set clients.clients_per_actor=50 --set train.batch_clients=auto --set tracking.enabled=false --set rounds=8 --set checkpoint.enabled=false"
run() { env FEDSWEEP_FORK_SESSION=$2 .venv/bin/python -m fedsweep.cli bench run configs/experiments/demo.yaml $K50 --set name=$1 --out $OUT/$1 >/dev/null 2>&1; }
i=0
run W0 1
for order in GZ ZG ZG GZ GZ ZG; do i=$((i+1)); for a in $(echo $order | fold -w1); do [ $a = G ] && s=1 || s=0; run $a$i $s; done; done
