"""Target features for training, computed on the fly.

Features are the outputs of the target layers ``target_layer_ids``, captured by
``Target`` exactly as the runtime captures them, for a batch of right-padded sequences
in one target forward (causal attention: padding at the end changes no earlier row).

Why on the fly and not a disk cache: a feature row costs n * H * 4 bytes per token
(SmolLM2-135M with 5 taps: 11.5 KB, so 1M tokens = 11.5 GB; a 27B target with 5 taps
of H 5120: 100 KB per token), while recomputing it is one target forward per sequence,
the same order of cost as the drafter's own LM-head pass over its blocks.  Computing
them on the fly keeps disk use at zero, resumes trivially (nothing to invalidate) and
guarantees the drafter trains on the features the runtime will feed it (same target
weights, same quantization).  Nothing here is differentiated: the target is frozen.
"""

from typing import List

import mlx.core as mx

from ..target import Target


def target_features(target: Target, seqs: List[List[int]], pad_id: int = 0) -> mx.array:
    """Tapped features [S, L_max, n * H] of right-padded sequences (float32)."""
    L = max(len(s) for s in seqs)
    ids = mx.array([s + [pad_id] * (L - len(s)) for s in seqs], dtype=mx.int32)
    _, feats = target(ids, None)
    feats = mx.stop_gradient(feats)
    mx.eval(feats)
    return feats
