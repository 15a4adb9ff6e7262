"""Greedy parity with plain mlx-lm decoding, and cache rollback after every cycle."""

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

import dflash2_mlx as d
from dflash2_mlx.adaptive import COPY_LARGEST
from dflash2_mlx.loop.draft_context import chat_contexts
from dflash2_mlx.generate import speculative_generate_step
from dflash2_mlx.loop.target import attach
from dflash2_mlx.request.sampling import SamplingParams, accept_greedy, clear_winners, log_softmax, verify_greedy
from helpers import cache_arrays, dflash_tokens, plain_tokens
from tiny_models import looping_pair, make_drafter, make_target

FAMILIES = ["llama", "llama_sliding", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_next", "qwen3_5_moe",
            "muse_glimmer", "gemma4_text", "gemma4"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """family -> (model, tokenizer, {1: v1 drafter, 2: v2 drafter}).

    A 4-letter alphabet keeps the vocabulary at 8, so random drafters are right
    often enough to give partial acceptances, full ones and rejections."""
    out = {}
    for fam in FAMILIES:
        root = tmp_path_factory.mktemp(fam)
        make_target(root / "t", fam, alphabet="abcd", seed=3)
        drafters = {}
        for v in (1, 2):
            # Random drafters vary: take the first seed whose drafts are sometimes
            # accepted and sometimes rejected on this target.
            for seed in range(10, 60):
                make_drafter(root / f"d{v}", root / "t", version=v, seed=seed)
                model, tok, drafter = d.load(str(root / "t"), str(root / f"d{v}"))
                _, stats = dflash_tokens(model, drafter, tok.encode("abcab dcba"), 16, 4)
                if 0 < stats.total_accepted < 3 * stats.cycles:
                    break
            drafters[v] = drafter
        out[fam] = (model, tok, drafters)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity_all_block_sizes(pairs, family):
    model, tok, drafters = pairs[family]
    prompt = tok.encode("abcab dcba")
    ref = plain_tokens(model, prompt, MAX_TOKENS)
    accepted_any = False
    for v in (1, 2):
        for block_size in range(1, 9):
            out, stats = dflash_tokens(model, drafters[v], prompt, MAX_TOKENS, block_size)
            assert out == ref, f"{family} v{v} block {block_size}: diverged from mlx-lm"
            accepted_any |= stats.total_accepted > 0
    assert accepted_any, "the test pair never accepted a draft token: it tests nothing"


def test_public_stream_generate_matches_mlx_lm(pairs):
    model, tok, drafters = pairs["qwen3"]
    prompt = "abc dab"
    ref = plain_tokens(model, tok.encode(prompt), 16)
    responses = list(d.stream_generate(model, tok, prompt, drafters[2], max_tokens=16))
    assert [r.token for r in responses] == ref[: len(responses)]
    last = responses[-1]
    assert last.finish_reason in ("length", "stop")
    assert last.cycles > 0 and last.tau >= 1.0
    # Block size "auto": drafts up to the trained 8, copies up to COPY_LARGEST rows.
    assert len(last.acceptance_counts) == COPY_LARGEST - 1
    assert sum(last.block_sizes.values()) == last.cycles
    assert set(last.block_sizes) <= set(range(1, COPY_LARGEST + 1))
    off = [r.token for r in d.stream_generate(model, tok, prompt, drafters[2], max_tokens=16,
                                              verify_mode="off")]
    assert off == [r.token for r in responses]


@pytest.mark.parametrize("family", ["qwen3", "llama_sliding", "qwen3_5"])
def test_a_chat_through_one_prompt_cache_is_mlx_lms(pairs, family):
    """mlx-lm's multi-turn use of ``prompt_cache``: each turn's prompt goes in after what the
    cache holds, which ends holding every token yielded (not a draft accepted past the last
    one read). Every turn's tokens and the cache's length after it are
    mlx_lm.stream_generate's, whether a turn ends at max_tokens, at its end of sequence or
    where its reader stops."""
    model, tok, drafters = pairs[family]
    turns = ["abcab dcba", "dd cc", "a b c d", "bbbb", "cab"]

    def chat(stream):
        cache, out = make_prompt_cache(model), []
        for i, text in enumerate(turns):
            tokens = []
            for r in stream(tok.encode(text), cache):
                tokens.append(r.token)
                if i == 2 and len(tokens) == 5:  # a reader that stops early
                    break
            out.append((tokens, max(c.offset for c in cache if hasattr(c, "offset"))))
        return out

    for bias in ({}, {1: -100.0}):  # end-of-sequence allowed, and not
        procs = make_logits_processors(logit_bias=bias) if bias else None
        want = chat(lambda ids, cache: mlx_lm.stream_generate(model, tok, ids, max_tokens=13, prompt_cache=cache,
                                                               logits_processors=procs))
        for block_size in (4, 8):
            got = chat(lambda ids, cache: d.stream_generate(model, tok, ids, drafters[2], max_tokens=13,
                                                            block_size=block_size, prompt_cache=cache,
                                                            logits_processors=procs))
            assert got == want, f"{family} block {block_size} bias {bias}"


def test_a_chat_through_one_prompt_cache_keeps_the_drafters_context(pairs):
    """Beside a prompt cache used as mlx-lm uses it, the drafter's context of the same tokens
    is kept from turn to turn (one row per token the cache holds); a cache that another
    generator has moved on gets a fresh one."""

    model, tok, drafters = pairs["qwen3"]
    cache, seen = make_prompt_cache(model), []
    for i, text in enumerate(["abcab dcba", "dd cc", "a b c d"]):
        for n, _ in enumerate(d.stream_generate(model, tok, tok.encode(text), drafters[2], max_tokens=13,
                                                block_size=4, prompt_cache=cache)):
            if i == 1 and n == 4:  # a reader that stops early
                break
        seen.append(chat_contexts[cache[0]])
        assert seen[-1].size == cache[0].offset > 0
    assert seen[0] is seen[1] is seen[2]
    list(mlx_lm.stream_generate(model, tok, tok.encode("bbbb"), max_tokens=5, prompt_cache=cache))
    list(d.stream_generate(model, tok, tok.encode("cab"), drafters[2], max_tokens=5, prompt_cache=cache))
    fresh = chat_contexts[cache[0]]
    assert fresh is not seen[0] and fresh.size < cache[0].offset  # only its own turn's tokens


@pytest.fixture(scope="module")
def kv_pairs(tmp_path_factory):
    """family -> (model, tokenizer, drafter) with 32-wide heads (MLX quantizes groups of 32+)."""
    out = {}
    for fam in ("qwen3", "qwen3_5"):
        root = tmp_path_factory.mktemp("kv-" + fam)
        make_target(root / "t", fam, alphabet="abcd", seed=3, head_dim=32)
        make_drafter(root / "d", root / "t", version=2, seed=11)
        out[fam] = d.load(str(root / "t"), str(root / "d"))
    return out


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("kv_bits,start", [(8, 0), (4, 0), (2, 0), (2, 17), (2, 5000)])
def test_kv_bits_as_mlx_lm_quantizes(kv_pairs, family, kv_bits, start):
    """mlx-lm's KV cache quantization (kv_bits, quantized_kv_start): from the start (the
    prompt's last token already reads quantized keys), from a token mid-reply (17: the
    prompt has 10), never (5000). The tokens are mlx-lm's, whatever the block size."""
    model, tok, drafter = kv_pairs[family]
    prompt = tok.encode("abcab dcba")
    kv = dict(kv_bits=kv_bits, kv_group_size=32, quantized_kv_start=start)
    procs = make_logits_processors(logit_bias={1: -100.0})  # no end of sequence: a longer text
    want = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS,
                                             logits_processors=procs, **kv)]
    if start == 0 and kv_bits == 2:  # the quantization shows in the text: the test can fail
        assert want != plain_tokens(model, prompt, MAX_TOKENS, procs)
    target = attach(model, drafter)
    for block_size in (2, 4, 8):
        steps = speculative_generate_step(mx.array(prompt), target, drafter, max_tokens=MAX_TOKENS,
                                          block_size=block_size, logits_processors=procs, **kv)
        assert [t for t, *_ in steps] == want, f"{family} kv_bits {kv_bits} start {start} block {block_size}"


