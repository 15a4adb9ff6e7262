"""A verify pass whose every row is what a one-row decode step computes, in one pass.

The rows of a pass meet in two places only: the products (a kernel picked by row count sums
in another order) and each layer's attention (the block's queries computed together). Inside
``rows()`` the products run row by row — quantized ones through the exact kernel
(``kernels.exact_rows``: all rows in one launch where MLX's one-row product is its qmv_fast,
MLX's own one-row product per row elsewhere) — and each layer's attention (or recurrent
mixer) runs once per row against the cache, as a one-row step runs it. Norms, activations
and the rest compute each row alone already. Whether that reproduces one-row steps bit for
bit on a given target is not assumed: the probe (``exactness.py``) compares it, and
``exact=True`` uses it only where it did (one-row steps otherwise).

``install`` gives the target's products and mixers a subclass of their own class that does
this only inside ``rows()``; outside it they compute exactly as before.
"""

import threading
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from ..kernels.exact_rows import quantized_rows

# The attribute names mlx-lm's decoder layers give their attention or recurrent mixer.
MIXERS = ("self_attn", "linear_attn", "attention", "attn", "mixer")

_here = threading.local()


def active() -> bool:
    return getattr(_here, "on", False)


@contextmanager
def rows():
    """Run the target's products and mixers row by row while inside."""
    before, _here.on = active(), True
    try:
        yield
    finally:
        _here.on = before


def by_row(fn, x: mx.array) -> mx.array:
    """``fn`` of each row of ``x`` [..., D] alone, shaped as a one-row step's input [1, 1, D]."""
    flat = x.reshape(-1, x.shape[-1])
    outs = [fn(flat[i : i + 1][None]) for i in range(flat.shape[0])]
    return mx.concatenate(outs, axis=1).reshape(*x.shape[:-1], -1)


def _one_row(x) -> bool:
    return x.ndim < 2 or x.size == x.shape[-1]


def _quantized(m, x, mode_of=lambda m: getattr(m, "mode", "affine")):
    return quantized_rows(x, m["weight"], m["scales"], m.get("biases"), m.group_size, m.bits, mode_of(m))


_classes = {}


def _subclass(cls, kind: str):
    if (cls, kind) in _classes:
        return _classes[(cls, kind)]
    if kind == "product":
        own_quantized = cls.__call__ is nn.QuantizedLinear.__call__

        def __call__(self, x):
            if not active() or _one_row(x):
                return cls.__call__(self, x)
            if own_quantized:
                y = _quantized(self, x)
                return y + self["bias"] if "bias" in self else y
            return by_row(lambda r: cls.__call__(self, r), x)

        body = {"__call__": __call__}
    elif kind == "embedding":
        own_quantized = cls.as_linear is nn.QuantizedEmbedding.as_linear

        def as_linear(self, x):
            if not active() or _one_row(x):
                return cls.as_linear(self, x)
            if own_quantized:
                return _quantized(self, x)
            return by_row(lambda r: cls.as_linear(self, r), x)

        body = {"as_linear": as_linear}
    else:

        def __call__(self, x, *args, **kwargs):
            if not active() or x.shape[-2] == 1:
                return cls.__call__(self, x, *args, **kwargs)
            # A one-row step has no mask: its one query reads the whole cache.
            args = (None, *args[1:]) if args else args
            if "mask" in kwargs:
                kwargs = {**kwargs, "mask": None}
            outs = [cls.__call__(self, x[:, i : i + 1], *args, **kwargs) for i in range(x.shape[1])]
            return mx.concatenate(outs, axis=1)

        body = {"__call__": __call__}
    _classes[(cls, kind)] = type(f"RowExact{cls.__name__}", (cls,), body)
    return _classes[(cls, kind)]


def _swap(module, kind: str):
    cls = type(module)
    if not cls.__name__.startswith("RowExact"):
        module.__class__ = _subclass(cls, kind)


def install(model, layers):
    """Let ``model``'s products and the mixers of ``layers`` run row by row inside ``rows()``."""
    for _, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)):
            _swap(m, "product")
        elif isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
            _swap(m, "embedding")
    for layer in layers:
        for name in MIXERS:
            if name in layer and isinstance(layer[name], nn.Module):
                _swap(layer[name], "mixer")
