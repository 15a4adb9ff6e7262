"""Adaptive speculation: each cycle, the block size that maximizes expected tokens per second.

    costs.py       ``CostModel``: seconds of a target pass over b rows and of a drafter step
                   with block b, as ``base + slope * context`` (measured and kept by the
                   calibration service, ``dflash2_mlx/calibration``)
    timing.py      ``Timing``: what the loop's cycles really took against their price, per kind
                   of cycle and block size; ``Corrected`` prices the cost model through it
    acceptance.py  ``Acceptance``: decayed per-position acceptance rates of the request at hand,
                   seeded from the pair's history on this machine; ``expected_tokens``
    policies.py    ``Fixed`` and ``Adaptive`` (probes, shadow probes, copies weighed against
                   drafts), the ``Policy`` protocol and ``Choice`` the loop uses, ``starting``
    curves/        named verify-cost curves of other machines (fixtures, with their sources)

The choice depends only on the past, so every cycle stays lossless whatever it picks.
"""

from .acceptance import (COPY_PRIOR_RATE, DECAY, PRIOR_RATE, PRIOR_WEIGHT, SAMPLED_PRIOR_WEIGHT, SEED_WEIGHT,
                         Acceptance, expected_tokens, fold)
from .costs import COPY_LARGEST, COPY_ROWS, STALE_AFTER_S, CostModel, Line, interp
from .policies import (PROBE_BUDGET, PROBE_FIRST, PROBE_MAX, SHADOW_BUDGET, Adaptive, Choice, Fixed, Policy,
                       best_block, starting, tokens_per_second)
from ..request.plan import AUTO, check_block_size
from .timing import TIMING_CLIP, TIMING_DECAY, TIMING_PRIOR, Corrected, Timing, kind

__all__ = [
    "AUTO", "Acceptance", "Adaptive", "COPY_LARGEST", "COPY_PRIOR_RATE", "COPY_ROWS", "Choice", "Corrected",
    "CostModel", "DECAY", "Fixed", "Line", "PRIOR_RATE", "PRIOR_WEIGHT", "PROBE_BUDGET", "PROBE_FIRST", "PROBE_MAX",
    "Policy", "SAMPLED_PRIOR_WEIGHT", "SEED_WEIGHT", "SHADOW_BUDGET", "STALE_AFTER_S", "TIMING_CLIP",
    "TIMING_DECAY", "TIMING_PRIOR", "Timing", "best_block", "check_block_size", "expected_tokens", "fold",
    "interp", "kind", "starting", "tokens_per_second",
]
