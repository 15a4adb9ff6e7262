"""Would another way of choosing the draft path (Viterbi, best of n walks) accept more, and at what price?

How other ways of choosing a DFlash 2 draft path would fare, offline at T=0.

Teacher-forced on the target's own greedy responses (as ``dflash2-mlx eval`` does), every
full block of each response is drafted once and scored four ways: the greedy selector walk
(what the loop does), the path with the largest summed selector score (Viterbi), the best of
n walks that start from position 1's n best candidates (what verifying n paths in one batched
target pass would accept), and the oracle over the top-16 candidates. Then it times a target pass over one path's rows against
one over n paths' (a batch of n copies of a 150-token cache): the price of verifying them.

    python scripts/experiments/offline_paths.py --limit 4 --block-size 5
"""

import argparse
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from dflash2_mlx.builtin.bench_sets import SHIPPED_BENCH_DIR
from dflash2_mlx.eval.evaluate import drafted_blocks, greedy_responses, leading
from dflash2_mlx.eval.prompts import load_benches
from dflash2_mlx.generate import load
from dflash2_mlx.kernels.selector import walk_reference
from dflash2_mlx.loop.target import attach


def walk_from(scores, first):
    """The greedy walk with position 1's candidate index ``first`` [N] imposed."""
    keep = (mx.arange(scores.shape[-1]) == first[:, None])[:, None, None, :]
    forced = mx.concatenate([mx.where(keep, scores[:, :1], -mx.inf), scores[:, 1:]], axis=1)
    return walk_reference(forced)[0]


def viterbi(scores):
    s = np.array(scores)
    best, back = s[:, 0, 0, :], []
    for t in range(1, s.shape[1]):
        total = best[:, :, None] + s[:, t]
        back.append(total.argmax(1))
        best = total.max(1)
    last = best.argmax(1)
    path = [last]
    for b in reversed(back):
        last = b[np.arange(len(last)), last]
        path.append(last)
    return mx.array(np.stack(path[::-1], 1).astype(np.int32))


def pass_ms(model, paths: int, rows: int, reps: int = 20) -> float:
    """Median-ish time of one target pass over ``paths`` x ``rows`` after a 150-token prefix."""
    times = []
    for _ in range(reps):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([list(range(100, 250))]), cache=cache))
        for c in cache:
            c.keys, c.values = mx.repeat(c.keys, paths, 0), mx.repeat(c.values, paths, 0)
        mx.eval([c.state for c in cache])
        tic = time.perf_counter()
        mx.eval(model(mx.full((paths, rows), 5), cache=cache))
        times.append(time.perf_counter() - tic)
    times.sort()
    return 1000 * float(np.mean(times[reps // 5 : -reps // 5]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=4, help="prompts per benchmark set")
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--paths", type=int, default=4, help="the most walks verified at once")
    args = ap.parse_args()
    model, tok, drafter = load()
    if drafter.version != 2:
        raise SystemExit("a DFlash 2 drafter is needed: the paths come from its selector")
    target, sel, B = attach(model, drafter), drafter.candidate_selector, args.block_size
    totals, blocks = {}, 0
    for bench, prompts in load_benches(sorted(SHIPPED_BENCH_DIR.glob("*.jsonl")), args.limit).items():
        for i, (ids, start) in enumerate(greedy_responses(model, tok, prompts, args.max_tokens)):
            for labels, cand, scores in drafted_blocks(target, drafter, ids, start, B, sel.top_k, seed=i):
                right = lambda path: leading(np.array(
                    mx.take_along_axis(cand, path[..., None], axis=-1)[..., 0] == labels))
                firsts = mx.argsort(-scores[:, 0, 0], axis=-1).astype(mx.int32)
                walks = [right(walk_from(scores, firsts[:, j])) for j in range(args.paths)]
                rows = {"selector walk": walks[0], "Viterbi": right(viterbi(scores)),
                        **{f"best of {n} walks": np.max(walks[:n], axis=0) for n in range(2, args.paths + 1)},
                        "oracle top-16": leading(np.array((cand == labels[..., None]).any(-1)))}
                for name, accepted in rows.items():
                    totals[name] = totals.get(name, 0) + int(accepted.sum()) + len(accepted)
                blocks += len(walks[0])
        print(f"after {bench}: " + ", ".join(f"{k} {v / blocks:.3f}" for k, v in totals.items()), flush=True)
    print(f"\nτ at block {B}, T=0, over {blocks} blocks:")
    for name, total in totals.items():
        print(f"  {name:18s} {total / blocks:.3f}")
    one = pass_ms(model, 1, B)
    print(f"\ntarget pass over {B} rows (one path): {one:.1f} ms")
    for n in range(2, args.paths + 1):
        ms = pass_ms(model, n, B)
        print(f"target pass over {n} x {B} rows ({n} paths): {ms:.1f} ms ({ms / one:.2f}x)")


if __name__ == "__main__":
    main()
