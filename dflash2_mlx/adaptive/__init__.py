"""Adaptive speculation: each cycle, the block size that maximizes expected tokens per second.

    costs.py       ``CostModel``: seconds of a target pass over b rows and of a drafter step
                   with block b, as ``base + slope * context``; ``calibrate`` measures it once
                   per (target, drafter, machine), ``cost_model`` keeps it on disk
    timing.py      ``Timing``: what the loop's cycles really took against their price, per kind
                   of cycle and block size; ``Corrected`` prices the cost model through it
    acceptance.py  ``Acceptance``: decayed per-position acceptance rates of the request at hand,
                   seeded from the pair's history on this machine; ``expected_tokens``
    policies.py    ``Fixed`` and ``Adaptive`` (probes, shadow probes, copies weighed against
                   drafts), the ``Policy`` protocol and ``Choice`` the loop uses, ``policy(...)`` and
                   the block sizes it takes (``check_block_size``)
    store.py       the JSON files they are kept in
    curves/        named verify-cost curves of other machines (fixtures, with their sources)

The choice depends only on the past, so every cycle stays lossless whatever it picks.
"""

from .acceptance import (COPY_PRIOR_RATE, DECAY, PRIOR_RATE, PRIOR_WEIGHT, SAMPLED_PRIOR_WEIGHT, SEED_WEIGHT,
                         Acceptance, expected_tokens, fold, history_path, load_history, pair_key, save_history)
from .costs import (CALIBRATION, CONTEXTS, COPY_LARGEST, COPY_ROWS, PLAIN_RUN, STALE_AFTER_S, CostModel, Line,
                    calibrate, cost_key, cost_model, cost_models, export_costs, interp, load_costs)
from .policies import (AUTO, PROBE_BUDGET, PROBE_FIRST, PROBE_MAX, SHADOW_BUDGET, Adaptive, Choice, Fixed, Policy,
                     best_block, policy, remember, starting, tokens_per_second)
from ..request.plan import check_block_size
from .store import cache_dir
from .timing import (TIMING_CLIP, TIMING_DECAY, TIMING_FORMAT, TIMING_PRIOR, Corrected, Timing, kind, save_timing,
                     timing_for, timing_path, timings)

__all__ = [
    "AUTO", "Acceptance", "Adaptive", "CALIBRATION", "CONTEXTS", "COPY_LARGEST", "COPY_PRIOR_RATE", "COPY_ROWS",
    "Choice", "Corrected", "CostModel", "DECAY", "Fixed", "Line", "PLAIN_RUN", "PRIOR_RATE", "PRIOR_WEIGHT",
    "PROBE_BUDGET", "PROBE_FIRST", "PROBE_MAX", "Policy", "SAMPLED_PRIOR_WEIGHT", "SEED_WEIGHT", "SHADOW_BUDGET",
    "STALE_AFTER_S", "TIMING_CLIP", "TIMING_DECAY", "TIMING_FORMAT", "TIMING_PRIOR", "Timing", "best_block",
    "cache_dir", "calibrate", "check_block_size", "cost_key", "cost_model", "cost_models", "export_costs", "load_costs",
    "expected_tokens", "fold", "history_path",
    "interp", "kind", "load_history", "pair_key", "policy", "remember", "save_history", "save_timing", "starting",
    "timing_for", "timing_path", "timings", "tokens_per_second",
]
