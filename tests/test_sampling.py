"""Sampling is lossless: DFlash's emitted tokens follow the target's own sampling
distribution exactly, for v1 (q = drafter distribution) and v2 (q over the
selector's candidates), with temperature, top-p, top-k, min-p, XTC and a logits processor.

The exact distribution of the first three generated tokens is enumerated with an
independent numpy re-implementation of mlx-lm's sampling rules (processors, then
top-p, min-p, XTC, top-k on log-probabilities, then softmax(x / temp); XTC a coin per
token) from the target's
own logits.  A chi-square goodness-of-fit test over N seeded runs (bins with an
expected count below 5 merged) must not reject at significance 1e-3; as a power
check the same samples must be rejected against the distribution at a different
temperature.
"""


import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import dflash2_mlx as d
from dflash2_mlx.request.sampling import (SamplingParams, accept, log_softmax, probs, verify_greedy,
                                       verify_lazy, verify_sampled)
from dflash2_mlx.generate import speculative_generate_step
from dflash2_mlx.loop.target import attach
from helpers import ref_probs, exact_joint, chi2_pvalue, params_of
from tiny_models import make_drafter, make_target

N = 1200
ALPHA = 1e-3
PROMPT = "ab"
REPEATING = "abab"  # "aba" occurred: a first token "a" makes the next block a copy


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    make_target(root / "t", "qwen3", alphabet="ab", seed=5, scale=1.5)
    out = {}
    for v in (1, 2):
        make_drafter(root / f"d{v}", root / "t", version=v, seed=20 + v, block_size=4)
        out[v] = d.load(str(root / "t"), str(root / f"d{v}"))
        # With a draft vocabulary that cannot propose ':' (the target can emit it).
        make_drafter(root / f"dv{v}", root / "t", version=v, seed=20 + v, block_size=4,
                     draft_vocab=[4, 0, 3, 1])
        out[f"{v}-vocab"] = d.load(str(root / "t"), str(root / f"dv{v}"))
    return out


SLOW = pytest.mark.slow  # the same check under more option mixes: CI's slow run has them
CASES = [
    (1, dict(temp=1.0)),
    pytest.param(2, dict(temp=0.8, top_p=0.9), marks=SLOW),
    pytest.param(1, dict(temp=0.7, top_k=3), marks=SLOW),
    (2, dict(temp=1.2, top_k=4, min_p=0.05, rep=(1.6, 4))),
    pytest.param("1-vocab", dict(temp=1.0), marks=SLOW),
    ("2-vocab", dict(temp=0.9, top_p=0.95)),
    pytest.param(2, dict(temp=1.0, xtc=(0.6, 0.1, ())), marks=SLOW),
    (1, dict(temp=0.8, min_p=0.02, top_k=4, xtc=(0.8, 0.15, (1,)))),
]


def sampled_runs(model, drafter, prompt, params, procs, n=N):
    """Counts of the first three tokens over ``n`` seeded runs, and summed cycle stats."""
    target = attach(model, drafter)
    counts, totals = {}, dict(accepted=0, cycles=0, copies=0, copied=0)
    for seed in range(n):
        mx.random.seed(seed)
        steps = speculative_generate_step(mx.array(prompt), target, drafter, max_tokens=3,
                                          params=params, logits_processors=procs, block_size=3)
        toks = []
        for t, _, _, st in steps:
            toks.append(t)
        totals["accepted"] += st.total_accepted
        totals["cycles"] += st.cycles
        totals["copies"] += st.copies
        totals["copied"] += st.copied
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
    return counts, totals


@pytest.mark.parametrize("version,kw", CASES)
def test_first_tokens_follow_target_distribution(setup, version, kw):
    model, tok, drafter = setup[version]
    prompt = tok.encode(PROMPT)
    rep = kw.pop("rep", None)
    params = params_of(kw)
    procs = make_logits_processors(repetition_penalty=rep[0], repetition_context_size=rep[1]) if rep else None
    counts, totals = sampled_runs(model, drafter, prompt, params, procs)
    joint = exact_joint(model, prompt, 3, rep=rep, **kw)
    assert abs(sum(joint.values()) - 1) < 1e-9
    p = chi2_pvalue(counts, joint, N)
    assert p > ALPHA, f"sampled tokens do not follow the target distribution (p = {p:.2e})"
    # Both branches of rejection sampling ran: some drafts accepted, some rejected.
    assert 0 < totals["accepted"] < 2 * totals["cycles"]
    # Power: the same samples reject a nearby wrong distribution.
    wrong = [exact_joint(model, prompt, 3, rep=rep, **{**kw, "temp": kw["temp"] * 2})]
    if "xtc" in kw:  # ... and the target's distribution without XTC
        wrong.append(exact_joint(model, prompt, 3, rep=rep, **{**kw, "xtc": None}))
    for w in wrong:
        assert chi2_pvalue({k: v for k, v in counts.items() if k in w}, w,
                           sum(v for k, v in counts.items() if k in w)) < ALPHA


# With top-p this target never samples the copied token (its rejections are tested there).
@pytest.mark.parametrize("kw,accepts", [(dict(temp=1.0), True),
                                        pytest.param(dict(temp=0.7, top_p=0.95, rep=(1.1, 4)), False, marks=SLOW)])
