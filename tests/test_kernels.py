"""The Metal kernels, checked three ways.

1. Everywhere: the kernel body text handed to ``mx.fast.metal_kernel`` is compiled as
   C++ (tests/metal_emu) with the signature MLX would generate, run over its whole grid
   in shuffled thread orders under AddressSanitizer, and compared with the twins.
2. Everywhere: the generated Metal source is inspected for what the emulator cannot see.
3. ``pytest -m metal`` on Apple Silicon: the real kernels against the twins.
"""

import re
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dflash2_mlx import kernels  # noqa: E402
from dflash2_mlx.model.conv import dynamic_conv_reference  # noqa: E402
from dflash2_mlx.model.selector import pair_scores_reference, walk_reference  # noqa: E402
from metal_emu.emulate import (  # noqa: E402
    EMULATED_ATTRIBUTES, THREADGROUP_ARRAY, emulate, emulate_many, metal_source, used_attributes,
)

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulation harness needs g++")
NO_METAL = "needs Apple Silicon with MLX's Metal back-end (mx.metal.is_available() is False here)"

CONV = kernels.SOURCES["dynamic_conv"]
SELECT = kernels.SOURCES["path_selector"]
SCORES = kernels.SOURCES["path_scores"]
WALK = kernels.SOURCES["path_walk"]


def keys(seed, n):
    return mx.random.split(mx.random.key(seed), n)


# ---- inputs ----------------------------------------------------------------------


def conv_case(seed, batch, L, H, groups, dtypes=(mx.float32,) * 3, scale=1.0):
    k = keys(seed, 3)
    xd, dd, bd = dtypes
    x = (mx.random.normal((*batch, L, H), key=k[0]) * scale).astype(xd)
    dyn = (mx.random.normal((*batch, L, 2, groups), key=k[1]) * 0.5).astype(dd)
    base = mx.random.normal((2, H), key=k[2]).astype(bd)
    return x, dyn, base


CONV_CASES = {
    "fp32 published H5120 B8": conv_case(0, (1,), 8, 5120, 320),
    "fp32 T=1": conv_case(1, (3,), 1, 64, 4),
    "fp32 T=16 batch (2,3)": conv_case(2, (2, 3), 16, 48, 16),
    "fp32 group size 1": conv_case(3, (2,), 5, 24, 24),
    "fp32 one group": conv_case(4, (1,), 4, 32, 1),
    "fp32 no batch dim": conv_case(5, (), 7, 64, 4),
    "fp16": conv_case(6, (2,), 5, 128, 8, (mx.float16,) * 3),
    "fp16 near overflow": conv_case(7, (2,), 4, 64, 4, (mx.float16,) * 3, scale=3e4),
    "bf16 published H5120 B5": conv_case(8, (2,), 5, 5120, 320, (mx.bfloat16,) * 3),
    "bf16 x, fp32 base": conv_case(9, (2,), 6, 96, 6, (mx.bfloat16, mx.bfloat16, mx.float32)),
    "fp32 x, bf16 taps": conv_case(10, (2,), 6, 96, 6, (mx.float32, mx.bfloat16, mx.bfloat16)),
    "fp16 x, bf16 base": conv_case(11, (1,), 3, 32, 2, (mx.float16, mx.float16, mx.bfloat16)),
}


def last_group_case():
    """dyn is zero except in the last channel group, where it is large."""
    x, dyn, base = conv_case(12, (2,), 5, 80, 5)
    dyn = mx.zeros_like(dyn).at[..., -1].add(3.0)
    return x, dyn, base


CONV_CASES["last channel group only"] = last_group_case()


def quarter(shape, key, lo=-8, hi=8):
    """Multiples of 1/4 in [lo/4, hi/4]: every product and sum below stays exact in fp32."""
    return mx.round(mx.random.uniform(lo, hi, shape, key=key)) / 4


def selector_case(seed, batch, L, K, R, V=300, dtype=mx.float32, exact=False):
    k = keys(seed, 7)
    draw = quarter if exact else (lambda s, key: mx.random.normal(s, key=key))
    cand = mx.argsort(mx.random.uniform(shape=(*batch, L, V), key=k[0]), axis=-1)[..., :K]
    unary = draw((*batch, L, K), k[1]) * (1 if exact else 3)
    gate = draw((*batch, L, R), k[2]).astype(dtype)
    A = (draw((V, R), k[3]) * (1 if exact else R**-0.5)).astype(dtype)
    B = (draw((V, R), k[4]) * (1 if exact else R**-0.5)).astype(dtype)
    anchor = mx.random.randint(0, V, batch, key=k[5]).astype(mx.int32)
    uniforms = mx.random.uniform(shape=(*batch, L), key=k[6])
    return dict(unary=unary, cand=cand, gate=gate, anchor=anchor, A=A, B=B, uniforms=uniforms)


def ties_case():
    """Every row has its maximum twice (indices 2 and 5 at t=0, 0 and 1 after), rest below."""
    c = selector_case(20, (2,), 4, 8, 4, exact=True)
    unary = mx.broadcast_to(mx.array([0.0, -1, 1, -2, -3, 1, -4, -5]), c["unary"].shape)
    unary = mx.where(mx.arange(4)[:, None] > 0, mx.array([1.0, 1, 0, -1, -2, -3, -4, -5]), unary)
    c.update(unary=unary, A=mx.zeros_like(c["A"]))
    return c


