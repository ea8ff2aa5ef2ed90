// common/nn against straightforward ATen formulas (computed in float64 where
// the building block is float32, so the expectation is the exact maths).
#include "common/nn.h"

#include <cmath>
#include <cstdio>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "common/cpu_features.h"

namespace vlm::nn {
namespace {

at::Tensor Rand(std::vector<int64_t> shape, at::ScalarType dtype = at::kFloat) {
  return at::randn(shape, at::TensorOptions().dtype(at::kFloat)).to(dtype);
}

double MaxRelDiff(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  return (x - y).abs().max().item<double>() / std::max(1e-30, y.abs().max().item<double>());
}

// softmax(q kᵀ scale [+ mask]) v per head in float64; q [Hq, Sq, D], k, v [Hkv, Sk, D].
at::Tensor NaiveAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          double scale, bool causal = false, int64_t q_offset = 0) {
  const int64_t group = q.size(0) / k.size(0);
  at::Tensor qd = q.to(at::kDouble);
  at::Tensor kd = k.to(at::kDouble).repeat_interleave(group, 0);
  at::Tensor vd = v.to(at::kDouble).repeat_interleave(group, 0);
  at::Tensor s = at::matmul(qd, kd.transpose(1, 2)) * scale;
  if (causal) {
    for (int64_t i = 0; i < q.size(1); ++i) {
      for (int64_t j = q_offset + i + 1; j < k.size(1); ++j) {
        s.select(1, i).select(1, j).fill_(-INFINITY);
      }
    }
  }
  return at::matmul(at::softmax(s, -1), vd);
}

class NnTest : public ::testing::Test {
 protected:
  void SetUp() override {
    at::set_num_threads(1);
    at::manual_seed(1234);
  }
};

// Attention and softmax run twice: the AVX-512 fused softmax (where the CPU
// has it) and the portable ATen path.
class AttentionTest : public NnTest, public ::testing::WithParamInterface<bool> {
 protected:
  void SetUp() override {
    NnTest::SetUp();
    ForcePortableSoftmaxForTesting(GetParam());
  }
  void TearDown() override { ForcePortableSoftmaxForTesting(false); }
};

INSTANTIATE_TEST_SUITE_P(Paths, AttentionTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Portable" : "Fused";
                         });

TEST_P(AttentionTest, SoftmaxInPlaceComputesInFloat32) {
  for (int64_t cols : {1, 7, 16, 33, 4099}) {
    at::Tensor x = Rand({6, cols}) * 10;
    if (cols > 2) {
      x[1][0] = -INFINITY;  // masked entries become exactly 0
      x[2][cols - 1] = -INFINITY;
      x[3][1] = 80;  // large logits do not overflow
    }
    at::Tensor expected = at::softmax(x.to(at::kDouble), -1);
    at::Tensor f = x.clone();
    SoftmaxInPlace(f);
    EXPECT_LT((f.to(at::kDouble) - expected).abs().max().item<double>(), 1e-6) << "cols " << cols;
    if (cols > 2) {
      EXPECT_EQ(f[1][0].item<float>(), 0.0f);
    }
    // bf16: the float32 softmax of the bf16 values, rounded once to bf16.
    at::Tensor b = x.to(at::kBFloat16);
    at::Tensor b_expected = at::softmax(b.to(at::kDouble), -1);
    SoftmaxInPlace(b);
    at::Tensor rel = (b.to(at::kDouble) - b_expected).abs() / b_expected.abs().clamp_min(1e-30);
    EXPECT_LE(rel.max().item<double>(), 1.0 / 256) << "cols " << cols;  // half a bf16 ulp + exp
    at::Tensor row_sums = b.to(at::kDouble).sum(-1);
    EXPECT_LT((row_sums - 1).abs().max().item<double>(), 0.01) << "cols " << cols;
  }
}

