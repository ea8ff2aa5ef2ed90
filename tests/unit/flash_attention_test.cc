// Flash attention for the ViT against a float64 softmax(q·kᵀ·scale)·v on the
// same bf16 inputs, and against the previous LibTorch path (nn::SegmentedAttention).
#include "common/kernels/flash_attention.h"

#include <cmath>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "common/nn.h"

namespace vlm::kernels {
namespace {

// Per segment and head, in float64 on the bf16 values: [N, H, D].
at::Tensor Reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::vector<int64_t>& cu, double scale) {
  at::Tensor out = at::zeros(q.sizes(), at::TensorOptions().dtype(at::kDouble));
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    const int64_t b = cu[s], len = cu[s + 1] - cu[s];
    if (len == 0) continue;
    auto hm = [&](const at::Tensor& t) {
      return t.narrow(0, b, len).to(at::kDouble).transpose(0, 1);  // [H, len, D]
    };
    const at::Tensor p = at::softmax(at::matmul(hm(q), hm(k).transpose(1, 2)) * scale, -1);
    out.narrow(0, b, len).copy_(at::matmul(p, hm(v)).transpose(0, 1));
  }
  return out;
}

// Error budget: the probabilities are rounded to bf16 (2^-9 relative) before
// P·V and the output once more (2^-9 relative): |err| ≤ 2^-8·max|v| + 2^-8·|ref|.
void ExpectClose(const at::Tensor& y, const at::Tensor& ref, const at::Tensor& v,
                 const std::string& what) {
  const at::Tensor yd = y.to(at::kDouble);
  const double vmax = v.abs().max().item<double>();
  const at::Tensor excess = (yd - ref).abs() - (ref.abs() * (1.0 / 256) + vmax / 256);
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << what << ": max |err| " << (yd - ref).abs().max().item<double>();
  const double cosine =
      at::cosine_similarity(yd.flatten(1), ref.flatten(1), 1).min().item<double>();
  EXPECT_GE(cosine, 0.9999) << what;
}

class FlashAttentionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    at::set_num_threads(2);
    at::manual_seed(11);
    if (!FlashAttentionSupported()) GTEST_SKIP() << "this CPU has no AVX-512 BF16";
  }
};

TEST_F(FlashAttentionTest, MatchesFloat64ReferenceOnOddSegments) {
  // Segments of 1, tails of the 48-query and 128-key blocks, several blocks.
  for (int64_t d : {16, 64, 72}) {
    const std::vector<int64_t> cu = {0, 1, 50, 50, 179, 436, 500};
    const int64_t n = cu.back(), heads = 3;
    const at::Tensor q = at::randn({n, heads, d}).to(at::kBFloat16);
    const at::Tensor k = at::randn({n, heads, d}).to(at::kBFloat16);
    const at::Tensor v = at::randn({n, heads, d}).to(at::kBFloat16);
    const double scale = 1.0 / std::sqrt(double(d));
    absl::StatusOr<at::Tensor> y = SegmentedFlashAttention(q, k, v, cu, scale);
    ASSERT_TRUE(y.ok()) << y.status();
    ExpectClose(*y, Reference(q, k, v, cu, scale), v, "D=" + std::to_string(d));
  }
}

TEST_F(FlashAttentionTest, PeakedScoresStayAccurate) {
  // Large scores (sharp softmax, running max changing across key blocks).
  const std::vector<int64_t> cu = {0, 300};
  const at::Tensor q = (at::randn({300, 2, 64}) * 4).to(at::kBFloat16);
  const at::Tensor k = (at::randn({300, 2, 64}) * 4).to(at::kBFloat16);
  const at::Tensor v = at::randn({300, 2, 64}).to(at::kBFloat16);
  absl::StatusOr<at::Tensor> y = SegmentedFlashAttention(q, k, v, cu, 0.125);
  ASSERT_TRUE(y.ok()) << y.status();
  ExpectClose(*y, Reference(q, k, v, cu, 0.125), v, "peaked");
}

