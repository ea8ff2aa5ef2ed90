// Symmetric int8 quantization of weights with a scale per group of 32.
#include "common/kernels/quantize.h"

#include <algorithm>
#include <cmath>
#include <vector>
#include <limits>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace vlm::kernels {
namespace {

// Expected scales of quantize.h computed with LibTorch ops: [N, groups] f32.
at::Tensor ExpectedScales(const at::Tensor& w) {
  const at::Tensor wf = w.to(at::kFloat);
  const int64_t n = wf.size(0), k = wf.size(1), kp = (k + kInt8Group - 1) / kInt8Group * kInt8Group;
  at::Tensor padded = at::zeros({n, kp});
  padded.narrow(1, 0, k).copy_(wf);
  const at::Tensor gmax = padded.view({n, kp / kInt8Group, kInt8Group}).abs().amax(-1);  // [N, G]
  const at::Tensor rmax = wf.abs().amax(1, true);                                       // [N, 1]
  const at::Tensor ratio =
      at::where(rmax > 0, gmax / rmax, at::zeros_like(gmax)).to(at::kHalf).to(at::kFloat);
  return rmax / 127.0f * ratio;
}

TEST(QuantizeTest, RoundTripErrorIsAtMostHalfAStepPerGroup) {
  at::manual_seed(1);
  // Rows of very different magnitudes, and groups within a row too.
  const at::Tensor w = at::randn({37, 100}) * at::logspace(-4, 1, 37).unsqueeze(1) *
                       at::logspace(-2, 0, 100).unsqueeze(0);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    const at::Tensor wd = w.to(dt);
    absl::StatusOr<QuantizedWeight> q = QuantizeInt8(wd);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(q->n(), 37);
    EXPECT_EQ(q->k(), 100);
    EXPECT_EQ(q->k_padded(), 128);
    EXPECT_EQ(q->groups(), 4);
    const at::Tensor ref = wd.to(at::kFloat);
    const at::Tensor gmax = at::constant_pad_nd(ref.abs(), {0, 28}, 0).view({37, 4, 32}).amax(-1);
    const at::Tensor step = gmax.repeat_interleave(32, 1).narrow(1, 0, 100) / 127;
    const at::Tensor err = (DequantizeInt8(*q) - ref).abs();
    // |w - s·round(w/s)| <= s/2 with s = group amax/127 (f16 ratio: s within 2^-11).
    EXPECT_TRUE((err <= step * (0.5 + 1e-3) + 1e-12).all().item<bool>());
    for (int64_t r = 0; r < q->n(); ++r) {
      EXPECT_FLOAT_EQ(q->row_scales()[r], ref[r].abs().max().item<float>() / 127.0f);
      int max_q = 0;
      for (int64_t i = 0; i < q->k(); ++i) max_q = std::max(max_q, std::abs(q->value(r, i)));
      EXPECT_EQ(max_q, 127) << "the largest weight of a row maps to ±127";
      for (int64_t i = q->k(); i < q->k_padded(); ++i) EXPECT_EQ(q->value(r, i), 0);
    }
    EXPECT_EQ(q->bytes(), 37u * 128 + 37u * 4 + 37u * 4 * 2);
  }
}

TEST(QuantizeTest, ZeroRowsGetZeroScaleAndZeros) {
  at::Tensor w = at::zeros({3, 64});
  w[1][5] = -2.0f;
  absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->row_scales()[0], 0.0f);
  EXPECT_EQ(q->scale(1, 1), 0.0f);  // an all-zero group of a nonzero row
  EXPECT_EQ(q->value(1, 5), -127);
  EXPECT_EQ(q->row(1)[5], 1);  // stored as q + 128
  EXPECT_TRUE(at::equal(DequantizeInt8(*q), w));
}

// StoredIndex is a permutation of each row and the stored bytes are q + 128
// at their natural index: full blocks of 512 interleaved (quad j of group l
// at quad 16·j + l), the rest in order.
TEST(QuantizeTest, StoredIndexInterleavesFullBlocksAndKeepsTheTailInOrder) {
  for (int64_t kp : {32, 512, 704, 2048}) {
    std::vector<int> seen(kp, 0);
    for (int64_t k = 0; k < kp; ++k) ++seen[StoredIndex(k, kp)];
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; })) << kp;
  }
  EXPECT_EQ(StoredIndex(0, 512), 0);
  EXPECT_EQ(StoredIndex(1, 512), 1);
  EXPECT_EQ(StoredIndex(3, 512), 3);
  EXPECT_EQ(StoredIndex(4, 512), 64);    // quad 1 of group 0
  EXPECT_EQ(StoredIndex(32, 512), 4);    // quad 0 of group 1
  EXPECT_EQ(StoredIndex(511, 512), 511);
  EXPECT_EQ(StoredIndex(512 + 35, 1024), 512 + 4 + 3);
  EXPECT_EQ(StoredIndex(530, 704), 530);  // the tail after one block
  at::manual_seed(2);
  const at::Tensor w = at::randn({3, 700});
  absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
  ASSERT_TRUE(q.ok());
  for (int64_t i = 0; i < 700; ++i) {
    EXPECT_EQ(int{q->row(2)[StoredIndex(i, 704)]}, q->value(2, i) + 128);
  }
}

// The stored values are exactly clamp(round-half-even(w·(1/scale)), ±127),
// with the group scales of quantize.h, computed here with LibTorch ops in
// f32: for bf16 and f32 weights, K with and without group tails and full
// blocks, and rows read through a stride (a transposed view).
TEST(QuantizeTest, ValuesAreRoundedWeightTimesInverseGroupScale) {
  at::manual_seed(3);
  for (int64_t k : {1, 15, 32, 100, 700, 2048}) {
    const at::Tensor base = at::randn({70, k}) * at::logspace(-3, 1, 70).unsqueeze(1);
    for (const at::Tensor& w : {base, base.to(at::kBFloat16), base.t().contiguous().t()}) {
      absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
      ASSERT_TRUE(q.ok()) << q.status();
      const at::Tensor wf = w.to(at::kFloat);
      const at::Tensor scales = ExpectedScales(w);  // [N, G]
      const at::Tensor scale = scales.repeat_interleave(kInt8Group, 1).narrow(1, 0, k);
      const at::Tensor inv = at::where(scale > 0, 1.0f / scale, at::zeros_like(scale));
      const at::Tensor expected = at::clamp(at::round(wf * inv), -127, 127).to(at::kInt);
      at::Tensor got = at::empty({q->n(), q->k()}, at::kInt);
      for (int64_t r = 0; r < q->n(); ++r) {
        for (int64_t i = 0; i < q->k(); ++i) got[r][i] = q->value(r, i);
        for (int64_t g = 0; g < q->groups(); ++g) {
          ASSERT_EQ(q->scale(r, g), scales[r][g].item<float>()) << "row " << r << " group " << g;
        }
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
