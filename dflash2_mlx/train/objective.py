"""The DFlash / DFlash 2 training objective.

Per sequence, random anchors are drawn in the response.  Each block is
``[anchor token, MASK x (B-1)]`` at absolute positions anchor..anchor+B-1; it sees the
context rows (target features) strictly before its anchor, its own block (bidirectional
unless the layer is causal) and no other block.  Blocks are laid out as a batch
``[N, B]`` with per-block RoPE offsets, so the dynamic conv runs inside each block only,
exactly as at inference (``Drafter.__call__`` over one block).

Loss: CE on block positions 1..B-1 weighted ``exp(-(k-1)/gamma)``; DFlash 2 adds the
selector CE over the top-k candidates with the true predecessor teacher-forced
(position 1's predecessor is the anchor), skipping positions whose true token is not a
candidate.  Differentiation goes through the pure-MLX twins
(``dynamic_conv_reference``, ``pair_scores_reference``), never the Metal dispatch.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..kernels.conv import dynamic_conv_reference
from ..kernels.selector import pair_scores_reference, top_candidates

# gamma of the published recipe; other block sizes interpolate linearly between these
# points and extrapolate with the slope of the nearest segment (B/2 below 8, +1/3 per
# position above 16).
GAMMA_TABLE = ((8, 4.0), (10, 5.0), (16, 7.0))


def decay_gamma(block_size: int) -> float:
    pts = GAMMA_TABLE
    if block_size <= pts[0][0]:
        (b0, g0), (b1, g1) = pts[0], pts[1]
    elif block_size >= pts[-1][0]:
        (b0, g0), (b1, g1) = pts[-2], pts[-1]
    else:
        i = next(i for i in range(1, len(pts)) if block_size <= pts[i][0])
        (b0, g0), (b1, g1) = pts[i - 1], pts[i]
    return g0 + (g1 - g0) * (block_size - b0) / (b1 - b0)


def position_weights(block_size: int) -> mx.array:
    """Loss weights of block positions 1..B-1: exp(-(k-1)/gamma)."""
    k = np.arange(1, block_size, dtype=np.float64)
    return mx.array(np.exp(-(k - 1) / decay_gamma(block_size)).astype(np.float32))


@dataclass
class Blocks:
    """A training batch: S sequences of target features and N blocks drawn from them."""
    features: mx.array  # [S, L, n*H] target features (row i = tapped states of token i)
    block_ids: mx.array  # [N, B] anchor then mask ids
    seq: mx.array  # [N] which sequence each block comes from
    anchors: mx.array  # [N] absolute anchor positions
    labels: mx.array  # [N, B-1] true tokens at anchor+1..anchor+B-1
    valid: mx.array  # [N, B-1] 1.0 where the label lies inside the sequence (and the block)
    lengths: Optional[mx.array] = None  # [N] served block size of each block (None: B)
    teacher: Optional[mx.array] = None  # [N, B-1, V'] the target's own logits for each label


def sample_anchors(rng: np.random.Generator, starts: Sequence[int], lengths: Sequence[int],
                   max_anchors: int, full_blocks: int = 0):
    """Anchors per sequence, without replacement, in the response [start, length-2].

    ``full_blocks`` > 0 keeps only anchors whose whole block of that size has labels.
    Returns (seq index, anchor) numpy arrays sorted by sequence then position."""
    seqs, anchors = [], []
    for s, (start, length) in enumerate(zip(starts, lengths)):
        last = length - full_blocks if full_blocks else length - 2
        pool = np.arange(max(start, 1), last + 1)
        if pool.size == 0:
            continue
        pick = pool if pool.size <= max_anchors else np.sort(rng.choice(pool, max_anchors, replace=False))
        seqs.append(np.full(pick.size, s))
        anchors.append(pick)
    if not anchors:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(seqs), np.concatenate(anchors)


def make_blocks(tokens: List[List[int]], features: mx.array, seq: np.ndarray,
                anchors: np.ndarray, block_size: int, mask_token_id: int,
                lengths: Optional[np.ndarray] = None) -> Blocks:
    """Block ids, labels and validity for anchors ``anchors`` of sequences ``seq``.

    ``lengths`` [N]: train block n as if served at block size ``lengths[n]`` (its rows
    past that are neither seen nor scored), so one drafter fits every runtime size."""
    N, T = len(anchors), block_size - 1
    labels = np.zeros((N, T), np.int64)
    valid = np.zeros((N, T), np.float32)
    first = np.zeros(N, np.int64)
    for n, (s, a) in enumerate(zip(seq, anchors)):
        ids = tokens[s]
        first[n] = ids[a]
        got = ids[a + 1 : a + block_size]
        labels[n, : len(got)] = got
        valid[n, : len(got)] = 1.0
    if lengths is not None:
        valid *= np.arange(1, block_size)[None, :] < np.asarray(lengths)[:, None]
    block = np.full((N, block_size), mask_token_id, np.int64)
    block[:, 0] = first
    return Blocks(features, mx.array(block), mx.array(seq), mx.array(anchors),
                  mx.array(labels), mx.array(valid),
                  None if lengths is None else mx.array(lengths))


def attention_mask(anchors: mx.array, ctx_len: int, block_size: int, causal: bool,
                   window: Optional[int] = None, lengths: Optional[mx.array] = None) -> mx.array:
    """Boolean [N, 1, B, ctx_len + B]: context rows j < anchor (the last ``window - 1`` of
    them on sliding layers), the own block (lower-triangular when causal; its first
    ``lengths[n]`` rows only when given)."""
    j = mx.arange(ctx_len)[None, :]
    a = anchors[:, None]
    ctx = j < a
    if window:
        ctx = ctx & (j >= a - (window - 1))
    N = anchors.shape[0]
    ctx = mx.broadcast_to(ctx[:, None, :], (N, block_size, ctx_len))
    inner = mx.ones((block_size, block_size), dtype=mx.bool_)
    if causal:
        inner = mx.tril(inner)
    inner = mx.broadcast_to(inner, (N, block_size, block_size))
    if lengths is not None:
        inner = inner & (mx.arange(block_size)[None, None, :] < lengths[:, None, None])
    return mx.concatenate([ctx, inner], axis=-1)[:, None]


def _conv_prepare(conv, u):
    dyn = conv.kernel_projection(u).reshape(*u.shape[:-1], 2, 2, conv.hidden_size // conv.group_size)
    return dynamic_conv_reference(u, dyn[..., 0, :, :], conv.base_kernel[0]), dyn


def _conv_finish(conv, y, dyn):
    return dynamic_conv_reference(y, dyn[..., 1, :, :], conv.base_kernel[1])


def layer_forward(layer, h, attend):
    """``DecoderLayer.__call__`` with the conv's reference twin (differentiable anywhere);
    ``attend(x)`` is the layer's attention over the blocks' context and own rows."""
    conv = "attention_conv" in layer
    x = layer.input_layernorm(h)
    if conv:
        x, dyn = _conv_prepare(layer.attention_conv, x)
    a = attend(x)
    h = h + (_conv_finish(layer.attention_conv, a, dyn) if conv else a)
    x = layer.post_attention_layernorm(h)
    if conv:
        x, dyn = _conv_prepare(layer.mlp_conv, x)
    m = layer.mlp(x)
    return h + (_conv_finish(layer.mlp_conv, m, dyn) if conv else m)


def group_by_sequence(seq: np.ndarray, n_seqs: int):
    """Slots [S, A] of the blocks of each sequence (A = most blocks of one sequence; a
    padding slot repeats block 0), and where each block sits in the flattened slots."""
    A = max(int(np.bincount(seq, minlength=n_seqs).max()), 1)
    slots = np.zeros((n_seqs, A), np.int64)
    where = np.zeros(len(seq), np.int64)
    for s in range(n_seqs):
        rows = np.nonzero(seq == s)[0]
        slots[s, : rows.size] = rows
        where[rows] = s * A + np.arange(rows.size)
    return slots, where


def grouped_mask(anchors: mx.array, lengths: mx.array, ctx_len: int, block_size: int,
                 causal: bool, window: Optional[int]) -> mx.array:
    """Boolean [S, 1, A*B, ctx_len + A*B] for the blocks of each sequence laid side by side
    (anchors, lengths [S, A]): each block row sees ``attention_mask``'s context rows and
    its own block's rows only."""
    S, A = anchors.shape
    B = block_size
    ctx = attention_mask(anchors.reshape(-1), ctx_len, B, causal, window,
                         lengths.reshape(-1))[:, 0, :, :ctx_len].reshape(S, A, B, ctx_len)
    inner = mx.tril(mx.ones((B, B), dtype=mx.bool_)) if causal else mx.ones((B, B), dtype=mx.bool_)
    same = mx.eye(A, dtype=mx.bool_)[:, None, :, None] & inner[None, :, None, :]  # [A, B, A, B]
    own = same[None] & (mx.arange(B)[None, None, None, None, :] < lengths[:, :, None, None, None])
    return mx.concatenate([ctx, own.reshape(S, A, B, A * B)], axis=-1).reshape(S, 1, A * B, -1)