def extreme_case():
    """Logits spanning 1e4..-1e30, a candidate so low its q underflows to exactly 0."""
    c = selector_case(21, (2,), 5, 16, 8)
    unary = c["unary"] * 3e3
    unary = unary.at[..., -1].add(-1e30)
    c.update(unary=unary, uniforms=mx.full(c["uniforms"].shape, 0.99999994))
    return c


SELECTOR_CASES = {
    "published k16 r256 B8": (selector_case(30, (2,), 7, 16, 256), (0.0, 1.0)),
    "published k16 r256 B5 batch 1": (selector_case(31, (1,), 4, 16, 256), (0.0, 0.7)),
    "exact quarters k16 r32": (selector_case(32, (3,), 6, 16, 32, exact=True), (0.0, 1.0)),
    "T=1": (selector_case(33, (2,), 1, 16, 16), (0.0, 1.0)),
    "k4 r8 no batch dim": (selector_case(34, (), 3, 4, 8), (0.0, 0.5)),
    "k20 r64 batch (2,2)": (selector_case(35, (2, 2), 5, 20, 64), (0.0, 2.0)),
    "k32 r16 (more pairs than threads)": (selector_case(36, (1,), 3, 32, 16), (0.0, 1.0)),
    "k16 r100 (a partial rank tile)": (selector_case(39, (1,), 3, 16, 100), (0.0, 1.0)),
    "bf16 gate and codebooks": (selector_case(37, (2,), 5, 16, 64, dtype=mx.bfloat16), (0.0, 1.0)),
    "fp16 gate and codebooks": (selector_case(38, (2,), 5, 16, 64, dtype=mx.float16), (0.0, 1.0)),
    "ties": (ties_case(), (0.0,)),
    "extreme logits": (extreme_case(), (0.0, 0.05, 1.0, 1e4)),
}


def sel_args(c):
    return c["unary"], c["cand"], c["gate"], c["anchor"], c["A"], c["B"]


# ---- 2. the generated Metal source --------------------------------------------------


def identifiers(text):
    return set(re.findall(r"\b[A-Za-z_]\w*\b", re.sub(r"//[^\n]*", "", text)))


def launches():
    x, dyn, base = CONV_CASES["fp16"]
    c = SELECTOR_CASES["published k16 r256 B8"][0]
    scores = pair_scores_reference(*sel_args(c))
    return [
        (CONV, kernels.conv_launch(x, dyn, base)),
        (SELECT, kernels.selector_launch(*sel_args(c), 1.0, c["uniforms"])),
        (SCORES, kernels.scores_launch(*sel_args(c))),
        (WALK, kernels.walk_launch(scores, 1.0, c["uniforms"])),
    ]


@pytest.mark.parametrize("src,launch", launches(), ids=["conv", "select", "scores", "walk"])
def test_generated_source_uses_every_name_and_declares_every_template_param(src, launch):
    used = identifiers(src.source)
    for name in (*src.input_names, *src.output_names):
        assert name in used, f"{src.name}: {name} is passed but never used"
    assert len(launch.inputs) == len(src.input_names)
    assert len(launch.output_shapes) == len(src.output_names) == len(launch.output_dtypes)

    text = metal_source(src, launch)
    decl = re.search(r"template <([^>]*)>\n\[\[kernel\]\]", text).group(1)
    declared = [p.split()[-1] for p in decl.split(",")]
    assert declared == [n for n, _ in launch.template]
    # Every all-caps name the body or header uses is a template parameter or a local
    # constant, and every template parameter is used.
    body = identifiers(src.header) | used
    caps = {w for w in body if re.fullmatch(r"[A-Z][A-Z0-9]*", w)}
    local = set(re.findall(r"constexpr\s+\w+\s+([A-Z]\w*)", src.source))
    local |= set(re.findall(r"template\s*<[^>]*\bint\s+([A-Z]\w*)", src.header))
    assert caps - local <= set(declared), f"undeclared template names {caps - local - set(declared)}"
    assert set(declared) <= body, f"unused template params {set(declared) - body}"
    # Only what the emulator models: attributes, threadgroup memory as arrays declared in
    # the body (no pointers into it), no SIMD ops.
    assert {a for a, _ in used_attributes(src.source)} <= EMULATED_ATTRIBUTES
    code = re.sub(r"//[^\n]*", "", src.source + src.header)
    assert len(re.findall(r"\bthreadgroup\b", code)) == len(THREADGROUP_ARRAY.findall(code))
    assert "simd_" not in src.source + src.header and "quad_" not in src.source + src.header
    # The instantiation MLX appends names the same template values.
    assert text.rstrip().endswith(";") and "[[host_name(" in text


def test_small_inputs_bind_in_constant_space_and_scalars_by_reference():
    c = SELECTOR_CASES["k4 r8 no batch dim"][0]
    text = metal_source(SELECT, kernels.selector_launch(*sel_args(c), 0.5, c["uniforms"]))
    assert "const constant int32_t* anchor [[buffer(3)]]" in text  # one row: 1 element
    assert "const constant float& temperature [[buffer(6)]]" in text
    assert "const constant float* uniforms [[buffer(7)]]" in text  # 3 elements
    assert "device float* scores [[buffer(8)]]" in text
    assert "uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]" in text


