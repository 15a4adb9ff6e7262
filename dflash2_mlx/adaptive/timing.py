"""What the loop's cycles really take against what the cost model priced them at, per kind
of cycle and block size (``Timing``), and the cost model priced through it (``Corrected``),
so a calibration that landed badly on a busy machine is corrected as the loop runs.  A
process keeps one ``Timing`` per cost model, kept for the next process by the calibration
service (``calibration/priced.py``: ``timing``, ``keep_timing``)."""

from dataclasses import dataclass, field
from typing import Dict, Optional

from .costs import CostModel

# Each observed cycle counts against its prediction; an unseen block size falls back on its
# kind's correction, an unseen kind on the calibration (worth TIMING_PRIOR cycles).
TIMING_PRIOR = 3.0
TIMING_DECAY = 0.9  # evidence kept per cycle of the same key: follows the machine's load
TIMING_CLIP = 3.0  # one cycle counts as at most this many times its prediction (a stall)
# A calibration is measured again (at the next request) once a kind's live cycles have
# kept costing more than DISAGREE times, or less than 1 / DISAGREE times, its prices for
# DISAGREE_CYCLES cycles in a row: the machine is not the one that was measured (another
# load, power mode or MLX), and corrections on top of a wrong curve misjudge its shape.
DISAGREE = 1.5
DISAGREE_CYCLES = 64


@dataclass
class Timing:
    """Decayed sums of observed and predicted seconds per kind of cycle ("plain", "draft",
    "copy") and per kind and block size ("draft4").  Calibration is a few seconds of timings
    on a machine that may be busy: calibrations in a row on an idle machine price the same
    passes differently, and one that overprices drafting sends a request to plain steps,
    where only its probes can show it wrong."""
    observed: Dict[str, float] = field(default_factory=dict)
    predicted: Dict[str, float] = field(default_factory=dict)
    seen: set = field(default_factory=set)  # block sizes this process has run (not saved)
    off: int = 0  # cycles in a row whose kind's live cost strayed from the calibration

    def record(self, kind: str, b: int, seconds: float, predicted: float, group: Optional[str] = None):
        if f"{kind}{b}" not in self.seen:  # a shape's first pass in a process allocates its
            self.seen.add(f"{kind}{b}")  # buffers: not what the next ones will cost
            return
        seconds = min(seconds, TIMING_CLIP * predicted)
        for key in (group, kind, f"{kind}{b}"):
            if key is not None:
                self.observed[key] = self.observed.get(key, 0.0) * TIMING_DECAY + seconds
                self.predicted[key] = self.predicted.get(key, 0.0) * TIMING_DECAY + predicted
        r = self.observed[kind] / max(self.predicted[kind], 1e-12)
        self.off = self.off + 1 if not 1 / DISAGREE <= r <= DISAGREE else 0

    def observed_ratio(self) -> float:
        """Observed over predicted seconds of every cycle recorded (decayed)."""
        kinds = [k for k in self.observed if k in ("plain", "draft", "copy")]
        return sum(self.observed[k] for k in kinds) / max(sum(self.predicted[k] for k in kinds), 1e-12)

    def disagrees(self) -> bool:
        """Whether live cycles have kept disagreeing with the calibration (measure it again)."""
        return self.off >= DISAGREE_CYCLES

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
