"""Which block-size policy is fastest on the same prompts, without timing noise? An offline replay.

Replay block-size policies offline on the built-in pair at T=0.

At T=0 the text is the target's own whatever the block sizes, so one teacher-forced pass
tells, for every position of each greedy response and every block size b, how many drafts
a cycle anchored there would accept.  A policy is then replayed over those tables in
milliseconds: it picks b, the table says what was accepted, the cost model says what the
cycle cost.  This compares fixed blocks, the adaptive default and its variants on the
same prompts without timing noise (an 8-minute bench run gives one noisy figure).

Costs: a careful calibration (many rounds) is the "true" price of each cycle, plus a
fixed bookkeeping cost per drafting cycle; the policy under test decides from its own
cost model, by default a fresh default calibration (what a user's first run measures).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python scripts/experiments/simulate_adaptive.py [--samples 2 --max-tokens 64] \
        [--tables T.npz --truth C.json]   # written on the first run, read after
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np

from dflash2_mlx import adaptive, calibration, load
from dflash2_mlx.builtin.bench_sets import default_bench_files
from dflash2_mlx.eval.prompts import sample_prompts
from dflash2_mlx.eval.evaluate import greedy_responses, leading, offline_hits
from dflash2_mlx.loop.target import attach
from dflash2_mlx.train.features import target_features


def accept_tables(target, drafter, seqs, largest: int):
    """Per sequence, {b: accepted drafts of a cycle anchored at each response position}."""
    tables = []
    for ids, start in seqs:
        table, feats = {}, target_features(target, [ids])
        for b in range(2, largest + 1):
            hit1, _, hitsel = offline_hits(target, drafter, ids, start, b, top_k=16, feats=feats)
            table[b] = leading(hitsel if hitsel is not None else hit1)
        tables.append((table, start, len(ids)))
    return tables


def save_tables(path, tables):
    arrays = {f"{i}_{b}": rows for i, (table, _, _) in enumerate(tables) for b, rows in table.items()}
    arrays["spans"] = np.array([(start, length) for _, start, length in tables])
    np.savez(path, **arrays)


def load_tables(path):
    data = np.load(path)
    tables = [({}, int(start), int(length)) for start, length in data["spans"]]
    for key in data.files:
        if key != "spans":
            i, b = map(int, key.split("_"))
            tables[i][0][b] = data[key]
    return tables


def replay(policy, table, start: int, length: int, max_tokens: int, costs, overhead: float):
    """(tokens, seconds, cycles by block size) of one greedy response under ``policy``;
    a plain step's shadow probe costs a block-2 draft and learns block 2's first outcome."""
    pos, emitted, seconds, used = start, 1, 0.0, {}
    while emitted < max_tokens:
        b = policy.block_size(pos)
        rows = table.get(b)
        if b > 1 and (rows is None or pos - start >= len(rows)):
            b = 1  # past the last anchor with a full block: no table, step plainly
        accepted = 0 if b == 1 else int(min(rows[pos - start], b - 1))
        seconds += costs.cycle(b, pos) + (overhead if b > 1 else 0.0)
        if b == 1 and policy.shadow() and pos - start < len(table[2]):
            seconds += costs.draft(2, pos)
            policy.record_shadow(float(min(table[2][pos - start], 1)))
        policy.record(b, accepted)
        used[b] = used.get(b, 0) + 1
        pos += accepted + 1
        emitted += accepted + 1
        if pos >= length:
            break
    return emitted, seconds, used


def run(name, make_policy, tables, max_tokens, truth, overhead, history: bool):
    hist = None
    tokens = seconds = 0.0
    used = {}
    for table, start, length in tables:
        policy = make_policy(hist)
        n, s, u = replay(policy, table, start, length, max_tokens, truth, overhead)
        tokens, seconds = tokens + n, seconds + s
        for k, v in u.items():
            used[k] = used.get(k, 0) + v
        if history and hasattr(policy, "acceptance"):
            hist = adaptive.fold(hist, policy.acceptance)
    return name, tokens / seconds, used


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=None)
    ap.add_argument("--samples", type=int, default=2, help="prompts per benchmark set (the bench's draw)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--overhead-ms", type=float, default=3.5, help="bookkeeping per drafting cycle")
    ap.add_argument("--decision-costs", type=int, default=3, help="fresh default calibrations to decide with")
    ap.add_argument("--tables", default=None, help="npz of acceptance tables: read if it exists, else written")
    ap.add_argument("--truth", default=None, help="json of the true cost model: read if it exists, else written")
    args = ap.parse_args()

    model, tok, drafter = load(draft=args.draft)
    target = attach(model, drafter)
    largest = drafter.config.block_size
    if args.tables and Path(args.tables).exists():
        tables = load_tables(args.tables)
    else:
        benches = sample_prompts(default_bench_files(), args.samples)
        prompts = [p for ps in benches.values() for p in ps]
        tic = time.perf_counter()
        seqs = greedy_responses(model, tok, prompts, args.max_tokens + largest)
        tables = accept_tables(target, drafter, seqs, largest)
        print(f"{len(prompts)} prompts, tables in {time.perf_counter() - tic:.0f} s")
        if args.tables:
            save_tables(args.tables, tables)
    if args.truth and Path(args.truth).exists():
        truth = adaptive.CostModel.from_json(json.loads(Path(args.truth).read_text()))
    else:
        truth = calibration.calibrate(target, drafter, budget_s=40.0, rounds=(8, 40),
                                   sizes=list(range(2, largest + 1)))
        if args.truth:
            Path(args.truth).write_text(json.dumps(truth.to_json()))
    overhead = args.overhead_ms / 1000
    deciders = [calibration.calibrate(target, drafter) for _ in range(args.decision_costs)]
    show = lambda c: " ".join(f"{b}:{1000 * c.cycle(b, 256):.1f}" for b in range(1, largest + 1))
    print(f"true cycle ms at context 256: {show(truth)}")
    for i, c in enumerate(deciders):
        print(f"decider {i} ms at context 256:  {show(c)}")

    rows = [run("plain", lambda h: adaptive.Fixed(1), tables, args.max_tokens, truth, overhead, False)]
    rows += [run(f"block {b}", lambda h, b=b: adaptive.Fixed(b), tables, args.max_tokens, truth,
                 overhead, False) for b in range(2, largest + 1)]
    adaptive_policy = lambda costs: lambda h: adaptive.starting(costs, largest, largest - 1, h)

    rows.append(run("adaptive, true costs", adaptive_policy(truth), tables, args.max_tokens, truth,
                    overhead, True))
    unshadowed = lambda h: adaptive.starting(truth, largest, largest - 1, h, shadow_budget=0)
    rows.append(run("  ... no shadow probes", unshadowed, tables, args.max_tokens, truth, overhead, True))
    for i, c in enumerate(deciders):
        rows.append(run(f"adaptive, decider {i}", adaptive_policy(c), tables, args.max_tokens, truth,
                        overhead, True))
    base = rows[0][1]
    for name, tps, used in rows:
        mix = " ".join(f"{b}:{n}" for b, n in sorted(used.items()))
        print(f"{name:24s} {tps:6.1f} tok/s  {tps / base:5.2f}x   cycles {mix}")


if __name__ == "__main__":
    main()