def test_kernel_sources_are_package_data():
    assert "//@ conv" not in CONV.source and "thread_position_in_grid" in CONV.source
    assert "dflash_walk_step" in SELECT.header and SELECT.header == WALK.header
    assert "threadgroup_barrier" in SELECT.source and "threadgroup_barrier" not in WALK.source
    assert len(THREADGROUP_ARRAY.findall(SCORES.source)) == 2 and "//@" not in SCORES.source


# ---- 1. the kernels, emulated on the CPU --------------------------------------------


@pytest.fixture(scope="module")
def conv_results():
    names = list(CONV_CASES)
    outs = emulate_many(CONV, [kernels.conv_launch(*CONV_CASES[n]) for n in names], seeds=(0, 1))
    return dict(zip(names, (o[0] for o in outs)))


@needs_gxx
@pytest.mark.parametrize("name", list(CONV_CASES))
def test_conv_emulated_matches_twin_bit_for_bit(conv_results, name):
    x, dyn, base = CONV_CASES[name]
    got, want = conv_results[name], dynamic_conv_reference(x, dyn, base)
    assert got.dtype == want.dtype == x.dtype and got.shape == want.shape
    assert mx.array_equal(got, want, equal_nan=True).item()


@needs_gxx
def test_conv_cases_reach_the_edges(conv_results):
    # The last group's taps changed exactly the last group's channels.
    x, dyn, base = CONV_CASES["last channel group only"]
    plain = dynamic_conv_reference(x, mx.zeros_like(dyn), base)
    changed = mx.any(conv_results["last channel group only"] != plain, axis=(0, 1))
    assert changed[-16:].all().item() and not changed[:-16].any().item()
    # fp16 overflowed to inf somewhere, identically in both.
    assert mx.isinf(conv_results["fp16 near overflow"]).any().item()
    # bf16 inputs round differently from an fp32 computation: the exact match is a real check.
    x, dyn, base = CONV_CASES["bf16 published H5120 B5"]
    wide = dynamic_conv_reference(*(a.astype(mx.float32) for a in (x, dyn, base))).astype(mx.bfloat16)
    assert not mx.array_equal(wide, conv_results["bf16 published H5120 B5"]).item()


def expand_selector_cases():
    runs = []
    for name, (c, temps) in SELECTOR_CASES.items():
        for t in temps:
            runs.append((name, t))
    return runs


SELECTOR_RUNS = expand_selector_cases()


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


def assert_scores_close(got, want, c):
    # fp32 sums of R products in another order: bound by R ulps of the largest term.
    bound = (mx.max(mx.abs(want)) + 1.0) * c["gate"].shape[-1] * 2e-7
    err = mx.max(mx.abs(got - want)).item()
    assert err <= bound.item(), f"score error {err} above {bound.item()}"


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


def test_split_layout_tiles_fit_metal():
    for K, R in ((16, 256), (20, 100), (32, 16), (4, 8), (256, 256), (1024, 64)):
        ab, rt = kernels.score_tiles(K, R)
        assert 1 <= ab <= K and 1 <= rt <= min(R, kernels.RANK_TILE)
        assert ab * K <= max(kernels.SCORE_THREADS, K) <= 1024
        assert (ab + K) * (rt + 1) * 4 <= kernels.MAX_THREADGROUP_MEMORY
    assert kernels.score_tiles(16, 256) == (16, 64)  # production: one threadgroup per position
    with pytest.raises(ValueError, match="1024 threads"):
        kernels.score_tiles(1025, 8)


def production_selector_case(seed, L, R, dtype, V=300, K=16):
    """What the drafter passes: no batch dimension, top_candidates' uint32 ids (from
    argpartition), a 0-d int32 anchor; values in quarters, so the scores are exact in any
    summation order and the paths can be compared with the twin's exactly."""
    from dflash2_mlx.model.selector import top_candidates

    k = keys(seed, 7)
    cand, _ = top_candidates(mx.random.normal((L, V), key=k[0]), K)
    args = (quarter((L, K), k[1]), cand, quarter((L, R), k[2]).astype(dtype), mx.array(7),
            quarter((V, R), k[3]).astype(dtype), quarter((V, R), k[4]).astype(dtype))
    return args, mx.random.uniform(shape=(L,), key=k[5])


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


@needs_gxx
def test_select_at_batch_1_runs_the_split_layout_and_falls_back_per_variant(monkeypatch):
    """The dispatch itself, with the emulator standing in for the GPU: at batch 1 the
    split layout's variants are self-checked and run; when the scores variant fails its
    check, select warns and uses the fused kernel."""
    ran = []

    def on_emulator(key, launch):
        ran.append(key)
        return emulate(kernels.SOURCES[key], launch)

    monkeypatch.setattr(kernels, "run_metal", on_emulator)
    monkeypatch.setattr(kernels, "metal_usable", lambda: True)
    monkeypatch.setattr(kernels, "reference_forced", lambda: False)
    monkeypatch.setattr(kernels, "_checks", {})
    args, u = production_selector_case(70, 4, 32, mx.float32)
    want = pair_scores_reference(*args)
    want_path, want_q = walk_reference(want, 0.8, u)
    scores, path, q = kernels.select(*args, 0.8, u)
    assert set(ran) == {"path_scores", "path_walk"} and ran[-1] == "path_walk"  # checks, then runs
    assert mx.array_equal(scores, want).item()
    assert kernels.path_problem("T=0.8", path, q, want_path, want_q, u, 0.8) == ""

    monkeypatch.setitem(kernels.SOURCES, "path_scores", broken(SCORES, "r < rn; ++r", "r + 1 < rn; ++r"))
    monkeypatch.setattr(kernels, "_checks", {})  # a new process: nothing checked yet
    ran.clear()
    with pytest.warns(RuntimeWarning, match=r"path_scores\[K=16 R=32 .* disagreed"):
        scores, path, q = kernels.select(*args, 0.8, u)
    assert ran[-1] == "path_selector" and "path_walk" not in ran
    assert mx.array_equal(scores, want).item()
    assert kernels.path_problem("T=0.8", path, q, want_path, want_q, u, 0.8) == ""


