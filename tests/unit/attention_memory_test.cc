// Tiled attention over one 16384-patch image (a 2048x2048 picture's worth,
// 16 heads of 64) never materializes the [16, 16384, 16384] score tensor:
// that would be 17 GB of float32; the peak growth here stays within the
// activations plus a few copies of one head's [tile, 16384] scores. Measured
// with VmHWM in a process of its own (this test binary), after resetting the
// mark via /proc/self/clear_refs.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "common/cpu_features.h"
#include "common/nn.h"

namespace vlm::nn {
namespace {

int64_t StatusKiB(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
  }
  return -1;
}

// Resets VmHWM to the current RSS (Linux >= 4.0); false if not permitted.
bool ResetPeakRss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

TEST(AttentionMemoryTest, SixteenThousandPatchImageStaysFarBelowTheScoreTensor) {
  at::set_num_threads(1);
  at::manual_seed(7);
  const int64_t n = 16384, heads = 16, head_dim = 64, tile = 256;
  // bf16 where oneDNN makes it fast (seconds); f32 elsewhere.
  const at::ScalarType dtype =
      GetCpuFeatures().fast_bf16_matmul() ? at::kBFloat16 : at::kFloat;
  const int64_t es = at::elementSize(dtype);
  const auto opts = at::TensorOptions().dtype(dtype);
  at::Tensor q = at::randn({n, heads, head_dim}, opts);
  at::Tensor k = at::randn({n, heads, head_dim}, opts);
  at::Tensor v = at::randn({n, heads, head_dim}, opts);

  const bool reset = ResetPeakRss();
  const int64_t before_kib = StatusKiB("VmHWM");
  ASSERT_GT(before_kib, 0);
  AttentionOptions options;
  options.scale = 1.0 / std::sqrt(double(head_dim));
  options.query_tile = tile;
  const std::vector<int64_t> cu = {0, n};
  at::Tensor out = SegmentedAttention(q, k, v, cu, options);
  const int64_t after_kib = StatusKiB("VmHWM");
  const double growth = double(after_kib - before_kib) * 1024;

  const double full_scores = double(n) * n * heads * 4;  // 17.2 GB
  // Default options put one head's [tile, n] scores in a step (over the 4 MiB
  // block budget); allow three float32 copies of that (the portable softmax).
  ASSERT_LT(options.score_block_bytes, tile * n * es);
  const double one_step = 3.0 * tile * n * 4;
  const double activations = 4.0 * n * heads * head_dim * es;  // head-major q, k, v + output
  const double bound = one_step + activations + (64 << 20);
  std::printf("dtype %s, tile %ld: peak RSS growth %.0f MiB (bound %.0f MiB; the full score "
              "tensor would be %.1f GiB)%s\n",
              dtype == at::kBFloat16 ? "bf16" : "f32", long(tile), growth / (1 << 20),
              bound / (1 << 20), full_scores / (1 << 30), reset ? "" : " [VmHWM not reset]");
  EXPECT_LT(growth, bound);
  EXPECT_LT(growth, full_scores / 16);

  // Spot-check rows at the start, middle and end against exact attention.
  const at::Tensor kd = k.to(at::kDouble), vd = v.to(at::kDouble);  // [n, heads, head_dim]
  for (int64_t row : {int64_t{0}, n / 2 + 3, n - 1}) {
    at::Tensor qr = q[row].to(at::kDouble);  // [heads, head_dim]
    at::Tensor s = at::einsum("hd,nhd->hn", {qr, kd}) * options.scale;
    at::Tensor expected = at::einsum("hn,nhd->hd", {at::softmax(s, -1), vd});
    at::Tensor got = out[row].to(at::kDouble);
    const double cosine = at::cosine_similarity(got, expected, 1).min().item<double>();
    EXPECT_GT(cosine, 0.995) << "row " << row;
  }
}

}  // namespace
}  // namespace vlm::nn
