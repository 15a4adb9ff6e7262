#!/usr/bin/env bash
# How does the DFlash 2 / v1 comparison change with the training budget (steps, depth)?
#
# The recipe's DFlash 2 / v1 comparison (train_smollm2_drafters.sh stage 4) at other budgets:
# the same first 640 records, flags, seed and warm start (the target's layers 28 and 29);
# only the number of steps differs (its learning-rate schedule with it). Then both side by
# side on the five sets, into WORK_DIR/pair-budgets/eval-STEPS.
#
#   scripts/recipe/pair_at_budget.sh WORK_DIR STEPS...     (e.g. ~/.cache/dflash2-work 100)
#
# Needs the recipe's data.jsonl (its stage 2, or DATA_ONLY=1) in WORK_DIR. Resumes (features
# written once, checkpoints every 25 steps; what it took when it ran: HISTORY.md).
#
# Other drafters than the recipe's:
#   LAYERS=4       both drafters 4 layers deep, starting as the target's last four (26-29);
#                  runs and reports carry -L4
#   VERSIONS=2     only the DFlash 2 drafter (its report alone carries -v2)
#   BLOCKS="5 8"   evaluated at these block sizes (default 5)
set -euo pipefail
WORK=${1:?WORK_DIR}
shift
source "$(dirname "$0")/recipe_phases.sh"  # HERE, T, OpenBLAS, cd WORK
mkdir -p pair-budgets
cd pair-budgets
[[ -f data-first.jsonl ]] || head -n 640 ../data.jsonl > data-first.jsonl
[[ -f features-first.safetensors ]] ||
    python "$T" features data-first.jsonl features-first.safetensors --max-len 448 --batch 8
B="$HERE/../../dflash2_mlx/builtin/bench_data"
BLOCKS=${BLOCKS:-5}
LAYERS=${LAYERS:-2}
VERSIONS=${VERSIONS:-2 1}
# The warm start follows from the depth (the target's last LAYERS of its 30 layers), so a run's
# name says all that differs from the recipe and a resumed run is never another one's.
WARM=$(seq -s, $((30 - LAYERS)) 29)
depth=""
(( LAYERS == 2 )) || depth=-L$LAYERS
only=""
[[ $VERSIONS == "2 1" ]] || only=-v${VERSIONS// /}
for steps in "$@"; do
    drafters=()
    for v in $VERSIONS; do
        run=run-v$v-$steps$depth
        [[ -d $run/final ]] || python "$T" train --version $v data-first.jsonl features-first.safetensors \
            "$run" --steps "$steps" --lr 2e-3 --batch-size 8 --max-anchors 32 --max-len 448 --seed 0 \
            --save-every 25 --min-block-size 3 --distill 1 --sliding-window 64 --layers "$LAYERS" \
            --warm-layers "$WARM" > "train-v$v-$steps$depth.log" 2>&1
        drafters=(-d "v$v=$run/final" "${drafters[@]}")  # v1 first, as the pair's reports list it
    done
    for b in $BLOCKS; do
        out=eval-$steps$depth$only
        (( b == 5 )) || out=$out-b$b
        [[ -f $out/report.md ]] || dflash2-mlx eval "${drafters[@]}" \
            -b "$B/gsm8k_test.jsonl" -b "$B/math500.jsonl" -b "$B/humaneval.jsonl" -b "$B/mbpp_test.jsonl" \
            -b "$B/mt_bench.jsonl" --limit 3 --max-tokens 48 --block-size "$b" --temp 0 --temp 1 -o "$out"
    done
done