@pytest.mark.parametrize("start", [12, 20, 27, 33])
def test_kv_bits_in_a_chat_through_one_prompt_cache(kv_pairs, start):
    """Quantization starting somewhere in a chat kept in one prompt cache (as mlx-lm keeps
    it): every turn's tokens, the cache's length and whether it is quantized are mlx-lm's."""
    model, tok, drafter = kv_pairs["qwen3"]
    kv = dict(kv_bits=2, kv_group_size=32, quantized_kv_start=start)
    procs = make_logits_processors(logit_bias={1: -100.0})

    def chat(stream):
        cache, out = make_prompt_cache(model), []
        for i, text in enumerate(["abcab dcba", "dd cc", "a b c d"]):
            tokens = []
            for r in stream(tok.encode(text), cache):
                tokens.append(r.token)
                if i == 1 and len(tokens) == 5:  # a reader that stops early
                    break
            out.append((tokens, cache[0].offset, isinstance(cache[0], QuantizedKVCache)))
        return out

    want = chat(lambda ids, cache: mlx_lm.stream_generate(model, tok, ids, max_tokens=8, prompt_cache=cache,
                                                           logits_processors=procs, **kv))
    for block_size in (4, 8):
        got = chat(lambda ids, cache: d.stream_generate(model, tok, ids, drafter, max_tokens=8, block_size=block_size,
                                                        prompt_cache=cache, logits_processors=procs, **kv))
        assert got == want, f"start {start} block {block_size}"


