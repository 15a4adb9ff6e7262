"""The one store of what is measured about this machine: JSON records under the cache home
(``$DFLASH2_MLX_HOME/calibration/``), one file per record, written atomically here and only
here, each keyed by the facts it holds for:

    costs       a pair's pass costs on a machine      (the pair's weight shapes, the machine)
    timing      live cycles against those costs        (the costs' key; the costs' creation inside)
    acceptance  a pair's acceptance history           (the pair's weights, the machine, greedy or sampled)
    exactness   a target's row-exactness verdict       (the target's weight shapes, the machine and its BLAS)
    source      which target a checkpoint loads as     (its directory and config, the machine)

This process keeps the values it read or made in ``live``.  Every record carries ``FORMAT``: one kept under another format is not read (whoever asks for
it measures again and writes over it), never half-read."""

import hashlib
import json
import os
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

# Bumped whenever what any record holds, or how it is measured, changes.  (The costs, the
# timings and the verdict had their own counters before, at 11, 2 and 2, in files under
# ``adaptive/``, which this store does not read.)
FORMAT = 12
KINDS = ("costs", "timing", "acceptance", "exactness", "source")


def home() -> Path:
    # Imported here, not at the top: ``builtin.smollm2`` imports the GGUF converter's
    # dependencies, which ``import dflash2_mlx`` does not need.
    from ..builtin.smollm2 import cache_home

    return cache_home() / "calibration"


def digest(facts) -> str:
    """A record's key: a digest of the facts it holds for."""
    return hashlib.sha1(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def path(kind: str, key: str) -> Path:
    if kind not in KINDS:
        raise ValueError(f"no record kind {kind!r} (one of {', '.join(KINDS)})")
    return home() / f"{kind}-{key}.json"


def read(kind: str, key: str) -> Optional[dict]:
    """The record's data; None where there is none, it is unreadable, or of another format."""
    return data_of(path(kind, key))


def write(kind: str, key: str, data: dict):
    """Keep ``data`` as the record."""
    write_json(path(kind, key), {"format": FORMAT, "kind": kind, "data": data})


def write_json(p: Path, obj: dict):
    """Atomically (a temp file renamed over the old one), its folder made if need be: a
    record, or a cost file exported for another machine."""
    p = Path(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, p)


def drop(kind: str, key: str):
    """Forget the record, on disk and in this process."""
    live.pop((kind, key), None)
    path(kind, key).unlink(missing_ok=True)


# This process's values of records it read or made (a ``CostModel``, a ``Timing``), by
# (kind, key): each is read once, and its requests share it.
live: Dict[Tuple[str, str], object] = {}


def records(kind: str) -> Iterator[Tuple[str, dict]]:
    """(key, data) of every readable record of ``kind``, by key."""
    for key in keys_of(kind):
        data = data_of(path(kind, key))
        if data is not None:
            yield key, data


def keys_of(kind: str) -> List[str]:
    """The key of every record file of ``kind`` (whatever its format), sorted."""
    return [p.stem[len(kind) + 1:] for p in sorted(home().glob(f"{kind}-*.json"))]


def data_of(p: Path) -> Optional[dict]:
    """A record file's data (None: unreadable, or of another format)."""
    try:
        record = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("data"), dict):
        return None
    return record["data"]
