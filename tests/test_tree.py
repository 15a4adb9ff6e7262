"""Tree verification (``dflash2_mlx/tree``): greedy parity with mlx-lm for trees of 4..32
nodes on every family (hybrids' recurrent layers node by node), caches equal to a fresh
prefill after every tree cycle, the sampled rule against the target's exact
distribution (and the biased ``min(1, p/q)`` rule caught by the same test), and bad input."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors
from scipy import stats as sstats

import dflash2_mlx as d
from dflash2_mlx import adaptive, calibration
from dflash2_mlx import tree as trees
from dflash2_mlx.generate import speculative_generate_step
from dflash2_mlx.loop.target import attach
from dflash2_mlx.request.sampling import SamplingParams, log_softmax, probs
from dflash2_mlx.tree.grow import grow, log_softmax as lattice_log_softmax
from helpers import cache_arrays, chi2_pvalue, exact_joint, params_of, plain_tokens
from tiny_models import make_drafter, make_target

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "llama_sliding", "muse_glimmer", "gemma4_text",
            "qwen3_5", "qwen3_next"]
BUDGETS = [4, 8, 16, 32]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """family -> (model, tokenizer, {1: v1 drafter, 2: v2 drafter}); sliding windows of 64
    (the trees fit until the context nears them), targets sharp enough to be far from ties."""
    out = {}
    for fam in FAMILIES:
        root = tmp_path_factory.mktemp(fam)
        make_target(root / "t", fam, alphabet="abcd", seed=3, window=64, scale=2.0)
        drafters = {}
        for v in (1, 2):
            make_drafter(root / f"d{v}", root / "t", version=v, seed=11 + v)
            model, tok, drafters[v] = d.load(str(root / "t"), str(root / f"d{v}"))
        out[fam] = (model, tok, drafters)
    return out


def tree_tokens(model, drafter, prompt, n, budget, block_size=8, **kw):
    target = attach(model, drafter)
    steps = speculative_generate_step(mx.array(prompt), target, drafter, max_tokens=n, block_size=block_size,
                                      tree_budget=budget, lookup=False, **kw)
    out, stats = [], None
    for t, _, _, stats in steps:
        out.append(t)
    return out, stats


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity_for_trees(pairs, family):
    model, tok, drafters = pairs[family]
    prompt = tok.encode("abcab dcba")
    ref = plain_tokens(model, prompt, MAX_TOKENS)
    for v in (1, 2):
        chain, chain_stats = tree_tokens(model, drafters[v], prompt, MAX_TOKENS, None)
        assert chain == ref
        for budget in BUDGETS:
            out, stats = tree_tokens(model, drafters[v], prompt, MAX_TOKENS, budget)
            assert out == ref, f"{family} v{v} tree of {budget}: diverged from mlx-lm"
            assert stats.trees > 0 and stats.nodes == stats.trees * budget
            if budget >= 8:  # the walk's path is in every tree: never fewer accepted than the chain
                assert stats.tau >= chain_stats.tau - 1e-9 or stats.cycles != chain_stats.cycles


def test_trees_accept_more_than_the_chain_somewhere(pairs):
    gains = []
    for family in FAMILIES:
        model, tok, drafters = pairs[family]
        prompt = tok.encode("abcab dcba")
        _, chain = tree_tokens(model, drafters[2], prompt, MAX_TOKENS, None)
        _, tree = tree_tokens(model, drafters[2], prompt, MAX_TOKENS, 16)
        gains.append(tree.tau - chain.tau)
    assert max(gains) > 0.2, gains


def wide_pair(tmp_path_factory, family: str):
    """A ``family`` pair with attention heads of 32 (mlx-lm quantizes KV caches in groups of
    32 or more)."""
    root = tmp_path_factory.mktemp(f"kv-{family}")
    make_target(root / "t", family, alphabet="abcd", seed=3, scale=2.0, head_dim=32)
    make_drafter(root / "d", root / "t", version=2, seed=13)
    return d.load(str(root / "t"), str(root / "d"))


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    return wide_pair(tmp_path_factory, "qwen3")


@pytest.mark.parametrize("start", [0, 12])
def test_greedy_parity_with_quantized_kv(wide_heads, start):
    model, tok, drafter = wide_heads
    drafters = {2: drafter}
    prompt = tok.encode("abcab dcba")
    from mlx_lm.generate import generate_step
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS, kv_bits=8,
                                            kv_group_size=32, quantized_kv_start=start)]
    for budget in (4, 16):
        out, stats = tree_tokens(model, drafters[2], prompt, MAX_TOKENS, budget, kv_bits=8, kv_group_size=32,
                                 quantized_kv_start=start)
        assert out == ref and stats.trees > 0


def test_greedy_parity_with_a_logits_processor(pairs):
    model, tok, drafters = pairs["qwen3"]
    prompt = tok.encode("abcab dcba")
    procs = make_logits_processors(repetition_penalty=1.3, repetition_context_size=6)
    ref = plain_tokens(model, prompt, MAX_TOKENS, procs)
    out, stats = tree_tokens(model, drafters[2], prompt, MAX_TOKENS, 16, logits_processors=procs)
    assert out == ref and stats.trees > 0


@pytest.fixture(scope="module")
def wide_hybrid(tmp_path_factory):
    return wide_pair(tmp_path_factory, "qwen3_5")


def test_hybrid_trees_with_quantized_kv(wide_hybrid):
    model, tok, drafter = wide_hybrid
    prompt = tok.encode("abcab dcba")
    from mlx_lm.generate import generate_step
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS, kv_bits=8,
                                            kv_group_size=32, quantized_kv_start=0)]
    out, stats = tree_tokens(model, drafter, prompt, MAX_TOKENS, 16, kv_bits=8, kv_group_size=32,
                             quantized_kv_start=0)
    assert out == ref and stats.trees > 0 and stats.tree_accepted > 0


def test_a_recurrent_layer_without_a_known_mixer_verifies_chains(pairs):
    """A recurrent cache the tree pass has no node-by-node mixer for: chains, saying why."""
    from mlx_lm.models.cache import ArraysCache
    model, tok, drafters = pairs["qwen3"]
    target = attach(model, drafters[2])
    why = target.verifiers.tree_fits(target.make_cache() + [ArraysCache(2)], 9)
    assert why == "recurrent layers without a mixer a tree pass reads"


def test_sliding_window_trees_stop_at_the_window_and_stay_exact(pairs):
    model, tok, drafters = pairs["llama_sliding"]
    prompt = tok.encode("abcab dcba")
    out, stats = tree_tokens(model, drafters[2], prompt, 80, 16)
    assert out == plain_tokens(model, prompt, 80)
    assert stats.trees > 0 and stats.chain_why == "the tree would reach a sliding window"


@pytest.mark.parametrize("family,temp", [("qwen3", 0.0), ("qwen3", 1.0), ("qwen3_5", 0.0), ("qwen3_next", 1.0)])
def test_cache_equals_fresh_prefill_after_every_tree_cycle(pairs, family, temp):
    """Attention caches compacted to the accepted path; a hybrid's recurrent state the one
    the accepted path alone leaves."""
    model, tok, drafters = pairs[family]
    drafter = drafters[2]
    target = attach(model, drafter)
    prompt = tok.encode("dcba abcd")
    cache = target.make_cache()
    mx.random.seed(7)
    steps = speculative_generate_step(mx.array(prompt), target, drafter, max_tokens=30, block_size=6,
                                      params=SamplingParams(temp=temp), prompt_cache=cache, tree_budget=12,
                                      lookup=False)
    tokens, seen, checks = [], 0, []
    for t, _, _, stats in steps:
        if stats.cycles != seen:
            seen = stats.cycles
            checks.append((len(tokens), stats.accepted, cache_arrays(cache)))
        tokens.append(t)
    assert len(checks) >= 4 and any(a > 0 for _, a, _ in checks)
    for n_before, accepted, state in checks:
        fresh = target.make_cache()
        target(mx.array([prompt + tokens[: n_before + accepted]]), fresh)
        ref = cache_arrays(fresh)
        assert [a.shape for a in state] == [b.shape for b in ref]
        for a, b in zip(state, ref):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


def test_grow_holds_the_walk_then_the_likeliest_paths():
    rng = np.random.default_rng(0)
    D, k = 4, 5
    cand = np.arange(D * k).reshape(D, k) + 100
    scores = rng.normal(size=(D, k, k)) * 2
    scores[0] = scores[0, :1]  # position 1's row is the anchor's, whatever a
    tree = grow(7, cand, scores, 12)
    assert tree.size == 12 and tree.tokens[0] == 7 and tree.depths.max() <= D
    assert all(tree.parents[i] < i for i in range(1, tree.tokens.size))
    # The first D nodes are the greedy walk.
    prev = 0
    for t in range(D):
        assert tree.tokens[t + 1] == cand[t, np.argmax(scores[t, prev])]
        prev = int(np.argmax(scores[t, prev]))
    # Best first: every path left out is no likelier than the least likely one taken.
    lp = lattice_log_softmax(scores)

    def logp(node):
        path, total, prev = tree.path_to(node), 0.0, 0
        for n in path[1:]:
            c = int(np.nonzero(cand[tree.depths[n] - 1] == tree.tokens[n])[0][0])
            total += lp[tree.depths[n] - 1, prev, c]
            prev = c
        return total

    taken = [logp(i) for i in range(D + 1, tree.tokens.size)]
    children = tree.children()
    for node in range(tree.tokens.size):
        if tree.depths[node] >= D:
            continue
        prev = 0 if node == 0 else int(np.nonzero(cand[tree.depths[node] - 1] == tree.tokens[node])[0][0])
        for c in range(k):
            if int(cand[tree.depths[node], c]) not in children[node]:
                assert logp(node) + lp[tree.depths[node], prev, c] <= min(taken) + 1e-9


def test_bad_budgets_and_modes_are_refused(pairs):
    model, tok, drafters = pairs["qwen3"]
    for bad in (0, 65, -3, "lots"):
        with pytest.raises(ValueError, match="tree budget .* is impossible"):
            d.generate(model, tok, "ab", drafters[2], max_tokens=4, verify_mode="tree", tree_budget=bad)
    with pytest.raises(ValueError, match="needs verify_mode='tree'"):
        d.generate(model, tok, "ab", drafters[2], max_tokens=4, tree_budget=8)
    text = d.generate(model, tok, "ab", drafters[2], max_tokens=8, verify_mode="ddtree", tree_budget="8")
    assert text == d.generate(model, tok, "ab", drafters[2], max_tokens=8, verify_mode="off")


def test_the_stats_line_reports_trees(pairs):
    from dflash2_mlx.generate import stats_line
    model, tok, drafters = pairs["qwen3"]
    last = None
    for last in d.stream_generate(model, tok, "abcab dcba", drafters[2], max_tokens=20, block_size=6,
                                  verify_mode="tree", tree_budget=16, lookup=False):
        pass
    assert last.trees > 0 and last.tree_nodes == 16 * last.trees
    assert f"trees {last.trees}: 16.0 nodes, depth" in stats_line(last)
    model, tok, drafters = pairs["qwen3_5"]
    for last in d.stream_generate(model, tok, "abcab dcba", drafters[2], max_tokens=20, block_size=6,
                                  verify_mode="tree", tree_budget=16, lookup=False):
        pass
    assert last.trees > 0 and f"trees {last.trees}: 16.0 nodes" in stats_line(last)
    for last in d.stream_generate(model, tok, "abcab dcba", drafters[2], max_tokens=20, block_size=6,
                                  verify_mode="tree", tree_budget=16, lookup=False, exact=True):
        pass
    assert "trees none (exact verify reads one row at a time (a chain))" in stats_line(last)


# Sampling ----------------------------------------------------------------------------------

N = 1200
ALPHA = 1e-3


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree-sampling")
    make_target(root / "t", "qwen3", alphabet="ab", seed=5, scale=1.5)
    out = {}
    for v in (1, 2):
        make_drafter(root / f"d{v}", root / "t", version=v, seed=20 + v, block_size=4)
        out[v] = d.load(str(root / "t"), str(root / f"d{v}"))
    return out


CASES = [
    (2, dict(temp=1.0)),
    (1, dict(temp=0.8, top_p=0.9)),
    pytest.param(2, dict(temp=1.2, top_k=3, min_p=0.05, rep=(1.6, 4)), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("version,kw", CASES)
def test_sampled_trees_follow_the_target_distribution(sharp, version, kw):
    model, tok, drafter = sharp[version]
    prompt = tok.encode("ab")
    rep = kw.pop("rep", None)
    params = params_of(kw)
    procs = make_logits_processors(repetition_penalty=rep[0], repetition_context_size=rep[1]) if rep else None
    counts, accepted, n_trees = {}, 0, 0
    for seed in range(N):
        mx.random.seed(seed)
        toks, st = tree_tokens(model, drafter, prompt, 3, 4, block_size=3, params=params, logits_processors=procs)
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
        accepted += st.tree_accepted
        n_trees += st.trees
    joint = exact_joint(model, prompt, 3, rep=rep, **kw)
    p = chi2_pvalue(counts, joint, N)
    assert p > ALPHA, f"sampled tree tokens do not follow the target distribution (p = {p:.2e})"
    assert n_trees > 0 and 0 < accepted < 2 * n_trees  # paths accepted, and left
    wrong = exact_joint(model, prompt, 3, rep=rep, **{**kw, "temp": kw["temp"] * 2})
    assert chi2_pvalue({k: v for k, v in counts.items() if k in wrong}, wrong,
                       sum(v for k, v in counts.items() if k in wrong)) < ALPHA


def biased_first_token(p: np.ndarray, q: np.ndarray, children: list, rng) -> int:
    """The rule the tree must not use: each child in turn accepted with min(1, p/q), else the
    residual max(p - q, 0) drawn from: right for one child drawn from q, not for top-k."""
    for c in children:
        if rng.uniform() < min(1.0, p[c] / q[c]):
            return c
    r = np.maximum(p - q, 0)
    return int(rng.choice(len(p), p=r / r.sum()))


def test_the_tree_rule_is_exact_and_the_biased_rule_is_caught():
    """One node with two children (the drafter's top 2): the first emitted token must follow
    p.  ``trees.accept`` passes the chi-square test; the child-by-child min(1, p/q) rule
    fails it on the same numbers."""
    logits = mx.array([[2.0, 1.5, 0.3, -1.0, 0.0]])
    q = np.array([0.45, 0.35, 0.1, 0.05, 0.05])
    params = SamplingParams(temp=1.0)
    p = np.array(probs(log_softmax(logits), params)[0], dtype=np.float64)
    p /= p.sum()
    tree = trees.Tree(np.array([9, 0, 1]), np.array([-1, 0, 0]), np.array([0, 1, 1]))
    rows = mx.concatenate([logits, mx.zeros((2, 5))])  # the children's rows: only reached on acceptance
    n = 4000
    ours, biased = np.zeros(5), np.zeros(5)
    rng = np.random.default_rng(0)
    mx.random.seed(0)
    for _ in range(n):
        path, token, _ = trees.accept(tree, rows, mx.array([9]), None, params)
        ours[int(tree.tokens[path[1]]) if len(path) > 1 else token] += 1
        biased[biased_first_token(p, q, [0, 1], rng)] += 1
    assert sstats.chisquare(ours, p * n).pvalue > ALPHA
    assert sstats.chisquare(biased, p * n).pvalue < 1e-6


def drawn_child_first(p: np.ndarray, q: np.ndarray, drawn: int, siblings: list, rng, residual=True):
    """The sampled tree's rule at a node of its drawn path (numpy): the drawn child with
    min(1, p/q), then a draw from the residual (``residual=False``: from p, the mutation
    the test must catch), moving on if a sibling holds it.  (token, whether the walk went on)."""
    if rng.uniform() * q[drawn] < p[drawn]:
        return drawn, True
    r = np.maximum(p - q, 0) if residual else p
    token = int(rng.choice(len(p), p=r / r.sum()))
    return token, token in siblings


def test_the_drawn_path_is_judged_as_a_chain_and_its_siblings_catch_the_residual():
    """A node whose first child was drawn from q (the walk's draw) and a sibling: the emitted
    token follows p, and the walk goes on with probability sum(min(p, q)) (the chain's) plus
    the residual's mass on the sibling.  Drawing from p after a rejection is caught."""
    logits = mx.array([[2.0, 1.5, 0.3, -1.0, 0.0]])
    q = np.array([0.1, 0.6, 0.05, 0.2, 0.05], dtype=np.float32)  # far from p: rejections matter
    params = SamplingParams(temp=1.0)
    p = np.array(probs(log_softmax(logits), params)[0], dtype=np.float64)
    p /= p.sum()
    rng, n = np.random.default_rng(1), 4000
    ours, mutant, went_on = np.zeros(5), np.zeros(5), 0
    mx.random.seed(1)
    for _ in range(n):
        drawn = int(rng.choice(5, p=q / q.sum()))
        sibling = 1 if drawn != 1 else 0
        tree = trees.Tree(np.array([9, drawn, sibling]), np.array([-1, 0, 0]), np.array([0, 1, 1]), drawn=1)
        rows = mx.concatenate([logits, mx.zeros((2, 5))])
        path, token, _ = trees.accept(tree, rows, mx.array([9]), None, params, mx.array(q[None]))
        ours[int(tree.tokens[path[1]]) if len(path) > 1 else token] += 1
        went_on += len(path) > 1
        mutant[drawn_child_first(p, q, drawn, [sibling], rng, residual=False)[0]] += 1
    assert sstats.chisquare(ours, p * n).pvalue > ALPHA
    assert sstats.chisquare(mutant, p * n).pvalue < 1e-6
    residual = np.maximum(p - q, 0)
    expect = sum(q[s] * (np.minimum(p, q).sum() + residual[1 if s != 1 else 0]) for s in range(5))
    assert abs(went_on / n - expect) < 4 * np.sqrt(expect * (1 - expect) / n)
    assert expect > np.minimum(p, q).sum()  # more than the chain's


def test_sampled_trees_hold_the_walks_drawn_path_first(sharp):
    """The tree a sampled cycle verifies starts with the path the walk drew (seeded: the same
    draws as the chain's own ``propose``), then other candidates."""
    from dflash2_mlx.loop.draft_context import DraftContext
    from dflash2_mlx.model.drafter import propose
    model, tok, drafter = sharp[2]
    target = attach(model, drafter)
    _, features = target(mx.array([tok.encode("abab")]), target.make_cache())
    context = DraftContext(drafter)
    context.add(features)
    hidden = drafter(mx.array([[3] + [drafter.config.mask_token_id] * 3]), context.fed())
    cand, scores = trees.lattice(drafter, hidden, 3)
    params = SamplingParams(temp=1.0)
    for seed in range(5):
        mx.random.seed(seed)
        draft, q = propose(drafter, hidden, mx.array(3), params)
        tree = grow(3, cand, scores, 8, params.temp, drawn=np.array(draft))
        assert tree.drawn == 3 and tree.tokens[1:4].tolist() == np.array(draft).tolist()
        assert tree.parents[1:4].tolist() == [0, 1, 2] and tree.size == 8
        kids = tree.children()
        assert all(len(kids[i]) == len(set(kids[i])) for i in range(tree.tokens.size))


def test_auto_budget_follows_the_cost_curve():
    """The H200's plateau (8-16 rows cost less than 5) takes wide trees; a curve that rises
    from the first rows (shaped like the published M4 Pro one) keeps the chain."""
    from dflash2_mlx.adaptive import curves

    h200, m4 = curves.cost_model("h200-27b-4bit"), curves.cost_model("m4pro-shaped")
    assert trees.choose(h200, 5, 0) == 32 and trees.choose(h200, 8, 0) == 8
    assert trees.choose(m4, 5, 0) == 4 and trees.choose(m4, 8, 0) == 7
    with pytest.raises(ValueError, match="no cost curve named 'mac'"):
        curves.load("mac")


def test_doctor_prints_the_cost_curves(tmp_path, monkeypatch):
    from dflash2_mlx.adaptive import CostModel
    from dflash2_mlx.calibration import store
    from dflash2_mlx.cli.doctor_report import costs_report

    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    lines = []
    costs_report(echo=lines.append)
    assert "not measured yet" in lines[0]
    store.write("costs", "0123456789abcdef",
                CostModel({1: (0.05, 0.0), 5: (0.1, 0.0), 33: (0.2, 0.0)}, {2: (0.01, 0.0)}).to_json())
    lines.clear()
    costs_report(echo=lines.append)
    table = "\n".join(lines)
    assert "| rows | here 01234567 | h200-27b-4bit | m4pro-shaped |" in table
    assert "| 5 | 2.00 | 3.22 |  |" in table and "| 33 | 4.00 | 2.64 | 3.90 |" in table
    assert "1 row 50.0 ms; measured 20" in table and "other processes used 0% of the cores" in table


def test_a_cost_file_is_exported_loaded_and_checked_against_the_pair(pairs, tmp_path, monkeypatch):
    """Another machine's curve replayed: with the H200-like file a block of 5 tries trees of
    8, 16 and 32 here (each priced within WORTH chains there); a file of another pair is a
    clear error."""
    from dflash2_mlx import calibration
    from dflash2_mlx.adaptive import curves

    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    model, tok, drafters = pairs["qwen3"]
    target = attach(model, drafters[2])
    path = tmp_path / "costs.json"
    calibration.export_costs(target, drafters[2], path)
    data = __import__("json").loads(path.read_text())
    assert data["pair"] and data["machine"]["platform"]
    h200 = curves.cost_model("h200-27b-4bit")  # this pair, priced as the H200 prices passes
    path.write_text(__import__("json").dumps({**data, "target": h200.to_json()["target"]}))
    prompt = "abcab dcba"
    last = None
    for last in d.stream_generate(model, tok, prompt, drafters[2], max_tokens=24, block_size=5,
                                  verify_mode="tree", lookup=False, cost_file=str(path)):
        pass
    assert last.trees >= 3 and last.tree_nodes >= 8 + 16 + 32
    other_model, _, other = pairs["llama"]
    with pytest.raises(ValueError, match="was measured for another target and drafter"):
        d.generate(other_model, tok, prompt, other[2], max_tokens=4, cost_file=str(path))
    with pytest.raises(ValueError, match="does not exist"):
        d.generate(model, tok, prompt, drafters[2], max_tokens=4, cost_file=str(tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a dflash2-mlx cost file"):
        d.generate(model, tok, prompt, drafters[2], max_tokens=4, cost_file=str(tmp_path / "bad.json"))


def test_trees_on_the_built_in_pair_are_plain_decodings_text():
    """SmolLM2-135M with its shipped DFlash 2 drafter: trees of 4, 8, 16 and 32 nodes give
    mlx-lm's own greedy tokens, and accept more per pass than the chain."""
    from mlx_lm.generate import generate_step

    model, tok, drafter = d.load()
    ids = tok.apply_chat_template([{"role": "user", "content": "Explain how a binary search works."}],
                                  add_generation_prompt=True)
    ref = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=32)]
    _, chain = tree_tokens(model, drafter, ids, 32, None, block_size=5)
    for budget in BUDGETS:
        out, stats = tree_tokens(model, drafter, ids, 32, budget, block_size=5)
        assert out == ref, f"tree of {budget} diverged from mlx-lm"
        assert stats.trees > 0
    assert stats.tau > chain.tau


def test_a_chat_through_one_prompt_cache_with_trees_is_mlx_lms(pairs):
    """mlx-lm's multi-turn use of ``prompt_cache`` with tree cycles: every turn's tokens and the
    cache's length after it are mlx_lm.stream_generate's (the cache is settled after trees)."""
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    model, tok, drafters = pairs["qwen3"]
    turns = ["abcab dcba", "dd cc", "a b c d", "bbbb"]

    def chat(stream):
        cache, out = make_prompt_cache(model), []
        for i, text in enumerate(turns):
            tokens = []
            for r in stream(tok.encode(text), cache):
                tokens.append(r.token)
                trees.append(getattr(r, "trees", 0))
                if i == 2 and len(tokens) == 5:  # a reader that stops early
                    break
            out.append((tokens, max(c.offset for c in cache)))
        return out

    trees = []
    want = chat(lambda ids, cache: mlx_lm.stream_generate(model, tok, ids, max_tokens=13, prompt_cache=cache))
    got = chat(lambda ids, cache: d.stream_generate(model, tok, ids, drafters[2], max_tokens=13, block_size=6,
                                                    prompt_cache=cache, verify_mode="tree", tree_budget=12,
                                                    lookup=False))
    assert got == want and max(trees) > 0


def test_live_choice_tries_each_candidate_then_runs_the_fastest():
    """``auto``'s live choice: the curve names the candidates (the chain, and the trees priced
    within WORTH chains), each runs TRIES cycles, then the most tokens per second of their own
    cycles wins; every REVISIT cycles the least recently run one runs again, so a tree whose
    acceptance grew is found, and one that does not pay runs only then."""
    from dflash2_mlx.adaptive import curves
    from dflash2_mlx.tree.budget import REVISIT, TRIES

    h200, m4 = curves.cost_model("h200-27b-4bit"), curves.cost_model("m4pro-shaped")
    assert trees.Arms(h200, 5).candidates == [4, 8, 16, 32]
    assert trees.Arms(m4, 8).candidates[0] == 7
    arms = trees.Arms(h200, 5)
    speed = {4: (2.0, 0.10), 8: (2.6, 0.11), 16: (3.0, 0.12), 32: (3.1, 0.20)}  # tokens, seconds a cycle
    picks = []
    for _ in range(4 * TRIES + 3 * REVISIT):
        n = arms.choose()
        picks.append(n)
        arms.record(n, *speed[n])
    assert picks[: 4 * TRIES] == [n for n in arms.candidates for _ in range(TRIES)]
    steady = picks[4 * TRIES:]
    assert steady.count(16) >= len(steady) - 3 and set(steady) - {16}  # the fastest, and revisits
    for _ in range(6 * REVISIT):  # the text changes: the chain now accepts as much, for less
        n = arms.choose()
        arms.record(n, *((3.0, 0.10) if n == 4 else speed[n]))
    assert max(arms.candidates, key=arms.rate) == 4


def test_auto_trees_under_the_adaptive_block_size(pairs, tmp_path, monkeypatch):
    """``--verify-mode tree`` as a user runs it: tree budget and block size both "auto", no
    cost curve given (the policy's, corrected by live timings, is there to be found)."""
    monkeypatch.setenv("DFLASH2_MLX_HOME", str(tmp_path))
    calibration.store.live.clear()
    model, tok, drafters = pairs["qwen3"]
    prompt = tok.encode("abcab dcba")
    target = attach(model, drafters[2])
    policy = calibration.policy(target, drafters[2], "auto", True)
    assert isinstance(policy.costs, adaptive.Corrected)
    out, stats = tree_tokens(model, drafters[2], prompt, MAX_TOKENS, "auto", block_size=policy)
    assert out == plain_tokens(model, prompt, MAX_TOKENS)
    assert stats.trees > 0 or stats.chain_why


def test_auto_trees_on_the_built_in_shaped_pair_are_plain_decodings(pairs):
    """Greedy parity whatever the live choice runs (chains and trees of every size)."""
    model, tok, drafters = pairs["qwen3"]
    prompt = tok.encode("abcab dcba")
    ref = plain_tokens(model, prompt, MAX_TOKENS)
    from dflash2_mlx.adaptive import curves

    out, stats = tree_tokens(model, drafters[2], prompt, MAX_TOKENS, "auto", costs=curves.cost_model("h200-27b-4bit"))
    assert out == ref and stats.trees > 0
