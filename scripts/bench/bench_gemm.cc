// vlm-bench-gemm: the project's bf16 GEMM (common/kernels/gemm.h) against
// LibTorch's bf16 at::linear on the Qwen3-VL-2B shapes, next to the machine's
// peak measured in the same run by a register-only micro-kernel (AVX-512 BF16
// VDPBF16PS loop; AMX TDPBF16PS tile loop where the CPU has AMX).
//
// "old" is the previous avx512bf16 block kernel (K blocks of 256, x copied per
// block, 96-row x 8-panel tasks), frozen below so every run shows old and new
// side by side; "kernel" is common/kernels' current one (Gemm, default avx512bf16).
//
// Tables (medians over --reps; implementations interleaved per repetition so
// load from other processes hits them alike):
//   1. GFLOP/s per shape and M = 64..2048 (wall time, --threads): kernel, old,
//      amx (where present), avx2 (the AVX2 + FMA path for CPUs without AVX-512,
//      on the same panels), at::linear; the kernel's share of the peak and its
//      ratio to at::linear and to old.
//   2. The same for short prefill chunks, M = 1, 4, 8, 16.
//   3. One thread, GFLOP per second of the thread's own CPU time
//      (CLOCK_THREAD_CPUTIME_ID): time the thread was descheduled does not
//      count, so this table stays meaningful on a machine shared with other
//      work; kernel, old and at::linear (1 intra-op thread) against the
//      1-thread peak measured the same way.
//   4. "No cliffs": every M in --cliff_min..--cliff_max on 2048->6144, time per row on
//      one thread in thread CPU time (the shape's tiling decides cliffs, and
//      thread CPU time keeps other processes' load out of the comparison);
//      a cliff is a step M-1 -> M where the time per row rises by more than
//      1.3x. Summarised per 64 rows; flagged M listed.
//
// Usage: vlm-bench-gemm [--threads 2] [--reps 3] [--cliff_max 1024] [--cliff_reps 3]
//                       [--cliff_min 1] (the cliff table over cliff_min..cliff_max)
//                       [--wall 1]  (--wall 0: skip tables 1 and 2)
//                       [--shapes 0,1,2,3] (fc1, fc2, gate/up, q/o) [--ms 64,...,2048]
//                       [--small_ms 1,4,8,16] [--cpu_ms 1,4,8,16,256,1024]
//                       (an empty list, e.g. --cpu_ms "", skips that table)
// GCC 12 AVX-512 headers warn about their own "undefined" vectors when inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/cpu_features.h"
#include "common/kernels/gemm.h"
#include "common/kernels/gemm_internal.h"
#include "common/kernels/thread_pool.h"
#include "common/omp_wait_policy.h"
#include "scripts/bench/on_threads.h"
#include "scripts/bench/peak_bf16.h"

