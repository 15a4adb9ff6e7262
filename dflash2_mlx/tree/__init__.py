"""Tree verification: many drafted paths that share prefixes, verified in one target pass.

    grow.py         ``Tree`` and ``grow``: the walk's path, then the likeliest other paths
                    through the drafter's lattice, best first, up to a budget of nodes
    target_pass.py  ``TreePass``, the tree verifier: one target pass over the tree (ancestor
                    mask, positions by depth), ``fits`` where a tree can run; and the caches
                    compacted to the accepted path
    recurrent.py    hybrids' recurrent layers in a tree pass: each node from its parent's
                    state, every node's state kept
    budget.py       ``auto``: the candidates the cost curve names, chosen among by the cycles'
                    own tokens per second (``Arms``)
    accept.py       the lattice of a drafter pass; exact acceptance (greedy, or sampled from
                    the target's own distribution node by node)

The cycle that uses them is ``loop/cycle.py``'s ``tree_cycle``.
"""

from ..request.plan import MAX_BUDGET, check_budget
from .accept import accept, lattice  # noqa: E402
from .budget import Arms, choose  # noqa: E402
from .grow import GREEDY_TEMPERATURE, Tree, grow, path_tree  # noqa: E402
from .target_pass import TreePass, compact  # noqa: E402

__all__ = ["GREEDY_TEMPERATURE", "MAX_BUDGET", "Arms", "Tree", "TreePass", "accept", "check_budget", "choose", "compact",
           "grow", "lattice", "path_tree"]
