"""The drafter's context: K/V rows made from the target features of committed tokens.

Features wait until the next draft and go in as one batch, so a run of plain decode steps
(block size 1) feeds the drafter once when drafting resumes.  ``window`` bounds how many
of the latest rows a draft reads (a long-context cap on the drafter's cost), past the first
``sink`` rows, which it always reads (attention sinks: softmax mass that has nowhere better
to go lands on the first tokens, and a window without them shifts it onto others); the
rows keep their absolute positions.
"""

import weakref
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .kv_quant import kv_offset

FLUSH_ROWS = 256  # pending rows that are fed at once even without a draft (bounds memory)


class WindowCache(KVCache):
    """A KVCache whose readers see only the first ``sink`` rows and the last ``window``."""

    def __init__(self, window: int, sink: int = 0):
        super().__init__()
        self.window, self.sink = window, sink

    def keys_and_values(self):
        k, v = super().keys_and_values()
        if k.shape[-2] <= self.sink + self.window:
            return k, v
        if not self.sink:
            return k[..., -self.window:, :], v[..., -self.window:, :]
        return (mx.concatenate([k[..., : self.sink, :], k[..., -self.window:, :]], axis=-2),
                mx.concatenate([v[..., : self.sink, :], v[..., -self.window:, :]], axis=-2))


class DraftContext:
    def __init__(self, drafter, window: Optional[int] = None, sink: int = 0):
        self.drafter, self.window, self.sink = drafter, window, sink
        self.cache = ([WindowCache(window, sink) for _ in drafter.layers] if window
                      else drafter.make_cache())
        self.pending, self.rows = [], 0

    def add(self, features: mx.array):
        """Features [1, n, taps * H] of tokens just committed."""
        self.pending.append(features)
        self.rows += features.shape[1]
        if self.rows >= FLUSH_ROWS:
            mx.eval([c.state for c in self.fed()])

    def fed(self) -> list:
        """The draft cache with every committed token in it."""
        if self.pending:
            self.drafter.append_context(mx.concatenate(self.pending, axis=1), self.cache)
            self.pending, self.rows = [], 0
        return self.cache

    @property
    def size(self) -> int:
        """Committed tokens in the context, fed or pending."""
        return self.cache[0].offset + self.rows

    def trim(self, n: int):
        """Drop the latest ``n`` rows."""
        for c in self.fed():
            c.trim(n)


# A prompt cache's first layer -> the drafter context of the tokens it holds, for mlx-lm's
# use of a prompt cache (the caller keeps only the target's cache from turn to turn).
chat_contexts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def chat_context(prompt_cache: list, drafter, window: Optional[int], sink: int) -> DraftContext:
    """The drafter context of the tokens ``prompt_cache`` holds, kept from the call that left
    them there; a fresh one (this call's tokens only) where none matches the cache."""
    context = chat_contexts.get(prompt_cache[0])
    if (context is None or context.drafter is not drafter or (context.window, context.sink) != (window, sink)
            or context.size != kv_offset(prompt_cache)):
        context = DraftContext(drafter, window, sink)
    chat_contexts[prompt_cache[0]] = context
    return context
