"""One target pass over a draft tree, and the caches compacted to the accepted path.

A node attends to the cache and to its own ancestors only, at position anchor + depth, so
its row is the one the chain [anchor .. node] would compute.  Both go through mlx-lm's own
interfaces, on the model instance: the mask through the cache's ``make_mask`` (each cache
of the pass takes a subclass that returns the tree's mask, for the pass only), the positions
through each attention's ``rope`` module (wrapped once: outside a tree pass it is the
model's own call; inside, every row rotated at its node's position).  ``TreePass``, the
tree verifier, owns both; ``loop/verifiers.py`` says where it may run.

After the pass the caches hold every node; ``compact`` moves the accepted path's entries to
consecutive positions and trims the rest: a key at depth d was rotated at anchor + d, where
the path puts it.  Trees need trimmable caches (full attention, quantized or not, and
sliding-window layers while the pass stays inside the window) and recurrent layers whose
mixer ``recurrent.py`` reads (hybrid targets: each node's state kept, the accepted one's
put in the cache).
"""

from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from . import recurrent
from .grow import Tree

_masking_classes = {}


def _masking(cls):
    if cls not in _masking_classes:

        def make_mask(self, N, *args, **kwargs):
            mask = object.__getattribute__(self, "_dflash_tree_mask")
            if mask.shape[0] != N:
                raise ValueError(f"a tree pass of {mask.shape[0]} rows asked a mask for {N}")
            return mask

        _masking_classes[cls] = type(f"TreeMasked{cls.__name__}", (cls,), {"make_mask": make_mask})
    return _masking_classes[cls]


class TreeRope(nn.Module):
    """An attention's rope: the model's own, or per-row positions during a tree pass."""

    def __init__(self, inner: nn.Module, depths: list):
        super().__init__()
        self.inner = inner
        self._depths = depths  # [None] outside a tree pass, else [mx.array of node depths]

    def __call__(self, x, offset=0, *args, **kwargs):
        depths = self._depths[0]
        if depths is None or x.shape[-2] != depths.size:
            return self.inner(x, offset, *args, **kwargs)
        if isinstance(self.inner, nn.RoPE) and not args and not kwargs:
            # The rows as a batch, each with its own offset: one call.
            rows = x.swapaxes(0, 2)
            return self.inner(rows, offset=offset + depths).swapaxes(0, 2)
        # Any other rope: the rows of one depth together, at that depth's position.
        out = [None] * depths.size
        d_np = np.array(depths)
        for d in np.unique(d_np):
            idx = np.nonzero(d_np == d)[0]
            rows = x[..., mx.array(idx), :].swapaxes(0, 2)
            r = self.inner(rows, int(offset + int(d)), *args, **kwargs).swapaxes(0, 2)
            for j, i in enumerate(idx):
                out[i] = r[..., j : j + 1, :]
        return mx.concatenate(out, axis=-2)


class TreePass:
    """The tree verifier of one target: one pass over a tree's nodes.  It owns what it changes
    on the model: the attention ropes' wrapper and the recurrent mixers' subclass, installed
    at the first pass that needs them (once per model: a later verifier of the same model
    reads the holders already there), and each attention cache's mask class, swapped for one
    pass and swapped back after it."""
    name = "tree"

    def __init__(self, target):
        self.target = target
        self.depths = None  # the ropes' holder: [None] outside a pass, [node depths] inside
        self.recurrent = None  # (the recurrent mixers' holder of the pass's tree, how many took it)

    def fits(self, cache: list, rows: int) -> Optional[str]:
        """None if a tree pass of ``rows`` can run on ``cache``, else why not."""
        layers = 0  # recurrent
        for c in cache:
            if isinstance(c, RotatingKVCache):
                if c.offset + rows >= c.max_size:
                    return "the tree would reach a sliding window"
            elif isinstance(c, ArraysCache):
                layers += 1
            elif not c.is_trimmable():
                return "recurrent layers cannot take a tree"
        if layers and self.recurrent is None:
            self.recurrent = recurrent.install(self.target.model)
        if layers and self.recurrent[1] != layers:
            return "recurrent layers without a mixer a tree pass reads"
        if not self._ropes():
            return "the target has no rope to place tree nodes"
        return None

    def _ropes(self) -> bool:
        """Wrap the target's attention ropes (once per model); False where it has none."""
        if self.depths is None:
            ropes = [(m, m["rope"]) for _, m in self.target.model.named_modules()
                     if isinstance(m.get("rope"), nn.Module)]
            wrapped = [r for _, r in ropes if isinstance(r, TreeRope)]
            depths = wrapped[0]._depths if wrapped else [None]
            for module, rope in ropes:
                if not isinstance(rope, TreeRope):
                    module.rope = TreeRope(rope, depths)
            self.depths = depths if ropes else None
        return self.depths is not None

    def __call__(self, tree: Tree, cache: list):
        """Logits [1, n, V] and features [1, n, F] of the tree's nodes, each row as if its
        path alone had been read (``fits`` said yes for these caches)."""
        attention = [c for c in cache if not isinstance(c, ArraysCache)]
        offset = attention[0].offset
        n = tree.tokens.size
        visible = np.concatenate([np.ones((n, offset), dtype=bool), tree.ancestors()], axis=1)
        mask = mx.array(visible)
        classes = []
        for c in attention:
            classes.append(type(c))
            c.__class__ = _masking(type(c))
            object.__setattr__(c, "_dflash_tree_mask", mask)
        self.depths[0] = mx.array(tree.depths.astype(np.int32))
        holder = self.recurrent[0] if self.recurrent else [None]
        holder[0] = tree
        try:
            return self.target(mx.array(tree.tokens[None].astype(np.int32)), cache)
        finally:
            self.depths[0] = holder[0] = None
            for c, cls in zip(attention, classes):
                c.__class__ = cls
                object.__delattr__(c, "_dflash_tree_mask")


def compact(cache: list, rows: int, path: List[int]):
    """Keep the entries of the nodes ``path`` (the anchor first) of the latest tree pass over
    ``rows`` nodes, at consecutive positions; drop the rest."""
    n = len(path)
    recurrent.keep(cache, path[-1])
    cache = [c for c in cache if not isinstance(c, ArraysCache)]
    if path == list(range(n)):  # already in place: a prefix of the pass
        for c in cache:
            c.trim(rows - n)
        return
    # The kept rows are gathered and evaluated first: written back from an expression of the
    # cache itself, MLX could not update the cache in place and would copy all of it.
    idx = mx.array(np.array(path, dtype=np.int32))
    moves = []
    for c in cache:
        end = c._idx if isinstance(c, RotatingKVCache) else c.offset
        arrays = [a for group in (c.keys, c.values) for a in (group if isinstance(group, (tuple, list)) else [group])]
        moves.append((c, end - rows, arrays, [mx.take(a[..., end - rows : end, :], idx, axis=2) for a in arrays]))
    mx.eval([k for *_, kept in moves for k in kept])
    for c, start, arrays, kept in moves:
        for a, k in zip(arrays, kept):
            a[..., start : start + n, :] = k
        c.trim(rows - n)
