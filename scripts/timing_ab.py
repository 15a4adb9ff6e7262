"""Adaptive decoding pricing its cycles at what they really took (``adaptive.Timing``, the
default) against pricing them at the calibration alone, alternating, on the bench's prompts
(T=0, copies on, as ``generate`` runs by default).  Each arm starts every round from no
timing; requests within a round share it, as a server's or the bench's do.

    python scripts/timing_ab.py                      # this machine's cached calibration
    python scripts/timing_ab.py --costs COSTS.json   # decide with another cost file, e.g.
                                                     # one measured while the CPU was busy

Prints seconds per round for each arm (generation only, the 10 prompts together).
"""

import argparse
import json
import time
from collections import Counter

import mlx.core as mx

import dflash2_mlx as d
from dflash2_mlx import adaptive
from dflash2_mlx.eval.bench import default_bench_files, sample_prompts
from dflash2_mlx.loop.cycle import speculative_generate_step
from dflash2_mlx.loop.target import attach
from dflash2_mlx.train.data import encode


def run_all(target, drafter, prompts, max_tokens: int, timed: bool) -> tuple:
    """Seconds and tokens over all prompts; one shared Timing per arm and round."""
    key = adaptive.cost_key(target, drafter)
    costs = adaptive.cost_model(target, drafter)
    adaptive._timings[key] = (costs.created, adaptive.Timing())  # from nothing, not from disk
    seconds = tokens = 0
    blocks = Counter()
    for ids in prompts:
        policy = adaptive.policy(target, drafter) if timed else adaptive.policy(target, drafter, costs=costs)
        tic = time.perf_counter()
        for *_, stats in speculative_generate_step(mx.array(ids), target, drafter,
                                                   max_tokens=max_tokens, block_size=policy):
            tokens += 1
        seconds += time.perf_counter() - tic
        blocks.update(stats.block_sizes)
        blocks["copies"] += stats.copies
    return seconds, tokens, dict(sorted(blocks.items(), key=str))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", help="a cost file (adaptive/costs-*.json) to decide with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=2, help="prompts per benchmark set")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    model, tok, drafter = d.load()
    target = attach(model, drafter)
    if args.costs:
        costs = adaptive.CostModel.from_json(json.load(open(args.costs)))
        costs.created = time.time()  # as if measured now: used as it is, never remeasured
        adaptive._costs[adaptive.cost_key(target, drafter)] = costs
    prompts = [encode(tok, p) for ps in sample_prompts(default_bench_files(), args.samples).values()
               for p in ps]
    run_all(target, drafter, prompts[:1], 8, True)  # warm-up (and calibration, if none is cached)
    totals = {True: [], False: []}
    for r in range(args.rounds):
        for timed in (True, False):
            seconds, tokens, blocks = run_all(target, drafter, prompts, args.max_tokens, timed)
            totals[timed].append(seconds)
            print(f"round {r} {'timed' if timed else 'calibration only'}: {seconds:.2f} s, "
                  f"{tokens / seconds:.1f} tok/s, blocks {blocks}", flush=True)
            if timed:  # what the timing learned: observed / priced, per kind and block size
                t = adaptive._timings[adaptive.cost_key(target, drafter)][1]
                print("  observed / priced:", {k: round(t.observed[k] / t.predicted[k], 2)
                                               for k in sorted(t.observed)}, flush=True)
    on, off = sum(totals[True]), sum(totals[False])
    print(f"timed {on:.2f} s vs calibration only {off:.2f} s: {off / on:.3f}x")
