"""What requests does the target itself expect? Prompts it writes itself (the Magpie recipe).

Training prompts written by the target itself (the Magpie recipe): the chat template up
to the start of a user turn, sampled at T=1 until the turn ends.

The domain-shaped prompts (make_domain_prompts.py) come from templates: the drafter still
does better on their own held-out prompts than on the five benchmark sets (HISTORY.md).  An
instruction-tuned model asked for a user turn writes the kind of requests it was tuned on,
with far more variety than templates.  Some turns start from a short opener (a word problem,
a math question, a coding task, a Python stub) so that the five forms stay in the mix; the
kinds are interleaved, so any prefix of the file is balanced.

A turn is kept when it ends within ``--max-tokens``, is 15 to 1500 characters long, is new,
and shares no 13 consecutive words with any prompt of the five benchmark sets
(``dflash2_mlx.train.contamination``).  Groups of ``--batch`` turns are appended as they
finish, each from its own seed: a rerun resumes after the last complete group.

    python scripts/recipe/make_magpie_prompts.py OUT.jsonl [--n 1024] [--seed 1] [--batch 64]
"""

import argparse
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import batch_generate
from mlx_lm.sample_utils import make_sampler
from tqdm import tqdm

from dflash2_mlx import load
from dflash2_mlx.train.contamination import contaminated

OPENERS = [
    [""],  # free: chat, writing, advice, knowledge (MT-Bench's form)
    ["If", "How many", "There are", "A store", "Tom", "Sarah"],  # word problems
    ["Solve", "Find", "What is the value of", "Calculate", "Simplify", "Let $"],  # math
    ["Write a Python function", "Write a function to", "Write a program that", "Implement"],
    ["def", "from typing import List\n\n\ndef", "import math\n\n\ndef"],  # stubs to complete
]  # no trailing spaces: the model's next token carries its own


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default=None, help="target (default: the built-in SmolLM2)")
    args = ap.parse_args()
    model, tok, _ = load(args.model)
    marker = "\x00"
    turn = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    prefix = turn[: turn.index(marker)]
    out = Path(args.out)
    kept = []
    for line in out.read_text().splitlines() if out.exists() else []:
        try:
            kept.append(json.loads(line))
        except json.JSONDecodeError:  # torn by an interruption: the last group reruns (same seed)
            kept = [r for r in kept if r["group"] != kept[-1]["group"]] if kept else []
            out.write_text("".join(json.dumps(r) + "\n" for r in kept))
            break
    seen = {r["text"] for r in kept}
    group = max((r["group"] for r in kept), default=-1) + 1
    sampler = make_sampler(1.0, top_p=0.95)
    bar = tqdm(total=args.n, initial=min(len(kept), args.n), desc="prompts", unit="prompt")
    with open(out, "a") as f:
        while len(kept) < args.n:
            mx.random.seed(args.seed * 100_003 + group)
            openers = [OPENERS[(len(kept) + i) % len(OPENERS)] for i in range(args.batch)]
            openers = [o[(group + i) % len(o)] for i, o in enumerate(openers)]
            ids = [tok.encode(prefix + o, add_special_tokens=False) for o in openers]
            res = batch_generate(model, tok, ids, max_tokens=args.max_tokens, sampler=sampler,
                                 return_token_ids=True, completion_batch_size=args.batch,
                                 prefill_batch_size=16)
            new = []
            for o, text, toks in zip(openers, res.texts, res.token_ids):
                text = (o + text).strip()
                if (len(toks) >= args.max_tokens or not 15 <= len(text) <= 1500 or text in seen
                        or contaminated(text)):
                    continue
                seen.add(text)
                new.append({"text": text, "group": group})
            new = new[: args.n - len(kept)]
            f.write("".join(json.dumps(r) + "\n" for r in new))
            f.flush()
            kept += new
            group += 1
            bar.update(len(new))
    bar.close()
    print(f"{out}: {len(kept)} prompts from {group} groups")


if __name__ == "__main__":
    main()
