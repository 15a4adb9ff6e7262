"""How do tau and the speed-up change with the prompt's length (1k, 4k, 8k tokens)?

τ and speed-up against prompt length on the built-in pair (SmolLM2-135M-Instruct + the
shipped DFlash 2 drafter): plain mlx-lm decoding, DFlash 2 at a fixed block size, adaptive
(block size auto), adaptive with a draft context window and a tree of ``--tree-budget`` nodes
(``--methods ... tree``), at T=0 on prompts of 1k, 4k and
8k tokens (a summarization request over the shipped prompt sets' text).  Every DFlash
output is checked token for token against plain decoding.  Methods run back to back per
length and alternate over ``--reps`` runs after one shared prefill (the median is
reported), so a busy machine slows them alike.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python scripts/experiments/long_context.py --out docs/long-context
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
import mlx_lm

from dflash2_mlx import load, stream_generate
from dflash2_mlx.builtin.bench_sets import default_bench_files
from dflash2_mlx.builtin.defaults import default_pair
from dflash2_mlx.loop.draft_context import DraftContext
from dflash2_mlx.loop.cycle import prefill
from dflash2_mlx.loop.target import attach
from dflash2_mlx.train.data import read_prompts


def long_prompt(tokenizer, length: int) -> list:
    """Chat-template ids of exactly ``length`` tokens: a request to summarize text."""
    text = "\n\n".join(q for f in default_bench_files() for _, q in read_prompts(f))
    body = tokenizer.encode(text)
    head = "Summarize the following text in a few sentences.\n\n"
    frame = len(tokenizer.apply_chat_template([{"role": "user", "content": head}],
                                              add_generation_prompt=True))
    ids, cut = None, length - frame
    while ids is None or len(ids) > length:  # decoding and re-encoding may merge tokens
        content = head + tokenizer.decode(body[:cut])
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                            add_generation_prompt=True)
        cut -= max(1, len(ids) - length)
    return ids


def run(fn):
    tokens, last = [], None
    for last in fn():
        tokens.append(int(last.token))
    return tokens, last


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8160])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=5, help="The fixed-block row's block size.")
    ap.add_argument("--draft-window", type=int, default=512, help="The windowed adaptive row's window.")
    ap.add_argument("--tree-budget", type=int, default=16, help="The tree row's nodes (as deep as the fixed block).")
    ap.add_argument("--methods", nargs="+", default=["plain", "fixed", "adaptive", "window"],
                    help="Rows to run: plain, fixed, adaptive, window, tree.")
    ap.add_argument("--reps", type=int, default=3, help="Runs of every method per length (the median is reported).")
    ap.add_argument("--out", type=Path, default=Path("long-context"))
    args = ap.parse_args()

    model, tokenizer, drafter = load(*default_pair())
    # The DFlash rows draft every block (no copies), as the bench's drafter rows do.
    methods = {
        "plain": ("plain", lambda ids, **kw: mlx_lm.stream_generate(
            model, tokenizer, mx.array(ids[kw.get("cached_tokens", 0):]), max_tokens=args.max_tokens,
            prompt_cache=kw.get("prompt_cache"))),
        "fixed": (f"DFlash 2 block {args.block_size}", lambda ids, **kw: stream_generate(
            model, tokenizer, ids, drafter, max_tokens=args.max_tokens, block_size=args.block_size, lookup=False, **kw)),
        "adaptive": ("DFlash 2 adaptive", lambda ids, **kw: stream_generate(
            model, tokenizer, ids, drafter, max_tokens=args.max_tokens, lookup=False, **kw)),
        "tree": (f"DFlash 2 tree {args.tree_budget} (block {args.block_size})", lambda ids, **kw: stream_generate(
            model, tokenizer, ids, drafter, max_tokens=args.max_tokens, block_size=args.block_size, lookup=False,
            verify_mode="tree", tree_budget=args.tree_budget, **kw)),
        "window": (f"DFlash 2 adaptive, window {args.draft_window}", lambda ids, **kw: stream_generate(
            model, tokenizer, ids, drafter, max_tokens=args.max_tokens, draft_window=args.draft_window, lookup=False, **kw)),
    }
    methods = dict(methods[m] for m in ["plain"] + [m for m in args.methods if m != "plain"])
    for fn in methods.values():  # warm-up (and the cost calibration, once per machine)
        run(lambda: fn(tokenizer.encode("Hello")))
    target = attach(model, drafter)
    rows = []
    for length in args.lengths:
        ids = long_prompt(tokenizer, length)
        # One prefill of all but the last prompt token, shared by every run of this length:
        # generation speed is what is compared, and runs can then repeat cheaply.
        cache = target.make_cache()
        _, features = prefill(target, mx.array(ids[:-1]), cache)
        mx.eval(features)
        cached = cache[0].offset
        ref, runs = None, {name: [] for name in methods}
        for rep in range(args.reps):  # methods alternate, so a busy spell slows them alike
            for name, fn in methods.items():
                context = DraftContext(drafter, args.draft_window if name == "window" else None)
                context.add(features)
                tokens, last = run(lambda: fn(ids, prompt_cache=cache, cached_tokens=len(ids) - 1,
                                              **({} if name == "plain" else {"draft_context": context})))
                for c in cache:
                    c.trim(c.offset - cached)
                ref = tokens if name == "plain" and ref is None else ref
                runs[name].append((tokens, last))
                print(f"{len(ids)} rep {rep + 1} {name}: {last.generation_tps:.2f} tok/s", flush=True)
        for name, done in runs.items():
            tps = sorted(last.generation_tps for _, last in done)
            last = done[-1][1]
            row = {"length": len(ids), "method": name, "tokens_per_s": tps[len(tps) // 2],
                   "runs_tokens_per_s": [last.generation_tps for _, last in done],
                   "generation_tokens": last.generation_tokens}
            if name != "plain":
                row.update(tau=last.tau, block_sizes=last.block_sizes, fallback=last.fallback,
                           identical_to_plain=all(tokens == ref for tokens, _ in done))
            rows.append(row)
            print(json.dumps(row), flush=True)
    for r in rows:
        plain = next(p for p in rows if p["length"] == r["length"] and p["method"] == "plain")
        r["speedup"] = r["tokens_per_s"] / plain["tokens_per_s"]
    lines = ["| prompt tokens | method | tok/s | speed-up | τ | block sizes (cycles) | T=0 identical |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        hist = ", ".join(f"{b}: {n}" for b, n in r.get("block_sizes", {}).items())
        lines.append(f"| {r['length']} | {r['method']} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}× | "
                     f"{r.get('tau', 1.0):.2f} | {hist or '-'} | "
                     f"{'-' if r['method'] == 'plain' else 'yes' if r['identical_to_plain'] else 'NO'} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long_context.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                            "rows": rows}, indent=1))
    (args.out / "long_context.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