# ---- the harness itself can fail ------------------------------------------------------

TOY = kernels.KernelSource(
    name="toy_sum",
    input_names=("x",),
    output_names=("y", "total"),
    source="""
const uint i = thread_position_in_grid.x;
y[i] = x[i] * 2.0f;
BARRIER
if (i == 0) {
  float s = 0.0f;
  for (uint j = 0; j < N; ++j) {
    if (y[j] == y[j]) s += y[j];  // unwritten outputs hold NaN: add what is there
  }
  total[0] = s;
}
""",
)


def toy(barrier: bool, read_past_end: bool = False):
    src = TOY.source.replace("BARRIER", "metal::threadgroup_barrier(metal::mem_flags::mem_device);" if barrier else "")
    if read_past_end:
        src = src.replace("x[i] * 2.0f", "x[i + 1] * 2.0f")
    n = 64
    launch = kernels.Launch(inputs=[mx.arange(n, dtype=mx.float32)], template=[("N", n)], grid=(n, 1, 1),
                            threadgroup=(n, 1, 1), output_shapes=[(n,), (1,)],
                            output_dtypes=[mx.float32, mx.float32])
    return kernels.KernelSource(TOY.name, TOY.input_names, TOY.output_names, src), launch


@needs_gxx
def test_harness_catches_thread_order_dependence_and_honours_barriers():
    src, launch = toy(barrier=False)
    with pytest.raises(AssertionError, match="depends on thread order"):
        emulate_many(src, [launch], seeds=(0, 1, 2, 3))
    src, launch = toy(barrier=True)
    (y, total), = emulate_many(src, [launch], seeds=(0, 1, 2, 3))
    assert total.item() == 2 * sum(range(64))


@needs_gxx
def test_harness_catches_out_of_bounds_reads():
    src, launch = toy(barrier=True, read_past_end=True)
    with pytest.raises(RuntimeError, match="heap-buffer-overflow"):
        emulate(src, launch)


# ---- dispatch, self-check, doctor on this machine -------------------------------------


def on_twins_only():
    return not kernels.metal_usable() or kernels.reference_forced()


def test_dispatch_uses_the_twins_without_metal(monkeypatch):
    x, dyn, base = CONV_CASES["fp32 T=1"]
    c = SELECTOR_CASES["k4 r8 no batch dim"][0]
    monkeypatch.setenv(kernels.FORCE_REFERENCE_ENV, "1")
    for k in kernels.KERNEL_NAMES:
        assert kernels.active_path(k) == f"reference (forced by {kernels.FORCE_REFERENCE_ENV})"
    monkeypatch.delenv(kernels.FORCE_REFERENCE_ENV)
    if not mx.metal.is_available():
        for k in kernels.KERNEL_NAMES:
            assert kernels.active_path(k) == "reference (no Metal back-end)"
    if on_twins_only():
        assert mx.array_equal(kernels.dynamic_conv(x, dyn, base), dynamic_conv_reference(x, dyn, base)).item()
        scores, path, q = kernels.select(*sel_args(c), 0.5, c["uniforms"])
        assert mx.array_equal(scores, pair_scores_reference(*sel_args(c))).item()
        wp, wq = walk_reference(scores, 0.5, c["uniforms"])
        assert mx.array_equal(path, wp).item() and mx.array_equal(q, wq).item()
        p2, q2 = kernels.walk(scores, 0.5, c["uniforms"])
        assert mx.array_equal(p2, wp).item()


@pytest.mark.skipif(mx.metal.is_available(), reason="checks the failure path a missing back-end takes")
def test_self_check_failure_warns_once_naming_the_kernel_and_is_reported(monkeypatch):
    monkeypatch.setattr(kernels, "_checks", {})
    with pytest.warns(RuntimeWarning, match=r"dynamic_conv\[T=float32.*failed to run.*No Metal back-end"):
        result = kernels.self_check("dynamic_conv")
    assert not result.passed and "No Metal back-end" in result.detail and result.failure == "failed to run"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.self_check("dynamic_conv") is result  # no second warning


