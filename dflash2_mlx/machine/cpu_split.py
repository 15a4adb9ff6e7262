"""Multi-row target passes on MLX's CPU backend: each product split over two CPU streams.

A verify pass multiplies a few rows (one block, or one row per sequence of a batch) by every
weight matrix.  OpenBLAS runs such small-M products as sgemms that hardly use a second
thread, while a 1-row product (a plain decode step) uses both cores.  With each product's
output columns split in halves, computed on two CPU streams with one BLAS thread each, a
multi-row pass uses both cores too (with more BLAS threads, the two streams still run one
each).  ``docs/cpu.md`` has what the split saves, with the commands that measure it.

Only the target's float32 Linear layers and its tied LM head are split, and only while a
pass over 2..MAX_ROWS rows runs (``rows``); the BLAS thread count is restored after it, so
plain decoding and long prefills run exactly as mlx-lm runs them.  Off on any other device,
without OpenBLAS (whose thread count it sets), with one BLAS thread, or with
DFLASH2_MLX_CPU_SPLIT=0.  The split changes a verify's logits by float rounding (the sums
run in another order), as any multi-row pass already differs from 1-row steps; what is
emitted is still decided by the target's own logits.
"""

import ctypes
import os
import threading
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

# The most rows a split pass has: on a 2-core x86 with SmolLM2 a longer pass is faster as
# one multi-threaded product (see docs/cpu.md).
MAX_ROWS = 15
_here = threading.local()  # per thread (MLX's streams are not shared across threads): active, streams


def _openblas():
    """OpenBLAS's (get, set) thread-count functions, if it is the BLAS loaded."""
    try:
        lib = ctypes.CDLL(None)
        return lib.openblas_get_num_threads, lib.openblas_set_num_threads
    except (OSError, AttributeError):
        return None


_blas = _openblas()


def _product(x: mx.array, w: mx.array) -> mx.array:
    """``x @ w.T`` with w's rows (the output columns) in halves on the two streams."""
    half = w.shape[0] // 2
    first, second = _here.streams
    with mx.stream(first):
        a = x @ w[:half].T
    with mx.stream(second):
        b = x @ w[half:].T
    return mx.concatenate([a, b], axis=-1)


class SplitLinear(nn.Linear):
    def __call__(self, x):
        if not getattr(_here, "active", False):
            return super().__call__(x)
        y = _product(x, self["weight"])
        return y + self["bias"] if "bias" in self else y


class SplitEmbedding(nn.Embedding):
    def as_linear(self, x):
        return _product(x, self.weight) if getattr(_here, "active", False) else super().as_linear(x)


def enabled() -> bool:
    return _blas is not None and os.environ.get("DFLASH2_MLX_CPU_SPLIT", "1") != "0"


def install(model):
    """Let the float32 Linear layers (and a tied LM head) of ``model`` split their products
    inside ``rows``; outside it they compute exactly as before."""
    if not enabled():
        return
    for _, m in model.named_modules():
        if type(m) in (nn.Linear, SplitLinear) and m.weight.dtype == mx.float32:
            m.__class__ = SplitLinear
        elif type(m) in (nn.Embedding, SplitEmbedding) and m.weight.dtype == mx.float32:
            m.__class__ = SplitEmbedding  # used only where the model ties its LM head


@contextmanager
def rows(n: int):
    """Split the products of a target pass over ``n`` rows built and evaluated inside this
    block, if that pays here; yields whether it does (the caller then evaluates the pass
    before leaving, while the BLAS runs one thread)."""
    if not (enabled() and 2 <= n <= MAX_ROWS and mx.default_device() == mx.cpu):
        yield False
        return
    get, set_ = _blas
    threads = get()
    if threads < 2:
        yield False
        return
    if getattr(_here, "streams", None) is None:
        _here.streams = (mx.new_stream(mx.cpu), mx.new_stream(mx.cpu))
    set_(1)
    _here.active = True
    try:
        yield True
    finally:
        _here.active = False
        set_(threads)
