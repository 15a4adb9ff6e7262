"""Where a DFlash cycle's time goes on the built-in pair (SmolLM2-135M-Instruct + the
shipped DFlash 2 drafter): target passes over 1..8 rows, the drafter pass, its LM head,
the whole propose step.  Prints milliseconds (mean of 10 after a warm-up).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python scripts/profile_cycle.py
"""

import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from dflash2_mlx import load
from dflash2_mlx.defaults import default_pair
from dflash2_mlx.drafter import propose
from dflash2_mlx.sampling import SamplingParams
from dflash2_mlx.target import attach


def ms(f, n=10):
    f()
    tic = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - tic) / n * 1e3


def main():
    model, tok, drafter = load(*default_pair())
    target = attach(model, drafter)
    ids = mx.array([tok.encode("Explain how a hash table works in Python. " * 5)])
    for rows in (1, 2, 5, 8):
        cache = make_prompt_cache(model)
        mx.eval(model(ids, cache=cache))

        def step():
            mx.eval(model(mx.array([[5] * rows]), cache=cache))
            for c in cache:
                c.trim(rows)

        print(f"target pass, {rows} row(s): {ms(step):.1f} ms")
    _, features = target(ids, make_prompt_cache(model))
    draft_cache = drafter.make_cache()
    drafter.append_context(features, draft_cache)
    block = mx.array([[5] + [drafter.config.mask_token_id] * 4])
    print(f"drafter pass (block 5): {ms(lambda: mx.eval(drafter(block, draft_cache))):.1f} ms")
    h = drafter(block, draft_cache)
    mx.eval(h)
    print(f"drafter logits, 4 rows (target LM head): {ms(lambda: mx.eval(drafter.logits(h[0, 1:]))):.1f} ms")
    greedy = SamplingParams()
    print(f"propose (logits + selector walk): "
          f"{ms(lambda: mx.eval(propose(drafter, h, mx.array(5), greedy)[0])):.1f} ms")


if __name__ == "__main__":
    main()
