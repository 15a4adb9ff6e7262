#!/usr/bin/env bash
# The recipe's DFlash 2 / v1 comparison (train_smollm2_drafters.sh stage 4) at other budgets:
# the same first 640 records, flags, seed and warm start (the target's layers 28 and 29);
# only the number of steps differs (its learning-rate schedule with it). Then both side by
# side on the five sets, into WORK_DIR/pair-budgets/eval-STEPS.
#
#   scripts/pair_at_budget.sh WORK_DIR STEPS...     (e.g. ~/.cache/dflash2-work 100)
#
# Needs the recipe's data.jsonl (its stage 2, or DATA_ONLY=1) in WORK_DIR. Resumes (features
# written once, checkpoints every 25 steps). 100 steps: features of the 640 records ~12 min,
# ~5 s a step for each drafter with the recipe sharing the CPU, the eval ~8 min.
set -euo pipefail
WORK=${1:?WORK_DIR}
shift
source "$(dirname "$0")/recipe_phases.sh"  # HERE, T, OpenBLAS, cd WORK
mkdir -p pair-budgets
cd pair-budgets
[[ -f data-first.jsonl ]] || head -n 640 ../data.jsonl > data-first.jsonl
[[ -f features-first.safetensors ]] ||
    python "$T" features data-first.jsonl features-first.safetensors --max-len 448 --batch 8
B="$HERE/../dflash2_mlx/bench_data"
BLOCKS=${BLOCKS:-5}
for steps in "$@"; do
    for v in 2 1; do
        [[ -d run-v$v-$steps/final ]] || python "$T" train --version $v data-first.jsonl features-first.safetensors \
            run-v$v-$steps --steps "$steps" --lr 2e-3 --batch-size 8 --max-anchors 32 --max-len 448 --seed 0 \
            --save-every 25 --min-block-size 3 --distill 1 --sliding-window 64 --warm-layers 28,29 \
            > train-v$v-$steps.log 2>&1
    done
    for b in $BLOCKS; do
        out=eval-$steps
        (( b == 5 )) || out=eval-$steps-b$b
        [[ -f $out/report.md ]] || dflash2-mlx eval -d v1=run-v1-$steps/final -d v2=run-v2-$steps/final \
            -b "$B/gsm8k_test.jsonl" -b "$B/math500.jsonl" -b "$B/humaneval.jsonl" -b "$B/mbpp_test.jsonl" \
            -b "$B/mt_bench.jsonl" --limit 3 --max-tokens 48 --block-size "$b" --temp 0 --temp 1 -o "$out"
    done
done
