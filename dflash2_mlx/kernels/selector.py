"""DFlash 2's path selector: pairwise scores over each position's top-k candidates,
then one walk from the anchor.

    S_t(a, b) = U_t(b) + sum_r A[a, r] * g_t[r] * B[b, r],   g_t = hidden_projection(h_t)

U_t is the drafter's own logit of candidate b at position t, A / B the predecessor /
successor codebooks.  Position 1's only predecessor is the anchor (the last verified
token); position t > 1 takes its predecessor among position t-1's candidates.

Walk rules, shared by the Metal kernel and this twin:
- a NaN score counts as -inf;
- greedy (temperature 0): argmax of the row, ties go to the lowest candidate index
  (candidates are ordered by descending drafter logit, so the drafter's preference wins);
- sampled: p = softmax(row / temperature); with uniform u in [0, 1), pick the first j
  whose cumulative sum exceeds u; if rounding leaves u above the total, the last
  candidate with p > 0; a row without a finite maximum (all -inf, or +inf after
  scaling) is walked greedily.  ``q`` returns the 16-way rows for rejection sampling.
"""

import mlx.core as mx


def top_candidates(logits: mx.array, k: int):
    """Top-k candidate ids and logits per position, by descending logit."""
    top = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
    values = mx.take_along_axis(logits, top, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


def pair_scores_reference(unary, cand, gate, anchor, predecessor_codebook, successor_codebook):
    """All pair scores S[..., t, a, b]; row a of position 0 is the anchor for every a.

    unary, cand: [..., T, k]; gate: [..., T, r]; anchor: [...] token ids.
    """
    k = cand.shape[-1]
    first = mx.broadcast_to(mx.expand_dims(anchor, (-1, -2)), (*cand.shape[:-2], 1, k))
    pred = mx.concatenate([first.astype(cand.dtype), cand[..., :-1, :]], axis=-2)
    A = predecessor_codebook[pred] * mx.expand_dims(gate, -2)  # [..., T, k, r]
    B = successor_codebook[cand]  # [..., T, k, r]
    pair = A.astype(mx.float32) @ B.astype(mx.float32).swapaxes(-1, -2)
    return mx.expand_dims(unary.astype(mx.float32), -2) + pair


def walk_reference(scores, temperature: float = 0.0, uniforms=None):
    """Walk the lattice from the anchor.

    scores: [..., T, k, k]; uniforms: [..., T] in [0, 1) when temperature > 0.
    Returns (path [..., T] candidate indices, q [..., T, k] the rows sampled from).
    """
    T, k = scores.shape[-3], scores.shape[-1]
    prev = mx.zeros(scores.shape[:-3], dtype=mx.int32)
    path, qs = [], []
    for t in range(T):
        row = mx.take_along_axis(
            scores[..., t, :, :], prev[..., None, None], axis=-2
        ).squeeze(-2)  # [..., k]
        x = row if temperature == 0 else row / temperature
        x = mx.where(mx.isnan(x), -mx.inf, x)  # not argmax's own NaN rule: it differs by back-end
        greedy = mx.argmax(x, axis=-1).astype(mx.int32)
        one_hot = (mx.arange(k) == greedy[..., None]).astype(mx.float32)
        if temperature == 0:
            idx, q = greedy, one_hot
        else:
            q = mx.softmax(x, axis=-1, precise=True)
            cdf = mx.cumsum(q, axis=-1)
            idx = mx.sum(cdf <= uniforms[..., t : t + 1], axis=-1).astype(mx.int32)
            last = (k - 1 - mx.argmax((q > 0)[..., ::-1], axis=-1)).astype(mx.int32)
            finite = mx.isfinite(mx.max(x, axis=-1))
            idx = mx.where(finite, mx.minimum(idx, last), greedy)
            q = mx.where(finite[..., None], q, one_hot)
        path.append(idx)
        qs.append(q)
        prev = idx
    return mx.stack(path, axis=-1), mx.stack(qs, axis=-2)
