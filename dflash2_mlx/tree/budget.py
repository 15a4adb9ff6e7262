"""How many nodes a tree verifies (``--tree-budget auto``): the machine's cost curve names
the candidates, the cycles' own tokens per second choose among them.

A tree of N nodes costs a verify pass over N + 1 rows; the chain of block b, one over b.
Where a wider pass costs (almost) no more than the chain's, its extra nodes are free tokens
of acceptance (``choose``: the largest tree whose pass costs at most ``SLACK`` times the
chain's, the prior).  Where it costs more, only the tokens it accepts can say whether it pays,
so ``Arms`` measures it: the chain and each tree priced within ``WORTH`` times the chain are
tried, then the one with the most tokens per second of its own cycles runs, and the others
are tried again now and then (acceptance drifts with the text).  A tree that does not pay
here runs only in those tries: never far below the chain.
"""

from typing import Dict, List

SIZES = (8, 16, 32)  # the trees ``auto`` weighs beyond the chain (``adaptive.costs.TREE_ROWS``)
SLACK = 1.05
WORTH = 1.4  # a tree priced above this many chains would need 40% more acceptance: not tried
TRIES = 1  # cycles each candidate runs before the choice
REVISIT = 64  # every this many cycles, the candidate least recently run runs once
DECAY = 0.8  # the weight of a candidate's earlier cycles (its tokens and seconds) at each new one


class Arms:
    """The live choice of a tree's nodes for drafted blocks of ``b`` (``b - 1``: the chain)."""

    def __init__(self, costs, b: int, context: int = 0):
        chain = costs.verify(b, context)
        measured = max(costs.target)
        self.candidates: List[int] = [b - 1] + [n for n in SIZES if n > b - 1 and n + 1 <= measured
                                                and costs.verify(n + 1, context) <= WORTH * chain]
        self.seen: Dict[int, list] = {n: [0.0, 0.0, 0] for n in self.candidates}  # tokens, seconds, cycles
        self.last: Dict[int, int] = {n: 0 for n in self.candidates}  # the cycle each last ran
        self.cycles = 0

    def choose(self) -> int:
        self.cycles += 1
        untried = [n for n in self.candidates if self.seen[n][2] < TRIES]
        if untried:
            return untried[0]
        if self.cycles % REVISIT == 0:
            return min(self.candidates, key=lambda n: self.last[n])
        return max(self.candidates, key=self.rate)

    def rate(self, n: int) -> float:
        tokens, seconds, _ = self.seen[n]
        return tokens / seconds if seconds else 0.0

    def record(self, n: int, tokens: int, seconds: float):
        """A cycle of ``n`` nodes emitted ``tokens`` in ``seconds`` (draft to accept)."""
        if n not in self.seen:
            return
        t, s, c = self.seen[n]
        self.seen[n] = [DECAY * t + tokens, DECAY * s + seconds, c + 1]
        self.last[n] = self.cycles


def choose(costs, b: int, context: int) -> int:
    """Nodes for a tree as deep as a block of ``b``, priced by ``costs`` (``CostModel``)."""
    measured = max(costs.target)
    chain = costs.verify(b, context)
    nodes = b - 1
    for n in SIZES:
        if n > b - 1 and n + 1 <= measured and costs.verify(n + 1, context) <= SLACK * chain:
            nodes = n
    return nodes
