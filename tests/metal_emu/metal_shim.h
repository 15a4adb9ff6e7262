// A small Metal shim: just enough of the Metal Shading Language, as MLX's custom
// kernels see it, to compile a kernel body as C++ and run its whole grid on the CPU.
//
// What it models:
// - address spaces `device` / `constant` / `thread` (erased; the real compiler's
//   address-space checks are not emulated);
// - uint, uint3, MLX's dtype names (float16_t/half and bfloat16_t/bfloat) with
//   round-to-nearest-even conversions and per-operation rounding, as on the GPU and
//   in MLX's CPU ops;
// - the metal:: functions the kernels use (exp, max, min, numeric_limits);
// - threadgroup_barrier, by running each threadgroup's threads as fibers that all
//   reach the barrier before any passes it (see emu_launch below).
// What it refuses: threadgroup memory and SIMD-group functions are not defined, so a
// kernel that uses them fails to compile here instead of being emulated unfaithfully.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>
#include <ucontext.h>

#define device
#define constant
#define thread

typedef unsigned int uint;

struct uint3 {
  uint x, y, z;
};

// ---- 16-bit floats -------------------------------------------------------------
// Arithmetic between two 16-bit values rounds the exact float result back to 16 bits
// (correctly rounded: float holds the exact product/sum of two 16-bit operands to
// within one rounding, so this matches IEEE half arithmetic and MLX's bf16 ops).
// Mixed 16-bit/float arithmetic promotes to float, as in Metal.

struct half {
  uint16_t bits;
  half() = default;
  explicit half(float f) {
    _Float16 h = static_cast<_Float16>(f);  // round to nearest even
    std::memcpy(&bits, &h, 2);
  }
  explicit half(int v) : half(static_cast<float>(v)) {}
  explicit half(uint v) : half(static_cast<float>(v)) {}
  operator float() const {
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return static_cast<float>(h);
  }
};

struct bfloat {
  uint16_t bits;
  bfloat() = default;
  explicit bfloat(float f) {
    // MLX's float_to_bfloat_bits: NaN stays a quiet NaN, otherwise round to nearest even.
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
      bits = 0x7FC0;
    } else {
      u += ((u >> 16) & 1u) + 0x7FFFu;
      bits = static_cast<uint16_t>(u >> 16);
    }
  }
  explicit bfloat(int v) : bfloat(static_cast<float>(v)) {}
  explicit bfloat(uint v) : bfloat(static_cast<float>(v)) {}
  operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

#define EMU_HALF_OPS(H)                                                          \
  inline H operator+(H a, H b) { return H(float(a) + float(b)); }                \
  inline H operator-(H a, H b) { return H(float(a) - float(b)); }                \
  inline H operator*(H a, H b) { return H(float(a) * float(b)); }                \
  inline H operator/(H a, H b) { return H(float(a) / float(b)); }                \
  inline H operator-(H a) { return H(-float(a)); }                               \
  inline float operator+(H a, float b) { return float(a) + b; }                  \
  inline float operator+(float a, H b) { return a + float(b); }                  \
  inline float operator-(H a, float b) { return float(a) - b; }                  \
  inline float operator-(float a, H b) { return a - float(b); }                  \
  inline float operator*(H a, float b) { return float(a) * b; }                  \
  inline float operator*(float a, H b) { return a * float(b); }                  \
  inline float operator/(H a, float b) { return float(a) / b; }                  \
  inline float operator/(float a, H b) { return a / float(b); }                  \
  inline bool operator<(H a, H b) { return float(a) < float(b); }                \
  inline bool operator>(H a, H b) { return float(a) > float(b); }                \
  inline bool operator<=(H a, H b) { return float(a) <= float(b); }              \
  inline bool operator>=(H a, H b) { return float(a) >= float(b); }              \
  inline bool operator==(H a, H b) { return float(a) == float(b); }              \
  inline bool operator!=(H a, H b) { return float(a) != float(b); }

EMU_HALF_OPS(half)
EMU_HALF_OPS(bfloat)

// MLX's names for them (mlx/backend/metal/kernels/bf16.h and utils).
typedef half float16_t;
typedef bfloat bfloat16_t;

// ---- metal:: --------------------------------------------------------------------

