"""MLX's own one-row quantized kernel, from the installed wheel's source, as a kernel the
emulator runs: ``qmv_fast_impl`` and what it calls (``load_vector``, ``qdot``,
``get_pack_factor``, ``get_bytes_per_pack``), cut verbatim out of
``mlx/backend/metal/kernels/quantized.h`` and called from a one-line body with MLX's own
grid (one threadgroup of 2 SIMD-groups x 32 lanes per row and 8 output columns)."""

import re

import mlx.core as mx

from dflash2_mlx.kernels import KernelSource, Launch

from .emulate import _prelude_dir

QMV_FUNCTIONS = ("get_pack_factor", "get_bytes_per_pack", "load_vector", "qdot", "qmv_fast_impl")


def quantized_header() -> str:
    return (_prelude_dir() / "quantized.h").read_text()


def cut_function(text: str, name: str) -> str:
    """The definition of template function ``name``: from its ``template`` line to the brace
    that closes its body."""
    m = re.search(r"^template\s*<[^;{]*?>\s*\n(?:[^\n;{]*\n)??[^\n;{]*\b" + name + r"\s*\(", text, flags=re.M)
    if m is None:
        raise LookupError(f"{name} is not defined in MLX's quantized.h")
    depth, i = 0, text.index("{", m.end())
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[m.start():j + 1]
    raise LookupError(f"{name}'s body does not close")


def mlx_qmv_fast_source() -> KernelSource:
    text = quantized_header()
    cut = "\n\n".join(cut_function(text, f) for f in QMV_FUNCTIONS)
    cut = re.sub(r"\s*\[\[[^\]]*\]\]", "", cut)  # parameter attributes: the body passes them
    header = ("constexpr int SIMD_SIZE = 32;  // quantized.h: MLX_MTL_CONST int SIMD_SIZE = 32\n"
              "#define METAL_FUNC inline  // kernels/defines.h\n\n" + cut + "\n")
    body = ("qmv_fast_impl<T, GS, BITS, false>(w, scales, biases, x, y, K, N,\n"
            "    threadgroup_position_in_grid, simdgroup_index_in_threadgroup, thread_index_in_simdgroup);\n")
    return KernelSource(name="mlx_qmv_fast", input_names=("w", "scales", "biases", "x", "K", "N"),
                        output_names=("y",), source=body, header=header)


def mlx_qmv_fast_launch(x, w, scales, biases, group_size: int, bits: int) -> Launch:
    """MLX's launch of qmv_fast for x [M, K]: grid (M, N / 8) threadgroups of (32, 2)."""
    M, K = x.shape
    N = w.shape[0]
    return Launch(inputs=[w, scales, biases, x, mx.array(K, dtype=mx.int32), mx.array(N, dtype=mx.int32)],
                  template=[("T", x.dtype), ("GS", group_size), ("BITS", bits)],
                  grid=(32 * M, 2 * (N // 8), 1), threadgroup=(32, 2, 1),
                  output_shapes=[(M, N)], output_dtypes=[x.dtype])
