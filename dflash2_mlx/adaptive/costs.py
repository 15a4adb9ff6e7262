"""The cost model: the seconds of a target pass over b rows and of a drafter step with block
b, each as ``base + slope * context``; measured once per (target, drafter, machine) by
``calibrate`` and kept on disk and in memory by ``cost_model``."""

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..machine.contention import BUSY_SHARE, Watch
from ..machine.identity import identity
from ..model.drafter import propose
from ..request.sampling import SamplingParams
from . import store

STALE_AFTER_S = 7 * 24 * 3600  # a cost model older than this is measured again
BUSY_RETRY_S = 120.0  # ... one measured while other processes used the machine, after this
CONTEXTS = (16, 1024)  # context lengths (tokens) the calibration measures at
PLAIN_RUN = 4  # pipelined plain steps timed together (one alone would pay the pipeline's fill)
CALIBRATION = 11  # bumped when calibrate() measures differently: older cost files are remeasured
# A block measured dearer than a larger one by more than this is measured again (REDO_ROUNDS
# rounds, interleaved with the larger ones); if it still is, it is a step of the machine's.
STEP = 1.25
REDO_ROUNDS = 4
# Rows a copy may verify when the block size is chosen ("auto"): a copy is not bound to the
# drafter's trained block, and a loop is accepted far; 15 is the widest verify the CPU split
# computes in two halves (cpu_split.MAX_ROWS).  Calibrated at COPY_ROWS, interpolated between.
COPY_LARGEST = 15
COPY_ROWS = (12, COPY_LARGEST)
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

Line = Tuple[float, float]  # (seconds at context 0, extra seconds per context token)


def interp(points: Dict[int, Line], b: int) -> Line:
    """Piecewise-linear interpolation of the measured lines over block sizes."""
    keys = sorted(points)
    if b <= keys[0] or b >= keys[-1]:
        return points[keys[0] if b <= keys[0] else keys[-1]]
    hi = next(k for k in keys if k >= b)
    lo = max(k for k in keys if k <= b)
    if hi == lo:
        return points[lo]
    w = (b - lo) / (hi - lo)
    return tuple((1 - w) * x + w * y for x, y in zip(points[lo], points[hi]))


@dataclass
class CostModel:
    """Seconds of the parts of a cycle: ``target[b]`` (a verify pass over b rows) and
    ``drafter[b]`` (feeding, drafting and proposing a block of b), as (base, per token)."""
    target: Dict[int, Line]
    drafter: Dict[int, Line]
    created: float = field(default_factory=time.time)
    calibration_s: float = 0.0
    busy: float = 0.0  # the share of the machine's cores other processes used while it was measured
    coarse: bool = False  # measured at a first use: a chain's and its copies' rows only (COARSE_ROUNDS)
    # Measured by this process at the pair's first use: the reply it was measured for ends
    # with the exactness probe (``generate.py``), so that the first token waits for the costs
    # only.  Not kept on disk.
    first_use: bool = field(default=False, compare=False, repr=False)

    def expired(self) -> bool:
        """Measure again: after a week, or soon when it was measured on a busy machine."""
        return time.time() - self.created > (BUSY_RETRY_S if self.busy > BUSY_SHARE else STALE_AFTER_S)

    def cycle(self, b: int, context: int) -> float:
        seconds = self.verify(b, context)
        return seconds + self.draft(b, context) if b > 1 else seconds

    def verify(self, b: int, context: int) -> float:
        base, slope = interp(self.target, b)
        return base + slope * context

    def draft(self, b: int, context: int) -> float:
        base, slope = interp(self.drafter, b)
        return base + slope * context

    def one_row_verify(self, largest: int = 40) -> "CostModel":
        """These costs with a verify pass over b rows priced as b one-row passes: what
        ``exact=True`` verifies with where passes are not row-exact (``loop/exactness.py``)."""
        base, slope = interp(self.target, 1)
        return CostModel({b: (b * base, b * slope) for b in range(1, largest + 1)}, self.drafter,
                         self.created, self.calibration_s, self.busy, self.coarse)

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("first_use")
        return out

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        lines = lambda d: {int(k): tuple(v) for k, v in d.items()}
        return cls(lines(data["target"]), lines(data["drafter"]), data["created"],
                   data.get("calibration_s", 0.0), data.get("busy", 0.0), bool(data.get("coarse", False)))


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