def test_gradients_come_from_the_twin():
    x, dyn, base = CONV_CASES["fp32 T=16 batch (2,3)"]
    # A forward that is not the twin's (scaled by 2) still gets the twin's gradient.
    f = kernels._with_twin_vjp(lambda *a: 2 * dynamic_conv_reference(*a), dynamic_conv_reference,
                               (True, True, True))
    g_twin = mx.grad(lambda *a: (dynamic_conv_reference(*a) * mx.arange(48)).sum(), argnums=(0, 1, 2))(x, dyn, base)
    g_f = mx.grad(lambda *a: (f(*a) * mx.arange(48)).sum(), argnums=(0, 1, 2))(x, dyn, base)
    for a, b in zip(g_twin, g_f):
        assert mx.allclose(a, b).item()
    # Integer inputs (candidate ids) get zero gradients.
    c = SELECTOR_CASES["k4 r8 no batch dim"][0]
    s = kernels._with_twin_vjp(pair_scores_reference, pair_scores_reference,
                               (True, False, True, False, True, True))
    gu, gg = mx.grad(lambda u, g: s(u, c["cand"], g, c["anchor"], c["A"], c["B"]).sum(), argnums=(0, 1))(
        c["unary"], c["gate"])
    wu, wg = mx.grad(lambda u, g: pair_scores_reference(u, c["cand"], g, c["anchor"], c["A"], c["B"]).sum(),
                     argnums=(0, 1))(c["unary"], c["gate"])
    assert mx.allclose(gu, wu).item() and mx.allclose(gg, wg).item()


def test_doctor_reports_every_kernel(capsys):
    from dflash2_mlx.machine.doctor import run_doctor

    report = run_doctor()
    printed = capsys.readouterr().out
    assert [r["kernel"] for r in report] == [k for k in kernels.KERNEL_NAMES
                                             for _ in kernels.production_launches(k)]
    for r in report:
        assert r["variant"] in printed and r["path"] in printed
        if not mx.metal.is_available():
            assert r["path"] in ("reference (no Metal back-end)",
                                 f"reference (forced by {kernels.FORCE_REFERENCE_ENV})")
            assert r["self_check"].startswith("not run")


def test_bench_kernels_times_the_twins_here(capsys):
    from dflash2_mlx.eval.kernel_bench import bench_kernels

    rows = bench_kernels(hidden=256, blocks=(5,), top_k=16, rank=32, vocab=512, repeats=2)
    printed = capsys.readouterr().out
    assert [r["kernel"] for r in rows] == ["dynamic_conv", "path_selector", "path_scores+path_walk"]
    for r in rows:
        assert r["twin_ms"] > 0
        if not kernels.metal_usable():
            assert r["kernel_ms"] is None and r["ratio"] is None
    if not kernels.metal_usable():
        assert "twin only" in printed and "no Metal back-end" in printed


# ---- 3. the real kernels (Apple Silicon) ---------------------------------------------

def gpu_default():
    mx.set_default_device(mx.gpu)


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason=NO_METAL)
@pytest.mark.parametrize("name", list(CONV_CASES))
def test_metal_conv_matches_twin(name):
    gpu_default()
    x, dyn, base = CONV_CASES[name]
    got = kernels.run_metal("dynamic_conv", kernels.conv_launch(x, dyn, base))[0]
    want = dynamic_conv_reference(x, dyn, base)
    assert got.dtype == want.dtype and got.shape == want.shape
    # The GPU may contract a*b + c*d into an FMA: allow one rounding of the output dtype.
    tol = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}[x.dtype]
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    # Near fp16 overflow a fused multiply-add can stay finite where the twin's rounded
    # product overflows: compare the finite values, and the overflow sets nearly agree.
    finite = mx.isfinite(got) & mx.isfinite(want)
    assert mx.mean((mx.isfinite(got) != mx.isfinite(want)).astype(mx.float32)).item() < 0.01
    assert mx.allclose(mx.where(finite, got, 0), mx.where(finite, want, 0), rtol=tol, atol=tol).item()


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


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason=NO_METAL)
def test_metal_dispatch_self_checks_and_differentiates(monkeypatch):
    gpu_default()
    monkeypatch.delenv(kernels.FORCE_REFERENCE_ENV, raising=False)
    for k in kernels.KERNEL_NAMES:
        for launch in kernels.production_launches(k):
            check = kernels.self_check(k, launch)
            assert check.passed, f"{check.variant} {check.failure}: {check.detail}"
            assert kernels.active_path(k, launch) == "metal"
    x, dyn, base = CONV_CASES["fp32 T=16 batch (2,3)"]
    g = mx.grad(lambda a: (kernels.dynamic_conv(a, dyn, base) ** 2).sum())(x)
    w = mx.grad(lambda a: (dynamic_conv_reference(a, dyn, base) ** 2).sum())(x)
    assert mx.allclose(g, w, rtol=1e-4, atol=1e-4).item()


def test_draft_cycle_share_on_the_tiny_pair(tmp_path, capsys):
    from dflash2_mlx.eval.kernel_bench import draft_cycle_share
    from tiny_models import make_drafter, make_target

    make_target(tmp_path / "target", hidden=64)
    make_drafter(tmp_path / "drafter", tmp_path / "target", version=2)
    r = draft_cycle_share(str(tmp_path / "target"), str(tmp_path / "drafter"), max_tokens=12)
    assert r["cycles"] >= 1 and r["conv_ms"] > 0 and r["selector_ms"] > 0
    assert r["conv_share"] > 0 and r["selector_share"] > 0
    # Timed inside the profiled run's cycles (the plain run's time varies with load).
    assert r["conv_ms"] + r["selector_ms"] < r["profiled_cycle_ms"]
    assert "ms/cycle" in capsys.readouterr().out


