"""On a hybrid target (GatedDeltaNet layers), is a tree faster than the chain?

A plain pass over a block leaves the recurrent state after its last token, so a cycle that
keeps fewer reads the kept tokens again (``loop.target.rollback``: the "replay" row); a tree
pass (``tree/recurrent.py``) runs the recurrence depth by depth from each node's parent and
keeps every node's state, so it never reads twice; the chain now verifies through it as a
tree of one path.  This times each, per cycle, on random targets shaped like the built-in SmolLM2-135M (fp32, 30 layers,
hidden 576): a qwen3_5 hybrid (3 linear-attention layers to 1 attention layer) and the
attention-only llama, with the shipped drafter (its acceptance on random targets is nil:
costs only).  Tokens per second are then modelled with the acceptance (tau) the bench
measured on the built-in pair, given with ``--tau`` (defaults: docs/results/trees-2026-12-05-t15,
T=0: chain of 8 1.94, tree 8 2.11, tree 16 2.42, tree 32 2.73).

    python scripts/experiments/hybrid_trees.py --tokens 48 --reps 3
"""

import argparse
import time

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import _get_classes

from dflash2_mlx import tree as trees
from dflash2_mlx.builtin.defaults import drafter_path
from dflash2_mlx.generate import speculative_generate_step
from dflash2_mlx.loop.target import attach
from dflash2_mlx.model.checkpoint import load_drafter

SHAPE = dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, vocab_size=49152, rope_theta=100000.0,
             max_position_embeddings=8192, tie_word_embeddings=True, eos_token_id=2)
HYBRID = dict(SHAPE, model_type="qwen3_5", linear_num_value_heads=8, linear_num_key_heads=4,
              linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
              full_attention_interval=4, partial_rotary_factor=0.25,
              rope_parameters={"type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.25})
ATTENTION = dict(SHAPE, model_type="llama")
# (name, block size, tree budget or None, tau key)
ROWS = [("plain", 1, None, "plain"), ("chain 8, replay", 8, "replay", "chain8"), ("chain 8", 8, None, "chain8"),
        ("tree 8", 8, 8, "tree8"), ("tree 16", 8, 16, "tree16"), ("tree 32", 8, 32, "tree32")]


def random_model(config: dict):
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    return model


def per_cycle(model, drafter, prompt, tokens: int, block: int, budget) -> float:
    """Seconds per cycle (a plain step for block 1), the prompt's prefill left out; budget
    "replay": the chain verified by a plain pass (the tree pass refused)."""
    if budget == "replay":
        fits, trees.TreePass.fits = trees.TreePass.fits, lambda *a: "replay"
        try:
            return per_cycle(model, drafter, prompt, tokens, block, None)
        finally:
            trees.TreePass.fits = fits
    target = attach(model, drafter)
    steps = speculative_generate_step(prompt, target, drafter, max_tokens=tokens, block_size=block,
                                      tree_budget=budget, lookup=False)
    next(steps)  # the prefill and the first token
    start, stats = time.perf_counter(), None
    for _, _, _, stats in steps:
        pass
    return (time.perf_counter() - start) / max(stats.cycles - 1, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (random ids)")
    ap.add_argument("--tau", nargs=4, type=float, default=[1.94, 2.11, 2.42, 2.73],
                    metavar=("CHAIN8", "TREE8", "TREE16", "TREE32"))
    a = ap.parse_args()
    tau = dict(plain=1.0, chain8=a.tau[0], tree8=a.tau[1], tree16=a.tau[2], tree32=a.tau[3])
    drafter = load_drafter(str(drafter_path()))
    mx.random.seed(1)
    prompt = mx.random.randint(3, SHAPE["vocab_size"], (a.prompt,))
    print(f"per-cycle wall time, min of {a.reps} runs of {a.tokens} tokens after a {a.prompt}-token prompt; "
          f"tok/s modelled = tau / cycle time")
    for name, config in (("qwen3_5 hybrid", HYBRID), ("llama (attention only)", ATTENTION)):
        model = random_model(config)
        params = sum(v.size for _, v in tree_flatten(model.parameters()))
        print(f"\n{name}: {params / 1e6:.0f}M parameters")
        print(f"| row | ms / cycle | tau (bench) | modelled tok/s | vs chain 8, replay |\n|---|---|---|---|---|")
        out = {}
        for row, block, budget, key in ROWS:
            t = min(per_cycle(model, drafter, prompt, a.tokens, block, budget) for _ in range(a.reps))
            out[row] = tau[key] / t
            base = out.get("chain 8, replay")
            print(f"| {row} | {1e3 * t:.1f} | {tau[key]:.2f} | {out[row]:.1f} | "
                  f"{f'{out[row] / base:.2f}x' if base else ''} |", flush=True)


if __name__ == "__main__":
    main()
