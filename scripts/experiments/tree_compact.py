"""What moving a tree's accepted rows in the KV cache costs as the context grows: the way
``tree/target_pass.compact`` did it before 2026-12-05 (the rows written back from an
expression of the cache itself, which makes MLX copy the whole cache) against ``compact``
itself (the rows gathered and evaluated first, then written in place).  24 layers of 8 KV
heads x 64, a 17-row tree pass, a path of 4 nodes.

    python scripts/experiments/tree_compact.py
"""

import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from dflash2_mlx.tree import compact

PATH = [0, 2, 5, 9]
ROWS = 17


def copied(cache, rows, path):
    for c in cache:
        start = c.offset - rows
        src = mx.array(np.array(path, dtype=np.int32) + start)
        for a in (c.keys, c.values):
            a[..., start : start + len(path), :] = a[..., src, :]
        c.trim(rows - len(path))


def caches(n, layers=24):
    out = []
    for _ in range(layers):
        c = KVCache()
        k = mx.random.normal((1, 8, n, 64))
        c.update_and_fetch(k, mx.array(k))
        t = mx.random.normal((1, 8, ROWS, 64))
        c.update_and_fetch(t, mx.array(t))
        out.append(c)
    mx.eval([x for c in out for x in (c.keys, c.values)])
    return out


for n in (1024, 8192, 32768):
    for name, fn in (("before", copied), ("compact", compact)):
        cache = caches(n)
        tic = time.perf_counter()
        fn(cache, ROWS, PATH)
        mx.eval([x for c in cache for x in (c.keys, c.values)])
        print(f"context {n:6d}: {name:8s} {(time.perf_counter() - tic) * 1e3:8.2f} ms")
