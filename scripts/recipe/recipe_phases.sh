# What do the recipe's scripts share? Their setup and one training phase of the shipped DFlash
# 2 drafter.
#
# Sourced by train_smollm2_drafters.sh and train_v1_twin.sh once WORK is set: OpenBLAS
# preloaded (Linux), the work directory made and entered, and one training phase of the
# shipped drafter, so that the v1 twin trains exactly as the shipped DFlash 2 drafter did.
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
if [[ "$(uname)" == Linux && -f $OPENBLAS ]]; then export LD_PRELOAD=$OPENBLAS; fi
mkdir -p "$WORK"
cd "$WORK"
T="$HERE/train_smollm2_drafters.py"

# A phase of the shipped drafter (stages 5 to 11): a DFlash $1 drafter, the run $3 on the
# data $2 with the first records' features and those of the later rounds ($8...), the last
# 64 records held out (never trained on; held-out figures every 50 steps in the log); from
# $4/final, or from the target's layers 28 and 29 when $4 is empty; $5 steps at lr $7, seed $6.
phase() {
    local version=$1 data=$2 run=$3 init=$4 steps=$5 seed=$6 lr=$7 more=() start=(--warm-layers 28,29) f
    shift 7
    for f in "$@"; do more+=(--more-features "$f"); done
    [[ -z $init ]] || start=(--init "$init/final")
    python "$T" train --version "$version" "$data" features.safetensors "${more[@]}" "$run" "${start[@]}" \
        --steps "$steps" --lr "$lr" --batch-size 8 --max-anchors 32 --max-len 448 --seed "$seed" \
        --val-records 64 --val-every 50 --save-every 25 --min-block-size 3 --distill 1 --sliding-window 64 \
        > "train-${run#run-}.log" 2>&1
}
