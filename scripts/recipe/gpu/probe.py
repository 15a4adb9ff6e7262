"""Is DFlash's greedy output the target's own on this machine, by default and with exact=True?

The exactness probe (``dflash2_mlx.loop.exactness``) on the built-in target in fp32 and in
bf16, then greedy parity: plain mlx-lm decoding against DFlash 2 (default) and DFlash 2 with
``exact=True``, the target in bf16 as a GPU runs it, on prompts of the five benchmark sets.

    python scripts/recipe/gpu/probe.py --model TARGET_DIR --draft DRAFTER_DIR --out DIR
        [--prompts 10] [--max-tokens 64]

Writes DIR/probe.json and DIR/probe.md (run by run.sh on the lent GPU machine; runs on any
MLX device).
"""

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm

from dflash2_mlx import stream_generate
from dflash2_mlx.builtin.bench_sets import SHIPPED_BENCH_DIR
from dflash2_mlx.loop import exactness
from dflash2_mlx.model.checkpoint import load_drafter
from dflash2_mlx.train.data import read_prompts


def prompts(n: int):
    sets = sorted(SHIPPED_BENCH_DIR.glob("*.jsonl"))
    per = [read_prompts(p, limit=n) for p in sets]
    out = []
    for i in range(n):
        for ps in per:
            if i < len(ps) and len(out) < n:
                out.append(ps[i][1])
    return out


def tokens_of(model, tok, prompt, max_tokens, **kw):
    return [r.token for r in stream_generate(model, tok, prompt, max_tokens=max_tokens, **kw)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": str(mx.default_device()), "mlx": mx.__version__}
    model, tok = mlx_lm.load(args.model)
    for dtype in ("float32", "bfloat16"):
        model.set_dtype(getattr(mx, dtype))
        tic = time.perf_counter()
        v = exactness.probe(model)
        report[f"probe_{dtype}"] = {**v.to_json(), "describe": v.describe(), "seconds": time.perf_counter() - tic}
        print(dtype, v.describe(), flush=True)
    # The target stays bf16: what a GPU user runs.
    drafter = load_drafter(args.draft, target=model)
    rows = []
    for i, p in enumerate(prompts(args.prompts)):
        tic = time.perf_counter()
        plain = tokens_of(model, tok, p, args.max_tokens)
        t_plain = time.perf_counter() - tic
        runs = {}
        for name, kw in (("default", {}), ("exact", {"exact": True})):
            tic = time.perf_counter()
            got = tokens_of(model, tok, p, args.max_tokens, drafter=drafter, block_size=5, **kw)
            first = next((j for j, (a, b) in enumerate(zip(got, plain)) if a != b), None)
            if first is None and len(got) != len(plain):
                first = min(len(got), len(plain))
            runs[name] = {"identical": got == plain, "first_divergence": first,
                          "seconds": time.perf_counter() - tic}
        rows.append({"prompt": i, "tokens": len(plain), "plain_seconds": t_plain, **runs})
        print(i, {k: (v["identical"], v["first_divergence"]) for k, v in runs.items()}, flush=True)
    report["parity"] = rows
    for name in ("default", "exact"):
        report[f"identical_{name}"] = sum(r[name]["identical"] for r in rows)
    report["prompts"] = len(rows)
    (out / "probe.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Exactness on {report['device']} (mlx {report['mlx']})", ""]
    for dtype in ("float32", "bfloat16"):
        v = report[f"probe_{dtype}"]
        lines.append(f"- probe, target {dtype}: {v['describe']}; logits differing {v['differing']:.1%}, "
                     f"rows {v['rows'][0]}..{v['rows'][-1]}")
    for name in ("default", "exact"):
        secs = sum(r[name]["seconds"] for r in rows)
        lines.append(f"- greedy parity, bf16 target, DFlash 2 {name}: {report[f'identical_{name}']}/{len(rows)} "
                     f"outputs identical to plain decoding ({args.max_tokens} tokens; {secs:.1f} s in all, "
                     f"plain {sum(r['plain_seconds'] for r in rows):.1f} s)")
    (out / "probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
