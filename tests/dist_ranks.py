"""One rank of a split pair under the DFlash loop, run by the distributed tests through
``dflash2_mlx.distributed.local.launch`` (``mlx.launch`` would run it the same way).

    python tests/dist_ranks.py --mode tensor [--target DIR --draft DIR] [--prompt P ...]
        [--block-sizes 2,5,8,auto] [--temps 0,0.8] [--seed 3] [--lookup on,off]
        [--chat] [--max-tokens 24] [--die-rank 1 --die-after 5] [--rank-draft 1:DIR]

Without ``--target`` it loads the built-in pair.  It loads with ``load(..., distributed=mode)``
and generates once per prompt x block size x temperature x lookup setting; rank 0 prints one
JSON line per generation ({"prompt", "block_size", "temp", "seed", "lookup", "tokens",
"ranks"}).  ``--die-rank R --die-after N``: rank R leaves (``os._exit``) once it has N tokens
of its first generation, as a crashed host would.  ``--rank-draft R:DIR``: rank R alone loads
another drafter (ranks that do not hold the same files).  Errors end the rank non-zero with the
message on stderr (``distributed.failure_message``).
"""

import argparse
import json
import os
import sys


def parse(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="tensor")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompt", action="append")
    ap.add_argument("--chat", action="store_true", help="each prompt is a user message (chat template)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--block-sizes", default="auto")
    ap.add_argument("--temps", default="0")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--lookup", default="on")
    ap.add_argument("--die-rank", type=int)
    ap.add_argument("--die-after", type=int, default=4)
    ap.add_argument("--rank-draft", help="R:DIR: rank R loads the drafter in DIR instead")
    return ap.parse_args(argv)


def runs(args):
    for prompt in args.prompt or ["The quick brown fox"]:
        prompt = [{"role": "user", "content": prompt}] if args.chat else prompt
        for b in args.block_sizes.split(","):
            for temp in (float(t) for t in args.temps.split(",")):
                for lookup in args.lookup.split(","):
                    yield prompt, (b if b == "auto" else int(b)), temp, lookup == "on"


def main(argv) -> int:
    args = parse(argv)
    import mlx.core as mx

    from dflash2_mlx import distributed
    from dflash2_mlx.generate import load, stream_generate

    draft = args.draft
    if args.rank_draft and args.rank_draft.split(":", 1)[0] == os.environ.get("MLX_RANK"):
        draft = args.rank_draft.split(":", 1)[1]
    try:
        model, tokenizer, drafter = load(args.target, draft, distributed=args.mode)
        group = distributed.group_of(model) or mx.distributed.init()
        rank = group.rank()
        for i, (prompt, b, temp, lookup) in enumerate(runs(args)):
            tokens = []
            for r in stream_generate(model, tokenizer, prompt, drafter, max_tokens=args.max_tokens,
                                     block_size=b, temp=temp, seed=args.seed, lookup=lookup):
                tokens.append(r.token)
                if i == 0 and rank == args.die_rank and len(tokens) >= args.die_after:
                    os._exit(3)  # no clean shutdown: the peers see the connection drop
            if rank == 0:
                print(json.dumps({"prompt": prompt, "block_size": b, "temp": temp, "seed": args.seed,
                                  "lookup": lookup, "tokens": tokens, "ranks": group.size()}), flush=True)
    except Exception as e:  # noqa: BLE001 - the message is what the test reads
        print(distributed.failure_message(e), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
