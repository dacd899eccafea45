#!/bin/bash
# Compiled layers and the LoRA hook read from its module, on 2 CPU cores (2026-11-29; every JSON packed into
# results.json beside this script):
# 1. the grouped step before (efc387f: a hook per module) and after (this commit: one hook function), the demo's
#    rows on the tiny model, K = 4 and K = 50, alternating, 3 repeats each: nothing slower on the CPU;
# 2. the same step with its decoder layers compiled (train.compile: aot_eager, inductor), K = 4: what compiling
#    costs and buys on a CPU (the GPU's figure is make gpu-check's; none measured yet).
# Run from the repository root: bash benchmarks/raw/2026-11-29-cpu-compiled/measure.sh OUT BEFORE_CHECKOUT
set -u
OUT=${1:-results/bench/compiled}; B=${2:?a checkout of efc387f}
mkdir -p "$OUT"
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
A=$PWD
STEP="configs/experiments/demo.yaml --set model.name=tiny --repeats 3 --sequential-max 0"
for i in 1 2; do
  for side in after before; do
    dir=$A; [ $side = before ] && dir=$B
    (cd $dir && PYTHONPATH=$dir $A/.venv/bin/python -m fedsweep.cli bench throughput $STEP --clients 4,50 \
       --set name=step-$side-$i --out "$OUT/step")
  done
done
for backend in aot_eager inductor; do
  /usr/bin/time -f "%e s wall" timeout 900 $A/.venv/bin/python -m fedsweep.cli bench throughput $STEP --clients 4 \
    --set train.compile=$backend --set name=compiled-$backend --out "$OUT/compiled" 2>&1 | tail -4
done
