"""Data-parallel training over ``mx.distributed`` ranks (``mlx.launch -n N -- dflash2-mlx
train ...``): what a rank takes of each micro-batch, how the ranks add up their sums and
gradients, and the facts they check agree before the first step.

Every rank holds the whole target and the whole drafter and draws the same data order and
the same random anchors as one process would (the draws cost nothing next to a forward);
rank r then builds the blocks of its contiguous share of the micro-batch's sequences only,
computing the target features of those.  The loss of a batch is a ratio (weighted token
sums over weight sums), so the ranks add up their sums and counts before dividing, and
each rank's gradient is that of its own sums over the batch's total counts: the sum of the
ranks' gradients is then exactly the gradient one process computes.  Rank 0 alone logs,
evaluates and writes checkpoints; every rank resumes from the same checkpoint.
"""

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten


@dataclass
class Ranks:
    """The training group; ``Ranks(None)`` is one process, which runs exactly as before."""
    group: Optional[object] = None

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size()

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def share(self, n: int) -> Optional[Tuple[int, int]]:
        """Items [lo, hi) of an n-item micro-batch that this rank builds (None: all)."""
        return share_of(self.rank, self.size, n) if self.distributed else None

    def reduce(self):
        """The all_sum that adds up the ranks' loss sums and counts (None: one process)."""
        if not self.distributed:
            return None
        return lambda x: mx.distributed.all_sum(x, group=self.group)

    def gradients(self, grads):
        """The sum of the ranks' gradients (each rank's loss is scaled by the group size,
        so the average over ranks that ``average_gradients`` takes is that sum)."""
        if not self.distributed:
            return grads
        return nn.average_gradients(grads, group=self.group)

    def stop_all(self, stop: bool) -> bool:
        """Whether any rank asks to stop (each rank's clock differs; all must stop together)."""
        if not self.distributed:
            return stop
        return mx.distributed.all_sum(mx.array(float(stop)), group=self.group).item() > 0

    def barrier(self):
        """Return once every rank has reached this call: what rank 0 wrote before it is
        on disk for any rank that reads the run directory after it."""
        if self.distributed:
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=self.group))


def share_of(rank: int, size: int, n: int) -> Tuple[int, int]:
    """Rank ``rank``'s contiguous items of ``n`` over ``size`` ranks (n divisible by size)."""
    per = n // size
    return rank * per, (rank + 1) * per


def ranks_of(group) -> Ranks:
    """``Ranks`` of a group (None or a group of one: a single process)."""
    return Ranks(group if group is not None and group.size() > 1 else None)


def check_config(size: int, batch_size: int, feature_cache_gb: float):
    """Settings data-parallel training over ``size`` ranks cannot run with (the same on
    every rank, so every rank stops with this error before any collective)."""
    if size == 1:
        return
    if batch_size % size:
        raise ValueError(f"batch size {batch_size} is not divisible by the {size} ranks: "
                         f"each rank takes batch_size / ranks sequences of a micro-batch")
    if feature_cache_gb > 0:
        raise ValueError("the feature cache is for one process: with several ranks every rank "
                         "computes its own sequences' features (drop --feature-cache-gb)")


def digest(*parts) -> List[int]:
    """Four int32 words of a sha256 over arrays, token lists and strings."""
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, mx.array):
            p = np.array(p.astype(mx.float32) if p.dtype == mx.bfloat16 else p)
        if isinstance(p, np.ndarray):
            h.update(str((p.dtype, p.shape)).encode())
            h.update(np.ascontiguousarray(p).tobytes())
        else:
            h.update(repr(p).encode())
    return np.frombuffer(h.digest()[:16], dtype="<i4").tolist()


def data_digest(seqs) -> List[int]:
    """``digest`` of (key, token ids, response start) sequences."""
    h = hashlib.sha256()
    for key, ids, start in seqs:
        h.update(repr((key, start, len(ids))).encode())
        h.update(np.asarray(ids, np.int64).tobytes())
    return np.frombuffer(h.digest()[:16], dtype="<i4").tolist()


def params_digest(module) -> List[int]:
    return digest(*[x for kv in tree_flatten(module.parameters()) for x in kv])


def target_digest(model) -> List[int]:
    """``digest`` of a target's parameter names, shapes and dtypes, and of every 97th row of
    its embedding table (cheap next to hashing every weight of a large target, and enough
    to tell two models apart)."""
    flat = tree_flatten(model.parameters())
    rows = [v[::97] for k, v in flat if "embed" in k and k.endswith("weight")][:1]
    return digest([(k, tuple(v.shape), str(v.dtype)) for k, v in flat], *rows)


def agree(ranks: Ranks, facts: Dict[str, Sequence[int]]):
    """Raise the same ``ValueError`` on every rank when the ranks differ on any of ``facts``
    (name -> int32 words), found with one all_gather."""
    if not ranks.distributed:
        return
    names = list(facts)
    local = np.concatenate([np.asarray(facts[k], np.int32).reshape(-1) for k in names])
    every = np.array(mx.distributed.all_gather(mx.array(local), group=ranks.group))
    every = every.reshape(ranks.size, local.size)
    at = 0
    for k in names:
        w = len(facts[k])
        block = every[:, at : at + w]
        at += w
        if not (block == block[0]).all():
            differ = [r for r in range(ranks.size) if not (block[r] == block[0]).all()]
            raise ValueError(f"the ranks differ on {k}: rank 0 has {block[0].tolist()}, "
                             f"rank(s) {differ} have {[block[r].tolist() for r in differ]}")