def grouped_attention(attn, x, ctx_k, ctx_v, offsets, mask, n_seqs: int):
    """``Attention.__call__`` for blocks x [S*A, B, H] whose queries attend, per sequence,
    to its context keys [S, kv, L, hd] and the rows of all its blocks under ``mask``: one
    attention per sequence instead of one per block (no per-block copy of the context)."""
    SA, B, _ = x.shape
    A = SA // n_seqs

    def side_by_side(t):  # [S*A, h, B, d] -> [S, h, A*B, d]
        return t.reshape(n_seqs, A, t.shape[1], B, -1).transpose(0, 2, 1, 3, 4).reshape(
            n_seqs, t.shape[1], A * B, -1)

    q = attn.rope(attn.q_norm(attn._heads(x, attn.q_proj, attn.n_heads)), offset=offsets)
    k, v = attn.keys_values(x, offsets)
    k = mx.concatenate([ctx_k.astype(k.dtype), side_by_side(k)], axis=2)
    v = mx.concatenate([ctx_v.astype(v.dtype), side_by_side(v)], axis=2)
    out = mx.fast.scaled_dot_product_attention(side_by_side(q), k, v, scale=attn.scale, mask=mask)
    out = out.reshape(n_seqs, attn.n_heads, A, B, -1).transpose(0, 2, 3, 1, 4).reshape(SA, B, -1)
    return attn.o_proj(out)


