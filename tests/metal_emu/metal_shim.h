// A small Metal shim: just enough of the Metal Shading Language, as MLX's custom
// kernels see it, to compile a kernel body as C++ and run its whole grid on the CPU.
//
// What it models:
// - address spaces: `device` and `constant` become `volatile` one at a time (the build
//   defines EMU_CONSTANT_IS_VOLATILE or EMU_DEVICE_IS_VOLATILE), so binding data of one
//   space to a pointer of the other drops a qualifier and fails to compile, as on Metal;
// - uint, uint3, MLX's dtype names (float16_t/half and bfloat16_t/bfloat) with
//   round-to-nearest-even conversions and per-operation rounding, as on the GPU and
//   in MLX's CPU ops;
// - the metal:: functions the kernels use (exp, precise::exp, max, min, numeric_limits);
// - threadgroup_barrier, by running each threadgroup's threads as fibers that all
//   reach the same barrier call site before any passes it; a barrier must fence device
//   memory, or threadgroup memory in a kernel that declares some;
// - races: every output byte a thread changes is attributed to it, and two threads
//   changing one byte without a barrier between them (or from two threadgroups) fail;
// - threadgroup memory: one-dimensional arrays declared in the kernel body
//   (`threadgroup T name[N];`, rewritten by emulate.py into EmuThreadgroupArray), one
//   fresh block per threadgroup. Every element access is checked: a read of an element no
//   thread of the group wrote, a read or write of an element another thread wrote or read
//   in the same barrier interval (a missing barrier), a read across barriers none of
//   which fenced mem_threadgroup, an index past the end, and more than Metal's 32 KiB per
//   threadgroup all fail;
// - the whole program after this header is compiled with Metal's missing C++ features
//   poisoned (double, std::, new, exceptions, goto, virtual...), see EMU_POISON.
// - simd_sum over a SIMD-group of 32 lanes (the threads of a threadgroup in index order, 32
//   at a time): every thread of the threadgroup must reach the same simd_sum call (uniform
//   control flow, as the kernels that use it have), then each lane gets the sum of its
//   group's values added in a butterfly order (lane i and lane i ^ 16, then ^ 8, ^ 4, ^ 2,
//   ^ 1), the same order for every kernel: two kernels whose lanes hold the same values
//   get the same bits, as on the GPU, whose own reduction order is not documented;
// What it refuses: other uses of `threadgroup` (pointers, scalars, 2-D arrays) and the
// other SIMD-group functions are not defined, so a kernel that uses them fails to compile
// here instead of being emulated unfaithfully.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdarg>
#include <limits>
#include <map>
#include <vector>
#include <ucontext.h>

#if defined(EMU_CONSTANT_IS_VOLATILE)
#define device
#define constant volatile
#elif defined(EMU_DEVICE_IS_VOLATILE)
#define device volatile
#define constant
#else
#error "define EMU_CONSTANT_IS_VOLATILE or EMU_DEVICE_IS_VOLATILE"
#endif
#define thread
// Threadgroup arrays are rewritten before compilation; anything else is refused.
#define threadgroup emu_only_threadgroup_arrays_are_emulated

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
  half(const half&) = default;
  half(const volatile half& o) : bits(o.bits) {}  // reads through constant / device pointers
  half& operator=(const half&) = default;
  void operator=(const half& o) volatile { bits = o.bits; }
  explicit half(float f) {
    _Float16 h = static_cast<_Float16>(f);  // round to nearest even
    std::memcpy(&bits, &h, 2);
  }
  explicit half(int v) : half(static_cast<float>(v)) {}
  explicit half(uint v) : half(static_cast<float>(v)) {}
  operator float() const volatile {
    _Float16 h;
    const uint16_t b = bits;
    std::memcpy(&h, &b, 2);
    return static_cast<float>(h);
  }
};

struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(const bfloat&) = default;
  bfloat(const volatile bfloat& o) : bits(o.bits) {}  // reads through constant / device pointers
  bfloat& operator=(const bfloat&) = default;
  void operator=(const bfloat& o) volatile { bits = o.bits; }
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
  operator float() const volatile {
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
namespace precise {
inline float exp(float x) { return std::exp(x); }
}  // namespace precise
inline float log(float x) { return std::log(x); }
inline float abs(float x) { return std::fabs(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
// Metal's fmax/fmin semantics for max/min on floats: a NaN operand yields the other.
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline uint min(uint a, uint b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
template <typename T>
inline T select(T a, T b, bool c) { return c ? b : a; }

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

// The default argument records the caller's line: the barrier's call site (two
// barriers on one line count as one).
void threadgroup_barrier(mem_flags, int line = __builtin_LINE());
float simd_sum(float v, int line = __builtin_LINE());

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
  uint thread_index_in_simdgroup;
  uint simdgroup_index_in_threadgroup;
  uint threads_per_simdgroup;
  uint simdgroups_per_threadgroup;
};

namespace emu_detail {

// The running thread, for the threadgroup-memory checks.
struct Who {
  uint id = 0;        // 1 + linear index of the thread in the grid
  uint group = 0;     // index of its threadgroup in the launch
  uint interval = 0;  // barriers it has passed
  int tg_fenced = -1; // the last interval ended by a barrier fencing mem_threadgroup
};

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
  bool at_barrier = false;
  int site_line = 0;
  uint simd_calls = 0;  // simd_sum calls made, to match the lanes of one call
  Who who;
  EmuThread ids;
};

inline ucontext_t g_scheduler;
inline Fiber* g_current = nullptr;
inline bool g_fibers = false;
inline void (*g_trampoline)(const void*, const EmuThread&) = nullptr;
inline const void* g_body = nullptr;
inline const char* g_error = nullptr;  // set by a thread, reported by the launch
inline char g_message[512];
inline Who* g_who = nullptr;
inline bool g_tg_kernel = false;  // the kernel declares threadgroup memory

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

// Which thread last changed each output byte, and in which barrier interval of its
// group. Kept by comparing the outputs with a shadow copy after each run of a thread
// (until it finishes or reaches a barrier), so writes of an unchanged value are not seen.
struct Buffer {
  char* data;
  size_t size;
};

struct RaceTracker {
  std::vector<Buffer> outs;
  std::vector<std::vector<char>> shadow;
  std::vector<std::vector<uint32_t>> owner, stamp, group;
  bool on = false;

  void start(const std::vector<Buffer>& buffers, bool enabled) {
    outs = buffers;
    on = enabled;
    if (!on) return;
    for (const Buffer& b : outs) {
      shadow.emplace_back(b.data, b.data + b.size);
      owner.emplace_back(b.size, 0u);
      stamp.emplace_back(b.size, 0u);
      group.emplace_back(b.size, 0u);
    }
  }

  // After thread `id` of group `g` ran in interval `now`: attribute its changes.
  bool after(uint id, uint g, uint now) {
    if (!on) return true;
    for (size_t k = 0; k < outs.size(); ++k) {
      char* cur = outs[k].data;
      char* old = shadow[k].data();
      const size_t n = outs[k].size;
      for (size_t c = 0; c < n; c += 64) {
        const size_t len = n - c < 64 ? n - c : 64;
        if (std::memcmp(cur + c, old + c, len) == 0) continue;
        for (size_t i = c; i < c + len; ++i) {
          if (cur[i] == old[i]) continue;
          const uint32_t prev = owner[k][i];
          if (prev != 0 && prev != id && (group[k][i] != g || stamp[k][i] == now)) {
            std::snprintf(g_message, sizeof g_message,
                          "emu: data race: threads %u and %u (threadgroups %u and %u) both "
                          "changed byte %zu of output %zu without a barrier between them",
                          prev - 1, id - 1, group[k][i], g, i, k);
            return false;
          }
          owner[k][i] = id;
          stamp[k][i] = now;
          group[k][i] = g;
          old[i] = cur[i];
        }
      }
    }
    return true;
  }
};

// The running fiber, for a call that waits for its threadgroup (else abort with ``misuse``).
inline Fiber* waiting_fiber(const char* misuse) {
  if (!g_fibers) {
    std::fprintf(stderr, "%s\n", misuse);
    std::abort();
  }
  return g_current;
}

// Yield until every thread of the group waits at ``site`` (the scheduler releases them).
inline void wait_for_group(Fiber* f, int site) {
  f->at_barrier = true;
  f->site_line = site;
  swapcontext(&f->ctx, &g_scheduler);
}

}  // namespace emu_detail

inline void metal::threadgroup_barrier(mem_flags flags, int line) {
  using namespace emu_detail;
  Fiber* f = waiting_fiber("emu: threadgroup_barrier outside a barrier-enabled launch");
  const bool fences_tg = int(flags) & int(mem_flags::mem_threadgroup);
  const bool fences_device = int(flags) & int(mem_flags::mem_device);
  if (g_tg_kernel && !fences_device && !fences_tg) {
    g_error = "emu: threadgroup_barrier without mem_flags::mem_threadgroup or mem_device: "
              "it fences no memory the threads share";
  } else if (!g_tg_kernel && !fences_device) {
    // Without threadgroup memory, threads share only device memory: a barrier that does
    // not fence it leaves what one thread wrote before it unordered with what another
    // reads after it. (With threadgroup memory, each read of it checks its own fence;
    // device memory is then not checked, see the README's known limits.)
    g_error = "emu: threadgroup_barrier without mem_flags::mem_device: device memory "
              "written before it is not guaranteed visible after it";
  }
  if (fences_tg) f->who.tg_fenced = int(f->who.interval);
  wait_for_group(f, line);
  ++f->who.interval;  // released: every thread of the group reached this barrier
}

// ---- SIMD-group reductions ---------------------------------------------------------

namespace emu_detail {
// Each simd_sum call's lane values, by (threadgroup, SIMD-group, call), for one launch.
struct SimdCall {
  float v[32];
  bool present[32];
};
inline std::map<uint64_t, SimdCall> g_simd;
}  // namespace emu_detail

inline float metal::simd_sum(float v, int line) {
  using namespace emu_detail;
  Fiber* f = waiting_fiber("emu: simd_sum outside a fiber launch");
  const uint lane = f->ids.thread_index_in_simdgroup;
  const uint64_t key = (uint64_t(f->who.group) << 40) |
                       (uint64_t(f->ids.simdgroup_index_in_threadgroup) << 32) | f->simd_calls++;
  SimdCall& call = g_simd[key];
  call.v[lane] = v;
  call.present[lane] = true;
  wait_for_group(f, -line);  // a simd_sum site, never equal to a barrier's
  // Released: every thread of the threadgroup reached this call, so every lane wrote.
  float x[32];
  for (int i = 0; i < 32; ++i) x[i] = call.present[i] ? call.v[i] : 0.0f;
  for (int off = 16; off >= 1; off >>= 1) {
    float y[32];
    for (int i = 0; i < 32; ++i) y[i] = x[i] + x[i ^ off];
    std::memcpy(x, y, sizeof x);
  }
  return x[lane];
}

// ---- threadgroup memory ----------------------------------------------------------

namespace emu_detail {

[[noreturn]] inline void tg_fail(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::fputs("emu: ", stderr);
  std::vfprintf(stderr, fmt, args);
  std::fputs("\n", stderr);
  va_end(args);
  std::_Exit(5);
}

// Who last wrote an element (0: nobody yet) and in which of the writer's barrier
// intervals; who read it in the latest interval it was read (several: any thread).
struct TgCell {
  uint writer = 0, written = 0, reader = 0, read = 0;
  bool readers = false;
};

struct TgBlock {
  std::vector<unsigned char> bytes;  // 0xFF at first: NaN as floats, if a read slipped by
  std::vector<TgCell> cells;
  const char* name;
};

constexpr size_t MAX_THREADGROUP_MEMORY = 32768;  // every Apple GPU
inline std::map<uint64_t, TgBlock> g_tg;          // (group, declaration) -> block
inline std::map<uint, size_t> g_tg_bytes;         // group -> bytes declared

inline void tg_reset() {
  g_tg.clear();
  g_tg_bytes.clear();
}

inline TgBlock& tg_block(int site, size_t n, size_t size, const char* name) {
  const uint64_t key = (uint64_t(g_who->group) << 32) | uint(site);
  auto it = g_tg.find(key);
  if (it != g_tg.end()) return it->second;
  size_t& total = g_tg_bytes[g_who->group];
  total += n * size;
  if (total > MAX_THREADGROUP_MEMORY)
    tg_fail("threadgroup memory of %zu bytes (with `%s`) exceeds Metal's %zu per threadgroup",
            total, name, MAX_THREADGROUP_MEMORY);
  TgBlock& b = g_tg[key];
  b.bytes.assign(n * size, 0xFF);
  b.cells.resize(n);
  b.name = name;
  return b;
}

inline void tg_read(TgBlock& b, size_t i) {
  const Who& w = *g_who;
  TgCell& c = b.cells[i];
  if (c.writer == 0)
    tg_fail("thread %u reads %s[%zu], which no thread of its threadgroup wrote "
            "(threadgroup memory starts undefined)", w.id - 1, b.name, i);
  if (c.writer != w.id && c.written == w.interval)
    tg_fail("data race on threadgroup memory: thread %u reads %s[%zu], which thread %u "
            "wrote in the same barrier interval (no barrier between the write and the read)",
            w.id - 1, b.name, i, c.writer - 1);
  if (c.writer != w.id && w.tg_fenced < int(c.written))
    tg_fail("thread %u reads %s[%zu], written by thread %u before a barrier without "
            "mem_flags::mem_threadgroup: the write is not guaranteed visible",
            w.id - 1, b.name, i, c.writer - 1);
  if (c.reader == 0 || c.read != w.interval) {
    c.reader = w.id;
    c.read = w.interval;
    c.readers = false;
  } else if (c.reader != w.id) {
    c.readers = true;
  }
}

inline void tg_write(TgBlock& b, size_t i) {
  const Who& w = *g_who;
  TgCell& c = b.cells[i];
  if (c.writer != 0 && c.writer != w.id && c.written == w.interval)
    tg_fail("data race on threadgroup memory: threads %u and %u both write %s[%zu] in one "
            "barrier interval", c.writer - 1, w.id - 1, b.name, i);
  if (c.reader != 0 && c.read == w.interval && (c.readers || c.reader != w.id))
    tg_fail("data race on threadgroup memory: thread %u overwrites %s[%zu] that another "
            "thread read in the same barrier interval (no barrier between the read and the "
            "write)", w.id - 1, b.name, i);
  c.writer = w.id;
  c.written = w.interval;
}

}  // namespace emu_detail

// One element of a threadgroup array: every read and write goes through the checks.
template <typename T>
struct EmuTgRef {
  emu_detail::TgBlock* block;
  size_t i;
  T* at() const { return reinterpret_cast<T*>(block->bytes.data()) + i; }
  operator T() const {
    emu_detail::tg_read(*block, i);
    return *at();
  }
  EmuTgRef& operator=(const T& v) {
    emu_detail::tg_write(*block, i);
    *at() = v;
    return *this;
  }
  EmuTgRef& operator=(const EmuTgRef& o) { return *this = static_cast<T>(o); }
  EmuTgRef& operator+=(const T& v) { return *this = static_cast<T>(static_cast<T>(*this) + v); }
  EmuTgRef& operator-=(const T& v) { return *this = static_cast<T>(static_cast<T>(*this) - v); }
  EmuTgRef& operator*=(const T& v) { return *this = static_cast<T>(static_cast<T>(*this) * v); }
};

// `threadgroup T name[N];` in a kernel body becomes `EmuThreadgroupArray<T, (N)> name(...)`:
// every thread that runs the declaration gets its threadgroup's block.
template <typename T, size_t N>
struct EmuThreadgroupArray {
  emu_detail::TgBlock* block;
  EmuThreadgroupArray(const char* name, int site)
      : block(&emu_detail::tg_block(site, N, sizeof(T), name)) {}
  EmuTgRef<T> operator[](size_t i) const {
    if (i >= N) emu_detail::tg_fail("index %zu past the end of threadgroup array %s[%zu]", i, block->name, N);
    return {block, i};
  }
};

// Runs `body` once per thread of the grid (dispatchThreads semantics: the last
// threadgroup along each axis may be partial, as MLX dispatches), in orders shuffled by
// `seed`, so a kernel whose result depends on thread order gives seed-dependent results.
// Without barriers, threadgroups run one after another, their threads one by one. With
// barriers, threads are fibers: each round runs every live thread until it finishes or
// reaches a barrier; a barrier releases when every thread of its group waits at the same
// call site. Small grids (at most EMU_INTERLEAVE threads) run all their threadgroups'
// fibers interleaved in one shuffled pool; larger ones one group at a time.
// Return codes: 2 divergent barrier, 5 a data race or a barrier that fences nothing.
#ifndef EMU_INTERLEAVE
#define EMU_INTERLEAVE 2048
#endif

template <typename Body>
inline int emu_launch(uint3 grid, uint3 tg, bool barriers, bool tg_memory, unsigned seed,
                      const std::vector<emu_detail::Buffer>& outs, bool track_races,
                      const Body& body) {
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
  g_tg_kernel = tg_memory;
  g_error = nullptr;
  g_message[0] = 0;
  g_simd.clear();
  RaceTracker races;
  races.start(outs, track_races);
  const uint64_t total = uint64_t(grid.x) * grid.y * grid.z;
  const size_t pool = barriers && total <= EMU_INTERLEAVE ? order.size() : 1;
  uint stamp = 0;  // barrier intervals, numbered across the launch
  for (size_t first = 0; first < order.size(); first += pool) {
    tg_reset();  // threadgroup memory lives as long as its threadgroups
    std::vector<EmuThread> threads;
    std::vector<uint> group_of;
    for (size_t gi = first; gi < first + pool && gi < order.size(); ++gi) {
      const uint3& gp = order[gi];
      uint3 size = {umin(tg.x, grid.x - gp.x * tg.x), umin(tg.y, grid.y - gp.y * tg.y),
                    umin(tg.z, grid.z - gp.z * tg.z)};
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
            t.thread_index_in_simdgroup = t.thread_index_in_threadgroup % 32;
            t.simdgroup_index_in_threadgroup = t.thread_index_in_threadgroup / 32;
            t.threads_per_simdgroup = 32;
            t.simdgroups_per_threadgroup = (size.x * size.y * size.z + 31) / 32;
            threads.push_back(t);
            group_of.push_back((gp.z * groups.y + gp.y) * groups.x + gp.x);
          }
    }
    std::vector<size_t> perm(threads.size());
    for (size_t i = 0; i < perm.size(); ++i) perm[i] = i;
    shuffle(perm, rng);
    auto linear = [&](const EmuThread& t) {
      const uint3& p = t.thread_position_in_grid;
      return uint((uint64_t(p.z) * grid.y + p.y) * grid.x + p.x + 1);
    };
    if (!barriers) {
      ++stamp;
      for (size_t i : perm) {
        Who who;
        who.id = linear(threads[i]);
        who.group = group_of[i];
        g_who = &who;
        body(threads[i]);
        if (!races.after(who.id, who.group, stamp)) {
          std::fprintf(stderr, "%s\n", g_message);
          return 5;
        }
      }
      continue;
    }
    std::vector<Fiber> fibers(threads.size());
    for (size_t i = 0; i < threads.size(); ++i) {
      Fiber& f = fibers[i];
      f.ids = threads[perm[i]];
      f.who.group = group_of[perm[i]];
      f.who.id = linear(f.ids);
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
      ++stamp;
      shuffle(turn, rng);
      for (size_t i : turn) {
        Fiber& f = fibers[i];
        if (f.done) continue;
        f.at_barrier = false;
        g_current = &f;
        g_who = &f.who;
        swapcontext(&g_scheduler, &f.ctx);
        if (g_error) {
          std::fprintf(stderr, "%s\n", g_error);
          return 5;
        }
        if (!races.after(f.who.id, f.who.group, stamp)) {
          std::fprintf(stderr, "%s\n", g_message);
          return 5;
        }
      }
      // Per threadgroup: all done, or all waiting at one call site.
      bool all_done = true;
      std::vector<size_t> done(order.size() + 1, 0), waiting(order.size() + 1, 0);
      std::vector<const Fiber*> site(order.size() + 1, nullptr);
      for (const Fiber& f : fibers) {
        const size_t g = f.who.group;
        if (f.done) {
          ++done[g];
          continue;
        }
        all_done = false;
        ++waiting[g];
        if (!site[g]) {
          site[g] = &f;
        } else if (site[g]->site_line != f.site_line) {
          std::fprintf(stderr, "emu: threads of threadgroup %zu wait at different barriers "
                       "(lines %d and %d)\n", g, site[g]->site_line, f.site_line);
          return 2;
        }
      }
      for (size_t g = 0; g < done.size(); ++g) {
        if (done[g] > 0 && waiting[g] > 0) {
          std::fprintf(stderr, "emu: %zu threads wait at a barrier that %zu finished threads "
                       "never reached\n", waiting[g], done[g]);
          return 2;
        }
      }
      if (all_done) break;
    }
  }
  g_fibers = false;
  return 0;
}

// The harness's main (kept here, before the poisoned kernel code): `prog CASE SEED
// input files... output files...`.
struct EmuCase {
  int (*run)(void**, unsigned);
  int n_in, n_buf;
  const size_t* sizes;
};

inline int emu_main(int argc, char** argv, const EmuCase* cases) {
  const EmuCase& c = cases[std::atoi(argv[1])];
  unsigned seed = (unsigned)std::strtoul(argv[2], nullptr, 10);
  std::vector<void*> bufs(c.n_buf);
  for (int i = 0; i < c.n_buf; ++i) {
    bufs[i] = std::malloc(c.sizes[i] ? c.sizes[i] : 1);  // exact size: ASan sees overruns
    if (i < c.n_in) {
      FILE* f = std::fopen(argv[3 + i], "rb");
      if (!f || std::fread(bufs[i], 1, c.sizes[i], f) != c.sizes[i]) return 3;
      std::fclose(f);
    } else {
      std::memset(bufs[i], 0xFF, c.sizes[i]);  // unwritten outputs read as NaN / -1
    }
  }
  int rc = c.run(bufs.data(), seed);
  if (rc) return rc;
  for (int i = c.n_in; i < c.n_buf; ++i) {
    FILE* f = std::fopen(argv[3 + i], "wb");
    if (!f || std::fwrite(bufs[i], 1, c.sizes[i], f) != c.sizes[i]) return 4;
    std::fclose(f);
  }
  for (void* b : bufs) std::free(b);
  return 0;
}

inline std::vector<emu_detail::Buffer> emu_outputs(void** bufs, int n_in, int n_buf,
                                                   const size_t* sizes) {
  std::vector<emu_detail::Buffer> out;
  for (int i = n_in; i < n_buf; ++i) out.push_back({static_cast<char*>(bufs[i]), sizes[i]});
  return out;
}
