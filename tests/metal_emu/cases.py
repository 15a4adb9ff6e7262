"""Inputs and checks the kernel test modules share: conv and selector cases (published
sizes, edge cases, the production call), the kernel sources, and markers for tests that
need g++ (the emulator) or Apple Silicon."""

import shutil

import mlx.core as mx
import pytest

from dflash2_mlx import kernels
from dflash2_mlx.kernels.selector import top_candidates

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulation harness needs g++")
NO_METAL = "needs Apple Silicon with MLX's Metal back-end (mx.metal.is_available() is False here)"

CONV = kernels.SOURCES["dynamic_conv"]
SELECT = kernels.SOURCES["path_selector"]
SCORES = kernels.SOURCES["path_scores"]
WALK = kernels.SOURCES["path_walk"]


def keys(seed, n):
    return mx.random.split(mx.random.key(seed), n)


def conv_case(seed, batch, L, H, groups, dtypes=(mx.float32,) * 3, scale=1.0):
    k = keys(seed, 3)
    xd, dd, bd = dtypes
    x = (mx.random.normal((*batch, L, H), key=k[0]) * scale).astype(xd)
    dyn = (mx.random.normal((*batch, L, 2, groups), key=k[1]) * 0.5).astype(dd)
    base = mx.random.normal((2, H), key=k[2]).astype(bd)
    return x, dyn, base


CONV_CASES = {
    "fp32 published H5120 B8": conv_case(0, (1,), 8, 5120, 320),
    "fp32 T=1": conv_case(1, (3,), 1, 64, 4),
    "fp32 T=16 batch (2,3)": conv_case(2, (2, 3), 16, 48, 16),
    "fp32 group size 1": conv_case(3, (2,), 5, 24, 24),
    "fp32 one group": conv_case(4, (1,), 4, 32, 1),
    "fp32 no batch dim": conv_case(5, (), 7, 64, 4),
    "fp16": conv_case(6, (2,), 5, 128, 8, (mx.float16,) * 3),
    "fp16 near overflow": conv_case(7, (2,), 4, 64, 4, (mx.float16,) * 3, scale=3e4),
    "bf16 published H5120 B5": conv_case(8, (2,), 5, 5120, 320, (mx.bfloat16,) * 3),
    "bf16 x, fp32 base": conv_case(9, (2,), 6, 96, 6, (mx.bfloat16, mx.bfloat16, mx.float32)),
    "fp32 x, bf16 taps": conv_case(10, (2,), 6, 96, 6, (mx.float32, mx.bfloat16, mx.bfloat16)),
    "fp16 x, bf16 base": conv_case(11, (1,), 3, 32, 2, (mx.float16, mx.float16, mx.bfloat16)),
}


def last_group_case():
    """dyn is zero except in the last channel group, where it is large."""
    x, dyn, base = conv_case(12, (2,), 5, 80, 5)
    dyn = mx.zeros_like(dyn).at[..., -1].add(3.0)
    return x, dyn, base


CONV_CASES["last channel group only"] = last_group_case()


def quarter(shape, key, lo=-8, hi=8):
    """Multiples of 1/4 in [lo/4, hi/4]: every product and sum below stays exact in fp32."""
    return mx.round(mx.random.uniform(lo, hi, shape, key=key)) / 4


def selector_case(seed, batch, L, K, R, V=300, dtype=mx.float32, exact=False):
    k = keys(seed, 7)
    draw = quarter if exact else (lambda s, key: mx.random.normal(s, key=key))
    cand = mx.argsort(mx.random.uniform(shape=(*batch, L, V), key=k[0]), axis=-1)[..., :K]
    unary = draw((*batch, L, K), k[1]) * (1 if exact else 3)
    gate = draw((*batch, L, R), k[2]).astype(dtype)
    A = (draw((V, R), k[3]) * (1 if exact else R**-0.5)).astype(dtype)
    B = (draw((V, R), k[4]) * (1 if exact else R**-0.5)).astype(dtype)
    anchor = mx.random.randint(0, V, batch, key=k[5]).astype(mx.int32)
    uniforms = mx.random.uniform(shape=(*batch, L), key=k[6])
    return dict(unary=unary, cand=cand, gate=gate, anchor=anchor, A=A, B=B, uniforms=uniforms)


