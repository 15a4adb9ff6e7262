"""The kernel sources and launches as the GPU gets them: the generated Metal source is
inspected for what the emulator cannot see, the split layout's tiles fit Metal's limits,
the production variants cover what the drafter dispatches, and the twins stay below the
kernels (they import nothing of them)."""

import ast
import importlib
import re
from pathlib import Path

import mlx.core as mx
import pytest

from dflash2_mlx import kernels
from dflash2_mlx.kernels.selector import pair_scores_reference, top_candidates
from metal_emu.cases import CONV, CONV_CASES, SCORES, SELECT, SELECTOR_CASES, WALK, sel_args
from metal_emu.emulate import EMULATED_ATTRIBUTES, THREADGROUP_ARRAY, metal_source, used_attributes


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


def test_split_layout_tiles_fit_metal():
    for K, R in ((16, 256), (20, 100), (32, 16), (4, 8), (256, 256), (1024, 64)):
        ab, rt = kernels.score_tiles(K, R)
        assert 1 <= ab <= K and 1 <= rt <= min(R, kernels.RANK_TILE)
        assert ab * K <= max(kernels.SCORE_THREADS, K) <= 1024
        assert (ab + K) * (rt + 1) * 4 <= kernels.MAX_THREADGROUP_MEMORY
    assert kernels.score_tiles(16, 256) == (16, 64)  # production: one threadgroup per position
    with pytest.raises(ValueError, match="1024 threads"):
        kernels.score_tiles(1025, 8)


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
    logits = mx.random.normal((4, 300), key=mx.random.key(1))
    cand, unary = top_candidates(logits, 16)
    launch = kernels.selector_launch(unary, cand, mx.zeros((4, 256)), mx.array(5),
                                     mx.zeros((300, 256)), mx.zeros((300, 256)), 0.7, mx.zeros((4,)))
    assert kernels.variant("path_selector", launch) in sel


def test_twins_import_nothing_of_the_kernels():
    """One-way structure: the twins define meaning; the dispatch beside them in kernels/
    reads them, never the reverse, and the drafter's modules call the dispatch."""
    for name in ("conv", "selector"):
        tree = ast.parse(Path(importlib.import_module(f"dflash2_mlx.kernels.{name}").__file__).read_text())
        imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any("kernels" in m or m.startswith("dflash2_mlx") or m == "" for m in imported), (name, imported)
