"""Does splitting a verify pass's products over two CPU streams make DFlash 2 faster?

DFlash 2 at block 5 with a verify pass's products split over two CPU streams (the
default where OpenBLAS is preloaded: ``dflash2_mlx/machine/cpu_split.py``) against unsplit
(DFLASH2_MLX_CPU_SPLIT=0), alternating, on two prompts, plus plain decoding for scale:
3 rounds of 128 tokens each.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python scripts/experiments/cpu_split_ab.py
"""

import os

import dflash2_mlx as d
from dflash2_mlx.generate import stream_generate

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
           "clips in May. How many clips did Natalia sell altogether in April and May?"]


def tps(model, tok, drafter, prompt: str, **kw) -> float:
    for last in stream_generate(model, tok, [{"role": "user", "content": prompt}], drafter,
                                max_tokens=128, lookup=False, **kw):  # drafted blocks only
        pass
    return last.generation_tps


if __name__ == "__main__":
    model, tok, drafter = d.load()
    for round_ in range(3):
        for flag in ("1", "0"):
            os.environ["DFLASH2_MLX_CPU_SPLIT"] = flag  # read at every target pass
            block5 = [f"{tps(model, tok, drafter, p, block_size=5):.1f}" for p in PROMPTS]
            plain = tps(model, tok, drafter, PROMPTS[1], verify_mode="off")
            print(round_, "split" if flag == "1" else "unsplit", "block 5 tok/s", " / ".join(block5),
                  f"| plain {plain:.1f}", flush=True)
