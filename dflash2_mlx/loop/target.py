"""The target side: capture tapped layer outputs from unmodified mlx-lm models, and
roll caches back to the accepted step.

Capture swaps each tapped layer's class for a subclass whose ``__call__`` records
the layer's output, so model files stay untouched.  Attention caches are trimmed;
recurrent caches (linear-attention layers of qwen3_5 / qwen3_next) cannot be, so
they are restored from a snapshot taken before verification and the accepted
tokens are replayed through the target.  So are sliding-window caches once a verify pass
reaches their window (it drops the oldest rows a trim would have to bring back).
A pass over a few rows on the CPU splits its products over two streams (``cpu_split``).
How the target verifies (a chain's pass, a row-exact pass, one-row steps, a tree) is its
verifiers' (``verifiers.py``), composed when the target is made.

A target split into a pipeline (``distributed/pipeline.py``: ``model.dflash_stage``) holds
only some layers on each rank: each rank taps the layers it holds and its features are the
drafter's ``fc`` rows summed over the ranks (H wide, the drafter skips its ``fc``); whether a
rollback replays is decided for the whole target, so every rank runs a replay together.
"""

from typing import Callable, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from ..machine import cpu_split
from ..model.target_model import model_args, text_model
from . import verifiers


class UnsupportedTargetError(ValueError):
    """A target model whose structure the adapter cannot tap."""


_capture_classes = {}


def _capturing(cls):
    if cls not in _capture_classes:

        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            store, index = object.__getattribute__(self, "_dflash_tap")
            store[index] = out[0] if isinstance(out, tuple) else out
            return out

        _capture_classes[cls] = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})
    return _capture_classes[cls]


class Target:
    """An mlx-lm model plus the layers a drafter reads."""

    def __init__(self, model, layer_ids: Sequence[int], exact: Optional[str] = None):
        self.model = model
        tm = text_model(model)
        missing = [n for n in ("layers",) if not hasattr(model, n)]
        inner = getattr(tm, "model", None)
        if inner is None or not hasattr(inner, "embed_tokens"):
            missing.append("model.embed_tokens")
        if missing:
            raise UnsupportedTargetError(
                f"target {type(model).__module__} has no {', '.join(missing)}; "
                "DFlash needs an mlx-lm decoder with `layers` and `model.embed_tokens`"
            )
        self.layers = model.layers
        self.stage = getattr(model, "dflash_stage", None)  # a pipeline stage: this rank's layers
        depth = len(self.layers) if self.stage is None else self.stage.depth
        bad = [i for i in layer_ids if not 0 <= i < depth]
        if bad:
            raise UnsupportedTargetError(
                f"target_layer_ids {list(layer_ids)} out of range for a {depth}-layer target"
            )
        self.layer_ids = list(layer_ids)
        self.args = model_args(model)
        self.hidden_size = self.args.hidden_size
        self.vocab_size = self.args.vocab_size
        self.model_type = getattr(self.args, "model_type", "")
        self.embed_tokens = inner.embed_tokens
        self.head_module = tm.lm_head if "lm_head" in tm else inner.embed_tokens
        self.lm_head = tm.lm_head if "lm_head" in tm else inner.embed_tokens.as_linear
        # Gemma scales its input embedding by sqrt(H); the drafter must see the same.
        self.embed_scale = self.hidden_size**0.5 if self.model_type.startswith("gemma") else 1.0
        self._taps: List = [None] * len(self.layer_ids)
        first = 0 if self.stage is None else self.stage.start
        self._slots = [s for s, i in enumerate(self.layer_ids) if self.stage is None or self.stage.holds(i)]
        for slot in self._slots:
            tap(self.layers[self.layer_ids[slot] - first], (self._taps, slot))
        if self.stage is not None:
            # The final (gathered) hidden state, after which a pass's features are summed.
            self._final, self._norm, self._cols = [None], inner.norm, False
            tap(self._norm, (self._final, 0))
        # How it verifies (``exact``: None, "pass" or "steps", see ``verifiers.py``); the
        # verifiers install what they change on the model and keep themselves here.
        self.verifiers = None
        verifiers.compose(self, exact)

    def project(self, drafter):
        """Pipeline: this rank's columns of the drafter's ``fc``; features come out through
        them, summed over the ranks, and the drafter takes them as its ``fc`` rows."""
        self._cols = self.stage.fc_columns(drafter.fc, self._slots, self.hidden_size)
        self._dtype = drafter.activation_dtype
        drafter.features_projected = True

    def needs_replay(self, cache) -> bool:
        return needs_replay(cache) if self.stage is None else self.stage.needs_replay(cache)

    def embed(self, ids):
        return self.embed_tokens(ids) * self.embed_scale

    def head_rows(self, ids: mx.array) -> Callable:
        """The LM head restricted to the rows ``ids``: a drafter with a draft vocabulary
        reads only its own rows, not the whole vocabulary's."""
        m = self.head_module
        bias = m["bias"][ids] if "bias" in m else None
        if "scales" in m:
            w, scales = m["weight"][ids], m["scales"][ids]
            biases = m["biases"][ids] if m.get("biases") is not None else None
            mx.eval(w, scales, biases)

            def head(h):
                out = mx.quantized_matmul(h, w, scales=scales, biases=biases, transpose=True,
                                          group_size=m.group_size, bits=m.bits, mode=m.mode)
                return out if bias is None else out + bias
        else:
            wt = m["weight"][ids].T
            mx.eval(wt, bias)

            def head(h):
                return h @ wt if bias is None else h @ wt + bias
        return head

    def make_cache(self):
        return make_prompt_cache(self.model)

    def check_cache(self, cache: list):
        """Refuse a cache that turns layers the model keeps whole into rotating ones (mlx-lm's
        ``max_kv_size``): the model's masks do not know that window, so a verify pass over
        several tokens would let its rows read more keys than one-token steps read."""
        for i, (c, own) in enumerate(zip(cache, self.make_cache())):
            if isinstance(c, RotatingKVCache) and not isinstance(own, RotatingKVCache):
                raise ValueError(
                    f"this prompt_cache bounds layer {i} to {c.max_size} tokens (mlx-lm's max_kv_size): "
                    f"DFlash's verify passes would not match mlx-lm's one-token steps there; "
                    f"use a cache without max_kv_size, or verify_mode='off'")

    def __call__(self, ids: mx.array, cache, split: bool = True):
        """Logits [1, L, V] and tapped features [1, L, n * H] for ``ids`` [1, L] (pipeline:
        the drafter's ``fc`` rows [1, L, H]).  ``split``: the CPU's two-stream products may
        run (``cpu_split``)."""
        if self.stage is not None:
            return self.staged_call(ids, cache)
        for slot, i in enumerate(self.layer_ids):
            object.__setattr__(self.layers[i], "_dflash_tap", (self._taps, slot))
        with cpu_split.rows(ids.size if split else 1) as split:
            logits = self.model(ids, cache=cache)
            features = mx.concatenate([t.astype(mx.float32) for t in self._taps], axis=-1)
            if split:
                mx.eval(logits, features)
        self._taps[:] = [None] * len(self._taps)
        return logits, features

    def staged_call(self, ids: mx.array, cache):
        if self._cols is False:
            raise ValueError("a target split into a pipeline gives the drafter's fc rows as its features: "
                             "build it with attach(model, drafter)")
        for slot in self._slots:
            object.__setattr__(self.layers[self.layer_ids[slot] - self.stage.start], "_dflash_tap",
                               (self._taps, slot))
        object.__setattr__(self._norm, "_dflash_tap", (self._final, 0))
        with cpu_split.rows(ids.size) as split:
            logits = self.model(ids, cache=cache)
            features = self.stage.context_rows([self._taps[s] for s in self._slots], self._cols,
                                               self._final[0], self._dtype)
            # Every collective of the pass, now and in one order on every rank.
            mx.eval([logits, features] if split else features)
        self._taps[:] = [None] * len(self._taps)
        self._final[0] = None
        return logits, features


