"""When the cycles are timed for the adaptive policy (``policy.timed``), in one place."""

import time
from typing import Optional


class Clock:
    """Times what a cycle's price should match, and nothing else:

    - a pipelined plain step (one that read the step before it): from the start of its loop
      iteration to the start of the next, what one step takes in the pipeline;
    - a copy's cycle, from its verify pass to what was accepted;
    - a drafted cycle that followed a drafted one: after plain steps or a copy the drafter
      first reads the rows they committed, work those steps put off, not this draft's."""

    def __init__(self, policy):
        self.policy = policy
        self.start = self.steady = None  # when this iteration (or cycle) began; a timed plain step
        self.drafted = False  # whether the latest cycle drafted

    def tick(self):
        """A loop iteration begins: a pipelined plain step before it took until now."""
        self.start = time.perf_counter()
        if self.steady is not None:
            self.policy.timed(1, self.start - self.steady)
            self.steady = None

    def plain(self, pipelined: bool):
        """This iteration is a plain step (``pipelined``: it reads the step before it)."""
        self.drafted = False
        if pipelined:
            self.steady = self.start

    def begin(self):
        """A cycle begins (its draft, or its copy)."""
        self.start = time.perf_counter()

    def end(self, b: int, copy: bool, tree: bool = False) -> Optional[float]:
        """The cycle of block ``b`` (``copy``: a copy's; ``tree``: one that verified a tree,
        whose time is not the block's price) has learned what was accepted; its time, where
        it is the cycle's own (None after plain steps or a copy)."""
        took = time.perf_counter() - self.start if copy or self.drafted else None
        if took is not None and not tree:
            self.policy.timed(b, took, copy)
        self.drafted = not copy
        return took
