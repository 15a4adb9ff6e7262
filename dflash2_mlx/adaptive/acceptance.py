"""Acceptance: per-position conditional acceptance rates of the request at hand, decayed so
they follow it, seeded from this pair's history on this machine (kept by the calibration
service), and the tokens a cycle is expected to emit with them."""

from dataclasses import dataclass
from typing import List, Optional

PRIOR_RATE = 0.5  # acceptance assumed for a pair never seen on this machine
# ... and for a request's copies: where the last tokens repeat, the built-in target's greedy
# responses mostly continue the copy (scripts/experiments/copies_offline.py measures how far)
COPY_PRIOR_RATE = 0.8
PRIOR_WEIGHT = 2.0  # pseudo-cycles behind each prior rate
SAMPLED_PRIOR_WEIGHT = 8.0  # ... for a sampled request without history: its first few cycles
# are accepted or not by chance, and a plain-decoding request learns only from rare probes
SEED_WEIGHT = 4.0  # cycles a pair's history on this machine counts for at a request's start
DECAY = 0.95  # evidence kept per drafted cycle


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


def fold(old: Optional[Acceptance], new: Acceptance, weight: float = 0.5) -> Optional[Acceptance]:
    """A pair's history with one more request's acceptance (older requests weigh less)."""
    if not any(new.reached):
        return old
    old = old or Acceptance.empty(len(new.reached))
    return Acceptance([weight * o + n for o, n in zip(old.reached, new.reached)],
                      [weight * o + n for o, n in zip(old.accepted, new.accepted)])
