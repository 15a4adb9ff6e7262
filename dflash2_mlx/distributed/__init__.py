"""A target split over ``mx.distributed`` ranks under the DFlash loop (tensor parallel through
mlx-lm's ``shard``, pipeline over contiguous layer ranges), and what the ranks check and
agree on so that every rank runs the same cycle.

    tensor.py       ``shard``: mlx-lm's tensor-parallel split, after the checks it needs
    pipeline.py     ``split``: contiguous layer ranges, one per rank
    fingerprint.py  every rank holds the same target and drafter files (one all_gather)
    agree.py        rank 0's block-size choice and sampling seed, used by every rank
    local.py        N ranks on 127.0.0.1 (tests, ``bench distributed``)

``split(model, group, mode)`` is the one entry point; ``group_of(model)`` tells a split
target's group (None for a whole one).  Serving over the ranks (rank 0 serves, the others
follow it) is the backend's: ``backend/follow.py``.
"""

import os
from typing import Optional

import mlx.core as mx

from . import tensor

MODES = ("tensor", "pipeline")


def init(group=None, backend: str = "any"):
    """The group to split over: ``group`` itself, else ``mx.distributed.init`` (from the
    environment ``mlx.launch`` sets: MLX_HOSTFILE / MLX_RANK for the ring backend)."""
    if group is not None:
        return group
    return mx.distributed.init(backend=backend)


def check_mode(mode: str):
    if mode not in MODES:
        raise ValueError(f"distributed mode {mode!r} is not supported; use one of {MODES}")


def split(model, group, mode: str):
    """Split ``model`` in place over ``group``: "tensor" (``tensor.shard``) or "pipeline"
    (``pipeline.split``).  A target that cannot be split over the group raises ValueError
    before any collective is issued."""
    check_mode(mode)
    if mode == "tensor":
        return tensor.shard(model, group)
    from . import pipeline  # imported here: tensor-parallel runs need none of it

    return pipeline.split(model, group)


def group_of(model) -> Optional[object]:
    """The group a split target runs over, or None (a whole target, or a group of one)."""
    split = tensor.split_of(model) or getattr(model, "dflash_stage", None)
    group = getattr(split, "group", None)
    return group if group is not None and group.size() > 1 else None


def is_rank0(model=None, group=None) -> bool:
    """Whether this process is rank 0 (the one that prints): of ``group``, of the group
    ``model`` is split over, or of the world; True without one."""
    group = group or (group_of(model) if model is not None else None)
    if group is None:
        return mx.distributed.init().rank() == 0 if mx.distributed.is_available() else True
    return group.rank() == 0


# What MLX's backends say when a peer rank is gone (ring: its TCP connection closed).
PEER_LOST = ("connection to a peer was lost", "peer", "connection reset", "broken pipe")


def peer_lost(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because another rank stopped."""
    return isinstance(e, RuntimeError) and any(w in str(e).lower() for w in PEER_LOST)


def failure_message(e: BaseException, rank: Optional[int] = None) -> str:
    """One line for a rank's stderr: which rank, and why it stops (a lost peer said plainly:
    a split target cannot go on with a rank missing)."""
    rank = os.environ.get("MLX_RANK", "?") if rank is None else rank
    if peer_lost(e):
        return (f"dflash2-mlx rank {rank}: another rank stopped mid-run ({e}); a split target "
                "cannot continue without it, so this rank stops too")
    return f"dflash2-mlx rank {rank}: {type(e).__name__}: {e}"


__all__ = ["MODES", "PEER_LOST", "check_mode", "failure_message", "group_of", "init", "is_rank0", "peer_lost",
           "split", "tensor"]
