"""``dflash2-mlx bench kernels``: the Metal kernels against their twins at the
published sizes, and the conv / selector share of one whole draft cycle."""

import time

import mlx.core as mx

from .. import kernels
from ..adaptive import check_block_size
from ..generate import load
from ..kernels.conv import dynamic_conv_reference
from ..kernels.selector import pair_scores_reference, walk_reference
from ..generate import speculative_generate_step
from ..loop.target import attach
from ..request.prompt import encode_prompt
from ..request.sampling import SamplingParams


def _time_ms(fn, repeats: int) -> float:
    """Median wall time of ``fn`` (evaluated) in milliseconds, after one warm-up."""
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _why_twin_only() -> str:
    if kernels.reference_forced():
        return f"the twins are forced by {kernels.FORCE_REFERENCE_ENV}"
    if not mx.metal.is_available():
        return "no Metal back-end on this machine"
    return "the default device is the CPU"


def bench_kernels(hidden: int = 5120, blocks=(5, 8), top_k: int = 16, rank: int = 256,
                  vocab: int = 32768, batch: int = 1, group_size: int = 16,
                  dtype=mx.float32, repeats: int = 20, echo=print) -> list:
    """Time kernel vs twin for the conv (over the whole block) and the selector
    (scores + greedy walk over the block's B-1 positions) in both layouts: fused (one
    launch, one threadgroup per batch row) and split (``path_scores+path_walk``: scores
    across threadgroups with codebook rows in threadgroup memory, then the walk; what
    ``kernels.select`` runs at batch 1). Both selector rows time the same twin. Returns
    one dict per (kernel, block): kernel, block, twin_ms, kernel_ms, ratio (twin /
    kernel); kernel_ms and ratio are None where the kernels cannot run."""
    on_metal = kernels.metal_usable() and not kernels.reference_forced()
    if not on_metal:
        echo(f"twin only: {_why_twin_only()} (the kernels need Apple Silicon)")
    key = mx.random.key(0)
    k = mx.random.split(key, 8)
    A = (mx.random.normal((vocab, rank), key=k[0]) * rank**-0.5).astype(dtype)
    B = (mx.random.normal((vocab, rank), key=k[1]) * rank**-0.5).astype(dtype)
    base = mx.random.normal((2, hidden), key=k[2]).astype(dtype)
    rows = []
    for L in blocks:
        x = mx.random.normal((batch, L, hidden), key=k[3]).astype(dtype)
        dyn = mx.random.normal((batch, L, 2, hidden // group_size), key=k[4]).astype(dtype)
        T = L - 1
        logits = mx.random.normal((batch, T, vocab), key=k[5])
        cand = mx.argsort(-logits, axis=-1)[..., :top_k]
        unary = mx.take_along_axis(logits, cand, axis=-1)
        gate = mx.random.normal((batch, T, rank), key=k[6]).astype(dtype)
        anchor = mx.zeros((batch,), dtype=mx.int32)
        mx.eval(A, B, base, x, dyn, cand, unary, gate)
        selector_twin = lambda: walk_reference(pair_scores_reference(unary, cand, gate, anchor, A, B))
        cases = {
            "dynamic_conv": (
                lambda: dynamic_conv_reference(x, dyn, base),
                lambda: kernels.run_metal("dynamic_conv", kernels.conv_launch(x, dyn, base)),
            ),
            "path_selector": (
                selector_twin,
                lambda: kernels.run_metal(
                    "path_selector", kernels.selector_launch(unary, cand, gate, anchor, A, B)),
            ),
            "path_scores+path_walk": (
                selector_twin,
                lambda: _split_selector(unary, cand, gate, anchor, A, B),
            ),
        }
        twin_times = {}  # one twin for both selector layouts: timed once
        for name, (twin, kernel) in cases.items():
            if twin not in twin_times:
                twin_times[twin] = _time_ms(twin, repeats)
            twin_ms = twin_times[twin]
            kernel_ms = _time_ms(kernel, repeats) if on_metal else None
            ratio = twin_ms / kernel_ms if kernel_ms else None
            rows.append(dict(kernel=name, block=L, twin_ms=twin_ms, kernel_ms=kernel_ms, ratio=ratio))
            shown = (f"kernel {kernel_ms:.3f} ms  twin/kernel {ratio:.2f}x" if on_metal
                     else "kernel n/a")
            echo(f"{name:<21} H={hidden} B={L} batch={batch} k={top_k} r={rank} {dtype}: "
                 f"twin {twin_ms:.3f} ms  {shown}")
    return rows


def _split_selector(unary, cand, gate, anchor, A, B):
    scores = kernels.run_metal("path_scores", kernels.scores_launch(unary, cand, gate, anchor, A, B))[0]
    return kernels.run_metal("path_walk", kernels.walk_launch(scores))


def draft_cycle_share(target: str, draft: str, prompt: str = "the quick brown fox jumps over",
                      max_tokens: int = 64, block_size=None, temp: float = 0.0,
                      echo=print) -> dict:
    """Share of one whole draft cycle (draft, propose, verify, accept) spent in the
    dynamic conv and in the selector's scores + walk, on a (tiny) target/drafter pair.

    The cycle time comes from a plain run; the conv and selector times from a second
    run in which each of their calls is timed alone (``kernels.profile``). Returns
    dict(cycles, cycle_ms, conv_ms, selector_ms, conv_share, selector_share, path,
    profiled_cycle_ms: the per-cycle time of the timed run, sync points included)."""
    model, tokenizer, drafter = load(target, draft)
    if drafter.version != 2:
        raise ValueError("the conv and selector exist only in DFlash 2 drafters")
    # A fixed block: the adaptive default may decode plain and time no draft at all.
    block_size = check_block_size(drafter, block_size or min(5, drafter.config.block_size))
    t = attach(model, drafter)
    ids = encode_prompt(tokenizer, prompt)
    params = SamplingParams(temp=temp)

    def run():
        mx.random.seed(0)
        steps = speculative_generate_step(ids, t, drafter, max_tokens=max_tokens,
                                          params=params, block_size=block_size, lookup=False)
        _, _, _, stats = next(steps)  # prefill and the first token: not a cycle
        t0 = time.perf_counter()
        for _ in steps:
            pass
        return (time.perf_counter() - t0) * 1e3, stats.cycles

    run()  # warm-up
    total_ms, cycles = run()
    with kernels.profile() as spent:
        profiled_ms, profiled_cycles = run()
    cycle_ms = total_ms / cycles
    conv_ms = spent["dynamic_conv"][0] / profiled_cycles
    sel_ms = spent["path_selector"][0] / profiled_cycles
    path = kernels.active_path("dynamic_conv")
    echo(f"draft cycle on {target} + {draft} (block {block_size}, {cycles} cycles, {path}): "
         f"{cycle_ms:.2f} ms/cycle; conv {conv_ms:.3f} ms ({100 * conv_ms / cycle_ms:.1f}%), "
         f"selector scores+walk {sel_ms:.3f} ms ({100 * sel_ms / cycle_ms:.1f}%)")
    return dict(cycles=cycles, cycle_ms=cycle_ms, conv_ms=conv_ms, selector_ms=sel_ms,
                conv_share=conv_ms / cycle_ms, selector_share=sel_ms / cycle_ms, path=path,
                profiled_cycle_ms=profiled_ms / profiled_cycles)
