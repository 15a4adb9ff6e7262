// An exact verify pass's quantized product: y[m] = x[m] @ dequant(w).T for the M rows of a
// verify pass, each row computed as MLX's one-row decode step computes it.
//
// MLX runs a one-row quantized matmul (transposed weights, K a multiple of 512 for 4-bit /
// 256 for 8-bit, N a multiple of 8) with its `qmv_fast` kernel (mlx/backend/metal/kernels/
// quantized.h: qmv_fast_impl, load_vector, qdot). Over several rows it picks other kernels
// (qmv_wide, qmm split-K) that sum in another order, so a verify row differs from the same
// token decoded alone in its last bits. This kernel keeps, for every row, qmv_fast's whole
// arithmetic: the same lanes read the same K positions (lane l: values_per_thread values at
// block + l * values_per_thread), each lane's partial sum adds the blocks in order, each
// block's term is qdot's `scale * accum + sum * bias` with `sum` and the pre-scaled inputs
// made as load_vector makes them, and the 32 lanes' partials meet in one simd_sum per output.
// What differs is only what is shared: a threadgroup computes R rows against the weights it
// reads once, instead of one threadgroup per row.
//
// The tests run MLX's own qmv_fast_impl (read from the installed wheel's quantized.h) and
// this kernel through the same emulator (tests/metal_emu) and compare them bit for bit;
// on a Mac each variant is also checked against mx.quantized_matmul's one-row result on
// its first use (kernels/exact_rows.py), and the one-row path runs where it differs.
//
// Everything below the "//@ qmv_rows" line is the body handed to mx.fast.metal_kernel:
//   inputs   w [N, K * BITS / 32] uint32, scales [N, K / GS], biases [N, K / GS], x [M, K]
//   outputs  y [M, N] (x's dtype)
//   template T (x's dtype), GS (group size), BITS (4 or 8), R (rows per threadgroup)
// Grid (32 * ceil(M / R), 2 * N / 8): threadgroups of 2 simdgroups x 32 lanes, each simdgroup
// 4 output columns (as qmv_fast), the threadgroup R rows starting at R * its x position.

//@ qmv_rows
constexpr int PACK_FACTOR = 32 / BITS;  // values per uint32
constexpr int BYTES_PER_PACK = 4;
constexpr int PACKS_PER_THREAD = 2;
constexpr int VALUES_PER_THREAD = PACK_FACTOR * PACKS_PER_THREAD;
constexpr int BLOCK = VALUES_PER_THREAD * 32;
constexpr int SCALE_STEP = GS / VALUES_PER_THREAD;
constexpr int COLS = 4;  // output columns per simdgroup

const int M = x_shape[0];
const int K = x_shape[1];
const int N = w_shape[0];
const int k_bytes = K * BYTES_PER_PACK / PACK_FACTOR;
const int k_groups = K / GS;
const uint lane = thread_index_in_simdgroup;
const int col = threadgroup_position_in_grid.y * (2 * COLS) + simdgroup_index_in_threadgroup * COLS;
const int row0 = threadgroup_position_in_grid.x * R;
const int rows = min(R, M - row0);

const device uint8_t* wl = (const device uint8_t*)w + col * k_bytes + lane * PACKS_PER_THREAD * BYTES_PER_PACK;
const device T* sl = scales + col * k_groups + lane / SCALE_STEP;
const device T* bl = biases + col * k_groups + lane / SCALE_STEP;
const device T* xl = x + row0 * K + lane * VALUES_PER_THREAD;

float partial[R][COLS];
for (int r = 0; r < R; r++) {
  for (int c = 0; c < COLS; c++) {
    partial[r][c] = 0;
  }
}
float xs[VALUES_PER_THREAD];

for (int k = 0; k < K; k += BLOCK) {
  for (int r = 0; r < rows; r++) {
    const device T* xr = xl + r * K + k;
    // load_vector: the inputs' sum, and the inputs pre-scaled to each nibble's place.
    float sum = 0;
    if (BITS == 4) {
      for (int i = 0; i < VALUES_PER_THREAD; i += 4) {
        sum += float(xr[i]) + float(xr[i + 1]) + float(xr[i + 2]) + float(xr[i + 3]);
        xs[i] = xr[i];
        xs[i + 1] = xr[i + 1] / 16.0f;
        xs[i + 2] = xr[i + 2] / 256.0f;
        xs[i + 3] = xr[i + 3] / 4096.0f;
      }
    } else {
      for (int i = 0; i < VALUES_PER_THREAD; i++) {
        sum += xr[i];
        xs[i] = xr[i];
      }
    }
    for (int c = 0; c < COLS; c++) {
      // qdot: one block's term of output column col + c.
      const device uint8_t* wc = wl + c * k_bytes + k * BYTES_PER_PACK / PACK_FACTOR;
      float accum = 0;
      if (BITS == 4) {
        const device uint16_t* ws = (const device uint16_t*)wc;
        for (int i = 0; i < VALUES_PER_THREAD / 4; i++) {
          accum += (xs[4 * i] * (ws[i] & 0x000f) + xs[4 * i + 1] * (ws[i] & 0x00f0) +
                    xs[4 * i + 2] * (ws[i] & 0x0f00) + xs[4 * i + 3] * (ws[i] & 0xf000));
        }
      } else {
        for (int i = 0; i < VALUES_PER_THREAD; i++) {
          accum += xs[i] * wc[i];
        }
      }
      const float s = sl[c * k_groups + k / GS];
      const float b = bl[c * k_groups + k / GS];
      partial[r][c] += s * accum + sum * b;
    }
  }
}

for (int r = 0; r < R; r++) {
  for (int c = 0; c < COLS; c++) {
    const float total = simd_sum(partial[r][c]);
    if (lane == 0 && r < rows) {
      y[(row0 + r) * N + col + c] = static_cast<T>(total);
    }
  }
}
