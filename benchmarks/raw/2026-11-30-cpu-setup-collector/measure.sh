#!/bin/bash
# Issue #76's set-up (process start -> round 1) on 2 cores, alone, forked workers; the demo's settings on the tiny
# model, K = 50 on one actor, no checkpoints, no tracking (the settings of 2026-11-30-cpu-fork-server/measure.sh).
# From the repository root:
#   measure.sh setup OUT N ARM=PATH[,VAR=VALUE...] ...   3 rounds; the arms alternate, one run of each per repetition,
#       in the order given; PATH: this checkout or a worktree of an earlier commit with the same .venv linked in
#       e.g.  measure.sh setup OUT 5 H=/tmp/wt_87483cd D=$PWD
#             measure.sh setup OUT 6 Z=$PWD,FEDSWEEP_FORK_SESSION=0 G=$PWD
#   measure.sh rounds OUT    8 rounds, the fork server in its own session (G) or the driver's (Z,
#       FEDSWEEP_FORK_SESSION=0): one warm-up run discarded, then the pairs GZ ZG ZG GZ GZ ZG (part 7; part 6 ran
#       GZ ZG GZ ZG without the warm-up)
#   measure.sh imports on|off   the fork server's warm modules imported in a fresh interpreter with Python's cyclic
#       collector on or off: wall seconds, CPU seconds, full collections
# Each run's JSON also reports the bench's own sampling CPU (sampler_cpu_s; before f37cac7's sampler, part 1's
# 2.40 CPU-seconds were read by timing TreeRSS.sample the same way).
set -u
mode=$1; shift
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false FEDSWEEP_WORKER_FORKS=1
K50="--set model.name=tiny --set clients.num_clients=50 --set clients.clients_per_actor=50 --set train.batch_clients=auto
     --set tracking.enabled=false --set checkpoint.enabled=false"
bench() { local out=$1 arm=$2 spec=$3 name=$4 rounds=$5; local dir=${spec%%,*} vars=""
  [[ $spec == *,* ]] && vars=${spec#*,}
  (cd "$dir" && env ${vars//,/ } .venv/bin/python -m fedsweep.cli bench run configs/experiments/demo.yaml $K50 \
     --set rounds=$rounds --set name=$name --out "$out/$arm" > /dev/null 2>&1) || echo "run $name failed" >&2; }
case $mode in
  setup)
    OUT=$(realpath -m "$1"); N=$2; shift 2
    for i in $(seq 1 "$N"); do
      for arm in "$@"; do bench "$OUT" "${arm%%=*}" "${arm#*=}" "${arm%%=*}$i" 3; done
    done ;;
  rounds)
    OUT=$(realpath -m "$1"); i=0
    bench "$OUT" W "$PWD" W0 8
    for order in GZ ZG ZG GZ GZ ZG; do i=$((i+1))
      for a in $(echo $order | fold -w1); do
        if [ $a = G ]; then bench "$OUT" G "$PWD" G$i 8; else bench "$OUT" Z "$PWD,FEDSWEEP_FORK_SESSION=0" Z$i 8; fi
      done
    done ;;
  imports)
    .venv/bin/python - "$1" <<'PY'
import gc, importlib, sys, time
if sys.argv[1] == "off":
    gc.disable()
wall, cpu = time.perf_counter(), time.process_time()
for m in ("torch", "transformers.models.llama.modeling_llama", "peft", "fedsweep.actors.engine_setup",
          "fedsweep.actors.client_training", "fedsweep.actors.client_eval", "fedsweep.algorithms.registry"):
    importlib.import_module(m)
print(sys.argv[1], round(time.perf_counter() - wall, 2), round(time.process_time() - cpu, 2), gc.get_stats()[2]["collections"])
PY
    ;;
  *) echo "measure.sh setup|rounds|imports ..." >&2; exit 2 ;;
esac
