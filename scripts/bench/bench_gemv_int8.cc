// vlm-bench-gemv-int8: one decode step's weight set of the Qwen3-VL-2B decoder
// (28 layers of q, k, v, o, gate, up, down + the LM head) through the int8
// GEMV (common/kernels/gemv_int8.h) against the bf16 vlm::Gemv, next to the
// read-bandwidth bound measured in the same run.
//
// Weights are distinct buffers per layer (bf16 3.4 GB, int8 1.7 GB: far
// beyond the L3), so each call streams its weights from DRAM. Each repetition
// measures the bandwidth, then runs one step per implementation and batch
// size, interleaved; tables print medians. The bound for an implementation is
// its own weight bytes (int8: rows + scales) / the best bandwidth of the run.
// Outputs are preallocated bf16 (f32 logits), as a decoder keeps them.
//
// Usage: vlm-bench-gemv-int8 [--layers 28] [--reps 5] [--threads 2] [--batches 1,2,4,8]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/kernels/gemv_int8.h"
#include "common/kernels/quantize.h"
#include "common/omp_wait_policy.h"
#include "scripts/bench/gemv_bench.h"
#include "services/language/gemv.h"

namespace {

using Clock = std::chrono::steady_clock;
using vlm::bench::CheckOk;
using vlm::bench::kDown;
using vlm::bench::kHead;
using vlm::bench::kLayerShapes;
using vlm::bench::RandomBf16;
using vlm::bench::Shape;

}  // namespace

int main(int argc, char** argv) {
  vlm::EnsureOmpWaitPolicy(argv);  // as the language service runs: see omp_wait_policy.h
  int layers = 28, reps = 5, threads = 2;
  std::string batches_arg = "1,2,4,8";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--layers") layers = std::atoi(value.c_str());
    else if (flag == "--reps") reps = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--threads") threads = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--batches") batches_arg = value;
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  const std::vector<int> batches = vlm::bench::SplitInts(batches_arg);
  at::set_num_threads(threads);
  const vlm::kernels::GemvInt8Path int8_path = vlm::kernels::DefaultGemvInt8Path();
  const vlm::GemvPath bf16_path = vlm::DefaultGemvPath();
  std::printf("vlm-bench-gemv-int8: %d layers, %d reps, %d threads, load average %s\n", layers,
              reps, threads, vlm::bench::LoadAverage().c_str());
  std::printf("bf16: vlm::Gemv %s; int8: GemvInt8 %s (weights int8 and activations int16 per group of 32)\n",
              vlm::GemvPathName(bf16_path), vlm::kernels::GemvInt8PathName(int8_path));

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
    for (const Shape& s : kLayerShapes) {
      const double u16 = vlm::bench::Median(calls[{false, b, s.name}]);
      const double u8 = vlm::bench::Median(calls[{true, b, s.name}]);
      const int64_t bytes = s.out * ((s.in + 63) / 64 * 64 + 4);
      std::printf("| %d | %s | %.1f | %.1f | %.2fx | %.2fx |\n", b, s.name, u16, u8, u16 / u8,
                  u8 * 1e-6 / bound.Seconds(bytes));
    }
    const double u16 = vlm::bench::Median(calls[{false, b, kHead.name}]);
    const double u8 = vlm::bench::Median(calls[{true, b, kHead.name}]);
    std::printf("| %d | %s | %.1f | %.1f | %.2fx | %.2fx |\n", b, kHead.name, u16, u8, u16 / u8,
                u8 * 1e-6 / bound.Seconds(kHead.out * (kHead.in + 4)));
  }
  std::printf("\nload average at end: %s\n", vlm::bench::LoadAverage().c_str());
  return 0;
}
