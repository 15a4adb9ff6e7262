"""Which implementation runs: the Metal kernel or its pure-MLX twin, and the entry
points the drafter calls (``dynamic_conv``, ``pair_scores``, ``walk``, ``select``).

A kernel runs when Metal is available and the default device is the GPU, unless
``DFLASH2_MLX_FORCE_REFERENCE=1`` (or ``force_reference(True)``) asks for the twins,
and only in a variant that passed its self-check (``kernels.selfcheck``); otherwise the
twin runs.  The selector has two layouts: fused (scores and walk in one launch, one
threadgroup per batch row) and split (``path_scores`` across threadgroups with the
codebook rows in threadgroup memory, then ``path_walk``), which ``select`` runs below
SPLIT_BELOW_ROWS batch rows and falls back from, per variant, to the fused one.
Gradients always come from the twin (``mx.custom_function`` with the twin's VJP), so
training differentiates through the meaning, not the kernel.  ``profile`` times every
dispatched call (for ``dflash2-mlx bench kernels``).
"""

import os
import time
from contextlib import contextmanager

import mlx.core as mx

from .conv import dynamic_conv_reference
from .launches import batch_rows, conv_launch, scores_launch, selector_launch, walk_launch
from .selector import pair_scores_reference, walk_reference
from .selfcheck import checked, checked_variants, self_check
from .sources import Launch, run_metal

FORCE_REFERENCE_ENV = "DFLASH2_MLX_FORCE_REFERENCE"


def with_twin_vjp(forward, twin, differentiable):
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


# ---- kernel or twin ------------------------------------------------------------------

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
        check = checked(key, launch)
        if check is not None and not check.passed:
            return f"reference (self-check {check.failure})"
    else:
        failed = [c for c in checked_variants() if c.kernel == key and not c.passed]
        if failed:
            return f"metal ({len(failed)} variant(s) on the reference after a failed self-check)"
    return "metal"


def kernel_launch(key: str, build, *args):
    """``build(*args)`` when the kernel should run it (Metal usable, not forced off, and
    its variant passed the self-check), else None: the caller uses the twin."""
    if reference_forced() or not metal_usable():
        return None
    launch = build(*args)
    return launch if self_check(key, launch).passed else None


# ---- timing hook (for the draft-cycle share in eval.kernel_bench) ------------------

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


_conv = with_twin_vjp(_conv_kernel, dynamic_conv_reference, (True, True, True))


def dynamic_conv(x, dyn, base):
    """conv(x, dyn, base)[t, c] = sum_o (base[o, c] + dyn[t, o, c // g]) * x[t - o, c]."""
    if _profile is not None:
        return _timed("dynamic_conv", _dynamic_conv, x, dyn, base)
    return _dynamic_conv(x, dyn, base)


def _dynamic_conv(x, dyn, base):
    if kernel_launch("dynamic_conv", conv_launch, x, dyn, base):
        return _conv(x, dyn, base)
    return dynamic_conv_reference(x, dyn, base)


def _scores_kernel(unary, cand, gate, anchor, pcb, scb):
    return run_metal("path_scores", scores_launch(unary, cand, gate, anchor, pcb, scb))[0]


_scores = with_twin_vjp(
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
    if kernel_launch("path_scores", scores_launch, *args):
        return _scores(*args)
    return pair_scores_reference(*args)


def walk(scores, temperature=0.0, uniforms=None):
    """(path [..., T] int32, q [..., T, k] float32) walked from the anchor."""
    if _profile is not None:
        return _timed("path_selector", _walk, scores, temperature, uniforms)
    return _walk(scores, temperature, uniforms)


def _walk(scores, temperature=0.0, uniforms=None):
    launch = kernel_launch("path_walk", walk_launch, scores, temperature, uniforms)
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
    if batch_rows(cand.shape[:-2]) < SPLIT_BELOW_ROWS:
        out = _select_split(args, temperature, uniforms)
        if out:
            return out
    launch = kernel_launch("path_selector", selector_launch, *args, temperature, uniforms)
    if launch:
        return tuple(run_metal("path_selector", launch))
    scores = pair_scores_reference(*args)
    return (scores, *walk_reference(scores, temperature, uniforms))


def _select_split(args, temperature, uniforms):
    """(scores, path, q) from the scores kernel and the walk kernel, or None when either
    variant is not usable (the scores launch is lazy: nothing runs until both pass)."""
    launch = kernel_launch("path_scores", scores_launch, *args)
    if not launch:
        return None
    scores = run_metal("path_scores", launch)[0]
    walk = kernel_launch("path_walk", walk_launch, scores, temperature, uniforms)
    if not walk:
        return None
    return (scores, *run_metal("path_walk", walk))
