// vlm-bench-gemv-int8: the int8-weight products of the Qwen3-VL-2B decoder
// (common/kernels/gemv_int8.h) against bf16, in one run.
//
// Decode (batches <= 8): one decode step's weight set (28 layers of q, k, v,
// o, gate, up, down + the LM head) through GemvInt8 against the bf16
// vlm::Gemv, next to the read-bandwidth bound measured in the same run.
// Weights are distinct buffers per layer (bf16 3.4 GB, int8 1.7 GB: far
// beyond the L3), so each call streams its weights from DRAM. Each repetition
// measures the bandwidth, then runs one step per implementation and batch
// size, interleaved; tables print medians. The bound for an implementation is
// its own weight bytes (int8: rows + scales) / the best bandwidth of the run.
// Outputs are preallocated bf16 (f32 logits), as a decoder keeps them.
//
// Prefill (batches >= 8): GFLOP/s per layer shape (one layer's weights, 75 MB
// int8 / 100 MB bf16 for the seven, so consecutive calls evict each other
// from a 32 MiB L3) for the bf16 kernels::Gemm on packed weights,
// kernels::GemmInt8 (the int8 weights converted to bf16 panels per task and
// multiplied by the same micro-kernel: how the decoder prefills int8 layers),
// GemvInt8 with all M rows in one call (how it prefilled them before), and
// GemvInt8 in calls of 8 rows (the weights streamed once per 8 rows), next to
// the compute bounds measured in the same repetition by register-only loops:
// VPDPBUSD (two per 64 weights per row: 32 weight MACs per instruction) and
// VDPBF16PS (32 MACs per instruction). Implementations interleave per shape.
// The same bf16 and int8 calls also run on one thread timed by its CPU clock
// (next to the VPDPBUSD loop timed the same way): on a machine shared with
// other work, wall times and the wall-time peaks move by tens of percent
// between repetitions, the CPU-time columns by a few.
//
// Usage: vlm-bench-gemv-int8 [--layers 28] [--reps 5] [--threads 2] [--batches 1,2,4,8]
//        [--prefill_reps 5] [--prefill_only_int8 1 (prefill table: GemmInt8 and GemvInt8
//        in one call only, for quick tuning runs)]
//   e.g. --batches 1,8,64,512: decode steps at 1 and 8, prefill table at 8, 64, 512.
#include <time.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/kernels/gemm.h"
#include "common/kernels/gemv_int8.h"
#include "common/kernels/quantize.h"
#include "common/omp_wait_policy.h"
#include "scripts/bench/gemv_bench.h"
#include "scripts/bench/on_threads.h"
#include "scripts/bench/peak_bf16.h"
#include "common/kernels/gemv.h"

