"""The path selector's kernels against the twins: the fused kernel and the walk
emulated on the CPU over published sizes and edge cases (ties, extreme logits, NaN rows,
sampling boundaries), the split layout (scores across threadgroups, then the walk) on
the production variants, and, with ``-m metal`` on Apple Silicon, all of them on the GPU."""

import mlx.core as mx
import pytest

from dflash2_mlx import kernels
from dflash2_mlx.kernels.selector import pair_scores_reference, walk_reference
from metal_emu.cases import (
    NO_METAL, SCORES, SELECT, SELECTOR_CASES, SELECTOR_RUNS, WALK, assert_scores_close,
    gpu_default, needs_gxx, production_selector_case, sel_args,
)
from metal_emu.emulate import emulate_many


@pytest.fixture(scope="module")
def selector_results():
    launches = [kernels.selector_launch(*sel_args(SELECTOR_CASES[n][0]), t, SELECTOR_CASES[n][0]["uniforms"])
                for n, t in SELECTOR_RUNS]
    outs = emulate_many(SELECT, launches, seeds=(0, 1, 2))
    return dict(zip(SELECTOR_RUNS, outs))


@pytest.fixture(scope="module")
def walk_results():
    launches = []
    for n, t in SELECTOR_RUNS:
        c = SELECTOR_CASES[n][0]
        launches.append(kernels.walk_launch(pair_scores_reference(*sel_args(c)), t, c["uniforms"]))
    return dict(zip(SELECTOR_RUNS, emulate_many(WALK, launches, seeds=(0, 1))))


@needs_gxx
@pytest.mark.parametrize("name,temp", SELECTOR_RUNS, ids=[f"{n}-T{t}" for n, t in SELECTOR_RUNS])
def test_selector_emulated_matches_twin(selector_results, name, temp):
    c = SELECTOR_CASES[name][0]
    scores, path, q = selector_results[(name, temp)]
    want_scores = pair_scores_reference(*sel_args(c))
    want_path, want_q = walk_reference(want_scores, temp, c["uniforms"])
    assert scores.dtype == mx.float32 and path.dtype == mx.int32 and q.dtype == mx.float32
    assert scores.shape == want_scores.shape and path.shape == want_path.shape and q.shape == want_q.shape
    if name in ("exact quarters k16 r32", "ties"):
        assert mx.array_equal(scores, want_scores).item()
    else:
        assert_scores_close(scores, want_scores, c)
    # The walk on the kernel's own scores follows the twin's rules exactly ...
    own_path, own_q = walk_reference(scores, temp, c["uniforms"])
    assert mx.array_equal(path, own_path).item()
    assert mx.allclose(q, own_q, atol=1e-6, rtol=1e-5).item()
    # ... and, these inputs having no near-ties, lands on the twin's path.
    assert mx.array_equal(path, want_path).item()
    assert mx.allclose(q, want_q, atol=1e-5, rtol=1e-4).item()


@needs_gxx
@pytest.mark.parametrize("name,temp", SELECTOR_RUNS, ids=[f"{n}-T{t}" for n, t in SELECTOR_RUNS])
def test_walk_emulated_matches_twin(walk_results, name, temp):
    c = SELECTOR_CASES[name][0]
    path, q = walk_results[(name, temp)]
    want_path, want_q = walk_reference(pair_scores_reference(*sel_args(c)), temp, c["uniforms"])
    assert mx.array_equal(path, want_path).item()
    if temp == 0:
        assert mx.array_equal(q, want_q).item()
    else:
        assert mx.allclose(q, want_q, atol=1e-6, rtol=1e-5).item()


@needs_gxx
def test_selector_edge_cases_do_what_they_claim(selector_results):
    # Ties go to the lowest index: 2 at position 0, then 0 (tied with 1).
    _, path, q = selector_results[("ties", 0.0)]
    assert path.tolist() == [[2, 0, 0, 0]] * 2
    assert (q.sum(-1) == 1).all().item()
    # Extreme logits: at u just below 1 the running sum stops short of u, so the pick is
    # the last candidate with q > 0, never the underflowed last one.
    for t in (0.05, 1.0, 1e4):
        _, path, q = selector_results[("extreme logits", t)]
        assert (q[..., -1] == 0).all().item()
        assert (path < 15).all().item()
    _, path, q = selector_results[("extreme logits", 1e4)]
    assert (path == 14).all().item()  # flat rows: u > cdf[j] for every j < 15
    # Low precision gate/codebooks: the A*g products round in that dtype, as in the twin.
    c = SELECTOR_CASES["bf16 gate and codebooks"][0]
    wide = pair_scores_reference(c["unary"], c["cand"], c["gate"].astype(mx.float32), c["anchor"],
                                 c["A"].astype(mx.float32), c["B"].astype(mx.float32))
    scores = selector_results[("bf16 gate and codebooks", 0.0)][0]
    assert_scores_close(scores, pair_scores_reference(*sel_args(c)), c)
    bound = (mx.max(mx.abs(wide)) + 1.0).item() * c["gate"].shape[-1] * 2e-7
    assert mx.max(mx.abs(scores - wide)).item() > 5 * bound


