"""What one chunk of a prompt costs at a long context: the time of a target pass over k
prompt tokens after a 2,500-token context, built-in target (a long prompt read beside
decoding requests is read in chunks bounded by their cycle: ``backend/batch_job.py``).

    python scripts/experiments/chunk_cost.py [--context 2500]
"""

import argparse
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

from dflash2_mlx.builtin.defaults import default_pair


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=2500)
    args = ap.parse_args()
    model, _ = mlx_lm.load(default_pair()[0])
    cache = make_prompt_cache(model)
    ids = mx.array([[(i * 7919) % 40000 + 10 for i in range(args.context)]])
    for i in range(0, args.context, 512):
        model(ids[:, i:i + 512], cache=cache)
        mx.eval([c.state for c in cache])
    for k in (1, 2, 4, 8, 16, 32, 64, 128):
        times = []
        for _ in range(5):
            x = mx.array([[11 + j for j in range(k)]])
            tic = time.perf_counter()
            model(x, cache=cache)
            mx.eval([c.state for c in cache])
            times.append(time.perf_counter() - tic)
            for c in cache:
                c.trim(k)
        m = sorted(times)[2]
        print(f"k={k:4d} chunk {m * 1e3:7.1f} ms  {k / m:7.1f} tok/s")


if __name__ == "__main__":
    main()