def block_forward(drafter, blocks: Blocks) -> mx.array:
    """Final-normed drafter states [N, B, H] of every block, under the training mask."""
    ctx = drafter.context(blocks.features)  # [S, L, H]
    S, L = ctx.shape[:2]
    B = blocks.block_ids.shape[1]
    slots, where = group_by_sequence(np.array(blocks.seq), S)
    flat = mx.array(slots.reshape(-1))
    h = drafter.embed(blocks.block_ids[flat])  # [S*A, B, H]
    offsets = blocks.anchors.astype(mx.int32)[flat]
    lengths = mx.full((len(blocks.anchors),), B) if blocks.lengths is None else blocks.lengths
    masks = {}
    for layer in drafter.layers:
        key = (layer.causal, layer.window if layer.sliding else None)
        if key not in masks:
            masks[key] = grouped_mask(offsets.reshape(slots.shape), lengths[flat].reshape(slots.shape),
                                      L, B, *key)
        k, v = layer.self_attn.keys_values(ctx, 0)  # [S, kv, L, hd]
        h = layer_forward(layer, h, lambda x: grouped_attention(layer.self_attn, x, k, v, offsets,
                                                                masks[key], S))
    return drafter.norm(h[mx.array(where)])


def selector_rows(drafter, logits, hidden, labels, anchor_ids):
    """Scores of each position's top-k candidates given the true predecessor.

    Returns (candidates [N, T, k], scores [N, T, k]).  Each (block, position) becomes
    its own one-position lattice whose 'anchor' is the true predecessor, so the scores
    come from the same ``pair_scores_reference`` the runtime twin uses."""
    sel = drafter.candidate_selector
    # The runtime's top_candidates (argpartition, then sort the k: a full-vocabulary
    # argsort is far slower on CPU), indices cut from the graph (no VJP w.r.t. indices).
    top = mx.stop_gradient(top_candidates(mx.stop_gradient(logits), sel.top_k)[0])
    unary = mx.take_along_axis(logits, top, axis=-1)
    cand = drafter.token_ids(top)
    N, T, k = cand.shape
    pred = mx.concatenate([anchor_ids[:, None], labels[:, :-1]], axis=1)
    gate = sel.hidden_projection(hidden)
    scores = pair_scores_reference(
        unary.reshape(N * T, 1, k), cand.reshape(N * T, 1, k),
        gate.reshape(N * T, 1, -1), pred.reshape(N * T),
        sel.predecessor_codebook, sel.successor_codebook,
    )
    return cand, scores[:, 0, 0, :].reshape(N, T, k)


def vocab_columns(drafter, labels: mx.array) -> mx.array:
    """Column of each label in the drafter's logits (-1 outside its draft vocabulary)."""
    vocab = drafter.vocab
    if vocab is None:
        return labels
    index = np.full(drafter.config.vocab_size, -1, np.int32)
    index[np.array(vocab)] = np.arange(vocab.size, dtype=np.int32)
    return mx.array(index)[labels]


def _ce(logits, target):
    return mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, target[..., None], axis=-1)[..., 0]


def teacher_logits(drafter, final_norm, blocks: Blocks) -> mx.array:
    """The target's own logits over the drafter's vocabulary for every label (the token at
    anchor + k, predicted from the target's last layer at anchor + k - 1), read from the
    features: the drafter's last tap must be the target's last layer."""
    H = drafter.config.hidden_size
    T = blocks.block_ids.shape[1] - 1
    L = blocks.features.shape[1]
    pos = mx.minimum(blocks.anchors[:, None] + mx.arange(T)[None, :], L - 1)
    last = blocks.features[:, :, -H:][blocks.seq[:, None], pos]  # [N, T, H]
    return mx.stop_gradient(drafter.logits(final_norm(last.astype(drafter.activation_dtype))))


