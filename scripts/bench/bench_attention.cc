// vlm-bench-attention: tiled ViT attention (common/nn SegmentedAttention) on
// realistic Qwen3-VL 2B vision shapes, against the compute bound measured in
// the same run (a 1024^3 GEMM), and against its own two batched matmuls
// alone ("matmuls ms"; the rest is softmax, scaling and copies).
//
//   vlm-bench-attention [--threads 2] [--dtype bf16|f32] [--patches 1024,4096,16384]
//                       [--tiles 128,256,512,1024] [--blocks-kib 1024,4096,65536]
//                       [--repeats 3]
// Prints a table: time per call (median), GFLOP/s, fraction of the GEMM rate,
// share of the time spent outside the two matmuls; for bf16 also the flash
// kernel (common/kernels/flash_attention.h) on the same inputs, as tile
// "flash", with its speed-up over the best tiled row above it.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/cpu_features.h"
#include "common/kernels/flash_attention.h"
#include "common/nn.h"

namespace {

std::vector<int64_t> ParseList(const char* text) {
  std::vector<int64_t> out;
  for (const char* p = text; *p;) {
    out.push_back(std::strtoll(p, const_cast<char**>(&p), 10));
    if (*p == ',') ++p;
  }
  return out;
}

template <typename F>
double MedianSeconds(int repeats, F&& f) {
  f();  // warm-up
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, repeats = 3;
  std::string dtype_name = "bf16";
  std::vector<int64_t> patches = {1024, 4096}, tiles = {128, 256, 512, 1024};
  std::vector<int64_t> blocks_kib = {vlm::nn::AttentionOptions().score_block_bytes >> 10};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--dtype")) dtype_name = argv[i + 1];
    else if (!std::strcmp(argv[i], "--patches")) patches = ParseList(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--tiles")) tiles = ParseList(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--blocks-kib")) blocks_kib = ParseList(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--repeats")) repeats = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  at::set_num_threads(threads);
  const at::ScalarType dtype = dtype_name == "f32" ? at::kFloat : at::kBFloat16;
  const int64_t heads = 16, head_dim = 64;
  std::printf("cpu: %s\nthreads %d, dtype %s, heads %ld, head_dim %ld, median of %d\n\n",
              vlm::GetCpuFeatures().Describe().c_str(), threads, dtype_name.c_str(), long(heads),
              long(head_dim), repeats);

  const auto opts = at::TensorOptions().dtype(dtype);
  // The machine's matmul rate in this dtype (a 1024^3 GEMM), measured now.
  at::Tensor a = at::randn({1024, 1024}, opts), b = at::randn({1024, 1024}, opts);
  const double gemm_gflops =
      2.0 * 1024 * 1024 * 1024 / MedianSeconds(repeats + 2, [&] { at::matmul(a, b); }) / 1e9;
  std::printf("GEMM 1024^3 %s: %.0f GFLOP/s (the compute bound below)\n\n", dtype_name.c_str(),
              gemm_gflops);
  std::printf("%8s %6s %9s %10s %12s %9s %10s %9s\n", "patches", "tile", "block KiB", "ms/call",
              "matmuls ms", "GFLOP/s", "of GEMM", "softmax+");
  for (int64_t n : patches) {
    at::Tensor q = at::randn({n, heads, head_dim}, opts);
    at::Tensor k = at::randn({n, heads, head_dim}, opts);
    at::Tensor v = at::randn({n, heads, head_dim}, opts);
    const at::Tensor kh = k.transpose(0, 1).contiguous(), vh = v.transpose(0, 1).contiguous();
    const double flops = 4.0 * double(n) * n * head_dim * heads;  // q·kᵀ and p·v
    double best_tiled = 1e30;
    for (int64_t tile : tiles) {
      for (int64_t block : blocks_kib) {
        vlm::nn::AttentionOptions o;
        o.scale = 1.0 / std::sqrt(double(head_dim));
        o.query_tile = tile;
        o.score_block_bytes = block << 10;
        const std::vector<int64_t> cu = {0, n};
        const double s =
            MedianSeconds(repeats, [&] { vlm::nn::SegmentedAttention(q, k, v, cu, o); });
        // The same two batched matmuls per work item, without softmax and copies.
        const int64_t t = std::min(tile, n);
        const int64_t step = std::clamp<int64_t>(o.score_block_bytes / (t * n * a.element_size()),
                                                 1, heads);
        at::Tensor sc = at::empty({step, t, n}, opts), qt = at::randn({step, t, head_dim}, opts);
        at::Tensor ot = at::empty({step, t, head_dim}, opts);
        const double mm = MedianSeconds(repeats, [&] {
          for (int64_t h0 = 0; h0 + step <= heads; h0 += step) {
            for (int64_t q0 = 0; q0 < n; q0 += t) {
              at::bmm_out(sc, qt, kh.narrow(0, h0, step).transpose(1, 2));
              at::bmm_out(ot, sc, vh.narrow(0, h0, step));
            }
          }
        });
        const double gflops = flops / s / 1e9;
        best_tiled = std::min(best_tiled, s);
        std::printf("%8ld %6ld %9ld %10.1f %12.1f %9.0f %9.0f%% %8.0f%%\n", long(n), long(tile),
                    long(block), s * 1e3, mm * 1e3, gflops, 100.0 * gflops / gemm_gflops,
                    100.0 * (s - mm) / s);
      }
    }
    if (dtype == at::kBFloat16 && vlm::kernels::FlashAttentionSupported()) {
      const std::vector<int64_t> cu = {0, n};
      const double s = MedianSeconds(repeats, [&] {
        if (!vlm::kernels::SegmentedFlashAttention(q, k, v, cu, 1.0 / std::sqrt(double(head_dim)))
                 .ok()) {
          std::abort();
        }
      });
      const double gflops = flops / s / 1e9;
      std::printf("%8ld %6s %9s %10.1f %12s %9.0f %9.0f%% %8s  (%.2fx the best tiled)\n", long(n),
                  "flash", "-", s * 1e3, "-", gflops, 100.0 * gflops / gemm_gflops, "-",
                  best_tiled / s);
    }
  }
  return 0;
}
