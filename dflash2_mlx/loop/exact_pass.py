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


# The products a pass runs row by row: the method that computes one, and MLX's own
# quantized version of it (which the exact kernel computes for all rows at once).
PRODUCTS = {"product": ("__call__", nn.QuantizedLinear.__call__),
            "embedding": ("as_linear", nn.QuantizedEmbedding.as_linear)}

_classes = {}


def _row_wise_product(cls, method: str, quantized) -> dict:
    own = getattr(cls, method)
    own_quantized = own is quantized

    def row_wise(self, x):
        if not active() or _one_row(x):
            return own(self, x)
        if own_quantized:
            y = quantized_rows(x, self["weight"], self["scales"], self.get("biases"), self.group_size,
                               self.bits, getattr(self, "mode", "affine"))
            return y + self["bias"] if "bias" in self else y
        return by_row(lambda r: own(self, r), x)

    return {method: row_wise}


def _row_wise_mixer(cls) -> dict:
    def __call__(self, x, *args, **kwargs):
        if not active() or x.shape[-2] == 1:
            return cls.__call__(self, x, *args, **kwargs)
        # A one-row step has no mask: its one query reads the whole cache.
        args = (None, *args[1:]) if args else args
        if "mask" in kwargs:
            kwargs = {**kwargs, "mask": None}
        outs = [cls.__call__(self, x[:, i : i + 1], *args, **kwargs) for i in range(x.shape[1])]
        return mx.concatenate(outs, axis=1)

    return {"__call__": __call__}


def _subclass(cls, kind: str):
    if (cls, kind) not in _classes:
        body = _row_wise_product(cls, *PRODUCTS[kind]) if kind in PRODUCTS else _row_wise_mixer(cls)
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
