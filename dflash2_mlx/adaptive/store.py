"""Where the adaptive policy keeps what outlives a process: JSON files under the cache
home (cost models, timings, acceptance histories), written atomically, and the digests
that name them."""

import hashlib
import json
import os
from pathlib import Path
from typing import Optional


def cache_dir() -> Path:
    # Imported here, not at the top: ``builtin.smollm2`` imports the GGUF converter's
    # dependencies, which ``import dflash2_mlx`` does not need.
    from ..builtin.smollm2 import cache_home

    return cache_home() / "adaptive"


def digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read(path: Path) -> Optional[dict]:
    """The JSON in ``path``; None where it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write(path: Path, data: dict):
    """Atomic: a temp file renamed over the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
