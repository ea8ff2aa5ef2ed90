// vlm-bench-gemm-f32: the row-invariant f32 product (common/kernels/gemm_f32.h,
// what RowLinear runs in f32) against the previous f32 RowLinear (at::linear
// through OpenBLAS, padded to RowLinearMinRows rows) on the Qwen3-VL-2B
// decoder's projection shapes, next to two bounds measured in the same run:
// the f32 FMA peak (a register-only AVX-512 loop) and, for few rows, reading
// the weight once at the machine's read bandwidth.
//
// Tables (medians over --reps, implementations interleaved per repetition so
// load from other processes hits them alike):
//   1. GFLOP/s (wall time, --threads threads) per shape and M: gemm_f32 on each
//      supported path, at::linear; the kernel's ratio to at::linear, its share
//      of the FMA peak and, for M <= 16, its share of the bandwidth bound.
//   2. One thread, GFLOP per second of the thread's own CPU time
//      (CLOCK_THREAD_CPUTIME_ID; time descheduled by other work does not
//      count): gemm_f32 (default path) and at::linear with 1 intra-op thread.
// OPENBLAS_CORETYPE decides at::linear's kernels; the header prints the ones in use.
//
// Usage: vlm-bench-gemm-f32 [--threads 2] [--reps 5] [--ms 1,4,8,16,64,256,512]
//                           [--cpu_ms 1,16,256] [--shapes 0,1,2,3] (q/o, k/v, gate/up, down)
// GCC 12 AVX-512 headers warn about their own "undefined" vectors when inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/cpu_features.h"
#include "common/kernels/gemm_f32.h"
#include "common/omp_wait_policy.h"
#include "scripts/bench/bench_util.h"
#include "scripts/bench/on_threads.h"
#include "common/kernels/gemv.h"
#include "scripts/bench/read_bandwidth.h"

namespace {

using Clock = std::chrono::steady_clock;
using vlm::bench::ArgInt;
using vlm::bench::ArgList;
using vlm::bench::LoadAverage;
using vlm::bench::Median;
using vlm::bench::Seconds;
using vlm::bench::ThreadCpuSeconds;
using vlm::kernels::GemmF32Path;

volatile float g_sink;  // keeps the peak loop's result (and so the loop) alive

// 12 independent FMA chains of 16 lanes: the f32 FMA rate of one core.
__attribute__((target("avx512f"), noinline)) void FmaLoop(int64_t iters) {
  __m512 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(1.0f + i * 1e-3f);
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], m, c);
  }
  __m512 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
  g_sink = _mm512_reduce_add_ps(s);
}

constexpr int64_t kPeakIters = 20'000'000;
constexpr double kPeakFlops = static_cast<double>(kPeakIters) * 12 * 16 * 2;

// at::linear padded as RowLinear pads bf16 calls: at least 8 rows and M·N·K >= 2^18
// (zero rows appended below x).
int64_t MinRows(const at::Tensor& w) {
  return std::max<int64_t>(8, ((int64_t{1} << 18) + w.numel() - 1) / w.numel());
}
at::Tensor PaddedRows(const at::Tensor& x, const at::Tensor& w) {
  return at::zeros({std::max(x.size(0), MinRows(w)), x.size(1)});
}
void RunTorch(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, at::Tensor& padded) {
  const int64_t m = x.size(0);
  if (m >= MinRows(w)) {
    at::linear_out(y, x, w);
    return;
  }
  padded.narrow(0, 0, m).copy_(x);
  y = at::linear(padded, w).narrow(0, 0, m);
}

void RunKernel(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, GemmF32Path path,
               int threads) {
  vlm::kernels::GemmF32Options o;
  o.path = path;
  o.threads = threads;
  if (!vlm::kernels::GemmF32(x, w, &y, o).ok()) std::abort();
}

