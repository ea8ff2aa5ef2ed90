// int8-weight GEMV: every path against a float64 reference of the same
// quantized math, path agreement, accuracy against the unquantized product,
// int16 against 8-bit activation groups, batch-row independence, and one
// decoder layer's logits int8 vs bf16.
#include "common/kernels/gemv_int8.h"

#include <array>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "common/kernels/gemv.h"

namespace vlm::kernels {
namespace {

// x quantized per block of `block` to ±limit (the kernel: 32, 32639), dequantized: [B, K] f64.
at::Tensor BlockQuantized(const at::Tensor& x, int64_t block, double limit = 32639) {
  const at::Tensor xf = x.to(at::kFloat);
  const int64_t b = xf.size(0), k = xf.size(1), kp = (k + block - 1) / block * block;
  at::Tensor padded = at::zeros({b, kp});
  padded.narrow(1, 0, k).copy_(xf);
  const at::Tensor blocks = padded.view({b, kp / block, block});
  const at::Tensor d = blocks.abs().amax(-1, true) / limit;
  const at::Tensor q = at::where(d > 0, at::round(blocks / d), at::zeros_like(blocks));
  return (q * d).view({b, kp}).narrow(1, 0, k).to(at::kDouble);
}

// The quantization step d of each element's block of `block`: [B, K] f64.
at::Tensor BlockStep(const at::Tensor& x, int64_t block) {
  const at::Tensor xf = x.to(at::kFloat);
  const int64_t b = xf.size(0), k = xf.size(1), kp = (k + block - 1) / block * block;
  at::Tensor padded = at::zeros({b, kp});
  padded.narrow(1, 0, k).copy_(xf);
  const at::Tensor d = padded.view({b, kp / block, block}).abs().amax(-1, true) / 32639.0f;
  return d.expand({b, kp / block, block}).reshape({b, kp}).narrow(1, 0, k).to(at::kDouble);
}

class GemvInt8PathTest : public ::testing::TestWithParam<GemvInt8Path> {
 protected:
  void SetUp() override {
    at::set_num_threads(2);
    at::manual_seed(99);
    std::string missing;
    if (!GemvInt8PathSupported(GetParam(), &missing)) {
      GTEST_SKIP() << "the " << GemvInt8PathName(GetParam()) << " path needs " << missing;
    }
    options_.path = GetParam();
  }
  GemvInt8Options options_;
};

TEST_P(GemvInt8PathTest, MatchesTheQuantizedMathInFloat64) {
  for (auto [b, n, k] : {std::array<int64_t, 3>{1, 1, 1}, {1, 33, 70}, {2, 64, 64}, {3, 100, 129},
                         {5, 17, 2048}, {8, 257, 300}, {2, 1000, 256},
                         {1, 1000, 320}, {1, 300, 6144}, {3, 70, 700}, {9, 40, 1024},
                         {12, 65, 545}}) {  // N = 1000, 300: split over threads
    const at::Tensor w = at::randn({n, k}) * 0.05;
    const at::Tensor x = at::randn({b, k});
    absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
    ASSERT_TRUE(q.ok());
    at::Tensor y;
    ASSERT_TRUE(GemvInt8(x, *q, &y, options_).ok());
    const at::Tensor ref =
        at::matmul(BlockQuantized(x, 32), DequantizeInt8(*q).to(at::kDouble).t());
    const at::Tensor abs_ref = at::matmul(BlockQuantized(x, 32).abs(),
                                          DequantizeInt8(*q).to(at::kDouble).abs().t());
    // Integer sums are exact; only f32 scaling and summation round.
    const double excess = ((y.to(at::kDouble) - ref).abs() - abs_ref * 1e-5).max().item<double>();
    EXPECT_LE(excess, 1e-9) << "B=" << b << " N=" << n << " K=" << k;
  }
}

TEST_P(GemvInt8PathTest, Bf16InputAndOutputWork) {
  const at::Tensor w = at::randn({40, 96}) * 0.05, x = at::randn({2, 96}).to(at::kBFloat16);
  absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
  ASSERT_TRUE(q.ok());
  at::Tensor y = at::empty({2, 40}, at::kBFloat16);
  ASSERT_TRUE(GemvInt8(x, *q, &y, options_).ok());
  const at::Tensor ref = at::matmul(BlockQuantized(x, 32), DequantizeInt8(*q).to(at::kDouble).t());
  EXPECT_LT((y.to(at::kDouble) - ref).abs().max().item<double>(),
            ref.abs().max().item<double>() / 128);
}

INSTANTIATE_TEST_SUITE_P(Paths, GemvInt8PathTest,
                         ::testing::Values(GemvInt8Path::kAvx512Vnni, GemvInt8Path::kScalar),
                         [](const auto& info) { return std::string(GemvInt8PathName(info.param)); });

TEST(GemvInt8Test, PathsAgree) {
  if (!GemvInt8PathSupported(GemvInt8Path::kAvx512Vnni)) GTEST_SKIP() << "no AVX-512 VNNI";
  at::manual_seed(5);
  const at::Tensor w = at::randn({300, 2048}) * 0.02;
  absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
  ASSERT_TRUE(q.ok());
  for (int64_t batch : {1, 4, 8}) {
    const at::Tensor x = at::randn({batch, 2048});
    at::Tensor a, b;
    GemvInt8Options o;
    o.path = GemvInt8Path::kAvx512Vnni;
    ASSERT_TRUE(GemvInt8(x, *q, &a, o).ok());
    o.path = GemvInt8Path::kScalar;
    ASSERT_TRUE(GemvInt8(x, *q, &b, o).ok());
    EXPECT_LT(((a - b).abs() / (b.abs() + 1e-3)).max().item<float>(), 1e-4) << "B=" << batch;
  }
}

// One-hot weight rows (w[n, k] = 1 iff k == n) make every output a single
// product, scale·d·xq·127, with no sum to round differently: the VNNI path's
// vector quantization of x (scales, rounding, clamping, start values for the
// +128 offset) must then give bit-identical results to the scalar path, for
// bf16 and f32 x, K with and without tails, and batch rows in every group size.
TEST(GemvInt8Test, VnniQuantizesActivationsExactlyAsScalar) {
  if (!GemvInt8PathSupported(GemvInt8Path::kAvx512Vnni)) GTEST_SKIP() << "no AVX-512 VNNI";
  at::manual_seed(12);
  for (int64_t k : {1, 31, 70, 129, 700, 2048}) {
    absl::StatusOr<QuantizedWeight> q = QuantizeInt8(at::eye(k));
    ASSERT_TRUE(q.ok());
    for (int64_t b : {1, 3, 4, 5, 8}) {
      at::Tensor x = at::randn({b, k}) * at::logspace(-3, 2, k).unsqueeze(0);
      x.select(1, k / 2).mul_(40);  // one outlier channel
      x.select(1, 0).zero_();
      for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
        at::Tensor a, s;
        GemvInt8Options o;
        o.path = GemvInt8Path::kAvx512Vnni;
        ASSERT_TRUE(GemvInt8(x.to(dt), *q, &a, o).ok());
        o.path = GemvInt8Path::kScalar;
        ASSERT_TRUE(GemvInt8(x.to(dt), *q, &s, o).ok());
        EXPECT_TRUE(at::equal(a, s)) << "K=" << k << " B=" << b << " " << dt;
        // And they are the block-quantized x itself (w = I): to within one
        // quantization step of the block where x·(1/d) and x/d round apart.
        const at::Tensor ref = BlockQuantized(x.to(dt), 32);
        const at::Tensor step = BlockStep(x.to(dt), 32);
        // (plus f32 rounding of the scale products: 1e-6 relative).
        const at::Tensor bad = (a.to(at::kDouble) - ref).abs() > step * 1.001 + ref.abs() * 1e-6;
        EXPECT_FALSE(bad.any().item<bool>()) << "K=" << k << " B=" << b << " " << dt;
      }
    }
  }
}

TEST_P(GemvInt8PathTest, RowsOfXWithAStrideWork) {
  const at::Tensor w = at::randn({96, 100}) * 0.05;
  const at::Tensor wide = at::randn({3, 160});
  const at::Tensor x = wide.narrow(1, 20, 100);  // row stride 160
  absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
  ASSERT_TRUE(q.ok());
  at::Tensor y, y_contiguous;
  ASSERT_TRUE(GemvInt8(x, *q, &y, options_).ok());
  ASSERT_TRUE(GemvInt8(x.contiguous(), *q, &y_contiguous, options_).ok());
  EXPECT_TRUE(at::equal(y, y_contiguous));
}

// A decoder-like hidden state: unit-scale channels plus a few outliers 50x larger.
at::Tensor HiddenWithOutliers(int64_t b, int64_t k) {
  at::Tensor x = at::randn({b, k});
  for (int64_t c : {7, 500, 1201}) {
    if (c < k) x.select(1, c).mul_(50);
  }
  return x;
}

// The activation error (kernel against x·wqᵀ with exact x) of int16 groups
// is far below that of 8-bit groups of 32 (llama.cpp's Q8_0 activations),
// and below the weights' own quantization error.
TEST(GemvInt8Test, Int16ActivationErrorIsFarBelowInt8AndWeightError) {
  at::manual_seed(8);
  const int64_t k = 2048;
  const at::Tensor w = at::randn({512, k}) * 0.02, x = HiddenWithOutliers(2, k);
  absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
  ASSERT_TRUE(q.ok());
  at::Tensor y;
  ASSERT_TRUE(GemvInt8(x, *q, &y).ok());
  const at::Tensor wd = DequantizeInt8(*q).to(at::kDouble).t();
  const at::Tensor exact = at::matmul(x.to(at::kDouble), wd);
  const double int16_err = (y.to(at::kDouble) - exact).norm().item<double>();
  const double int8_err = (at::matmul(BlockQuantized(x, 32, 127), wd) - exact).norm().item<double>();
  const double weight_err =
      (at::matmul(x.to(at::kDouble), w.to(at::kDouble).t()) - exact).norm().item<double>();
  std::printf("||y - x·wqᵀ||: int16 groups %.4g, int8 groups of 32 %.4g; weight rounding %.4g\n",
              int16_err, int8_err, weight_err);
  EXPECT_LT(int16_err * 50, int8_err);
  EXPECT_LT(int16_err * 50, weight_err);
}

// A batch row's result does not depend on the other rows of the call or on
// the batch size, bit for bit: the decoder relies on it for batch invariance.
TEST_P(GemvInt8PathTest, EachBatchRowIsIndependentOfTheBatch) {
  for (int64_t k : {64, 700, 2048}) {
    const at::Tensor w = at::randn({130, k}) * 0.05;
    const at::Tensor x = HiddenWithOutliers(11, k).to(at::kBFloat16);
    absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
    ASSERT_TRUE(q.ok());
    at::Tensor all;
    ASSERT_TRUE(GemvInt8(x, *q, &all, options_).ok());
    for (int64_t b = 0; b < 11; ++b) {
      at::Tensor one;
      ASSERT_TRUE(GemvInt8(x.narrow(0, b, 1), *q, &one, options_).ok());
      EXPECT_TRUE(at::equal(one[0], all[b])) << "K=" << k << " row " << b;
    }
    at::Tensor three;  // rows 4..6 as a batch of 3
    ASSERT_TRUE(GemvInt8(x.narrow(0, 4, 3), *q, &three, options_).ok());
    EXPECT_TRUE(at::equal(three, all.narrow(0, 4, 3))) << "K=" << k;
  }
}

// Decode batches of 1..8 rows (B = 5..8 walk a task's rows once per group of 4
// batch rows): each row equals its 1-row call. N = 131: an odd row after the
// pairs, tasks of 64 rows and a partial last one.
TEST_P(GemvInt8PathTest, DecodeRowsEqualTheirOneRowCalls) {
  for (int64_t k : {700, 2048}) {
    const at::Tensor w = at::randn({131, k}) * 0.05;
    absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
    ASSERT_TRUE(q.ok());
    for (int64_t b = 1; b <= 8; ++b) {
      const at::Tensor x = HiddenWithOutliers(b, k).to(at::kBFloat16);
      at::Tensor y;
      ASSERT_TRUE(GemvInt8(x, *q, &y, options_).ok());
      for (int64_t r = 0; r < b; ++r) {
        at::Tensor one;
        ASSERT_TRUE(GemvInt8(x.narrow(0, r, 1), *q, &one, options_).ok());
        EXPECT_TRUE(at::equal(one, y.narrow(0, r, 1))) << "K=" << k << " B=" << b << " row " << r;
      }
    }
  }
}

// Prefill-sized batches (more than 8 rows: the weights are read once per call
// and every row block serves all batch rows) give each row bit for bit what
// a 1-row decode call gives, for every batch size 1..70 and 512, at batch
// offsets that are not multiples of the row groups, with K tails inside and
// after the 512-element blocks (700 = 512 + 5 groups + 28, 1100), N not a
// multiple of the row tiles or blocks (33, 131) and bf16 or f32 output.
TEST_P(GemvInt8PathTest, PrefillBatchRowsAreBitIdenticalToOneRowCalls) {
  for (auto [n, k] : {std::array<int64_t, 2>{131, 700}, {33, 2048}, {67, 1100}}) {
    const at::Tensor w = at::randn({n, k}) * 0.05;
    absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
    ASSERT_TRUE(q.ok());
    const int64_t rows = 520;
    const at::Tensor x = HiddenWithOutliers(rows, k).to(at::kBFloat16);
    for (at::ScalarType out : {at::kFloat, at::kBFloat16}) {
      std::vector<at::Tensor> one(rows);
      for (int64_t i = 0; i < rows; ++i) {
        one[i] = at::empty({1, n}, out);
        ASSERT_TRUE(GemvInt8(x.narrow(0, i, 1), *q, &one[i], options_).ok());
      }
      std::vector<int64_t> batches;
      for (int64_t b = 1; b <= 70; ++b) batches.push_back(b);
      batches.push_back(512);
      for (int64_t b : batches) {
        const int64_t offset = b % 5;
        at::Tensor y = at::empty({b, n}, out);
        ASSERT_TRUE(GemvInt8(x.narrow(0, offset, b), *q, &y, options_).ok());
        for (int64_t i = 0; i < b; ++i) {
          ASSERT_TRUE(at::equal(y[i], one[offset + i][0]))
              << "N=" << n << " K=" << k << " B=" << b << " row " << i << " " << out;
        }
      }
    }
  }
}

// The same with x rows that are a column slice of a wider tensor (row stride
// larger than K), as the decoder's views can be.
TEST_P(GemvInt8PathTest, PrefillBatchWithRowStrideMatchesOneRowCalls) {
  const at::Tensor w = at::randn({70, 600}) * 0.05;
  absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
  ASSERT_TRUE(q.ok());
  const at::Tensor wide = HiddenWithOutliers(40, 900);
  const at::Tensor x = wide.narrow(1, 150, 600);  // [40, 600], row stride 900
  at::Tensor y;
  ASSERT_TRUE(GemvInt8(x, *q, &y, options_).ok());
  for (int64_t i = 0; i < 40; ++i) {
    at::Tensor one;
    ASSERT_TRUE(GemvInt8(x.narrow(0, i, 1), *q, &one, options_).ok());
    EXPECT_TRUE(at::equal(y[i], one[0])) << "row " << i;
  }
}

TEST(GemvInt8Test, AccuracyAgainstUnquantizedWeights) {
  at::manual_seed(4);
  const at::Tensor w = at::randn({1024, 2048}) * 0.02, x = HiddenWithOutliers(3, 2048);
  absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
  ASSERT_TRUE(q.ok());
  at::Tensor y;
  ASSERT_TRUE(GemvInt8(x, *q, &y).ok());
  const at::Tensor exact = at::matmul(x.to(at::kDouble), w.to(at::kDouble).t());
  const double cosine = at::cosine_similarity(y.to(at::kDouble), exact, 1).min().item<double>();
  EXPECT_GE(cosine, 0.9995);
}

// One Qwen3 decoder layer for one token (pre-norm attention over a short
// cache, SwiGLU MLP), then the final norm and an LM head: the matrix-vector
// products run through `linear`. Weights N(0, 0.02) as initialized models
// have, RMSNorm gains around 1 with a few large ones (outlier channels).
struct Layer {
  at::Tensor q, k, v, o, gate, up, down, head, norm1, norm2, norm_f, cache_k, cache_v;
};

at::Tensor Rms(const at::Tensor& x, const at::Tensor& g) {
  return x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * g;
}

template <typename Linear>
at::Tensor LayerLogits(const Layer& l, const at::Tensor& x, Linear linear) {
  const int64_t heads = 16, kv_heads = 8, hd = 128;
  at::Tensor h = Rms(x, l.norm1);
  const at::Tensor q = linear(h, 0).view({heads, hd});
  const at::Tensor k = at::cat({l.cache_k, linear(h, 1).view({1, kv_heads, hd})}, 0);  // [S, 8, hd]
  const at::Tensor v = at::cat({l.cache_v, linear(h, 2).view({1, kv_heads, hd})}, 0);
  const at::Tensor kk = k.repeat_interleave(2, 1).permute({1, 2, 0});  // [16, hd, S]
  const at::Tensor p = at::softmax(at::matmul(q.unsqueeze(1), kk) / std::sqrt(128.0), -1);
  const at::Tensor attn = at::matmul(p, v.repeat_interleave(2, 1).permute({1, 0, 2}));  // [16,1,hd]
  at::Tensor xr = x + linear(attn.reshape({1, heads * hd}), 3);
  h = Rms(xr, l.norm2);
  xr = xr + linear(at::silu(linear(h, 4)) * linear(h, 5), 6);
  return linear(Rms(xr, l.norm_f), 7);
}

TEST(GemvInt8Test, DecoderLayerLogitsCosineAbove0999AgainstBf16) {
  at::set_num_threads(2);
  at::manual_seed(2026);
  const int64_t hidden = 2048, inter = 6144, vocab = 8192;
  auto weight = [](int64_t n, int64_t k) { return (at::randn({n, k}) * 0.02).to(at::kBFloat16); };
  auto gain = [&] {
    at::Tensor g = 1 + 0.1 * at::randn({hidden});
    for (int64_t c : {3, 900, 1777}) g[c] = 12.0f;
    return g;
  };
  Layer l{weight(2048, hidden), weight(1024, hidden), weight(1024, hidden), weight(hidden, 2048),
          weight(inter, hidden), weight(inter, hidden), weight(hidden, inter), weight(vocab, hidden),
          gain(), gain(), gain(), at::randn({15, 8, 128}), at::randn({15, 8, 128})};
  const std::vector<at::Tensor> ws = {l.q, l.k, l.v, l.o, l.gate, l.up, l.down, l.head};
  std::vector<QuantizedWeight> qs;
  for (const at::Tensor& w : ws) {
    absl::StatusOr<QuantizedWeight> q = QuantizeInt8(w);
    ASSERT_TRUE(q.ok());
    qs.push_back(*q);
  }
  double worst = 1;
  for (int token = 0; token < 4; ++token) {
    at::Tensor x = at::randn({1, hidden});
    x.select(1, 11).mul_(30);  // a massive-activation channel in the residual stream
    const at::Tensor bf16 = LayerLogits(l, x, [&](const at::Tensor& in, int i) {
      at::Tensor y;
      EXPECT_TRUE(vlm::Gemv(in.to(at::kFloat), ws[i], &y).ok());
      return y.to(at::kFloat);
    });
    const at::Tensor int8 = LayerLogits(l, x, [&](const at::Tensor& in, int i) {
      at::Tensor y;
      EXPECT_TRUE(GemvInt8(in.to(at::kFloat), qs[i], &y).ok());
      return y;
    });
    worst = std::min(worst, at::cosine_similarity(int8.to(at::kDouble), bf16.to(at::kDouble), 1)
                                .item<double>());
  }
  std::printf("decoder layer logits cosine int8 vs bf16 (worst of 4 tokens): %.6f\n", worst);
  EXPECT_GE(worst, 0.999);
}

TEST(GemvInt8Test, BadInputIsInvalidArgument) {
  absl::StatusOr<QuantizedWeight> q = QuantizeInt8(at::randn({8, 64}));
  ASSERT_TRUE(q.ok());
  at::Tensor y;
  EXPECT_EQ(GemvInt8(at::randn({1, 63}), *q, &y).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GemvInt8(at::randn({64}), *q, &y).code(), absl::StatusCode::kInvalidArgument);
  at::Tensor bad = at::empty({1, 7});
  EXPECT_EQ(GemvInt8(at::randn({1, 64}), *q, &bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GemvInt8(at::randn({1, 64}), QuantizedWeight(), &y).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GemvInt8(at::randn({1, 64}), *q, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseGemvInt8Path("avx2").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace vlm::kernels