def test_a_max_kv_size_cache_is_refused_with_dflash(pairs):
    """mlx-lm's max_kv_size makes every layer a rotating cache the model's masks do not know
    of: a verify pass would read more keys than one-token steps (not mlx-lm's text), so
    DFlash refuses it by name; plain decoding runs it as mlx-lm does. A model's own sliding
    layers (llama_sliding) are no such cache."""
    model, tok, drafters = pairs["qwen3"]
    with pytest.raises(ValueError, match="bounds layer 0 to 16 tokens .mlx-lm's max_kv_size."):
        list(d.stream_generate(model, tok, "abc", drafters[2], max_tokens=4,
                               prompt_cache=make_prompt_cache(model, max_kv_size=16)))
    plain = [r.token for r in d.stream_generate(model, tok, "abc", drafters[2], max_tokens=4, verify_mode="off",
                                                 prompt_cache=make_prompt_cache(model, max_kv_size=16))]
    assert plain == [int(t) for t, _ in generate_step(mx.array(tok.encode("abc")), model, max_tokens=4,
                                                        max_kv_size=16)]
    model, tok, drafters = pairs["llama_sliding"]
    assert len(list(d.stream_generate(model, tok, "abc", drafters[2], max_tokens=4,
                                      prompt_cache=make_prompt_cache(model)))) == 4


def test_greedy_parity_with_repetition_penalty(pairs):
    model, tok, drafters = pairs["qwen3"]
    prompt = tok.encode("aabbccdd")
    procs = make_logits_processors(repetition_penalty=1.8, repetition_context_size=6)
    ref = plain_tokens(model, prompt, MAX_TOKENS, procs)
    for v in (1, 2):
        out, _ = dflash_tokens(model, drafters[v], prompt, MAX_TOKENS, 4, procs)
        assert out == ref


