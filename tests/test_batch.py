"""Batched DFlash is lossless per sequence: whatever else shares the batch, a greedy
sequence emits exactly its plain mlx-lm tokens (and drafts what its single stream drafts),
a seeded sampled one exactly its single-stream tokens, and sampled tokens follow the
target's distribution (chi-square, as in test_sampling).  Covers mixed prompts and
lengths, block sizes 1..8 and changing ones, stop tokens, an abort and a late joiner,
logits processors per sequence, reused prefixes, attention-only and hybrid (recurrent)
targets, and the batch caches after every cycle."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_logits_processors

import dflash2_mlx as d
from dflash2_mlx import adaptive, calibration
from dflash2_mlx.calibration import keys, store
from dflash2_mlx.adaptive import CostModel, Timing, best_block
from dflash2_mlx.batch import BatchCosts, BatchGenerator, batch_generate, prefill_groups
from dflash2_mlx.batch import cache as batch_cache
from dflash2_mlx.batch.cache import draft_hidden
from dflash2_mlx.loop.draft_context import DraftContext
from dflash2_mlx.request.sampling import SamplingParams
from dflash2_mlx.generate import speculative_generate_step
from dflash2_mlx.loop.target import UnsupportedTargetError, attach
from helpers import chi2_pvalue, exact_joint, params_of
from helpers import cache_arrays, plain_tokens
from tiny_models import make_drafter, make_target

# hybrids (recurrent layers): qwen3_5, qwen3_next, qwen3_5_moe; sliding windows: llama_sliding,
# muse_glimmer (NoPE globals), gemma4_text and gemma4 (KV shared by the last layers)
FAMILIES = ["qwen3", "llama", "qwen2", "qwen3_moe", "qwen3_5", "qwen3_next", "qwen3_5_moe",
            "llama_sliding", "muse_glimmer", "gemma4_text", "gemma4"]
PROMPTS = ["abcab dcba", "a", "dd cb", "abcdabcdabcd ab", "cab"]
LIMITS = [24, 9, 17, 24, 1]  # mixed lengths, one that ends at its first token


def single(model, drafter, prompt, n, block_size, lookup=False, **kw):
    """Tokens and stats of the single-stream cycle (copying where the text repeats when
    ``lookup``, as the batch does then at a fixed block size)."""
    steps = speculative_generate_step(mx.array(prompt), attach(model, drafter), drafter,
                                      max_tokens=n, block_size=block_size, lookup=lookup, **kw)
    tokens, stats = [], None
    for t, _, _, stats in steps:
        tokens.append(t)
    return tokens, stats


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """family -> (model, tokenizer, drafter): a random DFlash 2 drafter that is sometimes
    right; "qwen3-v1": the qwen3 target with a DFlash v1 drafter."""
    out = {}
    for fam in FAMILIES + ["qwen3-v1"]:
        root = tmp_path_factory.mktemp(fam)
        make_target(root / "t", fam.split("-")[0], alphabet="abcd", seed=3)
        for seed in range(10, 60):
            make_drafter(root / "d", root / "t", version=1 if fam.endswith("v1") else 2, seed=seed)
            model, tok, drafter = d.load(str(root / "t"), str(root / "d"))
            _, stats = single(model, drafter, tok.encode("abcab dcba"), 16, 4)
            if 0 < stats.total_accepted < 3 * stats.cycles:
                break
        out[fam] = (model, tok, drafter)
    return out


def run(gen, on_step=None):
    """Drive ``gen`` to the end: uid -> tokens, uid -> last response."""
    tokens, last, step = {}, {}, 0
    while len(gen):
        for r in gen.next():
            tokens.setdefault(r.uid, []).append(r.token)
            last[r.uid] = r
        step += 1
        if on_step:
            on_step(gen, step)
    return tokens, last


def check_parity(model, tok, drafter, block_sizes, batched_drafter=(True,), lookup=True, copies=True):
    """Each sequence of a mixed batch emits its plain mlx-lm tokens and drafts (and copies)
    what its single stream drafts (same acceptance: the drafter saw the same context)."""
    prompts = [tok.encode(p) for p in PROMPTS]
    refs = [plain_tokens(model, p, n) for p, n in zip(prompts, LIMITS)]
    accepted_any = copied_any = False
    for b in block_sizes:
        ref_stats = [single(model, drafter, p, n, b, lookup)[1] for p, n in zip(prompts, LIMITS)]
        for batched in batched_drafter:
            gen = BatchGenerator(model, drafter, block_size=b, batch_drafter=batched, lookup=lookup)
            uids = [gen.insert(p, max_tokens=n) for p, n in zip(prompts, LIMITS)]
            tokens, last = run(gen)
            for i, uid in enumerate(uids):
                assert tokens[uid] == refs[i], f"block {b} sequence {i}: diverged"
                assert last[uid].finish_reason == "length"
                got, ref = last[uid].stats, ref_stats[i]
                assert (got.total_accepted, got.cycles, got.copies, got.copied) == \
                    (ref.total_accepted, ref.cycles, ref.copies, ref.copied)
                accepted_any |= ref.total_accepted > ref.copied
                copied_any |= ref.copied > 0
    assert accepted_any, "no draft token was ever accepted: the test pair tests nothing"
    # Copies off: none; on: some copied token accepted (where the pair's text repeats at all).
    assert copied_any == lookup if copies else not (copied_any and not lookup)


def test_greedy_parity_mixed_batch_all_block_sizes(pairs):
    check_parity(*pairs["qwen3"], range(1, 9))
    check_parity(*pairs["qwen3"], [4], batched_drafter=(False,))
    check_parity(*pairs["qwen3"], [2, 5], lookup=False)


@pytest.mark.parametrize("family", FAMILIES[1:] + ["qwen3-v1"])
def test_greedy_parity_other_families(pairs, family):
    check_parity(*pairs[family], [1, 3, 8], copies=family != "qwen3_5_moe")


class Scripted:
    """A batch policy walking a fixed list of block sizes."""

    fallback = False

    def __init__(self, sizes):
        self.sizes, self.i, self.largest = list(sizes), 0, max(sizes)

    def block_size(self, context):
        self.i += 1
        return self.sizes[(self.i - 1) % len(self.sizes)]

    def record(self, b, accepted):
        pass


def test_stop_abort_join_and_changing_blocks(pairs):
    """A stop token ends one sequence mid-block, one is aborted mid-generation, one joins
    after a few cycles, one has its own repetition penalty; block sizes change every
    cycle.  Every survivor still emits its plain tokens."""
    model, tok, drafter = pairs["qwen3"]
    p = {k: tok.encode(v) for k, v in dict(stop="abcab dcba", abort="dd cb", late="bca",
                                             penal="aabbccdd", plain="abcdabcdabcd ab").items()}
    procs = make_logits_processors(repetition_penalty=1.8, repetition_context_size=6)
    refs = {k: plain_tokens(model, v, 30, procs if k == "penal" else None) for k, v in p.items()}
    stop = refs["stop"][7]  # its 8th token ends it
    gen = BatchGenerator(model, drafter, block_size=Scripted([3, 1, 5, 8, 2, 4, 1, 6]))
    uid = {k: gen.insert(p[k], max_tokens=30, stop_tokens=[stop] if k == "stop" else (),
                         logits_processors=procs if k == "penal" else None)
           for k in ("stop", "abort", "penal", "plain")}

    def on_step(gen, step):
        if step == 2:
            assert gen.remove(uid["abort"])
        if step == 3:
            uid["late"] = gen.insert(p["late"], max_tokens=30)

    tokens, last = run(gen, on_step)
    n_stop = refs["stop"].index(stop) + 1
    assert tokens[uid["stop"]] == refs["stop"][:n_stop]
    assert last[uid["stop"]].finish_reason == "stop"
    got = tokens[uid["abort"]]
    assert 0 < len(got) < 30 and got == refs["abort"][: len(got)]
    assert last[uid["abort"]].finish_reason is None
    for k in ("late", "penal", "plain"):
        assert tokens[uid[k]] == refs[k], k
        assert last[uid[k]].finish_reason == "length"
    assert not gen.remove(uid["abort"])  # gone already


def test_reused_prefix_and_max_batch(pairs):
    """Sequences that start from a reused prefix (target cache and draft context holding
    their first prompt tokens, as the server's prefix cache gives them) emit their plain
    tokens; with max_batch 2 the others wait for a place."""
    model, tok, drafter = pairs["qwen3"]
    target = attach(model, drafter)
    texts = ["abcab dcba", "dd cb", "abcdabcdabcd ab", "ca"]
    refs = [plain_tokens(model, tok.encode(t), 16) for t in texts]
    gen = BatchGenerator(model, drafter, block_size=4, max_batch=2)
    uids = []
    for i, t in enumerate(texts):
        ids = tok.encode(t)
        cached = len(ids) // 2 if i % 2 == 0 else 0
        cache, context = target.make_cache(), DraftContext(drafter)
        if cached:
            _, features = target(mx.array([ids[:cached]]), cache)
            context.add(features)
        uids.append(gen.insert(ids, max_tokens=16, prompt_cache=cache, draft_context=context,
                               cached_tokens=cached))
    widths = []
    tokens, _ = run(gen, lambda g, step: widths.append(len(g.active)))
    assert [tokens[u] for u in uids] == refs
    assert max(widths) == 2


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_batch_cache_equals_fresh_prefill_after_every_cycle(pairs, family, monkeypatch):
    """Each sequence's caches (attention rows with holes skipped; recurrent states, rolled
    back and replayed per sequence) are its committed tokens', with compaction running
    every few cycles; so are a finished sequence's returned caches."""
    monkeypatch.setattr(batch_cache, "COMPACT_MIN_ROWS", 4)
    model, tok, drafter = pairs[family]
    target = attach(model, drafter)
    prompts = [tok.encode(t) for t in ("dcba abcd", "ab", "cc dd aa bb")]
    gen = BatchGenerator(model, drafter, block_size=Scripted([4, 6, 2, 8]), return_caches=True)
    uids = [gen.insert(pr, max_tokens=n) for pr, n in zip(prompts, (30, 20, 26))]
    committed = {u: list(pr) for u, pr in zip(uids, prompts)}
    checks, finals, sizes = 0, 0, []

    def compare(cache, tokens):
        fresh = target.make_cache()
        target(mx.array([tokens]), fresh)
        state, ref = cache_arrays(cache), cache_arrays(fresh)
        assert len(state) == len(ref)
        for a, b in zip(state, ref):
            assert a.shape == b.shape
            # fp32 rounding of a recurrent state replayed row by row vs one prefill: ~2e-5 on some CPUs
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)

    while len(gen):
        for r in gen.next():
            committed[r.uid].append(r.token)
            if not r.finish_reason:
                continue
            # Its last cycle's kept tokens go past its emitted ones when max_tokens cut it.
            n = next(c.offset for c in r.cache if isinstance(c, KVCache))
            if n <= len(committed[r.uid]):
                compare(r.cache, committed[r.uid][:n])
                finals += 1
        sizes.append(gen.batch.rows.size)
        for s in gen.active:
            # In the cache: every committed token but the newest (the next anchor).
            compare(gen.extract_cache(s.uid)[0], committed[s.uid][:-1])
            checks += 1
    assert finals >= 1 and checks >= 10
    assert any(b < a for a, b in zip(sizes, sizes[1:])), "compaction never ran"


