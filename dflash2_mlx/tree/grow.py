"""Growing a draft tree from one drafter pass.

The lattice: block position t (1..D) has k candidates (by descending drafter logit) and a
score row per predecessor, ``scores[t - 1, a, :]`` (DFlash 2's selector: a is a candidate
of position t - 1, or the anchor at position 1; DFlash 1: the drafter's own logits, the
same row for every predecessor).  A node is a path from the anchor through the lattice; its
children are its position's next candidates, each as likely as the softmax of its score
row says.  The tree holds the walk's own path first (the greedy walk: a tree never accepts
less than the chain of the same depth at temperature 0), then the most likely other paths,
best first, until it holds ``budget`` nodes.
"""

import heapq
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

# Greedy trees rank paths by softmax(scores / GREEDY_TEMPERATURE): the selector's rows are
# sharper than how often the target follows them, and softer rows spend the budget on the
# siblings the target picks (scripts/experiments/tree_rules.py and docs/tree.md say by how much).
GREEDY_TEMPERATURE = 1.5


@dataclass
class Tree:
    """Nodes in the order the verify pass reads them, node 0 the anchor; every node after
    its parent.  ``tokens`` [n], ``parents`` [n] (-1 for the anchor), ``depths`` [n].
    ``drawn``: nodes 1..drawn are a path drawn from the drafter's rows (node i the child of
    node i - 1), which acceptance judges with those rows; 0 for a greedy tree."""
    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    drawn: int = 0
    derived: dict = field(default_factory=dict, repr=False, compare=False)  # what every layer of a pass reads

    @property
    def size(self) -> int:
        """Nodes besides the anchor (the drafts the pass verifies)."""
        return self.tokens.size - 1

    def children(self) -> List[dict]:
        """Per node: {token: child node}."""
        out = [{} for _ in range(self.tokens.size)]
        for i in range(1, self.tokens.size):
            out[self.parents[i]][int(self.tokens[i])] = i
        return out

    def ancestors(self) -> np.ndarray:
        """[n, n] bool: node j is node i or one of its ancestors (what row i may attend to)."""
        n = self.tokens.size
        mask = np.eye(n, dtype=bool)
        for i in range(1, n):
            mask[i] |= mask[self.parents[i]]
        return mask

    def path_to(self, node: int) -> List[int]:
        """The nodes from the anchor to ``node``."""
        path = [node]
        while self.parents[path[-1]] >= 0:
            path.append(int(self.parents[path[-1]]))
        return path[::-1]


def path_tree(tokens: np.ndarray) -> Tree:
    """A block [anchor, d1 .. d_{b-1}] as a tree of one path (a chain's verify through a tree
    pass: a hybrid's recurrent layers then keep every row's state)."""
    n = tokens.size
    return Tree(np.asarray(tokens, dtype=np.int64), np.arange(n, dtype=np.int64) - 1, np.arange(n, dtype=np.int64))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.where(np.isnan(x), -np.inf, x.astype(np.float64))
    top = np.max(x, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return x - top - np.log(np.sum(np.exp(x - top), axis=-1, keepdims=True))


def grow(anchor: int, cand: np.ndarray, scores: np.ndarray, budget: int, temperature: float = 1.0,
         drawn: Optional[np.ndarray] = None) -> Tree:
    """The tree of ``budget`` nodes (at most depth D) over the lattice ``cand`` [D, k] (token
    ids) and ``scores`` [D, k, k] (row a of position 1 is the anchor's, for every a).  Paths are
    ranked by their probability under softmax(scores / temperature).  ``drawn``: the tokens
    the walk drew (sampling), the tree's first path instead of the argmax walk's."""
    D, k = cand.shape
    logp = log_softmax(scores / max(temperature, 1e-6))  # [D, k, k]
    # nodes: (candidate index, lattice position); the anchor is (0, -1)
    tokens, parents, depths, index = [anchor], [-1], [0], [0]
    total = [0.0]

    def add(parent: int, c: int, lp: float) -> int:
        tokens.append(int(cand[depths[parent], c]))
        parents.append(parent)
        depths.append(depths[parent] + 1)
        index.append(c)
        total.append(lp)
        return len(tokens) - 1

    def row(node: int) -> np.ndarray:  # log-probs of the node's children
        return logp[depths[node], index[node]]

    # The walk's path: the argmax child at each depth (ties to the lowest candidate index),
    # or the path it drew.
    node = 0
    while len(tokens) <= budget and depths[node] < (D if drawn is None else min(D, drawn.size)):
        r = row(node)
        c = int(np.argmax(r)) if drawn is None else lattice_index(cand, scores, depths[node], int(drawn[depths[node]]))
        node = add(node, c, total[node] + r[c])
        if drawn is not None:
            tokens[-1] = int(drawn[depths[node] - 1])
    first = len(tokens) - 1
    # Then best first: the frontier is every child not yet in the tree.
    taken = {(parents[i], tokens[i]) for i in range(1, len(tokens))}
    frontier = []

    def offer(node: int):
        if depths[node] >= D:
            return
        r = row(node)
        for c in range(k):
            if (node, int(cand[depths[node], c])) not in taken and np.isfinite(r[c]):
                heapq.heappush(frontier, (-(total[node] + r[c]), node, c))

    for i in range(len(tokens)):
        offer(i)
    while len(tokens) <= budget and frontier:
        neg, parent, c = heapq.heappop(frontier)
        offer(add(parent, c, -neg))
    return Tree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64),
                np.array(depths, dtype=np.int64), first if drawn is not None else 0)


def lattice_index(cand: np.ndarray, scores: np.ndarray, t: int, token: int) -> int:
    """The candidate of position t + 1 that is ``token``.  A token outside the lattice (a
    DFlash 1 drafter samples the whole vocabulary) takes candidate 0's row, which is every
    candidate's there; a selector's walk only draws candidates."""
    hit = np.flatnonzero(cand[t] == token)
    if hit.size:
        return int(hit[0])
    if not np.array_equal(scores[t + 1:t + 2].min(axis=1), scores[t + 1:t + 2].max(axis=1)):
        raise ValueError(f"drawn token {token} is not a candidate of block position {t + 1}")
    return 0