def test_emitted_logprobs_match_mlx_lm(pairs):
    """Each emitted token's log-probabilities are the ones a plain mlx-lm step yields,
    whether the token was drafted, a bonus, or decoded plain (up to float rounding: a
    verify pass multiplies 1 + n rows where a plain step multiplies one)."""
    model, tok, drafters = pairs["qwen3"]
    prompt = mx.array(tok.encode("abcab dcba"))
    ref = [lp for _, lp in generate_step(prompt, model, max_tokens=MAX_TOKENS)]
    for block_size in (1, 3, 8):
        steps = speculative_generate_step(prompt, attach(model, drafters[2]), drafters[2],
                                          max_tokens=MAX_TOKENS, block_size=block_size)
        got = [lp for _, lp, _, _ in steps]
        assert len(got) == len(ref)
        for i, (a, b) in enumerate(zip(got, ref)):
            assert mx.allclose(a, b, atol=1e-4).item(), f"block {block_size}: token {i}'s logprobs differ"


def _reference_accept(logits, draft):
    logprobs = log_softmax(logits)
    accepted, bonus = accept_greedy(mx.argmax(logprobs, axis=-1), draft)
    return accepted, bonus, logprobs


def test_verify_greedy_equals_the_full_rule_on_random_rows():
    rng = np.random.default_rng(0)
    seen = set()
    for trial in range(200):
        n = int(rng.integers(1, 8))
        logits = mx.array(rng.normal(size=(n + 1, 64)).astype(np.float32) * 3)
        top = np.argmax(np.array(logits), axis=-1)
        agree = int(rng.integers(0, n + 1))  # the draft follows the argmax this far
        draft = np.where(np.arange(n) < agree, top[:n], (top[:n] + 1) % 64)
        draft = mx.array(draft.astype(np.int32))
        accepted, bonus, logprobs = verify_greedy(logits, draft)
        ref_accepted, ref_bonus, ref_logprobs = _reference_accept(logits, draft)
        assert (accepted, bonus) == (ref_accepted, ref_bonus)
        assert logprobs.shape[0] >= accepted + 1
        assert mx.array_equal(logprobs[: accepted + 1], ref_logprobs[: accepted + 1]).item()
        seen.add(accepted == n)
    assert seen == {True, False}


@pytest.mark.parametrize("draft_token", [7, 0])
def test_verify_greedy_follows_logprobs_where_rounding_ties_logits(draft_token):
    """Logits 1.0 everywhere but one ulp more at index 7: after subtracting the log-sum both
    round to one value, so mlx-lm's argmax over log-probabilities picks index 0 where the
    raw logits' argmax says 7.  Acceptance must follow the log-probabilities either way."""
    row = np.ones(1000, dtype=np.float32)
    row[7] = np.nextafter(np.float32(1.0), np.float32(2.0))
    logits = mx.array(np.stack([row, row]))
    assert int(mx.argmax(logits[0]).item()) == 7
    assert int(mx.argmax(log_softmax(logits[0])).item()) == 0  # the premise of this test
    draft = mx.array([draft_token], dtype=mx.int32)
    accepted, bonus, logprobs = verify_greedy(logits, draft)
    assert (accepted, bonus) == _reference_accept(logits, draft)[:2]
    assert (accepted, bonus) == ((1, 0) if draft_token == 0 else (0, 0))


def _scale_tree(module, key_filter, fn):
    params = dict(tree_flatten(module.parameters()))
    module.load_weights([(k, fn(k, v)) for k, v in params.items() if key_filter(k)], strict=False)


