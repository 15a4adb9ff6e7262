"""How many nodes a tree verifies (``--tree-budget auto``), from the machine's cost curve.

A tree of N nodes costs a verify pass over N + 1 rows; the chain of block b, one over b.
Where a wider pass costs (almost) no more than the chain's, its extra nodes are free tokens
of acceptance; where it costs more, the chain's acceptance would have to grow by as much, and
the drafter's lattice rarely gives that much.  So ``auto`` takes the largest tree whose pass
costs at most ``SLACK`` times the chain's, among sizes the calibration measured, and the chain
(N = b - 1) where none does: never slower than the chain for the same draft.
"""

from typing import Union

from . import MAX_BUDGET

SIZES = (8, 16, 32)  # the trees ``auto`` weighs beyond the chain (``adaptive.costs.TREE_ROWS``)
SLACK = 1.05


def check_budget(budget: Union[int, str, None]) -> Union[int, str]:
    """A tree budget as given (a number of nodes, or "auto"), or a clear error."""
    if budget is None or budget == "auto":
        return "auto"
    if isinstance(budget, str) and budget.isdigit():
        budget = int(budget)
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"tree budget {budget!r} is impossible: give a number of nodes from 1 to "
                         f"{MAX_BUDGET}, or 'auto'")
    return budget


def choose(costs, b: int, context: int) -> int:
    """Nodes for a tree as deep as a block of ``b``, priced by ``costs`` (``CostModel``)."""
    measured = max(costs.target)
    chain = costs.verify(b, context)
    nodes = b - 1
    for n in SIZES:
        if n > b - 1 and n + 1 <= measured and costs.verify(n + 1, context) <= SLACK * chain:
            nodes = n
    return nodes
