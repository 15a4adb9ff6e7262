"""What does exact=True cost on this machine, and does it change the text?

The built-in pair, prompts of the five benchmark sets, greedy, --max-tokens each: plain
mlx-lm decoding, DFlash 2 by default, DFlash 2 with exact=True (the row-exact pass where the
probe found it exact) and with exact=True forced to one-row steps, side by side in one process
(each prompt runs the four in turn, after one warm-up prompt). Prints the machine's exactness
verdict, tokens per second of each and how many outputs equal plain decoding's.

    python scripts/experiments/exact_cost.py [--prompts 10] [--max-tokens 64] [--block-size auto] [--bits 4]

``--bits``: quantize the target's linear layers first (group 64), as a 4-bit target is run.
"""

import argparse
import dataclasses
import time


from dflash2_mlx import load, stream_generate
from dflash2_mlx.builtin.bench_sets import SHIPPED_BENCH_DIR
from dflash2_mlx.calibration import exactness
from dflash2_mlx.train.data import read_prompts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block-size", default="auto")
    ap.add_argument("--bits", type=int, default=None)
    args = ap.parse_args()
    block = args.block_size if args.block_size == "auto" else int(args.block_size)
    model, tok, drafter = load()
    if args.bits:
        import mlx.nn as nn

        nn.quantize(model, group_size=64, bits=args.bits,
                    class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 64 == 0)
    verdict = exactness.verdict(model)
    print("verdict:", verdict.describe(), "| row-exact pass:", verdict.exact_pass or verdict.exact_pass_note)
    measured = exactness.verdict
    sets = [read_prompts(p, limit=args.prompts) for p in sorted(SHIPPED_BENCH_DIR.glob("*.jsonl"))]
    prompts = [ps[i][1] for i in range(args.prompts) for ps in sets if i < len(ps)][: args.prompts + 1]
    runs = {"plain": dict(), "default": dict(drafter=drafter, block_size=block),
            "exact": dict(drafter=drafter, block_size=block, exact=True),
            "steps": dict(drafter=drafter, block_size=block, exact=True)}
    secs, toks, same = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0), dict.fromkeys(runs, 0)
    for i, p in enumerate(prompts):
        out = {}
        for name, kw in runs.items():
            # "steps": the same verdict but for the pass, so exact=True takes one-row steps.
            exactness.verdict = (lambda m: dataclasses.replace(verdict, exact_pass=False)) if name == "steps" else measured
            tic = time.perf_counter()
            out[name] = [r.token for r in stream_generate(model, tok, p, max_tokens=args.max_tokens, **kw)]
            if i:  # the first prompt warms up (and calibrates)
                secs[name] += time.perf_counter() - tic
                toks[name] += len(out[name])
        if i:
            for name in runs:
                same[name] += out[name] == out["plain"]
    n = len(prompts) - 1
    for name in runs:
        print(f"{name:8s} {toks[name] / secs[name]:6.1f} tok/s  {toks[name] / secs[name] / (toks['plain'] / secs['plain']):.2f}x plain"
              f"  identical to plain {same[name]}/{n}")


if __name__ == "__main__":
    main()
