"""How a target verifies: one small verifier per way, composed for a target in one place.

    Chain         one pass over the block (the target's own call)
    RowExactPass  one pass whose every row is a one-row decode step's (``exact_pass.py``)
    OneRowSteps   the block as one-row decode steps
    TreePass      one pass over a tree's nodes (``tree/target_pass.py``)
    PathPass      a hybrid's chain as a tree of one path: its recurrent layers keep every
                  row's state, so a rollback takes the kept row's instead of a replay

Each verifier installs what it changes on the target's model and undoes what it changes
for one pass only; nothing else writes the target's fields.  What is installed stays: it
computes as the model's own outside a pass, and every target of the model shares it.  ``compose`` says how they
combine, innermost first:

1. The CPU split (``machine/cpu_split.py``) is under every pass over 2..MAX_ROWS rows, the
   row-exact pass's excepted (its products run row by row).  ``compose`` installs it.
2. A pipeline stage (``distributed/pipeline.py``) is the target's own call on each rank:
   every pass exchanges between ranks in one order, so it verifies chains only (no tree, no
   path) and refuses exact verify (the probe reads the model alone, not split).
3. Exact verify ("pass" or "steps", from the exactness verdict) replaces the chain's pass
   and takes no tree or path: a tree's rows are several rows of one pass.
4. Otherwise chains, trees where the caches let a tree run (``tree_fits``), and on a target
   whose rollback replays (a hybrid) a block as a path where it fits.

The batch (``batch/``) verifies chains only, through the target's own call: a request that
asks for exact verify decodes alone.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from ..machine import cpu_split
from ..tree import TreePass, path_tree
from . import exact_pass

EXACT_MODES = (None, "pass", "steps")


class Chain:
    """One pass over the block: the target's own call (on this CPU, split over two streams)."""
    name = "chain"

    def __init__(self, target):
        self.target = target

    def __call__(self, ids: mx.array, cache):
        return self.target(ids, cache)


class RowExactPass:
    """One pass over the block whose products and mixers run row by row: the target's
    products and mixers take their row-wise subclass (``exact_pass.install``, once per
    model; outside ``exact_pass.rows()`` they compute as before).  The exactness probe says
    whether that is one-row steps' bits on this machine."""
    name = "pass"

    def __init__(self, target):
        self.target = target
        exact_pass.install(target.model, target.layers)

    def __call__(self, ids: mx.array, cache):
        if ids.shape[1] == 1:  # one row is a one-row step already
            return self.target(ids, cache)
        with exact_pass.rows():
            return self.target(ids, cache, split=False)


class OneRowSteps:
    """The block as L one-row decode steps: the rows, cache entries and features are those
    mlx-lm's decoding computes."""
    name = "steps"

    def __init__(self, target):
        self.target = target

    def __call__(self, ids: mx.array, cache):
        if ids.shape[1] == 1:  # one row is a one-row step already
            return self.target(ids, cache)
        outs = [self.target(ids[:, i : i + 1], cache) for i in range(ids.shape[1])]
        return (mx.concatenate([o[0] for o in outs], axis=1),
                mx.concatenate([o[1] for o in outs], axis=1))


class PathPass:
    """A block verified as a tree of one path (a hybrid target's chain)."""
    name = "path"

    def __init__(self, tree: TreePass):
        self.tree = tree

    def __call__(self, block: mx.array, cache):
        return self.tree(path_tree(np.array(block)), cache)


@dataclass(frozen=True)
class Verifiers:
    """How one target verifies (``compose``): ``block`` verifies a chain's block [1, L] (and
    replays kept tokens), ``tree`` a tree, ``path`` a block as one path; ``refused`` says why
    trees and paths cannot run on this target at all."""
    exact: Optional[str]
    block: Callable
    tree: Optional[TreePass] = None
    path: Optional[PathPass] = None
    refused: Optional[str] = None

    @property
    def names(self) -> tuple:
        return (self.block.name,) + ((self.tree.name, self.path.name) if self.tree is not None else ())

    def tree_fits(self, cache: list, rows: int) -> Optional[str]:
        """None if a tree (or path) of ``rows`` can be verified on ``cache``, else why not."""
        return self.refused or self.tree.fits(cache, rows)


def check(model, exact: bool):
    """Raise ValueError for a combination the product refuses, before any probe runs."""
    if exact and getattr(model, "dflash_stage", None) is not None:  # ``distributed/pipeline.py``
        raise ValueError("exact verify on a target split into a pipeline: the exactness probe and the "
                         "row-exact pass read the whole model on one machine; verify without it "
                         "(exact=False, no --exact, dflash_exact false)")


def compose(target, exact: Optional[str] = None) -> Verifiers:
    """The target's verifiers, in the order the module docstring states (``exact``: how
    verify rows are made exact, None, "pass" or "steps"); kept on the target."""
    if exact not in EXACT_MODES:
        raise ValueError(f"exact verify is one of {EXACT_MODES}, not {exact!r}")
    check(target.model, bool(exact))
    cpu_split.install(target.model)
    if exact is not None:
        block = RowExactPass(target) if exact == "pass" else OneRowSteps(target)
        v = Verifiers(exact, block, refused="exact verify reads one row at a time (a chain)")
    elif target.stage is not None:
        v = Verifiers(None, Chain(target), refused="a pipeline target verifies chains")
    else:
        tree = TreePass(target)
        v = Verifiers(None, Chain(target), tree, PathPass(tree))
    target.verifiers = v
    return v
