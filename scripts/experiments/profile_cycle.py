"""Where does a DFlash cycle's time go on this machine?

Where a DFlash cycle's time goes on the built-in pair (SmolLM2-135M-Instruct + the
shipped DFlash 2 drafter): target passes over 1 and b rows, the drafter pass, propose,
and the bookkeeping left in a real cycle (``dflash2_mlx.eval.profile.cycle_breakdown``).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python scripts/experiments/profile_cycle.py [--draft DIR]
"""

import argparse

from dflash2_mlx import load
from dflash2_mlx.eval.profile import cycle_breakdown, format_breakdown


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=None, help="drafter directory (default: the shipped DFlash 2)")
    ap.add_argument("--block-size", type=int, default=5)
    args = ap.parse_args()
    model, tok, drafter = load(draft=args.draft)
    ids = tok.encode("Explain how a hash table works in Python. " * 20)
    print(format_breakdown(cycle_breakdown(model, drafter, ids, args.block_size), args.block_size))


if __name__ == "__main__":
    main()
