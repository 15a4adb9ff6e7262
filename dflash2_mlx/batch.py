"""Batched DFlash: several sequences drafted together and verified in one target pass.

Each cycle picks one block size b for the batch (fixed, or the adaptive policy fed with
every sequence's acceptance), drafts every sequence's block [anchor, MASK...], verifies all
blocks in ONE target pass over [S, b] rows, and lets each sequence keep its own accepted
prefix plus the target's bonus token, with its own sampling parameters, logits processors,
random stream, max_tokens and stop tokens.  Sequences join between cycles (prefilled
together, see below) and leave (finished or aborted).

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
rollback, batched).  Sliding-window and other caches are refused (``UnsupportedTargetError``).
Joining sequences are prefilled together the same way: right-padded chunks, ``lengths``
for the recurrent layers, holes for the attention rows.

The drafter: each sequence keeps its own ``DraftContext`` (the single-stream one, so its
context rows are exactly the single-stream ones) and one drafter pass runs over all blocks,
the contexts left-padded into one batch with a mask (``draft_hidden``); ``propose`` then
runs per sequence (its own temperature, its own random draws).  On this 2-core CPU (busy)
with the shipped SmolLM2 drafter, 8 blocks of 4 cost 18 ms in one pass against 51 ms in
eight; one block alone costs the same either way.

Random draws: each sampled sequence owns a PRNG key, swapped in around its draws, so it
draws exactly what a single stream seeded the same way draws, whatever else is in the
batch; a sequence without a seed gets a key drawn from the global generator.

Lossless per sequence: every emitted token is the target's choice in the pass that verified
it (greedy) or passed rejection sampling against the target's own distribution (sampled),
exactly as in ``speculative.py``; the batch only changes which rows share a matmul.
"""

import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, _BaseCache

from . import adaptive
from .adaptive import _interp
from .draft_context import DraftContext
from .drafter import Drafter, propose
from .sampling import SamplingParams, probs, processed_logprobs, sample
from .speculative import CycleStats
from .target import Target, UnsupportedTargetError, attach

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

    def mask(self, n: int) -> mx.array:
        """[S, 1, n, rows + n]: each sequence's live rows, then causal inside the new rows."""
        S = self.live.shape[0]
        old = mx.broadcast_to(mx.array(self.live)[:, None, None, :], (S, 1, n, self.size))
        new = mx.broadcast_to(mx.tril(mx.ones((n, n), dtype=mx.bool_)), (S, 1, n, n))
        return mx.concatenate([old, new], axis=-1)

    def commit(self, kept: Sequence[int]):
        """After a pass, sequence i keeps its first ``kept[i]`` new rows; the rest are
        holes, and rows that are holes for all at the end are dropped (the next pass
        writes over them)."""
        kept = np.asarray(kept)
        cols = np.arange(kept.max())[None, :] < kept[:, None]
        self._set(np.concatenate([self.live, cols], axis=1), self.positions + kept)


class BatchCache(_BaseCache):
    """One target layer's keys and values for a batch whose rows a ``Rows`` describes."""

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
        if window_size is not None:
            raise UnsupportedTargetError("batched DFlash does not support sliding-window layers")
        return self.rows.mask(N)

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

    def __init__(self, recurrent: Sequence[int]):
        """``recurrent``: per target layer, 0 for attention, else its recurrent state's
        number of arrays (an mlx-lm ``ArraysCache`` batched along its first axis)."""
        self.rows = Rows()
        self.layers = [ArraysCache(n) if n else BatchCache(self.rows) for n in recurrent]

    def __len__(self):
        return self.rows.live.shape[0]

    @property
    def kinds(self) -> List[int]:
        return [len(c.cache) if isinstance(c, ArraysCache) else 0 for c in self.layers]

    @property
    def recurrent(self) -> List[ArraysCache]:
        return [c for c in self.layers if isinstance(c, ArraysCache)]

    def add(self, cache: Optional[list] = None):
        """Append a sequence with nothing cached yet, or with a single-stream ``cache``
        (a reused prefix)."""
        one = TargetBatch(self.kinds)
        n = 0
        if cache is not None:
            n = next((c.offset for c in cache if isinstance(c, KVCache)), 0)
            for layer, c in zip(one.layers, cache):
                if isinstance(layer, ArraysCache):
                    layer.cache = list(c.cache)
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
        for layer in self.layers:
            if isinstance(layer, ArraysCache):
                c = ArraysCache(len(layer.cache))
                c.cache = [None if x is None else x[i : i + 1] for x in layer.cache]
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


