// Per-channel symmetric int8 quantization of weights.
#include "common/kernels/quantize.h"

#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace vlm::kernels {
namespace {

TEST(QuantizeTest, RoundTripErrorIsAtMostHalfAStepPerChannel) {
  at::manual_seed(1);
  // Rows of very different magnitudes: each gets its own scale.
  const at::Tensor w = at::randn({37, 100}) * at::logspace(-4, 1, 37).unsqueeze(1);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    const at::Tensor wd = w.to(dt);
    absl::StatusOr<QuantizedWeight> q = QuantizeInt8(wd);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(q->n(), 37);
    EXPECT_EQ(q->k(), 100);
    EXPECT_EQ(q->k_padded(), 128);
    const at::Tensor ref = wd.to(at::kFloat);
    const at::Tensor amax = ref.abs().amax(1);
    const at::Tensor err = (DequantizeInt8(*q) - ref).abs().amax(1);
    // |w - s·round(w/s)| <= s/2 with s = amax/127 (plus f32 rounding).
    EXPECT_TRUE((err <= amax / 254 * 1.0001 + 1e-12).all().item<bool>());
    for (int64_t r = 0; r < q->n(); ++r) {
      EXPECT_FLOAT_EQ(q->scales()[r], amax[r].item<float>() / 127.0f);
      int max_q = 0;
      for (int64_t i = 0; i < q->k(); ++i) max_q = std::max(max_q, std::abs(q->value(r, i)));
      EXPECT_EQ(max_q, 127) << "the largest weight of a row maps to ±127";
      for (int64_t i = q->k(); i < q->k_padded(); ++i) EXPECT_EQ(q->value(r, i), 0);
    }
    EXPECT_EQ(q->bytes(), 37u * 128 + 37u * 4);
  }
}

TEST(QuantizeTest, ZeroRowsGetZeroScaleAndZeros) {
  at::Tensor w = at::zeros({3, 64});
  w[1][5] = -2.0f;
  absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->scales()[0], 0.0f);
  EXPECT_EQ(q->value(1, 5), -127);
  EXPECT_EQ(q->row(1)[5], 1);  // stored as q + 128
  EXPECT_TRUE(at::equal(DequantizeInt8(*q), w));
}

// The stored values are exactly clamp(round-half-even(w·(1/scale)), ±127) + 128,
// computed here with LibTorch ops in f32: for bf16 and f32 weights, K with and
// without 16-element tails, and rows read through a stride (a transposed view).
TEST(QuantizeTest, ValuesAreRoundedWeightTimesInverseScale) {
  at::manual_seed(3);
  for (int64_t k : {1, 15, 16, 100, 2048}) {
    const at::Tensor base = at::randn({70, k}) * at::logspace(-3, 1, 70).unsqueeze(1);
    for (const at::Tensor& w : {base, base.to(at::kBFloat16), base.t().contiguous().t()}) {
      absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
      ASSERT_TRUE(q.ok()) << q.status();
      const at::Tensor wf = w.to(at::kFloat);
      const at::Tensor scale = wf.abs().amax(1, true) / 127.0f;
      const at::Tensor inv = at::where(scale > 0, 1.0f / scale, at::zeros_like(scale));
      const at::Tensor expected = at::clamp(at::round(wf * inv), -127, 127).to(at::kInt);
      at::Tensor got = at::empty({q->n(), q->k()}, at::kInt);
      for (int64_t r = 0; r < q->n(); ++r) {
        for (int64_t i = 0; i < q->k(); ++i) got[r][i] = q->value(r, i);
        EXPECT_EQ(q->scales()[r], scale[r][0].item<float>());
      }
      EXPECT_TRUE(at::equal(got, expected)) << "K=" << k << " " << w.scalar_type();
    }
  }
}

TEST(QuantizeTest, InfinityIsInvalidArgument) {
  at::Tensor w = at::randn({100, 40}).to(at::kBFloat16);
  w[77][39] = -std::numeric_limits<float>::infinity();
  absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
  EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(q.status().message().find("row 77"), std::string::npos) << q.status();
}

TEST(QuantizeTest, BadInputIsInvalidArgument) {
  EXPECT_EQ(QuantizeInt8(at::randn({4})).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeInt8(at::ones({2, 2}, at::kInt)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeInt8(at::Tensor()).status().code(), absl::StatusCode::kInvalidArgument);
  at::Tensor w = at::randn({4, 8});
  w[2][3] = std::nanf("");
  absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
  EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(q.status().message().find("row 2"), std::string::npos) << q.status();
}

}  // namespace
}  // namespace vlm::kernels