TEST_F(NnTest, LayerNormMatchesFormula) {
  at::Tensor x = Rand({7, 48}) * 3 + 1, w = Rand({48}), b = Rand({48});
  at::Tensor xd = x.to(at::kDouble);
  at::Tensor mean = xd.mean(-1, true);
  at::Tensor var = (xd - mean).pow(2).mean(-1, true);
  at::Tensor expected = (xd - mean) / at::sqrt(var + 1e-6) * w.to(at::kDouble) + b.to(at::kDouble);
  EXPECT_LT(MaxRelDiff(LayerNorm(x, w, b, 1e-6), expected), 1e-6);
  at::Tensor y16 = LayerNorm(x.to(at::kBFloat16), w.to(at::kBFloat16), b.to(at::kBFloat16), 1e-6);
  EXPECT_EQ(y16.scalar_type(), at::kBFloat16);
  EXPECT_LT(MaxRelDiff(y16, expected), 3e-2);
}

TEST_F(NnTest, RmsNormCastsBackBeforeWeightLikeHf) {
  at::Tensor x = Rand({5, 32}, at::kBFloat16), w = Rand({32}, at::kBFloat16);
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor normed = (xf * at::rsqrt(xf.pow(2).mean(-1, true) + 1e-6)).to(at::kBFloat16);
  at::Tensor expected = w * normed;  // bf16 product, as HF computes it
  at::Tensor y = RmsNorm(x, w, 1e-6);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(y, expected));
  at::Tensor x32 = Rand({5, 32}), w32 = Rand({32});
  at::Tensor xd = x32.to(at::kDouble);
  at::Tensor e32 = w32.to(at::kDouble) * xd / at::sqrt(xd.pow(2).mean(-1, true) + 1e-6);
  EXPECT_LT(MaxRelDiff(RmsNorm(x32, w32, 1e-6), e32), 1e-6);
}

TEST_F(NnTest, LinearCastsInputToWeightDtype) {
  at::Tensor x = Rand({9, 24}), w = Rand({16, 24}), b = Rand({16});
  at::Tensor expected = at::matmul(x.to(at::kDouble), w.to(at::kDouble).t()) + b.to(at::kDouble);
  EXPECT_LT(MaxRelDiff(Linear(x, w, b), expected), 1e-6);
  EXPECT_LT(MaxRelDiff(Linear(x, w), expected - b.to(at::kDouble)), 1e-6);
  at::Tensor y16 = Linear(x, w.to(at::kBFloat16), b.to(at::kBFloat16));
  EXPECT_EQ(y16.scalar_type(), at::kBFloat16);
  EXPECT_LT(MaxRelDiff(y16, expected), 3e-2);
}

TEST_F(NnTest, GeluVariantsMatchFormulas) {
  at::Tensor z = at::linspace(-6, 6, 241, at::TensorOptions().dtype(at::kFloat));
  at::Tensor zd = z.to(at::kDouble);
  at::Tensor tanh_form =
      0.5 * zd * (1 + at::tanh(std::sqrt(2.0 / M_PI) * (zd + 0.044715 * zd.pow(3))));
  at::Tensor erf_form = 0.5 * zd * (1 + at::erf(zd / std::sqrt(2.0)));
  EXPECT_LT((GeluTanh(z).to(at::kDouble) - tanh_form).abs().max().item<double>(), 1e-6);
  EXPECT_LT((GeluErf(z).to(at::kDouble) - erf_form).abs().max().item<double>(), 1e-6);
  // The two differ enough that mixing them up is caught.
  EXPECT_GT((tanh_form - erf_form).abs().max().item<double>(), 1e-4);
}

TEST_F(NnTest, SwiGluMatchesFormula) {
  at::Tensor x = Rand({6, 16}), g = Rand({40, 16}), u = Rand({40, 16}), d = Rand({16, 40});
  at::Tensor xd = x.to(at::kDouble);
  at::Tensor a = at::matmul(xd, g.to(at::kDouble).t());
  at::Tensor expected =
      at::matmul(a * at::sigmoid(a) * at::matmul(xd, u.to(at::kDouble).t()), d.to(at::kDouble).t());
  EXPECT_LT(MaxRelDiff(SwiGlu(x, g, u, d), expected), 1e-5);
}

