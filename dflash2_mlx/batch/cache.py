"""The caches of a batch of DFlash sequences and its one drafter pass (``cycle.py`` runs the cycle).

The target cache: one row index shared by all sequences, positions decoupled from it.
mlx-lm's BatchKVCache ties a sequence's position to its row index (position = row - left
padding), which only holds while every sequence advances by the same count each step.
Here sequence i keeps k_i of the b rows of a cycle, and the k_i differ; trimming every
row to min k_i and re-feeding the rest would carry a backlog that grows with the
difference in the sequences' acceptance, without bound.  So instead:
- every target layer's ``BatchCache`` holds keys/values [S, heads, rows, dim] and shares
  one ``Rows``: ``live`` [S, rows] (which rows hold a committed token of that sequence)
  and ``offset`` [S] (each sequence's next position, which RoPE reads, as with
  BatchKVCache);
- a verify pass writes b new rows for everyone; the mask is "live rows, then causal inside
  the block", so a rejected row of one sequence is a dead row (a hole) it never attends to
  again, while rows of others are untouched; rows dead for all at the end are trimmed;
- nothing is rolled or re-fed; holes cost attention columns like left padding does, and
  ``compact`` gathers each sequence's live rows together when holes pass a quarter of the
  rows (keys carry their RoPE rotation, so rows can move).
Recurrent layers (the linear attention of hybrid targets, qwen3_5 / qwen3_next) keep
their mlx-lm ``ArraysCache`` batched along its first axis.  Their state cannot be trimmed,
so when some sequence rejected part of its block the states are restored from a snapshot
taken before the verify pass and each sequence's kept tokens are run again in one
right-padded pass, the padding masked by the cache's ``lengths`` (the single-stream
rollback, batched).  Sliding-window layers (mlx-lm's ``RotatingKVCache``) are ``BatchCache``s
too, whose mask also drops the keys a window leaves behind (each live row's position is known
from ``Rows``): their rows are not dropped, so they cost the memory of full attention while the
sequence is in the batch; a sequence joining from a rotating cache brings the rows it holds
(the window), the older ones zeros no query's window reaches.  Quantized and chunked caches
are refused (``UnsupportedTargetError``).
Joining sequences are prefilled together the same way: right-padded chunks, ``lengths``
for the recurrent layers, holes for the attention rows.

The drafter: each sequence keeps its own ``DraftContext`` (the single-stream one, so its
context rows are exactly the single-stream ones) and one drafter pass runs over all blocks,
the contexts left-padded into one batch with a mask (``draft_hidden``); ``propose`` then
runs per sequence (its own temperature, its own random draws).  Several small blocks cost
less in one pass than in one pass each; one block alone costs the same either way.
"""

from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from ..loop.target import Target, UnsupportedTargetError
from ..model.drafter import Drafter

COMPACT_MIN_ROWS = 32  # holes are gathered away only when at least this many rows go


# --- the batched target cache --------------------------------------------------------------

class Rows:
    """Which cache rows each sequence owns, shared by every layer's ``BatchCache``."""

    def __init__(self):
        self.live = np.zeros((0, 0), dtype=bool)  # [S, rows]
        self.positions = np.zeros((0,), dtype=np.int64)  # [S] next position of each sequence
        self.offset = mx.zeros((0,), dtype=mx.int32)

    @property
    def size(self) -> int:
        return self.live.shape[1]

    def _set(self, live: np.ndarray, positions: np.ndarray):
        self.live, self.positions = live, positions
        self.offset = mx.array(positions.astype(np.int32))

    def mask(self, n: int, window: Optional[int] = None) -> mx.array:
        """[S, 1, n, rows + n]: each sequence's live rows, then causal inside the new rows;
        with a ``window``, only keys fewer than ``window`` positions back (mlx-lm's sliding
        window: query q reads key k when q - k < window)."""
        S = self.live.shape[0]
        causal = np.tril(np.ones((n, n), dtype=bool))
        if window is None:
            old = mx.broadcast_to(mx.array(self.live)[:, None, None, :], (S, 1, n, self.size))
            new = mx.broadcast_to(mx.array(causal), (S, 1, n, n))
            return mx.concatenate([old, new], axis=-1)
        # A live row's position: the sequence's next position less the live rows from it on.
        after = np.cumsum(self.live[:, ::-1], axis=1)[:, ::-1]
        keys = self.positions[:, None] - after  # [S, rows]
        queries = self.positions[:, None] + np.arange(n)[None, :]  # [S, n]
        old = self.live[:, None, :] & (queries[:, :, None] - keys[:, None, :] < window)
        steps = np.arange(n)[:, None] - np.arange(n)[None, :]
        new = np.broadcast_to(causal & (steps < window), (S, n, n))
        return mx.array(np.concatenate([old, new], axis=-1)[:, None])

    def commit(self, kept: Sequence[int]):
        """After a pass, sequence i keeps its first ``kept[i]`` new rows; the rest are
        holes, and rows that are holes for all at the end are dropped (the next pass
        writes over them)."""
        kept = np.asarray(kept)
        cols = np.arange(kept.max())[None, :] < kept[:, None]
        self._set(np.concatenate([self.live, cols], axis=1), self.positions + kept)