def test_batched_drafter_matches_per_sequence_passes(tmp_path):
    """One drafter pass over left-padded contexts of different lengths, with sliding and
    causal layers, equals one pass per sequence."""
    make_target(tmp_path / "t", "qwen3", alphabet="abcd", seed=3)
    make_drafter(tmp_path / "d", tmp_path / "t", version=2, layers=3, sliding_window=6,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                 is_causal=True)
    model, tok, drafter = d.load(str(tmp_path / "t"), str(tmp_path / "d"))
    target = attach(model, drafter)
    contexts = []
    for n in (1, 4, 5, 6, 13):
        ctx = DraftContext(drafter)
        _, features = target(mx.array([[i % 7 for i in range(n)]]), target.make_cache())
        ctx.add(features)
        contexts.append(ctx.fed())
    blocks = mx.array([[3, 2, 2, 2], [4, 2, 2, 2], [5, 2, 2, 2], [6, 2, 2, 2], [7, 2, 2, 2]])
    together = draft_hidden(drafter, blocks, contexts)
    for i, c in enumerate(contexts):
        alone = drafter(blocks[i : i + 1], c)
        np.testing.assert_allclose(np.array(together[i]), np.array(alone[0]), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family,block_size",
                         [("qwen3", 2), ("qwen3", 5), ("qwen3_5", 4), ("qwen3-v1", 4),
                          ("muse_glimmer", 4), ("gemma4", 3), ("qwen3_5_moe", 4)])
