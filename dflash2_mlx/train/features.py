"""Target features for training: computed on the fly, optionally kept in a bounded disk
cache.

Features are the outputs of the target layers ``target_layer_ids``, captured by
``Target`` exactly as the runtime captures them, for a batch of right-padded sequences
in one target forward (causal attention: padding at the end changes no earlier row;
evaluation is lazy, so layers after the deepest tap and the LM head never run).

On the fly is the default: a feature row costs n * H * 4 bytes per token (SmolLM2-135M
with 5 taps: 11.5 KB, so 1M tokens = 11.5 GB; a 27B target with 5 taps of H 5120:
100 KB per token), while recomputing it is one target forward per sequence - for one
pass over a large dataset, the cheaper side, and it trains on exactly the features the
runtime feeds (same weights, same quantization), with nothing to invalidate.

``FeatureCache`` is for many epochs over a small dataset with a target that is slow on
this machine (the CPU case): one safetensors file per sequence, written atomically, at
most ``max_bytes`` in all (past that, sequences are computed on the fly and not
stored), reused after an interruption.  A ``meta.json`` pins the target, the tapped
layers and the sequence length cap; a cache made for anything else is cleared.
"""

import json
import shutil
from pathlib import Path
from typing import List, Optional, Sequence

import mlx.core as mx

from ..loop.target import Target


def target_features(target: Target, seqs: List[List[int]], pad_id: int = 0) -> mx.array:
    """Tapped features [S, L_max, n * H] of right-padded sequences (float32)."""
    L = max(len(s) for s in seqs)
    ids = mx.array([s + [pad_id] * (L - len(s)) for s in seqs], dtype=mx.int32)
    _, feats = target(ids, None)
    feats = mx.stop_gradient(feats)
    mx.eval(feats)
    return feats


class FeatureCache:
    def __init__(self, path, max_bytes: int, meta: dict):
        self.path = Path(path)
        self.max_bytes = max_bytes
        meta_file = self.path / "meta.json"
        if self.path.exists() and (not meta_file.is_file() or json.loads(meta_file.read_text()) != meta):
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        meta_file.write_text(json.dumps(meta))
        for tmp in self.path.glob("*.tmp.safetensors"):
            tmp.unlink()  # a write cut short
        self.used = sum(f.stat().st_size for f in self.path.glob("*.safetensors"))

    def _file(self, key) -> Path:
        return self.path / f"{key}.safetensors"

    def get(self, key) -> Optional[mx.array]:
        f = self._file(key)
        return mx.load(str(f))["features"] if f.is_file() else None

    def put(self, key, features: mx.array):
        if self.used + features.nbytes > self.max_bytes or self._file(key).is_file():
            return
        tmp = self.path / f"{key}.tmp.safetensors"
        mx.save_safetensors(str(tmp), {"features": features})
        size = tmp.stat().st_size
        if self.used + size > self.max_bytes:
            tmp.unlink()
            return
        tmp.rename(self._file(key))
        self.used += size


def batch_features(target: Target, seqs: List[List[int]], keys: Sequence = None,
                   cache: Optional[FeatureCache] = None) -> mx.array:
    """Features [S, L_max, n * H] through ``cache`` when given (rows past a sequence's end
    are padding that the block mask never reads)."""
    if cache is None:
        return target_features(target, seqs)
    found = [cache.get(k) for k in keys]
    missing = [i for i, f in enumerate(found) if f is None]
    if missing:
        fresh = target_features(target, [seqs[i] for i in missing])
        for j, i in enumerate(missing):
            found[i] = fresh[j, : len(seqs[i])]
            cache.put(keys[i], found[i])
    L = max(len(s) for s in seqs)
    rows = [mx.pad(f, [(0, L - f.shape[0]), (0, 0)]) for f in found]
    out = mx.stack(rows)
    mx.eval(out)
    return out
