"""Are DFlash's plain steps as fast as mlx-lm's at a long context?

Plain decode steps at a long context: mlx-lm's generate_step against ours at block size 1
(speculative_generate_step), after the same N-token prompt, 64 tokens each.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python scripts/experiments/plain_vs_block1_long.py 8160
"""

import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

from dflash2_mlx.generate import load
from dflash2_mlx.generate import speculative_generate_step
from dflash2_mlx.loop.target import attach

TOKENS = 64


def tokens_per_s(steps) -> float:
    """Generation speed after the first token (the prefill's)."""
    next(steps)
    tic, n = time.perf_counter(), 0
    for _ in steps:
        n += 1
    return n / (time.perf_counter() - tic)


if __name__ == "__main__":
    n = int(sys.argv[1])
    model, tok, drafter = load()
    ids = mx.array((tok.encode("The quick brown fox jumps over the lazy dog. ") * (n // 10 + 1))[:n])
    plain = tokens_per_s(generate_step(ids, model, max_tokens=TOKENS))
    ours = tokens_per_s(speculative_generate_step(ids, attach(model, drafter), drafter,
                                                  max_tokens=TOKENS, block_size=1))
    print(n, "plain", round(plain, 2), "ours block1", round(ours, 2), flush=True)
