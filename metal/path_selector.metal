// DFlash 2's path selector: score every (predecessor, candidate) pair of every block
// position, then walk the lattice from the anchor: in one launch (`select`), or in two
// (`scores` split across threadgroups, then `walk`).
//
//   S[n, t, a, b] = U[n, t, b] + sum_r AG(A[pred(t, a), r] * g[n, t, r]) * B[cand[n, t, b], r]
//   pred(0, a) = anchor[n],  pred(t, a) = cand[n, t - 1, a]
//
// Sections (split on the "//@ name" lines by dflash2_mlx/kernels/sources.py):
//   header  the walk step shared by both kernels (passed as `header=`)
//   select  fused kernel: inputs unary [N, L, K], cand [N, L, K] (integer ids),
//           gate [N, L, R], anchor [N], predecessor_codebook [V, R],
//           successor_codebook [V, R], temperature (scalar float32), uniforms [N, L];
//           outputs scores [N, L, K, K] float32, path [N, L] int32, q [N, L, K] float32;
//           template K, R, L, NT (threads per row), AG (dtype of A * g, MLX promotion).
//           Grid (NT, N, 1), threadgroup (NT, 1, 1): one threadgroup per batch row.
//           Phase 1: the row's NT threads share out its L*K*K pair scores (each score
//           is computed by exactly one thread, written to `scores`). Barrier on device
//           memory. Phase 2: thread 0 alone walks, reading `scores`.
//   scores  scores only, split across threadgroups (the batch-1 layout, followed by
//           `walk`): inputs as `select` less temperature and uniforms; output scores;
//           template K, R, L, AB (predecessor rows per threadgroup), RT (rank columns
//           per tile), AG. Grid (AB * K * ceil(K / AB), L, N), threadgroup (AB * K, 1, 1):
//           one threadgroup per (batch row, position, tile of AB predecessor rows), one
//           thread per pair. Each rank tile of the rows the threadgroup needs (AB rows of
//           A * g, K successor rows) is staged once in threadgroup memory, where `select`
//           reads every row from device memory K times. Same products, same sequential
//           sum over r as `select`, so the two agree bit for bit.
//   walk    walk only (for scores computed elsewhere): inputs scores, temperature,
//           uniforms; outputs path, q; template K, L. One thread per batch row.
//
// Walk rules (shared with dflash2_mlx.kernels.selector.walk_reference):
//   a NaN score counts as -inf (so NaN rows behave the same on every back-end);
//   greedy (temperature == 0): argmax, ties to the lowest candidate index; q one-hot.
//   sampled: x = row / temperature; if max(x) is not finite (every score -inf or NaN,
//   or an overflow to +inf) the step is greedy on x; otherwise
//   q = softmax(x) computed as exp(x - max) * (1 / sum), and the pick is the first j
//   whose running sum of q exceeds u, else (rounding left u above the total) the last
//   j with q > 0.

//@ header
// Row is `const device float*` or `const constant float*` (MLX binds inputs of fewer
// than 8 elements in the constant address space), hence the template.
inline float dflash_walk_score(float s, float temperature) {
  const float x = temperature == 0.0f ? s : s / temperature;
  return metal::isnan(x) ? -metal::numeric_limits<float>::infinity() : x;
}

template <int K, typename Row>
inline uint dflash_walk_step(Row row, float temperature, float u, device float* q) {
  float top = -metal::numeric_limits<float>::infinity();
  uint arg = 0;
  for (uint j = 0; j < K; ++j) {
    const float x = dflash_walk_score(row[j], temperature);
    if (x > top) {
      top = x;
      arg = j;
    }
  }
  if (temperature == 0.0f || !metal::isfinite(top)) {
    for (uint j = 0; j < K; ++j) {
      q[j] = j == arg ? 1.0f : 0.0f;
    }
    return arg;
  }
  float total = 0.0f;
  for (uint j = 0; j < K; ++j) {
    // precise::exp: under fast math, recent macOS may resolve metal::exp to the fast variant.
    const float e = metal::precise::exp(dflash_walk_score(row[j], temperature) - top);
    q[j] = e;
    total += e;
  }
  const float inv = 1.0f / total;
  float cdf = 0.0f;
  uint pick = K;
  uint last = arg;
  for (uint j = 0; j < K; ++j) {
    const float p = q[j] * inv;
    q[j] = p;
    cdf += p;
    if (pick == K && cdf > u) {
      pick = j;
    }
    if (p > 0.0f) {
      last = j;
    }
  }
  return metal::min(pick, last);
}