def broken(src, old, new):
    assert old in src.source + src.header
    return kernels.KernelSource(src.name + "_broken", src.input_names, src.output_names,
                                src.source.replace(old, new), src.header.replace(old, new))


def emulated_checks(key, src=None):
    """Self-check every production variant of ``key`` through the emulator (one program
    for all of them); returns one SelfCheck-like (passed, detail) per variant."""
    src = src or kernels.SOURCES[key]
    variants = [(launch, kernels.CHECK_CASES[key](launch)) for launch in kernels.production_launches(key)]
    launches = [case.launch for _, cases in variants for case in cases]
    outs = iter(emulate_many(src, launches, seeds=(0,)))
    return [(launch, "; ".join(p for p in (case.judge(next(outs), case.want) for case in cases) if p))
            for launch, cases in variants]


@needs_gxx
@pytest.mark.parametrize("key", kernels.KERNEL_NAMES)
def test_self_check_passes_on_every_production_variant_emulated(key):
    checked = emulated_checks(key)
    assert len(checked) >= 3
    for launch, detail in checked:
        assert detail == "", kernels.describe(kernels.variant(key, launch))


def test_production_variants_cover_what_production_dispatches():
    sel = [kernels.variant("path_selector", launch) for launch in kernels.production_launches("path_selector")]
    bindings = {b for _, _, bs in sel for b in bs}
    assert {"device uint32*", "device int32*", "constant int32*", "constant float32*",
            "constant float32&", "device bfloat16*", "device float16*"} <= bindings
    templates = [dict(t) for _, t, _ in sel]
    assert any(t["K"] == 16 and t["NT"] == 256 and t["R"] == 256 for t in templates)
    split = [kernels.variant("path_scores", launch) for launch in kernels.production_launches("path_scores")]
    assert [b for _, _, b in split] == [b[:6] for _, _, b in sel]  # same inputs, less the walk's
    assert any(dict(t)["K"] == 16 and dict(t)["AB"] == 16 and dict(t)["R"] == 256 for _, t, _ in split)
    conv = [dict(t) for _, t, _ in (kernels.variant("dynamic_conv", launch)
                                   for launch in kernels.production_launches("dynamic_conv"))]
    assert any(t["T"] == "bfloat16" and t["TAP"] == "float32" and t["H"] > 256 for t in conv)
    # The drafter's own call: no batch dimension, argpartition's uint32 candidates.
    from dflash2_mlx.model.selector import top_candidates

    logits = mx.random.normal((4, 300), key=mx.random.key(1))
    cand, unary = top_candidates(logits, 16)
    launch = kernels.selector_launch(unary, cand, mx.zeros((4, 256)), mx.array(5),
                                     mx.zeros((300, 256)), mx.zeros((300, 256)), 0.7, mx.zeros((4,)))
    assert kernels.variant("path_selector", launch) in sel


@needs_gxx
def test_self_check_catches_broken_variants_and_says_how():
    # Ties to the highest index: every selector variant disagrees.
    bad = broken(SELECT, "if (x > top)", "if (x >= top)")
    assert all(detail for _, detail in emulated_checks("path_selector", bad))
    # Split scores that stage every rank tile from the gate's first columns: every
    # variant (rank 256, four tiles) disagrees.
    bad = broken(SCORES, "gate[row * R + r0 + i % rn]", "gate[row * R + i % rn]")
    assert all("scores: not bit-identical" in detail for _, detail in emulated_checks("path_scores", bad))
    # A conv that rounds the taps to half: only the fp32 variants notice.
    bad = broken(CONV, "const TAP tap0 = ", "const TAP tap0 = (TAP)(half)")
    flagged = {tuple(v for _, v in kernels.variant("dynamic_conv", launch)[1][:2]): bool(d)
               for launch, d in emulated_checks("dynamic_conv", bad)}
    assert flagged[("float32", "float32")] and not flagged[("float16", "float16")]
    # Through check_variant: a compile failure and a disagreement are told apart.
    launch = kernels.production_launches("path_walk")[0]
    run_bad = lambda key, l: emulate(broken(WALK, "cdf > u", "cdf >= u - 0.05f"), l)
    r = kernels.check_variant("path_walk", launch, run=run_bad)
    assert not r.passed and r.failure == "disagreed" and "path (T=0.7)" in r.detail
    run_broken = lambda key, l: emulate(broken(WALK, "cdf > u", "cdf > u +"), l)
    r = kernels.check_variant("path_walk", launch, run=run_broken)
    assert not r.passed and r.failure == "failed to compile" and "K=16 L=4" in r.variant


def test_self_check_warns_per_variant_and_falls_back_per_variant(monkeypatch):
    monkeypatch.setattr(kernels, "_checks", {})
    good, bad = kernels.production_launches("path_walk")[:2]
    fail = kernels.SelfCheck("path_walk", False, "RuntimeError: boom", "v", "failed to run")
    monkeypatch.setattr(kernels, "check_variant",
                        lambda key, launch: fail if launch is bad else kernels.SelfCheck(key, True))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.self_check("path_walk", good).passed
    with pytest.warns(RuntimeWarning, match="kernel v failed to run.*for this variant"):
        assert not kernels.self_check("path_walk", bad).passed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not kernels.self_check("path_walk", bad).passed  # cached: no second warning
    monkeypatch.setattr(kernels, "metal_usable", lambda: True)
    monkeypatch.setattr(kernels, "reference_forced", lambda: False)
    assert kernels._kernel_launch("path_walk", lambda: good) is good
    assert kernels._kernel_launch("path_walk", lambda: bad) is None


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


