"""A prefix cache across requests: the target's cache (and the drafter's context) of earlier
requests, reused by a request whose prompt starts the same way.

An entry holds the token ids it covers and copies of the cache arrays for them:
- attention caches (mlx-lm ``KVCache``) are kept for the whole turn, prompt and reply; a new
  prompt that shares only part of it trims them to the shared prefix (a slice);
- recurrent caches (the linear-attention layers of qwen3_5 / qwen3_next) cannot be trimmed, so
  a hybrid target's entry is a snapshot at one step, usable only by a prompt that starts with
  all of it: at the prompt's last-but-one token (taken before the request runs), and at the
  end of the turn, from the latest step at which the caches held only known tokens (a
  speculative cycle may have accepted drafts that were not emitted when the reply ended);
- sliding-window caches (mlx-lm ``RotatingKVCache``) keep only their window: their rows are
  kept in position order, zeros before the window, and an entry serves only prompts that
  share enough of it for every window to be whole (its ``floor``): a chat's next turn does;
- with DFlash, the drafter's context rows (K/V made from target features) for the same tokens.
A plain request can reuse a DFlash entry's target part; a DFlash request needs the draft rows.
At least the prompt's last token is always run, so the first token comes from fresh logits.

Entries live in one model's engine, least recently used first out, within ``budget`` bytes
(and ``max_entries``, if set); with a ``disk`` tier (``ssd_cache.py``) those let go are kept
there.  Everything here runs on the MLX worker thread.
"""

import collections
import ctypes
import sys
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from ..batch.cache import window_rows
from ..loop.draft_context import DraftContext
from ..loop.target import attach, snapshot


# A prompt is read in chunks of about this many seconds, each a step of the worker (solo and
# batch): other requests decode between them, and a request given up stops within one.
PREFILL_CHUNK_SECONDS = 0.5
LEAST_BESIDE = 16  # tokens of a chunk read beside decoding requests, at least

# glibc's malloc_trim, where there is one (None elsewhere: macOS, musl).  CDLL(None) is the
# process's own symbols, libc's among them: no library search at import.
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform.startswith("linux") else None


def give_back_freed():
    """Hand the memory of entries let go back to the system.  MLX keeps freed buffers in
    its cache (on Metal up to the memory limit) and glibc keeps freed chunks in its arenas
    for reuse; the next entries rarely have the same sizes, so an evicting cache would
    otherwise hold the process well above its budget."""
    mx.clear_cache()
    if _malloc_trim is not None:
        _malloc_trim(0)


@dataclass
class Entry:
    tokens: tuple
    target: list  # per target layer: (keys, values) or (arrays, lengths)
    draft: Optional[list]  # per drafter layer: (keys, values); None without DFlash
    trimmable: bool
    nbytes: int
    floor: int = 0  # the fewest tokens it can start (sliding windows: enough for every window)


@dataclass
class Start:
    """Where a request begins: its caches (the first ``tokens`` prompt tokens already in them,
    ``reused`` of those from the cache)."""
    cache: list
    context: object  # a DraftContext, or None for plain decoding
    tokens: int = 0
    reused: int = 0
    # Targets with recurrent caches: (n, states), the recurrent states at the latest step
    # where every cache held exactly the first n tokens, all of them known.
    held: Optional[tuple] = None


def recurrent(cache) -> bool:
    return any(isinstance(c, ArraysCache) for c in cache)


def windowed(cache) -> bool:
    return any(isinstance(c, RotatingKVCache) for c in cache)


def reusable(cache) -> bool:
    """Plain attention with recurrent caches, or with sliding-window ones (not both)."""
    known = all(type(c) in (KVCache, ArraysCache) or type(c).__name__ == "MambaCache"
                or (type(c) is RotatingKVCache and c.keep == 0) for c in cache)
    return known and not (windowed(cache) and recurrent(cache))


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reuse_length(tokens: tuple, has_draft: bool, trimmable: bool, ids: Sequence[int], draft: bool,
                 floor: int = 0) -> int:
    """How many of ``ids`` an entry over ``tokens`` can start (0: none).  The prompt's last
    token always runs; a DFlash request needs the draft rows; an untrimmable (recurrent)
    entry serves only prompts that start with all of it, a sliding-window one at least
    ``floor`` tokens of it."""
    if draft and not has_draft:
        return 0
    n = min(_common(tokens, ids), len(ids) - 1)
    return n if (trimmable and n >= floor) or n == len(tokens) else 0


