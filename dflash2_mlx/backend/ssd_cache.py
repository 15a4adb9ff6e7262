"""The prefix cache's second tier: entries the memory tier lets go, kept on disk (oMLX's
``dflash_ssd_cache`` and ``dflash_ssd_cache_max_bytes``).

An entry goes to disk when the memory tier evicts it, when it is larger than the memory
tier's budget (or that tier is off), and when its engine unloads, so a model unloaded for
idling or a restarted server starts from its earlier prompts.  A request that shares a
longer prefix with an entry on disk than with any in memory restores it from the file,
which then moves back into memory if it fits there.

Each pair (the target's and the drafter's files, and how the drafter is loaded) has its own
directory: an entry is only ever restored into the models that made it.  Files are
safetensors, data and never code; on start-up only their token ids and layout are read
(an unreadable file is deleted: it is a cache, and so is a temporary file its writer left
when it died); arrays are read when an entry is restored, and served only if they match
the checksum written with them and have the shapes the model's caches take.
Within ``budget`` bytes, the least recently written or used files go first.

Files are written by one writer thread, so that neither the request that lets an entry go
nor those decoding beside it in a batch wait for its checksum and its bytes to reach the
disk (an entry of a long prompt is hundreds of megabytes).  The engine's thread hands the
writer plain bytes (``_Pending``): the writer never runs MLX.  Until its file is in place
an entry is served from memory, and at most ``WAITING`` entries wait for the writer.
"""

import collections
import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm import __version__ as mlx_lm_version
from safetensors import safe_open

from ..builtin.smollm2 import cache_home

from .prefix_cache import Entry, covers, reuse_length

log = logging.getLogger("dflash2_mlx.serve")

FORMAT = "dflash2-prefix-1"
WAITING = 2  # entries handed to the writer and not yet on disk; a third waits for room
# safetensors' names of the dtypes a cache holds
DTYPES = {mx.bool_: "BOOL", mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16", mx.int16: "I16", mx.uint32: "U32",
          mx.int32: "I32", mx.uint64: "U64", mx.int64: "I64", mx.float16: "F16", mx.bfloat16: "BF16",
          mx.float32: "F32", mx.float64: "F64"}


def default_ssd_cache_dir() -> Path:
    """Where pairs' directories go unless ``serve --ssd-cache-dir`` says otherwise."""
    return cache_home() / "ssd-cache"


def pair_dir(root, target_dir, draft_dir, load_kwargs: dict) -> Path:
    """The directory of one pair's entries under ``root``: named by the pair's files (path,
    size and modification time of each config and weight file), load options and mlx-lm's
    version (its models lay out the caches)."""
    def files(d):
        d = Path(d).resolve()
        return [str(d)] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(d.iterdir())
                           if f.suffix == ".safetensors" or f.name == "config.json"]
    key = {"format": FORMAT, "mlx_lm": mlx_lm_version, "target": files(target_dir),
           "drafter": files(draft_dir) if draft_dir is not None else None,
           "load": sorted([k, str(v)] for k, v in load_kwargs.items())}
    return Path(root).expanduser() / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]


@dataclass
class Spilled:
    """An entry on disk, as the index knows it."""
    tokens: tuple
    draft: bool
    trimmable: bool
    nbytes: int
    floor: int = 0


def checksum(arrays: dict) -> str:
    """SHA-256 of every array's name, dtype, shape and bytes (a file's tensor bytes can be
    damaged with its header intact)."""
    return _checksum(_raw(arrays))


def _raw(arrays: dict) -> dict:
    """Every array as (dtype, shape, its bytes in row-major order), by name: what the writer
    thread hashes and writes without running MLX."""
    return {name: (a.dtype, a.shape, np.array(mx.contiguous(a).view(mx.uint8)).reshape(-1))
            for name, a in arrays.items()}


