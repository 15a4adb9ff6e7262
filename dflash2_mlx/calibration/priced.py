"""A request's block-size policy, priced by the service: the pair's costs, corrected by
what its cycles really took on this machine (``Timing``), seeded from its acceptance history
(``policy``); and what the request taught, kept for the next one (``remember``)."""

import sys
from typing import Callable, Optional

from ..adaptive import policies
from ..adaptive.acceptance import Acceptance, fold
from ..adaptive.costs import COPY_LARGEST, CostModel
from ..adaptive.timing import Timing
from ..request.plan import AUTO
from . import keys, store
from .pair_costs import costs as pair_costs


def policy(target, drafter, block_size=AUTO, greedy: bool = True, costs: Optional[CostModel] = None,
           history: bool = True, largest: Optional[int] = None, priced: Optional[Callable] = None):
    """The block-size policy of one request: ``Fixed`` for a number, ``Adaptive`` for
    "auto" choosing up to ``largest`` (default: the drafter's trained block size).  Unless
    ``costs`` are given they are the pair's on this machine (``costs.costs``), corrected by
    the cycles it really took here (``Timing``), priced by ``priced(costs, timing)`` (default
    ``Corrected``; a batch's: ``batch.BatchCosts``); with ``history`` False a request starts from
    nothing earlier requests saw (neither the pair's acceptance history nor its timing: a
    seeded sampled request's text depends on its block sizes, which then depend only on the
    cost file and the seed)."""
    if block_size != AUTO:
        return policies.Fixed(block_size)
    positions = drafter.config.block_size - 1
    history_key = keys.acceptance(target, drafter, greedy) if history else None
    timing_key = keys.costs(target, drafter) if costs is None and history else None
    costs = costs or pair_costs(target, drafter)
    chosen = policies.starting(costs, largest or positions + 1, positions, acceptance_history(history_key, positions),
                               greedy, copy_largest=largest or max(positions + 1, COPY_LARGEST),
                               timing=timing(timing_key, costs) if timing_key else None, priced=priced)
    chosen.history_key, chosen.timing_key = history_key, timing_key
    return chosen


def acceptance_history(key: Optional[str], positions: int) -> Optional[Acceptance]:
    """The pair's acceptance history on this machine (None: none yet, or of another block)."""
    data = store.read("acceptance", key) if key else None
    try:
        hist = Acceptance(list(data["reached"]), list(data["accepted"]))
    except (TypeError, KeyError):
        return None
    return hist if len(hist.reached) == positions and hist.reached[0] > 0 else None


def timing(key: str, costs: CostModel) -> Timing:
    """This process's ``Timing`` of the cost model ``costs`` (shared by its requests): at
    first the one kept by an earlier process, unless it corrected another calibration."""
    created, kept = store.live.get(("timing", key), (None, None))
    if created != costs.created:
        data = store.read("timing", key) or {}
        try:
            if data.get("created") != costs.created:
                raise ValueError("it corrected another calibration")
            kept = Timing({str(k): float(v) for k, v in data["observed"].items()},
                          {str(k): float(v) for k, v in data["predicted"].items()})
        except (AttributeError, KeyError, TypeError, ValueError):
            kept = Timing()
        store.live[("timing", key)] = (costs.created, kept)
    return kept


def remember(chosen):
    """Keep what a request's adaptive policy learned (``chosen``: any policy, or None): its
    acceptance and its live timing."""
    if getattr(chosen, "history_key", None):
        keep_acceptance(chosen.history_key, chosen.acceptance)
    if getattr(chosen, "timing_key", None):
        keep_timing(chosen.timing_key, chosen.costs.costs, chosen.costs.timing)


def keep_acceptance(key: str, acceptance: Acceptance):
    """Fold a request's acceptance into the pair's history."""
    if any(acceptance.reached):
        hist = fold(acceptance_history(key, len(acceptance.reached)), acceptance)
        store.write("acceptance", key, {"reached": hist.reached, "accepted": hist.accepted})


def keep_timing(key: str, costs: CostModel, live: Timing):
    """Keep ``live`` (the timing of the cost model ``costs``) for the next process; or, where
    live cycles kept disagreeing with the calibration, forget both costs and timing so the
    next request measures the machine again."""
    if live.disagrees():
        print(f"dflash2-mlx: live cycles kept costing {live.observed_ratio():.2f}x what the pass costs measured "
              f"at first use said: measuring them again at the next request", file=sys.stderr, flush=True)
        store.drop("costs", key)
        store.drop("timing", key)
        return
    store.write("timing", key, {"created": costs.created, "observed": live.observed, "predicted": live.predicted})