def _timed(fn) -> float:
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


def calibrate(target, drafter, budget_s: float = 3.0, rounds: Tuple[int, int] = (3, 8),
              sizes: Optional[List[int]] = None, redo: bool = True, coarse: bool = False) -> CostModel:
    """Measure target passes over every block up to 8 rows (and B, COPY_ROWS for copies
    wider than B, and TREE_ROWS for trees) and drafter steps with blocks 2 and B (and ``sizes``) at a short context,
    1 and B rows at a long one, and fit ``base + slope * context`` per block size (others
    are interpolated).  Every small block is measured because a verify pass's cost is far
    from linear in its rows: a middle block interpolated from its neighbours is priced
    below its cost, which sends adaptive decoding to blocks larger than pay.  Each point keeps
    its fastest of 3 to 8 rounds (more while ``budget_s`` lasts: one round overprices a
    multi-row pass against plain steps, which sends adaptive decoding to plain steps where
    drafting pays).  A block measured dearer than a larger one is measured again, interleaved
    with the larger ones: a burst of other work goes away there, and what is left within
    ``STEP`` is priced as the larger block (``steps_kept``); a step that holds (a GPU whose
    quantized matmul tiles from 8 rows: 8 rows cheaper than 5) is kept.  Without ``redo``
    nothing is measured again: the ranks of a split target calibrate together, pass for pass,
    and one rank's timings must not add passes the others do not run.  ``coarse``: a first
    use's (COARSE_ROUNDS; no tree rows, no widest pass, nothing measured again)."""
    from .. import tree as trees

    tic, watch = time.perf_counter(), Watch()
    B, mask = drafter.config.block_size, drafter.config.mask_token_id
    short, long = CONTEXTS
    caches = {}
    for n in CONTEXTS:
        cache = target.make_cache()
        _, features = target(mx.zeros((1, 1), dtype=mx.int32), cache)
        _pad(cache, n - 1)
        draft_cache = drafter.make_cache()
        drafter.append_context(features, draft_cache)
        _pad(draft_cache, n - 1)
        caches[n] = (cache, features, draft_cache)

    trees_of = {}  # (rows, context) -> the tree they are verified as, worked out once, untimed

    def target_pass(b, n):
        cache = caches[n][0]
        tree = trees_of.get((b, n))
        if b == 1:  # plain steps run pipelined (``loop/plain.py``): time a chain of them
            token = mx.zeros((1,), dtype=mx.int32)
            for _ in range(PLAIN_RUN):
                token = mx.argmax(target(token[None], cache)[0][0, -1:], axis=-1)
                mx.async_eval(token)
            mx.eval(token)
        elif tree is not None:
            mx.eval(trees.tree_pass(target, tree, cache))
            trees.compact(cache, b, list(range(b)))  # the recurrent layers leave the tree pass
        else:
            mx.eval(target(mx.zeros((1, b), dtype=mx.int32), cache))
        for c in cache:
            if c.is_trimmable():
                c.trim(PLAIN_RUN if b == 1 else b)

    def drafter_step(b, n):
        _, features, draft_cache = caches[n]
        drafter.append_context(features, draft_cache)
        hidden = drafter(mx.array([[0] + [mask] * (b - 1)]), draft_cache)
        mx.eval(propose(drafter, hidden, mx.array(0), SamplingParams())[0])
        for c in draft_cache:
            c.trim(1)

    sizes = sorted(set(sizes or []) | {2, B})
    rows = sorted(set(sizes) | set(range(2, min(B, 8) + 1)) | {r for r in COPY_ROWS if r > B}
                  | (set() if coarse else set(TREE_ROWS) | {LARGEST_ROWS}))
    if coarse:
        rounds, budget_s, redo = (COARSE_ROUNDS[0], COARSE_ROUNDS[0]), 0.0, False
    points = ([(target_pass, b, short) for b in [1] + rows]
              + [(target_pass, b, long) for b in {1, B, *(() if coarse else TREE_ROWS)}]
              + [(drafter_step, b, short) for b in sizes] + [(drafter_step, B, long)])
    for p in points:
        if p[0] is target_pass and p[1] > 1:
            trees_of[(p[1], p[2])] = shaped(target, caches[p[2]][0], p[1], B - 1)
    target_pass(2, short)  # warm-up: one pass is enough (a plain chain is four)
    best = {p: float("inf") for p in points}

    def measure(ps, n_rounds):
        for _ in range(n_rounds):
            for p in ps:
                per = PLAIN_RUN if p[0] is target_pass and p[1] == 1 else 1
                best[p] = min(best[p], _timed(lambda: p[0](p[1], p[2])) / per)

    for r in range(rounds[1]):
        start = time.perf_counter()
        measure([p for p in points if not (coarse and r >= COARSE_ROUNDS[1] and p[2] == long)], 1)
        now = time.perf_counter()
        if r + 1 >= rounds[0] and now + (now - start) - tic > budget_s:
            break
    curve = lambda: {p[1]: best[p] for p in best if p[0] is target_pass and p[2] == short}
    gaps = uneven_gaps(curve()) if redo else []
    for _ in range(REFINE_ROUNDS):
        if not gaps:
            break
        middles = [(target_pass, (lo + hi) // 2, short) for lo, hi in gaps]
        trees_of.update({(p[1], short): shaped(target, caches[short][0], p[1], B - 1) for p in middles})
        best.update({p: float("inf") for p in middles})
        measure(middles, rounds[0])
        rows = sorted(set(rows) | {p[1] for p in middles})
        gaps = stepped_halves(curve(), gaps)
    for step, n in {(p[0], p[2]) for p in points}:
        mine = {p[1]: p for p in best if p[0] is step and p[2] == n}
        inverted = [b for b in mine if any(best[mine[b2]] * STEP < best[mine[b]] for b2 in mine if b2 > b)]
        again = [mine[b2] for b2 in mine if inverted and b2 >= min(inverted)]
        for _ in range(REDO_ROUNDS if inverted and redo else 0):
            for p in again:
                per = PLAIN_RUN if p[0] is target_pass and p[1] == 1 else 1
                best[p] = min(best[p], _timed(lambda: p[0](p[1], p[2])) / per)
        kept = steps_kept({b: best[p] for b, p in mine.items()})
        for b, p in mine.items():
            best[p] = kept[b]

    def lines(step, blocks):
        slopes = {b: (max(0.0, (best[(step, b, long)] - best[(step, b, short)]) / (long - short)), 0.0)
                  for b in blocks if (step, b, long) in best}
        out = {}
        for b in blocks:
            slope = interp(slopes, b)[0]
            out[b] = (best[(step, b, short)] - slope * short, slope)
        return out

    return CostModel(lines(target_pass, [1] + rows), lines(drafter_step, sizes),
                     calibration_s=time.perf_counter() - tic, busy=watch.others(), coarse=coarse)


def shaped(target, cache, rows: int, depth: int):
    """The tree the loop verifies ``rows`` rows as, where it is one (else None, a plain
    pass): a tree's rows (TREE_ROWS) as a tree at most ``depth`` deep, a hybrid's chain as
    a tree of one path (``loop/cycle.py``: its recurrent layers then keep every row's state).
    A hybrid's such passes cost more than a plain one over as many rows (the recurrence runs
    a depth at a time): priced as plain passes they would draw the policy to them."""
    from .. import tree as trees

    if trees.fits(target, cache, rows) is not None:
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


def shapes(module) -> list:
    return sorted((k, v.dtype.__repr__(), v.shape) for k, v in tree_flatten(module.parameters()))


def cost_key(target, drafter) -> str:
    """Model identity (architecture, shapes and dtypes of every weight), machine."""
    return store.digest({"calibration": CALIBRATION, "target": shapes(target.model), "drafter": shapes(drafter),
                         "drafter_activations": str(drafter.activation_dtype),
                         "machine": identity()})


cost_models: Dict[str, CostModel] = {}  # this process's, by ``cost_key``


def cost_model(target, drafter, key: Optional[str] = None, whole: bool = False) -> CostModel:
    """The pair's cost model on this machine: from memory, else from disk when fresh,
    else calibrated now (and saved): a first use's coarse one, or with ``whole`` (a tree's
    rows, an exported cost file) the whole curve.  ``key``: the pair's ``cost_key``, when the
    caller has it."""
    key = key or cost_key(target, drafter)
    costs = cost_models.get(key)
    if costs is None or costs.expired() or (whole and costs.coarse):
        path = store.cache_dir() / f"costs-{key}.json"
        data = store.read(path)
        try:
            costs = CostModel.from_json(data)
        except (TypeError, KeyError, ValueError, AttributeError):
            costs = None
        if costs is None or costs.expired() or (whole and costs.coarse):
            costs = measured(target, drafter, path, coarse=not whole)
        cost_models[key] = costs
    return costs


def measured(target, drafter, path, coarse: bool = False) -> CostModel:
    """A fresh calibration (a first use's ``coarse`` one, or the whole curve), kept at
    ``path``.  One taken while other processes used the machine is taken again at once; if
    the machine is still busy the quieter one is used by this process for BUSY_RETRY_S and
    not kept: a busy machine's prices would send adaptive decoding to plain steps (or trees
    to chains) for days."""
    # Said, not silent: the first request on a machine waits for it (seconds).
    what = ("timing this pair's passes on this machine (once" if coarse else
            "timing this pair's tree and widest passes on this machine (once, at a first tree")
    print(f"dflash2-mlx: first use: {what}; `dflash2-mlx doctor --recalibrate` measures again) ...", end=" ",
          file=sys.stderr, flush=True)
    tic = time.perf_counter()
    costs = calibrate(target, drafter, coarse=coarse)
    if costs.busy > BUSY_SHARE:
        again = calibrate(target, drafter, coarse=coarse)
        costs = min(costs, again, key=lambda c: c.busy)
    if costs.busy > BUSY_SHARE:
        print(f"done in {time.perf_counter() - tic:.0f} s, but other processes used {costs.busy:.0%} of this "
              f"machine's cores meanwhile: these costs serve for {BUSY_RETRY_S:.0f} s, then are measured again",
              file=sys.stderr, flush=True)
        return costs
    store.write(path, costs.to_json())
    costs.first_use = coarse
    print(f"done in {time.perf_counter() - tic:.0f} s", file=sys.stderr, flush=True)
    return costs


def pair_digest(target, drafter) -> str:
    """The pair a cost model prices (every weight's shape and dtype), whatever the machine."""
    return store.digest({"target": shapes(target.model), "drafter": shapes(drafter),
                         "drafter_activations": str(drafter.activation_dtype)})


def export_costs(target, drafter, path) -> CostModel:
    """This machine's cost model of the pair (measured now if it has none) written to
    ``path``, with the pair it prices and the machine it was measured on: a file another
    machine can load with ``load_costs`` (``--cost-file``) to decide as this one would."""
    from ..machine.identity import describe

    costs = cost_model(target, drafter, whole=True)
    store.write(Path(path), {**costs.to_json(), "pair": pair_digest(target, drafter),
                             "machine": describe()})
    return costs


def load_costs(path, target, drafter) -> CostModel:
    """A cost file written by ``export_costs``; a clear error for a file that is not one, or
    that prices another pair."""
    try:
        data = json.loads(Path(path).read_text())
        costs = CostModel.from_json(data)
    except FileNotFoundError:
        raise ValueError(f"cost file {path} does not exist") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"cost file {path} is not a dflash2-mlx cost file "
                         f"(write one with `dflash2-mlx doctor --export-costs FILE`): {e}") from None
    if data.get("pair") != pair_digest(target, drafter):
        raise ValueError(f"cost file {path} was measured for another target and drafter "
                         f"(on {(data.get('machine') or {}).get('platform', 'an unknown machine')}): its passes price other "
                         "shapes; export one for this pair")
    costs.created = time.time()  # given, not measured: never stale in this process
    return costs
