"""A target split into contiguous layer ranges, one per rank (pipeline parallel), under the
DFlash loop.

The layout is mlx-lm's (``models/pipeline.py``): rank 0 holds the LAST layers and rank
N-1 the first; a pass receives the hidden state from rank r+1, runs the rank's layers, sends
it to rank r-1, and one all_gather hands rank 0's final hidden state to every rank, which
then computes the norm and the LM head itself: every rank ends a pass with the same logits,
so verify and accept agree on every rank by construction.  Families with mlx-lm's
``pipeline(group)`` (qwen2, qwen3_5, qwen3_next, deepseek_v3, ...) use it as it is; llama and
qwen3, which mlx-lm does not pipeline, get the same split and the same exchanges in
``staged_call``, our own layer loop.  A rank keeps only its own layers in the model, so with
lazy loading the others' weights are never read there, and its caches (``make_prompt_cache``
over the model's ``layers``, which are the rank's) cover its layers only, in order.

The drafter reads tapped layers that live on different ranks.  Its ``fc`` is linear over
the concatenated taps, ``fc(concat(t_1..t_n)) = sum_r fc_r(taps of rank r)``, so each rank
applies its own columns of ``fc`` to its own taps and one all_sum of an H-wide row per token
gives every rank the drafter's input (``context_rows``); the drafter then skips ``fc``.

Every collective of a pass is issued inside ``Target.__call__`` and evaluated there, in one
order on every rank (send / recv, all_gather, all_sum): lazily kept graphs of several
passes could otherwise be scheduled in different orders on different ranks.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from ..model.target_model import model_args, text_model

# mlx-lm modules whose inner model runs "embed -> masks -> layers -> norm" and has no
# ``pipeline`` of its own: split here with ``staged_call``.
OWN_LOOP = ("llama", "qwen3")


@dataclass
class Stage:
    """One rank's part of a target split into a pipeline."""
    group: object
    rank: int
    size: int
    start: int  # the first (global) layer index this rank holds
    stop: int  # one past its last
    depth: int  # the whole target's layers
    recurrent: bool  # some layer of the whole target keeps a recurrent (untrimmable) cache
    windows: Tuple[int, ...]  # the sliding windows of the whole target's rotating caches

    def holds(self, layer: int) -> bool:
        return self.start <= layer < self.stop

    def needs_replay(self, cache: list) -> bool:
        """Whether a rollback must restore and replay, decided for the whole target (every
        rank alike: a replay is a target pass, which all ranks run together) from what the
        local caches share, their offset."""
        if self.recurrent:
            return True
        offset = next((c.offset for c in cache if hasattr(c, "offset")), 0)
        return any(offset >= w for w in self.windows)

    def receive(self, h: mx.array) -> mx.array:
        """The hidden state from the rank before (rank + 1), or ``h`` on the first stage."""
        if self.rank < self.size - 1:
            return mx.distributed.recv_like(h, self.rank + 1, group=self.group)
        return h

    def pass_on(self, h: mx.array, cache: list) -> mx.array:
        """Send ``h`` on to rank - 1, and give every rank rank 0's (the final) hidden state."""
        if self.rank != 0:
            h = mx.distributed.send(h, self.rank - 1, group=self.group)
            if cache and cache[-1] is not None:  # evaluating the caches alone sends too
                depend(cache[-1], h)
        if self.size > 1:
            h = mx.distributed.all_gather(h, group=self.group)[: h.shape[0]]
        return h

    def fc_columns(self, fc: nn.Module, slots: List[int], hidden: int) -> Optional[mx.array]:
        """The columns of the drafter's ``fc`` [H, n * H] that read the tap slots ``slots``,
        as one [H, len(slots) * H] matrix (None: this rank holds no tapped layer)."""
        if not slots:
            return None
        if "scales" in fc:  # a quantized fc: its columns as floats (groups lie within a tap)
            w = mx.dequantize(fc["weight"], fc["scales"], fc.get("biases"), group_size=fc.group_size,
                              bits=fc.bits, mode=getattr(fc, "mode", "affine"))
        else:
            w = fc["weight"]
        cols = mx.concatenate([w[:, s * hidden:(s + 1) * hidden] for s in slots], axis=1)
        mx.eval(cols)
        return cols

    def context_rows(self, taps: List[mx.array], cols: Optional[mx.array], like: mx.array,
                     dtype=mx.float32) -> mx.array:
        """The drafter's ``fc`` rows [.., L, H] of a pass: this rank's columns over its taps
        (in the drafter's activation ``dtype``), summed over the ranks.  ``like``: the pass's
        final hidden state [.., L, H]; the sum is issued after it, so that the collectives of
        a pass keep one order on every rank."""
        if cols is None:
            part = mx.zeros(like.shape, dtype=dtype)
        else:
            part = mx.concatenate([t.astype(dtype) for t in taps], axis=-1) @ cols.T
        return mx.distributed.all_sum(mx.depends(part, like), group=self.group)