namespace {

using Clock = std::chrono::steady_clock;
using vlm::kernels::Gemm;
using vlm::kernels::GemmOptions;
using vlm::kernels::GemmPath;
using vlm::kernels::PackedWeight;

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string LoadAverage() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

double ThreadCpuSeconds(const std::function<void()>& fn) {
  timespec a, b;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
  fn();
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
  return (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
}

double Seconds(const std::function<void()>& fn) {
  const auto t0 = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

using vlm::bench::OnThreads;

// --- peak micro-kernels ------------------------------------------------------
// VDPBF16PS: scripts/bench/peak_bf16.h.
using vlm::bench::Avx512Bf16Loop;
double PeakAvx512Bf16(int threads, int64_t iters = 20'000'000) {
  return vlm::bench::PeakAvx512Bf16(threads, iters);
}

struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
constexpr TileConfig MakeConfig() {
  TileConfig c{};
  c.palette_id = 1;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  return c;
}
alignas(64) static const TileConfig kTileConfig = MakeConfig();

// Four C tiles fed by two A and two B tiles loaded once: the TDPBF16PS rate.
__attribute__((target("amx-tile,amx-bf16"), noinline)) void AmxLoop(int64_t iters,
                                                                     const uint16_t* data) {
  _tile_loadconfig(&kTileConfig);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, data, 64);
  _tile_loadd(5, data, 64);
  _tile_loadd(6, data, 64);
  _tile_loadd(7, data, 64);
  for (int64_t it = 0; it < iters; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) static thread_local float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
}

double PeakAmx(int threads) {
  const int64_t iters = 5'000'000;
  alignas(64) static uint16_t data[16 * 32] = {};
  const double s = OnThreads(threads, [&](int) { AmxLoop(iters, data); });
  return static_cast<double>(iters) * 4 * 16 * 16 * 32 * 2 * threads / s / 1e9;
}

// --- the old block kernel (frozen copy, for the side-by-side columns) --------
namespace old {

using vlm::kernels::internal::kMicroRows;
using vlm::kernels::internal::kPanelCols;

#define OLD_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// R rows x P panels, x read in place (row stride ld_x); accumulate: continue
// the sums in out (a previous K block).
template <int R, int P>
OLD_TARGET inline void Micro(const uint16_t* x, int64_t ld_x, int64_t k, const uint16_t* panel,
                            int64_t panel_stride, float* out, bool accumulate) {
  __m512 acc[P][2][R];
#pragma GCC unroll 8
  for (int q = 0; q < P; ++q)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if (accumulate) {
        acc[q][0][r] = _mm512_load_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols);
        acc[q][1][r] = _mm512_load_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols + 16);
      } else {
        acc[q][0][r] = acc[q][1][r] = _mm512_setzero_ps();
      }
    }
  const int64_t pairs = k / 2;
  const uint16_t* b = panel;
  for (int64_t p = 0; p < pairs; ++p, b += 2 * kPanelCols) {
    __m512bh bv[P][2];
#pragma GCC unroll 8
    for (int q = 0; q < P; ++q) {
      bv[q][0] = (__m512bh)_mm512_load_si512(b + q * panel_stride);
      bv[q][1] = (__m512bh)_mm512_load_si512(b + q * panel_stride + kPanelCols);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t v;
      std::memcpy(&v, x + r * ld_x + 2 * p, sizeof v);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(v);
#pragma GCC unroll 8
      for (int q = 0; q < P; ++q) {
        acc[q][0][r] = _mm512_dpbf16_ps(acc[q][0][r], a, bv[q][0]);
        acc[q][1][r] = _mm512_dpbf16_ps(acc[q][1][r], a, bv[q][1]);
      }
    }
  }
  if (k & 1) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(x[r * ld_x + k - 1]);
#pragma GCC unroll 8
      for (int q = 0; q < P; ++q) {
        acc[q][0][r] = _mm512_dpbf16_ps(acc[q][0][r], a,
                                        (__m512bh)_mm512_load_si512(b + q * panel_stride));
        acc[q][1][r] = _mm512_dpbf16_ps(
            acc[q][1][r], a, (__m512bh)_mm512_load_si512(b + q * panel_stride + kPanelCols));
      }
    }
  }
#pragma GCC unroll 8
  for (int q = 0; q < P; ++q)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols, acc[q][0][r]);
      _mm512_store_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols + 16, acc[q][1][r]);
    }
}

constexpr int PanelsFor(int rows) { return rows == 1 ? 6 : rows == 2 ? 3 : rows <= 5 ? 2 : 1; }

template <int R, int P = PanelsFor(R)>
OLD_TARGET void MicroRows(const uint16_t* x, int64_t ld_x, int64_t k, const uint16_t* panel,
                         int64_t panel_stride, int panels, float* out, bool accumulate) {
  if constexpr (P > 1) {
    if (panels < P) {
      return MicroRows<R, P - 1>(x, ld_x, k, panel, panel_stride, panels, out, accumulate);
    }
  }
  Micro<R, P>(x, ld_x, k, panel, panel_stride, out, accumulate);
}

template <int R>
OLD_TARGET void Dispatch(const uint16_t* x, int64_t ld_x, int rows, int64_t k,
                        const uint16_t* panel, int64_t stride, int panels, float* acc,
                        bool accumulate = false) {
  if constexpr (R > 1) {
    if (rows < R) return Dispatch<R - 1>(x, ld_x, rows, k, panel, stride, panels, acc, accumulate);
  }
  MicroRows<R>(x, ld_x, k, panel, stride, panels, acc, accumulate);
}

