"""Adaptive speculation: each cycle, the block size that maximizes expected tokens per second.

- ``CostModel``: the seconds of a target pass over b rows and of a drafter step with block
  b, each as ``base + slope * context``; measured once per (target, drafter, machine) by
  ``calibrate`` (about three seconds) and cached on disk by ``cost_model``.
- ``Acceptance``: per-position conditional acceptance rates of the request at hand,
  decayed so they follow it, seeded from this pair's history on this machine.
- ``best_block``: argmax over b in 1..largest of E[tokens | b] / cost(b, context); b = 1
  is a plain decode step (no drafter pass).
- ``Timing``: what the loop's cycles really took against what the cost model priced
  them at, per kind of cycle and block size; the policy prices through it (``Corrected``),
  so a calibration that landed badly on a busy machine is corrected as the loop runs.
- ``Adaptive``: the per-request state the cycle asks for a block size and tells what was
  accepted; after falling back to plain decoding it probes the drafter now and then, and
  every few plain steps runs a shadow probe (the drafter's guess for the token the plain
  step makes, never verified) so its estimate keeps up with a drafter that recovers.
  Where a copy is on offer (``lookup.py``) it weighs verifying the copy (its own
  acceptance, a target pass without a drafter pass) against drafting and plain steps.

The choice depends only on the past, so every cycle stays lossless whatever it picks.
"""

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from ..machine.identity import identity

AUTO = "auto"
STALE_AFTER_S = 7 * 24 * 3600  # a cost model older than this is measured again
CONTEXTS = (16, 1024)  # context lengths (tokens) the calibration measures at
PRIOR_RATE = 0.5  # acceptance assumed for a pair never seen on this machine
# ... and for a request's copies: where the last tokens repeat, the built-in target's greedy
# responses continued the copy 2.9 of 4 tokens deep (scripts/copies_offline.py), 0.82 a position
COPY_PRIOR_RATE = 0.8
PRIOR_WEIGHT = 2.0  # pseudo-cycles behind each prior rate
SAMPLED_PRIOR_WEIGHT = 8.0  # ... for a sampled request without history: its first few cycles
# are accepted or not by chance, and a plain-decoding request learns only from rare probes
SEED_WEIGHT = 4.0  # cycles a pair's history on this machine counts for at a request's start
DECAY = 0.95  # evidence kept per drafted cycle
PROBE_FIRST, PROBE_MAX = 16, 64  # plain steps before the first probe and, backing off, at most
PROBE_BUDGET = 0.015  # a failed probe's extra cost, spread over the wait, is at most this share
SHADOW_BUDGET = 0.03  # shadow probes' drafter passes cost at most this share of the plain steps
PLAIN_RUN = 4  # pipelined plain steps timed together (one alone would pay the pipeline's fill)
CALIBRATION = 5  # bumped when calibrate() measures differently: older cost files are remeasured
# Rows a copy may verify when the block size is chosen ("auto"): a copy is not bound to the
# drafter's trained block, and a loop is accepted far; 15 is the widest verify the CPU split
# computes in two halves (cpu_split.MAX_ROWS).  Calibrated at COPY_ROWS, interpolated between.
COPY_LARGEST = 15
COPY_ROWS = (12, COPY_LARGEST)
# Timing: each observed cycle counts against its prediction; an unseen block size falls back
# on its kind's correction, an unseen kind on the calibration (worth TIMING_PRIOR cycles).
TIMING_PRIOR = 3.0
TIMING_DECAY = 0.9  # evidence kept per cycle of the same key: follows the machine's load
TIMING_CLIP = 3.0  # one cycle counts as at most this many times its prediction (a stall)
TIMING_FORMAT = 2  # bumped when the loop times cycles differently: older timing files are dropped