TEST_F(FlashAttentionTest, ReadsStridedViewsOfAFusedQkv) {
  const int64_t n = 200, heads = 4, d = 32;
  const at::Tensor qkv = at::randn({n, 3, heads, d}).to(at::kBFloat16);
  const std::vector<int64_t> cu = {0, 64, 200};
  absl::StatusOr<at::Tensor> y =
      SegmentedFlashAttention(qkv.select(1, 0), qkv.select(1, 1), qkv.select(1, 2), cu, 0.2);
  ASSERT_TRUE(y.ok()) << y.status();
  const at::Tensor q = qkv.select(1, 0).contiguous(), k = qkv.select(1, 1).contiguous(),
                   v = qkv.select(1, 2).contiguous();
  absl::StatusOr<at::Tensor> dense = SegmentedFlashAttention(q, k, v, cu, 0.2);
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_TRUE(at::equal(*y, *dense));
}

TEST_F(FlashAttentionTest, AgreesWithThePreviousLibTorchPath) {
  const std::vector<int64_t> cu = {0, 784, 784 + 196};
  const int64_t n = cu.back(), heads = 4, d = 64;
  const at::Tensor q = at::randn({n, heads, d}).to(at::kBFloat16);
  const at::Tensor k = at::randn({n, heads, d}).to(at::kBFloat16);
  const at::Tensor v = at::randn({n, heads, d}).to(at::kBFloat16);
  nn::AttentionOptions o;
  o.scale = 0.125;
  const at::Tensor old = nn::SegmentedAttention(q, k, v, cu, o);
  absl::StatusOr<at::Tensor> y = SegmentedFlashAttention(q, k, v, cu, 0.125);
  ASSERT_TRUE(y.ok()) << y.status();
  const double cosine = at::cosine_similarity(y->to(at::kDouble).flatten(1),
                                              old.to(at::kDouble).flatten(1), 1)
                            .min()
                            .item<double>();
  EXPECT_GE(cosine, 0.999);
  ExpectClose(*y, Reference(q, k, v, cu, 0.125), v, "vs reference");
}

TEST_F(FlashAttentionTest, SplitOverThreadsGivesTheSameBits) {
  const std::vector<int64_t> cu = {0, 333, 400};
  const at::Tensor q = at::randn({400, 2, 64}).to(at::kBFloat16);
  const at::Tensor k = at::randn({400, 2, 64}).to(at::kBFloat16);
  const at::Tensor v = at::randn({400, 2, 64}).to(at::kBFloat16);
  absl::StatusOr<at::Tensor> one = SegmentedFlashAttention(q, k, v, cu, 0.1, 1);
  absl::StatusOr<at::Tensor> two = SegmentedFlashAttention(q, k, v, cu, 0.1, 2);
  ASSERT_TRUE(one.ok() && two.ok());
  EXPECT_TRUE(at::equal(*one, *two));
}

TEST(FlashAttentionInputTest, BadInputGetsInvalidArgument) {
  const at::Tensor t = at::randn({10, 2, 16}).to(at::kBFloat16);
  auto code = [](const absl::StatusOr<at::Tensor>& r) { return r.status().code(); };
  const std::vector<int64_t> ok = {0, 10};
  EXPECT_EQ(code(SegmentedFlashAttention(t.to(at::kFloat), t, t, ok, 1)),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SegmentedFlashAttention(t, t.narrow(0, 0, 9), t, ok, 1)),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SegmentedFlashAttention(t, t, t.transpose(1, 2), ok, 1)),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SegmentedFlashAttention(t, t, t, std::vector<int64_t>{0, 9}, 1)),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SegmentedFlashAttention(t, t, t, std::vector<int64_t>{0, 6, 4, 10}, 1)),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SegmentedFlashAttention(t, t, t, std::vector<int64_t>{}, 1)),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace vlm::kernels
