// vlm-bench-gemm: the project's bf16 GEMM (common/kernels/gemm.h) against
// LibTorch's bf16 at::linear on the Qwen3-VL-2B shapes, next to the machine's
// peak measured in the same run by a register-only micro-kernel (AVX-512 BF16
// VDPBF16PS loop; AMX TDPBF16PS tile loop where the CPU has AMX).
//
// Tables (medians over --reps; implementations interleaved per repetition so
// load from other processes hits them alike):
//   1. GFLOP/s per shape and M: kernel (project pool), kernel with the rows
//      split by OpenMP instead (at::parallel_for, one Gemm per thread), amx
//      (where present), at::linear; the kernel's share of the peak and its
//      ratio to at::linear.
//   2. One thread, GFLOP per second of the thread's own CPU time
//      (CLOCK_THREAD_CPUTIME_ID): time the thread was descheduled does not
//      count, so this table stays meaningful on a machine shared with other
//      work; kernel and at::linear (1 intra-op thread) against the 1-thread peak.
//   3. "No cliffs": every M in 1..--cliff_max on 2048->6144, time per row on
//      one thread in thread CPU time (the shape's tiling decides cliffs, and
//      thread CPU time keeps other processes' load out of the comparison);
//      a cliff is a step M-1 -> M where the time per row rises by more than
//      1.3x. Summarised per 64 rows; flagged M listed.
//
// Usage: vlm-bench-gemm [--threads 2] [--reps 5] [--cliff_max 1024] [--cliff_reps 3]
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
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/cpu_features.h"
#include "common/kernels/gemm.h"

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

// Runs fn(thread) on `threads` threads started together; wall seconds.
double OnThreads(int threads, const std::function<void(int)>& fn) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load()) {
      }
      fn(t);
    });
  }
  while (ready.load() < threads - 1) std::this_thread::yield();
  const auto t0 = Clock::now();
  go.store(true);
  fn(0);
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// --- peak micro-kernels ------------------------------------------------------
// 24 independent accumulators, operands in registers: the VDPBF16PS issue rate.
__attribute__((target("avx512f,avx512bf16"), noinline)) float Avx512Bf16Loop(int64_t iters) {
  __m512 acc[24];
#pragma GCC unroll 24
  for (int i = 0; i < 24; ++i) acc[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80), b = (__m512bh)_mm512_set1_epi32(0x00010001);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  __m512 s = acc[0];
#pragma GCC unroll 24
  for (int i = 1; i < 24; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

double PeakAvx512Bf16(int threads) {
  const int64_t iters = 20'000'000;
  std::vector<float> sink(threads);
  const double s = OnThreads(threads, [&](int t) { sink[t] = Avx512Bf16Loop(iters); });
  return static_cast<double>(iters) * 24 * 16 * 4 * threads / s / 1e9;  // 16 lanes x 2 MACs
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

// --- implementations ---------------------------------------------------------
struct Problem {
  at::Tensor x, w;       // bf16 [M, K], [N, K]
  PackedWeight packed;   // avx512bf16 layout (amx reads the same)
  at::Tensor y;          // bf16 [M, N]
};

void RunKernel(Problem& p, int threads, std::optional<GemmPath> path) {
  GemmOptions o;
  o.threads = threads;
  o.path = path;
  if (!Gemm(p.x, p.packed, &p.y, o).ok()) std::abort();
}

// The same kernel with M split over OpenMP threads (one single-threaded Gemm each).
void RunKernelOpenMp(Problem& p, int threads) {
  const int64_t m = p.x.size(0);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t lo = m * t / threads, hi = m * (t + 1) / threads;
      if (lo == hi) continue;
      at::Tensor y = p.y.narrow(0, lo, hi - lo);
      GemmOptions o;
      o.threads = 1;
      if (!Gemm(p.x.narrow(0, lo, hi - lo), p.packed, &y, o).ok()) std::abort();
    }
  });
}

void RunTorch(Problem& p) { at::linear_out(p.y, p.x, p.w); }

