"""How much throughput does batched DFlash add for 1, 2, 4, 8 concurrent streams, and does it keep T=0 parity?

Batched DFlash on the built-in pair (SmolLM2-135M-Instruct + the shipped DFlash 2
drafter): aggregate tokens/s for 1, 2, 4, 8 concurrent streams.

All streams start together (prefilled in one batch) and run to ``--max-tokens`` (or their
end of sequence); latency is a stream's time from the start to its last token.  "agg tok/s"
counts every token over the whole run (prefill included); "dec tok/s" the tokens after the
first call (prefill and one cycle) over the time after it (one at a time: after each
request's first token).  Each row
also runs the same prompts one at a time (single-stream DFlash, as the server does today)
unless ``--no-sequential``.  Both copy where the text repeats itself (as ``generate`` and the
server do) unless ``--no-copies``.  At T=0 every stream's tokens must equal its single-stream
tokens (``mismatch`` counts the streams that differ).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python scripts/experiments/bench_batch.py --max-tokens 64 --block-sizes 1,4,auto
"""

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash2_mlx import adaptive, calibration, load
from dflash2_mlx.batch import BatchGenerator
from dflash2_mlx.builtin.bench_sets import SHIPPED_BENCH_DIR
from dflash2_mlx.generate import speculative_generate_step
from dflash2_mlx.loop.target import attach
from dflash2_mlx.train.data import encode, read_prompts

def prompts(tokenizer, n: int):
    """``n`` chat prompts, alternating GSM8K and HumanEval (first records of each)."""
    files = ("gsm8k_test.jsonl", "humaneval.jsonl")
    pools = [[q for _, q in read_prompts(SHIPPED_BENCH_DIR / f, limit=n)] for f in files]
    return [encode(tokenizer, pools[i % 2][i // 2]) for i in range(n)]


def block_policy(target, drafter, block):
    return calibration.policy(target, drafter, adaptive.AUTO) if block == "auto" else int(block)


def run_batch(model, drafter, ids, max_tokens, block, stop, batch_drafter=True, lookup=True):
    # "auto": the batch's own policy (priced for the batch's size), as the server runs it
    gen = BatchGenerator(model, drafter, block_size=block if block == "auto" else int(block),
                         batch_drafter=batch_drafter, lookup=lookup)
    uids = [gen.insert(p, max_tokens=max_tokens, stop_tokens=stop) for p in ids]
    tokens = {u: [] for u in uids}
    done, stats = {}, {}
    tic = time.perf_counter()
    decode = None  # (time, tokens) when the first call (prefill + one cycle) returned
    while len(gen):
        for r in gen.next():
            tokens[r.uid].append(r.token)
            if r.finish_reason:
                done[r.uid], stats[r.uid] = time.perf_counter() - tic, r.stats
        decode = decode or (time.perf_counter() - tic, sum(map(len, tokens.values())))
    wall = time.perf_counter() - tic
    gen_tps = (sum(map(len, tokens.values())) - decode[1]) / max(wall - decode[0], 1e-9)
    taus = [stats[u].tau if stats[u].cycles else 1.0 for u in uids]
    return [tokens[u] for u in uids], [done[u] for u in uids], taus, wall, gen_tps


def run_sequential(model, drafter, ids, max_tokens, block, stop, lookup=True):
    """The same prompts one after another: latency includes the wait for earlier ones."""
    target = attach(model, drafter)
    out, done, taus, decode = [], [], [], 0.0
    tic = time.perf_counter()
    for p in ids:
        toks, stats = [], None
        for t, _, _, stats in speculative_generate_step(
                mx.array(p), target, drafter, max_tokens=max_tokens,
                block_size=block_policy(target, drafter, block), lookup=lookup):
            toks.append(t)
            if len(toks) == 1:
                first = time.perf_counter()
            if t in stop:
                break
        out.append(toks)
        done.append(time.perf_counter() - tic)
        decode += time.perf_counter() - first
        taus.append(stats.tau if stats.cycles else 1.0)
    gen_tps = sum(len(t) - 1 for t in out) / max(decode, 1e-9)
    return out, done, taus, time.perf_counter() - tic, gen_tps


def row(kind, n, block, tokens, done, taus, wall, gen_tps, mismatch):
    total = sum(len(t) for t in tokens)
    return dict(mode=kind, streams=n, block=block, tokens=total, seconds=round(wall, 2),
                aggregate_tps=round(total / wall, 2), decode_tps=round(gen_tps, 2),
                per_stream_tps=round(float(np.mean([len(t) / d for t, d in zip(tokens, done)])), 2),
                tau=round(float(np.mean(taus)), 2), p50_s=round(float(np.percentile(done, 50)), 2),
                p95_s=round(float(np.percentile(done, 95)), 2), mismatch=mismatch)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--block-sizes", default="1,4", help="comma list of sizes or 'auto'")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-sequential", action="store_true", help="skip the one-at-a-time rows")
    ap.add_argument("--per-sequence-drafter", action="store_true",
                    help="one drafter pass per stream instead of one for the batch")
    ap.add_argument("--copies", action=argparse.BooleanOptionalAction, default=True,
                    help="copies where the text repeats itself (batch and sequential)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()

    model, tok, drafter = load()
    stop = set(tok.eos_token_ids)
    streams = [int(s) for s in args.streams.split(",")]
    ids = prompts(tok, max(streams))
    run_batch(model, drafter, ids[:1], 4, 1, stop)  # warm-up
    rows = []
    print(f"{'mode':>10} {'streams':>7} {'block':>5} {'agg tok/s':>9} {'dec tok/s':>10} "
          f"{'stream tok/s':>12} {'tau':>5} {'p50 s':>6} {'p95 s':>6} {'mismatch':>8}")
    for block in args.block_sizes.split(","):
        ref = None
        for n in streams:
            modes = [("batch", False)] + ([] if args.no_sequential else [("sequential", True)])
            for kind, sequential in modes:
                if sequential:
                    result = run_sequential(model, drafter, ids[:n], args.max_tokens, block, stop,
                                            args.copies)
                else:
                    result = run_batch(model, drafter, ids[:n], args.max_tokens, block, stop,
                                       not args.per_sequence_drafter, args.copies)
                tokens = result[0]
                ref = ref or {}
                mismatch = sum(1 for i, t in enumerate(tokens) if ref.setdefault(i, t) != t)
                rows.append(row(kind, n, block, *result, mismatch))
                r = rows[-1]
                print(f"{kind:>10} {n:>7} {block:>5} {r['aggregate_tps']:>9.1f} "
                      f"{r['decode_tps']:>10.1f} {r['per_stream_tps']:>12.1f} {r['tau']:>5.2f} "
                      f"{r['p50_s']:>6.2f} {r['p95_s']:>6.2f} {mismatch:>8}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
