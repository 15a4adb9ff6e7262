"""A draft vocabulary: the drafter scores only a subset of the target's LM head rows.

Drafting over fewer rows changes what is proposed, never what is emitted: greedy
output stays the target's own token for token, and the checkpoint extension
(``draft_vocab`` tensor + ``draft_vocab_size``) is validated as data."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import dflash2_mlx as d
from dflash2_mlx.loop.target import attach
from dflash2_mlx.model.checkpoint import CheckpointError, load_drafter, quantize, save_drafter
from dflash2_mlx.model.drafter import propose
from dflash2_mlx.request.sampling import SamplingParams
from helpers import dflash_tokens, plain_tokens
from tiny_models import SPECIALS, make_drafter, make_target

ALPHABET = "abcd"


def letter_ids(tok, letters):
    return [tok.encode(c)[0] for c in letters]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    make_target(root / "t", "qwen3", alphabet=ALPHABET, seed=3)
    model, tok = d.load(str(root / "t"))[:2]
    # The target mostly repeats <pad>; leave 'c', 'd' and <mask> out.
    vocab = letter_ids(tok, "ba") + [SPECIALS.index("<pad>"), SPECIALS.index("<eos>")]
    drafters = {}
    for v in (1, 2):
        for seed in range(10, 60):
            make_drafter(root / f"d{v}", root / "t", version=v, seed=seed, draft_vocab=vocab)
            model, tok, drafter = d.load(str(root / "t"), str(root / f"d{v}"))
            _, stats = dflash_tokens(model, drafter, tok.encode("abcab dcba"), 16, 4)
            if 0 < stats.total_accepted < 3 * stats.cycles:
                break
        drafters[v] = drafter
    return root, model, tok, drafters, vocab


def test_greedy_parity_with_draft_vocab(pair):
    _, model, tok, drafters, vocab = pair
    prompt = tok.encode("abcab dcba")
    ref = plain_tokens(model, prompt, 24)
    accepted = 0
    for v in (1, 2):
        for block_size in range(1, 9):
            out, stats = dflash_tokens(model, drafters[v], prompt, 24, block_size)
            assert out == ref, f"v{v} block {block_size}: diverged from mlx-lm"
            accepted += stats.total_accepted
    assert accepted > 0, "no draft token was ever accepted: the test pair tests nothing"


@pytest.mark.parametrize("quantized", [False, True])
def test_draft_logits_are_the_head_rows(pair, quantized):
    root, _, _, _, vocab = pair
    model, _, drafter = d.load(str(root / "t"), str(root / "d2"))
    if quantized:
        nn.quantize(model, group_size=32, bits=8)
    target = attach(model, drafter)
    h = mx.random.normal((3, model.args.hidden_size))
    full = np.array(target.lm_head(h))
    np.testing.assert_allclose(np.array(drafter.logits(h)), full[:, vocab], rtol=1e-5, atol=1e-5)


def test_proposals_stay_inside_the_draft_vocab(pair):
    _, model, tok, drafters, vocab = pair
    for v in (1, 2):
        drafter = drafters[v]
        target = attach(model, drafter)
        cache = drafter.make_cache()
        _, feats = target(mx.array([tok.encode("abcab")]), target.make_cache())
        drafter.append_context(feats, cache)
        block = mx.array([[vocab[0]] + [drafter.config.mask_token_id] * 4])
        for temp in (0.0, 1.0):
            tokens, q = propose(drafter, drafter(block, cache), mx.array(vocab[0]), SamplingParams(temp=temp))
            assert set(tokens.tolist()) <= set(vocab)
            if temp:
                assert q.shape == (4, model.args.vocab_size)
                outside = np.delete(np.array(q), vocab, axis=1)
                assert not outside.any() and np.allclose(np.array(q).sum(-1), 1, atol=1e-5)


def test_draft_vocab_round_trips_and_is_not_trained(pair, tmp_path):
    _, _, _, drafters, vocab = pair
    drafter = drafters[2]
    assert "draft_vocab" not in dict(tree_flatten(drafter.trainable_parameters()))
    save_drafter(drafter, tmp_path / "copy")
    cfg = json.loads((tmp_path / "copy" / "config.json").read_text())
    assert cfg["dflash_config"]["draft_vocab_size"] == len(vocab)
    assert load_drafter(str(tmp_path / "copy")).draft_vocab.tolist() == vocab


@pytest.mark.parametrize("bad,message", [
    ([0, 1, 2, 999], "outside the vocabulary"),
    ([3, 3, 4, 5], "repeats token ids"),
])
def test_bad_draft_vocab_is_refused(pair, tmp_path, bad, message):
    root = pair[0]
    make_drafter(tmp_path / "d", root / "t", version=2, draft_vocab=bad)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(str(tmp_path / "d"))


def test_draft_vocab_smaller_than_top_k_is_refused(pair, tmp_path):
    root = pair[0]
    make_drafter(tmp_path / "d", root / "t", version=2, draft_vocab=[3, 4, 5, 6])
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["dflash_config"]["draft_vocab_size"] = 2
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="draft_vocab_size 2"):
        load_drafter(str(tmp_path / "d"))


@pytest.mark.skipif(mx.metal.is_available(), reason="on Metal quantized drafters stay quantized")
def test_quantized_drafter_runs_dequantized_on_cpu(pair, tmp_path):
    root, model, tok, drafters, _ = pair
    drafter = drafters[1]
    quantize(drafter, bits=8, group_size=32)
    save_drafter(drafter, tmp_path / "q", extra_config={"quantization": {"group_size": 32, "bits": 8}})
    loaded = load_drafter(str(tmp_path / "q"))
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.named_modules())
    x = mx.random.normal((2, model.args.hidden_size))
    np.testing.assert_allclose(np.array(loaded.layers[0].mlp(x)), np.array(drafter.layers[0].mlp(x)),
                               rtol=1e-4, atol=1e-4)
    prompt = tok.encode("abcab dcba")
    assert dflash_tokens(model, loaded, prompt, 16, 5)[0] == plain_tokens(model, prompt, 16)