// MicroPacked: Micro on a copied x slice (row stride kXStride, even length);
// kPrefetch also pulls the next panel slice into L2, two lines per pair.
constexpr int64_t kKBlock = 256;
constexpr int64_t kXStride = kKBlock + 32;

template <int R, int P, bool kPrefetch = false>
OLD_TARGET inline void MicroPacked(const uint16_t* x, int64_t k, const uint16_t* panel,
                                  int64_t panel_stride, float* out, bool accumulate,
                                  const uint16_t* prefetch = nullptr) {
  __m512 acc[P][2][R];
#pragma GCC unroll 8
  for (int q = 0; q < P; ++q)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if (accumulate) {
        acc[q][0][r] = _mm512_load_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols);
        acc[q][1][r] = _mm512_load_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols + 16);
      } else {
        acc[q][0][r] = acc[q][1][r] = _mm512_setzero_ps();
      }
    }
  const int64_t pairs = (k + 1) / 2;
  const uint16_t* b = panel;
  for (int64_t p = 0; p < pairs; ++p, b += 2 * kPanelCols) {
    if constexpr (kPrefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * 2 * kPanelCols), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * 2 * kPanelCols + kPanelCols),
                   _MM_HINT_T1);
    }
    __m512bh bv[P][2];
#pragma GCC unroll 8
    for (int q = 0; q < P; ++q) {
      bv[q][0] = (__m512bh)_mm512_load_si512(b + q * panel_stride);
      bv[q][1] = (__m512bh)_mm512_load_si512(b + q * panel_stride + kPanelCols);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t v;
      std::memcpy(&v, x + r * kXStride + 2 * p, sizeof v);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(v);
#pragma GCC unroll 8
      for (int q = 0; q < P; ++q) {
        acc[q][0][r] = _mm512_dpbf16_ps(acc[q][0][r], a, bv[q][0]);
        acc[q][1][r] = _mm512_dpbf16_ps(acc[q][1][r], a, bv[q][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int q = 0; q < P; ++q)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols, acc[q][0][r]);
      _mm512_store_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols + 16, acc[q][1][r]);
    }
}

