"""Metal kernels for DFlash 2's dynamic conv and path selector, with dispatch to their
pure-MLX twins.

The kernel bodies live in ``metal/*.metal`` (package ``dflash2_mlx.metal``) and are
handed verbatim to ``mx.fast.metal_kernel``; each ``*_launch`` function below is the
plain wrapper that turns arrays into the launch (inputs, template arguments, grid,
output shapes).  The same ``KernelSource`` + ``Launch`` pair is what the CPU emulation
harness in ``tests/metal_emu`` compiles and runs, so the harness exercises exactly the
text and arguments the GPU gets.

Dispatch: a kernel runs when Metal is available and the default device is the GPU,
unless ``DFLASH2_MLX_FORCE_REFERENCE=1`` (or ``force_reference(True)``) asks for the
twins.  The first use of each kernel *variant* in a process (template values, input
dtypes and address spaces: see ``variant``) checks it against its twin on inputs of the
same shapes and dtypes; on a failure it warns once, naming the variant and saying whether
it failed to compile, failed to run or disagreed, and that variant uses the twin from
then on.  The selector has two layouts: fused (scores and walk in one launch, one
threadgroup per batch row) and split (``path_scores`` across threadgroups with the
codebook rows in threadgroup memory, then ``path_walk``), which ``select`` runs below
SPLIT_BELOW_ROWS batch rows and falls back from, per variant, to the fused one.
Gradients always come from the twin (``mx.custom_function`` with the twin's
VJP), so training differentiates through the meaning, not the kernel.
"""

import os
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources

import mlx.core as mx

from ..model.conv import dynamic_conv_reference
from ..model.selector import pair_scores_reference, walk_reference

FORCE_REFERENCE_ENV = "DFLASH2_MLX_FORCE_REFERENCE"
KERNEL_NAMES = ("dynamic_conv", "path_selector", "path_scores", "path_walk")


# ---- kernel sources ------------------------------------------------------------


def read_sections(filename: str) -> dict:
    """Split ``metal/<filename>`` into its ``//@ name`` sections (text before the
    first marker is the file's comment and is dropped)."""
    text = resources.files("dflash2_mlx.metal").joinpath(filename).read_text()
    sections, name, lines = {}, None, []
    for line in text.splitlines():
        if line.startswith("//@ "):
            if name is not None:
                sections[name] = "\n".join(lines).strip("\n") + "\n"
            name, lines = line[4:].strip(), []
        elif name is not None:
            lines.append(line)
    if name is not None:
        sections[name] = "\n".join(lines).strip("\n") + "\n"
    return sections


@dataclass(frozen=True)
class KernelSource:
    """The arguments of ``mx.fast.metal_kernel`` for one kernel."""

    name: str
    input_names: tuple
    output_names: tuple
    source: str
    header: str = ""


@dataclass
class Launch:
    """The arguments of one call of a ``mx.fast.metal_kernel`` object."""

    inputs: list
    template: list
    grid: tuple
    threadgroup: tuple
    output_shapes: list
    output_dtypes: list


def _sources() -> dict:
    conv = read_sections("dynamic_conv.metal")
    sel = read_sections("path_selector.metal")
    return {
        "dynamic_conv": KernelSource(
            name="dflash2_dynamic_conv",
            input_names=("x", "dyn", "base"),
            output_names=("out",),
            source=conv["conv"],
        ),
        "path_selector": KernelSource(
            name="dflash2_path_selector",
            input_names=(
                "unary", "cand", "gate", "anchor", "predecessor_codebook",
                "successor_codebook", "temperature", "uniforms",
            ),
            output_names=("scores", "path", "q"),
            source=sel["select"],
            header=sel["header"],
        ),
        "path_scores": KernelSource(
            name="dflash2_path_scores",
            input_names=(
                "unary", "cand", "gate", "anchor", "predecessor_codebook",
                "successor_codebook",
            ),
            output_names=("scores",),
            source=sel["scores"],
        ),
        "path_walk": KernelSource(
            name="dflash2_path_walk",
            input_names=("scores", "temperature", "uniforms"),
            output_names=("path", "q"),
            source=sel["walk"],
            header=sel["header"],
        ),
    }


SOURCES = _sources()


# ---- launches: shapes, grids, template arguments -----------------------------------


def _promote(*dtypes):
    out = dtypes[0]
    for d in dtypes[1:]:
        out = mx.result_type(out, d)
    return out