int ArgInt(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // tables appear as rows finish
  const int threads = ArgInt(argc, argv, "--threads", 2);
  const int reps = std::max(1, ArgInt(argc, argv, "--reps", 5));
  const int cliff_max = ArgInt(argc, argv, "--cliff_max", 1024);
  const int cliff_reps = std::max(1, ArgInt(argc, argv, "--cliff_reps", 3));
  at::set_num_threads(threads);
  at::manual_seed(7);

  const vlm::CpuFeatures& cpu = vlm::GetCpuFeatures();
  std::string amx_missing;
  const bool have_kernel = vlm::kernels::GemmPathSupported(GemmPath::kAvx512Bf16);
  const bool have_amx = vlm::kernels::GemmPathSupported(GemmPath::kAmx, &amx_missing);
  std::printf("vlm-bench-gemm: %d threads, cpu: %s\n", threads, cpu.Describe().c_str());
  std::printf("load average at start: %s; default gemm path: %s\n", LoadAverage().c_str(),
              vlm::kernels::GemmPathName(vlm::kernels::DefaultGemmPath()));
  if (!have_kernel) {
    std::printf("this CPU has no AVX-512 BF16: the project kernel cannot run; nothing to compare\n");
    return 0;
  }

  // --- peak ---
  double peak = 0;
  std::vector<double> peaks;
  for (int r = 0; r < 3; ++r) peaks.push_back(PeakAvx512Bf16(threads));
  peak = Median(peaks);
  std::printf("\n## Peak (register-only micro-kernel, %d threads, median of 3)\n\n", threads);
  std::printf("| micro-kernel | GFLOP/s |\n|---|---|\n");
  std::printf("| AVX-512 BF16 VDPBF16PS, 24 accumulators | %.0f |\n", peak);
  double amx_peak = 0;
  if (have_amx) {
    std::vector<double> a;
    for (int r = 0; r < 3; ++r) a.push_back(PeakAmx(threads));
    amx_peak = Median(a);
    std::printf("| AMX TDPBF16PS, 4 accumulator tiles | %.0f |\n", amx_peak);
  } else {
    std::printf("| AMX TDPBF16PS | not run: %s |\n", amx_missing.c_str());
  }
  const double bound = std::max(peak, amx_peak);

  // --- shapes ---
  struct Shape {
    const char* name;
    int64_t k, n;
  };
  const Shape shapes[] = {{"ViT fc1 1024->4096", 1024, 4096},
                          {"ViT fc2 4096->1024", 4096, 1024},
                          {"decoder gate/up 2048->6144", 2048, 6144},
                          {"decoder q/o 2048->2048", 2048, 2048}};
  const int64_t ms[] = {64, 128, 256, 512, 1024, 2048};
  std::printf("\n## GFLOP/s, bf16, %d threads (median of %d); peak = %.0f GFLOP/s\n\n", threads,
              reps, bound);
  std::printf("| shape | M | kernel (pool) | kernel (OpenMP rows) |%s at::linear | kernel %% of peak | kernel / at::linear |\n",
              have_amx ? " amx |" : "");
  std::printf("|---|---|---|---|%s---|---|---|\n", have_amx ? "---|" : "");
  for (const Shape& s : shapes) {
    Problem p;
    p.w = at::randn({s.n, s.k}).mul_(0.05).to(at::kBFloat16);
    absl::StatusOr<PackedWeight> packed = PackedWeight::Pack(p.w, {}, GemmPath::kAvx512Bf16);
    if (!packed.ok()) std::abort();
    p.packed = *packed;
    for (int64_t m : ms) {
      p.x = at::randn({m, s.k}).to(at::kBFloat16);
      p.y = at::empty({m, s.n}, at::kBFloat16);
      const double flop = 2.0 * m * s.n * s.k;
      std::vector<double> tk, to, ta, tt;
      for (int r = 0; r <= reps; ++r) {  // r = 0 warms up
        const double a = Seconds([&] { RunKernel(p, threads, GemmPath::kAvx512Bf16); });
        const double b = Seconds([&] { RunKernelOpenMp(p, threads); });
        const double c = have_amx ? Seconds([&] { RunKernel(p, threads, GemmPath::kAmx); }) : 0;
        const double d = Seconds([&] { RunTorch(p); });
        if (r == 0) continue;
        tk.push_back(a), to.push_back(b), ta.push_back(c), tt.push_back(d);
      }
      const double gk = flop / Median(tk) / 1e9, go = flop / Median(to) / 1e9,
                   gt = flop / Median(tt) / 1e9;
      char amx_col[32] = "";
      if (have_amx) std::snprintf(amx_col, sizeof amx_col, " %.0f |", flop / Median(ta) / 1e9);
      std::printf("| %s | %lld | %.0f | %.0f |%s %.0f | %.0f%% | %.2fx |\n", s.name,
                  static_cast<long long>(m), gk, go, amx_col, gt, 100 * gk / bound, gk / gt);
      std::fflush(stdout);
    }
  }

  // --- one thread, per CPU-second ---
  {
    at::set_num_threads(1);
    std::vector<double> p1;
    for (int r = 0; r < 3; ++r) {
      p1.push_back(static_cast<double>(20'000'000) * 24 * 64 /
                   ThreadCpuSeconds([] { Avx512Bf16Loop(20'000'000); }) / 1e9);
    }
    const double peak1 = Median(p1);
    std::printf("\n## One thread, GFLOP per CPU-second of the thread (median of %d); 1-thread peak "
                "%.0f\n\n", reps, peak1);
    std::printf("| shape | M | kernel | at::linear | kernel %% of peak | kernel / at::linear |\n");
    std::printf("|---|---|---|---|---|---|\n");
    for (const Shape& s : shapes) {
      Problem p;
      p.w = at::randn({s.n, s.k}).mul_(0.05).to(at::kBFloat16);
      p.packed = *PackedWeight::Pack(p.w, {}, GemmPath::kAvx512Bf16);
      for (int64_t m : {int64_t{256}, int64_t{1024}}) {
        p.x = at::randn({m, s.k}).to(at::kBFloat16);
        p.y = at::empty({m, s.n}, at::kBFloat16);
        const double flop = 2.0 * m * s.n * s.k;
        std::vector<double> tk, tt;
        for (int r = 0; r <= reps; ++r) {
          const double a = ThreadCpuSeconds([&] { RunKernel(p, 1, GemmPath::kAvx512Bf16); });
          const double b = ThreadCpuSeconds([&] { RunTorch(p); });
          if (r > 0) tk.push_back(a), tt.push_back(b);
        }
        const double gk = flop / Median(tk) / 1e9, gt = flop / Median(tt) / 1e9;
        std::printf("| %s | %lld | %.0f | %.0f | %.0f%% | %.2fx |\n", s.name,
                    static_cast<long long>(m), gk, gt, 100 * gk / peak1, gk / gt);
        std::fflush(stdout);
      }
    }
    at::set_num_threads(threads);
  }

  // --- cliffs ---
  if (cliff_max > 0) {
    const int64_t k = 2048, n = 6144;
    Problem p;
    p.w = at::randn({n, k}).mul_(0.05).to(at::kBFloat16);
    p.packed = *PackedWeight::Pack(p.w, {}, GemmPath::kAvx512Bf16);
    const at::Tensor x_all = at::randn({cliff_max, k}).to(at::kBFloat16);
    const at::Tensor y_all = at::empty({cliff_max, n}, at::kBFloat16);
    std::vector<std::vector<double>> tk(cliff_max + 1), tt(cliff_max + 1);
    at::set_num_threads(1);
    for (int r = 0; r < cliff_reps; ++r) {
      for (int64_t m = 1; m <= cliff_max; ++m) {
        p.x = x_all.narrow(0, 0, m);
        p.y = y_all.narrow(0, 0, m);
        tk[m].push_back(ThreadCpuSeconds([&] { RunKernel(p, 1, std::nullopt); }));
        tt[m].push_back(ThreadCpuSeconds([&] { RunTorch(p); }));
      }
    }
    std::vector<double> rk(cliff_max + 1), rt(cliff_max + 1);  // µs per row
    for (int64_t m = 1; m <= cliff_max; ++m) {
      rk[m] = Median(tk[m]) * 1e6 / m;
      rt[m] = Median(tt[m]) * 1e6 / m;
    }
    std::printf("\n## No cliffs: 2048->6144, every M in 1..%d, one thread, time per row (µs of "
                "thread CPU time, median of %d), default path %s vs at::linear\n",
                cliff_max, cliff_reps, vlm::kernels::GemmPathName(vlm::kernels::DefaultGemmPath()));
    std::printf("A cliff: the time per row rises by more than 1.3x from M-1 to M.\n\n");
    std::printf("| M range | kernel µs/row min..max | kernel worst rise | kernel cliffs | at::linear µs/row min..max | at::linear worst rise | at::linear cliffs |\n");
    std::printf("|---|---|---|---|---|---|---|\n");
    std::vector<int64_t> flagged_k, flagged_t;
    double worst_k = 0, worst_t = 0;
    for (int64_t lo = 1; lo <= cliff_max; lo += 64) {
      const int64_t hi = std::min<int64_t>(cliff_max, lo + 63);
      double kmin = 1e30, kmax = 0, tmin = 1e30, tmax = 0, kr = 0, trr = 0;
      int kc = 0, tc = 0;
      for (int64_t m = lo; m <= hi; ++m) {
        kmin = std::min(kmin, rk[m]), kmax = std::max(kmax, rk[m]);
        tmin = std::min(tmin, rt[m]), tmax = std::max(tmax, rt[m]);
        if (m > 1) {
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