# ---- FMA contraction in the conv ------------------------------------------------------


@needs_gxx
@pytest.mark.skipif("fma" not in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else True,
                    reason="needs a CPU with FMA")
def test_conv_with_fma_contraction_stays_within_one_ulp_of_the_twin():
    names = [n for n in CONV_CASES if n != "fp16 near overflow"]
    launches = [kernels.conv_launch(*CONV_CASES[n]) for n in names]
    outs = emulate_many(CONV, launches, extra_flags=("-O2", "-mfma", "-ffp-contract=fast"))
    differ = 0
    for n, (got,) in zip(names, outs):
        want = dynamic_conv_reference(*CONV_CASES[n])
        assert kernels.conv_problem(got, *CONV_CASES[n]) == "", n
        differ += mx.sum(got != want).item()
    assert differ > 0  # contraction really happened: the exact match is not promised


# ---- the emulator rejects what real Metal would break on -----------------------------------


def toy_launch(n=64, groups=1, inputs=None):
    return kernels.Launch(inputs=inputs or [mx.arange(n * groups, dtype=mx.float32)], template=[("N", n)],
                          grid=(n * groups, 1, 1), threadgroup=(n, 1, 1), output_shapes=[(n * groups,), (1,)],
                          output_dtypes=[mx.float32, mx.float32])


def toy_kernel(source, header=""):
    return kernels.KernelSource("toy", ("x",), ("y", "total"), source, header)


SUM_AFTER_BARRIER = """
const uint i = thread_position_in_grid.x;
y[i] = x[i] * 2.0f;
metal::threadgroup_barrier(FLAGS);
if (i == 0) {
  float s = 0.0f;
  for (uint j = 0; j < N; ++j) s += y[j];
  total[0] = s;
}
"""

BROKEN_KERNELS = {
    "memory fence missing": (SUM_AFTER_BARRIER.replace("FLAGS", "metal::mem_flags::mem_none"), "",
                             "without mem_flags::mem_device"),
    "threadgroup-only fence": (SUM_AFTER_BARRIER.replace("FLAGS", "metal::mem_flags::mem_threadgroup"), "",
                               "without mem_flags::mem_device"),
    "lost update": ("const uint i = thread_position_in_grid.x;\ny[i] = x[i];\ntotal[0] = total[0] == total[0] ? "
                    "total[0] + x[i] + 1.0f : x[i] + 1.0f;\n", "", "data race"),
    "two threadgroups write one element": ("const uint i = thread_position_in_grid.x;\ny[i] = x[i];\n"
                                           "if (thread_position_in_threadgroup.x == 0) total[0] = x[i] + 1.0f;\n",
                                           "", "data race"),
    "barriers at different call sites": (
        "const uint i = thread_position_in_grid.x;\ny[i] = x[i];\n"
        "if (i % 2) {\n  metal::threadgroup_barrier(metal::mem_flags::mem_device);\n} else {\n"
        "  metal::threadgroup_barrier(metal::mem_flags::mem_device);\n}\n"
        "if (i == 0) total[0] = y[1];\n", "", "wait at different barriers"),
    "constant data bound to a device pointer": (
        "const uint i = thread_position_in_grid.x;\ny[i] = first(x);\nif (i == 0) total[0] = 0.0f;\n",
        "inline float first(const device float* p) { return p[0]; }\n", "invalid conversion"),
    "device data bound to a constant pointer": (
        "const uint i = thread_position_in_grid.x;\ny[i] = first(x);\nif (i == 0) total[0] = 0.0f;\n",
        "inline float first(const constant float* p) { return p[0]; }\n", "invalid conversion"),
    "clash with MLX's prelude": ("const uint i = thread_position_in_grid.x;\ny[i] = ceildiv(i, 2u);\n"
                                 "if (i == 0) total[0] = 0.0f;\n",
                                 "inline uint ceildiv(uint a, uint b) { return (a + b - 1) / b; }\n",
                                 "clash with MLX's Metal prelude"),
    "double": ("const uint i = thread_position_in_grid.x;\ndouble d = x[i];\ny[i] = d;\nif (i == 0) total[0] = 0.0f;\n",
               "", "poisoned"),
    "std::": ("const uint i = thread_position_in_grid.x;\ny[i] = std::sqrt(x[i]);\nif (i == 0) total[0] = 0.0f;\n",
              "", "poisoned"),
    "variable-length array": ("const uint i = thread_position_in_grid.x;\nfloat tmp[i + 1];\ntmp[0] = x[i];\n"
                              "y[i] = tmp[0];\nif (i == 0) total[0] = 0.0f;\n", "", "variable length array"),
}