namespace metal {

template <typename T>
struct numeric_limits {
  static constexpr T infinity() { return std::numeric_limits<T>::infinity(); }
  static constexpr T lowest() { return std::numeric_limits<T>::lowest(); }
  static constexpr T max() { return std::numeric_limits<T>::max(); }
  static constexpr T min() { return std::numeric_limits<T>::min(); }
};

inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
inline float abs(float x) { return std::fabs(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
// Metal's fmax/fmin semantics for max/min on floats: a NaN operand yields the other.
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline uint min(uint a, uint b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

void threadgroup_barrier(mem_flags);

}  // namespace metal

using namespace metal;

// ---- the grid ---------------------------------------------------------------------

struct EmuThread {
  uint3 thread_position_in_grid;
  uint3 thread_position_in_threadgroup;
  uint3 threadgroup_position_in_grid;
  uint3 threads_per_threadgroup;
  uint3 threads_per_grid;
  uint3 threadgroups_per_grid;
  uint3 dispatch_threads_per_threadgroup;
  uint thread_index_in_threadgroup;
};

namespace emu_detail {

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
  bool at_barrier = false;
  EmuThread ids;
};

inline ucontext_t g_scheduler;
inline Fiber* g_current = nullptr;
inline bool g_fibers = false;
inline void (*g_trampoline)(const void*, const EmuThread&) = nullptr;
inline const void* g_body = nullptr;

inline void fiber_entry() {
  Fiber* f = g_current;
  g_trampoline(g_body, f->ids);
  f->done = true;
  swapcontext(&f->ctx, &g_scheduler);
}

// A small deterministic generator and Fisher-Yates shuffle (no <random> needed).
struct Rng {
  uint64_t s;
  uint32_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return static_cast<uint32_t>(s >> 32);
  }
};

template <typename T>
void shuffle(std::vector<T>& v, Rng& rng) {
  for (size_t i = v.size(); i > 1; --i) {
    size_t j = rng.next() % i;
    T tmp = v[i - 1];
    v[i - 1] = v[j];
    v[j] = tmp;
  }
}

inline uint umin(uint a, uint b) { return a < b ? a : b; }

}  // namespace emu_detail

inline void metal::threadgroup_barrier(mem_flags) {
  using namespace emu_detail;
  if (!g_fibers) {
    std::fprintf(stderr, "emu: threadgroup_barrier outside a barrier-enabled launch\n");
    std::abort();
  }
  Fiber* f = g_current;
  f->at_barrier = true;
  swapcontext(&f->ctx, &g_scheduler);
}

// Runs `body` once per thread of the grid (dispatchThreads semantics: the last
// threadgroup along each axis may be partial, as MLX dispatches). Threadgroups run one
// after another in an order shuffled by `seed`; inside a threadgroup the threads run in
// a shuffled order, each until it finishes or reaches a barrier; a barrier releases
// only when every thread of the group has reached it (a thread that finishes while
// others wait at a barrier is reported as divergent-barrier UB, return code 2). So a
// kernel whose result depends on thread order gives seed-dependent results.
template <typename Body>
inline int emu_launch(uint3 grid, uint3 tg, bool barriers, unsigned seed, const Body& body) {
  using namespace emu_detail;
  uint64_t z = uint64_t(seed) + 0x9E3779B97F4A7C15ull;  // splitmix64 of the seed
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  Rng rng{(z ^ (z >> 31)) | 1};
  uint3 groups = {(grid.x + tg.x - 1) / tg.x, (grid.y + tg.y - 1) / tg.y,
                  (grid.z + tg.z - 1) / tg.z};
  std::vector<uint3> order;
  for (uint z = 0; z < groups.z; ++z)
    for (uint y = 0; y < groups.y; ++y)
      for (uint x = 0; x < groups.x; ++x) order.push_back({x, y, z});
  shuffle(order, rng);
  g_body = &body;
  g_trampoline = [](const void* b, const EmuThread& t) { (*static_cast<const Body*>(b))(t); };
  g_fibers = barriers;
  std::vector<Fiber> fibers;
  for (const uint3& gp : order) {
    uint3 size = {umin(tg.x, grid.x - gp.x * tg.x), umin(tg.y, grid.y - gp.y * tg.y),
                  umin(tg.z, grid.z - gp.z * tg.z)};
    std::vector<EmuThread> threads;
    for (uint z = 0; z < size.z; ++z)
      for (uint y = 0; y < size.y; ++y)
        for (uint x = 0; x < size.x; ++x) {
          EmuThread t;
          t.thread_position_in_threadgroup = {x, y, z};
          t.threadgroup_position_in_grid = gp;
          t.thread_position_in_grid = {gp.x * tg.x + x, gp.y * tg.y + y, gp.z * tg.z + z};
          t.threads_per_threadgroup = size;
          t.dispatch_threads_per_threadgroup = tg;
          t.threads_per_grid = grid;
          t.threadgroups_per_grid = groups;
          t.thread_index_in_threadgroup = (z * size.y + y) * size.x + x;
          threads.push_back(t);
        }
    shuffle(threads, rng);
    if (!barriers) {
      for (const EmuThread& t : threads) body(t);
      continue;
    }
    fibers.resize(threads.size());
    for (size_t i = 0; i < threads.size(); ++i) {
      Fiber& f = fibers[i];
      f.ids = threads[i];
      f.done = false;
      f.at_barrier = false;
      f.stack.resize(1 << 16);
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.data();
      f.ctx.uc_stack.ss_size = f.stack.size();
      f.ctx.uc_link = nullptr;
      makecontext(&f.ctx, fiber_entry, 0);
    }
    std::vector<size_t> turn(fibers.size());
    for (size_t i = 0; i < turn.size(); ++i) turn[i] = i;
    for (;;) {
      shuffle(turn, rng);
      for (size_t i : turn) {
        Fiber& f = fibers[i];
        if (f.done) continue;
        f.at_barrier = false;
        g_current = &f;
        swapcontext(&g_scheduler, &f.ctx);
      }
      size_t done = 0, waiting = 0;
      for (const Fiber& f : fibers) {
        done += f.done;
        waiting += f.at_barrier && !f.done;
      }
      if (done == fibers.size()) break;
      if (done > 0 && waiting > 0) {
        std::fprintf(stderr, "emu: %zu threads wait at a barrier that %zu finished threads never reached\n",
                     waiting, done);
        return 2;
      }
    }
  }
  g_fibers = false;
  return 0;
}