# --- the cost model -------------------------------------------------------------------

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

    def cycle(self, b: int, context: int) -> float:
        seconds = self.verify(b, context)
        return seconds + self.draft(b, context) if b > 1 else seconds

    def verify(self, b: int, context: int) -> float:
        base, slope = interp(self.target, b)
        return base + slope * context

    def draft(self, b: int, context: int) -> float:
        base, slope = interp(self.drafter, b)
        return base + slope * context

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        lines = lambda d: {int(k): tuple(v) for k, v in d.items()}
        return cls(lines(data["target"]), lines(data["drafter"]), data["created"],
                   data.get("calibration_s", 0.0))


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
              sizes: Optional[List[int]] = None) -> CostModel:
    """Measure target passes over every block up to 8 rows (and B, and COPY_ROWS for copies
    wider than B) and drafter steps with
    blocks 2 and B (and ``sizes``) at a short context, 1 and B rows at a long one, and fit
    ``base + slope * context`` per block size (others are interpolated).  Every small block
    is measured because a verify pass's cost is far from linear in its rows (a 2-core CPU:
    1 / 2 / 4 / 8 rows 42 / 51 / 65 / 70 ms; interpolating 4 from 2 and 8 gives 58, which
    sends adaptive decoding to blocks larger than pay).  Each
    point keeps its fastest of 3 to 8 rounds (more while ``budget_s`` lasts: one round
    overprices a multi-row pass against plain steps by 10-25% on a 2-core CPU, which sends
    adaptive decoding to plain steps where drafting pays), and a block never costs less
    than a smaller one: a burst of other work on the machine cannot make a large block
    look cheap."""
    from ..model.drafter import propose
    from ..loop.sampling import SamplingParams

    tic = time.perf_counter()
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

    def target_pass(b, n):
        cache = caches[n][0]
        if b == 1:  # plain steps run pipelined (speculative.py): time a chain of them
            token = mx.zeros((1,), dtype=mx.int32)
            for _ in range(PLAIN_RUN):
                token = mx.argmax(target(token[None], cache)[0][0, -1:], axis=-1)
                mx.async_eval(token)
            mx.eval(token)
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
    rows = sorted(set(sizes) | set(range(2, min(B, 8) + 1)) | {r for r in COPY_ROWS if r > B})
    points = ([(target_pass, b, short) for b in [1] + rows] + [(target_pass, b, long) for b in {1, B}]
              + [(drafter_step, b, short) for b in sizes] + [(drafter_step, B, long)])
    target_pass(2, short)  # warm-up: one pass is enough (a plain chain is four)
    best = {p: float("inf") for p in points}
    for r in range(rounds[1]):
        start = time.perf_counter()
        for p in points:
            per = PLAIN_RUN if p[0] is target_pass and p[1] == 1 else 1
            best[p] = min(best[p], _timed(lambda: p[0](p[1], p[2])) / per)
        now = time.perf_counter()
        if r + 1 >= rounds[0] and now + (now - start) - tic > budget_s:
            break
    for step, b, n in sorted(points, key=lambda p: -p[1]):  # suffix minimum over block sizes
        best[(step, b, n)] = min(v for (s, b2, n2), v in best.items() if s is step and n2 == n and b2 >= b)

    def lines(step, blocks):
        slopes = {b: (max(0.0, (best[(step, b, long)] - best[(step, b, short)]) / (long - short)), 0.0)
                  for b in blocks if (step, b, long) in best}
        out = {}
        for b in blocks:
            slope = interp(slopes, b)[0]
            out[b] = (best[(step, b, short)] - slope * short, slope)
        return out

    return CostModel(lines(target_pass, [1] + rows), lines(drafter_step, sizes),
                     calibration_s=time.perf_counter() - tic)


# --- what cycles really take --------------------------------------------------------------

@dataclass
class Timing:
    """Decayed sums of observed and predicted seconds per kind of cycle ("plain", "draft",
    "copy") and per kind and block size ("draft4").  Calibration is a few seconds of timings
    on a machine that may be busy: four calibrations in a row on an idle 2-core CPU here
    priced a 4-row verify at 49 to 60 ms and a plain step at 44 to 48, and one that overprices
    drafting sends a request to plain steps, where only its probes can show it wrong."""
    observed: Dict[str, float] = field(default_factory=dict)
    predicted: Dict[str, float] = field(default_factory=dict)
    seen: set = field(default_factory=set)  # block sizes this process has run (not saved)

    def record(self, kind: str, b: int, seconds: float, predicted: float, group: Optional[str] = None):
        if f"{kind}{b}" not in self.seen:  # a shape's first pass in a process allocates its
            self.seen.add(f"{kind}{b}")  # buffers: not what the next ones will cost
            return
        seconds = min(seconds, TIMING_CLIP * predicted)
        for key in (group, kind, f"{kind}{b}"):
            if key is not None:
                self.observed[key] = self.observed.get(key, 0.0) * TIMING_DECAY + seconds
                self.predicted[key] = self.predicted.get(key, 0.0) * TIMING_DECAY + predicted

    def ratio(self, kind: str, b: int, predicted: float, group: Optional[str] = None) -> float:
        """Observed over predicted seconds for a cycle of this kind and block size, shrunk
        towards the kind's ratio, which is shrunk towards the ``group``'s (every kind's,
        a batch's work per sequence that no calibration saw) or 1 (the calibration)."""
        w = TIMING_PRIOR * predicted
        r = 1.0
        for key in (group, kind, f"{kind}{b}"):
            if key is not None:
                r = (self.observed.get(key, 0.0) + w * r) / (self.predicted.get(key, 0.0) + w)
        return r


