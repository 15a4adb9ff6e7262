"""The launch of each kernel for given arrays: shape and dtype checks, template
arguments, grid, threadgroup and output shapes (see ``metal/*.metal`` for what each
kernel expects).  Building a launch is cheap and pure Python: dispatch builds one per
call to decide, by its variant, whether the kernel may run."""

import mlx.core as mx

from .sources import Launch


def _promote(*dtypes):
    out = dtypes[0]
    for d in dtypes[1:]:
        out = mx.result_type(out, d)
    return out


def batch_rows(shape) -> int:
    """The number of batch rows of a batch shape (1 for ``()``)."""
    n = 1
    for s in shape:
        n *= s
    return n


def conv_launch(x: mx.array, dyn: mx.array, base: mx.array) -> Launch:
    """x [..., L, H], dyn [..., L, 2, H // g], base [2, H] -> out [..., L, H] (x's dtype)."""
    *batch, L, H = x.shape
    G = dyn.shape[-1]
    if G == 0 or H % G:
        raise ValueError(f"hidden size {H} is not a multiple of the {G} channel groups")
    if tuple(dyn.shape) != (*batch, L, 2, G) or tuple(base.shape) != (2, H):
        raise ValueError(f"conv shapes disagree: x {x.shape}, dyn {dyn.shape}, base {base.shape}")
    tap = _promote(base.dtype, dyn.dtype)
    return Launch(
        inputs=[x, dyn, base],
        template=[("T", x.dtype), ("TAP", tap), ("C", _promote(tap, x.dtype)),
                  ("H", H), ("GS", H // G), ("L", L)],
        grid=(H, L, batch_rows(batch)),
        threadgroup=(min(H, 256), 1, 1),
        output_shapes=[tuple(x.shape)],
        output_dtypes=[x.dtype],
    )


def _walk_inputs(batch, L, temperature, uniforms):
    temp = mx.array(float(temperature), dtype=mx.float32)
    if uniforms is None:
        if temperature != 0:
            raise ValueError("sampling (temperature > 0) needs uniforms")
        uniforms = mx.zeros((*batch, L), dtype=mx.float32)
    return temp, mx.broadcast_to(uniforms, (*batch, L)).astype(mx.float32)


def _selector_anchor(unary, cand, gate, anchor, predecessor_codebook, successor_codebook):
    """Check the selector's shapes and dtypes; the anchor as one id per batch row."""
    *batch, L, K = cand.shape
    R = gate.shape[-1]
    V = predecessor_codebook.shape[0]
    if tuple(unary.shape) != tuple(cand.shape) or tuple(gate.shape[:-1]) != (*batch, L):
        raise ValueError(f"selector shapes disagree: unary {unary.shape}, cand {cand.shape}, gate {gate.shape}")
    if predecessor_codebook.shape[-1] != R or successor_codebook.shape[-1] != R:
        raise ValueError("codebook rank differs from the gate's")
    if max(V, successor_codebook.shape[0]) * R >= 2**32:
        raise ValueError("codebooks too large for 32-bit indexing")
    if not mx.issubdtype(cand.dtype, mx.integer):
        raise ValueError("candidates must be integer token ids")
    anchor = mx.broadcast_to(mx.array(anchor), tuple(batch)).reshape(-1)
    if not mx.issubdtype(anchor.dtype, mx.integer):
        raise ValueError("anchor must be integer token ids")
    return anchor


def selector_launch(unary, cand, gate, anchor, predecessor_codebook, successor_codebook,
                    temperature=0.0, uniforms=None) -> Launch:
    """Scores, path and q in one launch (see metal/path_selector.metal)."""
    *batch, L, K = cand.shape
    R = gate.shape[-1]
    anchor = _selector_anchor(unary, cand, gate, anchor, predecessor_codebook, successor_codebook)
    temp, uniforms = _walk_inputs(batch, L, temperature, uniforms)
    nt = min(K * K, 256)
    return Launch(
        inputs=[unary, cand, gate, anchor, predecessor_codebook, successor_codebook,
                temp, uniforms],
        template=[("K", K), ("R", R), ("L", L), ("NT", nt),
                  ("AG", _promote(predecessor_codebook.dtype, gate.dtype))],
        grid=(nt, batch_rows(batch), 1),
        threadgroup=(nt, 1, 1),
        output_shapes=[(*batch, L, K, K), (*batch, L), (*batch, L, K)],
        output_dtypes=[mx.float32, mx.int32, mx.float32],
    )


# Metal's threadgroup memory per threadgroup on every Apple GPU (MTLDevice
# maxThreadgroupMemoryLength); the scores kernel's two tiles must fit in it.
MAX_THREADGROUP_MEMORY = 32768
SCORE_THREADS = 256  # threads per threadgroup the scores kernel aims for
RANK_TILE = 64  # rank columns staged per tile when memory allows


def score_tiles(K: int, R: int) -> tuple:
    """(AB, RT): predecessor rows per threadgroup (AB * K threads, at most SCORE_THREADS
    unless K alone exceeds it) and rank columns per tile, the largest up to RANK_TILE whose
    two padded float tiles, (AB + K) * (RT + 1) * 4 bytes, fit in threadgroup memory."""
    if K > 1024:
        raise ValueError(f"k {K} exceeds Metal's 1024 threads per threadgroup")
    ab = min(K, max(1, SCORE_THREADS // K))
    rt = min(R, RANK_TILE, MAX_THREADGROUP_MEMORY // (4 * (ab + K)) - 1)
    return ab, rt


def scores_launch(unary, cand, gate, anchor, predecessor_codebook, successor_codebook) -> Launch:
    """Scores alone, split across threadgroups: one per (batch row, position, tile of
    predecessor rows), with the codebook rows staged in threadgroup memory (see
    metal/path_selector.metal, `scores`). ``walk_launch`` walks them."""
    *batch, L, K = cand.shape
    R = gate.shape[-1]
    anchor = _selector_anchor(unary, cand, gate, anchor, predecessor_codebook, successor_codebook)
    ab, rt = score_tiles(K, R)
    return Launch(
        inputs=[unary, cand, gate, anchor, predecessor_codebook, successor_codebook],
        template=[("K", K), ("R", R), ("L", L), ("AB", ab), ("RT", rt),
                  ("AG", _promote(predecessor_codebook.dtype, gate.dtype))],
        grid=(ab * K * -(-K // ab), L, batch_rows(batch)),
        threadgroup=(ab * K, 1, 1),
        output_shapes=[(*batch, L, K, K)],
        output_dtypes=[mx.float32],
    )


def walk_launch(scores, temperature=0.0, uniforms=None) -> Launch:
    *batch, L, K, K2 = scores.shape
    if K != K2:
        raise ValueError(f"scores must be [..., T, k, k], got {scores.shape}")
    temp, uniforms = _walk_inputs(batch, L, temperature, uniforms)
    n = batch_rows(batch)
    return Launch(
        inputs=[scores.astype(mx.float32), temp, uniforms],
        template=[("K", K), ("L", L)],
        grid=(n, 1, 1),
        threadgroup=(min(n, 64), 1, 1),
        output_shapes=[(*batch, L), (*batch, L, K)],
        output_dtypes=[mx.int32, mx.float32],
    )


EXACT_ROWS = 8  # verify rows per threadgroup of the exact product (metal/exact_rows.metal)
EXACT_BITS = (4, 8)


def exact_block(bits: int) -> int:
    """The K step of MLX's one-row qmv_fast (lanes x values per lane), which the exact kernel
    keeps; K must be a multiple of it (MLX's dispatch gate for qmv_fast)."""
    return 32 * 2 * (32 // bits)


def exact_qmv_unfit(x_shape, w_shape, dtype, scales_dtype, group_size: int, bits: int,
                    mode: str = "affine", biases=True) -> str:
    """Why the exact kernel cannot compute this product as MLX's one-row qmv_fast does
    ("" when it can): MLX takes another one-row kernel for other shapes and modes."""
    K, N = x_shape[-1], w_shape[0]
    if mode != "affine" or not biases:
        return f"mode {mode} (the kernel follows affine qmv_fast)"
    if bits not in EXACT_BITS:
        return f"{bits}-bit weights"
    if len(w_shape) != 2:
        return "batched weights"
    if K % exact_block(bits) or N % 8 or exact_block(bits) % group_size:
        return f"K {K} / N {N} / group {group_size} (MLX's one-row product is not qmv_fast there)"
    if dtype != scales_dtype or dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return f"inputs {dtype} with scales {scales_dtype}"
    return ""


def exact_qmv_launch(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
                     group_size: int, bits: int) -> Launch:
    """x [M, K] (row-contiguous), w [N, K * bits / 32] -> y [M, N], each row as MLX's
    one-row qmv_fast computes it."""
    why = exact_qmv_unfit(x.shape, w.shape, x.dtype, scales.dtype, group_size, bits)
    if why or x.ndim != 2:
        raise ValueError(f"the exact kernel does not take {why or f'x of shape {x.shape}'}")
    M, N = x.shape[0], w.shape[0]
    return Launch(
        inputs=[w, scales, biases, x],
        template=[("T", x.dtype), ("GS", group_size), ("BITS", bits), ("R", EXACT_ROWS)],
        grid=(32 * -(-M // EXACT_ROWS), 2 * (N // 8), 1),
        threadgroup=(32, 2, 1),
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )
