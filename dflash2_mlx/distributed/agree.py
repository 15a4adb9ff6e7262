"""What the ranks of a split target must decide alike, decided by rank 0.

Every rank runs the same cycle on the same logits, so the accepted tokens, copies and
sampled tokens agree by construction, except where a decision reads something local: the
adaptive policy's block size depends on measured time, which differs per rank, and a
sampled run without a seed starts from each process's own random state.  ``Agreed`` wraps
a block-size policy so that rank 0's choice is every rank's (one small all_sum per cycle),
and ``shared_seed`` gives every rank rank 0's seed.
"""

import random

import mlx.core as mx

from ..adaptive import Choice, Fixed


def broadcast(values, group) -> list:
    """Rank 0's ``values`` (ints) on every rank: an all_sum to which the others add zeros."""
    mine = mx.array(values if group.rank() == 0 else [0] * len(values), dtype=mx.int32)
    return mx.distributed.all_sum(mine, group=group).tolist()


class Agreed:
    """A block-size policy whose choices are rank 0's on every rank.  Each rank's own policy
    still chooses and learns (it keeps its state going); rank 0's choice, and whether its
    plain step carries a shadow probe, travel in one all_sum of four ints per cycle."""

    def __init__(self, policy, group):
        self.policy, self.group = policy, group
        self.largest, self.copy_largest = policy.largest, policy.copy_largest
        self.pending_shadow = None  # rank 0's shadow decision for the plain step just chosen

    def __getattr__(self, name):  # costs, acceptance, fallback: the policy's
        return getattr(self.__dict__["policy"], name)

    # Rank 0 alone saves what the request taught (``calibration.remember``): ranks on one host
    # share the files, and the others' choices were never used.
    @property
    def history_key(self):
        return self.policy.history_key if self.group.rank() == 0 else None

    @property
    def timing_key(self):
        return self.policy.timing_key if self.group.rank() == 0 else None

    def choose(self, context: int, copy: int = 0) -> Choice:
        mine = self.policy.choose(context, copy)
        # A plain step's shadow decision is rank 0's too, taken now to share the collective.
        shadow = self.group.rank() == 0 and mine.block == 1 and self.policy.shadow()
        block, copied, fallback, shadow = broadcast([mine.block, mine.copy, mine.fallback, shadow], self.group)
        self.pending_shadow = bool(shadow) if block == 1 else None
        return Choice(block, copy=bool(copied), fallback=bool(fallback))

    def shadow(self) -> bool:
        # The loop asks right after a plain step's choice; a block the KV clamp cut to one
        # was not chosen plain, and carries no probe on any rank.
        shadow, self.pending_shadow = bool(self.pending_shadow), None
        return shadow

    def record(self, b: int, accepted: int, copy: bool = False):
        self.policy.record(b, accepted, copy)

    def timed(self, b: int, seconds: float, copy: bool = False):
        self.policy.timed(b, seconds, copy)

    def record_shadow(self, chance: float):
        self.policy.record_shadow(chance)


def agreed(policy, group):
    """``policy`` for the ranks of ``group``: as it is where every rank's choice is the same
    anyway (a fixed block size, or no group), else ``Agreed``."""
    if group is None or group.size() == 1 or isinstance(policy, Fixed):
        return policy
    return Agreed(policy, group)


def shared_seed(group) -> int:
    """A seed rank 0 picks, the same on every rank of ``group`` (for a sampled run given none)."""
    return broadcast([random.SystemRandom().randrange(1 << 31)], group)[0]