def ties_case():
    """Every row has its maximum twice (indices 2 and 5 at t=0, 0 and 1 after), rest below."""
    c = selector_case(20, (2,), 4, 8, 4, exact=True)
    unary = mx.broadcast_to(mx.array([0.0, -1, 1, -2, -3, 1, -4, -5]), c["unary"].shape)
    unary = mx.where(mx.arange(4)[:, None] > 0, mx.array([1.0, 1, 0, -1, -2, -3, -4, -5]), unary)
    c.update(unary=unary, A=mx.zeros_like(c["A"]))
    return c


def extreme_case():
    """Logits spanning 1e4..-1e30, a candidate so low its q underflows to exactly 0."""
    c = selector_case(21, (2,), 5, 16, 8)
    unary = c["unary"] * 3e3
    unary = unary.at[..., -1].add(-1e30)
    c.update(unary=unary, uniforms=mx.full(c["uniforms"].shape, 0.99999994))
    return c


SELECTOR_CASES = {
    "published k16 r256 B8": (selector_case(30, (2,), 7, 16, 256), (0.0, 1.0)),
    "published k16 r256 B5 batch 1": (selector_case(31, (1,), 4, 16, 256), (0.0, 0.7)),
    "exact quarters k16 r32": (selector_case(32, (3,), 6, 16, 32, exact=True), (0.0, 1.0)),
    "T=1": (selector_case(33, (2,), 1, 16, 16), (0.0, 1.0)),
    "k4 r8 no batch dim": (selector_case(34, (), 3, 4, 8), (0.0, 0.5)),
    "k20 r64 batch (2,2)": (selector_case(35, (2, 2), 5, 20, 64), (0.0, 2.0)),
    "k32 r16 (more pairs than threads)": (selector_case(36, (1,), 3, 32, 16), (0.0, 1.0)),
    "k16 r100 (a partial rank tile)": (selector_case(39, (1,), 3, 16, 100), (0.0, 1.0)),
    "bf16 gate and codebooks": (selector_case(37, (2,), 5, 16, 64, dtype=mx.bfloat16), (0.0, 1.0)),
    "fp16 gate and codebooks": (selector_case(38, (2,), 5, 16, 64, dtype=mx.float16), (0.0, 1.0)),
    "ties": (ties_case(), (0.0,)),
    "extreme logits": (extreme_case(), (0.0, 0.05, 1.0, 1e4)),
}


def sel_args(c):
    return c["unary"], c["cand"], c["gate"], c["anchor"], c["A"], c["B"]


def expand_selector_cases():
    runs = []
    for name, (c, temps) in SELECTOR_CASES.items():
        for t in temps:
            runs.append((name, t))
    return runs


SELECTOR_RUNS = expand_selector_cases()


def assert_scores_close(got, want, c):
    # fp32 sums of R products in another order: bound by R ulps of the largest term.
    bound = (mx.max(mx.abs(want)) + 1.0) * c["gate"].shape[-1] * 2e-7
    err = mx.max(mx.abs(got - want)).item()
    assert err <= bound.item(), f"score error {err} above {bound.item()}"


def production_selector_case(seed, L, R, dtype, V=300, K=16):
    """What the drafter passes: no batch dimension, top_candidates' uint32 ids (from
    argpartition), a 0-d int32 anchor; values in quarters, so the scores are exact in any
    summation order and the paths can be compared with the twin's exactly."""
    k = keys(seed, 7)
    cand, _ = top_candidates(mx.random.normal((L, V), key=k[0]), K)
    args = (quarter((L, K), k[1]), cand, quarter((L, R), k[2]).astype(dtype), mx.array(7),
            quarter((V, R), k[3]).astype(dtype), quarter((V, R), k[4]).astype(dtype))
    return args, mx.random.uniform(shape=(L,), key=k[5])


def broken(src, old, new):
    """``src`` with ``old`` replaced by ``new`` in its body and header."""
    assert old in src.source + src.header
    return kernels.KernelSource(src.name + "_broken", src.input_names, src.output_names,
                                src.source.replace(old, new), src.header.replace(old, new))


def gpu_default():
    mx.set_default_device(mx.gpu)

