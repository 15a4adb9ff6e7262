"""An exact verify pass's quantized products: each row computed as MLX's one-row decode step
computes it (``metal/exact_rows.metal``), and its twin.

The twin defines the meaning: row i of the result is ``mx.quantized_matmul`` of row i alone,
MLX's own one-row product on whatever device runs it (one launch per row, each reading the
weights).  The kernel computes the same bits for all rows in one launch where MLX's one-row
product is its ``qmv_fast`` (affine 4- or 8-bit weights, K a multiple of its block, N of 8);
it runs only on Metal, and only in a variant that gave, on its first use, bit for bit the
twin's rows on that machine (any difference, e.g. another MLX version's qmv_fast, keeps the
twin).  The tests run MLX's own qmv_fast source and the kernel through the CPU emulator.
"""

import warnings

import mlx.core as mx

from .dispatch import metal_usable, reference_forced
from .launches import exact_qmv_launch, exact_qmv_unfit
from .sources import run_metal

# Each variant's self-check result in this process, by (dtype, group size, bits).
checked: dict = {}


def quantized_rows_reference(x, w, scales, biases, group_size: int, bits: int, mode: str = "affine"):
    """x [..., K] -> [..., N]: every row of x alone through ``mx.quantized_matmul``."""
    K = x.shape[-1]
    flat = x.reshape(-1, K)
    rows = [mx.quantized_matmul(flat[i : i + 1][None], w, scales, biases, transpose=True,
                                group_size=group_size, bits=bits, mode=mode)[0]
            for i in range(flat.shape[0])]
    return mx.concatenate(rows, axis=0).reshape(*x.shape[:-1], -1)


def _self_check(dtype, group_size: int, bits: int) -> bool:
    key = (str(dtype), group_size, bits)
    if key not in checked:
        K, N, M = 2 * 32 * 2 * (32 // bits), 16, 5
        w, s, b = mx.quantize(mx.random.normal((N, K), key=mx.random.key(1)), group_size=group_size, bits=bits)
        s, b = s.astype(dtype), b.astype(dtype)
        x = mx.random.normal((M, K), key=mx.random.key(2)).astype(dtype)
        want = quantized_rows_reference(x, w, s, b, group_size, bits)
        try:
            got = run_metal("exact_qmv", exact_qmv_launch(x, w, s, b, group_size, bits))[0]
            ok = bool(mx.array_equal(got, want).item())
            why = "" if ok else "its rows differ from MLX's one-row product"
        except Exception as e:  # a compiler that rejects it: the twin runs
            ok, why = False, f"failed: {e}"
        checked[key] = ok
        if not ok:
            warnings.warn(f"exact verify kernel ({dtype}, group {group_size}, {bits}-bit) {why}; "
                          "exact passes use one-row products there", RuntimeWarning, stacklevel=3)
    return checked[key]


def kernel_fits(x, w, scales, biases, group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether the exact kernel computes this product (on this machine, now)."""
    if reference_forced() or not metal_usable():
        return False
    if exact_qmv_unfit(x.shape, w.shape, x.dtype, scales.dtype, group_size, bits, mode, biases is not None):
        return False
    return _self_check(x.dtype, group_size, bits)


def quantized_rows(x, w, scales, biases, group_size: int, bits: int, mode: str = "affine"):
    """x [..., K] @ dequantized(w).T, each row as MLX's one-row product computes it."""
    if not kernel_fits(x, w, scales, biases, group_size, bits, mode):
        return quantized_rows_reference(x, w, scales, biases, group_size, bits, mode)
    flat = mx.contiguous(x.reshape(-1, x.shape[-1]))
    y = run_metal("exact_qmv", exact_qmv_launch(flat, w, scales, biases, group_size, bits))[0]
    return y.reshape(*x.shape[:-1], -1)
