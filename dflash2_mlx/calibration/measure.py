"""Measuring a pair's pass costs on this machine (``calibrate``): set up caches at two
contexts, time every point a few rounds, measure again the middles of gaps the curve may
step in (``refine``) and the blocks measured dearer than larger ones (``redo_inverted``),
then fit ``base + slope * context`` per block (``fit``)."""

import time
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .. import tree as trees
from ..adaptive.costs import COPY_ROWS, CostModel, interp
from ..machine.contention import Watch
from ..model.drafter import propose
from ..request.sampling import SamplingParams

CONTEXTS = (16, 1024)  # context lengths (tokens) the calibration measures at
PLAIN_RUN = 4  # pipelined plain steps timed together (one alone would pay the pipeline's fill)
# A block measured dearer than a larger one by more than this is measured again (REDO_ROUNDS
# rounds, interleaved with the larger ones); if it still is, it is a step of the machine's.
STEP = 1.25
REDO_ROUNDS = 4
# Rows of the trees ``--tree-budget auto`` weighs (8, 16 and 32 nodes and the anchor): a
# curve may step between them (a GPU's matmul tiles), so each is measured, not extrapolated.
TREE_ROWS = (9, 17, 33)
# A pair's first use measures only what a chain's cycles and its copies price (every row
# count up to the drafter's block and the widest copy, each the fastest of COARSE_ROUNDS):
# the first reply waits seconds, not the minute a whole curve takes.  The whole curve (tree
# rows, the widest passes, refinements, more rounds) is measured when a tree first needs it.
# The short context's points take one round more than the long one's: a chain's price at a
# short context is what sends a reply to blocks or to plain steps, and two rounds of it now
# and then left every multi-row pass a third dearer than it is.
COARSE_ROUNDS = (3, 2)  # (at the short context, at the long one)
LARGEST_ROWS = 40  # the widest pass calibrated; wider ones are priced as it
# Where the curve between two measured row counts is not a straight line (the middle row
# count costs more than LINEAR off the line through them), the middle is measured and both
# halves looked at again, up to REFINE_ROUNDS times: steps (a GPU's tiles, the CPU's split)
# are found where they are, not assumed at the rows measured.
LINEAR = 0.1
REFINE_ROUNDS = 4

Point = Tuple[str, int, int]  # ("target" or "drafter", rows, context)


def _pad(cache, n: int):
    """Grow every attention cache by ``n`` zero rows: attention then costs what it costs
    at that context, without a prefill (recurrent caches do not grow)."""
    for c in cache:
        keys = getattr(c, "keys", None)
        if isinstance(keys, mx.array) and keys.ndim == 4:
            shape = (keys.shape[0], keys.shape[1], n, keys.shape[3])
            c.update_and_fetch(mx.zeros(shape, keys.dtype), mx.zeros(shape[:3] + c.values.shape[3:],
                                                                     c.values.dtype))
    mx.eval([c.state for c in cache])


class Passes:
    """The passes a calibration times, on caches padded to each of CONTEXTS, and the
    fastest time of each point so far (``best``)."""

    def __init__(self, target, drafter):
        self.target, self.drafter = target, drafter
        self.B, self.mask = drafter.config.block_size, drafter.config.mask_token_id
        self.caches = {}
        for n in CONTEXTS:
            cache = target.make_cache()
            _, features = target(mx.zeros((1, 1), dtype=mx.int32), cache)
            _pad(cache, n - 1)
            draft_cache = drafter.make_cache()
            drafter.append_context(features, draft_cache)
            _pad(draft_cache, n - 1)
            self.caches[n] = (cache, features, draft_cache)
        self.trees = {}  # (rows, context) -> the tree they are verified as, worked out once, untimed
        self.best: Dict[Point, float] = {}

    def add(self, points: List[Point]):
        for kind, b, n in points:
            if kind == "target" and b > 1 and (b, n) not in self.trees:
                self.trees[(b, n)] = shaped(self.target, self.caches[n][0], b, self.B - 1)
            self.best.setdefault((kind, b, n), float("inf"))

    def time(self, points: List[Point], rounds: int = 1):
        """Time each point ``rounds`` times, interleaved; each keeps its fastest."""
        for _ in range(rounds):
            for p in points:
                run = self.target_pass if p[0] == "target" else self.drafter_step
                per = PLAIN_RUN if p[0] == "target" and p[1] == 1 else 1
                tic = time.perf_counter()
                run(p[1], p[2])
                self.best[p] = min(self.best[p], (time.perf_counter() - tic) / per)

    def target_pass(self, b: int, n: int):
        cache, tree = self.caches[n][0], self.trees.get((b, n))
        if b == 1:  # plain steps run pipelined (``loop/plain.py``): time a chain of them
            token = mx.zeros((1,), dtype=mx.int32)
            for _ in range(PLAIN_RUN):
                token = mx.argmax(self.target(token[None], cache)[0][0, -1:], axis=-1)
                mx.async_eval(token)
            mx.eval(token)
        elif tree is not None:
            mx.eval(self.target.verifiers.tree(tree, cache))
            trees.compact(cache, b, list(range(b)))  # the recurrent layers leave the tree pass
        else:
            mx.eval(self.target(mx.zeros((1, b), dtype=mx.int32), cache))
        for c in cache:
            if c.is_trimmable():
                c.trim(PLAIN_RUN if b == 1 else b)

    def drafter_step(self, b: int, n: int):
        _, features, draft_cache = self.caches[n]
        self.drafter.append_context(features, draft_cache)
        hidden = self.drafter(mx.array([[0] + [self.mask] * (b - 1)]), draft_cache)
        mx.eval(propose(self.drafter, hidden, mx.array(0), SamplingParams())[0])
        for c in draft_cache:
            c.trim(1)

    def curve(self, kind: str = "target", n: int = CONTEXTS[0]) -> Dict[int, float]:
        return {p[1]: t for p, t in self.best.items() if p[0] == kind and p[2] == n}