TEST_F(NnTest, RotateHalfSplitsHalvesNotPairs) {
  at::Tensor x = at::arange(1, 5, at::TensorOptions().dtype(at::kFloat)).view({1, 1, 4});
  at::Tensor expected = at::tensor({-3.f, -4.f, 1.f, 2.f}).view({1, 1, 4});
  EXPECT_TRUE(at::equal(RotateHalf(x), expected));
}

TEST_F(NnTest, ApplyRotaryMatchesFormulaAndPreservesNorm) {
  const int64_t s = 11, h = 3, d = 8;
  at::Tensor x = Rand({s, h, d});
  at::Tensor angle = Rand({s, d / 2}) * 5;
  at::Tensor emb = at::cat({angle, angle}, 1);
  at::Tensor cos = emb.cos(), sin = emb.sin();
  at::Tensor y = ApplyRotary(x, cos, sin);
  // Pair (i, i + d/2) rotates by angle i.
  at::Tensor x1 = x.narrow(2, 0, d / 2), x2 = x.narrow(2, d / 2, d / 2);
  at::Tensor c = angle.cos().unsqueeze(1), sn = angle.sin().unsqueeze(1);
  at::Tensor expected = at::cat({x1 * c - x2 * sn, x2 * c + x1 * sn}, 2);
  EXPECT_LT(MaxRelDiff(y, expected), 1e-6);
  EXPECT_LT(MaxRelDiff(y.norm(2, -1), x.norm(2, -1)), 1e-5);
  at::Tensor y16 = ApplyRotary(x.to(at::kBFloat16), cos, sin);
  EXPECT_EQ(y16.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(y16, ApplyRotary(x.to(at::kBFloat16).to(at::kFloat), cos, sin)
                                 .to(at::kBFloat16)));
}

TEST_P(AttentionTest, TiledAttentionEqualsUntiledForAnyTile) {
  const int64_t h = 3, s = 37, d = 8;
  at::Tensor q = Rand({h, s, d}), k = Rand({h, s, d}), v = Rand({h, s, d});
  const double scale = 1.0 / std::sqrt(double(d));
  at::Tensor expected = NaiveAttention(q, k, v, scale);
  for (int64_t tile : {1, 5, 16, 36, 37, 1024}) {
    AttentionOptions options;
    options.scale = scale;
    options.query_tile = tile;
    EXPECT_LT(MaxRelDiff(AttentionHeadMajor(q, k, v, options), expected), 1e-5) << "tile " << tile;
    // Token-major layout gives the same numbers, transposed.
    at::Tensor tm = Attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), options);
    EXPECT_LT(MaxRelDiff(tm.transpose(0, 1), expected), 1e-5) << "tile " << tile;
  }
}

TEST_P(AttentionTest, GroupedQueryHeadsUseKvHeadOfTheirGroup) {
  const int64_t hq = 6, hkv = 2, sq = 13, sk = 13, d = 16;
  at::Tensor q = Rand({hq, sq, d}), k = Rand({hkv, sk, d}), v = Rand({hkv, sk, d});
  AttentionOptions options;
  options.scale = 0.25;
  options.query_tile = 4;
  at::Tensor out = AttentionHeadMajor(q, k, v, options);
  EXPECT_LT(MaxRelDiff(out, NaiveAttention(q, k, v, 0.25)), 1e-5);
  // Head 2 (group 0 = heads 0..2) attends with kv head 0, head 3 with kv head 1.
  EXPECT_LT(MaxRelDiff(out[2], NaiveAttention(q.narrow(0, 2, 1), k.narrow(0, 0, 1),
                                              v.narrow(0, 0, 1), 0.25)[0]),
            1e-5);
  EXPECT_LT(MaxRelDiff(out[3], NaiveAttention(q.narrow(0, 3, 1), k.narrow(0, 1, 1),
                                              v.narrow(0, 1, 1), 0.25)[0]),
            1e-5);
}