def depend(c, x: mx.array):
    """Make the cache ``c``'s state depend on ``x`` (as mlx-lm's pipelined models do)."""
    if hasattr(c, "keys"):
        k = c.keys
        c.keys = tuple(mx.depends(list(k), x)) if isinstance(k, tuple) else mx.depends(k, x)
    else:
        c[0] = mx.depends(c[0], x)


def stage_of(model) -> Optional[Stage]:
    """The stage of a split target, or None for a whole one."""
    return getattr(model, "dflash_stage", None)


def layer_ranges(depth: int, size: int) -> List[Tuple[int, int]]:
    """[start, stop) per rank: mlx-lm's even split, the low ranks taking the extra layers,
    and rank r running the layers after those of ranks r+1 .. size-1."""
    base, extra = divmod(depth, size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    out = []
    for r in range(size):
        start = sum(counts[r + 1:])
        out.append((start, start + counts[r]))
    return out


def check(model, size: int):
    """Raise ValueError when ``model`` cannot be split over ``size`` ranks (no collective)."""
    tm = text_model(model)
    inner = getattr(tm, "model", None)
    family = getattr(model_args(model), "model_type", type(model).__module__)
    if stage_of(model) is not None or getattr(model, "dflash_tensor", None) is not None:
        raise ValueError("this target is already split")
    module = type(inner).__module__.rsplit(".", 1)[-1] if inner is not None else ""
    if inner is None or not (hasattr(inner, "pipeline") or module in OWN_LOOP):
        raise ValueError(
            f"a {family} target cannot be split into a pipeline: mlx-lm has no pipeline() for "
            f"it and DFlash's own layer loop covers {', '.join(OWN_LOOP)}; use distributed='tensor'")
    depth = len(model.layers)
    if depth < size:
        raise ValueError(f"a {depth}-layer target cannot be split over {size} ranks (fewer layers than ranks)")


def split(model, group) -> Stage:
    """Split ``model`` in place over ``group``: this rank keeps its layer range only."""
    check(model, group.size())
    inner = text_model(model).model
    depth, rank, size = len(model.layers), group.rank(), group.size()
    template = make_prompt_cache(model)  # the whole target's caches (empty): their kinds
    start, stop = layer_ranges(depth, size)[rank]
    if hasattr(inner, "pipeline"):
        if size != mx.distributed.init().size():
            raise ValueError("mlx-lm's pipelined models exchange over the whole world group: "
                             f"a group of {size} of {mx.distributed.init().size()} ranks cannot be used")
        inner.pipeline(group)
        if (inner.start_idx, inner.end_idx) != (start, stop) or len(model.layers) != stop - start:
            raise ValueError(f"mlx-lm split rank {rank} as layers {inner.start_idx}..{inner.end_idx} "
                             f"({len(model.layers)} held), expected {start}..{stop}")
    else:
        inner.layers = inner.layers[start:stop]
        inner.__class__ = staged(type(inner))
    stage = Stage(group, rank, size, start, stop, depth,
                  recurrent=any(not isinstance(c, RotatingKVCache) and not c.is_trimmable() for c in template),
                  windows=tuple(c.max_size for c in template if isinstance(c, RotatingKVCache)))
    object.__setattr__(model, "dflash_stage", stage)
    object.__setattr__(inner, "dflash_stage", stage)
    return stage


_staged_classes = {}


def staged(cls):
    """``cls`` (an inner model of ``OWN_LOOP``) with its forward as one pipeline stage."""
    if cls not in _staged_classes:
        _staged_classes[cls] = type(f"Staged{cls.__name__}", (cls,), {"__call__": staged_call})
    return _staged_classes[cls]


def staged_call(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None):
    """The family's forward over this rank's layers: the masks from the rank's first cache of
    each kind (every cache holds the same tokens), the hidden state received before them and
    passed on after them, the final one shared by every rank before the norm."""
    stage = self.dflash_stage
    h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
    if cache is None:
        cache = [None] * len(self.layers)
    masks = {}
    for layer, c in zip(self.layers, cache):
        sliding = getattr(layer, "use_sliding", False)
        if sliding not in masks:
            window = getattr(self, "sliding_window", None) if sliding else None
            masks[sliding] = create_attention_mask(h, c, window_size=window)
    h = stage.receive(h)
    for layer, c in zip(self.layers, cache):
        h = layer(h, masks[getattr(layer, "use_sliding", False)], c)
    return self.norm(stage.pass_on(h, cache))