def batch_layers(target: Target) -> List[int]:
    """What ``TargetBatch`` needs to know of the target's layers; refuses the caches it
    cannot batch (sliding windows, quantized or chunked attention caches)."""
    kinds = []
    for c in target.make_cache():
        if type(c) is KVCache:
            kinds.append(0)
        elif type(c) is ArraysCache:
            kinds.append(len(c.cache))
        else:
            raise UnsupportedTargetError(
                f"batched DFlash supports targets whose layers use plain attention caches "
                f"(KVCache) or recurrent states (ArraysCache); this "
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


# --- the batched cycle ------------------------------------------------------------------------

def _swap_key(key: int) -> int:
    """Make ``key`` (64 bits) the global PRNG key; return the key it replaces.

    ``mx.random.seed(s)`` sets the key to [s >> 32, s & 0xffffffff], so any key can be
    put back; ``propose`` and the accept rules draw from the global key."""
    hi, lo = mx.random.state[0].tolist()
    mx.random.seed(key)
    return (hi << 32) | lo


def _fresh_key() -> int:
    """A key for a sequence without a seed, drawn from the global generator (62 bits)."""
    hi, lo = mx.random.randint(0, (1 << 31) - 1, shape=(2,)).tolist()
    return (hi << 32) | lo


@dataclass
class Response:
    """One emitted token of one sequence; the last one has ``finish_reason`` set
    ("stop": a stop token, emitted here too; "length": max_tokens)."""
    uid: int
    token: int
    logprobs: mx.array
    from_draft: bool
    finish_reason: Optional[str]
    stats: CycleStats
    cache: Optional[list] = None  # with return_caches: the finished sequence's target cache
    context: Optional[DraftContext] = None  # ... and its draft context


@dataclass
class _Sequence:
    uid: int
    prompt: mx.array
    params: SamplingParams
    processors: Optional[List[Callable]]
    max_tokens: float
    stop_tokens: frozenset
    key: Optional[int]  # its PRNG key (sampled sequences only)
    prompt_cache: Optional[list]  # a reused prefix's target cache, until it joins
    context: Optional[DraftContext]
    cached_tokens: int
    history: Optional[mx.array] = None  # committed tokens: the logits processors' input
    anchor: int = 0
    emitted: int = 0
    stats: Optional[CycleStats] = None
    finish: Optional[str] = None
    last: Optional[Response] = None  # its latest response


def accept_lazy(logprobs: mx.array, draft: Optional[mx.array], q: Optional[mx.array],
                params: SamplingParams):
    """One sequence's accept rule as lazy arrays (ok [n], candidates [n + 1]), so a batch
    is evaluated at once; ``pick`` reads them.  The same rule and the same draws as
    ``accept_greedy`` / ``accept_sampled`` (a uniform per draft, then one categorical over
    the vocabulary, i.e. argmax of the row plus one gumbel draw); ``draft`` None is a plain
    step, drawn as ``sample`` draws it."""
    if draft is None:
        return mx.zeros((0,), dtype=mx.bool_), sample(logprobs, params)
    n = draft.shape[0]
    if params.greedy:
        target_tokens = mx.argmax(logprobs, axis=-1)
        return draft == target_tokens[:n], target_tokens
    p = probs(logprobs, params)
    idx = draft[:, None]
    p_d = mx.take_along_axis(p[:n], idx, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    ok = mx.random.uniform(shape=(n,)) * q_d < p_d
    noise = mx.random.gumbel(shape=(p.shape[-1],))
    # Row i < n: the residual max(p - q, 0) after a rejection at i; row n: the bonus row p.
    candidates = mx.concatenate([mx.log(mx.maximum(p[:n] - q, 0)), mx.log(p[n:])])
    return ok, mx.argmax(candidates + noise, axis=-1)


def pick(ok: List[bool], candidates: List[int]):
    """Accepted drafts (up to the first rejection) and the token drawn after them."""
    accepted = next((i for i, m in enumerate(ok) if not m), len(ok))
    return accepted, candidates[accepted]


def prefill_groups(lengths: List[int], slack: float = 1.25) -> List[List[int]]:
    """Which joiners are prefilled together (indices): by length, a group grows while its
    padded rows stay within ``slack`` times its real ones (a padding row is wasted work; on
    a CPU long prompts gain little from sharing a pass, short ones a lot)."""
    groups, group = [], []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        rows = sum(lengths[j] for j in group) + lengths[i]
        if group and lengths[i] * (len(group) + 1) > slack * rows:
            groups.append(group)
            group = []
        group.append(i)
    return groups + [group] if group else groups


class BatchCosts:
    """The pair's single-stream cost model (``adaptive.CostModel``) as a batch of
    ``streams`` sequences sees it, for the adaptive policy: a cycle with block b verifies
    S * b rows and drafts S blocks, so its base cost is the model's at S * b rows (the lines
    extended past the largest calibrated block along their last slope), and each sequence's
    own context adds its attention cost.  One sequence: the model itself."""

    def __init__(self, costs):
        self.costs, self.streams = costs, 1

    def cycle(self, b: int, context: int) -> float:
        seconds = self._part(self.costs.target, b, context)
        if b > 1:
            seconds += self._part(self.costs.drafter, b, context)
        return seconds

    def _part(self, points: dict, b: int, context: int) -> float:
        S = self.streams
        return _rows_base(points, S * b) + S * _interp(points, b)[1] * context


def _rows_base(points: dict, rows: int) -> float:
    keys = sorted(points)
    if rows <= keys[-1] or len(keys) < 2:
        return _interp(points, rows)[0]
    lo, hi = keys[-2], keys[-1]
    per_row = max(0.0, (points[hi][0] - points[lo][0]) / (hi - lo))
    return points[hi][0] + per_row * (rows - hi)


class BatchGenerator:
    """Continuous batching of DFlash sequences: ``insert`` between calls, ``next`` runs
    the joiners' prefills and one batched draft -> verify -> accept cycle and returns the
    tokens it produced; ``remove`` aborts a sequence.  Not thread-safe: one MLX thread.

    ``block_size``: a number (every cycle), "auto" (the adaptive policy, fed with every
    sequence's acceptance, its costs those of the whole batch: ``BatchCosts``), or a policy
    object (one whose ``costs`` are ``BatchCosts`` is told the batch's size each cycle).
    ``batch_drafter``: one drafter pass for all blocks (else one per sequence).
    ``max_batch``: sequences that run together; more wait for a place."""

    def __init__(self, model, drafter: Drafter, *, block_size=adaptive.AUTO,
                 draft_window: Optional[int] = None, prefill_step_size: int = 2048,
                 batch_drafter: bool = True, return_caches: bool = False,
                 max_batch: Optional[int] = None):
        self.target = attach(model, drafter)
        self.drafter = drafter
        self.batch = TargetBatch(batch_layers(self.target))
        if hasattr(block_size, "record"):
            self.policy = block_size
        else:
            from .generate import check_block_size

            block_size = check_block_size(drafter, block_size)
            costs = None
            if block_size == adaptive.AUTO:
                costs = BatchCosts(adaptive.cost_model(self.target, drafter))
            self.policy = adaptive.policy(self.target, drafter, block_size, costs=costs)
        self.draft_window = draft_window
        self.prefill_step_size = prefill_step_size
        self.batch_drafter = batch_drafter
        self.return_caches = return_caches
        self.max_batch = max_batch or float("inf")
        self.waiting: List[_Sequence] = []
        self.active: List[_Sequence] = []  # in the batch's row order
        self._next_uid = 0

    def __len__(self):
        return len(self.waiting) + len(self.active)

    def insert(self, prompt, *, max_tokens: int = 256, params: SamplingParams = SamplingParams(),
               logits_processors: Optional[List[Callable]] = None, stop_tokens=(),
               seed: Optional[int] = None, prompt_cache: Optional[list] = None,
               draft_context: Optional[DraftContext] = None, cached_tokens: int = 0) -> int:
        """Queue a sequence (token ids); it joins at the next ``next``.  ``seed``: its own
        random stream, as ``mx.random.seed(seed)`` before a single stream.  A reused prefix:
        the first ``cached_tokens`` are already in ``prompt_cache`` and ``draft_context``."""
        prompt = mx.array(prompt, dtype=mx.uint32) if not isinstance(prompt, mx.array) else prompt
        if prompt.size == 0:
            raise ValueError("prompt is empty: give at least one token")
        if max_tokens == 0 or max_tokens < -1:
            raise ValueError(f"max_tokens must be positive (or -1 for no limit), got {max_tokens}")
        if not 0 <= cached_tokens < prompt.size:
            raise ValueError(f"cached_tokens must leave at least the last prompt token to run, "
                             f"got {cached_tokens} of {prompt.size}")
        key = None
        if not params.greedy:
            key = seed if seed is not None else _fresh_key()
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        self.waiting.append(_Sequence(
            uid, prompt, params, logits_processors, max_tokens if max_tokens > 0 else float("inf"),
            frozenset(stop_tokens), key, prompt_cache, draft_context, cached_tokens))
        return uid

    def remove(self, uid: int) -> bool:
        """Abort a sequence (waiting or running); False when there is none with ``uid``."""
        for i, s in enumerate(self.waiting):
            if s.uid == uid:
                del self.waiting[i]
                return True
        for i, s in enumerate(self.active):
            if s.uid == uid:
                self._keep([j for j in range(len(self.active)) if j != i])
                return True
        return False

    def extract_cache(self, uid: int):
        """A running sequence's (target cache, draft context) as a single stream's, e.g.
        for a prefix cache before ``remove``; the target cache holds every committed token
        but the newest (the next anchor)."""
        i = next(i for i, s in enumerate(self.active) if s.uid == uid)
        return self.batch.extract(i), self.active[i].context

    def next(self) -> List[Response]:
        """Admit waiting sequences (their first tokens), then one cycle for all."""
        out = self._admit()
        self._leave()
        out += self._cycle()
        self._leave()
        return out

    def close(self):
        """Keep the batch's acceptance as the pair's history (adaptive block sizes)."""
        adaptive.remember(self.policy)

    # -- joining ------------------------------------------------------------------------
    def _admit(self) -> List[Response]:
        """Prefill the waiting sequences (as many as there are places) and sample each
        one's first token; they join the batch.  Prompts of similar lengths are prefilled
        together (``prefill_groups``)."""
        places = int(min(len(self.waiting), self.max_batch - len(self.active)))
        joiners, self.waiting = self.waiting[:places], self.waiting[places:]
        out = []
        for group in prefill_groups([s.prompt.size - s.cached_tokens for s in joiners]):
            seqs = [joiners[i] for i in group]
            batch, last = self._prefill(seqs)
            for s, logits in zip(seqs, last):
                logprobs = processed_logprobs(logits, s.prompt[:-1], s.prompt[-1:], s.processors)
                with _KeyScope(s):
                    s.anchor = int(sample(logprobs, s.params)[0].item())
                out += self._emit(s, [s.anchor], logprobs, 0)
            self.batch.extend(batch)
            self.active += seqs
        return out

    def _prefill(self, seqs: List[_Sequence]):
        """One target pass per chunk of the sequences' uncached prompt tokens, right-padded
        (a padding row comes after a sequence's real rows, so they never see it; it is a
        hole once the pass is committed).  Their caches, and each one's last logits."""
        batch = TargetBatch(self.batch.kinds)
        for s in seqs:
            batch.add(s.prompt_cache)
            s.prompt_cache = None
            s.context = s.context or DraftContext(self.drafter, self.draft_window)
            s.stats = CycleStats(self.policy.largest)
            s.history = s.prompt
        rest = [s.prompt[s.cached_tokens:].tolist() for s in seqs]
        last = [None] * len(seqs)
        width = max(1, self.prefill_step_size // len(seqs))  # rows per pass, all sequences
        for start in range(0, max(len(r) for r in rest), width):
            chunks = [r[start : start + width] for r in rest]
            w = max(len(c) for c in chunks)
            ids = mx.array([c + [0] * (w - len(c)) for c in chunks], dtype=mx.uint32)
            kept = [len(c) for c in chunks]
            logits, features = batch.forward(self.target, ids, None if min(kept) == w else kept)
            batch.rows.commit(kept)
            for i, s in enumerate(seqs):
                if kept[i]:
                    s.context.add(features[i : i + 1, : kept[i]])
                if kept[i] and start + kept[i] == len(rest[i]):
                    last[i] = logits[i, kept[i] - 1 : kept[i]]
            mx.eval(last, [c.state for c in batch.layers])
        return batch, last

    def _leave(self):
        """Finished sequences leave the batch (with return_caches their caches go with
        their last response)."""
        if not any(s.finish for s in self.active):
            return
        if self.return_caches:
            for i, s in enumerate(self.active):
                if s.finish:
                    s.last.cache, s.last.context = self.batch.extract(i), s.context
        self._keep([i for i, s in enumerate(self.active) if not s.finish])

    # -- one cycle ---------------------------------------------------------------------
    def _cycle(self) -> List[Response]:
        seqs = self.active
        if not seqs:
            return []
        costs = getattr(self.policy, "costs", None)
        if isinstance(costs, BatchCosts):
            costs.streams = len(seqs)
        b = self.policy.block_size(max(s.history.size for s in seqs))
        anchors = mx.array([s.anchor for s in seqs], dtype=mx.int32)[:, None]
        drafts, qs = [], []
        if b > 1:
            mask = self.drafter.config.mask_token_id
            blocks = mx.array([[s.anchor] + [mask] * (b - 1) for s in seqs])
            hidden = self._draft(blocks)
            for i, s in enumerate(seqs):
                with _KeyScope(s):
                    draft, q = propose(self.drafter, hidden[i : i + 1], mx.array(s.anchor),
                                       s.params)
                drafts.append(draft.astype(mx.int32))
                qs.append(q)
            verify = mx.concatenate([anchors, mx.stack(drafts)], axis=1)
        else:
            verify = anchors
        # Verify: one target pass over every sequence's block.
        saved = self.batch.snapshot()
        logits, features = self.batch.forward(self.target, verify)
        rows, lazy = [], []
        for i, s in enumerate(seqs):
            rows.append(processed_logprobs(logits[i], s.history, verify[i], s.processors))
            with _KeyScope(s):
                lazy.append(accept_lazy(rows[i], drafts[i] if drafts else None,
                                        qs[i] if drafts else None, s.params))
        # Accept: one evaluation for the whole batch, then each sequence's prefix on the host.
        mx.eval(lazy, verify)
        accepted, bonus = zip(*(pick(ok.tolist(), cand.tolist()) for ok, cand in lazy))
        kept = [a + 1 for a in accepted]
        if saved is not None and min(kept) < b:
            self.batch.replay(self.target, saved, verify, kept)
        self.batch.rows.commit(kept)
        self.batch.compact()
        self._record(b, accepted)
        out = []
        for i, (s, ids) in enumerate(zip(seqs, verify.tolist())):
            s.context.add(features[i : i + 1, : kept[i]])
            s.history = mx.concatenate([s.history, verify[i, : kept[i]].astype(s.history.dtype)])
            s.stats.record(b, accepted[i], self.policy.fallback)
            out += self._emit(s, ids[1 : kept[i]] + [bonus[i]], rows[i], accepted[i])
            s.anchor = bonus[i]
        return out

    def _draft(self, blocks: mx.array) -> mx.array:
        contexts = [s.context.fed() for s in self.active]
        if self.batch_drafter:
            return draft_hidden(self.drafter, blocks, contexts)
        return mx.concatenate([self.drafter(blocks[i : i + 1], c) for i, c in enumerate(contexts)])

    def _record(self, b: int, accepted: List[int]):
        """The policy learns from every sequence's draft, but counts a plain step once."""
        if b == 1:
            self.policy.record(1, 0)
        else:
            for a in accepted:
                self.policy.record(b, a)

    def _emit(self, s: _Sequence, tokens: List[int], logprobs: mx.array, drafted: int):
        out = []
        for j, token in enumerate(tokens):
            s.emitted += 1
            if token in s.stop_tokens:
                s.finish = "stop"
            elif s.emitted >= s.max_tokens:
                s.finish = "length"
            s.last = Response(s.uid, token, logprobs[j], j < drafted, s.finish, s.stats)
            out.append(s.last)
            if s.finish:
                break
        return out

    # -- leaving -----------------------------------------------------------------------
    def _keep(self, indices: List[int]):
        self.batch.keep(indices)
        self.active = [self.active[i] for i in indices]


class _KeyScope:
    """Around a sampled sequence's draws: its own PRNG key in, the global one back."""

    def __init__(self, seq: _Sequence):
        self.seq, self.outer = seq, None

    def __enter__(self):
        if self.seq.key is not None:
            self.outer = _swap_key(self.seq.key)

    def __exit__(self, *exc):
        if self.seq.key is not None:
            self.seq.key = _swap_key(self.outer)


# --- the Python API ----------------------------------------------------------------------------

@dataclass
class BatchResult:
    """What ``batch_generate`` returns, in the prompts' order (stop tokens left out)."""
    texts: List[str]
    token_ids: List[List[int]]
    finish_reasons: List[str]
    stats: List[CycleStats]
    generation_tokens: int = 0
    generation_tps: float = 0.0  # all sequences' tokens per second of the whole run


def stream_batch_generate(model, tokenizer, prompts: Sequence, drafter: Drafter, *,
                          max_tokens: Union[int, List[int]] = 256, temp: float = 0.0,
                          top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0,
                          logits_processors: Optional[List[Callable]] = None,
                          block_size=adaptive.AUTO, seed: Optional[int] = None,
                          **kwargs) -> Iterator[Response]:
    """Generate from every prompt (text, token ids or chat messages) in one batch; yield
    each token's ``Response`` as it comes (``uid`` = the prompt's index).  ``seed``: the
    whole batch's random draws.  Other keywords go to ``BatchGenerator``."""
    from .generate import encode_prompt

    if seed is not None:
        mx.random.seed(seed)
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = SamplingParams(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
    gen = BatchGenerator(model, drafter, block_size=block_size, **kwargs)
    for prompt, limit in zip(prompts, limits):
        gen.insert(encode_prompt(tokenizer, prompt), max_tokens=limit, params=params,
                   logits_processors=logits_processors, stop_tokens=tokenizer.eos_token_ids)
    while len(gen):
        yield from gen.next()


def batch_generate(model, tokenizer, prompts: Sequence, drafter: Drafter, **kwargs) -> BatchResult:
    """Every prompt's whole response, generated together (keywords: ``stream_batch_generate``)."""
    n = len(prompts)
    tokens = [[] for _ in range(n)]
    finish, stats = [""] * n, [None] * n
    tic, total = time.perf_counter(), 0
    for r in stream_batch_generate(model, tokenizer, prompts, drafter, **kwargs):
        total += 1
        if r.finish_reason != "stop":
            tokens[r.uid].append(r.token)
        if r.finish_reason:
            finish[r.uid], stats[r.uid] = r.finish_reason, r.stats
    seconds = time.perf_counter() - tic
    return BatchResult([tokenizer.decode(t) for t in tokens], tokens, finish, stats, total,
                       total / seconds if seconds else 0.0)
