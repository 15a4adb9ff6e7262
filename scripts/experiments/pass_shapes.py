"""A plain target pass over N rows against the pass the loop verifies N rows with (the
calibration's ``adaptive.costs.shaped``: a tree's rows as a tree pass, a hybrid's chain as a
tree of one path), the fastest of REPS rounds each, interleaved, on random targets shaped
like the built-in SmolLM2-135M (``hybrid_trees.py``): the llama and a qwen3_5 hybrid, at a
256-token context.

    python scripts/experiments/pass_shapes.py [--reps 20]
"""

import argparse
import time

import mlx.core as mx
from hybrid_trees import ATTENTION, HYBRID, random_model

from dflash2_mlx import tree as trees
from dflash2_mlx.calibration.measure import _pad, shaped
from dflash2_mlx.builtin.defaults import drafter_path
from dflash2_mlx.loop.target import attach
from dflash2_mlx.model.checkpoint import load_drafter


def timed(target, cache, rows, tree) -> float:
    tic = time.perf_counter()
    if tree is None:
        mx.eval(target(mx.zeros((1, rows), dtype=mx.int32), cache))
    else:
        mx.eval(target.verifiers.tree(tree, cache))
        trees.compact(cache, rows, list(range(rows)))
    seconds = time.perf_counter() - tic
    for c in cache:
        if c.is_trimmable():
            c.trim(rows)
    return seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    drafter = load_drafter(drafter_path())
    depth = drafter.config.block_size - 1
    for name, config in (("llama", ATTENTION), ("qwen3_5", HYBRID)):
        target = attach(random_model(config), drafter)
        cache = target.make_cache()
        target(mx.zeros((1, 1), dtype=mx.int32), cache)
        _pad(cache, 255)
        print(f"{name}, context 256")
        for rows in (5, 8, 9, 17, 33):
            tree = shaped(target, cache, rows, depth)
            plain = loop = float("inf")
            for _ in range(args.reps):
                plain = min(plain, timed(target, cache, rows, None))
                loop = min(loop, timed(target, cache, rows, tree))
            kind = "plain" if tree is None else "a tree of one path" if tree.depths.max() == rows - 1 else "a tree"
            print(f"  {rows} rows: plain pass {plain * 1e3:.1f} ms, as the loop verifies them ({kind}) "
                  f"{loop * 1e3:.1f} ms ({loop / plain:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
