"""Where a DFlash cycle's time goes: a target pass over 1 and over b rows, the drafter
pass, the propose step, and what is left of a real cycle (bookkeeping: rollback, the draft
context's append, history, the accept rule's log-softmax, host syncs), all measured on the
pair at hand at one context length."""

import statistics
import time

import mlx.core as mx

from .drafter import propose
from .sampling import SamplingParams
from .speculative import speculative_generate_step
from .target import attach


def _ms(fn, n: int) -> float:
    """Median milliseconds of a call: a CPU shared with anything else makes means jumpy."""
    fn()
    times = []
    for _ in range(n):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3


def cycle_breakdown(model, drafter, prompt_ids, block_size: int = 5, repeats: int = 15,
                    tokens: int = 64) -> dict:
    """Milliseconds of each part of a greedy cycle at block ``block_size`` after
    ``prompt_ids``, and their shares (see the module docstring)."""
    target = attach(model, drafter)
    ids = mx.array([prompt_ids])
    cache = target.make_cache()
    _, feats = target(ids, cache)
    mx.eval(feats)

    def target_pass(rows):
        def run():
            mx.eval(target(mx.array([[prompt_ids[-1]] * rows]), cache)[0])
            for c in cache:
                c.trim(rows)
        return run

    draft_cache = drafter.make_cache()
    drafter.append_context(feats, draft_cache)
    block = mx.array([[prompt_ids[-1]] + [drafter.config.mask_token_id] * (block_size - 1)])
    hidden = drafter(block, draft_cache)
    mx.eval(hidden)
    greedy = SamplingParams()

    def append(rows=2):  # a cycle commits tau rows; ~2 on this pair
        drafter.append_context(feats[:, -rows:], draft_cache)
        mx.eval([c.state for c in draft_cache])
        for c in draft_cache:
            c.trim(rows)

    out = {
        "target_1": _ms(target_pass(1), repeats),
        f"target_{block_size}": _ms(target_pass(block_size), repeats),
        "drafter": _ms(lambda: mx.eval(drafter(block, draft_cache)), repeats),
        "append": _ms(append, repeats),
        "propose": _ms(lambda: mx.eval(propose(drafter, hidden, mx.array(prompt_ids[-1]), greedy)[0]), repeats),
    }
    # A real cycle: generation at a fixed block size, timed after the first token; the
    # median of three generations (they are identical, so only the timing varies).
    cycles = []
    for _ in range(3):
        steps = speculative_generate_step(ids[0], target, drafter, max_tokens=tokens, block_size=block_size)
        next(steps)
        tic = time.perf_counter()
        for *_, stats in steps:
            pass
        cycles.append((time.perf_counter() - tic) / max(stats.cycles, 1) * 1e3)
    out["cycle"] = statistics.median(cycles)
    out["tau"] = stats.tau
    parts = out[f"target_{block_size}"] + out["drafter"] + out["propose"]
    out["bookkeeping"] = max(out["cycle"] - parts, 0.0)
    out["draft_share"] = (out["drafter"] + out["propose"]) / out["target_1"]
    out["bookkeeping_share"] = out["bookkeeping"] / out["cycle"]
    out["cycle_vs_plain"] = out["cycle"] / out["target_1"]
    return out


def format_breakdown(b: dict, block_size: int = 5) -> str:
    return (f"target pass 1 row {b['target_1']:.1f} ms, {block_size} rows {b[f'target_{block_size}']:.1f} ms; "
            f"drafter {b['drafter']:.1f} ms + propose {b['propose']:.1f} ms = "
            f"{b['draft_share']:.2f}x a 1-row pass; cycle {b['cycle']:.1f} ms "
            f"({b['cycle_vs_plain']:.2f}x a plain step), bookkeeping {b['bookkeeping']:.1f} ms "
            f"({100 * b['bookkeeping_share']:.1f}% of a cycle; the draft context's append of 2 rows "
            f"alone {b['append']:.1f} ms)")