TEST_P(AttentionTest, CausalAttentionWithOffsetMatchesMaskedSoftmax) {
  const int64_t hq = 4, hkv = 2, d = 8;
  struct Case { int64_t sq, sk, offset; };
  for (const Case& c : {Case{17, 17, 0}, Case{7, 20, 13}, Case{1, 9, 8}}) {
    at::Tensor q = Rand({hq, c.sq, d}), k = Rand({hkv, c.sk, d}), v = Rand({hkv, c.sk, d});
    at::Tensor expected = NaiveAttention(q, k, v, 0.3, true, c.offset);
    for (int64_t tile : {1, 3, 8, 64}) {
      AttentionOptions options;
      options.scale = 0.3;
      options.causal = true;
      options.q_offset = c.offset;
      options.query_tile = tile;
      EXPECT_LT(MaxRelDiff(AttentionHeadMajor(q, k, v, options), expected), 1e-5)
          << "sq " << c.sq << " sk " << c.sk << " offset " << c.offset << " tile " << tile;
    }
  }
}

TEST_P(AttentionTest, SegmentedAttentionIsBlockDiagonal) {
  const int64_t h = 2, d = 8;
  const std::vector<int64_t> cu = {0, 5, 5, 17, 30};  // includes an empty segment
  at::Tensor q = Rand({30, h, d}), k = Rand({30, h, d}), v = Rand({30, h, d});
  AttentionOptions options;
  options.scale = 0.35;
  for (int64_t tile : {2, 7, 100}) {
    options.query_tile = tile;
    at::Tensor out = SegmentedAttention(q, k, v, cu, options);
    for (size_t i = 0; i + 1 < cu.size(); ++i) {
      const int64_t b = cu[i], n = cu[i + 1] - cu[i];
      if (n == 0) continue;
      auto hm = [&](const at::Tensor& t) { return t.narrow(0, b, n).transpose(0, 1); };
      at::Tensor expected = NaiveAttention(hm(q), hm(k), hm(v), 0.35).transpose(0, 1);
      EXPECT_LT(MaxRelDiff(out.narrow(0, b, n), expected), 1e-5) << "segment " << i;
    }
  }
  // Changing another segment's keys and values leaves a segment untouched.
  at::Tensor k2 = k.clone(), v2 = v.clone();
  k2.narrow(0, 17, 13).normal_();
  v2.narrow(0, 17, 13).normal_();
  at::Tensor a = SegmentedAttention(q, k, v, cu, options);
  at::Tensor b = SegmentedAttention(q, k2, v2, cu, options);
  EXPECT_TRUE(at::equal(a.narrow(0, 0, 17), b.narrow(0, 0, 17)));
  EXPECT_FALSE(at::equal(a.narrow(0, 17, 13), b.narrow(0, 17, 13)));
}

TEST_P(AttentionTest, Bf16AttentionStaysCloseToExact) {
  const int64_t h = 4, s = 64, d = 32;
  at::Tensor q = Rand({h, s, d}), k = Rand({h, s, d}), v = Rand({h, s, d});
  AttentionOptions options;
  options.scale = 1.0 / std::sqrt(double(d));
  options.query_tile = 24;
  at::Tensor out = AttentionHeadMajor(q.to(at::kBFloat16), k.to(at::kBFloat16),
                                      v.to(at::kBFloat16), options);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  at::Tensor expected = NaiveAttention(q, k, v, options.scale);
  at::Tensor cosine = at::cosine_similarity(out.to(at::kDouble).reshape({-1, d}),
                                            expected.reshape({-1, d}), 1);
  EXPECT_GT(cosine.min().item<double>(), 0.999);
}

TEST_F(NnTest, AttentionRejectsBadShapes) {
  AttentionOptions options;
  EXPECT_THROW(AttentionHeadMajor(Rand({3, 4, 8}), Rand({2, 4, 8}), Rand({2, 4, 8}), options),
               c10::Error);  // 3 query heads over 2 kv heads
  EXPECT_THROW(AttentionHeadMajor(Rand({2, 4, 8}), Rand({2, 4, 4}), Rand({2, 4, 4}), options),
               c10::Error);  // head dims differ
  options.causal = true;
  options.q_offset = 2;
  EXPECT_THROW(AttentionHeadMajor(Rand({2, 4, 8}), Rand({2, 5, 8}), Rand({2, 5, 8}), options),
               c10::Error);  // positions 2..5 need 6 keys
  AttentionOptions bidir;
  const std::vector<int64_t> bad_cu = {0, 3, 5};
  EXPECT_THROW(SegmentedAttention(Rand({6, 2, 8}), Rand({6, 2, 8}), Rand({6, 2, 8}), bad_cu, bidir),
               c10::Error);  // cu_seqlens ends at 5, not 6
}

