"""Drafter modules: conv and selector twins on hand cases, context injection, masks,
sliding windows, output scaling."""

import mlx.core as mx
import numpy as np
import pytest

from dflash2_mlx.kernels.conv import dynamic_conv_reference
from dflash2_mlx.kernels.selector import pair_scores_reference, walk_reference
from dflash2_mlx.model.config import DrafterConfig, default_target_layer_ids
from dflash2_mlx.model.drafter import Drafter, DynamicConv, propose
from dflash2_mlx.request.sampling import SamplingParams


def config(version=2, **kw):
    d = dict(architectures=["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"],
             hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, intermediate_size=64, vocab_size=20, rms_norm_eps=1e-6,
             rope_theta=10000.0, num_target_layers=4,
             dflash_config=dict(block_size=5, mask_token_id=2, target_layer_ids=[1, 2],
                                conv_group_size=16, selector_rank=8, selector_top_k=4))
    d.update(kw)
    return DrafterConfig.from_dict(d)


def bound(cfg, seed=0):
    mx.random.seed(seed)
    drafter = Drafter(cfg)
    emb = mx.random.normal((cfg.vocab_size, cfg.hidden_size))
    drafter.bind(lambda ids: emb[ids], lambda h: h @ emb.T)
    return drafter


def test_conv_reference_matches_hand_computation():
    x = mx.array([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])  # T=3, H=2
    base = mx.array([[1.0, 0.5], [0.25, -1.0]])  # [tap, channel]
    dyn = mx.array([[[[0.1], [0.2]], [[0.0], [0.0]], [[-1.0], [1.0]]]])  # g = 2: one group
    out = np.array(dynamic_conv_reference(x, dyn, base))
    b, dy, xx = np.array(base), np.array(dyn)[0, :, :, 0], np.array(x)[0]
    want = np.zeros((3, 2))
    for t in range(3):
        for c in range(2):
            want[t, c] = (b[0, c] + dy[t, 0]) * xx[t, c]
            if t:
                want[t, c] += (b[1, c] + dy[t, 1]) * xx[t - 1, c]
    np.testing.assert_allclose(out[0], want, rtol=1e-6)


def test_fresh_conv_is_an_exact_noop():
    conv = DynamicConv(32, 16)
    x = mx.random.normal((2, 5, 32))
    y, dyn = conv.prepare(x)
    assert mx.array_equal(y, x) and mx.array_equal(conv.finish(x, dyn), x)


def test_selector_scores_and_walk_on_a_hand_case():
    unary = mx.array([[2.0, 1.0], [0.0, 0.5]])  # T=2, k=2
    cand = mx.array([[5, 6], [7, 8]])
    gate = mx.ones((2, 1))
    A = mx.zeros((10, 1)).at[4].add(1.0).at[5].add(3.0).at[6].add(-1.0)
    B = mx.zeros((10, 1)).at[5].add(0.0).at[6].add(2.0).at[7].add(1.0).at[8].add(-1.0)
    S = pair_scores_reference(unary, cand, gate, mx.array(4), A, B)
    # Position 1 from anchor 4 (A=1): 5 -> 2 + 0 = 2, 6 -> 1 + 2 = 3.
    np.testing.assert_allclose(np.array(S[0, 0]), [2.0, 3.0])
    # Position 2 from candidate 5 (A=3): 7 -> 0 + 3, 8 -> 0.5 - 3; from 6 (A=-1): -1, 1.5.
    np.testing.assert_allclose(np.array(S[1]), [[3.0, -2.5], [-1.0, 1.5]])
    path, _ = walk_reference(S, 0.0)
    assert path.tolist() == [1, 1]  # 6 then 8: the pair term overrides unary at step 1
    # Ties go to the lowest index.
    tied = mx.zeros((1, 3, 3))
    assert walk_reference(tied, 0.0)[0].tolist() == [0]
    # Sampling by inverse CDF with the given uniforms.
    path, q = walk_reference(S, 1.0, mx.array([0.0, 0.999999]))
    assert path.tolist() == [0, 1]
    np.testing.assert_allclose(np.array(q[0]), np.exp([2, 3]) / np.exp([2, 3]).sum(), rtol=1e-5)


