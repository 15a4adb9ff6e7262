"""The block size of a batch: the pair's cost model as a batch of S sequences sees it
(``BatchCosts``), and the adaptive policy priced with it (``batch_policy``)."""

from typing import Optional

from .. import adaptive, calibration
from ..adaptive import interp


class BatchCosts:
    """The pair's single-stream cost model (``adaptive.CostModel``) as a batch of
    ``streams`` sequences sees it, for the adaptive policy: a cycle with block b verifies
    S * b rows and drafts S blocks, so its base cost is the model's at S * b rows (the lines
    extended past the largest calibrated block along their last slope), and each sequence's
    own context adds its attention cost.  One sequence: the model itself.

    With ``timing`` (``adaptive.Timing``) each cycle is priced at what the batch's cycles of
    its kind, size and stream count really took (``observe``): the extension past the
    calibrated rows, and a batch's per-sequence work, are guesses that the timing corrects."""

    def __init__(self, costs, timing=None):
        self.costs, self.streams, self.timing = costs, 1, timing

    def cycle(self, b: int, context: int) -> float:
        raw = self._raw(b, context, True)
        if self.timing is None:
            return raw
        return raw * self.timing.ratio(self.kind(b, True), b, raw, f"batch{self.streams}")

    def observe(self, b: int, context: int, seconds: float, drafted: bool = True):
        """A cycle of block ``b`` took ``seconds`` (``drafted`` False: every sequence verified
        a copy, no drafter pass).  What one kind shows moves the others' prices too: at first
        a batch times only the kind it runs, and its per-sequence work priced on that kind
        alone can send it to plain steps and back."""
        if self.timing is not None:
            self.timing.record(self.kind(b, drafted), b, seconds, self._raw(b, context, drafted),
                               f"batch{self.streams}")

    def kind(self, b: int, drafted: bool) -> str:
        return f"batch{self.streams}-{adaptive.kind(b, copy=not drafted)}"

    def _raw(self, b: int, context: int, drafted: bool) -> float:
        seconds = self._part(self.costs.target, b, context)
        if b > 1 and drafted:
            seconds += self._part(self.costs.drafter, b, context)
        return seconds

    def _part(self, points: dict, b: int, context: int) -> float:
        S = self.streams
        return _rows_base(points, S * b) + S * interp(points, b)[1] * context


def _rows_base(points: dict, rows: int) -> float:
    keys = sorted(points)
    if rows <= keys[-1] or len(keys) < 2:
        return interp(points, rows)[0]
    lo, hi = keys[-2], keys[-1]
    per_row = max(0.0, (points[hi][0] - points[lo][0]) / (hi - lo))
    return points[hi][0] + per_row * (rows - hi)


def batch_policy(target, drafter, largest: Optional[int] = None) -> adaptive.Adaptive:
    """The adaptive policy of a batch: the pair's history, its ``BatchCosts`` measured or
    cached, with this process's timing of them (shared with single streams, and saved with
    theirs when the batch closes)."""
    return calibration.policy(target, drafter, adaptive.AUTO, largest=largest, priced=BatchCosts)