// The previous Avx512Bf16Block: K in blocks of 256, x slices copied per block
// at a 576-byte row stride, panel slices reused from L1 across row tiles,
// fewer than 12 rows walk each panel over the whole K.
OLD_TARGET void Block(const vlm::kernels::internal::Problem& p, int64_t m0, int64_t m1, int64_t j0,
                     int64_t j1) {
  const int64_t stride = p.w.kpairs * 2 * kPanelCols;
  const int64_t k = p.w.k;
  const int64_t panels = j1 - j0;
  const int64_t full_tiles = (m1 - m0) / kMicroRows;
  const int tail_rows = static_cast<int>((m1 - m0) % kMicroRows);
  constexpr int64_t kTile = kMicroRows * kPanelCols;
  thread_local std::vector<uint16_t> x_buf;
  thread_local std::vector<float> sums_buf;
  const int64_t ld_tail = (k + 31) / 32 * 32 + 32;
  x_buf.resize(static_cast<size_t>(std::max((m1 - m0) * kXStride, tail_rows * ld_tail) + 32));
  uint16_t* xs = reinterpret_cast<uint16_t*>(
      (reinterpret_cast<uintptr_t>(x_buf.data()) + 63) & ~uintptr_t{63});
  if (full_tiles > 0) {
    const int64_t tiles = full_tiles + (tail_rows > 0 ? 1 : 0);
    sums_buf.resize(static_cast<size_t>((tiles * panels + 6) * kTile + 16));
    float* sums = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(sums_buf.data()) + 63) & ~uintptr_t{63});
    const int group = tail_rows > 0 ? PanelsFor(tail_rows) : 1;
    for (int64_t k0 = 0; k0 < k; k0 += kKBlock) {
      const int64_t kc = k - k0 < kKBlock ? k - k0 : kKBlock;
      const bool accumulate = k0 > 0;
      for (int64_t r = 0; r < m1 - m0; ++r) {
        uint16_t* dst = xs + r * kXStride;
        std::memcpy(dst, p.x + (m0 + r) * p.ld_x + k0, kc * sizeof(uint16_t));
        if (kc & 1) dst[kc] = 0;
      }
      for (int64_t j = j0; j < j1; ++j) {
        const uint16_t* w = p.w.panel(j) + k0 * kPanelCols;
        const uint16_t* next =
            j + 1 < j1 ? w + stride : p.w.panel(j0) + (k0 + kKBlock) * kPanelCols;
        const bool prefetch = j + 1 < j1 || k0 + kKBlock < k;
        for (int64_t t = 0; t < full_tiles; ++t) {
          float* out = sums + (t * panels + (j - j0)) * kTile;
          if (t == 0 && prefetch) {
            MicroPacked<kMicroRows, 1, true>(xs, kc, w, stride, out, accumulate, next);
          } else {
            MicroPacked<kMicroRows, 1>(xs + t * kMicroRows * kXStride, kc, w, stride, out,
                                       accumulate);
          }
        }
      }
      if (tail_rows > 0) {
        for (int64_t j = j0; j < j1; j += group) {
          const int n = static_cast<int>(j1 - j < group ? j1 - j : group);
          Dispatch<kMicroRows>(xs + full_tiles * kMicroRows * kXStride, kXStride, tail_rows, kc,
                               p.w.panel(j) + k0 * kPanelCols, stride, n,
                               sums + (full_tiles * panels + (j - j0)) * kTile, accumulate);
        }
      }
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const int rows = t < full_tiles ? kMicroRows : tail_rows;
      for (int64_t j = j0; j < j1; ++j) {
        vlm::kernels::internal::StoreTile(p.epilogue, m0 + t * kMicroRows, rows, j,
                                          sums + (t * panels + (j - j0)) * kTile);
      }
    }
  } else {
    for (int r = 0; r < tail_rows; ++r) {
      std::memcpy(xs + r * ld_tail, p.x + (m0 + r) * p.ld_x, k * sizeof(uint16_t));
    }
    const int group = PanelsFor(tail_rows);
    alignas(64) float acc[6 * kTile];
    for (int64_t j = j0; j < j1; j += group) {
      const int n = static_cast<int>(j1 - j < group ? j1 - j : group);
      Dispatch<kMicroRows>(xs, ld_tail, tail_rows, k, p.w.panel(j), stride, n, acc);
      for (int q = 0; q < n; ++q) {
        vlm::kernels::internal::StoreTile(p.epilogue, m0, tail_rows, j + q, acc + q * kTile);
      }
    }
  }
  _mm256_zeroupper();
}

// The previous work split: 96-row blocks x chunks of 8 panels.
struct Weight {
  std::vector<uint16_t, std::allocator<uint16_t>> storage;
  vlm::kernels::internal::Panels panels;
};

Weight Pack(const at::Tensor& w_bf16) {
  const int64_t n = w_bf16.size(0), k = w_bf16.size(1);
  Weight w;
  w.panels.k = k;
  w.panels.kpairs = (k + 31) / 32 * 16;
  w.panels.count = (n + kPanelCols - 1) / kPanelCols;
  w.storage.resize(w.panels.count * w.panels.kpairs * 2 * kPanelCols + 32);
  uint16_t* data = reinterpret_cast<uint16_t*>(
      (reinterpret_cast<uintptr_t>(w.storage.data()) + 63) & ~uintptr_t{63});
  const at::Tensor c = w_bf16.contiguous();
  vlm::kernels::internal::PackPanels(reinterpret_cast<const uint16_t*>(c.data_ptr()), k, nullptr,
                                     0, n, k, false, data, w.panels.kpairs, w.panels.count);
  w.panels.data = data;
  return w;
}