namespace {

using Clock = std::chrono::steady_clock;
using vlm::bench::CheckOk;
using vlm::bench::kDown;
using vlm::bench::kHead;
using vlm::bench::kLayerShapes;
using vlm::bench::RandomBf16;
using vlm::bench::Shape;

using vlm::bench::OnThreads;

// Register-only issue-rate loops with 24 independent accumulators. VPDPBUSD
// in inline assembly: from intrinsics GCC 12 copied accumulators through the
// stack every iteration and the loop measured half the real rate.
__attribute__((target("avx512f,avx512vnni"), noinline)) void VnniLoop(int64_t iters) {
  __asm__ volatile("vpternlogd $0xff, %%zmm24, %%zmm24, %%zmm24\n\t"
                   "vpternlogd $0xff, %%zmm25, %%zmm25, %%zmm25" ::: "xmm24", "xmm25");
  for (int64_t it = 0; it < iters; ++it) {
    __asm__ volatile(
      "vpdpbusd %%zmm24, %%zmm25, %%zmm0\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm1\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm2\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm3\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm4\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm5\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm6\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm7\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm8\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm9\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm10\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm11\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm12\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm13\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm14\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm15\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm16\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm17\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm18\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm19\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm20\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm21\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm22\n\t"
      "vpdpbusd %%zmm24, %%zmm25, %%zmm23\n\t"
      ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25");
  }
}

// GFLOP/s of weight-times-activation MACs at the loops' issue rate, `threads` threads:
// VPDPBUSD does 64 u8·s8 products, i.e. 32 int8-weight × int16-activation MACs
// (hi and lo parts); VDPBF16PS does 32 bf16 MACs.
double PeakInt8(int threads, int64_t iters = 4'000'000) {
  const double s = OnThreads(threads, [&](int) { VnniLoop(iters); });
  return static_cast<double>(iters) * 24 * 32 * 2 * threads / s / 1e9;
}
double PeakBf16(int threads, int64_t iters = 4'000'000) {
  return vlm::bench::PeakAvx512Bf16(threads, iters);
}

double ThreadCpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

std::string Ratio(double num, double den) {
  if (num <= 0 || den <= 0) return "";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fx", num / den);
  return buf;
}

// g: GFLOP/s by implementation, in the order of RunPrefill's enum.
void PrintPrefillRow(int m, const char* shape, const double* g, double p8, double p16, double p8c) {
  const double bf16 = g[0], int8 = g[1], by8 = g[2], bf16_1 = g[3], int8_1 = g[4], gemm8 = g[5];
  std::printf("| %d | %s | %.0f | %.0f | %.0f | %.0f | %.0f%% | %.0f%% | %.0f%% | %s | %s | %s | "
              "%.0f | %.0f | %.0f%% | %s |\n",
              m, shape, bf16, gemm8, int8, by8, p16 > 0 ? 100 * gemm8 / p16 : 0.0,
              100 * int8 / p8, p16 > 0 ? 100 * bf16 / p16 : 0.0, Ratio(gemm8, int8).c_str(),
              Ratio(bf16, gemm8).c_str(), Ratio(int8, by8).c_str(), bf16_1, int8_1,
              100 * int8_1 / p8c, Ratio(bf16_1, int8_1).c_str());
}

// Prefill table: per layer shape and M, GFLOP/s (median over reps) of bf16
// Gemm, int8 in one call, int8 in calls of 8 rows, and both peaks.
void RunPrefill(const std::vector<int>& batches, int reps, int threads, bool only_int8) {
  const bool have_bf16 =
      vlm::kernels::GemmPathSupported(vlm::kernels::GemmPath::kAvx512Bf16);
  std::printf("\n## Prefill-sized batches: GFLOP/s, %d threads, median of %d; bf16 Gemm path %s\n\n",
              threads, reps, vlm::kernels::GemmPathName(vlm::kernels::DefaultGemmPath()));
  std::vector<vlm::kernels::PackedWeight> w16;
  std::vector<vlm::kernels::QuantizedWeight> w8;
  for (int i = 0; i < 7; ++i) {
    const Shape& s = kLayerShapes[i];
    const at::Tensor w = RandomBf16(s.out, s.in, 500 + i);
    absl::StatusOr<vlm::kernels::PackedWeight> p = vlm::kernels::PackedWeight::Pack(w);
    CheckOk(p.status(), "pack");
    w16.push_back(*p);
    absl::StatusOr<vlm::kernels::QuantizedWeight> q = vlm::kernels::QuantizeInt8(w);
    CheckOk(q.status(), "quantize");
    w8.push_back(*q);
  }
  // By (batch, shape): seconds per implementation; peaks per batch.
  // k*Cpu1: on one thread (the kernels then run inline on the caller), timed
  // by the thread's CPU clock, which time stolen by other processes on a
  // shared machine does not inflate.
  enum { kBf16, kInt8, kInt8By8, kBf16Cpu1, kInt8Cpu1, kGemmInt8, kImpls };
  std::map<std::pair<int, int>, std::vector<double>> t[kImpls];
  std::vector<double> peak8, peak16, peak8_cpu1;
  auto run = [&](int impl, const at::Tensor& x, int i, at::Tensor* y) {
    const auto start = Clock::now();
    const double cpu_start = ThreadCpuSeconds();
    if (impl == kBf16) {
      CheckOk(vlm::kernels::Gemm(x, w16[i], y), "gemm");
    } else if (impl == kInt8) {
      CheckOk(vlm::kernels::GemvInt8(x, w8[i], y), "int8 gemv");
    } else if (impl == kGemmInt8) {
      CheckOk(vlm::kernels::GemmInt8(x, w8[i], y), "int8 gemm");
    } else if (impl == kBf16Cpu1) {
      vlm::kernels::GemmOptions o;
      o.threads = 1;
      CheckOk(vlm::kernels::Gemm(x, w16[i], y, o), "gemm");
      return ThreadCpuSeconds() - cpu_start;
    } else if (impl == kInt8Cpu1) {
      vlm::kernels::GemvInt8Options o;
      o.threads = 1;
      CheckOk(vlm::kernels::GemvInt8(x, w8[i], y, o), "int8 gemv");
      return ThreadCpuSeconds() - cpu_start;
    } else {
      for (int64_t r = 0; r < x.size(0); r += 8) {
        const int64_t rows = std::min<int64_t>(8, x.size(0) - r);
        at::Tensor part = y->narrow(0, r, rows);
        CheckOk(vlm::kernels::GemvInt8(x.narrow(0, r, rows), w8[i], &part), "int8 gemv");
      }
    }
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  std::map<int, std::pair<at::Tensor, at::Tensor>> xs;  // [M, 2048], [M, 6144] bf16
  for (int b : batches) {
    xs[b] = {at::randn({b, 2048}).to(at::kBFloat16), at::randn({b, 6144}).to(at::kBFloat16)};
  }
  for (int r = -1; r < reps; ++r) {  // r = -1: warm-up
    peak8.push_back(PeakInt8(threads));
    {
      const double c0 = ThreadCpuSeconds();
      VnniLoop(2'000'000);
      peak8_cpu1.push_back(2'000'000.0 * 24 * 32 * 2 / (ThreadCpuSeconds() - c0) / 1e9);
    }
    if (have_bf16) peak16.push_back(PeakBf16(threads));
    for (int b : batches) {
      for (int i = 0; i < 7; ++i) {
        const at::Tensor& x = i == kDown ? xs[b].second : xs[b].first;
        at::Tensor y = at::empty({b, kLayerShapes[i].out}, at::kBFloat16);
        for (int impl = 0; impl < kImpls; ++impl) {
          if (impl == kBf16 && !have_bf16) continue;
          if ((impl == kBf16 || impl == kBf16Cpu1 || impl == kGemmInt8) && !have_bf16) continue;
          if (only_int8 && impl != kInt8 && impl != kInt8Cpu1 && impl != kGemmInt8) continue;
          const double sec = run(impl, x, i, &y);
          if (r >= 0) t[impl][{b, i}].push_back(sec);
        }
      }
    }
    std::fprintf(stderr, "prefill rep %d/%d, load average %s\n", r + 1, reps,
                 vlm::bench::LoadAverage().c_str());
  }
  peak8.erase(peak8.begin());
  peak8_cpu1.erase(peak8_cpu1.begin());
  if (!peak16.empty()) peak16.erase(peak16.begin());
  const double p8 = vlm::bench::Median(peak8), p16 = vlm::bench::Median(peak16);
  const double p8c = vlm::bench::Median(peak8_cpu1);
  std::printf("peaks (register-only loops, median over reps): VPDPBUSD %.0f GFLOP/s "
              "(int8 weights x int16 activations), VDPBF16PS %.0f GFLOP/s, %d threads wall; "
              "VPDPBUSD on 1 thread by its CPU time %.0f GFLOP/s\n\n", p8, p16, threads, p8c);
  std::printf("Wall time, %d threads: bf16 Gemm on packed bf16 weights; GemmInt8 (int8 weights "
              "converted to bf16 panels per task, the bf16 micro-kernel); GemvInt8 in one call "
              "(VPDPBUSD, int16 activations) and in calls of 8 rows (the decoder before GemvInt8 "
              "took prefill chunks whole); share of the peaks; speed ratios. 1 thr CPU: bf16 Gemm "
              "and GemvInt8 on one thread by its CPU time (robust to other load).\n\n",
              threads);
  std::printf("| M | shape | bf16 Gemm | int8 GemmInt8 | int8 GemvInt8 | GemvInt8 by 8 rows | "
              "GemmInt8 %% of VDPBF16PS peak | GemvInt8 %% of VPDPBUSD peak | bf16 %% of "
              "VDPBF16PS peak | GemmInt8 speed vs GemvInt8 | bf16 speed vs GemmInt8 | GemvInt8 "
              "one call vs by 8 | 1 thr CPU: bf16 | 1 thr CPU: GemvInt8 | GemvInt8 %% of 1-thr "
              "peak | 1 thr bf16 speed vs GemvInt8 |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int b : batches) {
    double sum[kImpls] = {};
    double flops_total = 0;
    for (int i = 0; i < 7; ++i) {
      const Shape& s = kLayerShapes[i];
      const double flops = 2.0 * b * s.out * s.in;
      flops_total += flops;
      double g[kImpls] = {};
      for (int impl = 0; impl < kImpls; ++impl) {
        const double sec = vlm::bench::Median(t[impl][{b, i}]);
        sum[impl] += sec;
        g[impl] = sec > 0 ? flops / sec / 1e9 : 0;
      }
      PrintPrefillRow(b, s.name, g, p8, p16, p8c);
    }
    double g[kImpls];
    for (int impl = 0; impl < kImpls; ++impl) g[impl] = sum[impl] > 0 ? flops_total / sum[impl] / 1e9 : 0;
    PrintPrefillRow(b, "layer", g, p8, p16, p8c);
  }
}

}  // namespace

int main(int argc, char** argv) {
  vlm::EnsureOmpWaitPolicy(argv);  // as the language service runs: see omp_wait_policy.h
  int layers = 28, reps = 5, threads = 2, prefill_reps = 5;
  bool only_int8 = false;
  std::string batches_arg = "1,2,4,8";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--layers") layers = std::atoi(value.c_str());
    else if (flag == "--reps") reps = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--threads") threads = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--batches") batches_arg = value;
    else if (flag == "--prefill_reps") prefill_reps = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--prefill_only_int8") only_int8 = value == "1";
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  std::vector<int> batches, prefill_batches;
  for (int b : vlm::bench::SplitInts(batches_arg)) {
    if (b < 1) {
      std::fprintf(stderr, "--batches: %d is not a batch size\n", b);
      return 2;
    }
    if (b <= 8) batches.push_back(b);
    if (b >= 8) prefill_batches.push_back(b);
  }
  at::set_num_threads(threads);
  const vlm::kernels::GemvInt8Path int8_path = vlm::kernels::DefaultGemvInt8Path();
  const vlm::GemvPath bf16_path = vlm::DefaultGemvPath();
  std::printf("vlm-bench-gemv-int8: %d layers, %d reps, %d threads, load average %s\n", layers,
              reps, threads, vlm::bench::LoadAverage().c_str());
  std::printf("bf16: vlm::Gemv %s; int8: GemvInt8 %s (weights int8 and activations int16 per group of 32)\n",
              vlm::GemvPathName(bf16_path), vlm::kernels::GemvInt8PathName(int8_path));

  if (batches.empty()) {
    RunPrefill(prefill_batches, prefill_reps, threads, only_int8);
    std::printf("\nload average at end: %s\n", vlm::bench::LoadAverage().c_str());
    return 0;
  }
  const auto t0 = Clock::now();
  std::vector<std::vector<at::Tensor>> w16(layers);
  std::vector<std::vector<vlm::kernels::QuantizedWeight>> w8(layers);
  int64_t bytes16 = 0, bytes8 = 0;
  auto add = [&](std::vector<at::Tensor>& d16, std::vector<vlm::kernels::QuantizedWeight>& d8,
                 const Shape& s, uint64_t seed) {
    d16.push_back(RandomBf16(s.out, s.in, seed));
    absl::StatusOr<vlm::kernels::QuantizedWeight> q = vlm::kernels::QuantizeInt8(d16.back());
    CheckOk(q.status(), "quantize");
    d8.push_back(*q);
    bytes16 += s.out * s.in * 2;
    bytes8 += static_cast<int64_t>(q->bytes());
  };
  for (int l = 0; l < layers; ++l) {
    for (int i = 0; i < 7; ++i) add(w16[l], w8[l], kLayerShapes[i], 100 * l + i);
  }
  std::vector<at::Tensor> head16;
  std::vector<vlm::kernels::QuantizedWeight> head8;
  add(head16, head8, kHead, 99999);
  vlm::bench::ReadBound bound(size_t{512} << 20);
  std::printf("weights per step: bf16 %.2f GB, int8 %.2f GB (rows + scales); filled and "
              "quantized in %.1f s\n\n",
              bytes16 / 1e9, bytes8 / 1e9,
              std::chrono::duration<double>(Clock::now() - t0).count());

  struct Acts {
    at::Tensor xh, xi;            // [B, 2048], [B, 6144] bf16
    std::vector<at::Tensor> y;    // [B, out] bf16 per layer shape
    at::Tensor logits;            // [B, 151936] f32
  };
  std::map<int, Acts> acts;
  for (int b : batches) {
    Acts& a = acts[b];
    a.xh = at::randn({b, 2048}).to(at::kBFloat16);
    a.xi = at::randn({b, 6144}).to(at::kBFloat16);
    for (const Shape& s : kLayerShapes) a.y.push_back(at::empty({b, s.out}, at::kBFloat16));
    a.logits = at::empty({b, kHead.out}, at::kFloat);
  }
  // Per-call microseconds by (int8, batch, call name), for the per-call table.
  std::map<std::tuple<bool, int, std::string>, std::vector<double>> calls;
  auto step = [&](bool int8, int batch) {
    Acts& a = acts[batch];
    auto call = [&](const Shape& s, const at::Tensor& x, const at::Tensor& w16_,
                    const vlm::kernels::QuantizedWeight& w8_, at::Tensor* y) {
      const auto t = Clock::now();
      if (int8) CheckOk(vlm::kernels::GemvInt8(x, w8_, y), "int8 gemv");
      else CheckOk(vlm::Gemv(x, w16_, y), "gemv");
      calls[{int8, batch, s.name}].push_back(
          std::chrono::duration<double, std::micro>(Clock::now() - t).count());
    };
    const auto start = Clock::now();
    for (int l = 0; l < layers; ++l) {
      for (int i = 0; i < 7; ++i) {
        call(kLayerShapes[i], i == kDown ? a.xi : a.xh, w16[l][i], w8[l][i], &a.y[i]);
      }
    }
    call(kHead, a.xh, head16[0], head8[0], &a.logits);
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  for (int b : batches) step(false, b), step(true, b);  // warm-up
  calls.clear();
  std::map<int, std::vector<double>> t16, t8;
  for (int r = 0; r < reps; ++r) {
    bound.Measure(threads);
    for (int b : batches) {
      t16[b].push_back(step(false, b));
      t8[b].push_back(step(true, b));
    }
    std::fprintf(stderr, "rep %d/%d, load average %s\n", r + 1, reps,
                 vlm::bench::LoadAverage().c_str());
  }
  std::printf("read bandwidth, %d threads: best %.1f GB/s, median %.1f GB/s (the bound uses the "
              "best)\n\n",
              threads, bound.best() / 1e9, bound.median() / 1e9);
  std::vector<vlm::bench::StepResult> rows;
  for (int b : batches) {
    rows.push_back({"bf16 (vlm::Gemv)", threads, b, bytes16, t16[b]});
    rows.push_back({"int8 (GemvInt8)", threads, b, bytes8, t8[b]});
  }
  vlm::bench::PrintStepTable(rows, bound, "bf16 (vlm::Gemv)");
  std::printf("\nPer call: median us (bf16 / int8) over %d layers x %d reps; time / bound for int8\n",
              layers, reps);
  std::printf("| B | call | bf16 us | int8 us | int8 speed vs bf16 | int8 time / bound |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (int b : batches) {
    for (int i = 0; i < 7; ++i) {
      const Shape& s = kLayerShapes[i];
      const double u16 = vlm::bench::Median(calls[{false, b, s.name}]);
      const double u8 = vlm::bench::Median(calls[{true, b, s.name}]);
      const auto bytes = static_cast<int64_t>(w8[0][i].bytes());  // every layer's are the same
      std::printf("| %d | %s | %.1f | %.1f | %.2fx | %.2fx |\n", b, s.name, u16, u8, u16 / u8,
                  u8 * 1e-6 / bound.Seconds(bytes));
    }
    const double u16 = vlm::bench::Median(calls[{false, b, kHead.name}]);
    const double u8 = vlm::bench::Median(calls[{true, b, kHead.name}]);
    std::printf("| %d | %s | %.1f | %.1f | %.2fx | %.2fx |\n", b, kHead.name, u16, u8, u16 / u8,
                u8 * 1e-6 / bound.Seconds(static_cast<int64_t>(head8[0].bytes())));
  }
  w16.clear(), w8.clear(), head16.clear(), head8.clear(), acts.clear();
  if (!prefill_batches.empty()) RunPrefill(prefill_batches, prefill_reps, threads, only_int8);
  std::printf("\nload average at end: %s\n", vlm::bench::LoadAverage().c_str());
  return 0;
}