struct Shape {
  const char* name;
  int64_t n, k;
};
constexpr Shape kShapes[] = {
    {"q/o 2048->2048", 2048, 2048},
    {"k/v 2048->1024", 1024, 2048},
    {"gate/up 2048->6144", 6144, 2048},
    {"down 6144->2048", 2048, 6144},
};

}  // namespace

int main(int argc, char** argv) {
  vlm::EnsureOmpWaitPolicy(argv);  // at::linear as the services run it
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int threads = ArgInt(argc, argv, "--threads", 2);
  const int reps = std::max(1, ArgInt(argc, argv, "--reps", 5));
  const std::vector<int64_t> ms = ArgList(argc, argv, "--ms", {1, 4, 8, 16, 64, 256, 512});
  const std::vector<int64_t> cpu_ms = ArgList(argc, argv, "--cpu_ms", {1, 16, 256});
  const std::vector<int64_t> shape_ids = ArgList(argc, argv, "--shapes", {0, 1, 2, 3});
  at::set_num_threads(threads);
  at::manual_seed(7);

  const vlm::CpuFeatures& cpu = vlm::GetCpuFeatures();
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  std::printf("vlm-bench-gemm-f32: %d threads, cpu: %s\n", threads, cpu.Describe().c_str());
  std::printf("OpenBLAS kernels: %s (OPENBLAS_CORETYPE=%s); default gemm_f32 path: %s\n",
              vlm::OpenBlasCoreName().c_str(), coretype != nullptr ? coretype : "unset",
              vlm::kernels::GemmF32PathName(vlm::kernels::DefaultGemmF32Path()));
  std::printf("load average at start: %s\n", LoadAverage().c_str());

  std::vector<GemmF32Path> paths;
  for (GemmF32Path p : {GemmF32Path::kAvx512, GemmF32Path::kAvx2}) {
    if (vlm::kernels::GemmF32PathSupported(p)) paths.push_back(p);
  }
  double peak = 0, peak1 = 0;
  if (cpu.avx512f) {
    std::vector<double> v, v1;
    for (int r = 0; r < 3; ++r) {
      v.push_back(kPeakFlops * threads /
                  vlm::bench::OnThreads(threads, [](int) { FmaLoop(kPeakIters); }) / 1e9);
      v1.push_back(kPeakFlops / ThreadCpuSeconds([] { FmaLoop(kPeakIters); }) / 1e9);
    }
    peak = Median(v);
    peak1 = Median(v1);
  }
  // Read bandwidth over a buffer far larger than the caches.
  std::vector<float> big(static_cast<size_t>(256) << 20 >> 2, 1.0f);
  std::vector<double> bws;
  for (int r = 0; r < 3; ++r) {
    bws.push_back(vlm::MeasureReadBandwidth(big.data(), big.size() * sizeof(float), threads));
  }
  const double bandwidth = Median(bws);
  big = {};
  std::printf("bounds: f32 FMA peak %.0f GFLOP/s (%d threads), %.0f (1 thread); read "
              "bandwidth %.1f GB/s\n\n",
              peak, threads, peak1, bandwidth / 1e9);

  // --- 1. wall time, --threads ---
  std::printf("1. GFLOP/s, %d threads (median of %d)\n", threads, reps);
  std::printf("| shape | M |");
  for (GemmF32Path p : paths) std::printf(" gemm_f32 %s |", vlm::kernels::GemmF32PathName(p));
  std::printf(" at::linear | kernel / at::linear | of FMA peak | of bandwidth bound |\n");
  std::printf("|---|---|");
  for (size_t i = 0; i < paths.size(); ++i) std::printf("---|");
  std::printf("---|---|---|---|\n");
  for (int64_t id : shape_ids) {
    if (id < 0 || id >= static_cast<int64_t>(std::size(kShapes))) continue;
    const Shape& s = kShapes[id];
    const at::Tensor w = at::randn({s.n, s.k}) * 0.02;
    for (int64_t m : ms) {
      const at::Tensor x = at::randn({m, s.k});
      at::Tensor y = at::empty({m, s.n});
      at::Tensor padded = PaddedRows(x, w);
      const double flops = 2.0 * m * s.n * s.k;
      std::vector<std::vector<double>> t(paths.size() + 1);
      // Warm-up (page faults, thread start), then interleaved repetitions.
      for (GemmF32Path p : paths) RunKernel(x, w, y, p, threads);
      RunTorch(x, w, y, padded);
      const int inner = std::max<int64_t>(1, static_cast<int64_t>(2e9 / flops));
      for (int r = 0; r < reps; ++r) {
        for (size_t i = 0; i < paths.size(); ++i) {
          t[i].push_back(Seconds([&] {
                           for (int j = 0; j < std::min(inner, 50); ++j) {
                             RunKernel(x, w, y, paths[i], threads);
                           }
                         }) /
                         std::min(inner, 50));
        }
        t.back().push_back(Seconds([&] {
                             for (int j = 0; j < std::min(inner, 50); ++j) {
                               RunTorch(x, w, y, padded);
                             }
                           }) /
                           std::min(inner, 50));
      }
      std::printf("| %s | %ld |", s.name, static_cast<long>(m));
      for (size_t i = 0; i < paths.size(); ++i) std::printf(" %.1f |", flops / Median(t[i]) / 1e9);
      const double kernel = Median(t[0]), torch = Median(t.back());
      const double read_bound = static_cast<double>(w.nbytes()) / bandwidth;
      std::printf(" %.1f | %.2fx | %s | %s |\n", flops / torch / 1e9, torch / kernel,
                  peak > 0 ? (std::to_string(static_cast<int>(100 * flops / kernel / 1e9 / peak)) + "%").c_str() : "-",
                  m <= 16 ? (std::to_string(static_cast<int>(100 * read_bound / kernel)) + "%").c_str() : "-");
    }
  }

  // --- 2. one thread, thread CPU time ---
  if (!cpu_ms.empty()) {
    at::set_num_threads(1);
    std::printf("\n2. GFLOP per thread-CPU-second, 1 thread (median of %d)\n", reps);
    std::printf("| shape | M | gemm_f32 %s | at::linear | kernel / at::linear | of 1-thread FMA peak |\n",
                vlm::kernels::GemmF32PathName(vlm::kernels::DefaultGemmF32Path()));
    std::printf("|---|---|---|---|---|---|\n");
    for (int64_t id : shape_ids) {
      if (id < 0 || id >= static_cast<int64_t>(std::size(kShapes))) continue;
      const Shape& s = kShapes[id];
      const at::Tensor w = at::randn({s.n, s.k}) * 0.02;
      for (int64_t m : cpu_ms) {
        const at::Tensor x = at::randn({m, s.k});
        at::Tensor y = at::empty({m, s.n});
        at::Tensor padded = PaddedRows(x, w);
        const double flops = 2.0 * m * s.n * s.k;
        const GemmF32Path path = vlm::kernels::DefaultGemmF32Path();
        RunKernel(x, w, y, path, 1);
        RunTorch(x, w, y, padded);
        std::vector<double> tk, tt;
        for (int r = 0; r < reps; ++r) {
          tk.push_back(ThreadCpuSeconds([&] { RunKernel(x, w, y, path, 1); }));
          tt.push_back(ThreadCpuSeconds([&] { RunTorch(x, w, y, padded); }));
        }
        const double k = Median(tk), t = Median(tt);
        std::printf("| %s | %ld | %.1f | %.1f | %.2fx | %s |\n", s.name, static_cast<long>(m),
                    flops / k / 1e9, flops / t / 1e9, t / k,
                    peak1 > 0 ? (std::to_string(static_cast<int>(100 * flops / k / 1e9 / peak1)) + "%").c_str() : "-");
      }
    }
  }
  std::printf("\nload average at end: %s\n", LoadAverage().c_str());
  return 0;
}
