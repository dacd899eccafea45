#!/bin/bash
tag=$1; shift
source /work/main/.venv/bin/activate; export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
d=/tmp/x/$tag; rm -rf $d; mkdir -p $d; cd $d
start=$(date +%s)
fedsweep run /work/main/configs/experiments/drift_sp.yaml --quiet --set eval.max_examples=4 --set eval.max_new_tokens=0 --set checkpoint.dir=$d/runs --set tracking.uri=sqlite:///$d/ml.db "$@" > $d/log 2>&1
echo "$tag rc=$? $(( $(date +%s)-start ))s :: $*"
sqlite3 $d/ml.db "select step, round(value,3) from metrics where key='drift_detour_ratio' order by step" | tr '\n' ' '; echo
sqlite3 $d/ml.db "select step, value from metrics where key='drift_neighbours_mean' order by step" | tr '\n' ' '; echo