# ---- the batch-1 layout: scores split across threadgroups, then the walk ----------------


@pytest.fixture(scope="module")
def split_scores():
    names = list(SELECTOR_CASES)
    outs = emulate_many(SCORES, [kernels.scores_launch(*sel_args(SELECTOR_CASES[n][0])) for n in names],
                        seeds=(0, 1))
    return dict(zip(names, (o[0] for o in outs)))


@needs_gxx
@pytest.mark.parametrize("name", list(SELECTOR_CASES))
def test_split_scores_equal_the_fused_kernels_bit_for_bit(split_scores, selector_results, name):
    # Same products and the same sequential sum over the rank as the fused kernel: the
    # split layout changes where rows are read from (threadgroup memory), not the arithmetic.
    c, temps = SELECTOR_CASES[name]
    fused = selector_results[(name, temps[0])][0]
    assert split_scores[name].shape == fused.shape and split_scores[name].dtype == mx.float32
    assert mx.array_equal(split_scores[name], fused).item()
    assert_scores_close(split_scores[name], pair_scores_reference(*sel_args(c)), c)


PRODUCTION_SPLIT = [(L, 256, dt) for L in (4, 15) for dt in (mx.float32, mx.bfloat16, mx.float16)]
PRODUCTION_SPLIT.append((4, 100, mx.float32))
SPLIT_TEMPS = (0.0, 0.8)


@pytest.fixture(scope="module")
def production_split():
    cases = [production_selector_case(40 + i, *p) for i, p in enumerate(PRODUCTION_SPLIT)]
    scores = [o[0] for o in emulate_many(SCORES, [kernels.scores_launch(*a) for a, _ in cases], seeds=(0, 1))]
    runs = [(i, t) for i in range(len(cases)) for t in SPLIT_TEMPS]
    walks = emulate_many(WALK, [kernels.walk_launch(scores[i], t, cases[i][1]) for i, t in runs], seeds=(0,))
    return {(i, t): (cases[i], scores[i], *w) for (i, t), w in zip(runs, walks)}


@needs_gxx
@pytest.mark.parametrize("i", range(len(PRODUCTION_SPLIT)),
                         ids=[f"L{L}-r{R}-{str(d).split('.')[-1]}" for L, R, d in PRODUCTION_SPLIT])
@pytest.mark.parametrize("temp", SPLIT_TEMPS)
def test_split_layout_matches_twin_on_production_variants(production_split, i, temp):
    (args, u), scores, path, q = production_split[(i, temp)]
    launch = kernels.scores_launch(*args)
    if args[2].shape[-1] == 256:  # the variant production dispatches, self-checked as such
        production = [kernels.variant("path_scores", p) for p in kernels.production_launches("path_scores")]
        assert kernels.variant("path_scores", launch) in production
    assert dict(launch.template)["AB"] * 16 == launch.threadgroup[0] == 256
    assert launch.grid == (256, args[0].shape[0], 1)  # one threadgroup per position
    want = pair_scores_reference(*args)
    assert mx.array_equal(scores, want).item()
    want_path, want_q = walk_reference(want, temp, u)
    assert kernels.path_problem(f"T={temp}", path, q, want_path, want_q, u, temp) == ""
    if temp == 0:
        assert mx.array_equal(path, want_path).item() and mx.array_equal(q, want_q).item()
    else:
        assert (mx.max(q, axis=-1) < 1).any().item()  # really sampled, not one-hot rows


def nan_selector_case(L=5, K=16, R=8, V=64):
    """NaN and infinite scores through the split layout: position 0's rows all NaN (a NaN
    in the anchor's predecessor row), a NaN candidate at position 1, a row of -inf and
    NaN at 2, +inf at 3, ordinary numbers at 4."""
    (unary, cand, gate, anchor, A, B), u = production_selector_case(60, L, R, mx.float32, V=V, K=K)
    A = A.at[7, 3].add(float("nan"))  # the anchor is token 7
    cand = mx.where(cand == 7, 8, cand)  # ... and no candidate shares its row
    unary = unary.at[1, 0].add(float("nan"))
    unary = unary.at[2].multiply(0).at[2].add(-float("inf")).at[2, 4].add(float("nan"))
    unary = unary.at[3, 5].add(float("inf"))
    return (unary, cand, gate, anchor, A, B), u