def test_seeded_sampled_sequence_matches_its_single_stream(pairs, family, block_size):
    """A seeded sequence draws from its own key: it emits its single stream's tokens,
    next to greedy and unseeded sampled neighbours."""
    model, tok, drafter = pairs[family]
    cases = [("abcab dcba", SamplingParams(temp=1.0), 11),
             ("dd cb", SamplingParams(temp=0.7, top_k=3), 5),
             ("bca", SamplingParams(temp=0.9, top_p=0.9), 12)]
    for lookup in (True, False):
        refs = []
        for text, params, seed in cases:
            mx.random.seed(seed)
            refs.append(single(model, drafter, tok.encode(text), 20, block_size, lookup,
                               params=params)[0])
        gen = BatchGenerator(model, drafter, block_size=block_size, lookup=lookup)
        gen.insert(tok.encode("abcd"), max_tokens=20)  # greedy neighbour
        gen.insert(tok.encode("cab"), max_tokens=20, params=SamplingParams(temp=1.0))
        uids = [gen.insert(tok.encode(t), max_tokens=20, params=pa, seed=s) for t, pa, s in cases]
        tokens, last = run(gen)
        for uid, ref in zip(uids, refs):
            assert tokens[uid] == ref
        assert (sum(last[uid].stats.copies for uid in uids) > 0) == lookup  # copies were sampled too