def distill_kl(teacher: mx.array, logits: mx.array) -> mx.array:
    """KL(p_teacher || p_drafter) per row."""
    lt = teacher - mx.logsumexp(teacher, axis=-1, keepdims=True)
    ls = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return (mx.exp(lt) * (lt - ls)).sum(axis=-1)


def part_names(version: int, distill: bool) -> List[str]:
    """The metrics ``loss_parts`` returns, in order."""
    return (["ce", "top1", "top1_pos1"] + (["kl"] if distill else [])
            + (["selector_ce", "in_topk"] if version == 2 else []))


def loss_weights(version: int, selector_weight: float, distill_weight: float) -> dict:
    """The weight of each metric in the total loss (``loss_parts``'s second value)."""
    weights = {"ce": 1.0}
    if distill_weight:
        weights["kl"] = distill_weight
    if version == 2:
        weights["selector_ce"] = selector_weight
    return weights


def loss_parts(drafter, blocks: Blocks, selector_weight: float = 1.0, distill_weight: float = 0.0):
    """({metric: (sum, count)}, {metric: weight in the total loss}) of a batch of blocks:
    every metric is a sum over rows divided by a count (or a weight sum), kept apart so
    that ranks holding parts of one batch can add them up before dividing.  With
    ``blocks.teacher``, the drafter's rows also learn the target's whole next-token
    distribution (KL, ``distill_weight``): far more signal per row than the label's token."""
    B = blocks.block_ids.shape[1]
    hidden = block_forward(drafter, blocks)[:, 1:]
    logits = drafter.logits(hidden)
    # Labels as columns of the logits; a label outside a draft vocabulary has none (-1):
    # it weighs nothing in the CE and is never right.
    column = vocab_columns(drafter, blocks.labels)
    w = position_weights(B)[None, :] * blocks.valid * (column >= 0)
    right = (mx.argmax(logits, axis=-1) == column) * blocks.valid
    parts = {"ce": ((_ce(logits, mx.maximum(column, 0)) * w).sum(), w.sum()),
             "top1": (right.sum(), blocks.valid.sum()),
             "top1_pos1": (right[:, 0].sum(), blocks.valid[:, 0].sum())}
    distill = blocks.teacher is not None and distill_weight
    if distill:
        wk = position_weights(B)[None, :] * blocks.valid  # every label, in the vocabulary or not
        parts["kl"] = ((distill_kl(blocks.teacher, logits) * wk).sum(), wk.sum())
    if drafter.version == 2:
        cand, rows = selector_rows(drafter, logits, hidden, blocks.labels, blocks.block_ids[:, 0])
        hit = cand == blocks.labels[..., None]
        inside = hit.any(axis=-1) * w
        idx = mx.argmax(hit, axis=-1)
        parts["selector_ce"] = ((_ce(rows, idx) * inside).sum(), inside.sum())
        parts["in_topk"] = ((hit.any(axis=-1) * blocks.valid).sum(), blocks.valid.sum())
    return parts, loss_weights(drafter.version, selector_weight, distill_weight if distill else 0.0)


def combine(parts, weights, reduce=None, scale: float = 1.0):
    """(total loss, metrics) from ``loss_parts``.  ``reduce`` (an all_sum over ranks) adds
    up every rank's sums and counts first: the metrics are then the whole batch's, and the
    loss returned is this rank's sums over the batch's counts, times ``scale`` (so that
    the ranks' gradients average to the whole batch's).  A count of zero has a sum of
    zero: that metric is 0."""
    names = list(parts)
    sums = mx.stack([parts[k][0] for k in names])
    counts = mx.stack([parts[k][1] for k in names])
    if reduce is None:
        every_sums, every_counts = sums, counts
    else:
        both = mx.stop_gradient(reduce(mx.concatenate([mx.stop_gradient(sums), counts])))
        every_sums, every_counts = both[: len(names)], both[len(names):]
    every_counts = mx.maximum(every_counts, 1e-9)
    metrics = {k: every_sums[i] / every_counts[i] for i, k in enumerate(names)}
    total = None
    for k, wt in weights.items():
        i = names.index(k)
        term = sums[i] / every_counts[i]
        term = term if wt == 1.0 else wt * term
        total = term if total is None else total + term
    if reduce is not None:
        metrics["loss"] = sum(wt * metrics[k] for k, wt in weights.items())
        total = total * scale
    else:
        metrics["loss"] = total
    return total, metrics


def loss(drafter, blocks: Blocks, selector_weight: float = 1.0, distill_weight: float = 0.0):
    """(total loss, metrics) of a batch of blocks (one process: ``loss_parts`` divided)."""
    return combine(*loss_parts(drafter, blocks, selector_weight, distill_weight))
