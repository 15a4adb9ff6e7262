"""The dynamic conv kernel against its twin: emulated on the CPU (bit for bit without
floating-point contraction, within the FMA bound with it) and, with ``-m metal`` on
Apple Silicon, on the GPU."""

from pathlib import Path

import mlx.core as mx
import pytest

from dflash2_mlx import kernels
from dflash2_mlx.kernels.conv import dynamic_conv_reference
from metal_emu.cases import CONV, CONV_CASES, NO_METAL, gpu_default, needs_gxx
from metal_emu.emulate import emulate_many


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


def test_conv_bound_admits_fp32_taps_and_rejects_a_wrong_tap():
    """A compiler that keeps ``base + dyn`` (and the products) in fp32 and rounds once at the
    end is within the self-check's bound; a conv that drops a tap is not."""
    for name in ("bf16 published H5120 B5",):
        x, dyn, base = CONV_CASES[name]
        wide = dynamic_conv_reference(*(a.astype(mx.float32) for a in (x, dyn, base))).astype(x.dtype)
        assert not mx.array_equal(wide, dynamic_conv_reference(x, dyn, base)).item()
        assert kernels.conv_problem(wide, x, dyn, base) == ""
        wrong = dynamic_conv_reference(x, dyn.at[..., 1, :].multiply(0.0), base)
        assert kernels.conv_problem(wrong, x, dyn, base) != ""


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