def kind(b: int, copy: bool = False) -> str:
    return "plain" if b == 1 else "copy" if copy else "draft"


class Corrected:
    """A cost model priced through ``Timing``: each cycle at what its kind and size took."""

    def __init__(self, costs: CostModel, timing: Timing):
        self.costs, self.timing = costs, timing

    def cycle(self, b: int, context: int) -> float:
        raw = self.costs.cycle(b, context)
        return raw * self.timing.ratio(kind(b), b, raw)

    def verify(self, b: int, context: int) -> float:
        """A copy's cycle: a verify pass, no drafter pass."""
        raw = self.costs.verify(b, context)
        return raw * self.timing.ratio(kind(b, copy=True), b, raw)

    def draft(self, b: int, context: int) -> float:
        return self.costs.draft(b, context)

    def observe(self, b: int, context: int, seconds: float, copy: bool = False):
        raw = (self.costs.verify if copy else self.costs.cycle)(b, context)
        self.timing.record(kind(b, copy), b, seconds, raw)


# --- identities and the on-disk cache ---------------------------------------------------

def _digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _shapes(module) -> list:
    return sorted((k, v.dtype.__repr__(), v.shape) for k, v in tree_flatten(module.parameters()))


def cost_key(target, drafter) -> str:
    """Model identity (architecture, shapes and dtypes of every weight), machine."""
    return _digest({"calibration": CALIBRATION, "target": _shapes(target.model), "drafter": _shapes(drafter),
                    "drafter_activations": str(drafter.activation_dtype),
                    "machine": identity()})


