"""The draft statistics of one generation (``CycleStats``), which every decoding loop
updates after each cycle and yields with each token."""

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class CycleStats:
    """Draft statistics of one generation, updated after every cycle."""
    block_size: int  # the largest block a cycle may use
    cycles: int = 0
    accepted: int = 0  # draft tokens accepted in the latest cycle
    total_accepted: int = 0
    position_accepted: List[int] = field(default_factory=list)
    block_sizes: Dict[int, int] = field(default_factory=Counter)  # cycles per block size
    fallback: bool = False  # the adaptive policy is decoding plain (probing now and then)
    shadows: int = 0  # plain steps that carried a shadow probe
    copies: int = 0  # cycles that verified a copy (``lookup.py``) instead of a draft
    copied: int = 0  # ... and the copied tokens they accepted
    trees: int = 0  # cycles that verified a tree (``tree/``)
    nodes: int = 0  # ... the drafted nodes they verified
    tree_accepted: int = 0  # ... and the depth they accepted
    chain_why: Optional[str] = None  # why the latest drafted cycle verified a chain, not a tree

    def __post_init__(self):
        self.position_accepted = [0] * max(self.block_size - 1, 0)

    def record(self, block_size: int, accepted: int, fallback: bool = False, copy: bool = False,
               nodes: int = 0):
        self.cycles += 1
        self.trees += nodes > 0
        self.nodes += nodes
        self.tree_accepted += accepted if nodes else 0
        self.copies += copy
        self.copied += accepted if copy else 0
        self.block_sizes[block_size] += 1
        self.fallback = fallback
        self.accepted = accepted
        self.total_accepted += accepted
        for i in range(accepted):
            self.position_accepted[i] += 1

    @property
    def tau(self) -> float:
        """Mean acceptance length: accepted draft tokens + the target's bonus token."""
        return (self.total_accepted + self.cycles) / self.cycles if self.cycles else 0.0
