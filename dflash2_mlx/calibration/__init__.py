"""Calibration as a service above the loop: what is measured about this machine, kept in
one store, and handed to a request as prices.  The loop asks nothing of it: a request's
boundary (``generate``, the batch) gets its policy and costs here and gives them to the loop.

    store.py      the one store: a JSON record per fact, one ``FORMAT``, written only there
    keys.py       the facts each record is keyed by (pair, machine, BLAS, sampling kind)
    measure.py    ``calibrate``: a pair's pass costs, measured in named steps
    pair_costs.py ``costs``: kept while fresh, else measured; cost files; a split target's
    priced.py     ``policy``: costs corrected by live timing, seeded by acceptance history;
                  ``remember``: what a request taught, kept (or a disagreeing calibration dropped)
    exactness.py  the row-exactness verdict: kept, probed, and what replies say of it
"""

from .exactness import exactness_of, known, note, verdict
from .measure import calibrate
from .pair_costs import costs, export_costs, load_costs, prepare_split, recalibrate
from .priced import acceptance_history, keep_acceptance, keep_timing, policy, remember, timing
from .store import FORMAT

__all__ = ["FORMAT", "acceptance_history", "calibrate", "costs", "exactness_of", "export_costs", "keep_acceptance",
           "keep_timing", "known", "load_costs", "note", "policy", "prepare_split", "recalibrate", "remember",
           "timing", "verdict"]
