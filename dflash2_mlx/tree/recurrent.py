"""A tree pass through the recurrent layers of hybrid targets (qwen3_5, qwen3_5_moe, qwen3_next).

A GatedDeltaNet layer has no mask to give: a node's output depends on the conv window and
the state its own path leaves.  Its projections read each row alone, so they run once over
every node, as in a chain's pass; the conv reads each node's own window (its last ancestors,
the cache's conv state before the anchor); the recurrence runs one depth at a time, the
nodes of a depth as a batch of one-token steps, each from its parent's state (the anchor
from the cache's).  Every node's conv and recurrent state is kept, and ``keep`` puts the
accepted node's into the cache: the state the accepted path alone leaves, without reading
it again (a chain's pass on a hybrid keeps only its last row's state and reads the kept
tokens again when it keeps fewer).

The layers are mlx-lm's own modules; a tree pass gives each a subclass of its own class
(``install``) whose call does the above only while a tree is set, the model's own call
otherwise.  The two layouts mlx-lm 0.32 writes (qwen3_5's ``in_proj_qkv`` and
qwen3_next's ``in_proj_qkvz``) are read by ``_front``; the rest of the layer is shared.
"""

from typing import List

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from .grow import Tree

# The attribute name of the recurrent mixers (called as (x, mask, cache)).
RECURRENT = "linear_attn"
_NEEDS = ("conv1d", "A_log", "dt_bias", "norm", "out_proj")

_classes = {}


def known(m: nn.Module) -> bool:
    """Whether ``m`` is a GatedDeltaNet whose layout a tree pass reads."""
    return (all(n in m for n in _NEEDS) and ("in_proj_qkvz" in m or "in_proj_qkv" in m)
            and getattr(m, "sharding_group", None) is None)


def _front(m, x: mx.array):
    """The conv's input [1, n, C] and z, b, a of the rows ``x`` (mlx-lm's two layouts)."""
    B, S, _ = x.shape
    if "in_proj_qkvz" in m:
        q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z, b, a
    z = m.in_proj_z(x).reshape(B, S, m.num_v_heads, m.head_v_dim)
    return m.in_proj_qkv(x), z, m.in_proj_b(x), m.in_proj_a(x)


def windows(tree: Tree, width: int) -> np.ndarray:
    """[n, width] rows of [conv state (width - 1 rows), nodes...] each node's conv reads: its
    last ancestors, then itself (worked out once per tree: every recurrent layer reads it)."""
    key = ("windows", width)
    if key not in tree.derived:
        n, pad = tree.tokens.size, width - 1
        out = np.zeros((n, width), dtype=np.int32)
        for i in range(n):
            prev = out[tree.parents[i]] if i else np.arange(width, dtype=np.int32) - 1
            out[i] = np.append(prev[1:], pad + i)
        tree.derived[key] = out
    return tree.derived[key]


def tree_layer(m, x: mx.array, cache: ArraysCache, tree: Tree) -> mx.array:
    """The layer's rows [1, n, H] for the tree's nodes; their states left on ``cache``."""
    qkv, z, b, a = _front(m, x)
    K, n = m.conv_kernel_size, tree.tokens.size
    conv_state = cache[0] if cache[0] is not None else mx.zeros((1, K - 1, qkv.shape[-1]), dtype=qkv.dtype)
    rows = mx.concatenate([conv_state, qkv], axis=1)[0]
    win = windows(tree, K)
    window = rows[mx.array(win)]  # [n, K, C]
    conv_out = nn.silu(m.conv1d(window))  # [n, 1, C]: each node's window alone
    q, k, v = [t.reshape(n, 1, h, d) for t, h, d in zip(
        mx.split(conv_out, [m.key_dim, 2 * m.key_dim], -1),
        [m.num_k_heads, m.num_k_heads, m.num_v_heads], [m.head_k_dim, m.head_k_dim, m.head_v_dim])]
    q, k = normalize_qk(q, k, inv_scale=m.head_k_dim**-0.5, eps=1e-6)
    a, b = a[0][:, None], b[0][:, None]
    states: List = [None] * n
    outs, order = [], []
    for d in range(int(tree.depths.max()) + 1):
        idx = np.flatnonzero(tree.depths == d)
        at = mx.array(idx)
        start = cache[1] if d == 0 else mx.concatenate([states[p] for p in tree.parents[idx]])
        out, state = gated_delta_update(q[at], k[at], v[at], a[at], b[at], m.A_log, m.dt_bias, start,
                                        None, use_kernel=not m.training)
        for r, i in enumerate(idx):  # gathers, not slices: a kept slice would hold the batch
            states[i] = mx.take(state, mx.array([r]), axis=0)
        outs.append(out)
        order.extend(idx)
    out = mx.concatenate(outs)[mx.array(np.argsort(np.array(order)))]  # [n, 1, Hv, Dv] in node order
    object.__setattr__(cache, "_dflash_tree_states", [[rows[mx.array(win[i, 1:])][None], states[i]] for i in range(n)])
    out = m.norm(out.reshape(1, n, *out.shape[2:]), z)
    return m.out_proj(out.reshape(1, n, -1))


def _tree_wise(cls):
    if cls not in _classes:

        def __call__(self, x, mask=None, cache=None):
            tree = object.__getattribute__(self, "_dflash_tree")[0]
            if tree is None or cache is None or x.shape[1] != tree.tokens.size:
                return cls.__call__(self, x, mask, cache)
            return tree_layer(self, x, cache, tree)

        _classes[cls] = type(f"TreeWise{cls.__name__}", (cls,), {"__call__": __call__})
    return _classes[cls]


def install(model) -> tuple:
    """Give ``model``'s recurrent mixers their tree-pass subclass: (the holder a tree pass
    sets its tree in, how many mixers took it).  A model installed before keeps its holder:
    every tree verifier of the model then reaches its mixers."""
    mixers = [m for name, m in model.named_modules()
              if name.rsplit(".", 1)[-1] == RECURRENT and isinstance(m, nn.Module) and known(m)]
    held = [m.__dict__["_dflash_tree"] for m in mixers if "_dflash_tree" in m.__dict__]
    holder = held[0] if held else [None]
    for m in mixers:
        if not type(m).__name__.startswith("TreeWise"):
            m.__class__ = _tree_wise(type(m))
        object.__setattr__(m, "_dflash_tree", holder)
    return holder, len(mixers)


def keep(cache: list, node: int):
    """Each recurrent cache takes the states ``node``'s path left in the latest tree pass."""
    for c in cache:
        if isinstance(c, ArraysCache):
            c.cache = list(c.__dict__.pop("_dflash_tree_states")[node])