def hidden(drafter, ctx, block):
    cache = drafter.make_cache()
    drafter.append_context(ctx, cache)
    return drafter(block, cache)


def test_context_in_chunks_equals_context_at_once():
    cfg = config()
    drafter = bound(cfg)
    ctx = mx.random.normal((1, 9, 64))
    block = mx.array([[3, 2, 2, 2, 2]])
    cache = drafter.make_cache()
    for a, b in [(0, 4), (4, 5), (5, 9)]:
        drafter.append_context(ctx[:, a:b], cache)
    np.testing.assert_allclose(np.array(drafter(block, cache)), np.array(hidden(drafter, ctx, block)),
                               atol=1e-5)


def test_context_is_read():
    drafter = bound(config())
    ctx = mx.random.normal((1, 6, 64))
    block = mx.array([[3, 2, 2, 2, 2]])
    a, b = hidden(drafter, ctx, block), hidden(drafter, ctx.at[:, 0].add(1.0), block)
    assert not np.allclose(np.array(a), np.array(b))


def test_sliding_window_sees_only_the_last_window_minus_one_rows():
    cfg = config(layer_types=["sliding_attention", "sliding_attention"], sliding_window=4)
    drafter = bound(cfg)
    ctx = mx.random.normal((1, 8, 64))
    block = mx.array([[3, 2, 2, 2, 2]])
    base = hidden(drafter, ctx, block)
    # Rows 0..4 are outside the window (8 - (4 - 1) = 5): changing them changes nothing.
    same = hidden(drafter, ctx.at[:, :5].add(3.0), block)
    np.testing.assert_allclose(np.array(base), np.array(same), atol=1e-6)
    diff = hidden(drafter, ctx.at[:, 5].add(3.0), block)
    assert not np.allclose(np.array(base), np.array(diff))


@pytest.mark.parametrize("causal", [True, False])
def test_block_causality_follows_is_causal(causal):
    drafter = bound(config(is_causal=causal))
    ctx = mx.random.normal((1, 4, 64))
    a = hidden(drafter, ctx, mx.array([[3, 2, 2, 2, 2]]))
    b = hidden(drafter, ctx, mx.array([[3, 2, 2, 2, 7]]))  # change the last block row
    same_prefix = np.allclose(np.array(a[:, :4]), np.array(b[:, :4]), atol=1e-6)
    assert same_prefix == causal


def test_default_causality_is_causal_iff_sliding():
    cfg = config(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    assert cfg.block_is_causal(0) and not cfg.block_is_causal(1)
    assert config(is_causal=False).block_is_causal(0) is False


def test_output_multiplier_softcap_and_input_scale():
    plain = bound(config())
    h = mx.random.normal((3, 32))
    scaled = bound(config(dflash_config=dict(block_size=5, mask_token_id=2, target_layer_ids=[1, 2],
                                             output_multiplier=0.5, final_logit_softcapping=2.0,
                                             input_embedding_scale=3.0, conv_group_size=16,
                                             selector_rank=8, selector_top_k=4)))
    want = np.tanh(np.array(plain.logits(h)) * 0.5 / 2.0) * 2.0
    np.testing.assert_allclose(np.array(scaled.logits(h)), want, rtol=1e-5, atol=1e-6)
    ids = mx.array([[1, 2]])
    np.testing.assert_allclose(np.array(scaled.embed(ids)), 3 * np.array(plain.embed(ids)), rtol=1e-6)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B-DFlash-b16
    assert default_target_layer_ids(64, 1) == [32]


def test_v2_greedy_walk_with_zero_successor_codebook_equals_v1_argmax():
    drafter = bound(config())
    ctx = mx.random.normal((1, 5, 64))
    h = hidden(drafter, ctx, mx.array([[3, 2, 2, 2, 2]]))
    tokens, _ = propose(drafter, h, mx.array(3), SamplingParams())
    assert tokens.tolist() == mx.argmax(drafter.logits(h[0, 1:]), axis=-1).tolist()
