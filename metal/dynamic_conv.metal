// DFlash 2's grouped dynamic two-tap conv, one fused pass over a whole block.
//
//   out[n, t, c] = sum_o (base[o, c] + dyn[n, t, o, c / GS]) * x[n, t - o, c],   x[n, -1, c] = 0
//
// Everything below the "//@ conv" line is the body handed to mx.fast.metal_kernel;
// MLX writes the signature from the names and dtypes (dflash2_mlx/kernels/launches.py):
//   inputs   x [N, L, H], dyn [N, L, 2, H / GS], base [2, H]   (row-contiguous)
//   outputs  out [N, L, H]
//   template T    output dtype (= x's dtype)
//            TAP  dtype of base + dyn      (MLX promotion, as in the twin)
//            C    dtype of TAP * x         (MLX promotion, as in the twin)
//            H, GS, L   hidden size, group size, block length
// Grid (H, L, N): one thread per (batch row, block position, channel). A thread reads
// only inputs and writes only its own output element, so thread order cannot matter.
// The arithmetic follows the twin operation for operation and dtype for dtype
// (taps = base + dyn, then tap0 * x + tap1 * x_prev, then the cast to T). What that
// guarantees: without floating-point contraction the result rounds exactly as the twin
// does (the emulator, -ffp-contract=off, checks bit equality). MLX compiles in math mode
// "safe", but the Metal compiler may still fuse tap0 * x + tap1 * x_prev into one
// fused multiply-add, skipping one product's rounding; then
//   |out - twin| <= eps(C) * max(|tap0 * x|, |tap1 * x_prev|) + eps(T) * |twin|,
// relative to the products, not the result (cancellation can make the result tiny and
// that difference many ulps of it). kernels.selfcheck.conv_problem checks exactly this bound.

//@ conv
const uint c = thread_position_in_grid.x;
const uint t = thread_position_in_grid.y;
const uint n = thread_position_in_grid.z;
constexpr uint G = H / GS;
const uint row = n * L + t;
const uint i = row * H + c;
const uint g = c / GS;

const TAP tap0 = static_cast<TAP>(base[c]) + static_cast<TAP>(dyn[(2 * row) * G + g]);
const TAP tap1 = static_cast<TAP>(base[H + c]) + static_cast<TAP>(dyn[(2 * row + 1) * G + g]);
const C cur = static_cast<C>(x[i]);
const C prev = t > 0 ? static_cast<C>(x[i - H]) : static_cast<C>(0.0f);
out[i] = static_cast<T>(static_cast<C>(tap0) * cur + static_cast<C>(tap1) * prev);
