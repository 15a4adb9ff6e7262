"""A pair's pass costs on this machine, as the service gives them: kept (in this process,
else in the store) while fresh, else measured now (``measure.calibrate``) and kept; a cost
file given by the user (``load_costs``) instead; a split target's, measured by all its ranks
together (``prepare_split``)."""

import json
import sys
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..adaptive.costs import BUSY_RETRY_S, STALE_AFTER_S, CostModel
from ..machine.contention import BUSY_SHARE
from . import keys, store
from .measure import calibrate

# Rounds a split target's ranks calibrate with: a fixed count, so every rank runs the same passes.
SPLIT_ROUNDS = (3, 3)


def costs(target, drafter, whole: bool = False) -> CostModel:
    """The pair's cost model on this machine: this process's, else the store's when fresh,
    else measured now (and kept): a first use's coarse one, or with ``whole`` (a tree's
    rows, an exported cost file) the whole curve."""
    key = keys.costs(target, drafter)
    kept = store.live.get(("costs", key))
    if not _serves(kept, whole):
        kept = _read(key)
        if not _serves(kept, whole):
            kept = measured(target, drafter, key, coarse=not whole)
        store.live[("costs", key)] = kept
    return kept


def _serves(c: Optional[CostModel], whole: bool) -> bool:
    return c is not None and not c.expired() and not (whole and c.coarse)


def _read(key: str) -> Optional[CostModel]:
    try:
        return CostModel.from_json(store.read("costs", key))
    except (TypeError, KeyError, ValueError, AttributeError):
        return None


def measured(target, drafter, key: str, coarse: bool = False) -> CostModel:
    """A fresh calibration (a first use's ``coarse`` one, or the whole curve), kept under
    ``key``.  One taken while other processes used the machine is taken again at once; if
    the machine is still busy the quieter one is used by this process for BUSY_RETRY_S and
    not kept: a busy machine's prices would send adaptive decoding to plain steps (or trees
    to chains) for days."""
    # Said, not silent: the first request on a machine waits for it (seconds).
    what = ("timing this pair's passes on this machine (once" if coarse else
            "timing this pair's tree and widest passes on this machine (once, at a first tree")
    print(f"dflash2-mlx: first use: {what}; `dflash2-mlx doctor --recalibrate` measures again) ...", end=" ",
          file=sys.stderr, flush=True)
    tic = time.perf_counter()
    c = calibrate(target, drafter, coarse=coarse)
    if c.busy > BUSY_SHARE:
        again = calibrate(target, drafter, coarse=coarse)
        c = min(c, again, key=lambda x: x.busy)
    if c.busy > BUSY_SHARE:
        print(f"done in {time.perf_counter() - tic:.0f} s, but other processes used {c.busy:.0%} of this "
              f"machine's cores meanwhile: these costs serve for {BUSY_RETRY_S:.0f} s, then are measured again",
              file=sys.stderr, flush=True)
        return c
    store.write("costs", key, c.to_json())
    c.first_use = coarse
    print(f"done in {time.perf_counter() - tic:.0f} s", file=sys.stderr, flush=True)
    return c


def prepare_split(target, drafter, group):
    """Before an adaptive request on a split target: unless every rank has a fresh cost model
    of the pair, all of them calibrate now, together (a fixed number of rounds, so the same
    passes), and keep it where ``costs`` finds it."""
    key = keys.costs(target, drafter)
    kept = store.live.get(("costs", key)) or _read(key)
    if kept is not None and time.time() - kept.created > STALE_AFTER_S:
        kept = None
    missing = mx.distributed.all_sum(mx.array([int(kept is None)]), group=group).item()
    if missing:
        kept = calibrate(target, drafter, budget_s=0.0, rounds=SPLIT_ROUNDS, redo=False)
        # Ranks sharing cores see each other as "other processes": a busy calibration would
        # expire within minutes, and one rank alone would then measure again (``measured``),
        # each of its passes waiting for ranks that are not running them.  Only all ranks
        # together measure a split target again, here.
        kept.busy = 0.0
        store.write("costs", key, kept.to_json())
    store.live[("costs", key)] = kept


def recalibrate() -> int:
    """Forget every pair's costs and live timings on this machine (the next request measures
    them again); how many records were dropped."""
    gone = [(kind, key) for kind in ("costs", "timing") for key in store.keys_of(kind)]
    for kind, key in gone:
        store.drop(kind, key)
    return len(gone)


def export_costs(target, drafter, path) -> CostModel:
    """This machine's cost model of the pair (measured now if it has none) written to
    ``path``, with the pair it prices and the machine it was measured on: a file another
    machine can load with ``load_costs`` (``--cost-file``) to decide as this one would."""
    from ..machine.identity import describe

    c = costs(target, drafter, whole=True)
    store.write_json(Path(path), {**c.to_json(), "pair": keys.pair_digest(target, drafter), "machine": describe()})
    return c


def load_costs(path, target, drafter) -> CostModel:
    """A cost file written by ``export_costs``; a clear error for a file that is not one, or
    that prices another pair."""
    try:
        data = json.loads(Path(path).read_text())
        c = CostModel.from_json(data)
    except FileNotFoundError:
        raise ValueError(f"cost file {path} does not exist") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"cost file {path} is not a dflash2-mlx cost file "
                         f"(write one with `dflash2-mlx doctor --export-costs FILE`): {e}") from None
    if data.get("pair") != keys.pair_digest(target, drafter):
        raise ValueError(f"cost file {path} was measured for another target and drafter "
                         f"(on {(data.get('machine') or {}).get('platform', 'an unknown machine')}): its passes price other "
                         "shapes; export one for this pair")
    c.created = time.time()  # given, not measured: never stale in this process
    return c