//@ select
const uint n = threadgroup_position_in_grid.y;
const uint tid = thread_position_in_threadgroup.x;

for (uint p = tid; p < L * K * K; p += NT) {
  const uint t = p / (K * K);
  const uint a = (p / K) % K;
  const uint b = p % K;
  const uint row = n * L + t;
  const uint pred = t == 0 ? static_cast<uint>(anchor[n])
                           : static_cast<uint>(cand[(row - 1) * K + a]);
  const uint succ = static_cast<uint>(cand[row * K + b]);
  float acc = 0.0f;
  for (uint r = 0; r < R; ++r) {
    const AG ag = static_cast<AG>(predecessor_codebook[pred * R + r]) *
                  static_cast<AG>(gate[row * R + r]);
    acc += static_cast<float>(ag) * static_cast<float>(successor_codebook[succ * R + r]);
  }
  scores[(row * K + a) * K + b] = static_cast<float>(unary[row * K + b]) + acc;
}

metal::threadgroup_barrier(metal::mem_flags::mem_device);

if (tid == 0) {
  uint prev = 0;
  for (uint t = 0; t < L; ++t) {
    const uint row = n * L + t;
    prev = dflash_walk_step<K>(scores + (row * K + prev) * K, temperature, uniforms[row], q + row * K);
    path[row] = static_cast<int>(prev);
  }
}

//@ scores
// Rows padded to RS = RT + 1 floats: the successor rows a SIMD group reads at one r (16
// of them at K = 16) then fall in distinct memory banks instead of one.
constexpr uint NTG = AB * K;
constexpr uint RS = RT + 1;
threadgroup float ag_tile[AB * RS];
threadgroup float b_tile[K * RS];

const uint tid = thread_position_in_threadgroup.x;
const uint a0 = threadgroup_position_in_grid.x * AB;
const uint t = threadgroup_position_in_grid.y;
const uint n = threadgroup_position_in_grid.z;
const uint row = n * L + t;
const uint a = a0 + tid / K;  // >= K in the last tile's spare threads: they only stage
const uint b = tid % K;

float acc = 0.0f;
for (uint r0 = 0; r0 < R; r0 += RT) {
  const uint rn = metal::min(static_cast<uint>(RT), static_cast<uint>(R) - r0);
  for (uint i = tid; i < AB * rn; i += NTG) {
    const uint pa = a0 + i / rn;
    if (pa < K) {
      const uint pred = t == 0 ? static_cast<uint>(anchor[n])
                               : static_cast<uint>(cand[(row - 1) * K + pa]);
      const AG ag = static_cast<AG>(predecessor_codebook[pred * R + r0 + i % rn]) *
                    static_cast<AG>(gate[row * R + r0 + i % rn]);
      ag_tile[(i / rn) * RS + i % rn] = static_cast<float>(ag);
    }
  }
  for (uint i = tid; i < K * rn; i += NTG) {
    const uint succ = static_cast<uint>(cand[row * K + i / rn]);
    b_tile[(i / rn) * RS + i % rn] = static_cast<float>(successor_codebook[succ * R + r0 + i % rn]);
  }
  // The tile is read by other threads than those that staged it ...
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  if (a < K) {
    for (uint r = 0; r < rn; ++r) {
      acc += ag_tile[(tid / K) * RS + r] * b_tile[b * RS + r];
    }
  }
  // ... and must not be restaged for the next r0 while any of them still reads it.
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
}
if (a < K) {
  scores[(row * K + a) * K + b] = static_cast<float>(unary[row * K + b]) + acc;
}

//@ walk
const uint n = thread_position_in_grid.x;
uint prev = 0;
for (uint t = 0; t < L; ++t) {
  const uint row = n * L + t;
  prev = dflash_walk_step<K>(scores + (row * K + prev) * K, temperature, uniforms[row], q + row * K);
  path[row] = static_cast<int>(prev);
}