void Run(const at::Tensor& x, const Weight& w, at::Tensor& y, int threads) {
  const int64_t m = x.size(0), n = y.size(1);
  vlm::kernels::internal::Problem p;
  p.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  p.ld_x = x.stride(0);
  p.w = w.panels;
  p.epilogue.y = y.data_ptr();
  p.epilogue.y_bf16 = true;
  p.epilogue.ld_y = y.stride(0);
  p.epilogue.n = n;
  const int64_t chunk = 8;
  const int64_t chunks = (w.panels.count + chunk - 1) / chunk;
  const int64_t row_blocks = (m + 95) / 96;
  vlm::kernels::ParallelFor(chunks * row_blocks, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / chunks, c = t % chunks;
      Block(p, b * 96, std::min(m, (b + 1) * 96), c * chunk,
            std::min(w.panels.count, (c + 1) * chunk));
    }
  });
}

}  // namespace old

// --- implementations ---------------------------------------------------------
struct Problem {
  at::Tensor x, w;       // bf16 [M, K], [N, K]
  PackedWeight packed;   // avx512bf16 layout (amx reads the same)
  old::Weight old;        // the same panels, for the old kernel
  at::Tensor y;          // bf16 [M, N]
};

Problem MakeProblem(int64_t n, int64_t k) {
  Problem p;
  p.w = at::randn({n, k}).mul_(0.05).to(at::kBFloat16);
  absl::StatusOr<PackedWeight> packed = PackedWeight::Pack(p.w, {}, GemmPath::kAvx512Bf16);
  if (!packed.ok()) std::abort();
  p.packed = *packed;
  p.old = old::Pack(p.w);
  return p;
}

void RunKernel(Problem& p, int threads, std::optional<GemmPath> path) {
  GemmOptions o;
  o.threads = threads;
  o.path = path;
  if (!Gemm(p.x, p.packed, &p.y, o).ok()) std::abort();
}

void RunOld(Problem& p, int threads) { old::Run(p.x, p.old, p.y, threads); }

void RunTorch(Problem& p) { at::linear_out(p.y, p.x, p.w); }

int ArgInt(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  }
  return fallback;
}

