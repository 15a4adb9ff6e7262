"""Sequences joining a batch: which are prefilled together (``prefill_groups``) and their
prompts' batched prefill (``prefill``)."""

from typing import List

import mlx.core as mx

from .cache import TargetBatch
from .sequence import BatchSequence


def prefill_groups(lengths: List[int], slack: float = 1.25) -> List[List[int]]:
    """Which joiners are prefilled together (indices): by length, a group grows while its
    padded rows stay within ``slack`` times its real ones (a padding row is wasted work; on
    a CPU long prompts gain little from sharing a pass, short ones a lot)."""
    groups, group = [], []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        rows = sum(lengths[j] for j in group) + lengths[i]
        if group and lengths[i] * (len(group) + 1) > slack * rows:
            groups.append(group)
            group = []
        group.append(i)
    return groups + [group] if group else groups


def prefill(target, kinds, seqs: List[BatchSequence], step_size: int):
    """One target pass per chunk of the (started) sequences' uncached prompt tokens,
    right-padded (a padding row comes after a sequence's real rows, so they never see it;
    it is a hole once the pass is committed), their features added to their draft contexts.
    Their caches as a ``TargetBatch`` of ``kinds``, and each one's last logits."""
    batch = TargetBatch(kinds)
    for s in seqs:
        batch.add(s.prompt_cache)
        s.prompt_cache = None
    rest = [s.prompt[s.cached_tokens:].tolist() for s in seqs]
    last = [None] * len(seqs)
    width = max(1, step_size // len(seqs))  # rows per pass, all sequences
    for start in range(0, max(len(r) for r in rest), width):
        chunks = [r[start : start + width] for r in rest]
        w = max(len(c) for c in chunks)
        ids = mx.array([c + [0] * (w - len(c)) for c in chunks], dtype=mx.uint32)
        kept = [len(c) for c in chunks]
        logits, features = batch.forward(target, ids, None if min(kept) == w else kept)
        batch.rows.commit(kept)
        for i, s in enumerate(seqs):
            if kept[i]:
                s.context.add(features[i : i + 1, : kept[i]])
            if kept[i] and start + kept[i] == len(rest[i]):
                last[i] = logits[i, kept[i] - 1 : kept[i]]
        mx.eval(last, [c.state for c in batch.layers])
    return batch, last