def test_sampled_sequences_follow_target_distribution_while_sharing_the_batch(tmp_path):
    """Three sampled settings (one with a repetition penalty, one whose prompt repeats itself,
    so that its blocks are often copies, one with XTC) and a greedy one share every batch; each sampled setting's first three tokens pass the chi-square test against the
    exact target distribution and fail it against a nearby wrong one; the greedy ones stay
    exact.  600 samples a setting (test_sampling takes 1200 for one single stream)."""
    make_target(tmp_path / "t", "qwen3", alphabet="ab", seed=5, scale=1.5)
    make_drafter(tmp_path / "d", tmp_path / "t", version=2, seed=22, block_size=4)
    model, tok, drafter = d.load(str(tmp_path / "t"), str(tmp_path / "d"))
    rep = (3.0, 4)
    procs = make_logits_processors(repetition_penalty=rep[0], repetition_context_size=rep[1])
    # "abab" repeats itself: its blocks are copies where the first token continues it.
    settings = {"a": ("abab", dict(temp=1.0, top_p=0.95), None),
                "b": ("ba", dict(temp=1.2, top_k=4, min_p=0.05), procs),
                "c": ("aab", dict(temp=1.0, xtc=(0.7, 0.1, ())), None)}
    greedy_prompt = tok.encode("bab")
    greedy_ref = plain_tokens(model, greedy_prompt, 3)
    N, per_batch = 600, 100
    counts = {k: {} for k in settings}
    accepted = {k: 0 for k in settings}
    copies = {k: [0, 0, 0] for k in settings}  # cycles, copies, copied tokens accepted
    mx.random.seed(0)
    for _ in range(N // per_batch):
        gen = BatchGenerator(model, drafter, block_size=3)
        kinds = {}
        for j in range(per_batch):
            for k, (text, kw, pr) in settings.items():
                kinds[gen.insert(tok.encode(text), max_tokens=3, params=params_of(kw),
                                 logits_processors=pr)] = k
            if j % 10 == 0:
                kinds[gen.insert(greedy_prompt, max_tokens=3)] = "greedy"
        tokens, last = run(gen)
        for uid, k in kinds.items():
            if k == "greedy":
                assert tokens[uid] == greedy_ref
                continue
            key = tuple(tokens[uid])
            counts[k][key] = counts[k].get(key, 0) + 1
            accepted[k] += last[uid].stats.total_accepted
            st = last[uid].stats
            copies[k] = [copies[k][0] + st.cycles, copies[k][1] + st.copies, copies[k][2] + st.copied]
    for k, (text, kw, pr) in settings.items():
        prompt = tok.encode(text)
        r = rep if pr is not None else None
        joint = exact_joint(model, prompt, 3, rep=r, **kw)
        p = chi2_pvalue(counts[k], joint, N)
        assert p > 1e-3, f"setting {k}: tokens do not follow the target distribution (p = {p:.2e})"
        assert 0 < accepted[k] < 2 * N  # drafts both accepted and rejected
        cycles, copied_blocks, copied = copies[k]
        if k == "a":  # copies verified, a copied token sometimes accepted, sometimes not
            assert 0 < copied_blocks < cycles and 0 < copied < 2 * copied_blocks
        # Power: the samples reject a nearby wrong distribution (for the penalized setting,
        # the same one without its penalty: the processor reached this sequence's rows; for
        # XTC's, the one without XTC and the one with half its probability).
        if r:
            wrongs = [dict(kw)]
        elif "xtc" in kw:
            P, threshold, special = kw["xtc"]
            wrongs = [dict(kw, xtc=None), dict(kw, xtc=(P / 2, threshold, special))]
        else:
            wrongs = [dict(kw, temp=kw["temp"] * 2)]
        for wrong_kw in wrongs:
            wrong = exact_joint(model, prompt, 3, **wrong_kw)
            seen = {key: v for key, v in counts[k].items() if key in wrong}
            assert chi2_pvalue(seen, wrong, sum(seen.values())) < 1e-3, wrong_kw


def test_batch_generate_matches_generate(pairs):
    model, tok, drafter = pairs["qwen3"]
    prompts = ["abcab dcba", "dd cb", "a"]
    limits = (20, 12, 16)
    out = batch_generate(model, tok, prompts, drafter, max_tokens=list(limits), block_size=4)
    for i, (prompt, n) in enumerate(zip(prompts, limits)):
        ref = list(d.stream_generate(model, tok, prompt, drafter, max_tokens=n, block_size=4, lookup=False))
        assert out.texts[i] == "".join(r.text for r in ref)
        assert out.finish_reasons[i] == ref[-1].finish_reason
        assert out.token_ids[i] == [r.token for r in ref if r.finish_reason != "stop"]
    assert "stop" in out.finish_reasons  # the eos token ends a sequence, and is not in its text
    stops = out.finish_reasons.count("stop")
    assert out.generation_tokens == sum(len(t) for t in out.token_ids) + stops


def test_batch_costs_and_prefill_groups():
    """A batch's cycle costs what its S * b rows cost (one sequence: the model itself), so
    a CPU-like machine drafts for one stream and decodes plain for eight at the same
    acceptance; prefill groups keep padding within 25% of the real rows."""
    cpu = CostModel({1: (1.0, 0.001), 8: (1.7, 0.002)}, {2: (0.2, 0.0), 8: (0.2, 0.0)})
    costs = BatchCosts(cpu)
    for b in range(1, 9):
        assert costs.cycle(b, 100) == pytest.approx(cpu.cycle(b, 100))
    costs.streams = 8
    assert costs.cycle(4, 0) == pytest.approx(1.7 + 0.1 * 24 + 0.2)  # 32 rows, the 1..8 slope
    assert costs.cycle(1, 10) == pytest.approx(1.7 + 8 * 0.001 * 10)
    rates = [0.5] * 7
    costs.streams = 1
    assert best_block(rates, costs, 0, 8) > 1
    costs.streams = 8
    assert best_block(rates, costs, 0, 8) == 1
    assert prefill_groups([100, 3, 98, 5, 4, 300]) == [[1, 4, 3], [2, 0], [5]]
    assert prefill_groups([7]) == [[0]] and prefill_groups([]) == []


def test_batch_costs_priced_by_their_timing():
    """Cycles priced at what the batch's cycles really took, per stream count: drafted
    cycles at 2 streams that took 3x their price send 2 streams to plain steps, and leave
    one stream's choice (and an untimed model's) as it was."""
    cpu = CostModel({1: (1.0, 0.001), 8: (1.7, 0.002)}, {2: (0.2, 0.0), 8: (0.2, 0.0)})
    timed, untimed = BatchCosts(cpu, Timing()), BatchCosts(cpu)
    rates = [0.6] * 7
    for costs in (timed, untimed):
        costs.streams = 2
        assert best_block(rates, costs, 0, 8) > 1
    for _ in range(12):  # the first is a warm-up pass: left out
        timed.observe(4, 0, 3 * untimed.cycle(4, 0))
        timed.observe(1, 0, untimed.cycle(1, 0))
    assert best_block(rates, timed, 0, 8) == 1 and best_block(rates, untimed, 0, 8) > 1
    assert timed.cycle(1, 0) == pytest.approx(untimed.cycle(1, 0), rel=0.25)  # near what plain steps took
    timed.streams = 1
    assert best_block(rates, timed, 0, 8) > 1
    assert set(timed.timing.observed) == {"batch2", "batch2-draft", "batch2-draft4", "batch2-plain",
                                          "batch2-plain1"}
    slow = BatchCosts(cpu, Timing())  # a batch's own work: seen in drafted cycles, priced in plain steps too
    slow.streams = untimed.streams = 4
    for _ in range(12):
        slow.observe(4, 0, 2 * untimed.cycle(4, 0))  # twice their price
    assert slow.cycle(1, 0) > 1.5 * untimed.cycle(1, 0)


class Observed(BatchCosts):
    def __init__(self, costs):
        super().__init__(costs)
        self.seen = []

    def observe(self, b, context, seconds, drafted=True):
        self.seen.append((b, drafted, seconds))


def test_the_batch_times_plain_steps_and_drafted_cycles_after_drafted_ones(pairs):
    """A drafted cycle is timed when the cycle before it drafted for the same sequences
    (after a plain step, or a sequence's joining, the drafter first reads rows not fed)."""
    model, tok, drafter = pairs["qwen3"]
    script = [4, 4, 1, 3, 3, 3, 1, 1, 2, 5]
    policy = Scripted(script)
    policy.costs = Observed(CostModel({1: (1.0, 0.0)}, {2: (0.1, 0.0)}))
    gen = BatchGenerator(model, drafter, block_size=policy, lookup=False)
    gen.insert(tok.encode("abcab dcba"), max_tokens=40)

    def on_step(gen, step):
        if step == 4:
            gen.insert(tok.encode("dd cb"), max_tokens=30)  # joins before the 5th cycle (block 3)

    run(gen, on_step)
    chosen = [script[i % len(script)] for i in range(policy.i)]
    timed = [b for i, b in enumerate(chosen)
             if b == 1 or (i and chosen[i - 1] > 1 and i != 4)]
    assert [b for b, _, _ in policy.costs.seen] == timed
    assert all(drafted == (b > 1) and seconds > 0 for b, drafted, seconds in policy.costs.seen)


def test_batch_timing_is_kept_for_the_next_process(pairs, tmp_path, monkeypatch):
    """"auto" over a batch times its cycles into the process's timing of the pair (beside
    the single streams'), and ``close`` saves it for the next process."""
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    model, tok, drafter = pairs["qwen3"]
    target = attach(model, drafter)
    key = keys.costs(target, drafter)
    store.live[("costs", key)] = measured = CostModel({1: (1.0, 0.0), 8: (1.7, 0.0)}, {2: (0.2, 0.0), 8: (0.2, 0.0)})
    try:
        gen = BatchGenerator(model, drafter, block_size="auto")
        for text in ("abcab dcba", "dd cb"):
            gen.insert(tok.encode(text), max_tokens=24)
        run(gen)
        gen.close()
        observed = dict(calibration.timing(key, measured).observed)
        assert any(k.startswith("batch2-") for k in observed)
        del store.live[("timing", key)]  # a new process: from disk
        assert calibration.timing(key, measured).observed == pytest.approx(observed)
    finally:
        store.live.clear()


def test_a_batch_that_made_a_pairs_first_calibration_probes_the_target_when_it_closes(pairs, tmp_path, monkeypatch):
    """A server whose first request of a pair runs in a batch says whether verify rows are
    row-exact afterwards, as a single stream's first reply does (the probe after the last token)."""
    from dflash2_mlx.calibration import exactness

    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    monkeypatch.setattr(store, "live", {})  # a first use in this process too
    model, tok, drafter = pairs["qwen3"]
    gen = BatchGenerator(model, drafter, block_size="auto")
    for text in ("abcab dcba", "dd cb"):
        gen.insert(tok.encode(text), max_tokens=8)
    run(gen)
    assert exactness.known(model) is None  # not before the batch is done
    gen.close()
    assert exactness.known(model) is not None


def test_adaptive_policy_sees_the_batch(pairs):
    """Block size "auto" over a batch: the policy's costs follow the batch's size as
    sequences leave, it drafts (drafts are nearly free here), and every sequence still
    emits its plain tokens."""
    model, tok, drafter = pairs["qwen3"]
    gpu = CostModel({1: (1.0, 0.0), 8: (1.0, 0.0)}, {2: (0.05, 0.0), 8: (0.05, 0.0)})
    costs = BatchCosts(gpu)
    policy = calibration.policy(attach(model, drafter), drafter, adaptive.AUTO, costs=costs,
                                history=False)
    gen = BatchGenerator(model, drafter, block_size=policy)
    texts, limits = ["abcab dcba", "dd cb", "a"], [24, 12, 4]
    uids = [gen.insert(tok.encode(t), max_tokens=n) for t, n in zip(texts, limits)]
    streams = []
    tokens, last = run(gen, lambda g, step: streams.append(costs.streams))
    for uid, t, n in zip(uids, texts, limits):
        assert tokens[uid] == plain_tokens(model, tok.encode(t), n)
        assert max(last[uid].stats.block_sizes) > 1
    assert streams[0] == 3 and streams[-1] == 1


@pytest.mark.parametrize("family", ["llama_sliding", "muse_glimmer", "gemma4_text"])
def test_sliding_window_caches_join_and_leave_as_mlx_lms_rotating_caches(pairs, family):
    """A sequence joins from a single stream's rotating caches (wrapped around by one-token
    steps), and the caches the batch hands back mid-run and at the end are rotating caches
    from which mlx-lm's own decoding goes on with plain decoding's tokens."""
    model, tok, drafter = pairs[family]
    target = attach(model, drafter)
    prompt = tok.encode("abcab dcba ddcc ab")
    want = plain_tokens(model, prompt, 40)
    cache, context = target.make_cache(), DraftContext(drafter)
    _, features = target(mx.array([prompt[:5]]), cache)
    context.add(features)
    for t in prompt[5:-1]:  # one-token steps: the windows wrap around
        _, features = target(mx.array([[t]]), cache)
        context.add(features)
    assert any(getattr(c, "_idx", 0) < getattr(c, "offset", 0) for c in cache), "no window wrapped"
    gen = BatchGenerator(model, drafter, block_size=4, return_caches=True)
    uid = gen.insert(prompt, max_tokens=30, prompt_cache=cache, draft_context=context,
                     cached_tokens=len(prompt) - 1)
    gen.insert(tok.encode("dcba"), max_tokens=24)  # a neighbour with shorter rows
    committed, checks = list(prompt), 0

    def goes_on(cache, n):
        """mlx-lm decoding from ``cache`` (the first ``n`` committed tokens) continues
        plain decoding's text."""
        steps = generate_step(mx.array(committed[n:]), model, prompt_cache=cache, max_tokens=4)
        got = [int(t) for t, _ in steps]
        emitted = len(committed) - len(prompt)
        assert got == want[emitted : emitted + 4]

    while len(gen):
        for r in gen.next():
            if r.uid != uid:
                continue
            committed.append(r.token)
            if r.finish_reason:
                n = next(c.offset for c in r.cache if isinstance(c, KVCache))
                if n <= len(committed):
                    goes_on(r.cache, n)
                    checks += 1
        if any(s.uid == uid for s in gen.active) and len(committed) > len(prompt):
            extracted = gen.extract_cache(uid)[0]
            assert {type(c).__name__ for c in extracted} == {type(c).__name__ for c in target.make_cache()}
            goes_on(extracted, len(committed) - 1)
            checks += 1
    assert committed[len(prompt):] == want[:30]
    assert checks >= 5