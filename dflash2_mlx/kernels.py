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
twins.  The first use of each kernel in a process checks it against its twin on a small
random input; on a mismatch it warns once, naming the kernel, and the twin is used from
then on.  Gradients always come from the twin (``mx.custom_function`` with the twin's
VJP), so training differentiates through the meaning, not the kernel.
"""

import os
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources

import mlx.core as mx

from .conv import dynamic_conv_reference
from .selector import pair_scores_reference, walk_reference

FORCE_REFERENCE_ENV = "DFLASH2_MLX_FORCE_REFERENCE"
KERNEL_NAMES = ("dynamic_conv", "path_selector", "path_walk")


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


def selector_launch(unary, cand, gate, anchor, predecessor_codebook, successor_codebook,
                    temperature=0.0, uniforms=None) -> Launch:
    """Scores, path and q in one launch (see metal/path_selector.metal)."""
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


@dataclass
class SelfCheck:
    kernel: str
    passed: bool
    detail: str = ""


_checks: dict = {}


def _compare(name, got, want, atol, rtol, exact=False):
    got = got.astype(mx.float32) if got.dtype != want.dtype else got
    want = want.astype(got.dtype)
    if got.shape != want.shape:
        return f"{name}: shape {got.shape} != {want.shape}"
    if exact:
        ok = mx.array_equal(got, want).item()
    else:
        ok = mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=atol, rtol=rtol).item()
    if not ok:
        err = mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item()
        return f"{name}: max abs difference {err:.3g}"
    return ""


def _check_inputs_conv():
    key = mx.random.key(20240521)
    k1, k2, k3 = mx.random.split(key, 3)
    x = mx.random.normal((2, 5, 64), key=k1)
    dyn = mx.random.normal((2, 5, 2, 4), key=k2) * 0.5
    base = mx.random.normal((2, 64), key=k3)
    return x, dyn, base


def _check_inputs_selector(ties: bool = False):
    # Quarter-integer values: every product and sum is exact in fp32, so kernel and
    # twin must agree bit for bit whatever the summation order (or FMA contraction).
    # With ties=True the pair terms vanish and the unary scores take only the values
    # 0, 1, 2, so the greedy walk meets tied maxima at every step.
    key = mx.random.key(7)
    k = mx.random.split(key, 5)
    V, R, L, K = 40, 8, 4, 6
    q4 = lambda shape, key: mx.round(mx.random.uniform(-8, 8, shape, key=key)) / 4
    cand = mx.stack([mx.random.permutation(V, key=kk)[:K * L].reshape(L, K)
                     for kk in mx.random.split(k[0], 2)]).astype(mx.int32)
    unary, gate = q4((2, L, K), k[1]), q4((2, L, R), k[2])
    A, B = q4((V, R), k[3]), q4((V, R), k[4])
    if ties:
        unary = mx.round(mx.random.uniform(0, 2, (2, L, K), key=k[1]))
        A = mx.zeros_like(A)
    anchor = mx.array([3, 11], dtype=mx.int32)
    uniforms = mx.random.uniform(shape=(2, L), key=k[0])
    return unary, cand, gate, anchor, A, B, uniforms


def _self_check_conv(run=None):
    run = run or run_metal
    x, dyn, base = _check_inputs_conv()
    problems = []
    for dt in (mx.float32, mx.bfloat16):
        args = (x.astype(dt), dyn.astype(dt), base.astype(dt))
        got = run("dynamic_conv", conv_launch(*args))[0]
        want = dynamic_conv_reference(*args)
        tol = 1e-5 if dt == mx.float32 else 2e-2
        problems.append(_compare(f"{dt}", got, want, tol, tol))
    return "; ".join(p for p in problems if p)


def _self_check_selector(run=None):
    run = run or run_metal
    problems = []
    for ties, temp in ((False, 0.0), (False, 0.7), (True, 0.0)):
        unary, cand, gate, anchor, A, B, u = _check_inputs_selector(ties)
        want_scores = pair_scores_reference(unary, cand, gate, anchor, A, B)
        s, p, q = run("path_selector", selector_launch(unary, cand, gate, anchor, A, B, temp, u))
        wp, wq = walk_reference(want_scores, temp, u)
        problems += [
            _compare("scores", s, want_scores, 0, 0, exact=True),
            _compare(f"path (T={temp})", p, wp, 0, 0, exact=True),
            _compare(f"q (T={temp})", q, wq, 1e-5, 1e-4),
        ]
    return "; ".join(p for p in problems if p)


def _self_check_walk(run=None):
    run = run or run_metal
    problems = []
    for ties, temp in ((False, 0.0), (False, 0.7), (True, 0.0)):
        unary, cand, gate, anchor, A, B, u = _check_inputs_selector(ties)
        scores = pair_scores_reference(unary, cand, gate, anchor, A, B)
        p, q = run("path_walk", walk_launch(scores, temp, u))
        wp, wq = walk_reference(scores, temp, u)
        problems += [_compare(f"path (T={temp})", p, wp, 0, 0, exact=True),
                     _compare(f"q (T={temp})", q, wq, 1e-5, 1e-4)]
    return "; ".join(p for p in problems if p)


_SELF_CHECKS = {
    "dynamic_conv": _self_check_conv,
    "path_selector": _self_check_selector,
    "path_walk": _self_check_walk,
}


def self_check(kernel: str) -> SelfCheck:
    """Check ``kernel`` against its twin once per process (needs Metal); warn on failure."""
    if kernel not in _checks:
        try:
            detail = _SELF_CHECKS[kernel]()
        except Exception as e:  # a kernel that fails to compile or run is a failed check
            detail = f"{type(e).__name__}: {e}"
        result = SelfCheck(kernel, not detail, detail)
        _checks[kernel] = result
        if not result.passed:
            warnings.warn(
                f"dflash2-mlx: the Metal kernel '{kernel}' disagrees with its reference twin "
                f"({detail}); using the twin for the rest of this process",
                RuntimeWarning,
                stacklevel=3,
            )
    return _checks[kernel]


def active_path(kernel: str) -> str:
    """Which implementation ``kernel`` dispatches to right now, with the reason."""
    if reference_forced():
        return f"reference (forced by {FORCE_REFERENCE_ENV})"
    if not mx.metal.is_available():
        return "reference (no Metal back-end)"
    if mx.default_device().type != mx.DeviceType.gpu:
        return "reference (default device is the CPU)"
    check = _checks.get(kernel)
    if check is not None and not check.passed:
        return "reference (self-check failed)"
    return "metal"


def _use_kernel(kernel: str) -> bool:
    if reference_forced() or not metal_usable():
        return False
    return self_check(kernel).passed


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


def _conv_kernel(x, dyn, base):
    return run_metal("dynamic_conv", conv_launch(x, dyn, base))[0]


_conv = _with_twin_vjp(_conv_kernel, dynamic_conv_reference, (True, True, True))


def dynamic_conv(x, dyn, base):
    """conv(x, dyn, base)[t, c] = sum_o (base[o, c] + dyn[t, o, c // g]) * x[t - o, c]."""
    if _profile is not None:
        return _timed("dynamic_conv", _dynamic_conv, x, dyn, base)
    return _dynamic_conv(x, dyn, base)


def _dynamic_conv(x, dyn, base):
    if _use_kernel("dynamic_conv"):
        return _conv(x, dyn, base)
    return dynamic_conv_reference(x, dyn, base)


def _scores_kernel(unary, cand, gate, anchor, pcb, scb):
    return run_metal("path_selector", selector_launch(unary, cand, gate, anchor, pcb, scb))[0]


_scores = _with_twin_vjp(
    _scores_kernel, pair_scores_reference, (True, False, True, False, True, True)
)


def pair_scores(unary, cand, gate, anchor, predecessor_codebook, successor_codebook):
    """All pair scores S[..., t, a, b] (see selector.pair_scores_reference)."""
    args = (unary, cand, gate, anchor, predecessor_codebook, successor_codebook)
    if _profile is not None:
        return _timed("path_selector", _pair_scores, *args)
    return _pair_scores(*args)


def _pair_scores(unary, cand, gate, anchor, predecessor_codebook, successor_codebook):
    if _use_kernel("path_selector"):
        return _scores(unary, cand, gate, mx.array(anchor), predecessor_codebook, successor_codebook)
    return pair_scores_reference(unary, cand, gate, anchor, predecessor_codebook, successor_codebook)


def walk(scores, temperature=0.0, uniforms=None):
    """(path [..., T] int32, q [..., T, k] float32) walked from the anchor."""
    if _profile is not None:
        return _timed("path_selector", _walk, scores, temperature, uniforms)
    return _walk(scores, temperature, uniforms)


def _walk(scores, temperature=0.0, uniforms=None):
    if _use_kernel("path_walk"):
        return tuple(run_metal("path_walk", walk_launch(scores, temperature, uniforms)))
    return walk_reference(scores, temperature, uniforms)


def select(unary, cand, gate, anchor, predecessor_codebook, successor_codebook,
           temperature=0.0, uniforms=None):
    """Score all pairs and walk, in one launch on Metal: (scores, path, q).

    Same result as ``pair_scores`` followed by ``walk``; values only (no gradient
    through the walk).
    """
    args = (unary, cand, gate, anchor, predecessor_codebook, successor_codebook,
            temperature, uniforms)
    if _profile is not None:
        return _timed("path_selector", _select, *args)
    return _select(*args)


def _select(unary, cand, gate, anchor, predecessor_codebook, successor_codebook,
            temperature=0.0, uniforms=None):
    if _use_kernel("path_selector"):
        launch = selector_launch(unary, cand, gate, anchor, predecessor_codebook,
                                 successor_codebook, temperature, uniforms)
        return tuple(run_metal("path_selector", launch))
    scores = pair_scores_reference(unary, cand, gate, anchor, predecessor_codebook, successor_codebook)
    return (scores, *walk_reference(scores, temperature, uniforms))