def calibrate(target, drafter, budget_s: float = 3.0, rounds: Tuple[int, int] = (3, 8),
              sizes: Optional[List[int]] = None, redo: bool = True, coarse: bool = False) -> CostModel:
    """Measure target passes over every block up to 8 rows (and B, COPY_ROWS for copies
    wider than B, and TREE_ROWS for trees) and drafter steps with blocks 2 and B (and
    ``sizes``) at a short context, 1 and B rows at a long one, and fit ``base + slope *
    context`` per block size (others are interpolated).  Every small block is measured
    because a verify pass's cost is far from linear in its rows: a middle block interpolated
    from its neighbours is priced below its cost, which sends adaptive decoding to blocks
    larger than pay.  Each point keeps its fastest of 3 to 8 rounds (more while ``budget_s``
    lasts: one round overprices a multi-row pass against plain steps, which sends adaptive
    decoding to plain steps where drafting pays).  Without ``redo`` nothing is measured
    again: the ranks of a split target calibrate together, pass for pass, and one rank's
    timings must not add passes the others do not run.  ``coarse``: a first use's
    (COARSE_ROUNDS; no tree rows, no widest pass, nothing measured again)."""
    tic, watch = time.perf_counter(), Watch()
    passes = Passes(target, drafter)
    sizes = sorted(set(sizes or []) | {2, passes.B})
    rows, points = plan_points(passes.B, sizes, coarse)
    if coarse:
        rounds, budget_s, redo = (COARSE_ROUNDS[0], COARSE_ROUNDS[0]), 0.0, False
    passes.add(points)
    passes.target_pass(2, CONTEXTS[0])  # warm-up: one pass is enough (a plain chain is four)
    first_rounds(passes, points, rounds, budget_s, coarse, tic)
    if redo:
        rows = refine(passes, rows, rounds[0])
    redo_inverted(passes, REDO_ROUNDS if redo else 0)
    return CostModel(fit(passes.best, "target", [1] + rows), fit(passes.best, "drafter", sizes),
                     calibration_s=time.perf_counter() - tic, busy=watch.others(), coarse=coarse)


def plan_points(B: int, sizes: List[int], coarse: bool) -> Tuple[List[int], List[Point]]:
    """The multi-row target passes and every point a calibration times, in the order timed."""
    short, long = CONTEXTS
    rows = sorted(set(sizes) | set(range(2, min(B, 8) + 1)) | {r for r in COPY_ROWS if r > B}
                  | (set() if coarse else set(TREE_ROWS) | {LARGEST_ROWS}))
    points = ([("target", b, short) for b in [1] + rows]
              + [("target", b, long) for b in {1, B, *(() if coarse else TREE_ROWS)}]
              + [("drafter", b, short) for b in sizes] + [("drafter", B, long)])
    return rows, points


def first_rounds(passes: Passes, points: List[Point], rounds: Tuple[int, int], budget_s: float,
                 coarse: bool, tic: float):
    """``rounds[0]`` rounds of every point, more up to ``rounds[1]`` while ``budget_s`` lasts
    (a first use's long-context points: COARSE_ROUNDS[1])."""
    for r in range(rounds[1]):
        start = time.perf_counter()
        passes.time([p for p in points if not (coarse and r >= COARSE_ROUNDS[1] and p[2] == CONTEXTS[1])])
        now = time.perf_counter()
        if r + 1 >= rounds[0] and now + (now - start) - tic > budget_s:
            break


