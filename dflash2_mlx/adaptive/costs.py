"""The cost model: the seconds of a target pass over b rows and of a drafter step with block
b, each as ``base + slope * context`` (measured and kept by the calibration service,
``dflash2_mlx/calibration``)."""

import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Tuple

from ..machine.contention import BUSY_SHARE

STALE_AFTER_S = 7 * 24 * 3600  # a cost model older than this is measured again
BUSY_RETRY_S = 120.0  # ... one measured while other processes used the machine, after this
# Rows a copy may verify when the block size is chosen ("auto"): a copy is not bound to the
# drafter's trained block, and a loop is accepted far; 15 is the widest verify the CPU split
# computes in two halves (cpu_split.MAX_ROWS).  Calibrated at COPY_ROWS, interpolated between.
COPY_LARGEST = 15
COPY_ROWS = (12, COPY_LARGEST)

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
    # only.  Not kept in the store.
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
