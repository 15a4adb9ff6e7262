"""Dispatch and self-check: which implementation runs here and why, the self-check of
every production variant (through the emulator standing in for the GPU), warnings and
per-variant fallback, gradients from the twins, and what ``doctor`` and
``bench kernels`` report on this machine."""

import warnings

import mlx.core as mx
import pytest

from dflash2_mlx import kernels
from dflash2_mlx.cli.doctor_report import run_doctor
from dflash2_mlx.eval.kernel_bench import bench_kernels, draft_cycle_share
from dflash2_mlx.kernels import dispatch, selfcheck
from dflash2_mlx.kernels.conv import dynamic_conv_reference
from dflash2_mlx.kernels.selector import pair_scores_reference, walk_reference
from metal_emu.cases import (
    CONV, CONV_CASES, NO_METAL, SCORES, SELECT, SELECTOR_CASES, WALK, broken, gpu_default,
    needs_gxx, production_selector_case, sel_args,
)
from metal_emu.emulate import emulate, emulate_many
from tiny_models import make_drafter, make_target



@needs_gxx
def test_select_at_batch_1_runs_the_split_layout_and_falls_back_per_variant(monkeypatch):
    """The dispatch itself, with the emulator standing in for the GPU: at batch 1 the
    split layout's variants are self-checked and run; when the scores variant fails its
    check, select warns and uses the fused kernel."""
    ran = []

    def on_emulator(key, launch):
        ran.append(key)
        return emulate(kernels.SOURCES[key], launch)

    # Patched where each is read: dispatch runs the kernels, selfcheck runs their checks.
    monkeypatch.setattr(dispatch, "run_metal", on_emulator)
    monkeypatch.setattr(selfcheck, "run_metal", on_emulator)
    monkeypatch.setattr(dispatch, "metal_usable", lambda: True)
    monkeypatch.setattr(dispatch, "reference_forced", lambda: False)
    monkeypatch.setattr(selfcheck, "results", {})
    args, u = production_selector_case(70, 4, 32, mx.float32)
    want = pair_scores_reference(*args)
    want_path, want_q = walk_reference(want, 0.8, u)
    scores, path, q = kernels.select(*args, 0.8, u)
    assert set(ran) == {"path_scores", "path_walk"} and ran[-1] == "path_walk"  # checks, then runs
    assert mx.array_equal(scores, want).item()
    assert kernels.path_problem("T=0.8", path, q, want_path, want_q, u, 0.8) == ""

    monkeypatch.setitem(kernels.SOURCES, "path_scores", broken(SCORES, "r < rn; ++r", "r + 1 < rn; ++r"))
    monkeypatch.setattr(selfcheck, "results", {})  # a new process: nothing checked yet
    ran.clear()
    with pytest.warns(RuntimeWarning, match=r"path_scores\[K=16 R=32 .* disagreed"):
        scores, path, q = kernels.select(*args, 0.8, u)
    assert ran[-1] == "path_selector" and "path_walk" not in ran
    assert mx.array_equal(scores, want).item()
    assert kernels.path_problem("T=0.8", path, q, want_path, want_q, u, 0.8) == ""


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
    monkeypatch.setattr(selfcheck, "results", {})
    with pytest.warns(RuntimeWarning, match=r"dynamic_conv\[T=float32.*failed to run.*No Metal back-end"):
        result = kernels.self_check("dynamic_conv")
    assert not result.passed and "No Metal back-end" in result.detail and result.failure == "failed to run"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.self_check("dynamic_conv") is result  # no second warning


def test_gradients_come_from_the_twin():
    x, dyn, base = CONV_CASES["fp32 T=16 batch (2,3)"]
    # A forward that is not the twin's (scaled by 2) still gets the twin's gradient.
    f = kernels.with_twin_vjp(lambda *a: 2 * dynamic_conv_reference(*a), dynamic_conv_reference,
                               (True, True, True))
    g_twin = mx.grad(lambda *a: (dynamic_conv_reference(*a) * mx.arange(48)).sum(), argnums=(0, 1, 2))(x, dyn, base)
    g_f = mx.grad(lambda *a: (f(*a) * mx.arange(48)).sum(), argnums=(0, 1, 2))(x, dyn, base)
    for a, b in zip(g_twin, g_f):
        assert mx.allclose(a, b).item()
    # Integer inputs (candidate ids) get zero gradients.
    c = SELECTOR_CASES["k4 r8 no batch dim"][0]
    s = kernels.with_twin_vjp(pair_scores_reference, pair_scores_reference,
                               (True, False, True, False, True, True))
    gu, gg = mx.grad(lambda u, g: s(u, c["cand"], g, c["anchor"], c["A"], c["B"]).sum(), argnums=(0, 1))(
        c["unary"], c["gate"])
    wu, wg = mx.grad(lambda u, g: pair_scores_reference(u, c["cand"], g, c["anchor"], c["A"], c["B"]).sum(),
                     argnums=(0, 1))(c["unary"], c["gate"])
    assert mx.allclose(gu, wu).item() and mx.allclose(gg, wg).item()


def test_doctor_reports_every_kernel(capsys):
    report = run_doctor()
    short = capsys.readouterr().out
    assert short.startswith("verdict: ") and "--verbose" in short
    assert not any(r["variant"] in short for r in report)  # the variants only with --verbose
    report = run_doctor(verbose=True)
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
    rows = bench_kernels(hidden=256, blocks=(5,), top_k=16, rank=32, vocab=512, repeats=2)
    printed = capsys.readouterr().out
    assert [r["kernel"] for r in rows] == ["dynamic_conv", "path_selector", "path_scores+path_walk"]
    for r in rows:
        assert r["twin_ms"] > 0
        if not kernels.metal_usable():
            assert r["kernel_ms"] is None and r["ratio"] is None
    if not kernels.metal_usable():
        assert "twin only" in printed and "no Metal back-end" in printed



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
    make_target(tmp_path / "target", hidden=64)
    make_drafter(tmp_path / "drafter", tmp_path / "target", version=2)
    r = draft_cycle_share(str(tmp_path / "target"), str(tmp_path / "drafter"), max_tokens=12)
    assert r["cycles"] >= 1 and r["conv_ms"] > 0 and r["selector_ms"] > 0
    assert r["conv_share"] > 0 and r["selector_share"] > 0
    # Timed inside the profiled run's cycles (the plain run's time varies with load).
    assert r["conv_ms"] + r["selector_ms"] < r["profiled_cycle_ms"]
    assert "ms/cycle" in capsys.readouterr().out


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
    monkeypatch.setattr(selfcheck, "results", {})
    good, bad = kernels.production_launches("path_walk")[:2]
    fail = kernels.SelfCheck("path_walk", False, "RuntimeError: boom", "v", "failed to run")
    monkeypatch.setattr(selfcheck, "check_variant",
                        lambda key, launch: fail if launch is bad else kernels.SelfCheck(key, True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.self_check("path_walk", good).passed
    with pytest.warns(RuntimeWarning, match="kernel v failed to run.*for this variant"):
        assert not kernels.self_check("path_walk", bad).passed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not kernels.self_check("path_walk", bad).passed  # cached: no second warning
    monkeypatch.setattr(dispatch, "metal_usable", lambda: True)
    monkeypatch.setattr(dispatch, "reference_forced", lambda: False)
    assert kernels.kernel_launch("path_walk", lambda: good) is good
    assert kernels.kernel_launch("path_walk", lambda: bad) is None
