"""Adaptive speculation: the choice, the cost model and its cache, and that a block size
changing between cycles keeps the output lossless (greedy parity, caches equal a fresh
prefill, sampled tokens distributed as the target's), with fallback to plain decoding and
recovery."""

import contextlib
import json
import os
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

import dflash2_mlx as d
from dflash2_mlx import adaptive, calibration
from dflash2_mlx.calibration import keys, measure, pair_costs, store
from dflash2_mlx.adaptive import Acceptance, Adaptive, CostModel, best_block, expected_tokens
from dflash2_mlx.responses import blocks_text, stats_line
from dflash2_mlx.generate import speculative_generate_step
from dflash2_mlx.loop.draft_context import DraftContext
from dflash2_mlx.loop.plain import shadow_chance
from dflash2_mlx.loop.target import attach
from dflash2_mlx.machine.contention import BUSY_SHARE, SIMULATED_ENV, Watch
from dflash2_mlx.model.drafter import propose
from dflash2_mlx.request.sampling import SamplingParams, log_softmax, sample, verify_sampled
from helpers import cache_arrays, chi2_pvalue, exact_joint, plain_tokens
from tiny_models import looping_pair, make_drafter, make_target

# A CPU-like machine: each extra verified row costs 10% of a decode step, a draft 20%.
CPU = CostModel({1: (1.0, 0.0), 8: (1.7, 0.0)}, {2: (0.2, 0.0), 8: (0.2, 0.0)})
# A GPU-like one: verifying 8 rows costs what 1 does, drafting 5%.
GPU = CostModel({1: (1.0, 0.0), 8: (1.0, 0.0)}, {2: (0.05, 0.0), 8: (0.05, 0.0)})


class Scripted:
    """A policy that walks a fixed list of block sizes (then repeats it); every other
    plain step carries a shadow probe."""

    def __init__(self, sizes):
        self.sizes, self.i, self.largest = list(sizes), 0, max(sizes)
        self.copy_largest = self.largest
        self.plain, self.chances = 0, []

    def choose(self, context, copy=0):
        b = self.sizes[self.i % len(self.sizes)]
        self.i += 1
        return adaptive.Choice(b)

    def record(self, b, accepted, copy=False):
        pass

    def timed(self, b, seconds, copy=False):
        pass

    def shadow(self):
        self.plain += 1
        return self.plain % 2 == 1

    def record_shadow(self, chance):
        self.chances.append(chance)


SCRIPT = [1, 3, 1, 5, 2, 8, 1, 1, 4, 6]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    out = {}
    for fam in ("qwen3", "qwen3_5"):
        make_target(root / fam, fam, alphabet="abcd", seed=3)
        for seed in range(10, 60):  # a random drafter that is right now and then
            make_drafter(root / f"{fam}-d", root / fam, version=2, seed=seed)
            out[fam] = model, tok, drafter = d.load(str(root / fam), str(root / f"{fam}-d"))
            _, stats = run(model, drafter, tok.encode("abcab dcba"), 16, 4)
            if 0 < stats.total_accepted < 3 * stats.cycles:
                break
    return out


def run(model, drafter, prompt, n, block_size, params=SamplingParams(), **kw):
    steps = speculative_generate_step(mx.array(prompt), attach(model, drafter), drafter,
                                      max_tokens=n, block_size=block_size, params=params, **kw)
    tokens, stats = [], None
    for t, _, _, stats in steps:
        tokens.append(t)
    return tokens, stats


# --- the choice -----------------------------------------------------------------------------

