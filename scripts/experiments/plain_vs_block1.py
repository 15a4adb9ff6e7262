"""Are DFlash's own plain steps (block size 1) as fast as plain mlx-lm decoding?

Plain mlx-lm decoding against DFlash's own plain steps (block size 1, pipelined), adaptive
and block 5, side by side on the built-in pair: 3 rounds of 128 tokens each.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python scripts/experiments/plain_vs_block1.py
"""

import dflash2_mlx as d
from dflash2_mlx.generate import stream_generate

PROMPT = [{"role": "user", "content": "Explain how a hash map works, with an example in Python."}]
METHODS = {"plain (--verify-mode off)": dict(verify_mode="off"), "block 1": dict(block_size=1),
           "adaptive": dict(), "block 5": dict(block_size=5)}

if __name__ == "__main__":
    model, tok, drafter = d.load()
    for round_ in range(3):
        for name, kw in METHODS.items():
            for last in stream_generate(model, tok, PROMPT, drafter, max_tokens=128, **kw):
                pass
            print(round_, name, f"{last.generation_tps:.1f} tok/s", last.block_sizes, flush=True)