@pytest.mark.parametrize("agree", [True, False])
def test_always_accepted_and_always_rejected(tmp_path, agree):
    """A target whose greedy token never changes, and a drafter that always proposes
    it (every draft accepted) or always proposes another (every draft rejected).

    Embedding channel 0 is huge for every token and both final norms keep only that
    channel, so both heads reduce to lm_head[:, 0] times a positive (or, for the
    rejecting drafter, negative) number."""
    model, tok, drafter, only0 = looping_pair(tmp_path)
    drafter.norm.weight = only0 if agree else -only0
    prompt = tok.encode("abc")
    ref = plain_tokens(model, prompt, 20)
    assert len(set(ref)) == 1
    for block_size in (2, 5, 8):
        out, stats = dflash_tokens(model, drafter, prompt, 20, block_size, lookup=False)
        assert out == ref
        if agree:
            assert stats.total_accepted == stats.cycles * (block_size - 1)
        else:
            assert stats.total_accepted == 0
        # The same loop copying where the sequence repeats: once the token has occurred
        # four times, every block is a copy and every copied token is accepted.
        out, stats = dflash_tokens(model, drafter, prompt, 20, block_size)
        assert out == ref and stats.copies > 0
        assert stats.copied == stats.copies * (block_size - 1)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_cache_equals_fresh_prefill_after_every_cycle(pairs, family, temp):
    model, tok, drafters = pairs[family]
    drafter = drafters[2]
    target = attach(model, drafter)
    prompt = tok.encode("dcba abcd")
    cache = target.make_cache()
    mx.random.seed(7)
    steps = speculative_generate_step(
        mx.array(prompt), target, drafter, max_tokens=30, block_size=4,
        params=SamplingParams(temp=temp), prompt_cache=cache)
    tokens, seen_cycles, checks = [], 0, []
    for t, _, _, stats in steps:
        if stats.cycles != seen_cycles:  # first token of a new cycle: cache rolled back
            seen_cycles = stats.cycles
            checks.append((len(tokens), stats.accepted, cache_arrays(cache)))
        tokens.append(t)
    assert len(checks) >= 5
    for n_before, accepted, state in checks:
        committed = prompt + tokens[: n_before + accepted]
        fresh = target.make_cache()
        target(mx.array([committed]), fresh)
        ref = cache_arrays(fresh)
        assert len(ref) == len(state)
        for a, b in zip(state, ref):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_quantized_target_agreement(tmp_path, family):
    """4-bit targets: verify (B rows) and decode (1 row) use different quantized matmul
    kernels, so exact parity is not guaranteed; measure agreement and require it high."""
    make_target(tmp_path / "t", family, alphabet="abcd", seed=3)
    make_drafter(tmp_path / "d", tmp_path / "t", version=2)
    model, tok, drafter = d.load(str(tmp_path / "t"), str(tmp_path / "d"))
    nn.quantize(model, group_size=32, bits=4)
    agree = total = 0
    for text in ["abc", "dcba", "bad cab"]:
        prompt = tok.encode(text)
        ref = plain_tokens(model, prompt, 24)
        out, _ = dflash_tokens(model, drafter, prompt, 24, 4)
        n = min(len(ref), len(out))
        agree += next((i for i in range(n) if ref[i] != out[i]), n)
        total += n
    print(f"{family} 4-bit: {agree}/{total} tokens agree before the first divergence")
    assert agree >= 0.9 * total


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_chunked_prefill_parity(pairs, family):
    model, tok, drafters = pairs[family]
    prompt = tok.encode("abcd dcba abab cdcd aabb ccdd")
    ref = plain_tokens(model, prompt, 16)
    out = [r.token for r in d.stream_generate(model, tok, prompt, drafters[2], max_tokens=16,
                                              block_size=4, prefill_step_size=5)]
    assert out == ref[: len(out)]


def test_clear_winners_margin():
    """Rows whose two largest logits are far apart skip the log-softmax; rows within the
    rounding margin (one ulp, or a few eps) do not."""
    far = mx.array([[0.0, 3.0, 1.0], [2.0, -1.0, 1.9]])
    assert clear_winners(far, mx.argmax(far, axis=-1))
    one = np.float32(1.0)
    near = mx.array(np.array([[one, np.nextafter(one, np.float32(2.0)), 0.0]], dtype=np.float32))
    assert not clear_winners(near, mx.argmax(near, axis=-1))
    close = mx.array([[5.0, 5.0 + 2e-6, 0.0]])
    assert not clear_winners(close, mx.argmax(close, axis=-1))