def covers(tokens: tuple, has_draft: bool, trimmable: bool, old_tokens: tuple, old_has_draft: bool,
           floor: int = 0, old_floor: int = 0) -> bool:
    """Whether a new entry makes an old one useless: same tokens first, draft rows if the old
    one had them (an untrimmable new entry covers only the very same tokens, a
    sliding-window one only entries it can start wherever they could)."""
    return (old_tokens == tokens[: len(old_tokens)] and (has_draft or not old_has_draft)
            and ((trimmable and floor <= old_floor) or old_tokens == tokens))


def recurrent_state(cache) -> list:
    """The recurrent states of ``cache`` (None for attention layers). The models replace
    these arrays at each step rather than write into them, so references are a snapshot:
    the one a speculative rollback takes (caches here are only KVCache / ArraysCache)."""
    return snapshot(cache)


def _held(cache) -> Optional[int]:
    """How many tokens the attention caches hold, if they agree (None without any)."""
    offsets = {c.offset for c in cache if isinstance(c, KVCache)}
    return offsets.pop() if len(offsets) == 1 else None


def _rows(c: KVCache, n: int):
    """Copies of the first ``n`` rows: a slice would keep the cache's whole buffer alive
    (mlx-lm's grow in steps of 256 rows), memory the entry's count does not see."""
    return mx.contiguous(c.keys[..., :n, :]), mx.contiguous(c.values[..., :n, :])


def _window(c: RotatingKVCache, n: int):
    """A rotating cache's rows for the first ``n`` tokens in position order (zeros before
    the rows it holds), copies."""
    k, v = window_rows(c, c.offset)
    return mx.contiguous(k[..., :n, :]), mx.contiguous(v[..., :n, :])


def _floor(cache, n: int) -> int:
    """The fewest of ``n`` tokens a restore can start with every window's rows whole: a
    window of w reads the w - 1 rows before it, and a rotating cache holds its last rows only."""
    floor = 0
    for c in cache:
        if isinstance(c, RotatingKVCache):
            first = c.offset - min(c.offset, c.keys.shape[2] if c.keys is not None else 0)
            if first > 0:
                floor = max(floor, first + c.max_size - 1)
    return floor


def _load_rows(c: KVCache, rows, n: int):
    k, v = rows
    c.state = (k[..., :n, :], v[..., :n, :], n)