def test_expected_tokens_and_best_block():
    assert expected_tokens([0.5, 0.5], 1) == 1.0
    assert expected_tokens([0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25)
    assert best_block([0.95] * 7, GPU, 0, 8) == 8  # drafts are nearly free: draft all
    assert best_block([0.05] * 7, CPU, 0, 8) == 1  # a drafter never right: plain decoding
    assert 1 < best_block([0.7] * 7, CPU, 0, 8) < 8  # in between: a middle block
    # A cost that grows with context on the target only makes drafting more worth it.
    long = CostModel({1: (1.0, 1e-3), 8: (1.7, 1e-3)}, {2: (0.2, 0.0), 8: (0.2, 0.0)})
    assert best_block([0.5] * 7, long, 4000, 8) >= best_block([0.5] * 7, long, 0, 8)


def test_cost_interpolates_between_measured_block_sizes():
    assert CPU.cycle(1, 0) == 1.0
    assert CPU.cycle(4, 0) == pytest.approx(1.0 + 0.3 + 0.2)
    assert CostModel.from_json(json.loads(json.dumps(CPU.to_json()))).cycle(5, 10) == CPU.cycle(5, 10)


def test_acceptance_rates_follow_the_request():
    acc = Acceptance.empty(4)
    assert acc.rates() == [0.5] * 4
    for _ in range(30):
        acc.record(5, 4)
    assert min(acc.rates()) > 0.9
    for _ in range(30):
        acc.record(5, 0)
    rates = acc.rates()
    assert rates[0] < 0.3  # recent rejections outweigh older acceptances
    assert Acceptance.empty(3).scaled(4.0).rates() == [0.5] * 3


def test_policy_falls_back_and_probes_with_backoff():
    policy = Adaptive(CPU, 8, Acceptance.empty(7))
    sizes = []
    for _ in range(200):
        b = policy.block_size(0)
        policy.record(b, 0)  # never accepted
        sizes.append(b)
    assert sizes[0] > 1 and sizes[-1] == 1 and policy.fallback
    probes = [i for i, b in enumerate(sizes) if b > 1 and i > 5]
    gaps = np.diff(probes)
    assert len(probes) >= 3 and all(g2 >= g1 for g1, g2 in zip(gaps, gaps[1:]))  # backing off
    assert gaps[-1] <= adaptive.PROBE_MAX + 1
    for _ in range(80):  # the drafter becomes right: probes see it, drafting resumes
        b = policy.block_size(0)
        policy.record(b, b - 1)
    assert not policy.fallback and policy.block_size(0) == 8


def test_sampled_requests_start_from_a_firmer_prior(pair):
    # A sampled request's first cycles are accepted or not by chance: three rejections must
    # not send it to plain decoding, where it would learn only from rare probes.
    greedy, sampled = Acceptance.empty(7), Acceptance.empty(7, adaptive.SAMPLED_PRIOR_WEIGHT)
    for acc in (greedy, sampled):
        for _ in range(3):
            acc.record(3, 0)
    assert greedy.rates()[0] < 0.25 < 0.35 < sampled.rates()[0]
    model, _, drafter = pair["qwen3"]
    target = attach(model, drafter)
    for greedy_request, weight in ((True, adaptive.PRIOR_WEIGHT), (False, adaptive.SAMPLED_PRIOR_WEIGHT)):
        chosen = calibration.policy(target, drafter, greedy=greedy_request, costs=CPU, history=False)
        assert chosen.acceptance.prior_weight == weight


def probe_gaps(policy, context, n=300):
    sizes = []
    for _ in range(n):
        b = policy.block_size(context)
        policy.record(b, 0)  # never accepted
        sizes.append(b)
    plain = sizes.index(1)  # the fallback: drafted cycles before it are not probes
    return np.diff([i for i, b in enumerate(sizes) if b > 1 and i >= plain - 1])


def test_probes_grow_rarer_where_verifying_costs_more():
    # Verifying 2 rows costs 1.1x a plain step at a short context, ~1.5x at 8k (attention).
    costs = CostModel({1: (1.0, 1e-4), 2: (1.1, 1.7e-4), 8: (1.7, 8e-4)}, {2: (0.05, 0.0), 8: (0.05, 0.0)})
    short = probe_gaps(Adaptive(costs, 8, Acceptance.empty(7)), 16)
    long = probe_gaps(Adaptive(costs, 8, Acceptance.empty(7)), 8000)
    extra = costs.cycle(2, 8000) / costs.cycle(1, 8000) - 1
    assert extra > 0.35 and min(long) > extra / adaptive.PROBE_BUDGET  # every failed probe amortized
    assert min(short) == adaptive.PROBE_FIRST + 1 < min(long)  # short context: the usual schedule
    assert max(short) == max(long) == adaptive.PROBE_MAX + 1  # backing off ends where it always did



def test_shadow_probes_follow_the_costs_and_feed_the_first_position():
    policy = Adaptive(CPU, 8, Acceptance.empty(7))  # a draft costs 0.2 of a plain step
    assert policy.block_size(0) > 1 and not policy.shadow()  # drafting: no shadows
    for _ in range(40):
        policy.record(policy.block_size(0), 0)
    assert policy.fallback
    shadows = [policy.shadow() for _ in range(70)]
    gaps = np.diff(np.flatnonzero(shadows))
    assert set(gaps) == {7}  # 0.2 / 7 < SHADOW_BUDGET <= 0.2 / 6
    assert not any(Adaptive(CPU, 8, Acceptance.empty(7), shadow_budget=0).shadow() for _ in range(50))
    before = policy.acceptance.rates()
    policy.record_shadow(1.0)
    after = policy.acceptance.rates()
    assert after[0] > before[0] and policy.acceptance.reached[1] < 1  # position 1 only
    quarter = Acceptance.empty(3)
    for _ in range(4):
        quarter.record_first(0.25)  # a sampled step's expected acceptance counts as a fraction
    assert quarter.accepted[0] / quarter.reached[0] == pytest.approx(0.25) and quarter.reached[1] == 0

# --- losslessness with the block size changing --------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_block_size_changing_keeps_greedy_parity(pair, family):
    model, tok, drafter = pair[family]
    prompt = tok.encode("abcab dcba")
    ref = plain_tokens(model, prompt, 40)
    scripted = Scripted(SCRIPT)
    out, stats = run(model, drafter, prompt, 40, scripted)
    assert out == ref
    assert set(stats.block_sizes) == set(SCRIPT) and stats.total_accepted > 0
    assert stats.shadows > 2 and set(scripted.chances) <= {0.0, 1.0}  # shadows leave the text alone
    for costs in (CPU, GPU):
        out, stats = run(model, drafter, prompt, 40, Adaptive(costs, 8, Acceptance.empty(7)))
        assert out == ref


def test_shadow_probes_leave_seeded_sampling_alone(pair):
    """The same seed gives the same sampled text with and without shadow probes."""
    model, tok, drafter = pair["qwen3"]
    prompt = tok.encode("abcab dcba")
    unshadowed = Scripted(SCRIPT)
    unshadowed.shadow = lambda: False
    outs = []
    for policy in (Scripted(SCRIPT), unshadowed):
        mx.random.seed(11)
        outs.append(run(model, drafter, prompt, 40, policy, SamplingParams(temp=1.0)))
    assert outs[0][0] == outs[1][0] and outs[0][1].shadows > 2 and outs[1][1].shadows == 0


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_pipelined_plain_steps_stop_where_asked(pair, family):
    """Block 1 runs pipelined plain steps (a step is built before the last one is read):
    every length, including the turns into and out of drafting, is the plain output."""
    model, tok, drafter = pair[family]
    prompt = tok.encode("abcab dcba")
    ref = plain_tokens(model, prompt, 12)
    for n in (1, 2, 3, 12):
        assert run(model, drafter, prompt, n, 1)[0] == ref[:n]
        assert run(model, drafter, prompt, n, Scripted([1, 1, 3, 1]))[0] == ref[:n]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_caches_equal_fresh_prefill_with_changing_block_size(pair, family, temp):
    """After every cycle the target cache equals a fresh prefill of the tokens it holds:
    the committed ones (a pipelined plain step has fed the token being read as well),
    never a rejected draft."""
    model, tok, drafter = pair[family]
    target = attach(model, drafter)
    prompt = tok.encode("dcba abcd")
    cache = target.make_cache()
    mx.random.seed(7)
    scripted = Scripted(SCRIPT)
    steps = speculative_generate_step(mx.array(prompt), target, drafter, max_tokens=30,
                                      block_size=scripted, params=SamplingParams(temp=temp),
                                      prompt_cache=cache)
    tokens, seen, checks = [], 0, []
    for t, _, _, stats in steps:
        if stats.cycles != seen:
            seen = stats.cycles
            held = next(c.offset for c in cache if hasattr(c, "offset")) - len(prompt)
            checks.append((len(tokens), held, cache_arrays(cache)))
        tokens.append(t)
    assert len(checks) >= 8 and scripted.chances and all(0 <= c <= 1 for c in scripted.chances)
    for n_before, held, state in checks:
        assert n_before - 1 <= held <= n_before + max(SCRIPT) - 1
        fresh = target.make_cache()
        target(mx.array([prompt + tokens[:held]]), fresh)
        for a, b in zip(state, cache_arrays(fresh)):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


def test_draft_context_fed_late_equals_fed_every_step(pair):
    model, tok, drafter = pair["qwen3"]
    target = attach(model, drafter)
    ids = mx.array([tok.encode("abcd dcba abca")])
    _, features = target(ids, target.make_cache())
    late, early = DraftContext(drafter), drafter.make_cache()
    for i in range(features.shape[1]):
        late.add(features[:, i : i + 1])
        drafter.append_context(features[:, i : i + 1], early)
    for a, b in zip(cache_arrays(late.fed()), cache_arrays(early)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    window = DraftContext(drafter, window=4)
    window.add(features)
    k, _ = window.fed()[0].keys_and_values()
    assert k.shape[2] == 4 and window.fed()[0].offset == features.shape[1]
    full = np.array(late.fed()[0].keys_and_values()[0])
    np.testing.assert_array_equal(np.array(k), full[..., -4:, :])
    # With sinks: the first 2 rows and the latest 4, each at its own position.
    sunk = DraftContext(drafter, window=4, sink=2)
    sunk.add(features)
    k, v = sunk.fed()[0].keys_and_values()
    np.testing.assert_array_equal(np.array(k), np.concatenate([full[..., :2, :], full[..., -4:, :]], axis=-2))
    assert v.shape == k.shape
    short = DraftContext(drafter, window=4, sink=features.shape[1] - 4)  # no more rows than sink + window: all
    short.add(features)
    np.testing.assert_array_equal(np.array(short.fed()[0].keys_and_values()[0]), full)


def test_draft_window_keeps_parity(pair):
    model, tok, drafter = pair["qwen3"]
    prompt = tok.encode("abcab dcba abcab")
    ref = plain_tokens(model, prompt, 24)
    for window, sink in ((1, 0), (3, 0), (2, 3)):
        out, _ = run(model, drafter, prompt, 24, 4, draft_window=window, draft_sink=sink)
        assert out == ref


def test_fallback_to_plain_and_recovery(tmp_path):
    model, tok, drafter, only0 = looping_pair(tmp_path)
    prompt = tok.encode("abc")
    ref = plain_tokens(model, prompt, 300)
    policy = Adaptive(CPU, 8, Acceptance.empty(7))
    steps = speculative_generate_step(mx.array(prompt), attach(model, drafter), drafter,
                                      max_tokens=300, block_size=policy, lookup=False)
    tokens, phases = [], {}
    for t, _, _, stats in steps:
        tokens.append(t)
        if len(tokens) == 100:  # rejected all along: decoding plain by now
            phases["rejected"] = (dict(stats.block_sizes), stats.fallback, stats.total_accepted)
            drafter.norm.weight = only0  # from here on every draft is right
            before = dict(stats.block_sizes)
    assert tokens == ref
    hist, fallback, accepted = phases["rejected"]
    assert fallback and accepted == 0 and hist[1] > 80  # mostly plain steps...
    assert sum(n for b, n in hist.items() if b > 1) >= 3  # ...after drafting, and probes
    assert not stats.fallback  # recovered: drafting again
    later = {b: n - before.get(b, 0) for b, n in stats.block_sizes.items()}
    assert later.get(8, 0) > 10 and stats.total_accepted > 100  # with the largest block


def test_copies_where_the_drafter_fails(tmp_path):
    """A target that repeats one token and a drafter that is never right: the policy
    falls back to plain steps for the drafter, yet once the token repeats the blocks are
    copies, growing to the largest size, all of them accepted; the text is the plain text."""
    model, tok, drafter, _ = looping_pair(tmp_path)
    prompt = tok.encode("abc")
    ref = plain_tokens(model, prompt, 120)
    policy = Adaptive(CPU, 8, Acceptance.empty(7))
    steps = speculative_generate_step(mx.array(prompt), attach(model, drafter), drafter,
                                      max_tokens=120, block_size=policy)
    tokens = []
    for t, _, _, stats in steps:
        tokens.append(t)
    assert tokens == ref
    # Copies grow to blocks of 8 as they keep being accepted; no draft ever is.
    assert stats.copies > 10 and stats.copied == stats.total_accepted > 7 * 10
    assert stats.block_sizes[8] >= 10 and stats.cycles < 30


def test_copies_grow_past_the_drafters_block(tmp_path):
    """With the block size chosen, a copy may verify up to COPY_LARGEST rows whatever the
    drafter's trained block; a number given as the largest block caps copies too."""
    model, tok, drafter, _ = looping_pair(tmp_path)
    target = attach(model, drafter)
    costs = CostModel({1: (1.0, 0.0), 8: (1.7, 0.0), 15: (2.2, 0.0)}, CPU.drafter)
    B = drafter.config.block_size
    policy = calibration.policy(target, drafter, costs=costs, history=False)
    assert policy.largest == B and policy.copy_largest == max(B, adaptive.COPY_LARGEST)
    prompt = tok.encode("abc")
    ref = plain_tokens(model, prompt, 150)
    tokens = []
    for t, _, _, stats in speculative_generate_step(mx.array(prompt), target, drafter,
                                                    max_tokens=150, block_size=policy):
        tokens.append(t)
    assert tokens == ref and stats.copied == stats.total_accepted
    assert max(stats.block_sizes) == policy.copy_largest > B
    assert calibration.policy(target, drafter, costs=costs, history=False, largest=5).copy_largest == 5


def test_copy_or_draft_by_expected_tokens_per_second():
    """With a copy on offer the policy verifies it when its acceptance beats the
    drafter's per second (a copy costs no drafter pass), else it drafts; a copy never
    moves the drafter's own fallback state."""
    good, bad = Acceptance([20.0] * 7, [19.0] * 7), Acceptance([20.0] * 7, [0.0] * 7)
    policy = Adaptive(CPU, 8, Acceptance([20.0] * 7, [10.0] * 7))
    policy.copies = good
    assert policy.choose(100, copy=7) == adaptive.Choice(8, copy=True)
    policy.record(8, 7, copy=True)
    assert policy.copies.accepted[6] > 19.0 and policy.acceptance.reached[0] == 20.0  # only copies learned
    assert policy.choose(100, copy=3) == adaptive.Choice(4, copy=True)  # no longer than the copy
    policy.copies = bad
    choice = policy.choose(100, copy=7)
    assert choice.block > 1 and not choice.copy
    assert policy.choose(100) == choice  # nothing on offer: the drafter
    # A request's first copy is tried even beside a drafter accepted well: the copies' prior
    # (COPY_PRIOR_RATE) is what copies were measured to reach, not the drafter's guess.
    fresh = Adaptive(CPU, 8, Acceptance([20.0] * 7, [14.0] * 7))
    assert fresh.copies.rates()[0] == pytest.approx(adaptive.COPY_PRIOR_RATE)
    choice = fresh.choose(100, copy=7)
    assert choice.block > 4 and choice.copy


def test_shadow_probes_bring_drafting_back_sooner(tmp_path):
    """After a fallback the drafter turns right: with shadow probes drafting resumes
    before a probe would have found it, and the text is the plain text either way."""
    model, tok, drafter, only0 = looping_pair(tmp_path)
    prompt = tok.encode("abc")
    ref = plain_tokens(model, prompt, 200)
    cheap = CostModel(CPU.target, {2: (0.05, 0.0), 8: (0.05, 0.0)})  # a shadow every 2 steps
    resumed = {}
    for budget in (adaptive.SHADOW_BUDGET, 0.0):
        drafter.norm.weight = -only0  # every draft rejected
        policy = Adaptive(cheap, 8, Acceptance.empty(7), shadow_budget=budget)
        steps = speculative_generate_step(mx.array(prompt), attach(model, drafter), drafter,
                                          max_tokens=200, block_size=policy, lookup=False)
        tokens = []
        for t, _, from_draft, stats in steps:
            tokens.append(t)
            if len(tokens) == 100:
                assert stats.fallback
                drafter.norm.weight = only0  # every draft right from here
            if from_draft and budget not in resumed:
                resumed[budget] = len(tokens)
        assert tokens == ref and (stats.shadows > 3) == (budget > 0)
    assert resumed[adaptive.SHADOW_BUDGET] <= 100 + 20 < resumed[0.0]


@pytest.mark.parametrize("version", [1, 2])
def test_shadow_chance_is_a_block_2_drafts_acceptance(tmp_path, version):
    """At T=1 a shadow probe's chance is exactly the chance that verifying a block-2 draft
    from the same place accepts its draft: compared with 3000 such verifications."""
    make_target(tmp_path / "t", "qwen3", alphabet="abcd", seed=5)
    make_drafter(tmp_path / "d", tmp_path / "t", version=version, seed=11)
    model, tok, drafter = d.load(str(tmp_path / "t"), str(tmp_path / "d"))
    target = attach(model, drafter)
    params = SamplingParams(temp=1.0)
    prompt = mx.array(tok.encode("abcab dc"))
    _, features = target(prompt[None, :-1], target.make_cache())
    context = DraftContext(drafter)
    context.add(features)
    token = prompt[-1:]
    logits, _ = target(prompt[None], target.make_cache())
    logprobs = log_softmax(logits[0, -1:].astype(mx.float32))
    step = (sample(logprobs, params), logprobs[0])
    mx.random.seed(123)
    chance = shadow_chance(drafter, context, token, step, params).item()
    after = mx.random.uniform(shape=(4,))
    mx.random.seed(123)
    assert mx.array_equal(after, mx.random.uniform(shape=(4,))).item()  # draws nothing
    # The verify pass's own first row is the same plain step's row.
    hidden = drafter(mx.array([[int(token[0]), drafter.config.mask_token_id]]), context.fed())
    n, hits = 3000, 0
    for i in range(n):
        mx.random.seed(i)
        draft, q = propose(drafter, hidden, token[0], params)
        rows = mx.concatenate([logits[0, -1:], logits[0, -1:]]).astype(mx.float32)
        hits += verify_sampled(rows, q, draft, params)[0]
    assert 0.05 < chance < 0.95
    assert abs(hits / n - chance) < 4 * (chance * (1 - chance) / n) ** 0.5

def test_stream_generate_reports_block_sizes(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    store.live.clear()
    model, tok, drafter = pair["qwen3"]
    ref = plain_tokens(model, tok.encode("abc dab"), 16)
    rs = list(d.stream_generate(model, tok, "abc dab", drafter, max_tokens=16))
    assert [r.token for r in rs] == ref[: len(rs)]
    last = rs[-1]
    assert sum(last.block_sizes.values()) == last.cycles and isinstance(last.fallback, bool)
    assert "blocks " in stats_line(last)
    assert blocks_text({1: 40, 3: 6}, True, 8) == "blocks 1x40 3x6 (plain fallback, 8 shadow probes)"
    assert blocks_text({5: 2}, False, 1, 1) == "blocks 5x2 (1 copy, 1 shadow probe)"
    assert blocks_text({3: 6}, False) == "blocks 3x6"
    capped = list(d.stream_generate(model, tok, "abc dab", drafter, max_tokens=16,
                                    verify_mode="adaptive", block_size=3))
    assert [r.token for r in capped] == [r.token for r in rs] and max(capped[-1].block_sizes) <= 3
    fixed = list(d.stream_generate(model, tok, "abc dab", drafter, max_tokens=16, block_size=4))
    assert set(fixed[-1].block_sizes) == {4}
    assert list((tmp_path / "calibration").glob("acceptance-*.json"))  # history kept for next time


# --- the cost model: calibration and its cache -------------------------------------------------

def forget_timings():
    """This process's live timings forgotten (a new process), its cost models kept."""
    for k in [k for k in store.live if k[0] == "timing"]:
        del store.live[k]


def test_calibration_is_cached_per_pair_and_machine(pair, tmp_path, monkeypatch):
    from dflash2_mlx.calibration.measure import STEP

    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    store.live.clear()
    model, tok, drafter = pair["qwen3"]
    target = attach(model, drafter)
    # A first use measures a chain's rows and its copies' (coarse); a tree's first need, the
    # whole curve: the grid, and the middles where the curve between two of its rows was not
    # straight.
    first = calibration.costs(target, drafter)
    assert first.coarse and first.first_use and set(first.target) == set(range(1, 9)) | {12, 15}
    assert "first_use" not in first.to_json()
    costs = calibration.costs(target, drafter, whole=True)
    assert not costs.coarse and not costs.first_use
    files = list((tmp_path / "calibration").glob("costs-*.json"))
    assert len(files) == 1
    grid = set(range(1, 10)) | {12, 15, 17, 33, 40}
    assert grid <= set(costs.target) <= set(range(1, 41)) and set(costs.drafter) == {2, 8}
    short = measure.CONTEXTS[0]
    # Never cheaper than a larger block (up to rounding), unless by a step of more than STEP
    # that held when measured again (this CPU splits up to 15 rows over two streams, one above).
    for b in costs.target:
        larger = [costs.verify(b2, short) for b2 in costs.target if b2 > b]
        if larger:
            assert costs.verify(b, short) <= min(larger) + 1e-12 or costs.verify(b, short) > STEP * min(larger)
    assert all(s >= 0 for _, s in list(costs.target.values()) + list(costs.drafter.values()))
    assert calibration.costs(target, drafter) is costs  # in memory: nothing measured again
    store.live.clear()
    assert calibration.costs(target, drafter).created == costs.created  # from disk
    stale = json.loads(files[0].read_text())
    stale["data"]["created"] = time.time() - adaptive.STALE_AFTER_S - 1
    files[0].write_text(json.dumps(stale))
    store.live.clear()
    again = calibration.costs(target, drafter)
    assert again.created > stale["data"]["created"] + 1  # measured again (coarse)
    # A record kept under another format is measured again and written over, never read.
    older = json.loads(files[0].read_text())
    older["format"] = store.FORMAT - 1
    files[0].write_text(json.dumps(older))
    store.live.clear()
    assert store.read("costs", keys.costs(target, drafter)) is None
    assert calibration.costs(target, drafter).created > again.created
    assert json.loads(files[0].read_text())["format"] == store.FORMAT
    extra = calibration.calibrate(target, drafter, budget_s=0.0, rounds=(1, 1), sizes=[4])
    assert grid <= set(extra.target) <= set(range(1, 41)) and set(extra.drafter) == {2, 4, 8}
    other = pair["qwen3_5"]
    assert keys.costs(attach(other[0], other[2]), other[2]) != keys.costs(target, drafter)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_calibration_times_passes_as_the_loop_runs_them(pair, family, monkeypatch):
    """A tree's rows (TREE_ROWS) are timed through a tree pass at most the drafter's block
    deep; a hybrid's chains through a tree of one path (its recurrent layers keep each row's
    state, as ``Sequence.verify`` runs them); an attention-only target's chains as plain
    passes."""
    from dflash2_mlx import tree as trees
    from dflash2_mlx.calibration.measure import TREE_ROWS

    model, tok, drafter = pair[family]
    target = attach(model, drafter)
    depth = drafter.config.block_size - 1
    passes = {}
    real = trees.TreePass.__call__

    def tree_pass(verifier, tree, cache):
        assert all(tree.parents[i] < i and tree.depths[i] == tree.depths[tree.parents[i]] + 1
                   for i in range(1, tree.tokens.size))
        passes[tree.tokens.size] = tree.depths.tolist()
        return real(verifier, tree, cache)

    monkeypatch.setattr(trees.TreePass, "__call__", tree_pass)
    costs = calibration.calibrate(target, drafter, budget_s=0.0, rounds=(1, 1))
    for rows in TREE_ROWS:
        assert rows in passes and len(passes[rows]) == rows and max(passes[rows]) == min(depth, rows - 1)
    chains = sorted(set(costs.target) - set(TREE_ROWS) - {1})
    if family == "qwen3":
        assert not set(chains) & set(passes)
    else:
        assert all(passes[b] == list(range(b)) for b in chains)
    assert all(base > 0 and slope >= 0 for base, slope in costs.target.values())


@contextlib.contextmanager
def busy_cores(monkeypatch):
    """Other processes use every core while the block runs (simulated: the suite's own load
    must not decide what a test sees)."""
    monkeypatch.setenv(SIMULATED_ENV, "1.0")
    try:
        yield
    finally:
        monkeypatch.setenv(SIMULATED_ENV, "0")


def test_the_watch_sees_other_processes_work(monkeypatch):
    """The real signal: a process spinning on every core shows as other processes' work."""
    monkeypatch.delenv(SIMULATED_ENV)
    loaders = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        watch = Watch()
        time.sleep(0.5)
        assert watch.others() > BUSY_SHARE
    finally:
        for p in loaders:
            p.kill()
            p.wait(timeout=10)


def test_a_calibration_on_a_busy_machine_is_measured_again_and_not_kept(pair, tmp_path, monkeypatch):
    """Every core busy with other processes while the pair is calibrated: the calibration is
    taken twice, said to be busy, serves this process for a while only, and no cost file is
    written (a quiet calibration is kept: the test above)."""
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    store.live.clear()
    model, tok, drafter = pair["qwen3"]
    target = attach(model, drafter)
    with busy_cores(monkeypatch):
        calls = []
        real = pair_costs.calibrate
        monkeypatch.setattr(pair_costs, "calibrate", lambda *a, **k: calls.append(1) or real(*a, **k))
        costs = calibration.costs(target, drafter)
    assert len(calls) == 2 and costs.busy > BUSY_SHARE
    assert not list((tmp_path / "calibration").glob("costs-*.json"))
    assert calibration.costs(target, drafter) is costs  # within BUSY_RETRY_S: this one serves
    costs.created -= adaptive.costs.BUSY_RETRY_S + 1
    assert costs.expired()  # ... then the next request measures again


def test_split_target_costs_measured_among_busy_ranks_do_not_expire(pair, tmp_path, monkeypatch):
    """Ranks that share cores see each other as other processes' work.  Costs all ranks
    measured together (``calibration.prepare_split``) must not expire as a busy calibration does:
    one rank alone would then measure again, each pass waiting for ranks not running it."""
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    store.live.clear()
    model, tok, drafter = pair["qwen3"]
    target = attach(model, drafter)
    with busy_cores(monkeypatch):
        calibration.prepare_split(target, drafter, mx.distributed.init())
    costs = calibration.costs(target, drafter)
    costs.created -= adaptive.costs.BUSY_RETRY_S + 1  # minutes later
    assert not costs.expired()
    monkeypatch.setattr(pair_costs, "calibrate", lambda *a, **k: pytest.fail("one rank measured alone"))
    assert calibration.costs(target, drafter) is costs


def test_history_seeds_the_next_request(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    model, tok, drafter = pair["qwen3"]
    target = attach(model, drafter)
    key = keys.acceptance(target, drafter, greedy=True)
    assert key != keys.acceptance(target, drafter, greedy=False)
    name, weight = tree_flatten(drafter.parameters())[0]
    drafter.update(tree_unflatten([(name, weight + 0.01)]))  # other weights: another history
    try:
        assert keys.acceptance(target, drafter, greedy=True) != key
    finally:
        drafter.update(tree_unflatten([(name, weight)]))
    assert keys.acceptance(target, drafter, greedy=True) == key
    seen = Acceptance.empty(7)
    for _ in range(20):
        seen.record(8, 0)
    calibration.keep_acceptance(key, seen)
    chosen = calibration.policy(target, drafter, greedy=True, costs=CPU)
    assert chosen.acceptance.rates()[0] < 0.2 and chosen.block_size(0) == 1 and chosen.fallback
    assert chosen.wait > 0  # a pair known to be weak here waits before its first probe
    assert calibration.policy(target, drafter, greedy=True, costs=CPU, history=False).block_size(0) > 1


def test_history_folds_older_requests_at_half_weight():
    first, second = Acceptance([4.0, 2.0], [2.0, 1.0]), Acceptance([2.0, 0.0], [0.0, 0.0])
    assert adaptive.fold(None, Acceptance.empty(2)) is None  # a request that never drafted
    once = adaptive.fold(None, first)
    assert (once.reached, once.accepted) == (first.reached, first.accepted)
    twice = adaptive.fold(once, second)
    assert (twice.reached, twice.accepted) == ([4.0, 1.0], [1.0, 0.5])


def test_seeded_requests_use_the_history_only_when_greedy(pair, tmp_path, monkeypatch):
    """A seed keeps sampled text reproducible, so sampling ignores the history then; greedy
    text cannot depend on it, so a seeded greedy request still starts from it."""
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    model, tok, drafter = pair["qwen3"]
    target = attach(model, drafter)
    store.live[("costs", keys.costs(target, drafter))] = CostModel(CPU.target, CPU.drafter)
    weak = Acceptance.empty(7)
    for _ in range(20):
        weak.record(8, 0)
    for greedy in (True, False):
        calibration.keep_acceptance(keys.acceptance(target, drafter, greedy), weak)
    sizes = {}
    for temp in (0.0, 1.0):
        for r in d.stream_generate(model, tok, "abcab dcba", drafter, max_tokens=8, temp=temp, seed=1,
                                   lookup=False):
            sizes[temp] = r.block_sizes
    store.live.clear()
    assert set(sizes[0.0]) == {1}  # the history says this drafter is weak here: plain
    assert max(sizes[1.0]) > 1  # no history: the prior says draft


# --- what cycles really take ------------------------------------------------------------------------

def test_timing_corrects_the_calibration_by_kind_and_block():
    t = adaptive.Timing()
    assert t.ratio("draft", 4, 0.06) == t.ratio("plain", 1, 0.05) == 1.0  # nothing seen: the calibration
    for b in (4, 1):
        t.record("draft" if b > 1 else "plain", b, 1.0, 0.05)  # a first pass in a process: not counted
    assert t.observed == {}
    for _ in range(10):
        t.record("draft", 4, 0.03, 0.06)  # drafted cycles of 4 take half what they were priced at
    four, eight = t.ratio("draft", 4, 0.06), t.ratio("draft", 8, 0.07)
    assert 0.5 < four < eight < 0.8  # block 4 seen itself; block 8 follows its kind, more cautiously
    assert t.ratio("copy", 4, 0.05) == t.ratio("plain", 1, 0.05) == 1.0  # other kinds: unchanged
    for _ in range(30):
        t.record("draft", 4, 0.09, 0.06)  # the machine got busy: the estimate follows it
    assert 1.3 < t.ratio("draft", 4, 0.06) < 1.5
    t.record("plain", 1, 10.0, 0.05)  # a stall counts as at most TIMING_CLIP predictions
    assert t.observed["plain"] == pytest.approx(adaptive.TIMING_CLIP * 0.05)


def test_cycles_timed_in_the_loop_move_the_choice():
    """A calibration that overpriced drafting sends a weak-ish drafter to plain steps; the
    probes' real times bring it back.  Without timing (given costs) nothing moves."""
    weak = lambda: Acceptance([20.0] * 7, [4.0] * 7)  # ~0.2 a position: 1.2 tokens for 1.3 steps
    timed = Adaptive(CPU, 8, weak(), seeded=True, timing=adaptive.Timing())
    fixed = Adaptive(CPU, 8, weak(), seeded=True)
    for policy in (timed, fixed):
        assert policy.block_size(0) == 1 and policy.fallback
        for _ in range(7):  # probes of block 2 that took 60% of their price (the first: warm-up)
            policy.timed(2, 0.6 * CPU.cycle(2, 0))
    assert timed.block_size(0) > 1 and not timed.fallback
    assert fixed.block_size(0) == 1


def test_the_loop_times_drafted_cycles_and_pipelined_plain_steps(pair):
    """A drafted cycle is timed when the cycle before it drafted too (after plain steps the
    drafter first reads the rows they committed: their work, not the draft's); a plain step
    when it waited for the one before it (the first of a run only starts the pipeline)."""
    model, tok, drafter = pair["qwen3"]
    policy = Scripted(SCRIPT)
    seen = []
    policy.timed = lambda b, seconds, copy=False: seen.append((b, seconds, copy))
    run(model, drafter, tok.encode("abcab dcba"), 40, policy, lookup=False)
    chosen = [SCRIPT[i % len(SCRIPT)] for i in range(policy.i)]
    steady = [b for i, b in enumerate(chosen) if b == 1 and i and chosen[i - 1] == 1]
    drafted = [b for i, b in enumerate(chosen) if b > 1 and i and chosen[i - 1] > 1]
    assert drafted and [b for b, _, _ in seen if b > 1] == drafted
    assert len(steady) - 1 <= sum(b == 1 for b, _, _ in seen) <= len(steady)
    assert all(seconds > 0 and not copy for _, seconds, copy in seen)


def test_timing_is_kept_for_measured_costs_and_the_next_process(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    model, tok, drafter = pair["qwen3"]
    target = attach(model, drafter)
    key = keys.costs(target, drafter)
    store.live[("costs", key)] = measured = CostModel(CPU.target, CPU.drafter)
    try:
        chosen = calibration.policy(target, drafter)
        assert isinstance(chosen.costs, adaptive.Corrected)
        assert chosen.costs.timing is calibration.policy(target, drafter).costs.timing  # one per process
        # Given costs, or a request that starts from nothing earlier ones saw: as calibrated.
        assert not isinstance(calibration.policy(target, drafter, costs=CPU).costs, adaptive.Corrected)
        assert not isinstance(calibration.policy(target, drafter, history=False).costs, adaptive.Corrected)
        list(d.stream_generate(model, tok, "abc dab", drafter, max_tokens=16))
        observed = dict(calibration.timing(key, measured).observed)
        assert observed and all(v > 0 for v in observed.values())
        forget_timings()  # a new process: the timing comes from disk
        assert calibration.policy(target, drafter).costs.timing.observed == pytest.approx(observed)
        forget_timings()  # ... unless it corrected another calibration
        recalibrated = CostModel(CPU.target, CPU.drafter, created=measured.created + 1)
        assert calibration.timing(key, recalibrated).observed == {}
        forget_timings()
        store.path("timing", key).write_text("{not json")
        assert calibration.timing(key, measured).observed == {}
    finally:
        store.live.clear()
        forget_timings()


def test_a_calibration_that_live_cycles_keep_disagreeing_with_is_measured_again(tmp_path, monkeypatch, capsys):
    """Cycles that keep costing 2x their prices for DISAGREE_CYCLES cycles in a row: the
    kept costs and timing are forgotten when the request ends, so the next one calibrates;
    a disagreement that comes and goes (the correction's business) keeps them."""
    from dflash2_mlx.adaptive import timing as timing_module

    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    costs = CostModel(CPU.target, CPU.drafter)
    key = "k"
    path = store.path("costs", key)
    store.write("costs", key, costs.to_json())
    store.live[("costs", key)] = costs
    try:
        t = adaptive.Timing()
        t.record("draft", 4, 0.06, 0.06)  # a first pass: not counted
        for i in range(2 * timing_module.DISAGREE_CYCLES):
            # Now and then a cycle as priced: its kind's decayed ratio stays off anyway.
            t.record("draft", 4, 0.06 if i % 7 == 0 else 0.14, 0.06)
        assert t.disagrees()
        calibration.keep_timing(key, costs, t)
        assert not path.exists() and not store.path("timing", key).exists()
        assert ("costs", key) not in store.live
        assert "measuring them again at the next request" in capsys.readouterr().err
        store.write("costs", key, costs.to_json())
        t = adaptive.Timing()
        for i in range(4 * timing_module.DISAGREE_CYCLES):  # bursts of load that pass
            t.record("draft", 4, 0.14 if (i // 20) % 2 else 0.06, 0.06)
        assert not t.disagrees()
        calibration.keep_timing(key, costs, t)
        assert path.exists() and store.path("timing", key).exists()
    finally:
        store.live.clear()
        forget_timings()


# --- sampling stays exact -------------------------------------------------------------------------

N = 1200


@pytest.mark.parametrize("version,kw", [(1, dict(temp=1.0)), (2, dict(temp=0.8, top_p=0.9))])
def test_sampled_tokens_follow_target_distribution_under_adaptive(tmp_path, version, kw):
    """The chi-square test of test_sampling, with the adaptive policy choosing each
    cycle's block size from the acceptance of the cycles before (so it varies with the
    random outcomes): the first three tokens must still follow the target exactly."""
    make_target(tmp_path / "t", "qwen3", alphabet="ab", seed=5, scale=1.5)
    make_drafter(tmp_path / "d", tmp_path / "t", version=version, seed=20 + version, block_size=4)
    model, tok, drafter = d.load(str(tmp_path / "t"), str(tmp_path / "d"))
    prompt = tok.encode("ab")
    target = attach(model, drafter)
    costs = CostModel({1: (1.0, 0.0), 4: (1.6, 0.0)}, {2: (0.3, 0.0), 4: (0.3, 0.0)})
    counts, sizes = {}, {}
    for seed in range(N):
        mx.random.seed(seed)
        steps = speculative_generate_step(mx.array(prompt), target, drafter, max_tokens=3,
                                          params=SamplingParams(**kw),
                                          block_size=Adaptive(costs, 4, Acceptance.empty(3)))
        toks = []
        for t, _, _, st in steps:
            toks.append(t)
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
        for b, n in st.block_sizes.items():
            sizes[b] = sizes.get(b, 0) + n
    assert len(sizes) >= 2 and sizes.get(1, 0) > 0  # drafted cycles, then plain steps
    p = chi2_pvalue(counts, exact_joint(model, prompt, 3, **kw), N)
    assert p > 1e-3, f"sampled tokens do not follow the target distribution (p = {p:.2e})"


def refined(cost, rows):
    """The rows calibration measures for a machine whose pass over b rows costs cost(b): the
    initial ones, then the middles its refinement asks for (as ``calibrate`` runs it)."""
    from dflash2_mlx.calibration.measure import REFINE_ROUNDS, stepped_halves, uneven_gaps

    curve = {b: cost(b) for b in rows}
    gaps = uneven_gaps(curve)
    for _ in range(REFINE_ROUNDS):
        if not gaps:
            break
        curve.update({(lo + hi) // 2: cost((lo + hi) // 2) for lo, hi in gaps})
        gaps = stepped_halves(curve, gaps)
    return curve


def test_calibration_finds_a_step_between_the_rows_it_measures():
    """A cliff between 24 and 25 rows (a tile boundary no fixed grid names): the refinement
    brackets it exactly; an evenly rising curve gets one middle per gap at most."""
    from dflash2_mlx.adaptive.costs import COPY_ROWS, interp
    from dflash2_mlx.calibration.measure import LARGEST_ROWS, TREE_ROWS

    rows = [1, *range(2, 9), *COPY_ROWS, *TREE_ROWS, LARGEST_ROWS]
    cliff = lambda b: 1.0 + 0.01 * b + (2.0 if b > 24 else 0.0)
    curve = refined(cliff, rows)
    assert 24 in curve and 25 in curve and len(curve) - len(set(rows)) <= 8
    lines = {b: (c, 0.0) for b, c in curve.items()}
    assert all(interp(lines, b)[0] == pytest.approx(cliff(b)) for b in range(1, LARGEST_ROWS + 1))
    even = lambda b: 1.0 + 0.1 * b
    assert len(refined(even, rows)) - len(set(rows)) <= 4


def test_calibration_keeps_a_machines_steps_and_clamps_noise():
    """A block dearer than a larger one by less than STEP is noise on a rising curve (priced
    as the larger block); by more, a step of the machine's own, kept: the H200's curve, whose
    quantized matmul runs up to 7 rows one by one and tiles from 8, stays as measured."""
    from dflash2_mlx.adaptive import curves
    from dflash2_mlx.calibration.measure import STEP, steps_kept

    measured = curves.load("h200-27b-4bit")["points"]
    h200 = {r: v for r, v in curves.relative("h200-27b-4bit").items() if r in measured}
    assert steps_kept(h200) == h200 and h200[5] > STEP * h200[8]
    noisy = {1: 1.0, 2: 1.2, 3: 1.3, 4: 1.45, 5: 1.5, 6: 1.42, 7: 1.6, 8: 1.7}
    kept = steps_kept(noisy)
    assert kept[5] == kept[4] == 1.42 and all(kept[b] == noisy[b] for b in noisy if b not in (4, 5))
    assert all(kept[a] <= kept[b] for a, b in zip(sorted(kept), sorted(kept)[1:]))
