"""Where a DFlash cycle's time goes: a target pass over 1 and over b rows, the drafter
pass, the propose step, each timed alone at one context length, and the bookkeeping of
real cycles (the draft context's append, the accept rule, rollback, history, host syncs).

Bookkeeping is timed inside real generations: the target and the drafter are wrapped so
that each pass, and the lazy work queued before it, finishes before the wrapper returns;
what a cycle spends outside those passes is bookkeeping.  Subtracting separately timed
parts from a separately timed cycle left a small difference of large, noisy timings."""

import statistics
import time

import mlx.core as mx

from ..loop import verifiers
from ..loop.draft_context import DraftContext
from ..model.drafter import propose
from ..request.sampling import SamplingParams
from ..generate import speculative_generate_step
from ..loop.target import attach


def _ms(fn, n: int) -> float:
    """Median milliseconds of a call: a CPU shared with anything else makes means jumpy."""
    fn()
    times = []
    for _ in range(n):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3


class Timed:
    """A target or drafter whose calls finish before returning, timed in two phases: the
    lazy inputs queued before the call (``before``), then the pass itself (``phase``)."""

    def __init__(self, inner, times: dict, before: str, phase: str, inputs):
        self.inner, self.times, self.before, self.phase, self.inputs = inner, times, before, phase, inputs
        if getattr(inner, "verifiers", None) is not None:  # a target: its verify passes timed too
            verifiers.compose(self, inner.verifiers.exact)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, ids, cache, **kwargs):
        tic = time.perf_counter()
        mx.eval(self.inputs(ids, cache))
        mid = time.perf_counter()
        out = self.inner(ids, cache, **kwargs)
        mx.eval(out)
        self.times[self.before] += mid - tic
        self.times[self.phase] += time.perf_counter() - mid
        return out


def _cache_states(cache):
    return [c.state for c in cache if getattr(c, "keys", None) is not None]


def timed_cycles(target, drafter, ids: mx.array, block_size: int, tokens: int,
                 runs: int = 3) -> dict:
    """Milliseconds per cycle of real greedy generations at ``block_size``, split into the
    draft context's append, the drafter pass, propose, the verify pass and the rest
    (``bookkeeping``: the accept rule, rollback, history, stats, host syncs, Python)."""
    times = dict.fromkeys(("append", "drafter", "propose", "verify", "total"), 0.0)
    # The drafter's inputs are the context's pending append; the verify pass's are the
    # proposed tokens (the drafter's states are already computed by then).
    t = Timed(target, times, "propose", "verify", lambda ids, cache: ids)
    d = Timed(drafter, times, "append", "drafter", lambda ids, cache: _cache_states(cache))
    cycles = 0
    for _ in range(runs):
        context = DraftContext(d)
        steps = speculative_generate_step(ids, t, d, max_tokens=tokens, block_size=block_size,
                                          context=context, lookup=False)  # drafted cycles only
        before = dict(times)
        next(steps)  # the prefill and the prompt's rows in the draft context are not a cycle
        mx.eval(_cache_states(context.fed()))
        times.update(before)
        tic = time.perf_counter()
        for *_, stats in steps:
            pass
        times["total"] += time.perf_counter() - tic
        cycles += stats.cycles
    out = {k: 1e3 * v / max(cycles, 1) for k, v in times.items()}
    out["bookkeeping"] = out["total"] - sum(out[k] for k in ("drafter", "propose", "verify"))
    return out


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

    out = {
        "target_1": _ms(target_pass(1), repeats),
        f"target_{block_size}": _ms(target_pass(block_size), repeats),
        "drafter": _ms(lambda: mx.eval(drafter(block, draft_cache)), repeats),
        "propose": _ms(lambda: mx.eval(propose(drafter, hidden, mx.array(prompt_ids[-1]), greedy)[0]), repeats),
    }
    # A real cycle: generation at a fixed block size, timed after the first token; the
    # median of three generations (they are identical, so only the timing varies).
    cycles = []
    for _ in range(3):
        steps = speculative_generate_step(ids[0], target, drafter, max_tokens=tokens, block_size=block_size,
                                          lookup=False)
        next(steps)
        tic = time.perf_counter()
        for *_, stats in steps:
            pass
        cycles.append((time.perf_counter() - tic) / max(stats.cycles, 1) * 1e3)
    out["cycle"] = statistics.median(cycles)
    out["tau"] = stats.tau
    timed = timed_cycles(target, drafter, ids[0], block_size, tokens)
    out["bookkeeping"], out["append"] = timed["bookkeeping"], timed["append"]
    out["timed_cycle"] = timed["total"]
    out["draft_share"] = (out["drafter"] + out["propose"]) / out["target_1"]
    out["bookkeeping_share"] = out["bookkeeping"] / out["timed_cycle"]
    out["cycle_vs_plain"] = out["cycle"] / out["target_1"]
    return out


def format_breakdown(b: dict, block_size: int = 5) -> str:
    return (f"target pass 1 row {b['target_1']:.1f} ms, {block_size} rows {b[f'target_{block_size}']:.1f} ms; "
            f"drafter {b['drafter']:.1f} ms + propose {b['propose']:.1f} ms = "
            f"{b['draft_share']:.2f}x a 1-row pass; cycle {b['cycle']:.1f} ms "
            f"({b['cycle_vs_plain']:.2f}x a plain step), bookkeeping {b['bookkeeping']:.1f} ms "
            f"({100 * b['bookkeeping_share']:.1f}% of a cycle timed pass by pass, {b['timed_cycle']:.1f} ms; "
            f"the draft context's append {b['append']:.1f} ms of it)")