class PrefixCache:
    def __init__(self, budget_bytes: int, max_entries: Optional[int] = None, disk=None):
        self.budget = int(budget_bytes)
        self.max_entries = max_entries  # None: as many as the budget holds
        self.disk = disk  # a DiskTier for what memory lets go, or None
        self.entries: "collections.OrderedDict[int, Entry]" = collections.OrderedDict()
        self._keys = iter(range(1 << 62))
        self._lock = threading.Lock()  # stats() is read from the event loop
        self.hits = self.misses = self.cached_tokens = self.disk_hits = 0
        self._layouts = {}  # (target, drafter) ids -> the layout of their entries (see ``layout``)

    @property
    def enabled(self) -> bool:
        return self.budget > 0 or self.disk is not None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def stats(self) -> dict:
        disk = self.disk
        ssd = disk.stats() if disk is not None else dict.fromkeys(
            ("prefix_cache_ssd_entries", "prefix_cache_ssd_bytes", "prefix_cache_ssd_budget_bytes"), 0)
        with self._lock:
            return {"prefix_cache_hits": self.hits, "prefix_cache_misses": self.misses,
                    "prefix_cache_cached_tokens": self.cached_tokens,
                    "prefix_cache_entries": len(self.entries), "prefix_cache_bytes": self.nbytes,
                    "prefix_cache_budget_bytes": self.budget, "prefix_cache_ssd_hits": self.disk_hits, **ssd}

    # Reuse -----------------------------------------------------------------------------
    def _best(self, ids: Sequence[int], draft: bool, fits=None):
        """The entry to start ``ids`` from, (entry, tokens) or (None, 0): the memory tier's
        best, or the disk tier's when that shares more (read back if ``fits`` it, and moved
        into memory)."""
        best, best_n = None, 0
        for key, e in self.entries.items():
            n = reuse_length(e.tokens, e.draft is not None, e.trimmable, ids, draft, e.floor)
            if n > best_n:
                best, best_n = key, n
        if best is not None:
            with self._lock:
                self.entries.move_to_end(best)
            best = self.entries[best]
        disk = self.disk
        name, n = disk.best(ids, draft) if disk is not None else (None, 0)
        if n > best_n:
            entry = disk.load(name, fits)
            if entry is not None:
                with self._lock:
                    self.disk_hits += 1
                if self._keep(entry):
                    disk.remove(name)
                best, best_n = entry, n
        return best, best_n

    def start(self, ids: Sequence[int], model, drafter=None, window=None, reuse: bool = True,
              sink: int = 0) -> Start:
        """Caches for a request over ``ids``: restored from the best entry, or fresh. With a
        ``drafter`` (DFlash) the start has a draft context too. A hybrid target is advanced to
        the last-but-one prompt token here and stored; its states there are the first held."""
        cache = make_prompt_cache(model)
        context = DraftContext(drafter, window, sink) if drafter is not None else None
        if not self.enabled or not reusable(cache):
            return Start(cache, context)
        fits = lambda e: self.fits(e, model, drafter if context is not None else None)  # noqa: E731
        entry, n = self._best(ids, context is not None, fits) if reuse else (None, 0)
        with self._lock:
            self.hits += entry is not None
            self.misses += entry is None
            self.cached_tokens += n
        if entry is not None:
            self._restore(entry, n, cache, context)
        start = Start(cache, context, n, n)
        if recurrent(cache):
            if start.tokens < len(ids) - 1:
                self._advance(start, ids[: len(ids) - 1], model)
            start.held = (start.tokens, recurrent_state(cache))
            if start.tokens > n:
                self.store(ids[: len(ids) - 1], start)
        return start

    def again(self, first: Start, ids: Sequence[int], model, drafter=None, window=None, sink: int = 0) -> Start:
        """``first`` (a start of ``ids`` none of whose tokens were read yet) or, where the cache
        now shares more of ``ids``, a start from there: a prompt that waited its turn to be
        read while another was read, which may have been the same prompt.  The counters move
        from the first lookup to this one (a request is one hit or one miss)."""
        if not self.enabled or first.tokens > first.reused or recurrent(first.cache):
            return first
        again = self.start(ids, model, drafter, window, sink=sink)
        kept, dropped = (again, first) if again.tokens > first.tokens else (first, again)
        with self._lock:  # a request is counted once
            self.hits -= dropped.reused > 0
            self.misses -= dropped.reused == 0
            self.cached_tokens -= dropped.reused
        return kept

    def fits(self, entry: Entry, model, drafter=None) -> bool:
        """Whether ``entry`` (one read from disk) has the arrays the caches of ``model`` (and,
        for its draft rows, ``drafter``) take: a file whose header was edited would fail the
        requests it starts, or serve from arrays that are not this model's."""
        key = (id(model), id(drafter))
        if key not in self._layouts:  # the caches after one token, once per pair
            probe = Start(make_prompt_cache(model), DraftContext(drafter) if drafter is not None else None)
            self._advance(probe, [0], model)
            draft = [_rows(c, 1) for c in probe.context.fed()] if drafter is not None else None
            target = [state if isinstance(c, ArraysCache) else _rows(c, 1)
                      for c, state in zip(probe.cache, recurrent_state(probe.cache))]
            self._layouts[key] = layout(target, draft)
        want = self._layouts[key]
        got = layout(entry.target, entry.draft if drafter is not None else None, len(entry.tokens))
        return got == want

    @staticmethod
    def note(start: Start, known: int):
        """After a generated token, ``known`` tokens (prompt and reply so far) are known: if
        the caches hold no more than those, their recurrent states are kept in ``start``
        (references, no copy), for the end-of-turn entry of a hybrid target."""
        if start.held is None:
            return
        n = _held(start.cache)
        if n is not None and start.held[0] < n <= known:
            start.held = (n, recurrent_state(start.cache))

    @staticmethod
    def _restore(e: Entry, n: int, cache, context):
        for c, saved in zip(cache, e.target):
            if isinstance(c, KVCache):
                _load_rows(c, saved, n)
            elif isinstance(c, RotatingKVCache):
                # The rows of the last window before ``n``, in order (the first may be a zero
                # row older than the window: a rotating cache never reads its oldest row again).
                k, v = saved
                lo = max(0, n - c.max_size)
                c.state = (k[..., lo:n, :], v[..., lo:n, :], n, 0, c.max_size, n - lo)
            else:
                c.state = (list(saved[0]), None, saved[1])
        if context is not None:
            for c, rows in zip(context.cache, e.draft):
                _load_rows(c, rows, n)

    @staticmethod
    def _advance(start: Start, ids: Sequence[int], model, step: int = 2048):
        """Run ``ids[start.tokens:]`` into the caches (features to the draft context)."""
        for _ in PrefixCache.advance_steps(start, ids, model, seconds=1e9, first=step, most=step):
            pass

    @staticmethod
    def advance_steps(start: Start, ids: Sequence[int], model, seconds=None, first: int = 128, most: int = 2048):
        """``_advance`` a chunk at a time, yielding after each: chunks are sized from the last
        one's time so that each takes about ``seconds`` (default ``PREFILL_CHUNK_SECONDS``; a
        function: asked before each chunk; from ``first`` tokens, at most ``most``), so a
        request's prefill takes turns with other requests' steps and a request given up stops
        within one chunk."""
        seconds = PREFILL_CHUNK_SECONDS if seconds is None else seconds
        target_seconds = seconds if callable(seconds) else lambda: seconds
        target = attach(model, start.context.drafter) if start.context is not None else None
        step = first
        while start.tokens < len(ids):
            tic = time.perf_counter()
            end = min(len(ids), start.tokens + step)
            chunk = mx.array(ids[start.tokens: end], dtype=mx.uint32)[None]
            if start.context is not None:
                _, features = target(chunk, start.cache)
                start.context.add(features)
            else:
                model(chunk, cache=start.cache)
            mx.eval([c.state for c in start.cache])
            took = time.perf_counter() - tic
            aim = target_seconds()
            # Below 32 tokens a pass reads its weights for little; only a chunk bounded by
            # other requests' cycles (less than the default time) goes below, to LEAST_BESIDE:
            # smaller, each chunk is mostly that pass, and a long prompt read beside busy
            # requests takes many times its time alone (its client gives up first).
            least = 32 if aim >= PREFILL_CHUNK_SECONDS else LEAST_BESIDE
            step = max(least, min(most, int((end - start.tokens) * aim / max(took, 1e-4))))
            start.tokens = end
            yield

    # Storing ---------------------------------------------------------------------------
    def read(self, ids: Sequence[int], start: Start):
        """A prompt's ``ids`` (all but its last token) were read into ``start``'s caches: where
        those keep only a window, the turn's end will not serve the same prompt again, so the
        prompt is kept now too (hybrid targets keep theirs in ``start``)."""
        if windowed(start.cache) and start.tokens == len(ids):
            self.store(ids, start)

    def store(self, tokens: Sequence[int], start: Start):
        """Keep the caches of ``start`` for ``tokens`` (what they hold, in order); the
        caches may hold more (trimmed here) or fewer (the tokens are cut to them)."""
        if not self.enabled or not reusable(start.cache):
            return
        trimmable = not recurrent(start.cache)
        n = min([len(tokens)] + [c.offset for c in start.cache if isinstance(c, (KVCache, RotatingKVCache))])
        if start.context is not None:
            draft_cache = start.context.fed()
            n = min([n] + [c.offset for c in draft_cache])
        states = [None] * len(start.cache)
        if not trimmable:
            if start.held is None or start.held[0] > n:
                return  # no step at which the recurrent states held known tokens only
            n, states = start.held
        if n < 1:
            return
        floor = _floor(start.cache, n)
        if floor > n:
            return  # a window the caches no longer hold whole at n tokens
        target = [_rows(c, n) if isinstance(c, KVCache) else _window(c, n) if isinstance(c, RotatingKVCache)
                  else state for c, state in zip(start.cache, states)]
        draft = [_rows(c, n) for c in draft_cache] if start.context is not None else None
        arrays = [a for pair in target + (draft or []) for a in _flat(pair)]
        mx.eval(arrays)
        entry = Entry(tuple(tokens[:n]), target, draft, trimmable, sum(a.nbytes for a in arrays), floor)
        disk = self.disk  # settings may change it from another thread
        if not self._keep(entry) and disk is not None:
            disk.put(entry)

    def _keep(self, entry: Entry) -> bool:
        """Put ``entry`` in memory (entries it covers go; the oldest go to disk while over the
        budget); False when it does not fit there at all."""
        if entry.nbytes > self.budget:
            return False
        gone, covered = self._admit(entry)
        self._spill(gone)
        if gone or covered:
            gone = None  # the last reference: the entries' arrays are freed here
            give_back_freed()
        return True

    def _admit(self, entry: Entry):
        """Add ``entry``, drop the entries it covers, and take out the oldest while over the
        budget; returns those taken out (oldest first) and how many were covered."""
        gone, covered = [], 0
        with self._lock:
            for key, e in list(self.entries.items()):
                if covers(entry.tokens, entry.draft is not None, entry.trimmable, e.tokens, e.draft is not None,
                          entry.floor, e.floor):
                    del self.entries[key]
                    covered += 1
            self.entries[next(self._keys)] = entry
            while self.nbytes > self.budget or len(self.entries) > (self.max_entries or len(self.entries)):
                gone.append(self.entries.popitem(last=False)[1])
        return gone, covered

    def _spill(self, entries: list):
        """Write ``entries`` to the disk tier, if there is one, in order."""
        disk = self.disk  # settings may change it from another thread
        for e in entries if disk is not None else ():
            disk.put(e)

    def clear(self):
        with self._lock:
            self.entries.clear()
        give_back_freed()

    def close(self):
        """Let every entry go: to the disk tier, if there is one, oldest first, and on disk
        before this returns (a server shutting down keeps them for the next)."""
        with self._lock:
            entries = list(self.entries.values())
            self.entries.clear()
        self._spill(entries)
        disk = self.disk
        if disk is not None:
            disk.flush()


def layout(target: list, draft: Optional[list], tokens: int = 1) -> tuple:
    """The shapes and dtypes of an entry's arrays, the token axis of attention rows left
    out (None where it is not ``tokens`` long): what two entries of one pair share."""
    def rows(a):
        if a.ndim != 4 or a.shape[2] != tokens:
            return None
        return a.shape[:2] + a.shape[3:], a.dtype

    def states(arrays):
        return tuple(None if a is None else (a.shape, a.dtype) for a in arrays)

    out = [(rows(first), rows(second)) if isinstance(first, mx.array) else states(first)
           for first, second in target]
    return tuple(out), None if draft is None else tuple((rows(k), rows(v)) for k, v in draft)


def _flat(pair) -> List[mx.array]:
    first, second = pair
    if isinstance(first, list):
        return [a for a in first if a is not None] + ([second] if second is not None else [])
    return [first, second]
