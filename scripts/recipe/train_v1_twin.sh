#!/usr/bin/env bash
# Is DFlash 2 better than DFlash v1 at an identical budget at the shipped scale? The v1 twin,
# trained and evaluated beside it.
#
# The DFlash v1 twin of the shipped DFlash 2 drafter, for "DFlash 2 vs v1 at an identical
# budget" at the shipped scale (the recipe's own pair, stage 4, is 640 records and 500 steps):
# stages 5-11 of train_smollm2_drafters.sh again with --version 1 - the same records,
# features, held-out records, steps, learning rates, seeds, warm start (the target's layers
# 28 and 29) and window - then both drafters evaluated side by side on the five sets.
#
#   scripts/recipe/train_v1_twin.sh [WORK_DIR]      (default: ~/.cache/dflash2-work)
#
# Run it after train_smollm2_drafters.sh has finished in the same work directory (or its data
# stages alone: DATA_ONLY=1): it reads that script's data and features and writes only
# run-t1-*, shipped-t1-s10 and eval-twin. It resumes the same way (every run restarts from
# its last checkpoint, every 25 steps). What it took when it ran: HISTORY.md.
set -euo pipefail
WORK=${1:-$HOME/.cache/dflash2-work}
source "$(dirname "$0")/recipe_phases.sh"  # HERE, T, OpenBLAS, cd WORK, phase

D=(features-d.safetensors features-d2.safetensors features-d3.safetensors features-m1.safetensors
   features-m2new.safetensors features-m3new.safetensors)
phase 1 data.jsonl run-t1-s4 "" 800 3 2e-3
phase 1 data-all5.jsonl run-t1-s5 run-t1-s4 600 5 1e-3 "${D[@]:0:1}"
phase 1 data-all6.jsonl run-t1-s6 run-t1-s5 600 6 1e-3 "${D[@]:0:2}"
phase 1 data-all7.jsonl run-t1-s7 run-t1-s6 700 7 1e-3 "${D[@]:0:3}"
phase 1 data-all8.jsonl run-t1-s8 run-t1-s7 500 8 1e-3 "${D[@]:0:4}"
phase 1 data-all9.jsonl run-t1-s9 run-t1-s8 500 9 1e-3 "${D[@]:0:5}"
phase 1 data-all10.jsonl run-t1-s10 run-t1-s9 500 10 1e-3 "${D[@]}"

# Side by side with the recipe's own DFlash 2 run; after DATA_ONLY=1 (no DFlash 2 trained here)
# with the shipped one, which the same recipe made, both then 8-bit as shipped.
B="$HERE/../../dflash2_mlx/builtin/bench_data"
V1=run-t1-s10/final V2=run-s10/final
if [[ ! -d $V2 ]]; then
    V2="$HERE/../../dflash2_mlx/builtin/drafters/smollm2-135m-dflash2" V1=shipped-t1-s10
    [[ -d $V1 ]] || python "$T" ship run-t1-s10/final "$V1" --bits 8 --data data-all10.jsonl --warm-layers 28,29
fi
[[ -f eval-twin/report.md ]] || dflash2-mlx eval -d v1="$V1" -d v2="$V2" \
    -b "$B/gsm8k_test.jsonl" -b "$B/math500.jsonl" -b "$B/humaneval.jsonl" -b "$B/mbpp_test.jsonl" \
    -b "$B/mt_bench.jsonl" --limit 3 --max-tokens 48 --block-size 5 --temp 0 --temp 1 -o eval-twin