def refine(passes: Passes, rows: List[int], rounds: int) -> List[int]:
    """Measure the middles of the gaps in the short context's curve where it may step (up to
    REFINE_ROUNDS times); the multi-row passes now measured."""
    gaps = uneven_gaps(passes.curve())
    for _ in range(REFINE_ROUNDS):
        if not gaps:
            break
        middles = [("target", (lo + hi) // 2, CONTEXTS[0]) for lo, hi in gaps]
        passes.add(middles)
        passes.time(middles, rounds)
        rows = sorted(set(rows) | {p[1] for p in middles})
        gaps = stepped_halves(passes.curve(), gaps)
    return rows


def redo_inverted(passes: Passes, redo_rounds: int):
    """A block measured dearer than a larger one is measured again, interleaved with the
    larger ones: a burst of other work goes away there, and what is left within ``STEP`` is
    priced as the larger block (``steps_kept``); a step that holds (a GPU whose quantized
    matmul tiles from 8 rows: 8 rows cheaper than 5) is kept."""
    best = passes.best
    for kind, n in sorted({(p[0], p[2]) for p in best}):
        mine = {p[1]: p for p in best if p[0] == kind and p[2] == n}
        inverted = [b for b in mine if any(best[mine[b2]] * STEP < best[mine[b]] for b2 in mine if b2 > b)]
        again = [mine[b2] for b2 in mine if inverted and b2 >= min(inverted)]
        if inverted:
            passes.time(again, redo_rounds)
        kept = steps_kept({b: best[p] for b, p in mine.items()})
        for b, p in mine.items():
            best[p] = kept[b]


def fit(best: Dict[Point, float], kind: str, blocks: List[int]) -> dict:
    """``base + slope * context`` per block: slopes where the long context was measured,
    interpolated between them."""
    short, long = CONTEXTS
    slopes = {b: (max(0.0, (best[(kind, b, long)] - best[(kind, b, short)]) / (long - short)), 0.0)
              for b in blocks if (kind, b, long) in best}
    out = {}
    for b in blocks:
        slope = interp(slopes, b)[0]
        out[b] = (best[(kind, b, short)] - slope * short, slope)
    return out


def shaped(target, cache, rows: int, depth: int):
    """The tree the loop verifies ``rows`` rows as, where it is one (else None, a plain
    pass): a tree's rows (TREE_ROWS) as a tree at most ``depth`` deep, a hybrid's chain as
    a tree of one path (``loop/cycle.py``: its recurrent layers then keep every row's state).
    A hybrid's such passes cost more than a plain one over as many rows (the recurrence runs
    a depth at a time): priced as plain passes they would draw the policy to them."""
    if target.verifiers.tree_fits(cache, rows) is not None:
        return None
    if rows in TREE_ROWS:  # depths 1..depth, over and over: a few deep paths and siblings
        depths = [0] + [(i - 1) % depth + 1 for i in range(1, rows)]
        last = {0: 0}
        parents = [-1]
        for i, d in enumerate(depths[1:], 1):
            parents.append(last[d - 1])
            last[d] = i
        return trees.Tree(np.zeros(rows, np.int64), np.array(parents), np.array(depths))
    if target.needs_replay(cache):
        return trees.path_tree(np.zeros(rows, np.int64))
    return None


def uneven_gaps(curve: Dict[int, float]) -> List[Tuple[int, int]]:
    """Neighbouring row counts of ``curve`` with rows between them whose costs differ by
    more than LINEAR (either way): the curve may step somewhere in there."""
    keys = sorted(curve)
    return [(lo, hi) for lo, hi in zip(keys, keys[1:])
            if hi - lo > 1 and abs(curve[hi] - curve[lo]) > LINEAR * min(curve[hi], curve[lo])]


def stepped_halves(curve: Dict[int, float], gaps: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """After each gap's middle was measured: the halves of the gaps whose middle lies off the
    straight line through its ends by more than LINEAR (a step is in one of them); a middle
    on the line says the gap rises evenly, and it is left."""
    out = []
    for lo, hi in gaps:
        m = (lo + hi) // 2
        line = curve[lo] + (curve[hi] - curve[lo]) * (m - lo) / (hi - lo)
        if abs(curve[m] - line) > LINEAR * line:
            out += [(a, b) for a, b in ((lo, m), (m, hi)) if b - a > 1]
    return out


def steps_kept(costs: Dict[int, float]) -> Dict[int, float]:
    """Costs by block size, each block priced at most as the cheapest larger one where it is
    dearer by less than ``STEP`` (measurement noise on a curve that rises); a block dearer by
    more is a step of the machine's own (kept: pricing 5 rows as 8 on a GPU that tiles from 8
    would send the policy to blocks that do not pay)."""
    out = dict(costs)
    for b in sorted(costs, reverse=True):
        larger = [out[b2] for b2 in costs if b2 > b]
        if larger and min(larger) < out[b] <= STEP * min(larger):
            out[b] = min(larger)
    return out