TEST(CpuFeaturesTest, Bf16StaysBf16WheneverAvx2AndFmaExist) {
  std::string warning;
  const ComputeDType chosen = ChooseComputeDType(ComputeDType::kBFloat16, &warning);
  const CpuFeatures& f = GetCpuFeatures();
  if (f.fast_bf16_matmul() || f.avx2_fma()) {
    EXPECT_EQ(chosen, ComputeDType::kBFloat16);
    EXPECT_TRUE(warning.empty()) << warning;
  } else {
    EXPECT_EQ(chosen, ComputeDType::kFloat32);
    EXPECT_NE(warning.find("float32"), std::string::npos);
  }
  EXPECT_EQ(ChooseComputeDType(ComputeDType::kFloat32, nullptr), ComputeDType::kFloat32);
  EXPECT_FALSE(GetCpuFeatures().Describe().empty());
}

// The decision for each kind of CPU, whatever this one is.
TEST(CpuFeaturesTest, ChoosesByFeatureSet) {
  CpuFeatures avx512;
  avx512.avx2 = avx512.fma = true;
  avx512.avx512f = avx512.avx512bw = avx512.avx512vl = avx512.avx512dq = true;
  CpuFeatures avx2;
  avx2.avx2 = avx2.fma = true;
  CpuFeatures avx2_no_fma;
  avx2_no_fma.avx2 = true;
  const CpuFeatures none;
  for (const CpuFeatures* f : {&avx512, &avx2}) {
    std::string warning;
    EXPECT_EQ(ChooseComputeDTypeFor(*f, ComputeDType::kBFloat16, &warning), ComputeDType::kBFloat16)
        << f->Describe();
    EXPECT_TRUE(warning.empty()) << warning;
    EXPECT_EQ(ChooseComputeDTypeFor(*f, ComputeDType::kFloat32, &warning), ComputeDType::kFloat32);
    EXPECT_TRUE(warning.empty()) << warning;
  }
  for (const CpuFeatures* f : std::initializer_list<const CpuFeatures*>{&avx2_no_fma, &none}) {
    std::string warning;
    EXPECT_EQ(ChooseComputeDTypeFor(*f, ComputeDType::kBFloat16, &warning), ComputeDType::kFloat32)
        << f->Describe();
    EXPECT_NE(warning.find("float32"), std::string::npos) << warning;
    EXPECT_NE(warning.find("AVX2"), std::string::npos) << warning;
  }
  EXPECT_NE(avx2.Describe().find("AVX2 kernels"), std::string::npos) << avx2.Describe();
}

TEST(CpuFeaturesTest, WarnsWhenOpenBlasRunsPrescottKernels) {
  at::matmul(at::ones({64, 64}), at::ones({64, 64}));  // OpenBLAS is loaded by now
  const std::string core = OpenBlasCoreName();
  std::printf("OpenBLAS core: \"%s\", suggested OPENBLAS_CORETYPE: \"%s\"\n", core.c_str(),
              SuggestedOpenBlasCoreType());
  const std::string warning = OpenBlasWarning();
  if (core == "Prescott" && *SuggestedOpenBlasCoreType() != '\0') {
    EXPECT_NE(warning.find(std::string("OPENBLAS_CORETYPE=") + SuggestedOpenBlasCoreType()),
              std::string::npos)
        << warning;
  }
  if (core == "SkylakeX" || core == "Haswell" || core == "Cooperlake" || core == "Zen") {
    EXPECT_TRUE(warning.empty()) << warning;
  }
}

}  // namespace
}  // namespace vlm::nn
