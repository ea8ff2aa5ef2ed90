// Per-channel symmetric int8 quantization of weights.
#include "common/kernels/quantize.h"

#include <cmath>

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
