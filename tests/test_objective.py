"""The training objective: decay weights, the block mask, the batched block forward
against the inference forward, and the CE / selector CE against hand computations."""

import math

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from dflash2_mlx.model.checkpoint import load_drafter
from dflash2_mlx.loop.target import attach
from dflash2_mlx.train import objective as O
from tiny_models import make_drafter, make_target


def test_decay_gamma_and_weights():
    assert [O.decay_gamma(b) for b in (8, 10, 16)] == [4.0, 5.0, 7.0]
    assert O.decay_gamma(12) == pytest.approx(5 + 2 * 2 / 6)
    assert O.decay_gamma(4) == pytest.approx(2.0)  # B/2 below 8
    assert O.decay_gamma(22) == pytest.approx(9.0)  # +1/3 per position above 16
    w = O.position_weights(16).tolist()
    assert len(w) == 15
    assert w[0] == 1.0
    assert w[1] == pytest.approx(math.exp(-1 / 7), rel=1e-6)
    assert w[14] == pytest.approx(math.exp(-14 / 7), rel=1e-6)
    assert O.position_weights(8).tolist()[3] == pytest.approx(math.exp(-3 / 4), rel=1e-6)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 4), (True, 3)])
def test_attention_mask_matches_brute_force(causal, window):
    anchors = [0, 2, 5, 9]
    ctx_len, B = 11, 4
    got = np.array(O.attention_mask(mx.array(anchors), ctx_len, B, causal, window))
    assert got.shape == (len(anchors), 1, B, ctx_len + B)
    for n, a in enumerate(anchors):
        for i in range(B):  # query row i of block n, at absolute position a + i
            for j in range(ctx_len + B):
                if j < ctx_len:
                    want = j < a and (window is None or a - j <= window - 1)
                else:
                    want = (not causal) or (j - ctx_len) <= i
                assert got[n, 0, i, j] == want, (a, i, j)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("objective")
    make_target(root / "target", "qwen3")
    make_drafter(root / "v1", root / "target", version=1, block_size=6,
                 layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    make_drafter(root / "v2", root / "target", version=2, block_size=6)
    model, _ = mlx_lm.load(str(root / "target"))
    return root, model


def bound(root, model, name):
    drafter = load_drafter(str(root / name))
    target = attach(model, drafter)
    return drafter, target


SEQ = [[5, 9, 3, 7, 12, 4, 8, 20, 6, 11, 13, 5, 17, 9, 21, 3, 10, 14],
       [7, 7, 15, 4, 9, 22, 3, 18, 5, 6, 12]]


def batch(drafter, target, seq, anchors):
    L = max(len(s) for s in SEQ)
    ids = mx.array([s + [0] * (L - len(s)) for s in SEQ])
    _, feats = target(ids, None)
    return O.make_blocks(SEQ, feats, np.array(seq), np.array(anchors),
                         drafter.config.block_size, drafter.config.mask_token_id)


@pytest.mark.parametrize("name", ["v1", "v2"])
def test_block_forward_equals_inference_forward(tiny, name):
    """One batched training pass == Drafter.__call__ per block (same anchor, same context).
    v1 has a sliding causal layer with a window shorter than some contexts; v2 has
    non-trivial dynamic convs."""
    root, model = tiny
    drafter, target = bound(root, model, name)
    seq, anchors = [0, 0, 0, 1, 1], [1, 6, 11, 4, 8]
    blocks = batch(drafter, target, seq, anchors)
    hidden = O.block_forward(drafter, blocks)
    for n, (s, a) in enumerate(zip(seq, anchors)):
        _, feats = target(mx.array([SEQ[s]]), None)
        cache = drafter.make_cache()
        drafter.append_context(feats[:, :a], cache)
        want = drafter(blocks.block_ids[n : n + 1], cache)[0]
        np.testing.assert_allclose(np.array(hidden[n]), np.array(want), atol=2e-5, rtol=1e-5)
    # Labels: the true next tokens, cut (and marked invalid) past the sequence end.
    assert blocks.labels[3].tolist() == SEQ[1][5:10]
    assert blocks.valid[4].tolist() == [1, 1, 0, 0, 0]
    assert blocks.block_ids[2].tolist() == [SEQ[0][11]] + [drafter.config.mask_token_id] * 5


@pytest.mark.parametrize("name", ["v1", "v2"])
def test_shorter_served_blocks_equal_inference_at_that_size(tiny, name):
    """A block trained as served at size b (``lengths``) has the hidden states of a
    b-row inference block at its first b rows, and scores only labels 1..b-1."""
    root, model = tiny
    drafter, target = bound(root, model, name)
    seq, anchors, lengths = [0, 0, 1], [3, 9, 4], [2, 4, 6]
    L = max(len(s) for s in SEQ)
    _, feats = target(mx.array([s + [0] * (L - len(s)) for s in SEQ]), None)
    blocks = O.make_blocks(SEQ, feats, np.array(seq), np.array(anchors), drafter.config.block_size,
                           drafter.config.mask_token_id, np.array(lengths))
    hidden = O.block_forward(drafter, blocks)
    for n, (s, a, b) in enumerate(zip(seq, anchors, lengths)):
        _, f = target(mx.array([SEQ[s]]), None)
        cache = drafter.make_cache()
        drafter.append_context(f[:, :a], cache)
        want = drafter(blocks.block_ids[n : n + 1, :b], cache)[0]
        np.testing.assert_allclose(np.array(hidden[n, :b]), np.array(want), atol=2e-5, rtol=1e-5)
        assert blocks.valid[n].tolist() == [1.0] * (b - 1) + [0.0] * (6 - b)


def test_teacher_logits_are_the_targets_own(tiny, tmp_path):
    """Distillation targets read from the features equal the target's real logits for
    each label, and the KL term is zero when the drafter's rows equal them."""
    root, model = tiny
    make_drafter(tmp_path / "d", root / "target", version=2, block_size=4, target_layer_ids=(1, 3))
    drafter, target = bound(tmp_path, model, "d")
    blocks = batch(drafter, target, [0, 1], [3, 5])
    norm = model.model.norm
    teacher = O.teacher_logits(drafter, norm, blocks)
    for n, (s, a) in enumerate([(0, 3), (1, 5)]):
        logits = model(mx.array([SEQ[s]]))[0]
        for k in range(3):
            np.testing.assert_allclose(np.array(teacher[n, k]), np.array(logits[a + k]), rtol=1e-4, atol=1e-4)
    assert float(O.distill_kl(teacher, teacher).max()) < 1e-6
    blocks.teacher = teacher
    total, m = O.loss(drafter, blocks, distill_weight=0.5)
    plain, _ = O.loss(drafter, blocks)
    assert float(m["kl"]) > 0 and float(total) == pytest.approx(float(plain) + 0.5 * float(m["kl"]), rel=1e-5)


def test_loss_matches_hand_computation(tiny):
    root, model = tiny
    drafter, target = bound(root, model, "v2")
    blocks = batch(drafter, target, [0, 0, 1], [2, 12, 6])
    total, m = O.loss(drafter, blocks, selector_weight=0.5)

    hidden = np.array(O.block_forward(drafter, blocks))[:, 1:]
    logits = np.array(drafter.logits(mx.array(hidden))).astype(np.float64)
    labels, valid = np.array(blocks.labels), np.array(blocks.valid)
    anchor = np.array(blocks.block_ids)[:, 0]
    sel = drafter.candidate_selector
    A, Bc = np.array(sel.predecessor_codebook), np.array(sel.successor_codebook)
    Wg = np.array(sel.hidden_projection.weight)
    k = sel.top_k
    gamma = 3.0  # B = 6 < 8: gamma = B / 2
    ce_num = ce_den = sel_num = sel_den = 0.0
    present = absent = 0
    for n in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if not valid[n, t]:
                continue
            w = math.exp(-t / gamma)
            row = logits[n, t]
            lse = np.log(np.exp(row - row.max()).sum()) + row.max()
            ce_num += w * (lse - row[labels[n, t]])
            ce_den += w
            cand = np.argsort(-row, kind="stable")[:k]
            if labels[n, t] not in cand:
                absent += 1
                continue
            present += 1
            pred = anchor[n] if t == 0 else labels[n, t - 1]
            g = Wg @ hidden[n, t]
            s = row[cand] + (A[pred] * g) @ Bc[cand].T
            lse = np.log(np.exp(s - s.max()).sum()) + s.max()
            sel_num += w * (lse - s[list(cand).index(labels[n, t])])
            sel_den += w
    assert present and absent  # both branches of the skip rule are exercised
    assert m["ce"].item() == pytest.approx(ce_num / ce_den, rel=1e-4)
    assert m["selector_ce"].item() == pytest.approx(sel_num / sel_den, rel=1e-4)
    assert total.item() == pytest.approx(ce_num / ce_den + 0.5 * sel_num / sel_den, rel=1e-4)


def test_sample_anchors_stay_in_the_response():
    rng = np.random.default_rng(0)
    seq, anchors = O.sample_anchors(rng, [5, 3], [20, 6], max_anchors=4)
    assert seq.tolist() == [0] * 4 + [1] * 2
    assert all(5 <= a <= 18 for a in anchors[:4]) and anchors[4:].tolist() == [3, 4]
    _, full = O.sample_anchors(rng, [5], [20], max_anchors=100, full_blocks=8)
    assert full.tolist() == list(range(5, 13))
