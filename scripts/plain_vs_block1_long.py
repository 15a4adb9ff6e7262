"""Plain decode steps at a long context: mlx-lm's generate_step against ours at block size 1
(speculative_generate_step), after the same N-token prompt, 64 tokens each.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python scripts/plain_vs_block1_long.py 8160
"""
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from dflash2_mlx.generate import load
from dflash2_mlx.target import attach
from dflash2_mlx.speculative import speculative_generate_step
N = int(sys.argv[1]); T = 64
model, tok, drafter = load()
ids = mx.array((tok.encode("The quick brown fox jumps over the lazy dog. ") * (N // 10 + 1))[:N])
def run_plain():
    steps = generate_step(ids, model, max_tokens=T)
    next(steps); tic = time.perf_counter(); n = 0
    for _ in steps: n += 1
    return n / (time.perf_counter() - tic)
def run_ours():
    t = attach(model, drafter)
    steps = speculative_generate_step(ids, t, drafter, max_tokens=T, block_size=1)
    next(steps); tic = time.perf_counter(); n = 0
    for _ in steps: n += 1
    return n / (time.perf_counter() - tic)
for r in range(1):
    print(N, "plain", round(run_plain(), 2), "ours block1", round(run_ours(), 2), flush=True)
