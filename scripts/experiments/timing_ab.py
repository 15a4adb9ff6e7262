"""Does pricing adaptive cycles at what they really took beat pricing them at the calibration alone?

Adaptive decoding pricing its cycles at what they really took (``adaptive.Timing``, the
default) against pricing them at the calibration alone, alternating, on the bench's prompts
(T=0, copies on, as ``generate`` runs by default).  Each arm starts every round from no
timing; requests within a round share it, as a server's or the bench's do.

    python scripts/experiments/timing_ab.py                      # this machine's cached calibration
    python scripts/experiments/timing_ab.py --costs COSTS.json   # decide with another cost file, e.g.
                                                     # one measured while the CPU was busy

Prints seconds per round for each arm (generation only, the 10 prompts together).
"""

import argparse
import time
from collections import Counter

import mlx.core as mx

import dflash2_mlx as d
from dflash2_mlx import adaptive, calibration
from dflash2_mlx.builtin.bench_sets import default_bench_files
from dflash2_mlx.calibration import keys
from dflash2_mlx.eval.prompts import sample_prompts
from dflash2_mlx.generate import speculative_generate_step
from dflash2_mlx.loop.target import attach
from dflash2_mlx.train.data import encode


def run_all(target, drafter, prompts, max_tokens: int, costs, timed: bool) -> tuple:
    """Seconds, tokens and block sizes over all prompts, and the arm's Timing: one per arm
    and round, from nothing (not from disk), shared by its requests (None: calibration only)."""
    positions = drafter.config.block_size - 1
    history = calibration.acceptance_history(keys.acceptance(target, drafter, True), positions)
    timing = adaptive.Timing() if timed else None
    seconds = tokens = 0
    blocks = Counter()
    for ids in prompts:
        policy = adaptive.starting(costs, positions + 1, positions, history, timing=timing,
                                   copy_largest=max(positions + 1, adaptive.COPY_LARGEST))
        tic = time.perf_counter()
        for *_, stats in speculative_generate_step(mx.array(ids), target, drafter,
                                                   max_tokens=max_tokens, block_size=policy):
            tokens += 1
        seconds += time.perf_counter() - tic
        blocks.update(stats.block_sizes)
        blocks["copies"] += stats.copies
    return seconds, tokens, dict(sorted(blocks.items(), key=str)), timing


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", help="a cost file (`dflash2-mlx doctor --export-costs FILE`) to decide with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=2, help="prompts per benchmark set")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    model, tok, drafter = d.load()
    target = attach(model, drafter)
    costs = (calibration.load_costs(args.costs, target, drafter) if args.costs
             else calibration.costs(target, drafter))  # measured now unless cached
    prompts = [encode(tok, p) for ps in sample_prompts(default_bench_files(), args.samples).values()
               for p in ps]
    run_all(target, drafter, prompts[:1], 8, costs, True)  # warm-up: compilation, allocation
    totals = {True: [], False: []}
    for r in range(args.rounds):
        for timed in (True, False):
            seconds, tokens, blocks, t = run_all(target, drafter, prompts, args.max_tokens, costs, timed)
            totals[timed].append(seconds)
            print(f"round {r} {'timed' if timed else 'calibration only'}: {seconds:.2f} s, "
                  f"{tokens / seconds:.1f} tok/s, blocks {blocks}", flush=True)
            if timed:  # what the timing learned: observed / priced, per kind and block size
                print("  observed / priced:", {k: round(t.observed[k] / t.predicted[k], 2)
                                               for k in sorted(t.observed)}, flush=True)
    on, off = sum(totals[True]), sum(totals[False])
    print(f"timed {on:.2f} s vs calibration only {off:.2f} s: {off / on:.3f}x")
