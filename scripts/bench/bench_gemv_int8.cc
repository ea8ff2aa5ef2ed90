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
//
// Usage: vlm-bench-gemv-int8 [--layers 28] [--reps 5] [--threads 2] [--batches 1,4]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/kernels/gemv_int8.h"
#include "common/kernels/quantize.h"
#include "services/language/gemv.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  const char* name;
  int64_t out, in;
};
const Shape kShapes[] = {{"q", 2048, 2048},    {"k", 1024, 2048},  {"v", 1024, 2048},
                         {"o", 2048, 2048},    {"gate", 6144, 2048}, {"up", 6144, 2048},
                         {"down", 2048, 6144}};
const Shape kHead = {"lm_head", 151936, 2048};

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

// bf16 values of magnitude 2^-7..2^-3 with random sign and mantissa (normal
// numbers only). Touches every page.
at::Tensor RandomBf16(int64_t rows, int64_t cols, uint64_t seed) {
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

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "failed: %s\n", std::string(s.message()).c_str());
    std::exit(1);
  }
}

std::vector<int> SplitInts(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(std::atoi(item.c_str()));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int layers = 28, reps = 5, threads = 2;
  std::string batches_arg = "1,4";
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
  const std::vector<int> batches = SplitInts(batches_arg);
  at::set_num_threads(threads);
  const vlm::kernels::GemvInt8Path int8_path = vlm::kernels::DefaultGemvInt8Path();
  const vlm::GemvPath bf16_path = vlm::DefaultGemvPath();
  std::printf("vlm-bench-gemv-int8: %d layers, %d reps, %d threads, load average %s\n", layers,
              reps, threads, LoadAverage().c_str());
  std::printf("bf16: vlm::Gemv %s; int8: GemvInt8 %s (activations per block of 32)\n",
              vlm::GemvPathName(bf16_path), vlm::kernels::GemvInt8PathName(int8_path));

  const auto t0 = Clock::now();
  std::vector<std::vector<at::Tensor>> w16(layers);
  std::vector<std::vector<vlm::kernels::QuantizedWeight>> w8(layers);
  int64_t bytes16 = 0, bytes8 = 0;
  auto add = [&](std::vector<at::Tensor>& d16, std::vector<vlm::kernels::QuantizedWeight>& d8,
                 const Shape& s, uint64_t seed) {
    d16.push_back(RandomBf16(s.out, s.in, seed));
    absl::StatusOr<vlm::kernels::QuantizedWeight> q = vlm::kernels::QuantizeInt8(d16.back());
    Check(q.status());
    d8.push_back(*q);
    bytes16 += s.out * s.in * 2;
    bytes8 += static_cast<int64_t>(q->bytes());
  };
  for (int l = 0; l < layers; ++l) {
    for (int i = 0; i < 7; ++i) add(w16[l], w8[l], kShapes[i], 100 * l + i);
  }
  std::vector<at::Tensor> head16;
  std::vector<vlm::kernels::QuantizedWeight> head8;
  add(head16, head8, kHead, 99999);
  const size_t bw_bytes = size_t{512} << 20;
  const at::Tensor bw_buffer = RandomBf16(1, bw_bytes / 2, 4242);
  std::printf("weights per step: bf16 %.2f GB, int8 %.2f GB (rows + f32 scales); filled and "
              "quantized in %.1f s\n\n",
              bytes16 / 1e9, bytes8 / 1e9,
              std::chrono::duration<double>(Clock::now() - t0).count());

  auto step = [&](bool int8, int batch) {
    const at::Tensor xh = at::randn({batch, 2048}).to(at::kBFloat16);
    const at::Tensor xi = at::randn({batch, 6144}).to(at::kBFloat16);
    at::Tensor y;
    const auto start = Clock::now();
    for (int l = 0; l < layers; ++l) {
      for (int i = 0; i < 7; ++i) {
        const at::Tensor& x = i == 6 ? xi : xh;
        y = at::Tensor();
        if (int8) Check(vlm::kernels::GemvInt8(x, w8[l][i], &y));
        else Check(vlm::Gemv(x, w16[l][i], &y));
      }
    }
    y = at::Tensor();
    if (int8) Check(vlm::kernels::GemvInt8(xh, head8[0], &y));
    else Check(vlm::Gemv(xh, head16[0], &y));
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  for (int b : batches) step(false, b), step(true, b);  // warm-up
  std::map<int, std::vector<double>> t16, t8;
  std::vector<double> bandwidth;
  for (int r = 0; r < reps; ++r) {
    bandwidth.push_back(vlm::MeasureReadBandwidth(bw_buffer.data_ptr(), bw_bytes, threads));
    for (int b : batches) {
      t16[b].push_back(step(false, b));
      t8[b].push_back(step(true, b));
    }
    std::fprintf(stderr, "rep %d/%d, load average %s\n", r + 1, reps, LoadAverage().c_str());
  }
  const double bw = *std::max_element(bandwidth.begin(), bandwidth.end());
  std::printf("read bandwidth, %d threads: best %.1f GB/s, median %.1f GB/s (the bound uses the best)\n\n",
              threads, bw / 1e9, Median(bandwidth) / 1e9);
  std::printf("| weights | B | ms/step | GB/s | steps/s (tok/s-equivalent) | bound steps/s | time / bound | speed vs bf16 |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (int b : batches) {
    const double s16 = Median(t16[b]), s8 = Median(t8[b]);
    const double bound16 = bytes16 / bw, bound8 = bytes8 / bw;
    std::printf("| bf16 (vlm::Gemv) | %d | %.1f | %.1f | %.2f | %.2f | %.2fx | 1.00x |\n", b,
                s16 * 1e3, bytes16 / s16 / 1e9, b / s16, b / bound16, s16 / bound16);
    std::printf("| int8 (GemvInt8) | %d | %.1f | %.1f | %.2f | %.2f | %.2fx | %.2fx |\n", b,
                s8 * 1e3, bytes8 / s8 / 1e9, b / s8, b / bound8, s8 / bound8, s16 / s8);
  }
  std::printf("\nload average at end: %s\n", LoadAverage().c_str());
  return 0;
}
