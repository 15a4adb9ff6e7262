"""The facts each record of the store is keyed by (``store.py``)."""

import mlx.core as mx
from mlx.utils import tree_flatten

from ..machine.identity import identity
from . import store


def shapes(module) -> list:
    """Every weight's name, dtype and shape: what a pass costs depends on them, not on values."""
    return sorted((k, v.dtype.__repr__(), v.shape) for k, v in tree_flatten(module.parameters()))


def pair(target, drafter) -> dict:
    """The pair a cost model prices, whatever the machine (``target``: the loop's adapter)."""
    return {"target": shapes(target.model), "drafter": shapes(drafter),
            "drafter_activations": str(drafter.activation_dtype)}


def costs(target, drafter) -> str:
    """The pair's pass costs: the pair's shapes on this machine (its MLX, device and BLAS)."""
    return store.digest({"pair": pair(target, drafter), "machine": identity()})


def pair_digest(target, drafter) -> str:
    """The pair alone, as a cost file written for another machine names it."""
    return store.digest(pair(target, drafter))


def acceptance(target, drafter, greedy: bool) -> str:
    """A pair's acceptance history: its weights themselves (acceptance depends on them), the
    machine (its rows round as they do) and the sampling kind.  Weights are probed by a sum
    over ~4096 evenly spaced entries of each of the first four (summing every weight would
    cost each request a pass over the whole embedding)."""
    def probe(m):
        return [float(mx.sum(v.reshape(-1)[:: max(1, v.size // 4096)].astype(mx.float32)))
                for _, v in tree_flatten(m.parameters())[:4]]
    return store.digest({"pair": pair(target, drafter), "machine": identity(), "target_weights": probe(target.model),
                         "drafter_weights": probe(drafter), "sampling": "greedy" if greedy else "sampled"})


def exactness(model) -> str:
    """A target's row-exactness verdict: its shapes on this machine (its BLAS or GPU)."""
    return store.digest({"target": shapes(model), "machine": identity()})


def source(where: dict) -> str:
    """What a checkpoint's directory loaded as on this machine (``calibration.exactness.source_of``)."""
    return store.digest({"source": where, "machine": identity()})