@needs_gxx
@pytest.mark.parametrize("name", list(BROKEN_KERNELS))
def test_emulator_rejects_broken_kernel(name):
    source, header, message = BROKEN_KERNELS[name]
    groups = 2 if "threadgroups" in name else 1
    n = 8 if "constant data" in name else 64
    inputs = [mx.arange(4, dtype=mx.float32)] if "constant data" in name else None
    launch = toy_launch(n, groups, inputs)
    if inputs:  # 4 inputs, 8 threads: the kernel reads x[0] only
        launch.output_shapes = [(n,), (1,)]
    with pytest.raises((RuntimeError, ValueError, AssertionError), match=message):
        emulate_many(toy_kernel(source, header), [launch], seeds=(0, 1))


@needs_gxx
def test_emulator_passes_the_fixed_kernels_and_rejects_oversized_threadgroups():
    (y, total), = emulate_many(toy_kernel(SUM_AFTER_BARRIER.replace("FLAGS", "metal::mem_flags::mem_device")),
                               [toy_launch()], seeds=(0, 1))
    assert total.item() == 2 * sum(range(64))
    ok = "const uint i = thread_position_in_grid.x;\ny[i] = x[i];\nif (i == 0) total[0] = 1.0f;\n"
    big = toy_launch(2048)
    with pytest.raises(ValueError, match="exceeds Metal's 1024"):
        emulate_many(toy_kernel(ok), [big])


# Each threadgroup reverses its slice of x through threadgroup memory (so every thread
# reads what another wrote), twice, refilling the array between the rounds.
REVERSE_IN_THREADGROUP = """
threadgroup float tile[N];
const uint i = thread_position_in_threadgroup.x;
const uint base = threadgroup_position_in_grid.x * N;
float acc = 0.0f;
for (uint k = 0; k < 2; ++k) {
  tile[i] = x[base + i] + static_cast<float>(k);
  AFTER_FILL
  acc += tile[N - 1 - i];
  BEFORE_REFILL
}
y[base + i] = acc;
if (thread_position_in_grid.x == 0) total[0] = 1.0f;
"""
TG_BARRIER = "metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);"


def reverse_kernel(after_fill=TG_BARRIER, before_refill=TG_BARRIER, **replace):
    source = REVERSE_IN_THREADGROUP.replace("AFTER_FILL", after_fill).replace("BEFORE_REFILL", before_refill)
    for old, new in replace.items():
        source = source.replace(old, new)
    return toy_kernel(source)


TG_BROKEN = {
    "no barrier after filling": (reverse_kernel(after_fill=""), "threadgroup memory"),
    # Read-then-refill or refill-then-read, depending on which thread runs first: both races.
    "no barrier before refilling": (reverse_kernel(before_refill=""), "data race on threadgroup memory"),
    "no barrier at all": (reverse_kernel(after_fill="", before_refill=""), "threadgroup memory"),
    "fenced as device memory": (reverse_kernel(TG_BARRIER.replace("threadgroup)", "device)")),
                                "without mem_flags::mem_threadgroup"),
    "fenced as nothing": (reverse_kernel(TG_BARRIER.replace("threadgroup)", "none)")), "fences no memory"),
    "two threads fill one element": (reverse_kernel(**{"tile[i] = ": "tile[i / 2] = "}), "both write"),
    "index past the end": (reverse_kernel(**{"tile[i] = ": "tile[i + 1] = "}), "past the end"),
    "shared across threadgroups": (reverse_kernel(**{"tile[i] = ": "if (base == 0) tile[i] = "}),
                                   "which no thread of its threadgroup wrote"),
    "above 32 KiB": (reverse_kernel(**{"tile[N];": "tile[N];\nthreadgroup float spill[8192];"}),
                     "exceeds Metal's 32768"),
}


@needs_gxx
@pytest.mark.parametrize("name", list(TG_BROKEN))
def test_emulator_rejects_broken_threadgroup_memory_use(name):
    src, message = TG_BROKEN[name]
    # Two threadgroups of 64: interleaved in one pool, each with its own threadgroup memory.
    with pytest.raises(RuntimeError, match=message):
        emulate_many(src, [toy_launch(64, 2)], seeds=(0, 1))


@needs_gxx
def test_emulator_runs_threadgroup_memory_per_threadgroup():
    # 2 threadgroups run interleaved; 40 (2560 threads, above the shim's EMU_INTERLEAVE)
    # one after another.
    for groups in (2, 40):
        x = mx.arange(64 * groups, dtype=mx.float32)
        (y, _), = emulate_many(reverse_kernel(), [toy_launch(64, groups, [x])], seeds=(0, 1, 2))
        want = 2 * x.reshape(groups, 64)[:, ::-1].reshape(-1) + 1
        assert mx.array_equal(y, want).item()
    # Pointers into threadgroup memory are not modelled: refused, not emulated loosely.
    pointer = reverse_kernel(**{"acc += tile[N - 1 - i];": "threadgroup float* p = tile;\nacc += p[N - 1 - i];"})
    with pytest.raises(RuntimeError, match="only_threadgroup_arrays_are_emulated"):
        emulate_many(pointer, [toy_launch(64, 2)])


def test_twins_import_nothing_of_the_kernels():
    """One-way structure: the twins define meaning; dispatch (kernels.py) sits above them
    and the drafter's modules call the dispatch."""
    import ast
    import importlib

    for name in ("conv", "selector"):
        tree = ast.parse(Path(importlib.import_module(f"dflash2_mlx.{name}").__file__).read_text())
        imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any("kernels" in m or m.startswith("dflash2_mlx") or m == "" for m in imported), (name, imported)
