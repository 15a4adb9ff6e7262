#!/usr/bin/env bash
# What does the lent GPU machine do with its minutes? Install MLX's CUDA build, let the target
# write prompts and answer them in large batches, train the drafter for a fixed wall-clock
# budget, evaluate it, and hand back the drafter, the data and the logs.
#
#   bash scripts/recipe/gpu/run.sh CARRY_DIR        (on the GPU machine, from the checkout)
#   DEVICE=cpu INSTALL=0 TOY=1 OUT=/tmp/gpu-out bash scripts/recipe/gpu/run.sh .carry   (rehearsal)
#   DATA=docs/results/gpu-2026-12-04/data.jsonl.xz ... run.sh CARRY_DIR   (reuse a dataset: train only)
#
# CARRY_DIR holds the payload's parts (prepare.sh).  Every phase has a time budget in seconds
# (the variables below) and the script ends within their sum plus setup; the results go to
# $OUT as they are made, at most 8 files of at most 16 MiB (the device tool's limit), so a run
# stopped early still returns what it finished:
#   run.log, logs.tar.xz (train log, eval report, timings, stats), drafter-bf16.tar.part-*
#   (the final drafter in bf16), data.jsonl.xz.part-* (the generated dataset).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
CARRY=$(realpath "${1:?usage: run.sh CARRY_DIR}")
OUT=${OUT:?set OUT to the folder that comes back}
DEVICE=${DEVICE:-gpu}
INSTALL=${INSTALL:-1}
W=${WORK:-/tmp/dflash2-gpu}
TOY=${TOY:-0}
if (( TOY )); then   # the same script at a size this CPU runs in minutes
    : "${MAGPIE_N:=16}" "${MAGPIE_BATCH:=8}" "${GEN_BATCH:=8}" "${GEN_MAX_TOKENS:=24}" "${PROMPT_LIMIT:=48}"
    : "${T0_SECONDS:=60}" "${T1_SECONDS:=30}" "${MAGPIE_SECONDS:=30}" "${TRAIN_SECONDS:=30}"
    : "${PROBE_SECONDS:=120}" "${PROBE_PROMPTS:=1}" "${TIMING_STEPS:=8}"
    : "${TRAIN_BATCH:=4}" "${VAL_RECORDS:=4}" "${EVAL_LIMIT:=1}" "${EVAL_TOKENS:=12}" "${EVAL_SECONDS:=120}"
fi
MAGPIE_N=${MAGPIE_N:-8192}; MAGPIE_BATCH=${MAGPIE_BATCH:-512}; MAGPIE_SECONDS=${MAGPIE_SECONDS:-45}
PROBE_SECONDS=${PROBE_SECONDS:-55}; PROBE_PROMPTS=${PROBE_PROMPTS:-10}
GEN_BATCH=${GEN_BATCH:-256}; GEN_MAX_TOKENS=${GEN_MAX_TOKENS:-256}; PROMPT_LIMIT=${PROMPT_LIMIT:-1000000}
T0_SECONDS=${T0_SECONDS:-110}; T1_SECONDS=${T1_SECONDS:-50}
TRAIN_SECONDS=${TRAIN_SECONDS:-190}; TRAIN_BATCH=${TRAIN_BATCH:-64}; LR=${LR:-1.5e-3}
VAL_RECORDS=${VAL_RECORDS:-128}; TIMING_STEPS=${TIMING_STEPS:-30}
EVAL_LIMIT=${EVAL_LIMIT:-2}; EVAL_TOKENS=${EVAL_TOKENS:-48}; EVAL_SECONDS=${EVAL_SECONDS:-120}
mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/run.log") 2>&1
T_START=$(date +%s)
phase() { echo "=== $(( $(date +%s) - T_START )) s: $*"; }
PART=15000000   # bytes per returned file (the tool's limit is 16 MiB)

logs() {  # everything small, re-packed after every phase (by either side of a parallel phase)
    local tmp=$W/logs.$BASHPID.tar.xz
    tar -C "$W" -cf - --ignore-failed-read timings.txt stats.json run/log.jsonl run/loss.png \
        timing/log.jsonl eval probe side.log 2>/dev/null | xz -T0 > "$tmp" && mv -f "$tmp" "$OUT/logs.tar.xz"
}
timed() {  # timed NAME SECONDS CMD...: run CMD for at most SECONDS, record how long it took
    local name=$1 secs=$2 t0 rc; shift 2
    t0=$(date +%s)
    timeout --signal=INT --kill-after=10 "$secs" "$@"; rc=$?
    echo "$name $(( $(date +%s) - t0 )) s (rc $rc)" >> "$W/timings.txt"
    logs
    return $rc
}

phase "setup: payload, install"
if [[ ! -d $W/payload ]]; then
    cat "$CARRY"/payload.part-* > "$W/payload.tar.xz"
    if [[ -f $CARRY/payload.sha256 ]] && [[ $(sha256sum "$W/payload.tar.xz" | cut -d' ' -f1) != $(cat "$CARRY/payload.sha256") ]]; then
        echo "payload checksum mismatch: a part is missing or torn"; ls -la "$CARRY"; exit 3
    fi
    mkdir -p "$W/payload" && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$W/payload.tar.xz" "$W/payload" || exit 3
