"""Does adaptive decoding fall back to plain speed when the drafter is never right? The drafter for that bench.

A drafter that is never right, for the adaptive benchmark: the shipped DFlash 2 drafter's
config (same shapes, same cost) with random weights, 8-bit like the shipped one.

    python scripts/experiments/random_drafter.py /tmp/random-drafter
    dflash2-mlx bench --model ~/.cache/dflash2_mlx/SmolLM2-135M-Instruct \\
        --drafter-v2 /tmp/random-drafter --no-v1 --samples 1 --temp 0
"""

import argparse

import mlx.core as mx

from dflash2_mlx.builtin.defaults import drafter_path
from dflash2_mlx.model.drafter import Drafter
from dflash2_mlx.model.checkpoint import load_drafter, quantize, save_drafter

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="directory to write the random drafter to")
    out = ap.parse_args().out
    config = load_drafter(str(drafter_path())).config
    mx.random.seed(0)
    drafter = Drafter(config)
    quantize(drafter, 8, 64)
    save_drafter(drafter, out)
    print(out)