def tap(layer, slot: tuple):
    """Record ``layer``'s output in ``slot`` (store, index) whenever it runs."""
    if not type(layer).__name__.startswith("Tapped"):
        layer.__class__ = _capturing(type(layer))
    object.__setattr__(layer, "_dflash_tap", slot)


def attach(model, drafter, exact: Optional[str] = None) -> Target:
    """The target adapter that taps the drafter's layers, with the drafter bound to the
    target's embedding and LM head (``exact``: how it verifies exact rows, ``verifiers.py``)."""
    target = Target(model, drafter.config.target_layer_ids, exact)
    if target.stage is not None:
        target.project(drafter)
    vocab = drafter.vocab
    drafter.bind(target.embed, target.lm_head if vocab is None else target.head_rows(vocab))
    return target


def snapshot(cache) -> list:
    """What a rollback needs: the state of every cache a verify pass may leave untrimmable,
    recurrent ones and sliding-window ones (a pass that reaches the window drops the rows a
    trim would need).  References suffice: a pass over several tokens builds new arrays."""
    out = []
    for c in cache:
        if isinstance(c, RotatingKVCache):
            out.append(c.state)
        elif c.is_trimmable():
            out.append(None)
        else:
            out.append((list(c.cache), c.lengths))
    return out


def needs_replay(cache) -> bool:
    return any(not c.is_trimmable() for c in cache)


def rollback(target: Target, cache, saved: list, fed: int, kept: mx.array):
    """Undo a verify pass over ``fed`` tokens, keeping only ``kept`` [1, n] of them."""
    n = kept.shape[1]
    if n == fed:
        return
    if not target.needs_replay(cache):
        for c in cache:
            c.trim(fed - n)
        return
    for c, s in zip(cache, saved):
        if s is None:
            c.trim(fed)
        elif isinstance(c, RotatingKVCache):
            c.state = s
        else:
            c.cache, c.lengths = list(s[0]), s[1]
    target.verifiers.block(kept, cache)
    mx.eval([c.state for c in cache])