fi
P=$W/payload
if (( INSTALL )); then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" "$P"/wheels/*.whl || exit 4
fi
# The package as pyproject.toml maps it (cli/ and metal/ inside dflash2_mlx), without a build.
rm -rf "$W/pkg" && mkdir -p "$W/pkg"
cp -r "$ROOT/dflash2_mlx" "$W/pkg/" && cp -r "$ROOT/cli" "$W/pkg/dflash2_mlx/cli" && cp -r "$ROOT/metal" "$W/pkg/dflash2_mlx/metal"
export PYTHONPATH=$W/site:$W/pkg${PYTHONPATH:+:$PYTHONPATH}
export DFLASH2_MLX_HOME=$W/home PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
cd "$W"  # not the checkout: python -m / - would import its unmapped dflash2_mlx first
mkdir -p "$W/home/gguf" && cp -n "$P"/gguf/*.gguf "$W/home/gguf/"
DF=(python3 -m dflash2_mlx.cli.main)
python3 - <<'PYEOF' || exit 5
import time, mlx.core as mx
print("mlx", mx.__version__, "default device", mx.default_device(), "gpu available", mx.is_available(mx.gpu))
from dflash2_mlx.builtin.smollm2 import default_target_path
print("target", default_target_path())
PYEOF
TARGET=$W/home/SmolLM2-135M-Instruct
echo "setup $(( $(date +%s) - T_START )) s" >> "$W/timings.txt"

if [[ -n ${DATA:-} ]]; then  # a dataset made before (e.g. docs/results/gpu-*/data.jsonl.xz): train only
    phase "dataset $DATA"
    if [[ $DATA == *.xz ]]; then xz -dc "$DATA" > "$W/data.jsonl"; else cp "$DATA" "$W/data.jsonl"; fi
    python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; json.dump({'records': len(r), 'response_tokens': sum(len(x['response_ids']) for x in r), 'reused': sys.argv[2]}, open(sys.argv[3], 'w'))" "$W/data.jsonl" "$DATA" "$W/stats.json"
else
# The GPU is far from busy with one 135M model: the target answers the prompts made on the
# CPU at T=0 while, beside it, it writes prompts of its own (Magpie) and the exactness probe
# runs; then it answers its own prompts and the rest at T=1.
phase "responses at T=0 ($T0_SECONDS s) | Magpie prompts ($MAGPIE_SECONDS s), then the exactness probe"
(
    cd "$W"
    (( MAGPIE_SECONDS > 0 )) && timed magpie "$MAGPIE_SECONDS" python3 "$ROOT/scripts/recipe/make_magpie_prompts.py" "$W/magpie.jsonl" \
        --n "$MAGPIE_N" --batch "$MAGPIE_BATCH" --max-tokens 128 --seed 21 --model "$TARGET"
    [[ -f $ROOT/scripts/recipe/gpu/probe.py ]] && (( PROBE_SECONDS > 0 )) && timed probe "$PROBE_SECONDS" python3 "$ROOT/scripts/recipe/gpu/probe.py" \
        --model "$TARGET" --draft "$P/drafter" --out "$W/probe" --prompts "$PROBE_PROMPTS"
) > "$W/side.log" 2>&1 &
SIDE=$!
timed data-T0 "$T0_SECONDS" "${DF[@]}" train --data-only --prompts "$P/prompts/cpu.jsonl" --data "$W/data-T0.jsonl" \
    --out "$W/run" --model "$TARGET" --device "$DEVICE" --prompt-limit "$PROMPT_LIMIT" \
    --gen-max-tokens "$GEN_MAX_TOKENS" --gen-batch-size "$GEN_BATCH" --gen-temp 0 --gen-by-length
wait $SIDE; cat "$W/side.log"
touch "$W/magpie.jsonl" "$W/data-T0.jsonl"
python3 - "$P/prompts/cpu.jsonl" "$W/data-T0.jsonl" "$W/rest.jsonl" <<'PYEOF'
import json, sys
from dflash2_mlx.train.data import read_dataset
done = {r["id"] for r in read_dataset(sys.argv[2])}
lines = [l for i, l in enumerate(open(sys.argv[1])) if l.strip() and i not in done]
open(sys.argv[3], "w").write("".join(lines))
PYEOF
python3 "$ROOT/scripts/recipe/gpu/prompts.py" "$W/prompts-T1.jsonl" "$W/magpie.jsonl" "$W/rest.jsonl"
phase "responses at T=1, $T1_SECONDS s"
timed data-T1 "$T1_SECONDS" "${DF[@]}" train --data-only --prompts "$W/prompts-T1.jsonl" --data "$W/data-T1.jsonl" \
    --out "$W/run" --model "$TARGET" --device "$DEVICE" --prompt-limit "$PROMPT_LIMIT" \
    --gen-max-tokens "$GEN_MAX_TOKENS" --gen-batch-size "$GEN_BATCH" --gen-temp 1 --gen-by-length
