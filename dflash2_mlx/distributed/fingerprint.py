"""Every rank must hold the same target and drafter: ranks with different files would
compute different logits and drift apart silently (a split target's ranks each hold a slice
of what they think is one model).  So at start each rank digests its files and one
``all_gather`` of a fixed-size array compares them; a mismatch raises on every rank, naming
the parts that differ and the ranks that hold other ones.

A part's digest reads the files' names (relative, so the same model under another path on
another host agrees), sizes and, for a weight file, its safetensors header (every tensor's
name, dtype, shape and offsets) and evenly spaced samples of its data; small files are read
whole.  Retrained weights of the same shapes differ in every sample, and reading a few
samples keeps the check cheap for a target of many gigabytes.
"""

import hashlib
import struct
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

WHOLE_BELOW = 64 << 20  # files smaller than this are hashed whole
SAMPLES, SAMPLE_BYTES = 16, 64 << 10  # of a larger weight file: this many reads of this size
DIGEST_WORDS = 4  # int32 words kept of each part's digest
PARTS = ("target config", "target tokenizer", "target weights", "drafter config", "drafter weights")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "special_tokens_map.json", "chat_template.jinja")


class FingerprintMismatch(RuntimeError):
    """Ranks hold different target or drafter files."""


def file_digest(h, path: Path):
    """Feed ``path`` into ``h``: its size and contents (a large one: its safetensors header
    and sampled data)."""
    size = path.stat().st_size
    h.update(f"{path.name}:{size};".encode())
    with open(path, "rb") as f:
        if size < WHOLE_BELOW:
            h.update(f.read())
            return
        if path.suffix == ".safetensors":
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(min(n, size - 8)))
        for i in range(SAMPLES):
            f.seek(i * (size - SAMPLE_BYTES) // max(SAMPLES - 1, 1))
            h.update(f.read(SAMPLE_BYTES))


def part_digest(files: List[Path]) -> bytes:
    h = hashlib.sha256()
    for p in sorted(files, key=lambda p: p.name):
        file_digest(h, p)
    return h.digest()


def digests(target: Path, draft: Optional[Path]) -> Dict[str, bytes]:
    """Each part's digest: the target's config, tokenizer and weights, the drafter's config
    and weights (empty without a drafter)."""
    target, files = Path(target), {}
    files["target config"] = [target / "config.json"]
    files["target tokenizer"] = [target / n for n in TOKENIZER_FILES if (target / n).is_file()]
    files["target weights"] = sorted(target.glob("*.safetensors"))
    if draft is not None:
        files["drafter config"] = [Path(draft) / "config.json"]
        files["drafter weights"] = sorted(Path(draft).glob("*.safetensors"))
    return {part: part_digest([p for p in files.get(part, []) if p.is_file()]) for part in PARTS}


def as_array(parts: Dict[str, bytes]) -> mx.array:
    """The parts' digests as one fixed-size int32 array (DIGEST_WORDS per part)."""
    words = []
    for part in PARTS:
        words += struct.unpack(f"<{DIGEST_WORDS}i", parts[part][: 4 * DIGEST_WORDS])
    return mx.array(words, dtype=mx.int32)


def differences(every: List[List[int]]) -> List[str]:
    """What differs between the ranks' digests (``every[r]``: rank r's words), per part:
    e.g. "drafter weights: rank 1 differs from rank 0"."""
    out = []
    for i, part in enumerate(PARTS):
        cut = slice(i * DIGEST_WORDS, (i + 1) * DIGEST_WORDS)
        others = [r for r in range(1, len(every)) if every[r][cut] != every[0][cut]]
        if others:
            ranks = f"ranks {', '.join(map(str, others))} differ" if len(others) > 1 else f"rank {others[0]} differs"
            out.append(f"{part}: {ranks} from rank 0")
    return out


def check(group, target: Path, draft: Optional[Path] = None):
    """Raise FingerprintMismatch on every rank unless all ranks of ``group`` hold the same
    target and drafter files (one all_gather of a few words per rank)."""
    if group is None or group.size() == 1:
        return
    mine = as_array(digests(target, draft))
    every = mx.distributed.all_gather(mine, group=group).reshape(group.size(), -1).tolist()
    diff = differences(every)
    if diff:
        raise FingerprintMismatch(
            f"the ranks do not hold the same model files ({'; '.join(diff)}); "
            "every rank needs the same target and drafter")
