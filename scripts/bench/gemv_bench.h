// Scaffolding shared by the decode matrix-vector benchmarks (vlm-bench-gemv,
// vlm-bench-gemv-int8): the Qwen3-VL-2B decoder's weight shapes, random bf16
// weights, medians, the read-bandwidth bound measured in the run, and the
// one-decode-step table. Header-only; single-threaded use from main().
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/status/status.h"
#include "common/kernels/gemv.h"
#include "scripts/bench/bench_util.h"
#include "scripts/bench/read_bandwidth.h"

namespace vlm::bench {

struct Shape {
  const char* name;
  int64_t out, in;
};
// One Qwen3 decoder layer, in call order, and the tied LM head.
inline constexpr Shape kLayerShapes[] = {{"q", 2048, 2048},     {"k", 1024, 2048},
                                         {"v", 1024, 2048},     {"o", 2048, 2048},
                                         {"gate", 6144, 2048},  {"up", 6144, 2048},
                                         {"down", 2048, 6144}};
inline constexpr int kQ = 0, kK = 1, kV = 2, kO = 3, kGate = 4, kUp = 5, kDown = 6;
inline constexpr Shape kHead = {"lm_head", 151936, 2048};

inline double Min(const std::vector<double>& v) {
  return v.empty() ? 0 : *std::min_element(v.begin(), v.end());
}

// bf16 values of magnitude 2^-7..2^-3 with random sign and mantissa (normal
// numbers only, so no path meets denormals). Touches every page.
inline at::Tensor RandomBf16(int64_t rows, int64_t cols, uint64_t seed) {
  at::Tensor t = at::empty({rows, cols}, at::kBFloat16);
  auto* p = reinterpret_cast<uint16_t*>(t.data_ptr());
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  const int64_t n = rows * cols;
  for (int64_t i = 0; i < n; ++i) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    const uint16_t sign = (s >> 20) & 1, exp = 120 + (s >> 21) % 5, mant = (s >> 30) & 0x7F;
    p[i] = static_cast<uint16_t>(sign << 15 | exp << 7 | mant);
  }
  return t;
}

// Exits the benchmark with the status message when `s` is not OK.
inline void CheckOk(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s failed: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}

inline std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

inline std::vector<int> SplitInts(const std::string& s) {
  std::vector<int> out;
  for (const std::string& item : SplitList(s)) out.push_back(std::atoi(item.c_str()));
  return out;
}

// The memory bound: read bandwidth over a buffer far beyond the L3, measured
// once per repetition (so it sees the same load as the kernels); the bound
// uses the best measurement of the run.
class ReadBound {
 public:
  explicit ReadBound(size_t bytes) : ReadBound(RandomBf16(1, bytes / 2, 4242)) {}
  // Measures over `buffer` (shared, e.g. by bounds for several thread counts).
  explicit ReadBound(at::Tensor buffer)
      : bytes_(static_cast<size_t>(buffer.nbytes())), buffer_(std::move(buffer)) {}
  void Measure(int threads) {
    seen_.push_back(vlm::MeasureReadBandwidth(buffer_.data_ptr(), bytes_, threads));
  }
  double best() const { return seen_.empty() ? 0 : *std::max_element(seen_.begin(), seen_.end()); }
  double median() const { return Median(seen_); }
  // Seconds to stream `bytes` at the best bandwidth.
  double Seconds(int64_t bytes) const { return static_cast<double>(bytes) / best(); }

 private:
  size_t bytes_;
  at::Tensor buffer_;
  std::vector<double> seen_;
};

// One row of the decode-step table: an implementation's step times (seconds,
// one per repetition) for a batch of `batch` tokens streaming `bytes` of weights.
struct StepResult {
  std::string impl;
  int threads = 0;
  int batch = 0;
  int64_t bytes = 0;
  std::vector<double> seconds;
};

// Markdown table: ms/step (median, best), GB/s, tokens/s, the bound's tokens/s,
// time / bound, and speed relative to the row named `reference` (same threads
// and batch; blank when absent).
inline void PrintStepTable(const std::vector<StepResult>& rows, const ReadBound& bound,
                           const std::string& reference) {
  std::printf("| impl | thr | B | weights GB | ms/step | best ms | GB/s | tok/s | bound tok/s | "
              "time / bound | speed vs %s |\n",
              reference.c_str());
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const StepResult& r : rows) {
    const double s = Median(r.seconds), bound_s = bound.Seconds(r.bytes);
    std::string speed = "";
    for (const StepResult& ref : rows) {
      if (ref.impl == reference && ref.threads == r.threads && ref.batch == r.batch) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.2fx", Median(ref.seconds) / s);
        speed = buf;
      }
    }
    std::printf("| %s | %d | %d | %.2f | %.1f | %.1f | %.1f | %.2f | %.2f | %.2fx | %s |\n",
                r.impl.c_str(), r.threads, r.batch, r.bytes / 1e9, s * 1e3, Min(r.seconds) * 1e3,
                r.bytes / s / 1e9, r.batch / s, r.batch / bound_s, s / bound_s, speed.c_str());
  }
}

}  // namespace vlm::bench