touch "$W/data-T1.jsonl"
python3 - "$W/data-T0.jsonl" "$W/data-T1.jsonl" "$W/data.jsonl" "$W/stats.json" <<'PYEOF'
import json, sys
from dflash2_mlx.train.data import read_dataset
t0, t1 = read_dataset(sys.argv[1]), read_dataset(sys.argv[2])
with open(sys.argv[3], "w") as f:  # one dataset, ids renumbered; T=0 first, then T=1
    for i, r in enumerate(t0 + t1):
        f.write(json.dumps({**r, "id": i, "temp": 0.0 if i < len(t0) else 1.0}) + "\n")
recs = t0 + t1
stats = {"records": len(recs), "records_T0": len(t0), "records_T1": len(t1),
         "response_tokens": sum(len(r["response_ids"]) for r in recs),
         "response_tokens_T0": sum(len(r["response_ids"]) for r in t0),
         "prompt_tokens": sum(len(r["prompt_ids"]) for r in recs)}
json.dump(stats, open(sys.argv[4], "w"), indent=1); print(stats)
PYEOF
fi
logs
( xz -T4 -c "$W/data.jsonl" > "$W/data.jsonl.xz" && split -b $PART -d -a 1 "$W/data.jsonl.xz" "$OUT/data.jsonl.xz.part-" ) &
XZ=$!

TRAIN=(train --data "$W/data.jsonl" --model "$TARGET" --device "$DEVICE" --init "$P/drafter"
       --batch-size "$TRAIN_BATCH" --max-anchors 32 --max-len 448 --min-block-size 3 --distill 1
       --lr "$LR" --seed 31 --val-records "$VAL_RECORDS" --log-every 25)
phase "training: the step time, then $TRAIN_SECONDS s"
# The step time, from a short run: the first steps on a fresh machine include minutes of
# CUDA warm-up (60 s for the first step on 2026-12-04), so the median of the later ones.
TIMING=(--out "$W/timing" --steps 100000 --stop-after "$TIMING_STEPS" --log-every 1 --val-every 100000 --restart)
timed timing 240 "${DF[@]}" "${TRAIN[@]}" "${TIMING[@]}"
if [[ ! -s $W/timing/log.jsonl ]]; then  # e.g. out of memory: a quarter of the batch
    TRAIN_BATCH=$(( TRAIN_BATCH / 4 > 1 ? TRAIN_BATCH / 4 : 1 ))
    TRAIN+=(--batch-size "$TRAIN_BATCH")  # the last of a repeated option wins
    timed timing-retry 240 "${DF[@]}" "${TRAIN[@]}" "${TIMING[@]}"
fi
STEPS=$(python3 - "$W/timing/log.jsonl" "$TRAIN_SECONDS" <<'PYEOF'
import json, sys
secs = [json.loads(l)["sec"] for l in open(sys.argv[1])]
secs = secs[5:] or secs[1:] or secs
per = sorted(secs)[len(secs) // 2]
print(max(20, int(float(sys.argv[2]) / per)))
PYEOF
) || STEPS=200
echo "steps $STEPS" | tee -a "$W/timings.txt"
timed train $(( TRAIN_SECONDS + 90 )) "${DF[@]}" "${TRAIN[@]}" --out "$W/run" --steps "$STEPS" \
    --max-seconds "$TRAIN_SECONDS" --save-every 400 --keep 1 --val-every $(( STEPS / 4 > 0 ? STEPS / 4 : 1 ))
FINAL=$(ls -d "$W/run/final" "$W/run"/step-* 2>/dev/null | head -1)
if [[ -n $FINAL ]]; then
    python3 - "$FINAL" "$W/drafter-bf16" <<'PYEOF'
import shutil, sys
from pathlib import Path
import mlx.core as mx
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir(parents=True, exist_ok=True)
shutil.copy(src / "config.json", dst / "config.json")
w = mx.load(str(src / "model.safetensors"))
mx.save_safetensors(str(dst / "model.safetensors"),
                    {k: v.astype(mx.bfloat16) if v.dtype == mx.float32 else v for k, v in w.items()})
shutil.copy(src / "training_state" / "state.json", dst / "state.json")
PYEOF
    tar -C "$W" -cf - drafter-bf16 | split -b $PART -d -a 1 - "$OUT/drafter-bf16.tar.part-"
fi

phase "eval: shipped vs this, five sets, $EVAL_SECONDS s"
BENCH=()
for f in "$ROOT"/dflash2_mlx/builtin/bench_data/*.jsonl; do BENCH+=(-b "$f"); done
[[ -n $FINAL ]] && timed eval "$EVAL_SECONDS" "${DF[@]}" eval -d shipped="$P/drafter" -d gpu="$FINAL" "${BENCH[@]}" \
    --model "$TARGET" --limit "$EVAL_LIMIT" --max-tokens "$EVAL_TOKENS" --block-size 5 --temp 0 --temp 1 -o "$W/eval"

wait $XZ
logs
phase "done; $(ls "$OUT" | tr '\n' ' ')"