def pair_key(target, drafter, greedy: bool, cost: Optional[str] = None) -> str:
    """The pair's weights themselves (acceptance depends on them), and the sampling kind
    (``cost``: the pair's ``cost_key``, when the caller has it).  Weights are probed by a
    sum over ~4096 evenly spaced entries of each of the first four (the whole embedding
    took 16 ms a request here)."""
    def probe(m):
        return [float(mx.sum(v.reshape(-1)[:: max(1, v.size // 4096)].astype(mx.float32)))
                for _, v in tree_flatten(m.parameters())[:4]]
    return _digest({"cost": cost or cost_key(target, drafter), "target": probe(target.model),
                    "drafter": probe(drafter), "greedy": greedy})


def cache_dir() -> Path:
    from ..builtin.smollm2 import cache_home

    return cache_home() / "adaptive"


def _read(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write(path: Path, data: dict):
    """Atomic: a temp file renamed over the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


_costs: Dict[str, CostModel] = {}


def cost_model(target, drafter, key: Optional[str] = None) -> CostModel:
    """The pair's cost model on this machine: from memory, else from disk when fresh,
    else calibrated now (and saved).  ``key``: the pair's ``cost_key``, when the caller has it."""
    key = key or cost_key(target, drafter)
    costs = _costs.get(key)
    if costs is None or time.time() - costs.created > STALE_AFTER_S:
        path = cache_dir() / f"costs-{key}.json"
        data = _read(path)
        try:
            costs = CostModel.from_json(data)
        except (TypeError, KeyError, ValueError, AttributeError):
            costs = None
        if costs is None or time.time() - costs.created > STALE_AFTER_S:
            costs = calibrate(target, drafter)
            _write(path, costs.to_json())
        _costs[key] = costs
    return costs


# --- acceptance ---------------------------------------------------------------------------

@dataclass
class Acceptance:
    """Decayed counts of drafted cycles that reached each draft position and that
    accepted its token.

    ``rates()`` are conditional (position i accepted given all before it were).  Each
    shrinks towards the previous position's rate (the first towards its prior rate), so a
    position not tried for a while drifts back to a guess worth trying."""
    reached: List[float]
    accepted: List[float]
    prior_weight: float = PRIOR_WEIGHT
    prior_rate: float = PRIOR_RATE

    @classmethod
    def empty(cls, positions: int, prior_weight: float = PRIOR_WEIGHT,
              prior_rate: float = PRIOR_RATE) -> "Acceptance":
        return cls([0.0] * positions, [0.0] * positions, prior_weight, prior_rate)

    def record(self, b: int, accepted: int):
        """One drafted cycle with block ``b`` whose first ``accepted`` drafts were taken."""
        self.reached = [x * DECAY for x in self.reached]
        self.accepted = [x * DECAY for x in self.accepted]
        for i in range(min(accepted + 1, b - 1)):
            self.reached[i] += 1
            self.accepted[i] += i < accepted

    def record_first(self, chance: float):
        """A shadow probe: a block-2 draft that would have been accepted with ``chance``
        (at T=0 0 or 1; when sampling, its expected acceptance, which varies less)."""
        self.record(2, 0)
        self.accepted[0] += chance

    def rates(self) -> List[float]:
        out, prev = [], self.prior_rate
        for n, a in zip(self.reached, self.accepted):
            prev = (a + self.prior_weight * prev) / (n + self.prior_weight)
            out.append(prev)
        return out

    @classmethod
    def copies(cls, positions: int) -> "Acceptance":
        """A request's copies before any was verified: tried (COPY_PRIOR_RATE), learned
        within the request only."""
        return cls.empty(positions, PRIOR_WEIGHT, COPY_PRIOR_RATE)

    def scaled(self, weight: float) -> "Acceptance":
        """The same rates, as if ``weight`` cycles had reached the first position."""
        f = weight / self.reached[0] if self.reached and self.reached[0] else 0.0
        return Acceptance([f * x for x in self.reached], [f * x for x in self.accepted])


def expected_tokens(rates: List[float], b: int) -> float:
    """E[tokens emitted by a cycle with block b]: the bonus plus each accepted draft."""
    total, reach = 1.0, 1.0
    for r in rates[: b - 1]:
        reach *= r
        total += reach
    return total


def best_block(rates: List[float], costs: CostModel, context: int, largest: int,
               smallest: int = 1, drafted: bool = True) -> int:
    """The block size in smallest..largest with the most expected tokens per second
    (``drafted=False``: blocks that cost no drafter pass, copies)."""
    return max(range(smallest, largest + 1),
               key=lambda b: tokens_per_second(rates, costs, context, b, drafted))


def tokens_per_second(rates: List[float], costs: CostModel, context: int, b: int,
                      drafted: bool = True) -> float:
    return expected_tokens(rates, b) / (costs.cycle if drafted else costs.verify)(b, context)


# --- the per-request policy --------------------------------------------------------------

class Fixed:
    """A block size that never changes (``--block-size N``)."""

    fallback = False
    copying = False

    def __init__(self, block_size: int):
        self.largest = self.copy_largest = block_size

    def block_size(self, context: int, copy: int = 0) -> int:
        """A copy on offer (``copy`` tokens) is always taken: at T=0 a copy is accepted
        about three times as far as a draft on the built-in pair (README)."""
        self.copying = copy > 0
        return self.largest

    def record(self, b: int, accepted: int):
        pass

    def timed(self, b: int, seconds: float, copy: bool = False):
        pass

    def shadow(self) -> bool:
        return False


class Adaptive:
    """Chooses each cycle's block size from the cost model and the live acceptance.

    When the best block is 1 (plain decoding) it probes with the best drafting block
    after ``wait`` plain steps; the wait doubles after every probe with nothing accepted
    (up to PROBE_MAX) and starts over after one that had a draft accepted.  It is never
    shorter than what keeps a failed probe's extra cost within PROBE_BUDGET of the plain
    steps around it, so probes grow rarer where verifying more rows costs more (long
    contexts).  A request starts from its pair's history (worth SEED_WEIGHT cycles) when
    there is one; only a pair without any probes at once when its prior says plain.

    Probes alone learn slowly: a stretch of failed cycles can send the decayed estimate
    below what the drafter deserves, and plain decoding then tests it only at probes that
    grow rarer.  So while decoding plain, every few steps (as many as keep the drafter's
    cost within ``shadow_budget`` of the plain steps; 0: never) the cycle also drafts a
    block of 2 from the step's input token without verifying it, and tells ``record_shadow``
    whether that draft would have been accepted."""

    def __init__(self, costs: CostModel, largest: int, acceptance: Acceptance, seeded: bool = False,
                 shadow_budget: float = SHADOW_BUDGET, copy_largest: Optional[int] = None,
                 timing: Optional[Timing] = None, priced: Optional[Callable] = None):
        # With ``timing``, cycles are priced at what they really took (``timed``) by
        # ``priced(costs, timing)`` (default ``Corrected``; a batch: ``BatchCosts``); without,
        # at the cost model's figures (given ones: tests, simulations).
        priced = priced or (Corrected if timing is not None else None)
        self.costs = priced(costs, timing) if priced else costs
        self.largest, self.acceptance = largest, acceptance
        self.copy_largest = copy_largest or largest  # the widest block a copy may verify
        self.fallback = False
        self.wait = PROBE_FIRST if seeded else 0
        self.backoff = PROBE_FIRST
        self.context = 0
        self.shadow_budget, self.since_shadow = shadow_budget, 0
        # Copies learn within the request, from a prior that has them tried: seeded from a
        # pair's history (tried), a few requests that copied badly kept later ones from ever
        # copying, and with the drafter's prior a drafter accepted well was never weighed
        # against a copy's real acceptance (the quick start: 0 or 26 copies, run to run).
        self.copies = Acceptance.copies(self.copy_largest - 1)
        self.copying = False

    def block_size(self, context: int, copy: int = 0) -> int:
        self.context = context
        rates = self.acceptance.rates()
        b = best_block(rates, self.costs, context, self.largest)
        self.copying = False
        if copy:
            copied = self.copies.rates()
            c = best_block(copied, self.costs, context, min(self.copy_largest, copy + 1),
                           smallest=2, drafted=False)
            if (tokens_per_second(copied, self.costs, context, c, drafted=False)
                    > tokens_per_second(rates, self.costs, context, b)):
                self.copying = True  # leaves the drafter's fallback and probes as they were
                return c
        self.fallback = b == 1
        if b > 1 or self.wait > 0:
            return b
        return best_block(rates, self.costs, context, self.largest, smallest=2)  # a probe

    def _wait(self, steps: int, probe: int) -> int:
        """At least ``steps``, and enough plain steps to amortize a failed probe of block
        ``probe`` at the current context within PROBE_BUDGET."""
        extra = self.costs.cycle(probe, self.context) / self.costs.cycle(1, self.context) - 1
        return max(steps, math.ceil(extra / PROBE_BUDGET))

    def record(self, b: int, accepted: int):
        if self.copying:
            self.copies.record(b, accepted)
            return
        if b > 1:
            self.acceptance.record(b, accepted)
        if not self.fallback:  # drafting: a fallback from here waits before probing
            self.wait, self.backoff = self._wait(PROBE_FIRST, 2), PROBE_FIRST  # sized for the cheapest probe
        elif b == 1:
            self.wait -= 1
        elif accepted:  # a probe with a sign of life: probe again soon (at once if all taken)
            self.wait = 0 if accepted == b - 1 else self._wait(PROBE_FIRST, b)
            self.backoff = PROBE_FIRST
        else:  # a probe that found nothing: wait longer
            self.wait = self._wait(self.backoff, b)
            self.backoff = min(2 * self.backoff, PROBE_MAX)

    def timed(self, b: int, seconds: float, copy: bool = False):
        """The wall time of a cycle of block ``b``: a copy's, a drafted cycle's that followed
        a drafted one, or a pipelined plain step's (``speculative.py`` says which it times)."""
        if isinstance(self.costs, Corrected):
            self.costs.observe(b, self.context, seconds, copy)

    def shadow(self) -> bool:
        """Whether the plain step just chosen should carry a shadow probe."""
        if not self.fallback or self.shadow_budget <= 0:
            return False
        self.since_shadow += 1
        share = self.costs.draft(2, self.context) / self.costs.cycle(1, self.context)
        if self.since_shadow < share / self.shadow_budget:
            return False
        self.since_shadow = 0
        return True

    def record_shadow(self, chance: float):
        self.acceptance.record_first(chance)


def history_path(key: str) -> Path:
    return cache_dir() / f"acceptance-{key}.json"


def load_history(key: str, positions: int) -> Optional[Acceptance]:
    data = _read(history_path(key))
    try:
        hist = Acceptance(list(data["reached"]), list(data["accepted"]))
    except (TypeError, KeyError):
        return None
    return hist if len(hist.reached) == positions and hist.reached[0] > 0 else None


def fold(old: Optional[Acceptance], new: Acceptance, weight: float = 0.5) -> Optional[Acceptance]:
    """A pair's history with one more request's acceptance (older requests weigh less)."""
    if not any(new.reached):
        return old
    old = old or Acceptance.empty(len(new.reached))
    return Acceptance([weight * o + n for o, n in zip(old.reached, new.reached)],
                      [weight * o + n for o, n in zip(old.accepted, new.accepted)])


def save_history(key: str, acceptance: Acceptance):
    """Fold a request's acceptance into the pair's history on disk."""
    if any(acceptance.reached):
        hist = fold(load_history(key, len(acceptance.reached)), acceptance)
        _write(history_path(key), {"reached": hist.reached, "accepted": hist.accepted})


def policy(target, drafter, block_size=AUTO, greedy: bool = True,
           costs: Optional[CostModel] = None, history: bool = True, largest: Optional[int] = None,
           priced: Optional[Callable] = None):
    """The block-size policy of one request: ``Fixed`` for a number, ``Adaptive`` for
    "auto" choosing up to ``largest`` (default: the drafter's trained block size).  Unless
    ``costs`` are given they are measured or cached, and corrected by the cycles this pair
    really took on this machine (``Timing``), priced by ``priced(costs, timing)`` (default
    ``Corrected``; a batch's: ``batch.BatchCosts``); with ``history`` False a request starts from
    nothing earlier requests saw (neither the pair's acceptance history nor its timing: a
    seeded sampled request's text depends on its block sizes, which then depend only on the
    cost file and the seed)."""
    if block_size != AUTO:
        return Fixed(block_size)
    positions = drafter.config.block_size - 1
    ckey = cost_key(target, drafter) if history or costs is None else None
    key = pair_key(target, drafter, greedy, ckey) if history else None
    hist = load_history(key, positions) if key else None
    timing_key = ckey if costs is None and history else None
    costs = costs or cost_model(target, drafter, ckey)
    chosen = starting(costs, largest or positions + 1, positions, hist, greedy,
                      copy_largest=largest or max(positions + 1, COPY_LARGEST),
                      timing=timing_for(timing_key, costs) if timing_key else None, priced=priced)
    chosen.history_key, chosen.timing_key = key, timing_key
    return chosen


def starting(costs: CostModel, largest: int, positions: int, hist: Optional[Acceptance],
             greedy: bool = True, shadow_budget: float = SHADOW_BUDGET,
             copy_largest: Optional[int] = None, timing: Optional[Timing] = None,
             priced: Optional[Callable] = None) -> Adaptive:
    """A request's ``Adaptive`` policy, seeded from the pair's history ``hist`` (worth
    SEED_WEIGHT cycles) when there is one, else from the prior."""
    start = hist.scaled(SEED_WEIGHT) if hist else Acceptance.empty(
        positions, PRIOR_WEIGHT if greedy else SAMPLED_PRIOR_WEIGHT)
    return Adaptive(costs, largest, start, seeded=hist is not None, shadow_budget=shadow_budget,
                    copy_largest=copy_largest, timing=timing, priced=priced)


_timings: Dict[str, Tuple[float, Timing]] = {}


def timing_path(key: str) -> Path:
    return cache_dir() / f"timing-{key}.json"


def timing_for(key: str, costs: CostModel) -> Timing:
    """This process's ``Timing`` of the cost model ``costs`` (shared by its requests): at
    first the one saved by an earlier process, unless it corrected another calibration."""
    created, timing = _timings.get(key, (None, None))
    if created != costs.created:
        data = _read(timing_path(key)) or {}
        try:
            if data.get("created") != costs.created or data.get("format") != TIMING_FORMAT:
                raise ValueError("another calibration, or timed another way")
            timing = Timing({str(k): float(v) for k, v in data["observed"].items()},
                            {str(k): float(v) for k, v in data["predicted"].items()})
        except (AttributeError, KeyError, TypeError, ValueError):
            timing = Timing()
        _timings[key] = (costs.created, timing)
    return timing


def remember(chosen):
    """Save an adaptive request's acceptance into its pair's history, and the timing."""
    if getattr(chosen, "history_key", None):
        save_history(chosen.history_key, chosen.acceptance)
    if getattr(chosen, "timing_key", None):
        costs = chosen.costs
        _write(timing_path(chosen.timing_key), {"created": costs.costs.created, "format": TIMING_FORMAT,
                                                "observed": costs.timing.observed,
                                                "predicted": costs.timing.predicted})