class BatchCache:
    """One target layer's keys and values for a batch whose rows a ``Rows`` describes, with
    the cache methods mlx-lm's attention layers and cache helpers call."""

    step = 256

    def __init__(self, rows: Rows):
        self.rows = rows
        self.keys = self.values = None

    @property
    def offset(self):
        return self.rows.offset

    def update_and_fetch(self, keys, values):
        """Write the pass's rows after the committed ones; ``Rows.commit`` decides later
        which of them stay, so every layer writes at the same place."""
        prev, n = self.rows.size, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            grow = ((prev + n + self.step - 1) // self.step) * self.step
            self.keys = _resize(self.keys, keys, prev, grow)
            self.values = _resize(self.values, values, prev, grow)
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        return self.keys[..., : prev + n, :], self.values[..., : prev + n, :]

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        return self.rows.mask(N, window_size)

    @property
    def state(self):
        return self.keys, self.values

    def is_trimmable(self):
        return False  # rows are owned per sequence: ``Rows.commit`` trims, not ``trim``

    def size(self):
        return self.rows.size

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def _resize(old: Optional[mx.array], like: mx.array, used: int, rows: int) -> mx.array:
    """``old``'s first ``used`` rows in an array of ``rows`` rows (batch and heads of ``like``)."""
    B, H, _, D = like.shape
    out = mx.zeros((B, H, rows, D), like.dtype)
    if old is not None and used:
        out[..., :used, :] = old[..., :used, :]
    return out


class TargetBatch:
    """The target's caches for a batch of sequences: join, leave, compact, extract, and
    the recurrent layers' snapshot and replay."""

    def __init__(self, kinds: Sequence[int]):
        """``kinds``: per target layer, 0 for attention, a negative -w for a sliding window of
        w, a positive n for a recurrent state of n arrays (an mlx-lm ``ArraysCache`` batched
        along its first axis)."""
        self.rows = Rows()
        self.layers = [ArraysCache(n) if n > 0 else BatchCache(self.rows) for n in kinds]
        self.windows = [-n if n < 0 else None for n in kinds]

    def __len__(self):
        return self.rows.live.shape[0]

    @property
    def kinds(self) -> List[int]:
        return [len(c.cache) if isinstance(c, ArraysCache) else -(w or 0)
                for c, w in zip(self.layers, self.windows)]

    @property
    def recurrent(self) -> List[ArraysCache]:
        return [c for c in self.layers if isinstance(c, ArraysCache)]

    def add(self, cache: Optional[list] = None):
        """Append a sequence with nothing cached yet, or with a single-stream ``cache``
        (a reused prefix)."""
        one = TargetBatch(self.kinds)
        n = 0
        if cache is not None:
            n = next((c.offset for c in cache if isinstance(c, (KVCache, RotatingKVCache))), 0)
            for layer, c in zip(one.layers, cache):
                if isinstance(layer, ArraysCache):
                    layer.cache = list(c.cache)
                elif isinstance(c, RotatingKVCache) and n:
                    layer.keys, layer.values = window_rows(c, n)
                elif n:
                    layer.keys, layer.values = c.keys[..., :n, :], c.values[..., :n, :]
        one.rows._set(np.ones((1, n), dtype=bool), np.array([n]))
        self.extend(one)

    def extend(self, other: "TargetBatch"):
        """Append ``other``'s sequences; both sides' rows end at the same row (the shorter
        side gets dead rows on the left)."""
        size, na, nb = max(self.rows.size, other.rows.size), len(self), len(other)
        for mine, theirs in zip(self.layers, other.layers):
            if isinstance(mine, ArraysCache):
                mine.cache = [_stack_states(x, na, y, nb) for x, y in zip(mine.cache, theirs.cache)]
                continue
            for name in ("keys", "values"):
                stacked = _stack(getattr(mine, name), na, self.rows.size,
                                 getattr(theirs, name), nb, other.rows.size, size)
                setattr(mine, name, stacked)
        live = np.zeros((na + nb, size), dtype=bool)
        live[:na, size - self.rows.size :] = self.rows.live
        live[na:, size - other.rows.size :] = other.rows.live
        self.rows._set(live, np.concatenate([self.rows.positions, other.rows.positions]))

    def keep(self, indices: List[int]):
        """Keep only the sequences at ``indices`` (in that order)."""
        if not indices:
            self.__init__(self.kinds)
            return
        idx = mx.array(indices)
        for layer in self.layers:
            if isinstance(layer, ArraysCache):
                layer.cache = [None if x is None else x[idx] for x in layer.cache]
            else:
                layer.keys, layer.values = layer.keys[idx], layer.values[idx]
        self.rows._set(self.rows.live[indices], self.rows.positions[indices])
        self.compact()

    def compact(self, force: bool = False):
        """Gather each sequence's live rows to the end of the batch's rows when the holes
        and the padding every sequence shares are worth a copy of the cache."""
        live = self.rows.live
        counts = live.sum(axis=1)
        width = int(counts.max()) if counts.size else 0
        waste = self.rows.size - width
        if not force and (waste < COMPACT_MIN_ROWS or 4 * waste < self.rows.size):
            return
        order = np.zeros((len(self), width), dtype=np.int32)
        for i, cols in enumerate(live):
            where = np.nonzero(cols)[0]
            order[i, width - where.size :] = where
        index = mx.array(order)[:, None, :, None]
        for layer in self.layers:
            if isinstance(layer, BatchCache):
                layer.keys = _gather_rows(layer.keys, index)
                layer.values = _gather_rows(layer.values, index)
        new_live = np.arange(width)[None, :] >= (width - counts)[:, None]
        self.rows._set(new_live, self.rows.positions)

    def extract(self, i: int) -> list:
        """Sequence i's caches as a single stream's (its committed tokens in order)."""
        cols = mx.array(np.nonzero(self.rows.live[i])[0].astype(np.int32))
        out = []
        for layer, window in zip(self.layers, self.windows):
            if isinstance(layer, ArraysCache):
                c = ArraysCache(len(layer.cache))
                c.cache = [None if x is None else x[i : i + 1] for x in layer.cache]
            elif window is not None:
                # The rows a window still reads, in order, as mlx-lm's rotating cache holds
                # them after it has written them one at a time.
                c, n = RotatingKVCache(max_size=window, keep=0), int(cols.size)
                last = cols[max(0, n - window):]
                keys = mx.contiguous(mx.take(layer.keys[i : i + 1], last, axis=2))
                values = mx.contiguous(mx.take(layer.values[i : i + 1], last, axis=2))
                c.state = (keys, values, n, 0, window, int(last.size))
            else:
                c = KVCache()
                c.keys = mx.contiguous(mx.take(layer.keys[i : i + 1], cols, axis=2))
                c.values = mx.contiguous(mx.take(layer.values[i : i + 1], cols, axis=2))
                c.offset = int(cols.size)
            out.append(c)
        return out

    def forward(self, target: Target, ids: mx.array, lengths: Optional[Sequence[int]] = None):
        """A target pass over ``ids`` [S, L] (logits, features); ``lengths``: each row's
        real tokens (the rest is right padding, which recurrent layers must not absorb;
        attention layers' rows are sorted out by ``Rows.commit``)."""
        for c in self.recurrent:
            c.lengths = None if lengths is None else mx.array(lengths)
        try:
            return target(ids, self.layers)
        finally:
            for c in self.recurrent:
                c.lengths = None

    def snapshot(self) -> Optional[list]:
        """The recurrent states, before a pass that may have to be undone (None: none)."""
        states = [list(c.cache) for c in self.recurrent]
        return states or None

    def replay(self, target: Target, saved: list, ids: mx.array, kept: Sequence[int]):
        """Undo a verify pass over ``ids`` and run each sequence's first ``kept[i]`` tokens
        again: recurrent states cannot be trimmed (as ``target.rollback`` does for one
        sequence).  The verify pass's attention rows were not committed: overwritten."""
        for c, states in zip(self.recurrent, saved):
            c.cache = list(states)
        self.forward(target, ids[:, : max(kept)], kept)


def _stack(a: Optional[mx.array], na: int, used_a: int, b: Optional[mx.array], nb: int,
           used_b: int, size: int) -> Optional[mx.array]:
    """Rows of ``na`` sequences (first ``used_a`` valid; None: none yet) over those of ``nb``,
    both right-aligned at ``size`` rows."""
    like = a if a is not None else b
    if like is None:
        return None
    parts = []
    for x, n, used in ((a, na, used_a), (b, nb, used_b)):
        if not n:
            continue
        if x is None:
            x = mx.zeros((n, like.shape[1], 0, like.shape[3]), like.dtype)
        parts.append(_left_pad(x[..., :used, :].astype(like.dtype), size))
    return mx.concatenate(parts, axis=0)


def _stack_states(a: Optional[mx.array], na: int, b: Optional[mx.array], nb: int):
    """One recurrent state array of ``na`` sequences over ``nb`` (None: zeros, the state
    before any token, as the model starts from)."""
    like = a if a is not None else b
    if like is None:
        return None
    parts = [x if x is not None else mx.zeros((n,) + like.shape[1:], like.dtype)
             for x, n in ((a, na), (b, nb)) if n]
    return mx.concatenate(parts, axis=0)


def _gather_rows(x: mx.array, index: mx.array) -> mx.array:
    shape = (x.shape[0], x.shape[1], index.shape[2], x.shape[3])
    return mx.take_along_axis(x, mx.broadcast_to(index, shape), axis=2)


def _left_pad(x: mx.array, width: int) -> mx.array:
    return mx.pad(x, [(0, 0), (0, 0), (width - x.shape[2], 0), (0, 0)])


def window_rows(c: RotatingKVCache, n: int):
    """A rotating cache's keys and values as ``n`` rows in position order: the rows it holds
    last, zeros before them (older than its window: no later query reads them)."""
    k, v = c.keys, c.values
    if c.offset <= k.shape[2]:
        k, v = k[..., : c.offset, :], v[..., : c.offset, :]
    elif c._idx < k.shape[2]:  # wrapped around (keep 0): the oldest rows start at _idx
        k = mx.concatenate([k[..., c._idx :, :], k[..., : c._idx, :]], axis=2)
        v = mx.concatenate([v[..., c._idx :, :], v[..., : c._idx, :]], axis=2)
    return _left_pad(k, n), _left_pad(v, n)


def batch_layers(target: Target) -> List[int]:
    """What ``TargetBatch`` needs to know of the target's layers (its ``kinds``); refuses
    the caches it cannot batch (quantized or chunked attention caches)."""
    kinds = []
    for c in target.make_cache():
        if type(c) is KVCache:
            kinds.append(0)
        elif type(c) is RotatingKVCache and c.keep == 0:
            kinds.append(-c.max_size)
        elif type(c) is ArraysCache:
            kinds.append(len(c.cache))
        else:
            raise UnsupportedTargetError(
                f"batched DFlash supports targets whose layers use attention caches "
                f"(KVCache, RotatingKVCache) or recurrent states (ArraysCache); this "
                f"{target.model_type or 'target'} has a {type(c).__name__}: serve it one "
                "sequence at a time")
    return kinds


# --- the batched drafter pass --------------------------------------------------------------

def _context_rows(layer, c: KVCache):
    """The context keys/values a drafter layer reads, as ``Drafter.__call__`` chooses them."""
    k, v = c.keys_and_values()
    if layer.sliding and c.offset >= layer.window:
        k, v = k[..., -(layer.window - 1):, :], v[..., -(layer.window - 1):, :]
    return k, v


def draft_hidden(drafter: Drafter, blocks: mx.array, caches: List[list]) -> mx.array:
    """Final-normed drafter states [S, B, H] of blocks [S, B], sequence i's anchor right
    after its own context ``caches[i]`` (never empty: a sequence joins with its prompt's):
    one pass, the contexts left-padded, the padding masked out."""
    S, B = blocks.shape
    h = drafter.embed(blocks)
    offset = mx.array([c[0].offset for c in caches], dtype=mx.int32)
    for l, layer in enumerate(drafter.layers):
        rows = [_context_rows(layer, c[l]) for c in caches]
        lengths = np.array([k.shape[2] for k, _ in rows])
        width = int(lengths.max())
        keys = mx.concatenate([_left_pad(k, width) for k, _ in rows], axis=0)
        values = mx.concatenate([_left_pad(v, width) for _, v in rows], axis=0)
        seen = np.arange(width)[None, :] >= (width - lengths)[:, None]
        block = mx.ones((B, B), dtype=mx.bool_)
        if layer.causal:
            block = mx.tril(block)
        mask = mx.concatenate([mx.broadcast_to(mx.array(seen)[:, None, None, :], (S, 1, B, width)),
                               mx.broadcast_to(block, (S, 1, B, B))], axis=-1)
        h = layer(h, keys, values, offset, mask)
    return drafter.norm(h)
