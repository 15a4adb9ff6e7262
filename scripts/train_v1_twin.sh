#!/usr/bin/env bash
# The DFlash v1 twin of the shipped DFlash 2 drafter, for "DFlash 2 vs v1 at an identical
# budget" at the shipped scale (the recipe's own pair, stage 4, is 640 records and 500 steps):
# stages 5-11 of train_smollm2_drafters.sh again with --version 1 - the same records,
# features, held-out records, steps, learning rates, seeds, warm start (the target's layers
# 28 and 29) and window - then both drafters evaluated side by side on the five sets.
#
#   scripts/train_v1_twin.sh [WORK_DIR]      (default: ~/.cache/dflash2-work)
#
# Run it after train_smollm2_drafters.sh has finished in the same work directory: it reads
# that script's data and features and writes only run-t1-* and eval-twin. It resumes the
# same way (every run restarts from its last checkpoint, every 25 steps). ~4,200 steps of a
# v1 drafter, ~2.4 s a step here: ~3 h of this project's 2-core CPU.
set -euo pipefail
WORK=${1:-$HOME/.cache/dflash2-work}
HERE=$(cd "$(dirname "$0")" && pwd)
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
if [[ "$(uname)" == Linux && -f $OPENBLAS ]]; then export LD_PRELOAD=$OPENBLAS; fi
cd "$WORK"
T="$HERE/train_smollm2_drafters.py"

# One stage: the v1 run $2 on the data $1 (from $3/final, or from the target's layers when
# $3 is empty), $4 steps at lr $6, seed $5, with the later rounds' features ($7...).
twin() {
    local data=$1 run=$2 init=$3 steps=$4 seed=$5 lr=$6 more=() start=() f
    shift 6
    for f in "$@"; do more+=(--more-features "$f"); done
    if [[ -n $init ]]; then start=(--init "$init/final"); else start=(--warm-layers 28,29); fi
    python "$T" train --version 1 "$data" features.safetensors "${more[@]}" "$run" "${start[@]}" \
        --steps "$steps" --lr "$lr" --batch-size 8 --max-anchors 32 --max-len 448 --seed "$seed" \
        --val-records 64 --val-every 50 --save-every 25 --min-block-size 3 --distill 1 --sliding-window 64 \
        > "train-${run#run-}.log" 2>&1
}

D=(features-d.safetensors features-d2.safetensors features-d3.safetensors features-m1.safetensors
   features-m2new.safetensors features-m3new.safetensors)
twin data.jsonl run-t1-s4 "" 800 3 2e-3
twin data-all5.jsonl run-t1-s5 run-t1-s4 600 5 1e-3 "${D[@]:0:1}"
twin data-all6.jsonl run-t1-s6 run-t1-s5 600 6 1e-3 "${D[@]:0:2}"
twin data-all7.jsonl run-t1-s7 run-t1-s6 700 7 1e-3 "${D[@]:0:3}"
twin data-all8.jsonl run-t1-s8 run-t1-s7 500 8 1e-3 "${D[@]:0:4}"
twin data-all9.jsonl run-t1-s9 run-t1-s8 500 9 1e-3 "${D[@]:0:5}"
twin data-all10.jsonl run-t1-s10 run-t1-s9 500 10 1e-3 "${D[@]}"

B="$HERE/../dflash2_mlx/bench_data"
[[ -f eval-twin/report.md ]] || dflash2-mlx eval -d v1=run-t1-s10/final -d v2=run-s10/final \
    -b "$B/gsm8k_test.jsonl" -b "$B/math500.jsonl" -b "$B/humaneval.jsonl" -b "$B/mbpp_test.jsonl" \
    -b "$B/mt_bench.jsonl" --limit 3 --max-tokens 48 --block-size 5 --temp 0 --temp 1 -o eval-twin
