// vlm-bench-gemm: the project's bf16 GEMM (common/kernels/gemm.h) against
// LibTorch's bf16 at::linear on the Qwen3-VL-2B shapes, next to the machine's
// peak measured in the same run by a register-only micro-kernel (AVX-512 BF16
// VDPBF16PS loop; AMX TDPBF16PS tile loop where the CPU has AMX).
//
// "kernel" is common/kernels' Gemm on the avx512bf16 path; its share of the
// measured peak is the bound it is judged by, at::linear the outside reference.
// (Comparing two versions of the kernel: scripts/bench/compare_commits.sh.)
//
// Tables (medians over --reps; implementations interleaved per repetition so
// load from other processes hits them alike):
//   1. GFLOP/s per shape and M = 64..2048 (wall time, --threads): kernel,
//      amx (where present), avx2 (the AVX2 + FMA path for CPUs without AVX-512,
//      on the same panels), at::linear; the kernel's share of the peak and its
//      ratio to at::linear.
//   2. The same for short prefill chunks, M = 1, 4, 8, 16.
//   3. One thread, GFLOP per second of the thread's own CPU time
//      (CLOCK_THREAD_CPUTIME_ID): time the thread was descheduled does not
//      count, so this table stays meaningful on a machine shared with other
//      work; kernel and at::linear (1 intra-op thread) against the
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
#include "common/kernels/thread_pool.h"
#include "common/omp_wait_policy.h"
#include "scripts/bench/bench_util.h"
#include "scripts/bench/on_threads.h"
#include "scripts/bench/peak_bf16.h"

namespace {

using Clock = std::chrono::steady_clock;
using vlm::kernels::Gemm;
using vlm::kernels::GemmOptions;
using vlm::kernels::GemmPath;
using vlm::kernels::PackedWeight;

using vlm::bench::ArgInt;
using vlm::bench::ArgList;
using vlm::bench::LoadAverage;
using vlm::bench::Median;
using vlm::bench::OnThreads;
using vlm::bench::Seconds;
using vlm::bench::ThreadCpuSeconds;

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

// --- implementations ---------------------------------------------------------
struct Problem {
  at::Tensor x, w;       // bf16 [M, K], [N, K]
  PackedWeight packed;   // avx512bf16 layout (amx and avx2 read the same)
  at::Tensor y;          // bf16 [M, N]
};

Problem MakeProblem(int64_t n, int64_t k) {
  Problem p;
  p.w = at::randn({n, k}).mul_(0.05).to(at::kBFloat16);
  absl::StatusOr<PackedWeight> packed = PackedWeight::Pack(p.w, {}, GemmPath::kAvx512Bf16);
  if (!packed.ok()) std::abort();
  p.packed = *packed;
  return p;
}

void RunKernel(Problem& p, int threads, std::optional<GemmPath> path) {
  GemmOptions o;
  o.threads = threads;
  o.path = path;
  if (!Gemm(p.x, p.packed, &p.y, o).ok()) std::abort();
}

void RunTorch(Problem& p) { at::linear_out(p.y, p.x, p.w); }

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
    std::printf("| shape | M | kernel |%s%s at::linear | peak | kernel %% of peak | kernel / "
                "at::linear |\n", have_amx ? " amx |" : "",
                have_avx2 ? " avx2 | avx2 / kernel |" : "");
    std::printf("|---|---|---|%s%s---|---|---|---|\n", have_amx ? "---|" : "",
                have_avx2 ? "---|---|" : "");
    for (const Shape& s : shapes) {
      Problem p = MakeProblem(s.n, s.k);
      for (int64_t m : ms) {
        p.x = at::randn({m, s.k}).to(at::kBFloat16);
        p.y = at::empty({m, s.n}, at::kBFloat16);
        const double flop = 2.0 * m * s.n * s.k;
        // Short problems repeat inside one timing so each sample is ~1 ms or more.
        const int inner = static_cast<int>(std::clamp<double>(4e8 / flop, 1, 200));
        std::vector<double> tk, ta, t2, tt, pk;
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
          const double c = have_amx ? timed([&] { RunKernel(p, threads, GemmPath::kAmx); }) : 0;
          const double f = have_avx2 ? timed([&] { RunKernel(p, threads, GemmPath::kAvx2); }) : 0;
          const double d = timed([&] { RunTorch(p); });
          if (r == 0) continue;
          tk.push_back(a / inner), ta.push_back(c / inner), t2.push_back(f / inner),
              tt.push_back(d / inner), pk.push_back(e);
        }
        const double gk = flop / Median(tk) / 1e9, gt = flop / Median(tt) / 1e9;
        char amx_col[32] = "";
        if (have_amx) std::snprintf(amx_col, sizeof amx_col, " %.0f |", flop / Median(ta) / 1e9);
        char avx2_col[48] = "";
        if (have_avx2) {
          const double g2 = flop / Median(t2) / 1e9;
          std::snprintf(avx2_col, sizeof avx2_col, " %.0f | %.2fx |", g2, g2 / gk);
        }
        const double row_peak = Median(pk);
        std::printf("| %s | %lld | %.0f |%s%s %.0f | %.0f | %.0f%% | %.2fx |\n", s.name,
                    static_cast<long long>(m), gk, amx_col, avx2_col, gt, row_peak,
                    100 * gk / row_peak, gk / gt);
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
    std::printf("| shape | M | kernel | at::linear | kernel %% of peak | kernel / at::linear |\n");
    std::printf("|---|---|---|---|---|---|\n");
    for (const Shape& s : shapes) {
      Problem p = MakeProblem(s.n, s.k);
      for (int64_t m : cpu_ms) {
        p.x = at::randn({m, s.k}).to(at::kBFloat16);
        p.y = at::empty({m, s.n}, at::kBFloat16);
        const double flop = 2.0 * m * s.n * s.k;
        const int inner = static_cast<int>(std::clamp<double>(4e8 / flop, 1, 200));
        std::vector<double> tk, tt;
        for (int r = 0; r <= reps; ++r) {
          const double a = ThreadCpuSeconds([&] {
            for (int i = 0; i < inner; ++i) RunKernel(p, 1, GemmPath::kAvx512Bf16);
          });
          const double c = ThreadCpuSeconds([&] {
            for (int i = 0; i < inner; ++i) RunTorch(p);
          });
          if (r > 0) tk.push_back(a / inner), tt.push_back(c / inner);
        }
        const double gk = flop / Median(tk) / 1e9, gt = flop / Median(tt) / 1e9;
        std::printf("| %s | %lld | %.0f | %.0f | %.0f%% | %.2fx |\n", s.name,
                    static_cast<long long>(m), gk, gt, 100 * gk / peak1, gk / gt);
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
