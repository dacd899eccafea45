#!/bin/bash
# Issue #76's set-up (process start -> round 1), forked workers, 2 cores, alone: arms given as
# NAME=PATH[,VAR=VALUE...] (a checkout or a worktree of an earlier commit with the same .venv linked in, and
# environment variables for that arm), alternating, one run of each arm per repetition, in the order given.
# The demo's settings on the tiny model, K = 50 on one actor, 3 rounds, no checkpoints, no tracking (the
# settings of 2026-11-30-cpu-fork-server/measure.sh). From the repository root:
#   bash benchmarks/raw/2026-11-30-cpu-setup-collector/measure.sh OUT N B=/tmp/wt_B N=$PWD
#   bash benchmarks/raw/2026-11-30-cpu-setup-collector/measure.sh OUT N S=$PWD Z=$PWD,FEDSWEEP_SIDE_NICENESS=0
set -u
OUT=$(realpath -m "${1:-results/bench/setup-collector}"); N=${2:-5}; shift 2
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false FEDSWEEP_WORKER_FORKS=1
K50="--set model.name=tiny --set clients.num_clients=50 --set clients.clients_per_actor=50 --set train.batch_clients=auto
     --set tracking.enabled=false --set rounds=3 --set checkpoint.enabled=false"
bench() { local arm=$1 spec=$2 i=$3; local dir=${spec%%,*} vars=""
  [[ $spec == *,* ]] && vars=${spec#*,}
  (cd "$dir" && env ${vars//,/ } .venv/bin/python -m fedsweep.cli bench run configs/experiments/demo.yaml $K50 \
     --set name=$arm$i --out "$OUT/$arm" > /dev/null 2>&1) || echo "run $arm$i failed" >&2; }
for i in $(seq 1 "$N"); do
  for arm in "$@"; do bench "${arm%%=*}" "${arm#*=}" "$i"; done
done
