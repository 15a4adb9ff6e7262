"""The exact verify kernel against MLX's own one-row kernel, bit for bit, through the emulator.

MLX's ``qmv_fast_impl`` (cut from the installed wheel's ``quantized.h``, ``metal_emu.mlx_kernels``)
runs one launch per row, as a one-row decode step runs it; ``metal/exact_rows.metal`` runs all
rows of a verify pass in one launch. Both go through the same emulator (same shim, same
simd_sum), so any difference in how a row's sum is ordered shows in its bits; a kernel that
orders one sum otherwise must fail the comparison."""

import mlx.core as mx
import pytest

from dflash2_mlx import kernels
from dflash2_mlx.kernels.exact_rows import kernel_fits, quantized_rows, quantized_rows_reference
from dflash2_mlx.kernels.launches import EXACT_ROWS, exact_block, exact_qmv_launch
from metal_emu import emulate as emu
from metal_emu.cases import needs_gxx
from metal_emu.mlx_kernels import cut_function, mlx_qmv_fast_launch, mlx_qmv_fast_source, quantized_header

N = 16
ROWS = range(2, 17)
WEIGHTS = [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)]
DTYPES = [mx.bfloat16, mx.float16]


def problem(bits, group_size, dtype, rows=max(ROWS), seed=0, blocks=1):
    K = exact_block(bits) * blocks  # every lane reads values in each block, as in a real layer
    if group_size == 128 and bits == 8:
        K *= 2
    key = mx.random.key(seed)
    kw, kx = mx.random.split(key)
    w, s, b = mx.quantize(mx.random.normal((N, K), key=kw), group_size=group_size, bits=bits)
    x = mx.random.normal((rows, K), key=kx).astype(dtype)
    return x, w, s.astype(dtype), b.astype(dtype)


def emulate_unchecked(src, launches):
    """MLX's own source uses its prelude's names (METAL_FUNC): skip the clash check that is
    there for our kernels."""
    saved = emu.check_metal_rules
    emu.check_metal_rules = lambda *a: None
    try:
        return emu.emulate_many(src, launches)
    finally:
        emu.check_metal_rules = saved


def mlx_one_row(problems):
    """MLX's qmv_fast over each row alone: per problem, the rows stacked."""
    launches = [mlx_qmv_fast_launch(x[i : i + 1], w, s, b, gs, bits)
                for (x, w, s, b), (bits, gs) in problems for i in range(x.shape[0])]
    outs = iter(emulate_unchecked(mlx_qmv_fast_source(), launches))
    return [mx.concatenate([next(outs)[0] for _ in range(x.shape[0])], axis=0) for (x, *_), _ in problems]


def ours(problems, rows, src=None):
    """Our kernel over the first ``r`` rows, for each r in ``rows``: per problem, {r: y}."""
    launches = [exact_qmv_launch(x[:r], w, s, b, gs, bits) for (x, w, s, b), (bits, gs) in problems for r in rows]
    outs = iter(emu.emulate_many(src or kernels.SOURCES["exact_qmv"], launches))
    return [{r: next(outs)[0] for r in rows} for _ in problems]


@needs_gxx
def test_the_reference_is_mlx_own_source():
    text = quantized_header()
    for name in ("qmv_fast_impl", "load_vector", "qdot"):
        assert cut_function(text, name) in text
    assert "simd_sum(result[row])" in mlx_qmv_fast_source().header


@needs_gxx
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_every_row_is_mlx_one_row_kernels_bit_for_bit(dtype):
    cases = [(problem(bits, gs, dtype, seed=i, blocks=2), (bits, gs)) for i, (bits, gs) in enumerate(WEIGHTS)]
    want = mlx_one_row(cases)
    got = ours(cases, ROWS)
    for (case, (bits, gs)), one_row, by_rows in zip(cases, want, got):
        # The reference is a faithful product, not a degenerate one (all zeros, NaN).
        x, w, s, b = case
        dense = x.astype(mx.float32) @ mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32),
                                                     group_size=gs, bits=bits).T
        assert mx.allclose(one_row.astype(mx.float32), dense, rtol=2e-2, atol=0.25).item()
        for r in ROWS:
            assert mx.array_equal(by_rows[r], one_row[:r]).item(), f"{bits}-bit group {gs}, {r} rows"


def reordered(old: str, new: str):
    src = kernels.SOURCES["exact_qmv"]
    assert old in src.source
    return kernels.KernelSource(src.name + f"_reordered{len(old)}", src.input_names, src.output_names,
                                src.source.replace(old, new))


@needs_gxx
def test_a_kernel_that_sums_in_another_order_fails_the_comparison():
    # Four-bit: a block's four products added pairwise instead of left to right.
    pairwise = reordered(
        "accum += (xs[4 * i] * (ws[i] & 0x000f) + xs[4 * i + 1] * (ws[i] & 0x00f0) +\n"
        "                    xs[4 * i + 2] * (ws[i] & 0x0f00) + xs[4 * i + 3] * (ws[i] & 0xf000));",
        "accum += ((xs[4 * i] * (ws[i] & 0x000f) + xs[4 * i + 1] * (ws[i] & 0x00f0)) +\n"
        "                    (xs[4 * i + 2] * (ws[i] & 0x0f00) + xs[4 * i + 3] * (ws[i] & 0xf000)));")
    # Eight-bit: a lane's values summed last to first.
    backwards = reordered("accum += xs[i] * wc[i];",
                          "accum += xs[VALUES_PER_THREAD - 1 - i] * wc[VALUES_PER_THREAD - 1 - i];")
    # float32 rows: a 16-bit output's rounding would hide most last-bit differences of the
    # float sums, which are what the comparison is for.
    blocks_backwards = reordered("for (int k = 0; k < K; k += BLOCK) {", "for (int k = K - BLOCK; k >= 0; k -= BLOCK) {")
    for bits, bad, blocks in ((4, pairwise, 1), (8, backwards, 1), (4, blocks_backwards, 4)):
        cases = [(problem(bits, 32, mx.float32, rows=4, seed=7, blocks=blocks), (bits, 32))]
        want = mlx_one_row(cases)[0]
        assert mx.array_equal(ours(cases, [4])[0][4], want).item()  # the kernel itself agrees
        got = ours(cases, [4], bad)[0][4]
        # Same values within rounding, other bits.
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), rtol=1e-2, atol=1e-2).item()
        assert not mx.array_equal(got, want).item(), f"{bits}-bit: the reordered kernel ({bad.name}) was not caught"


def test_the_twin_is_mlx_one_row_product_and_the_kernel_runs_only_where_it_fits():
    x, w, s, b = problem(4, 64, mx.float32, rows=6)
    y = quantized_rows(x[None], w, s, b, 64, 4)
    assert y.shape == (1, 6, N)
    for i in range(6):
        one = mx.quantized_matmul(x[None, i : i + 1], w, s, b, transpose=True, group_size=64, bits=4)
        assert mx.array_equal(y[0, i : i + 1], one[0]).item()
    assert mx.array_equal(y, quantized_rows_reference(x[None], w, s, b, 64, 4)).item()
    if not mx.metal.is_available():
        assert not kernel_fits(x, w, s, b, 64, 4)
    with pytest.raises(ValueError, match="does not take"):
        exact_qmv_launch(x[:, :100], w, s, b, 64, 4)
    with pytest.raises(ValueError, match="3-bit"):
        exact_qmv_launch(x, w, s, b, 64, 3)
    assert EXACT_ROWS >= 2