@needs_gxx
@pytest.mark.parametrize("temp", SPLIT_TEMPS)
def test_split_layout_follows_the_nan_rule(temp):
    args, u = nan_selector_case()
    (scores,), = emulate_many(SCORES, [kernels.scores_launch(*args)], seeds=(0, 1))
    want = pair_scores_reference(*args)
    assert mx.array_equal(scores, want, equal_nan=True).item()
    assert mx.isnan(scores[0]).all().item() and mx.isnan(scores[1, :, 0]).all().item()
    (path, q), = emulate_many(WALK, [kernels.walk_launch(scores, temp, u)], seeds=(0,))
    want_path, want_q = walk_reference(want, temp, u)
    assert path.tolist() == want_path.tolist()
    assert mx.allclose(q, want_q, atol=1e-6).item() and not mx.isnan(q).any().item()
    p = path.tolist()
    assert p[0] == 0 and p[1] != 0 and p[2] == 0 and p[3] == 5  # NaN counts as -inf


# ---- NaN rows and sampling boundaries ---------------------------------------------------


def nan_rows():
    nan, inf = float("nan"), float("inf")
    rows = [
        [nan, 1, 2, 0],      # NaN first: argmax skips it
        [1, nan, 2, 2],      # NaN in the middle, tied maximum after it
        [nan, nan, nan, nan],
        [-inf, -inf, -inf, -inf],
        [nan, -inf, nan, -inf],
        [3, inf, 1, inf],    # +inf: greedy even when sampling
        [0.5, -inf, nan, 0.25],
    ]
    scores = mx.array(rows, dtype=mx.float32)  # [T, K]: every predecessor row the same
    return mx.broadcast_to(scores[:, None, :], (len(rows), 4, 4))


@needs_gxx
@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_nan_rows_walk_the_same_in_kernel_and_twin(temp):
    scores = nan_rows()
    u = mx.full((scores.shape[0],), 0.6)
    (path, q), = emulate_many(WALK, [kernels.walk_launch(scores, temp, u)], seeds=(0, 1))
    want_path, want_q = walk_reference(scores, temp, u)
    assert path.tolist() == want_path.tolist()
    assert mx.allclose(q, want_q, atol=1e-6, equal_nan=True).item()
    assert not mx.isnan(q).any().item() and (q.sum(-1) == 1).all().item()
    expect = [2, 2, 0, 0, 0, 1, 0] if temp == 0 else [None, None, 0, 0, 0, 1, None]
    for got, e in zip(path.tolist(), expect):
        assert e is None or got == e
    # NaN counts as -inf: never picked when a number is there, even when sampling.
    assert path.tolist()[0] != 0 and path.tolist()[-1] in (0, 3)


def test_path_comparison_tolerates_only_boundary_flips():
    q = mx.array([[[0.25, 0.25, 0.5, 0.0]]])
    u = mx.array([[0.5]])  # exactly at the boundary between candidates 1 and 2
    want_path = mx.array([[2]])
    assert kernels.path_problem("T=1", mx.array([[1]]), q, want_path, q, u, 1.0) == ""
    assert "not at a sampling boundary" in kernels.path_problem("T=1", mx.array([[0]]), q, want_path, q, u, 1.0)
    far = mx.array([[0.5 + 10 * kernels.BOUNDARY_TOL]])
    assert kernels.path_problem("T=1", mx.array([[1]]), q, want_path, q, far, 1.0)
    assert kernels.path_problem("T=0", mx.array([[1]]), q, want_path, q, u, 0.0)  # greedy: exact
    assert "q (T=1)" in kernels.path_problem("T=1", want_path, q * 0.5, want_path, q, u, 1.0)


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason=NO_METAL)
@pytest.mark.parametrize("name,temp", SELECTOR_RUNS, ids=[f"{n}-T{t}" for n, t in SELECTOR_RUNS])
def test_metal_selector_and_walk_match_twin(name, temp):
    gpu_default()
    c = SELECTOR_CASES[name][0]
    scores, path, q = kernels.run_metal("path_selector",
                                        kernels.selector_launch(*sel_args(c), temp, c["uniforms"]))
    want_scores = pair_scores_reference(*sel_args(c))
    assert_scores_close(scores, want_scores, c)
    own_path, own_q = walk_reference(scores, temp, c["uniforms"])
    assert mx.array_equal(path, own_path).item()
    assert mx.allclose(q, own_q, atol=1e-5, rtol=1e-4).item()
    wp, wq = kernels.run_metal("path_walk", kernels.walk_launch(want_scores, temp, c["uniforms"]))
    twin_path, twin_q = walk_reference(want_scores, temp, c["uniforms"])
    assert mx.array_equal(wp, twin_path).item()
    assert mx.allclose(wq, twin_q, atol=1e-5, rtol=1e-4).item()
    # The split layout (batch 1's): scores across threadgroups, then the same walk.
    split = kernels.run_metal("path_scores", kernels.scores_launch(*sel_args(c)))[0]
    assert_scores_close(split, want_scores, c)
    sp, sq = kernels.run_metal("path_walk", kernels.walk_launch(split, temp, c["uniforms"]))
    own_path, own_q = walk_reference(split, temp, c["uniforms"])
    assert kernels.path_problem(f"T={temp}", sp, sq, own_path, own_q, c["uniforms"], temp) == ""
