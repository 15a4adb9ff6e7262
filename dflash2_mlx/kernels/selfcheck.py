"""The self-check of each kernel variant against the pure-MLX twins.

A variant is one compiled kernel as MLX builds it (``variant``): its template values and
each input's dtype and address space.  The first use of a variant in a process runs it
on inputs of the same shapes and dtypes, never the caller's data (``CHECK_CASES``), and
compares with the twins (``conv_problem``, ``path_problem``); the result is kept in
``results`` for the rest of the process, and a failing variant warns once, naming the
variant and saying whether it failed to compile, failed to run or disagreed.
``production_launches`` lists the variants production dispatches, which ``doctor``
self-checks and reports.
"""

import warnings
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from .conv import dynamic_conv_reference
from .launches import conv_launch, scores_launch, selector_launch, walk_launch
from .selector import pair_scores_reference, walk_reference
from .sources import SOURCES, Launch, run_metal

# A variant is one compiled kernel as MLX builds it: the template values, and each
# input's dtype and address space (MLX binds an input of fewer than 8 elements as
# `constant`, a 0-d one by reference). Each variant is self-checked on its first use.
MAX_CONSTANT_ARRAY_SIZE = 8


def _binding(a: mx.array) -> str:
    space = "constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device"
    return f"{space} {a.dtype}".replace("mlx.core.", "") + ("&" if a.ndim == 0 else "*")


def variant(key: str, launch: Launch) -> tuple:
    """The cache key of the compiled kernel ``launch`` runs (see ``describe``)."""
    template = tuple((n, v if isinstance(v, int) else str(v).replace("mlx.core.", ""))
                     for n, v in launch.template)
    return key, template, tuple(_binding(a) for a in launch.inputs)


def describe(v: tuple) -> str:
    """E.g. ``path_selector[K=16 R=256 L=4 NT=256 AG=bfloat16; cand device uint32*, ...]``."""
    key, template, bindings = v
    names = SOURCES[key].input_names
    return (f"{key}[{' '.join(f'{n}={t}' for n, t in template)}; "
            + ", ".join(f"{n} {b}" for n, b in zip(names, bindings)) + "]")


@dataclass
class SelfCheck:
    kernel: str
    passed: bool
    detail: str = ""
    variant: str = ""
    failure: str = ""  # "", "failed to compile", "failed to run" or "disagreed"


# The result of every variant self-checked in this process, by variant.
results: dict = {}

# Messages MLX raises when the Metal compiler rejects a kernel (mlx/backend/metal/device.cpp),
# and the emulator's own (tests/metal_emu).
COMPILE_FAILURES = ("Unable to build metal library", "Unable to load function",
                    "Unable to load kernel", "failed on the emulated kernel")
# The walk's sampled pick may flip where a uniform lies this close to a cumulative sum:
# the kernel uses precise exp and a sequential sum, the twin on a GPU fast::exp and a
# SIMD prefix sum (K terms of at most a few ulps each; 1 ulp of 1.0 is 6e-8).
BOUNDARY_TOL = 4e-6


def _as_f32(a):
    return a.astype(mx.float32)


def _exact_problem(name, got, want):
    if got.shape == want.shape and got.dtype == want.dtype and mx.array_equal(got, want).item():
        return ""
    return f"{name}: not bit-identical to the twin's"


def _close_problem(name, got, want, atol=1e-5, rtol=1e-4):
    if mx.allclose(_as_f32(got), _as_f32(want), atol=atol, rtol=rtol, equal_nan=True).item():
        return ""
    return f"{name}: max abs difference {mx.max(mx.abs(_as_f32(got) - _as_f32(want))).item():.3g}"