def test_copied_blocks_follow_target_distribution(setup, kw, accepts):
    """A prompt that repeats itself: where the first token continues the repetition the
    block is a copy (one-hot rows, no drafter pass), elsewhere a draft; either way the
    three tokens follow the target's own distribution."""
    model, tok, drafter = setup[2]
    prompt = tok.encode(REPEATING)
    rep = kw.pop("rep", None)
    procs = make_logits_processors(repetition_penalty=rep[0], repetition_context_size=rep[1]) if rep else None
    counts, totals = sampled_runs(model, drafter, prompt, SamplingParams(**kw), procs)
    joint = exact_joint(model, prompt, 3, rep=rep, **kw)
    p = chi2_pvalue(counts, joint, N)
    assert p > ALPHA, f"sampled tokens do not follow the target distribution (p = {p:.2e})"
    # Copies were verified, and a copied token was sometimes accepted and sometimes not.
    assert 0 < totals["copies"] < totals["cycles"]
    assert (0 < totals["copied"] if accepts else totals["copied"] == 0)
    assert totals["copied"] < 2 * totals["copies"]
    wrong = exact_joint(model, prompt, 3, rep=rep, **{**kw, "temp": kw["temp"] * 2})
    assert chi2_pvalue({k: v for k, v in counts.items() if k in wrong}, wrong,
                       sum(v for k, v in counts.items() if k in wrong)) < ALPHA


@pytest.mark.parametrize("temp,top_k,min_p,xtc", [(1.0, 0, 0.0, (0.5, 0.1, ())),
                                                  (0.9, 4, 0.1, (0.8, 0.13, (0,)))])
def test_xtc_mixture_is_mlx_lms_sampler(temp, top_k, min_p, xtc):
    """``probs`` with XTC is the distribution of mlx-lm's own sampler (a coin per token, then
    its chain), checked against draws of ``make_sampler`` and the numpy reference."""
    logits = np.log(np.array([0.3, 0.25, 0.2, 0.12, 0.08, 0.05])) + 0.3
    params = params_of(dict(temp=temp, top_k=top_k, min_p=min_p, xtc=xtc))
    ours = np.array(probs(log_softmax(mx.array(logits, dtype=mx.float32)[None]), params)[0])
    ref = ref_probs(logits, [], temp, top_k=top_k, min_p=min_p, xtc=xtc)
    np.testing.assert_allclose(ours, ref, atol=1e-6)
    sampler = make_sampler(temp, min_p=min_p, top_k=top_k, xtc_probability=xtc[0],
                           xtc_threshold=xtc[1], xtc_special_tokens=list(xtc[2]))
    mx.random.seed(0)
    lp = log_softmax(mx.array(logits, dtype=mx.float32)[None])
    n = 4000
    draws = np.array([sampler(lp).item() for _ in range(n)])
    counts = {(t,): int((draws == t).sum()) for t in range(len(logits)) if (draws == t).any()}
    joint = {(t,): float(p) for t, p in enumerate(ref) if p > 0}
    assert chi2_pvalue(counts, joint, n) > ALPHA
    # Power: the same draws reject the distribution without XTC.
    plain = ref_probs(logits, [], temp, top_k=top_k, min_p=min_p)
    kept = {k: v for k, v in counts.items() if plain[k[0]] > 0}
    assert chi2_pvalue(kept, {(t,): float(p) for t, p in enumerate(plain) if p > 0},
                       sum(kept.values())) < ALPHA


def test_sampling_params_refuse_what_mlx_lm_refuses():
    for bad in (dict(xtc_probability=1.5), dict(xtc_threshold=0.6), dict(min_tokens_to_keep=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(temp=1.0, **bad)


@pytest.mark.parametrize("kw", [dict(), dict(temp=1.0), dict(temp=0.8, top_p=0.9, top_k=6),
                                dict(temp=1.1, min_p=0.05, xtc=(0.5, 0.1, (2,)))])
def test_single_stream_and_batch_share_the_accept_rule(kw):
    """On random rows and drafts (drawn from rows q near the target's, one-hot as a copy's
    in some), with the same key: a single stream's ``verify_greedy`` / ``verify_sampled``
    and a batch's ``verify_lazy`` read by ``accept`` accept as many drafts, emit the same
    token with the same log-probabilities, and leave the key where the other leaves it."""
    params = params_of(kw)
    rng = np.random.default_rng(7)
    vocab, n = 16, 4
    counts = set()
    for trial in range(80):
        logits = rng.normal(size=(n + 1, vocab)) * 2.0
        q = np.exp(logits[:n] + rng.normal(size=(n, vocab)) * 0.7)
        q /= q.sum(axis=-1, keepdims=True)
        draft = np.array([rng.choice(vocab, p=row) for row in q])
        if params.greedy:  # the target's own argmax for a random prefix, then the draws
            agree = rng.integers(0, n + 1)
            draft[:agree] = logits[:agree].argmax(axis=-1)
        elif trial % 4 == 0:  # a copy: its rows q are one-hot
            q = np.eye(vocab)[draft]
        logits, q = mx.array(logits, dtype=mx.float32), mx.array(q, dtype=mx.float32)
        draft = mx.array(draft, dtype=mx.int32)
        mx.random.seed(trial)
        if params.greedy:
            accepted, token, logprobs = verify_greedy(logits, draft)
        else:
            accepted, token, logprobs = verify_sampled(logits, q, draft, params)
        single_key = mx.random.state[0].tolist()
        mx.random.seed(trial)
        ok, candidates = verify_lazy(log_softmax(logits), draft, None if params.greedy else q, params)
        mx.eval(ok, candidates)
        assert mx.random.state[0].tolist() == single_key
        assert accept(ok.tolist(), candidates.tolist()) == (accepted, token)
        np.testing.assert_allclose(np.array(logprobs), np.array(log_softmax(logits)[: accepted + 1]),
                                   rtol=0, atol=1e-6)
        counts.add(accepted)
    assert {0, n} <= counts and len(counts) >= 3, f"too few outcomes to compare: {counts}"