def _checksum(raw: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(raw):
        dtype, shape, data = raw[name]
        h.update(f"{name}:{dtype}:{shape};".encode())
        h.update(memoryview(data))
    return h.hexdigest()


def _header(raw: dict, meta: dict) -> bytes:
    """A safetensors file's head for ``raw`` arrays: its length, then the header (the bytes
    by name, as MLX orders them)."""
    header, offset = {"__metadata__": meta}, 0
    for name, (dtype, shape, data) in sorted(raw.items()):
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the bytes start 8-aligned
    return struct.pack("<Q", len(text)) + text


def _write_safetensors(path: Path, head: bytes, raw: dict):
    with open(path, "wb") as f:
        f.write(head)
        for name in sorted(raw):
            f.write(memoryview(raw[name][2]))


def _writer_gone(tmp: Path) -> bool:
    """Whether the process that was writing ``tmp`` (``.NAME.PID.THREAD.tmp.safetensors``)
    is gone: a writer killed mid-write leaves it behind."""
    try:
        pid = int(tmp.name.split(".")[-4])
    except (IndexError, ValueError):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    return False


def _arrays(entry: Entry):
    """The arrays and metadata of an entry's file (its checksum is the writer's to add)."""
    arrays = {"tokens": mx.array(entry.tokens, dtype=mx.uint32)}
    layout = []
    for i, (first, second) in enumerate(entry.target):
        if isinstance(first, list):  # recurrent layer: (arrays, lengths)
            present = [j for j, a in enumerate(first) if a is not None]
            arrays.update({f"t{i}.{j}": first[j] for j in present})
            if second is not None:
                arrays[f"t{i}.lengths"] = second
            layout.append({"arrays": len(first), "present": present, "lengths": second is not None})
        else:
            arrays[f"t{i}.k"], arrays[f"t{i}.v"] = first, second
            layout.append("kv")
    for i, (k, v) in enumerate(entry.draft or []):
        arrays[f"d{i}.k"], arrays[f"d{i}.v"] = k, v
    meta = {"format": FORMAT, "target": json.dumps(layout), "trimmable": str(int(entry.trimmable)),
            "floor": str(entry.floor), "draft": str(len(entry.draft)) if entry.draft is not None else "none"}
    return arrays, meta


def _entry(arrays: dict, meta: dict) -> Entry:
    """An entry from its file's arrays and metadata (KeyError/ValueError if they do not fit)."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"format {meta.get('format')!r}")
    if meta.get("sha256") != checksum(arrays):
        raise ValueError("the arrays do not match their checksum")
    target = []
    for i, kind in enumerate(json.loads(meta["target"])):
        if kind == "kv":
            target.append((arrays[f"t{i}.k"], arrays[f"t{i}.v"]))
        else:
            first = [arrays[f"t{i}.{j}"] if j in kind["present"] else None for j in range(kind["arrays"])]
            target.append((first, arrays[f"t{i}.lengths"] if kind["lengths"] else None))
    draft = None if meta["draft"] == "none" else [(arrays[f"d{i}.k"], arrays[f"d{i}.v"])
                                                  for i in range(int(meta["draft"]))]
    nbytes = sum(a.nbytes for k, a in arrays.items() if k != "tokens")
    return Entry(tuple(arrays["tokens"].tolist()), target, draft, meta["trimmable"] == "1", nbytes,
                 int(meta.get("floor", 0)))


@dataclass
class _Pending:
    """An entry handed to the writer: served from ``entry`` until ``raw`` is on disk."""
    entry: Entry
    raw: dict
    meta: dict


def _name(entry: Entry) -> str:
    return hashlib.sha256(repr((entry.tokens, entry.draft is not None, entry.trimmable)).encode()).hexdigest()[:32]


class DiskTier:
    def __init__(self, root, budget_bytes: int):
        self.root = Path(root)
        self.budget = int(budget_bytes)
        self.entries: "collections.OrderedDict[str, Spilled]" = collections.OrderedDict()  # oldest first
        self.pending: Dict[str, _Pending] = {}  # handed to the writer, not yet on disk
        self._lock = threading.Lock()
        self._waiting: "queue.Queue[str]" = queue.Queue(maxsize=WAITING)
        self._writer: Optional[threading.Thread] = None
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.entries.values())

    def stats(self) -> dict:
        with self._lock:
            return {"prefix_cache_ssd_entries": len(self.entries), "prefix_cache_ssd_bytes": self.nbytes,
                    "prefix_cache_ssd_budget_bytes": self.budget}

    def _path(self, name: str) -> Path:
        return self.root / f"{name}.safetensors"

    def _scan(self):
        for tmp in self.root.glob(".*.tmp.safetensors"):
            if _writer_gone(tmp):
                log.warning("prefix cache: removing %s, left by a writer that is gone", tmp)
                tmp.unlink(missing_ok=True)
        files = sorted((f for f in self.root.glob("*.safetensors") if not f.name.startswith(".")),
                       key=lambda f: f.stat().st_mtime_ns)  # (dot files: another writer's, unfinished)
        for f in files:
            try:
                with safe_open(str(f), framework="numpy") as st:
                    meta = st.metadata() or {}
                    if meta.get("format") != FORMAT:
                        raise ValueError(f"format {meta.get('format')!r}")
                    tokens = tuple(int(t) for t in st.get_tensor("tokens"))
                self.entries[f.stem] = Spilled(tokens, meta["draft"] != "none", meta["trimmable"] == "1",
                                               f.stat().st_size, int(meta.get("floor", 0)))
            except Exception as e:  # a cache: a file it cannot read goes
                log.warning("prefix cache: dropping unreadable %s (%s)", f, e)
                f.unlink(missing_ok=True)
        self._fit()

    def best(self, ids: Sequence[int], draft: bool):
        """The entry sharing the longest usable prefix with ``ids``: (name, tokens) or (None, 0)."""
        best, best_n = None, 0
        with self._lock:
            kept = [(name, s.tokens, s.draft, s.trimmable, s.floor) for name, s in self.entries.items()]
            kept += [(name, p.entry.tokens, p.entry.draft is not None, p.entry.trimmable, p.entry.floor)
                     for name, p in self.pending.items()]
        for name, tokens, has_draft, trimmable, floor in kept:
            n = reuse_length(tokens, has_draft, trimmable, ids, draft, floor)
            if n > best_n:
                best, best_n = name, n
        return best, best_n

    def put(self, entry: Entry):
        """Hand ``entry`` to the writer (it waits while ``WAITING`` entries do).  The bytes are
        taken here, on the caller's thread, where MLX runs."""
        if entry.nbytes > self.budget:
            return
        arrays, meta = _arrays(entry)
        name, pending = _name(entry), _Pending(entry, _raw(arrays), meta)
        with self._lock:
            self.pending[name] = pending
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._write_all, name="disk-tier-writer", daemon=True)
                self._writer.start()
        self._waiting.put(name)

    def flush(self):
        """Wait until every entry handed over is on disk (or given up)."""
        self._waiting.join()

    def _write_all(self):
        while True:
            name = self._waiting.get()
            with self._lock:
                pending = self.pending.get(name)
            try:
                if pending is not None:
                    self._write(name, pending)
            finally:
                with self._lock:
                    if self.pending.get(name) is pending:
                        del self.pending[name]
                self._waiting.task_done()

    def _write(self, name: str, pending: _Pending):
        """Write one entry's file.  Room is made first (the entries it covers go, then the
        oldest while over budget), so the files and the one being written stay within it."""
        entry = pending.entry
        head = _header(pending.raw, {**pending.meta, "sha256": _checksum(pending.raw)})
        size = len(head) + sum(data.nbytes for _, _, data in pending.raw.values())
        with self._lock:
            for old, s in list(self.entries.items()):
                if old != name and covers(entry.tokens, entry.draft is not None, entry.trimmable, s.tokens, s.draft,
                                          entry.floor, s.floor):
                    self._drop(old)
            self._drop(name)  # (rewritten: its old file is replaced)
            self._fit(room=size)
        tmp = self.root / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp.safetensors"
        try:
            _write_safetensors(tmp, head, pending.raw)
            os.replace(tmp, self._path(name))
        except Exception as e:  # a full disk, a removed directory: the request goes on
            log.warning("prefix cache: could not write to %s (%s)", self.root, e)
            tmp.unlink(missing_ok=True)
            return
        with self._lock:
            self.entries[name] = Spilled(entry.tokens, entry.draft is not None, entry.trimmable, size, entry.floor)
            self._fit()

    def load(self, name: str, fits=None) -> Optional[Entry]:
        """The entry ``name`` read back (None, and the file gone, if it cannot be read, its
        arrays fail their checksum, or it does not ``fits`` the model); one still waiting for
        the writer is served as it was handed over."""
        with self._lock:
            pending = self.pending.get(name)
        if pending is not None:
            return pending.entry if fits is None or fits(pending.entry) else None
        path = self._path(name)
        if not path.exists():  # taken by another server sharing the directory
            self.remove(name)
            return None
        try:
            arrays, meta = mx.load(str(path), return_metadata=True)
            entry = _entry(arrays, meta)
            mx.eval(list(arrays.values()))
            if fits is not None and not fits(entry):
                raise ValueError("its arrays are not the shapes this model's caches take")
        except Exception as e:
            log.warning("prefix cache: dropping unreadable %s (%s)", path, e)
            with self._lock:
                self._drop(name)
            return None
        with self._lock:
            if name in self.entries:
                self.entries.move_to_end(name)
        with contextlib.suppress(OSError):  # (gone meanwhile: another server took it)
            os.utime(path)  # recently used: the last to go
        return entry

    def remove(self, name: str):
        with self._lock:
            self.pending.pop(name, None)
            self._drop(name)

    def resize(self, budget_bytes: int):
        with self._lock:
            self.budget = int(budget_bytes)
            self._fit()

    def _drop(self, name: str):
        self.entries.pop(name, None)
        self._path(name).unlink(missing_ok=True)

    def _fit(self, room: int = 0):
        """The oldest files go until they and ``room`` bytes more fit the budget."""
        while self.entries and self.nbytes + room > self.budget:
            self._drop(next(iter(self.entries)))
