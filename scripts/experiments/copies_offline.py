"""How deep are copies and the drafter's walk accepted, offline, and what would verifying both add?

How far copies (``loop/lookup.py``) and the drafter's selector walk are accepted, offline.

Teacher-forced on the target's greedy responses to benchmark prompts: at every position of
a response with a full block after it, the drafter's greedy walk (as ``dflash2-mlx eval``
scores it) and, where the last tokens repeat, the copy ``Lookup`` offers; how many leading
tokens of each equal the target's own.  Prints, per set, the share of positions with a copy
on offer, the mean accepted depth of copy and walk there, and tau with the walk alone,
against copying where a copy is on offer and drafting elsewhere, and against verifying
both wherever a copy is on offer (a two-branch tree: an upper bound on what that would add).

    python scripts/experiments/copies_offline.py --first 3 --last 8 --max-tokens 128 --block-size 5
"""

import argparse

import mlx_lm
import numpy as np

from dflash2_mlx.builtin.bench_sets import default_bench_files
from dflash2_mlx.builtin.defaults import drafter_path
from dflash2_mlx.eval.evaluate import greedy_responses, leading, offline_hits
from dflash2_mlx.eval.prompts import load_benches
from dflash2_mlx.model.checkpoint import load_drafter
from dflash2_mlx.loop.lookup import MIN_N, Lookup
from dflash2_mlx.builtin.smollm2 import default_target_path
from dflash2_mlx.loop.target import attach


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--first", type=int, default=3, help="first prompt of each set (0-based)")
    ap.add_argument("--last", type=int, default=8, help="end of the prompt range (exclusive)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--draft", default=None, help="drafter directory (default: the shipped DFlash 2)")
    ap.add_argument("--min-n", type=int, default=MIN_N, help="shortest repeat that offers a copy")
    args = ap.parse_args()
    B, T = args.block_size, args.block_size - 1
    model, tok = mlx_lm.load(str(default_target_path()))
    drafter = load_drafter(args.draft or str(drafter_path()), target=model)
    target = attach(model, drafter)
    sets = load_benches(default_bench_files(), args.last)
    rows = {}
    for name, prompts in sets.items():
        out = []
        for ids, start in greedy_responses(model, tok, prompts[args.first : args.last], args.max_tokens):
            _, _, walk = offline_hits(target, drafter, ids, start, B, 16)
            anchors = range(max(start, 1), len(ids) - B + 1)
            copier = Lookup(ids[: anchors.start], min_n=args.min_n)
            for j, a in enumerate(anchors):
                copier.extend([ids[a]])
                copy = copier.draft(T)
                depth = -1  # no copy on offer
                if copy:
                    depth = int(leading((np.array(copy) == np.array(ids[a + 1 : a + B]))[None])[0])
                out.append((int(leading(walk[j : j + 1])[0]), depth))
        rows[name] = np.array(out)
    rows["overall"] = np.concatenate(list(rows.values()))
    for name, r in rows.items():
        walk, copy = r[:, 0], r[:, 1]
        on = copy >= 0
        both = np.where(on, copy, walk)
        print(f"{name}: {len(r)} positions, a copy on offer at {on.mean():.0%}; there copy "
              f"{copy[on].mean() if on.any() else 0:.2f} deep, walk {walk[on].mean() if on.any() else 0:.2f}; "
              f"tau walk {1 + walk.mean():.2f}, copies + walk {1 + both.mean():.2f}, "
              f"either (both verified where a copy is on offer) {1 + np.maximum(walk, copy).mean():.2f}")


if __name__ == "__main__":
    main()