def _rows(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def conv_launch(x: mx.array, dyn: mx.array, base: mx.array) -> Launch:
    """x [..., L, H], dyn [..., L, 2, H // g], base [2, H] -> out [..., L, H] (x's dtype)."""
    *batch, L, H = x.shape
    G = dyn.shape[-1]
    if G == 0 or H % G:
        raise ValueError(f"hidden size {H} is not a multiple of the {G} channel groups")
    if tuple(dyn.shape) != (*batch, L, 2, G) or tuple(base.shape) != (2, H):
        raise ValueError(f"conv shapes disagree: x {x.shape}, dyn {dyn.shape}, base {base.shape}")
    tap = _promote(base.dtype, dyn.dtype)
    return Launch(
        inputs=[x, dyn, base],
        template=[("T", x.dtype), ("TAP", tap), ("C", _promote(tap, x.dtype)),
                  ("H", H), ("GS", H // G), ("L", L)],
        grid=(H, L, _rows(batch)),
        threadgroup=(min(H, 256), 1, 1),
        output_shapes=[tuple(x.shape)],
        output_dtypes=[x.dtype],
    )


def _walk_inputs(batch, L, temperature, uniforms):
    temp = mx.array(float(temperature), dtype=mx.float32)
    if uniforms is None:
        if temperature != 0:
            raise ValueError("sampling (temperature > 0) needs uniforms")
        uniforms = mx.zeros((*batch, L), dtype=mx.float32)
    return temp, mx.broadcast_to(uniforms, (*batch, L)).astype(mx.float32)


def _selector_anchor(unary, cand, gate, anchor, predecessor_codebook, successor_codebook):
    """Check the selector's shapes and dtypes; the anchor as one id per batch row."""
    *batch, L, K = cand.shape
    R = gate.shape[-1]
    V = predecessor_codebook.shape[0]
    if tuple(unary.shape) != tuple(cand.shape) or tuple(gate.shape[:-1]) != (*batch, L):
        raise ValueError(f"selector shapes disagree: unary {unary.shape}, cand {cand.shape}, gate {gate.shape}")
    if predecessor_codebook.shape[-1] != R or successor_codebook.shape[-1] != R:
        raise ValueError("codebook rank differs from the gate's")
    if max(V, successor_codebook.shape[0]) * R >= 2**32:
        raise ValueError("codebooks too large for 32-bit indexing")
    if not mx.issubdtype(cand.dtype, mx.integer):
        raise ValueError("candidates must be integer token ids")
    anchor = mx.broadcast_to(mx.array(anchor), tuple(batch)).reshape(-1)
    if not mx.issubdtype(anchor.dtype, mx.integer):
        raise ValueError("anchor must be integer token ids")
    return anchor


def selector_launch(unary, cand, gate, anchor, predecessor_codebook, successor_codebook,
                    temperature=0.0, uniforms=None) -> Launch:
    """Scores, path and q in one launch (see metal/path_selector.metal)."""
    *batch, L, K = cand.shape
    R = gate.shape[-1]
    anchor = _selector_anchor(unary, cand, gate, anchor, predecessor_codebook, successor_codebook)
    temp, uniforms = _walk_inputs(batch, L, temperature, uniforms)
    nt = min(K * K, 256)
    return Launch(
        inputs=[unary, cand, gate, anchor, predecessor_codebook, successor_codebook,
                temp, uniforms],
        template=[("K", K), ("R", R), ("L", L), ("NT", nt),
                  ("AG", _promote(predecessor_codebook.dtype, gate.dtype))],
        grid=(nt, _rows(batch), 1),
        threadgroup=(nt, 1, 1),
        output_shapes=[(*batch, L, K, K), (*batch, L), (*batch, L, K)],
        output_dtypes=[mx.float32, mx.int32, mx.float32],
    )


# Metal's threadgroup memory per threadgroup on every Apple GPU (MTLDevice
# maxThreadgroupMemoryLength); the scores kernel's two tiles must fit in it.
MAX_THREADGROUP_MEMORY = 32768
SCORE_THREADS = 256  # threads per threadgroup the scores kernel aims for
RANK_TILE = 64  # rank columns staged per tile when memory allows


def score_tiles(K: int, R: int) -> tuple:
    """(AB, RT): predecessor rows per threadgroup (AB * K threads, at most SCORE_THREADS
    unless K alone exceeds it) and rank columns per tile, the largest up to RANK_TILE whose
    two padded float tiles, (AB + K) * (RT + 1) * 4 bytes, fit in threadgroup memory."""
    if K > 1024:
        raise ValueError(f"k {K} exceeds Metal's 1024 threads per threadgroup")
    ab = min(K, max(1, SCORE_THREADS // K))
    rt = min(R, RANK_TILE, MAX_THREADGROUP_MEMORY // (4 * (ab + K)) - 1)
    return ab, rt


def scores_launch(unary, cand, gate, anchor, predecessor_codebook, successor_codebook) -> Launch:
    """Scores alone, split across threadgroups: one per (batch row, position, tile of
    predecessor rows), with the codebook rows staged in threadgroup memory (see
    metal/path_selector.metal, `scores`). ``walk_launch`` walks them."""
    *batch, L, K = cand.shape
    R = gate.shape[-1]
    anchor = _selector_anchor(unary, cand, gate, anchor, predecessor_codebook, successor_codebook)
    ab, rt = score_tiles(K, R)
    return Launch(
        inputs=[unary, cand, gate, anchor, predecessor_codebook, successor_codebook],
        template=[("K", K), ("R", R), ("L", L), ("AB", ab), ("RT", rt),
                  ("AG", _promote(predecessor_codebook.dtype, gate.dtype))],
        grid=(ab * K * -(-K // ab), L, _rows(batch)),
        threadgroup=(ab * K, 1, 1),
        output_shapes=[(*batch, L, K, K)],
        output_dtypes=[mx.float32],
    )


def walk_launch(scores, temperature=0.0, uniforms=None) -> Launch:
    *batch, L, K, K2 = scores.shape
    if K != K2:
        raise ValueError(f"scores must be [..., T, k, k], got {scores.shape}")
    temp, uniforms = _walk_inputs(batch, L, temperature, uniforms)
    n = _rows(batch)
    return Launch(
        inputs=[scores.astype(mx.float32), temp, uniforms],
        template=[("K", K), ("L", L)],
        grid=(n, 1, 1),
        threadgroup=(min(n, 64), 1, 1),
        output_shapes=[(*batch, L), (*batch, L, K)],
        output_dtypes=[mx.int32, mx.float32],
    )


# ---- running on Metal --------------------------------------------------------------

_metal_kernels = {}


def run_metal(key: str, launch: Launch) -> list:
    """Call the real kernel (raises "No Metal back-end" where there is none)."""
    if key not in _metal_kernels:
        src = SOURCES[key]
        _metal_kernels[key] = mx.fast.metal_kernel(
            name=src.name,
            input_names=list(src.input_names),
            output_names=list(src.output_names),
            source=src.source,
            header=src.header,
        )
    return _metal_kernels[key](
        inputs=launch.inputs,
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
    )


def _with_twin_vjp(forward, twin, differentiable):
    """``forward`` for values, ``twin``'s VJP for gradients (integer args get zeros)."""

    @mx.custom_function
    def f(*args):
        return forward(*args)

    @f.vjp
    def f_vjp(primals, cotangents, outputs):
        idx = [i for i in range(len(primals)) if differentiable[i]]

        def on_floats(*xs):
            full = list(primals)
            for i, x in zip(idx, xs):
                full[i] = x
            return twin(*full)

        cots = cotangents if isinstance(cotangents, (list, tuple)) else [cotangents]
        _, grads = mx.vjp(on_floats, [primals[i] for i in idx], list(cots))
        out = [mx.zeros_like(p) for p in primals]
        for i, g in zip(idx, grads):
            out[i] = g
        return tuple(out)

    return f


# ---- dispatch and self-check ------------------------------------------------------

_force_reference = None


def force_reference(value=True):
    """Force the twins (True), allow the kernels (False), or defer to the env var (None)."""
    global _force_reference
    _force_reference = value


def reference_forced() -> bool:
    if _force_reference is not None:
        return bool(_force_reference)
    return os.environ.get(FORCE_REFERENCE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def metal_usable() -> bool:
    return mx.metal.is_available() and mx.default_device().type == mx.DeviceType.gpu


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


_checks: dict = {}

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
    """Problem text when the conv kernel's ``got`` is further from the twin than FMA
    contraction allows. The Metal compiler may fuse tap0 * x + tap1 * prev into one
    fused multiply-add (one rounding of a product skipped), so the guarantee is
    |got - twin| <= eps_C * max(|tap0 * x|, |tap1 * prev|) + eps_T * |twin| (C the compute,
    T the output dtype): exact to the twin's rounding relative to the products, not to
    the result, which cancellation can make tiny."""
    want = dynamic_conv_reference(x, dyn, base)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"out: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    launch = conv_launch(x, dyn, base)
    C, T = dict(launch.template)["C"], x.dtype
    H = x.shape[-1]
    taps = (base + mx.repeat(dyn, H // dyn.shape[-1], axis=-1)).astype(mx.float32)
    x32 = x.astype(mx.float32)
    prev = mx.concatenate([mx.zeros_like(x32[..., :1, :]), x32[..., :-1, :]], axis=-2)
    mag = mx.maximum(mx.abs(taps[..., 0, :] * x32), mx.abs(taps[..., 1, :] * prev))
    bound = mx.finfo(C).eps * mag + mx.finfo(T).eps * mx.abs(_as_f32(want))
    g, w = _as_f32(got), _as_f32(want)
    finite = mx.isfinite(g) & mx.isfinite(w)
    same = mx.array_equal(mx.where(finite, 0, g), mx.where(finite, 0, w), equal_nan=True).item()
    excess = mx.max(mx.where(finite, mx.abs(g - w) - bound, 0)).item()
    if not same or excess > 0:
        err = mx.max(mx.where(finite, mx.abs(g - w), 0)).item()
        return f"out: max abs difference {err:.3g}, beyond the fused-multiply-add bound"
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
    if v not in _checks:
        result = check_variant(key, launch)
        _checks[v] = result
        if not result.passed:
            warnings.warn(
                f"dflash2-mlx: the Metal kernel {result.variant} {result.failure} "
                f"({result.detail}); its reference twin is used for this variant for the "
                f"rest of this process",
                RuntimeWarning,
                stacklevel=3,
            )
    return _checks[v]


def checked_variants() -> list:
    """Every variant self-checked in this process (SelfCheck each)."""
    return list(_checks.values())


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


def active_path(key: str, launch: Launch = None) -> str:
    """Which implementation ``key`` (the variant of ``launch`` when given) dispatches to
    right now, with the reason."""
    if reference_forced():
        return f"reference (forced by {FORCE_REFERENCE_ENV})"
    if not mx.metal.is_available():
        return "reference (no Metal back-end)"
    if mx.default_device().type != mx.DeviceType.gpu:
        return "reference (default device is the CPU)"
    if launch is not None:
        check = _checks.get(variant(key, launch))
        if check is not None and not check.passed:
            return f"reference (self-check {check.failure})"
    else:
        failed = [c for c in _checks.values() if c.kernel == key and not c.passed]
        if failed:
            return f"metal ({len(failed)} variant(s) on the reference after a failed self-check)"
    return "metal"


def _kernel_launch(key: str, build, *args):
    """``build(*args)`` when the kernel should run it (Metal usable, not forced off, and
    its variant passed the self-check), else None: the caller uses the twin."""
    if reference_forced() or not metal_usable():
        return None
    launch = build(*args)
    return launch if self_check(key, launch).passed else None


# ---- timing hook (for the draft-cycle share in kernel_bench) -----------------------

_profile = None


@contextmanager
def profile():
    """Time every dispatched call while active: yields {group: [ms, calls]} with groups
    "dynamic_conv" and "path_selector" (scores and walk). Each call's inputs are
    evaluated before its clock starts and its outputs before it stops, so calls are
    timed alone (this adds sync points: time the surrounding work separately)."""
    global _profile
    _profile = {"dynamic_conv": [0.0, 0], "path_selector": [0.0, 0]}
    try:
        yield _profile
    finally:
        _profile = None


def _timed(group, fn, *args):
    mx.eval([a for a in args if isinstance(a, mx.array)])
    t0 = time.perf_counter()
    out = fn(*args)
    mx.eval(out)
    _profile[group][0] += (time.perf_counter() - t0) * 1e3
    _profile[group][1] += 1
    return out


# ---- the functions the drafter calls ----------------------------------------------
# Each builds its launch (cheap, pure Python), then runs the kernel when Metal is usable
# and that variant passed its self-check, else the twin.


def _conv_kernel(x, dyn, base):
    return run_metal("dynamic_conv", conv_launch(x, dyn, base))[0]


_conv = _with_twin_vjp(_conv_kernel, dynamic_conv_reference, (True, True, True))


def dynamic_conv(x, dyn, base):
    """conv(x, dyn, base)[t, c] = sum_o (base[o, c] + dyn[t, o, c // g]) * x[t - o, c]."""
    if _profile is not None:
        return _timed("dynamic_conv", _dynamic_conv, x, dyn, base)
    return _dynamic_conv(x, dyn, base)


def _dynamic_conv(x, dyn, base):
    if _kernel_launch("dynamic_conv", conv_launch, x, dyn, base):
        return _conv(x, dyn, base)
    return dynamic_conv_reference(x, dyn, base)


def _scores_kernel(unary, cand, gate, anchor, pcb, scb):
    return run_metal("path_scores", scores_launch(unary, cand, gate, anchor, pcb, scb))[0]


_scores = _with_twin_vjp(
    _scores_kernel, pair_scores_reference, (True, False, True, False, True, True)
)


def pair_scores(unary, cand, gate, anchor, predecessor_codebook, successor_codebook):
    """All pair scores S[..., t, a, b] (see selector.pair_scores_reference); on Metal the
    split scores kernel, at any batch size (it has no walk to keep in one launch)."""
    args = (unary, cand, gate, anchor, predecessor_codebook, successor_codebook)
    if _profile is not None:
        return _timed("path_selector", _pair_scores, *args)
    return _pair_scores(*args)


def _pair_scores(unary, cand, gate, anchor, predecessor_codebook, successor_codebook):
    args = (unary, cand, gate, mx.array(anchor), predecessor_codebook, successor_codebook)
    if _kernel_launch("path_scores", scores_launch, *args):
        return _scores(*args)
    return pair_scores_reference(*args)


def walk(scores, temperature=0.0, uniforms=None):
    """(path [..., T] int32, q [..., T, k] float32) walked from the anchor."""
    if _profile is not None:
        return _timed("path_selector", _walk, scores, temperature, uniforms)
    return _walk(scores, temperature, uniforms)


def _walk(scores, temperature=0.0, uniforms=None):
    launch = _kernel_launch("path_walk", walk_launch, scores, temperature, uniforms)
    if launch:
        return tuple(run_metal("path_walk", launch))
    return walk_reference(scores, temperature, uniforms)


# Below this many batch rows `select` runs the split layout (scores kernel, then walk
# kernel): the fused kernel's one threadgroup per row would leave most of the GPU idle
# (the smallest Apple GPUs have 7-8 cores). A guess from the layouts, not a measurement:
# `dflash2-mlx bench kernels` times both on a Mac.
SPLIT_BELOW_ROWS = 8


def select(unary, cand, gate, anchor, predecessor_codebook, successor_codebook,
           temperature=0.0, uniforms=None):
    """Score all pairs and walk on Metal: (scores, path, q).

    Below SPLIT_BELOW_ROWS batch rows (production drafts one row) in two launches,
    scores split across threadgroups then the walk; otherwise in one fused launch. Each
    launch's variant must pass its self-check, else the next layout down is used:
    split, fused, twin. Same result as ``pair_scores`` followed by ``walk``; values only
    (no gradient through the walk).
    """
    args = (unary, cand, gate, anchor, predecessor_codebook, successor_codebook,
            temperature, uniforms)
    if _profile is not None:
        return _timed("path_selector", _select, *args)
    return _select(*args)


def _select(unary, cand, gate, anchor, predecessor_codebook, successor_codebook,
            temperature=0.0, uniforms=None):
    args = (unary, cand, gate, anchor, predecessor_codebook, successor_codebook)
    if _rows(cand.shape[:-2]) < SPLIT_BELOW_ROWS:
        out = _select_split(args, temperature, uniforms)
        if out:
            return out
    launch = _kernel_launch("path_selector", selector_launch, *args, temperature, uniforms)
    if launch:
        return tuple(run_metal("path_selector", launch))
    scores = pair_scores_reference(*args)
    return (scores, *walk_reference(scores, temperature, uniforms))


def _select_split(args, temperature, uniforms):
    """(scores, path, q) from the scores kernel and the walk kernel, or None when either
    variant is not usable (the scores launch is lazy: nothing runs until both pass)."""
    launch = _kernel_launch("path_scores", scores_launch, *args)
    if not launch:
        return None
    scores = run_metal("path_scores", launch)[0]
    walk = _kernel_launch("path_walk", walk_launch, scores, temperature, uniforms)
    if not walk:
        return None
    return (scores, *run_metal("path_walk", walk))