// A comma-separated list of integers ("256,1024"), or `fallback` when absent.
std::vector<int64_t> ArgList(int argc, char** argv, const char* name,
                             std::vector<int64_t> fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) != 0) continue;
    std::vector<int64_t> v;
    for (const char* s = argv[i + 1]; *s != '\0';) {
      char* end = nullptr;
      const long long x = std::strtoll(s, &end, 10);
      if (end == s) break;
      v.push_back(x);
      s = *end == ',' ? end + 1 : end;
    }
    return v;
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  vlm::EnsureOmpWaitPolicy(argv);  // at::linear as the services run it: see omp_wait_policy.h
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // tables appear as rows finish
  const int threads = ArgInt(argc, argv, "--threads", 2);
  const int reps = std::max(1, ArgInt(argc, argv, "--reps", 3));
  const int cliff_max = ArgInt(argc, argv, "--cliff_max", 1024);
  // First M of the cliff table (M = cliff_min - 1 is timed too, for the first step).
  const int cliff_min = std::max(1, ArgInt(argc, argv, "--cliff_min", 1));
  const int cliff_reps = std::max(1, ArgInt(argc, argv, "--cliff_reps", 3));
  const bool wall_tables = ArgInt(argc, argv, "--wall", 1) != 0;
  const std::vector<int64_t> wall_ms =
      ArgList(argc, argv, "--ms", {64, 128, 256, 512, 1024, 2048});
  const std::vector<int64_t> small_ms = ArgList(argc, argv, "--small_ms", {1, 4, 8, 16});
  const std::vector<int64_t> cpu_ms =
      ArgList(argc, argv, "--cpu_ms", {1, 4, 8, 16, 256, 1024});
  const std::vector<int64_t> shape_ids = ArgList(argc, argv, "--shapes", {0, 1, 2, 3});
  at::set_num_threads(threads);
  at::manual_seed(7);

  const vlm::CpuFeatures& cpu = vlm::GetCpuFeatures();
  std::string amx_missing;
  const bool have_kernel = vlm::kernels::GemmPathSupported(GemmPath::kAvx512Bf16);
  const bool have_amx = vlm::kernels::GemmPathSupported(GemmPath::kAmx, &amx_missing);
  const bool have_avx2 = vlm::kernels::GemmPathSupported(GemmPath::kAvx2);
  std::printf("vlm-bench-gemm: %d threads, OMP_WAIT_POLICY=%s, cpu: %s\n", threads,
              vlm::OmpWaitPolicy().c_str(), cpu.Describe().c_str());
  std::printf("load average at start: %s; default gemm path: %s\n", LoadAverage().c_str(),
              vlm::kernels::GemmPathName(vlm::kernels::DefaultGemmPath()));
  if (!have_kernel) {
    std::printf("this CPU has no AVX-512 BF16: the project kernel cannot run; nothing to compare\n");
    return 0;
  }

  // --- peak ---
  std::vector<double> peaks, p1;
  for (int r = 0; r < 3; ++r) peaks.push_back(PeakAvx512Bf16(threads));
  const double peak = Median(peaks);
  for (int r = 0; r < 3; ++r) {
    p1.push_back(static_cast<double>(20'000'000) * 24 * 64 /
                 ThreadCpuSeconds([] { Avx512Bf16Loop(20'000'000); }) / 1e9);
  }
  const double peak1 = Median(p1);
  std::printf("\n## Peak (register-only micro-kernel, median of 3)\n\n");
  std::printf("| micro-kernel | GFLOP/s |\n|---|---|\n");
  std::printf("| AVX-512 BF16 VDPBF16PS, 24 accumulators, %d threads (wall) | %.0f |\n", threads,
              peak);
  std::printf("| the same, 1 thread (per CPU-second of the thread) | %.0f |\n", peak1);
  double amx_peak = 0;
  if (have_amx) {
    std::vector<double> a;
    for (int r = 0; r < 3; ++r) a.push_back(PeakAmx(threads));
    amx_peak = Median(a);
    std::printf("| AMX TDPBF16PS, 4 accumulator tiles, %d threads | %.0f |\n", threads, amx_peak);
  } else {
    std::printf("| AMX TDPBF16PS | not run: %s |\n", amx_missing.c_str());
  }

  // --- shapes ---
  struct Shape {
    const char* name;
    int64_t k, n;
  };
  const Shape all_shapes[] = {{"ViT fc1 1024->4096", 1024, 4096},
                          {"ViT fc2 4096->1024", 4096, 1024},
                          {"decoder gate/up 2048->6144", 2048, 6144},
                          {"decoder q/o 2048->2048", 2048, 2048}};
  std::vector<Shape> shapes;
  for (int64_t i : shape_ids) {
    if (i >= 0 && i < static_cast<int64_t>(std::size(all_shapes))) shapes.push_back(all_shapes[i]);
  }
  auto wall_table = [&](const char* title, const std::vector<int64_t>& ms) {
    // The peak loop runs once per repetition too, between the implementations,
    // so "% of peak" compares numbers taken under the same load.
    std::printf("\n## %s: GFLOP/s, bf16, %d threads, wall time (median of %d); peak: the "
                "VDPBF16PS loop sampled in the same repetitions%s\n\n", title, threads, reps,
                have_amx ? " (AMX rows: the AMX peak above)" : "");
    std::printf("| shape | M | kernel | old |%s%s at::linear | peak | kernel %% of peak | kernel / "
                "at::linear | kernel / old |\n", have_amx ? " amx |" : "",
                have_avx2 ? " avx2 | avx2 / kernel |" : "");
    std::printf("|---|---|---|---|%s%s---|---|---|---|---|\n", have_amx ? "---|" : "",
                have_avx2 ? "---|---|" : "");
    for (const Shape& s : shapes) {
      Problem p = MakeProblem(s.n, s.k);
      for (int64_t m : ms) {
        p.x = at::randn({m, s.k}).to(at::kBFloat16);
        p.y = at::empty({m, s.n}, at::kBFloat16);
        const double flop = 2.0 * m * s.n * s.k;
        // Short problems repeat inside one timing so each sample is ~1 ms or more.
        const int inner = static_cast<int>(std::clamp<double>(4e8 / flop, 1, 200));
        std::vector<double> tk, to, ta, t2, tt, pk;
        for (int r = 0; r <= reps; ++r) {  // r = 0 warms up
          const double e = PeakAvx512Bf16(threads, 4'000'000);
          // Each implementation runs once untimed right before its timing, so
          // each starts with its threads awake (the peak loop above lets the
          // kernels' pool go to sleep; a single ~1 ms GEMM would otherwise
          // carry the wake-up, and only the first one timed after the peak).
          auto timed = [&](const std::function<void()>& run) {
            run();
            return Seconds([&] {
              for (int i = 0; i < inner; ++i) run();
            });
          };
          const double a = timed([&] { RunKernel(p, threads, GemmPath::kAvx512Bf16); });
          const double b = timed([&] { RunOld(p, threads); });
          const double c = have_amx ? timed([&] { RunKernel(p, threads, GemmPath::kAmx); }) : 0;
          const double f = have_avx2 ? timed([&] { RunKernel(p, threads, GemmPath::kAvx2); }) : 0;
          const double d = timed([&] { RunTorch(p); });
          if (r == 0) continue;
          tk.push_back(a / inner), to.push_back(b / inner), ta.push_back(c / inner),
              t2.push_back(f / inner), tt.push_back(d / inner), pk.push_back(e);
        }
        const double gk = flop / Median(tk) / 1e9, go = flop / Median(to) / 1e9,
                     gt = flop / Median(tt) / 1e9;
        char amx_col[32] = "";
        if (have_amx) std::snprintf(amx_col, sizeof amx_col, " %.0f |", flop / Median(ta) / 1e9);
        char avx2_col[48] = "";
        if (have_avx2) {
          const double g2 = flop / Median(t2) / 1e9;
          std::snprintf(avx2_col, sizeof avx2_col, " %.0f | %.2fx |", g2, g2 / gk);
        }
        const double row_peak = Median(pk);
        std::printf("| %s | %lld | %.0f | %.0f |%s%s %.0f | %.0f | %.0f%% | %.2fx | %.2fx |\n",
                    s.name, static_cast<long long>(m), gk, go, amx_col, avx2_col, gt, row_peak,
                    100 * gk / row_peak, gk / gt, gk / go);
      }
    }
  };
  if (wall_tables) {
    if (!wall_ms.empty()) wall_table("Prefill and ViT sizes", wall_ms);
    if (!small_ms.empty()) wall_table("Short prefill chunks", small_ms);
  }

  // --- one thread, per CPU-second ---
  if (!cpu_ms.empty()) {
    at::set_num_threads(1);
    std::printf("\n## One thread, GFLOP per CPU-second of the thread (median of %d); 1-thread "
                "peak %.0f\n\n", reps, peak1);
    std::printf("| shape | M | kernel | old | at::linear | kernel %% of peak | kernel / at::linear "
                "| kernel / old |\n");
    std::printf("|---|---|---|---|---|---|---|---|\n");
    for (const Shape& s : shapes) {
      Problem p = MakeProblem(s.n, s.k);
      for (int64_t m : cpu_ms) {
        p.x = at::randn({m, s.k}).to(at::kBFloat16);
        p.y = at::empty({m, s.n}, at::kBFloat16);
        const double flop = 2.0 * m * s.n * s.k;
        const int inner = static_cast<int>(std::clamp<double>(4e8 / flop, 1, 200));
        std::vector<double> tk, to, tt;
        for (int r = 0; r <= reps; ++r) {
          const double a = ThreadCpuSeconds([&] {
            for (int i = 0; i < inner; ++i) RunKernel(p, 1, GemmPath::kAvx512Bf16);
          });
          const double b = ThreadCpuSeconds([&] {
            for (int i = 0; i < inner; ++i) RunOld(p, 1);
          });
          const double c = ThreadCpuSeconds([&] {
            for (int i = 0; i < inner; ++i) RunTorch(p);
          });
          if (r > 0) tk.push_back(a / inner), to.push_back(b / inner), tt.push_back(c / inner);
        }
        const double gk = flop / Median(tk) / 1e9, go = flop / Median(to) / 1e9,
                     gt = flop / Median(tt) / 1e9;
        std::printf("| %s | %lld | %.0f | %.0f | %.0f | %.0f%% | %.2fx | %.2fx |\n", s.name,
                    static_cast<long long>(m), gk, go, gt, 100 * gk / peak1, gk / gt, gk / go);
      }
    }
    at::set_num_threads(threads);
  }

  // --- cliffs ---
  if (cliff_max > 0) {
    const int64_t k = 2048, n = 6144;
    Problem p = MakeProblem(n, k);
    const at::Tensor x_all = at::randn({cliff_max, k}).to(at::kBFloat16);
    const at::Tensor y_all = at::empty({cliff_max, n}, at::kBFloat16);
    std::vector<std::vector<double>> tk(cliff_max + 1), tt(cliff_max + 1);
    at::set_num_threads(1);
    for (int r = 0; r < cliff_reps; ++r) {
      for (int64_t m = std::max(1, cliff_min - 1); m <= cliff_max; ++m) {
        p.x = x_all.narrow(0, 0, m);
        p.y = y_all.narrow(0, 0, m);
        tk[m].push_back(ThreadCpuSeconds([&] { RunKernel(p, 1, std::nullopt); }));
        tt[m].push_back(ThreadCpuSeconds([&] { RunTorch(p); }));
      }
    }
    std::vector<double> rk(cliff_max + 1), rt(cliff_max + 1);  // µs per row
    for (int64_t m = std::max(1, cliff_min - 1); m <= cliff_max; ++m) {
      rk[m] = Median(tk[m]) * 1e6 / m;
      rt[m] = Median(tt[m]) * 1e6 / m;
    }
    std::printf("\n## No cliffs: 2048->6144, every M in %d..%d, one thread, time per row (µs of "
                "thread CPU time, median of %d), default path %s vs at::linear\n",
                cliff_min, cliff_max, cliff_reps, vlm::kernels::GemmPathName(vlm::kernels::DefaultGemmPath()));
    std::printf("A cliff: the time per row rises by more than 1.3x from M-1 to M.\n\n");
    std::printf("| M range | kernel µs/row min..max | kernel worst rise | kernel cliffs | at::linear µs/row min..max | at::linear worst rise | at::linear cliffs |\n");
    std::printf("|---|---|---|---|---|---|---|\n");
    std::vector<int64_t> flagged_k, flagged_t;
    double worst_k = 0, worst_t = 0;
    for (int64_t lo = cliff_min; lo <= cliff_max; lo += 64) {
      const int64_t hi = std::min<int64_t>(cliff_max, lo + 63);
      double kmin = 1e30, kmax = 0, tmin = 1e30, tmax = 0, kr = 0, trr = 0;
      int kc = 0, tc = 0;
      for (int64_t m = lo; m <= hi; ++m) {
        kmin = std::min(kmin, rk[m]), kmax = std::max(kmax, rk[m]);
        tmin = std::min(tmin, rt[m]), tmax = std::max(tmax, rt[m]);
        if (m > 1 && m - 1 >= std::max(1, cliff_min - 1)) {
          const double a = rk[m] / rk[m - 1], b = rt[m] / rt[m - 1];
          kr = std::max(kr, a), trr = std::max(trr, b);
          if (a > 1.3) ++kc, flagged_k.push_back(m);
          if (b > 1.3) ++tc, flagged_t.push_back(m);
        }
      }
      worst_k = std::max(worst_k, kr), worst_t = std::max(worst_t, trr);
      std::printf("| %lld..%lld | %.1f..%.1f | %.2fx | %d | %.1f..%.1f | %.2fx | %d |\n",
                  static_cast<long long>(lo), static_cast<long long>(hi), kmin, kmax, kr, kc, tmin,
                  tmax, trr, tc);
    }
    auto list = [](const std::vector<int64_t>& v) {
      std::string s;
      for (size_t i = 0; i < v.size() && i < 40; ++i) s += (i ? " " : "") + std::to_string(v[i]);
      if (v.size() > 40) s += " ...";
      return s.empty() ? std::string("none") : s;
    };
    std::printf("\nworst rise: kernel %.2fx, at::linear %.2fx\n", worst_k, worst_t);
    std::printf("kernel cliffs at M: %s\n", list(flagged_k).c_str());
    std::printf("at::linear cliffs at M: %s\n", list(flagged_t).c_str());
  }
  std::printf("\nload average at end: %s\n", LoadAverage().c_str());
  return 0;
}