def path_problem(label, path, q, want_path, want_q, uniforms, temperature):
    """Problem text when the kernel's walk (path, q) disagrees with the twin's.

    Paths must match exactly, except at a sampled step whose uniform lies within
    ``BOUNDARY_TOL`` of the twin's cumulative sum at every boundary between the two
    picks (a rounding flip, see BOUNDARY_TOL); the rest of that row's walk then follows
    another lattice row and is not compared. q rows are compared up to there."""
    L, K = want_q.shape[-2], want_q.shape[-1]
    gp, wp = path.reshape(-1, L).tolist(), want_path.reshape(-1, L).tolist()
    gq, wq = q.reshape(-1, L, K), want_q.reshape(-1, L, K)
    us = uniforms.reshape(-1, L).tolist()
    cdf = mx.cumsum(wq, axis=-1).tolist()
    for n in range(len(wp)):
        stop = L
        for t in range(L):
            if gp[n][t] == wp[n][t]:
                continue
            lo, hi = sorted((gp[n][t], wp[n][t]))
            near = temperature != 0 and 0 <= lo and hi < K and all(
                abs(cdf[n][t][j] - us[n][t]) <= BOUNDARY_TOL for j in range(lo, hi))
            if not near:
                return (f"path ({label}): row {n} step {t} picks {gp[n][t]}, the twin "
                        f"{wp[n][t]}, not at a sampling boundary")
            stop = t + 1
            break
        problem = _close_problem(f"q ({label})", gq[n, :stop], wq[n, :stop])
        if problem:
            return f"{problem} in row {n}"
    return ""


def _keys(n):
    return mx.random.split(mx.random.key(20240521), n)


def _quarters(shape, key, lo=-8, hi=8):
    # Multiples of 1/4 in [lo/4, hi/4]: with them the selector's products and sums are
    # exact in fp32 (and A * g in bf16 / fp16), so scores match bit for bit in any order.
    return mx.round(mx.random.uniform(lo, hi, shape, key=key)) / 4


@dataclass
class CheckCase:
    """One self-check launch of a variant, with the twin's outputs and how to judge."""

    label: str
    launch: Launch
    want: list
    judge: object  # (outputs, want) -> problem text, "" when they agree


