// DecodeAttention (the AVX-512 bf16 kernel) against its ATen formulation and
// against float32 attention on the same bf16 values.
#include "services/language/decode_attention.h"

#include <cmath>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/nn.h"

namespace vlm::language {
namespace {

struct Shape {
  int64_t hq, hkv, d, length, capacity;
};

// max |a - b| / max |b|
double RelErr(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>() /
         b.to(at::kFloat).abs().max().item<double>();
}

TEST(DecodeAttentionTest, Bf16KernelMatchesAtenAndFloat32) {
  const Shape shapes[] = {{4, 2, 32, 1, 8},      {4, 2, 32, 37, 64},   {16, 8, 128, 300, 512},
                          {16, 8, 128, 1025, 1100}, {8, 8, 64, 17, 17}, {8, 2, 64, 200, 256},
                          {2, 1, 256, 33, 40}};
  at::manual_seed(3);
  for (const Shape& s : shapes) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.d));
    // Scores of a few units: a peaked but not one-hot softmax.
    at::Tensor q = (at::randn({s.hq, s.d}) * 2).to(at::kBFloat16);
    at::Tensor k = at::randn({s.hkv, s.capacity, s.d}).to(at::kBFloat16);
    at::Tensor v = at::randn({s.hkv, s.capacity, s.d}).to(at::kBFloat16);
    at::Tensor got = DecodeAttention(q, k, v, s.length, scale);
    at::Tensor aten = DecodeAttentionReference(q, k, v, s.length, scale);
    ASSERT_EQ(got.sizes(), (at::IntArrayRef{s.hq, s.d}));
    EXPECT_EQ(got.scalar_type(), at::kBFloat16);
    // float32 attention over the same bf16 values (token-major nn::Attention).
    nn::AttentionOptions o;
    o.scale = scale;
    at::Tensor f32 = nn::Attention(q.to(at::kFloat).unsqueeze(0),
                                   k.narrow(1, 0, s.length).transpose(0, 1).to(at::kFloat),
                                   v.narrow(1, 0, s.length).transpose(0, 1).to(at::kFloat), o)[0];
    const double e_kernel = RelErr(got, f32), e_aten = RelErr(aten, f32);
    // Both round q·scale, scores, probabilities and the output to bf16.
    EXPECT_LT(e_kernel, 3e-2) << s.hq << "x" << s.d << " L=" << s.length;
    EXPECT_LT(e_aten, 3e-2) << s.hq << "x" << s.d << " L=" << s.length;
    EXPECT_LT(RelErr(got, aten), 3e-2) << s.hq << "x" << s.d << " L=" << s.length;
    std::printf("  Hq %ld Hkv %ld D %ld L %ld: kernel %.1e, aten %.1e vs f32, kernel vs aten %.1e "
                "(kernel used: %d)\n",
                static_cast<long>(s.hq), static_cast<long>(s.hkv), static_cast<long>(s.d),
                static_cast<long>(s.length), e_kernel, e_aten, RelErr(got, aten),
                DecodeAttentionHasKernel(at::kBFloat16, s.d));
  }
}

TEST(DecodeAttentionTest, OneKeyReturnsItsValue) {
  at::Tensor q = at::randn({4, 32}).to(at::kBFloat16);
  at::Tensor k = at::randn({2, 8, 32}).to(at::kBFloat16);
  at::Tensor v = at::randn({2, 8, 32}).to(at::kBFloat16);
  at::Tensor got = DecodeAttention(q, k, v, 1, 0.2);
  // Query heads 0, 1 read kv head 0; 2, 3 read kv head 1 (i / group).
  EXPECT_TRUE(at::equal(got[0], v[0][0]));
  EXPECT_TRUE(at::equal(got[1], v[0][0]));
  EXPECT_TRUE(at::equal(got[3], v[1][0]));
}

TEST(DecodeAttentionTest, Float32UsesAtenPath) {
  at::Tensor q = at::randn({4, 32});
  at::Tensor k = at::randn({2, 16, 32});
  at::Tensor v = at::randn({2, 16, 32});
  EXPECT_FALSE(DecodeAttentionHasKernel(at::kFloat, 32));
  EXPECT_TRUE(at::equal(DecodeAttention(q, k, v, 9, 0.3), DecodeAttentionReference(q, k, v, 9, 0.3)));
}

TEST(DecodeAttentionTest, RejectsBadShapes) {
  at::Tensor q = at::randn({3, 32}).to(at::kBFloat16);  // 3 heads over 2 kv heads
  at::Tensor k = at::randn({2, 16, 32}).to(at::kBFloat16);
  EXPECT_THROW(DecodeAttention(q, k, k, 4, 1.0), c10::Error);
  at::Tensor q4 = at::randn({4, 32}).to(at::kBFloat16);
  EXPECT_THROW(DecodeAttention(q4, k, k, 17, 1.0), c10::Error);  // beyond capacity
  EXPECT_THROW(DecodeAttention(q4, k, k, 0, 1.0), c10::Error);
}

}  // namespace
}  // namespace vlm::language