def conv_problem(got, x, dyn, base) -> str:
    """Problem text when the conv kernel's ``got`` is further from the twin than the
    compiler's freedom allows. The Metal compiler may fuse tap0 * x + tap1 * prev into one
    fused multiply-add (a product's rounding skipped), and may keep a tap ``base + dyn`` in
    fp32 where the twin rounds it to C first (another rounding of each product), so the
    guarantee is |got - twin| <= 2 eps_C (|tap0 * x| + |tap1 * prev|) + eps_T |twin| (C the
    compute, T the output dtype): exact to the twin's roundings relative to the products,
    not to the result, which cancellation can make tiny."""
    want = dynamic_conv_reference(x, dyn, base)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"out: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    launch = conv_launch(x, dyn, base)
    C, T = dict(launch.template)["C"], x.dtype
    H = x.shape[-1]
    taps = (base + mx.repeat(dyn, H // dyn.shape[-1], axis=-1)).astype(mx.float32)
    x32 = x.astype(mx.float32)
    prev = mx.concatenate([mx.zeros_like(x32[..., :1, :]), x32[..., :-1, :]], axis=-2)
    mag = mx.abs(taps[..., 0, :] * x32) + mx.abs(taps[..., 1, :] * prev)
    bound = 2 * mx.finfo(C).eps * mag + mx.finfo(T).eps * mx.abs(_as_f32(want))
    g, w = _as_f32(got), _as_f32(want)
    finite = mx.isfinite(g) & mx.isfinite(w)
    same = mx.array_equal(mx.where(finite, 0, g), mx.where(finite, 0, w), equal_nan=True).item()
    excess = mx.max(mx.where(finite, mx.abs(g - w) - bound, 0)).item()
    if not same or excess > 0:
        err = mx.max(mx.where(finite, mx.abs(g - w), 0)).item()
        return f"out: max abs difference {err:.3g}, beyond the rounding bound (FMA, fp32 taps)"
    return ""


def _conv_cases(launch: Launch) -> list:
    x, dyn, base = launch.inputs
    k = _keys(3)
    args = (mx.random.normal(x.shape, key=k[0]).astype(x.dtype),
            (mx.random.normal(dyn.shape, key=k[1]) * 0.5).astype(dyn.dtype),
            mx.random.normal(base.shape, key=k[2]).astype(base.dtype))
    judge = lambda out, want: conv_problem(out[0], *args)
    return [CheckCase("random", conv_launch(*args), [], judge)]


# Greedy, sampled at two temperatures, and greedy on tied maxima (pair terms zero, unary
# scores in {0, 1, 2}).
_WALKS = ((False, 0.0), (False, 0.7), (False, 2.0), (True, 0.0))


def _walk_judge(label, temperature, uniforms, with_scores):
    def judge(out, want):
        problems = [_exact_problem("scores", out[0], want[0])] if with_scores else []
        path, q = out[-2:]
        problems.append(path_problem(label, path, q, *want[-2:], uniforms, temperature))
        return "; ".join(p for p in problems if p)

    return judge


def _selector_check_args(inputs, ties: bool) -> dict:
    """Selector inputs shaped and typed as ``inputs`` (a selector or scores launch's),
    in quarters (exact scores in any order); ``ties``: pair terms zero, unary scores
    in {0, 1, 2}."""
    unary, cand, gate, anchor, A, B = inputs[:6]
    batch, V = cand.shape[:-2], max(64, 2 * cand.shape[-1])
    k = _keys(6)
    return dict(
        unary=(mx.round(mx.random.uniform(0, 2, unary.shape, key=k[0])) if ties
               else _quarters(unary.shape, k[0])).astype(unary.dtype),
        cand=mx.random.randint(0, V, cand.shape, key=k[1]).astype(cand.dtype),
        gate=_quarters(gate.shape, k[2]).astype(gate.dtype),
        anchor=mx.random.randint(0, V, batch, key=k[3]).astype(anchor.dtype),
        predecessor_codebook=(mx.zeros((V, A.shape[1])) if ties
                              else _quarters((V, A.shape[1]), k[4])).astype(A.dtype),
        successor_codebook=_quarters((V, B.shape[1]), k[5]).astype(B.dtype),
    )


def _selector_cases(launch: Launch) -> list:
    uniforms = launch.inputs[7]
    u_key = _keys(6)[0]  # the unary's key, split 32 ways below: one stream per temperature
    cases = []
    for ties, temp in _WALKS:
        args = _selector_check_args(launch.inputs, ties)
        u = mx.random.uniform(shape=uniforms.shape, key=mx.random.split(u_key, 32)[int(temp * 10)])
        scores = pair_scores_reference(**args)
        label = f"T={temp}{' ties' if ties else ''}"
        cases.append(CheckCase(label, selector_launch(**args, temperature=temp, uniforms=u),
                               [scores, *walk_reference(scores, temp, u)],
                               _walk_judge(label, temp, u, with_scores=True)))
    return cases


def _scores_cases(launch: Launch) -> list:
    args = _selector_check_args(launch.inputs, ties=False)
    want = [pair_scores_reference(**args)]
    judge = lambda out, want: _exact_problem("scores", out[0], want[0])
    return [CheckCase("exact", scores_launch(**args), want, judge)]


def _walk_cases(launch: Launch) -> list:
    scores, _, uniforms = launch.inputs
    k = _keys(2)
    cases = []
    for ties, temp in _WALKS:
        s = mx.round(mx.random.uniform(0, 2, scores.shape, key=k[0])) if ties else \
            _quarters(scores.shape, k[0])
        u = mx.random.uniform(shape=uniforms.shape, key=mx.random.split(k[1], 32)[int(temp * 10)])
        label = f"T={temp}{' ties' if ties else ''}"
        cases.append(CheckCase(label, walk_launch(s, temp, u), list(walk_reference(s, temp, u)),
                               _walk_judge(label, temp, u, with_scores=False)))
    return cases


CHECK_CASES = {"dynamic_conv": _conv_cases, "path_selector": _selector_cases,
               "path_scores": _scores_cases, "path_walk": _walk_cases}


def _failure_kind(message: str) -> str:
    return "failed to compile" if any(m in message for m in COMPILE_FAILURES) else "failed to run"


def check_variant(key: str, launch: Launch, run=None) -> SelfCheck:
    """Run the variant of ``launch`` on inputs of its own shapes and dtypes (never the
    caller's data) and compare with the twins; ``run(key, launch)`` runs a kernel
    (default: on Metal)."""
    run = run or run_metal
    name = describe(variant(key, launch))
    problems = []
    try:
        for case in CHECK_CASES[key](launch):
            out = run(key, case.launch)
            mx.eval(out)
            problem = case.judge(out, case.want)
            if problem:
                problems.append(problem)
    except Exception as e:  # a kernel that fails to compile or run fails its check
        detail = f"{type(e).__name__}: {e}".strip()
        return SelfCheck(key, False, detail, name, _failure_kind(detail))
    detail = "; ".join(problems)
    return SelfCheck(key, not detail, detail, name, "disagreed" if detail else "")


def self_check(key: str, launch: Launch = None) -> SelfCheck:
    """Check the variant of ``launch`` (default: the first production variant of ``key``)
    against the twins once per process; warn once per failing variant."""
    launch = launch or production_launches(key)[0]
    v = variant(key, launch)
    if v not in results:
        result = check_variant(key, launch)
        results[v] = result
        if not result.passed:
            warnings.warn(
                f"dflash2-mlx: the Metal kernel {result.variant} {result.failure} "
                f"({result.detail}); its reference twin is used for this variant for the "
                f"rest of this process",
                RuntimeWarning,
                stacklevel=3,
            )
    return results[v]


def checked_variants() -> list:
    """Every variant self-checked in this process (SelfCheck each)."""
    return list(results.values())


def checked(key: str, launch: Launch) -> Optional[SelfCheck]:
    """The self-check of the variant of ``launch`` in this process, None when not run."""
    return results.get(variant(key, launch))


def production_launches(key: str) -> list:
    """Launches of the variant classes production dispatches: the drafter's conv in fp32,
    bf16 and fp16 activations (with an fp32 base too) at H 5120 (several threadgroups),
    blocks of 5 and 16; the selector with no batch dimension (anchor and uniforms then
    bind as `constant`), uint32 (argpartition) and int32 (draft vocabulary) candidates,
    k 16 (256 threads), rank 256, fp32 / bf16 / fp16 gate and codebooks; the walk alike;
    the split scores kernel alike (the batch-1 layout); and one batched launch of each."""
    f32, bf16, f16 = mx.float32, mx.bfloat16, mx.float16
    z = lambda shape, dt: mx.zeros(shape, dtype=dt)
    out = []
    if key == "dynamic_conv":
        H, G = 5120, 320
        for L in (5, 16):
            for xd, bd in ((f32, f32), (bf16, bf16), (f16, f16), (bf16, f32), (f16, f32)):
                out.append(conv_launch(z((1, L, H), xd), z((1, L, 2, G), xd), z((2, H), bd)))
        out.append(conv_launch(z((3, 5, H), bf16), z((3, 5, 2, G), bf16), z((2, H), f32)))
        return out
    K, R, V = 16, 256, 64
    for T in (4, 15):
        for cd in (mx.uint32, mx.int32):
            for wd in (f32, bf16, f16):
                if key == "path_walk":
                    if cd == mx.int32 and wd == f32:
                        out.append(walk_launch(z((T, K, K), f32), 0.7, z((T,), f32)))
                    continue
                args = (z((T, K), f32), z((T, K), cd), z((T, R), wd), mx.array(0),
                        z((V, R), wd), z((V, R), wd))
                out.append(scores_launch(*args) if key == "path_scores"
                           else selector_launch(*args, 0.7, z((T,), f32)))
    if key == "path_walk":
        out.append(walk_launch(z((3, 4, K, K), f32), 0.7, z((3, 4), f32)))
        return out
    args = (z((3, 4, K), f32), z((3, 4, K), mx.int32), z((3, 4, R), f32), z((3,), mx.int32),
            z((V, R), f32), z((V, R), f32))
    out.append(scores_launch(*args) if key == "path_scores"
               else selector_launch(*args, 0.7, z((3, 4), f32)))
    return out
