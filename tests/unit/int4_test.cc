// 4-bit weights (common/kernels/quantize_int4.h, gemv_int4.h):
// - the quantizer: round-trip error within half a step per element, the
//   layout's accessors agree with the stored nibbles, all-zero rows and K
//   padding, non-finite values rejected by row, Views over external memory;
// - GemvInt4: every path this CPU runs gives the scalar reference's bits
//   (the integer group sums are exact and the f32 steps are the same on every
//   path), rows are independent of the batch, and the result is within a
//   derived bound of the exact product with the dequantized weight;
// - GemmInt4: bit for bit Gemm on the dequantized weight rounded to bf16
//   (plain, gate/up with SiLU·up, residual in place), rows batch-invariant.
// Shapes: K in full 512-blocks, tail groups and padding (40, 520, 1100),
// N not a multiple of 16 or of the tasks' 64 rows.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "common/kernels/amx_emulation_support.h"
#include "common/kernels/gemm.h"
#include "common/kernels/gemv_int4.h"
#include "common/kernels/quantize_int4.h"

namespace vlm::kernels {
namespace {

struct Shape {
  int64_t n, k;
};
const std::vector<Shape> kShapes = {{37, 40}, {70, 520}, {96, 1024}, {33, 1100}, {130, 2048}};

Int4Weight Quantized(const at::Tensor& w) {
  absl::StatusOr<Int4Weight> q = QuantizeInt4(w);
  EXPECT_TRUE(q.ok()) << q.status();
  return q.ok() ? *std::move(q) : Int4Weight();
}

// Heavy-tailed weights (Student t with 3 degrees of freedom, scaled), the
// case the zero points are for.
at::Tensor HeavyTailed(int64_t n, int64_t k) {
  const at::Tensor z = at::randn({n, k});
  const at::Tensor chi = (at::randn({n, k, 3}).pow(2)).sum(2) / 3;
  return z / chi.sqrt() * 0.02;
}

TEST(QuantizeInt4Test, RoundTripWithinHalfAStep) {
  at::manual_seed(1);
  for (const Shape& s : kShapes) {
    for (bool heavy : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "N=" << s.n << " K=" << s.k << " heavy=" << heavy);
      const at::Tensor w = (heavy ? HeavyTailed(s.n, s.k) : at::randn({s.n, s.k}) * 0.02)
                               .to(at::kBFloat16);
      const Int4Weight q = Quantized(w);
      ASSERT_FALSE(q.empty());
      EXPECT_EQ(q.k_padded() % kInt4Group, 0);
      const at::Tensor d = DequantizeInt4(q);
      const at::Tensor err = (d - w.to(at::kFloat)).abs();
      // Per group: |error| ≤ scale / 2 (rounding), plus the f16 ratio's and
      // the clamp's slack: scale is within 2^-11 of (hi - lo) / 15, so the
      // extremes stay in range up to 15·2^-11 steps.
      for (int64_t r = 0; r < s.n; ++r) {
        for (int64_t g = 0; g < q.groups(); ++g) {
          const int64_t i0 = g * kInt4Group, i1 = std::min(s.k, i0 + kInt4Group);
          if (i0 >= s.k) continue;
          const float step = q.scale(r, g);
          const float worst = err[r].slice(0, i0, i1).max().item<float>();
          ASSERT_LE(worst, step * (0.5f + 16.0f / 2048) + 1e-12f) << "row " << r << " group " << g;
        }
      }
      // The bytes hold what the accessors say, padding decodes to 0.
      for (int64_t r = 0; r < s.n; r += 7) {
        for (int64_t i = s.k; i < q.k_padded(); ++i) EXPECT_EQ(q.value(r, i), 0);
        for (int64_t g = 0; g < q.groups(); ++g) EXPECT_LE(q.zero(r, g), 15);
      }
      const double rel = (d - w.to(at::kFloat)).norm().item<double>() / w.to(at::kFloat).norm().item<double>();
      EXPECT_LT(rel, heavy ? 0.12 : 0.09);  // int4_fidelity.py: 0.104 / 0.081 asymmetric, groups of 32
    }
  }
}

TEST(QuantizeInt4Test, EdgeCasesAndBadInput) {
  at::Tensor w = at::randn({4, 100});
  w[1].zero_();
  w[2] = at::abs(w[2]);  // one-signed: lo = 0, zero point 0
  const Int4Weight q = Quantized(w);
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(q.value(1, i), 0);
  EXPECT_EQ(q.row_scales()[1], 0.0f);
  for (int64_t g = 0; g < q.groups(); ++g) EXPECT_EQ(q.zero(2, g), 0);
  at::Tensor bad = at::randn({3, 64});
  bad[2][5] = std::nanf("");
  absl::StatusOr<Int4Weight> r = QuantizeInt4(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("row 2"), std::string::npos) << r.status();
  EXPECT_FALSE(QuantizeInt4(at::randn({3, 4, 5})).ok());
  EXPECT_FALSE(QuantizeInt4(at::randn({3, 4}).to(at::kInt)).ok());
}

// Every array of two quantizations, byte for byte.
void ExpectSameBytes(const Int4Weight& a, const Int4Weight& b) {
  ASSERT_EQ(a.n(), b.n());
  ASSERT_EQ(a.k(), b.k());
  EXPECT_EQ(std::memcmp(a.packed(), b.packed(), a.packed_bytes()), 0) << "packed";
  EXPECT_EQ(std::memcmp(a.row_scales(), b.row_scales(), a.row_scale_bytes()), 0) << "row scales";
  EXPECT_EQ(std::memcmp(a.ratios(), b.ratios(), a.ratio_bytes()), 0) << "ratios";
  EXPECT_EQ(std::memcmp(a.zeros(), b.zeros(), a.zero_bytes()), 0) << "zeros";
}

// Rows of the kinds the vector paths could get wrong: random, heavy-tailed,
// all-equal groups (positive, negative), zeros, extremes near the largest
// finite value (where hi - lo overflows to inf), denormals alone (1/scale
// overflows) and mixed with normal values, one-signed rows, -0.
at::Tensor EdgeRows(int64_t k) {
  at::Tensor rows = at::randn({14, k}) * 0.02;
  rows[1] = HeavyTailed(1, k)[0];
  rows[2].fill_(0.375f);
  rows[3].fill_(-1e-3f);
  rows[4].zero_();
  const float big = 3.3e38f;  // finite in bf16 too
  rows[5] = at::where(at::randn({k}) > 0, at::full({k}, big), at::full({k}, -big));
  rows[6] = (at::randn({k}) * 1e38).clamp(-big, big);
  rows[7] = at::randn({k}) * 1e-40;  // f32 denormals (bf16 keeps some)
  rows[8] = at::where(at::randn({k}) > 1, at::randn({k}), at::randn({k}) * 1e-39);
  rows[9] = at::randn({k}).abs() * 0.1;
  rows[10] = -at::randn({k}).abs() * 0.1;
  rows[11].fill_(-0.0f);
  rows[12] = at::randn({k}) * 1e-30;
  // Groups of equal values, each group its own value.
  at::Tensor g = at::randn({(k + 31) / 32}).repeat_interleave(32).slice(0, 0, k);
  rows[13] = g;
  return rows;
}

TEST(QuantizeInt4Test, EveryPathGivesTheScalarBytes) {
  at::manual_seed(7);
  for (int64_t k : {1, 31, 33, 40, 512, 520, 1100, 2048}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(::testing::Message() << "K=" << k << " dtype=" << dtype);
      at::Tensor w = at::cat({EdgeRows(k), at::randn({50, k}) * 0.02}).to(dtype);
      ASSERT_TRUE(at::isfinite(w).all().item<bool>());
      absl::StatusOr<Int4Weight> ref = QuantizeInt4(w, QuantizeInt4Path::kScalar, 1);
      ASSERT_TRUE(ref.ok()) << ref.status();
      for (QuantizeInt4Path path :
           {QuantizeInt4Path::kAvx512, QuantizeInt4Path::kAvx2, QuantizeInt4Path::kScalar}) {
        if (!QuantizeInt4PathSupported(path)) continue;
        SCOPED_TRACE(QuantizeInt4PathName(path));
        for (int threads : {1, 2}) {
          absl::StatusOr<Int4Weight> q = QuantizeInt4(w, path, threads);
          ASSERT_TRUE(q.ok()) << q.status();
          ExpectSameBytes(*ref, *q);
        }
        // Strided rows (a column slice) quantize as their contiguous copy.
        const at::Tensor wide = at::cat({w, w}, 1);
        absl::StatusOr<Int4Weight> sliced = QuantizeInt4(wide.slice(1, k, 2 * k), path);
        ASSERT_TRUE(sliced.ok()) << sliced.status();
        ExpectSameBytes(*ref, *sliced);
        // A non-finite value anywhere in a row, on every path.
        for (float v : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                        std::nanf("")}) {
          at::Tensor bad = w.clone();
          bad[9][k - 1] = v;
          absl::StatusOr<Int4Weight> r = QuantizeInt4(bad, path);
          ASSERT_FALSE(r.ok());
          EXPECT_NE(r.status().message().find("row 9"), std::string::npos) << r.status();
        }
      }
    }
  }
}

TEST(QuantizeInt4Test, ViewOverExternalMemoryGivesTheSameProducts) {
  const Int4Weight q = Quantized(at::randn({70, 1100}) * 0.02);
  // Copies of the arrays, owned by one block (as a mapped file would be).
  auto block = std::make_shared<std::vector<uint8_t>>(q.bytes());
  uint8_t* p = block->data();
  std::memcpy(p, q.packed(), q.packed_bytes());
  std::memcpy(p + q.packed_bytes(), q.row_scales(), q.row_scale_bytes());
  std::memcpy(p + q.packed_bytes() + q.row_scale_bytes(), q.ratios(), q.ratio_bytes());
  std::memcpy(p + q.packed_bytes() + q.row_scale_bytes() + q.ratio_bytes(), q.zeros(),
              q.zero_bytes());
  Int4Weight v = Int4Weight::View(
      q.n(), q.k(), p, reinterpret_cast<const float*>(p + q.packed_bytes()),
      reinterpret_cast<const uint16_t*>(p + q.packed_bytes() + q.row_scale_bytes()),
      p + q.packed_bytes() + q.row_scale_bytes() + q.ratio_bytes(), block);
  block.reset();  // the view keeps it alive
  EXPECT_EQ(v.bytes(), q.bytes());
  const at::Tensor x = at::randn({3, 1100});
  at::Tensor a, b;
  ASSERT_TRUE(GemvInt4(x, q, &a).ok());
  ASSERT_TRUE(GemvInt4(x, v, &b).ok());
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_TRUE(at::equal(DequantizeInt4(q), DequantizeInt4(v)));
}

class GemvInt4PathTest : public ::testing::TestWithParam<GemvInt4Path> {
 protected:
  void SetUp() override {
    at::set_num_threads(2);
    at::manual_seed(20261203);
    std::string missing;
    if (!GemvInt4PathSupported(GetParam(), &missing)) {
      GTEST_SKIP() << GemvInt4PathName(GetParam()) << " cannot run here: " << missing;
    }
  }
  GemvInt4Options Opts(GemvInt4Path path, int threads = 0) const {
    GemvInt4Options o;
    o.path = path;
    o.threads = threads;
    return o;
  }
};

TEST_P(GemvInt4PathTest, SameBitsAsTheScalarReference) {
  for (const Shape& s : kShapes) {
    for (int64_t batch : {1, 2, 3, 5, 8, 11}) {
      SCOPED_TRACE(::testing::Message() << "N=" << s.n << " K=" << s.k << " B=" << batch);
      const Int4Weight w = Quantized(HeavyTailed(s.n, s.k));
      for (at::ScalarType xt : {at::kBFloat16, at::kFloat}) {
        at::Tensor x = at::randn({batch, s.k}).to(xt);
        x.select(1, s.k / 3).mul_(30);  // an outlier channel
        at::Tensor y, ref;
        ASSERT_TRUE(GemvInt4(x, w, &y, Opts(GetParam())).ok());
        ASSERT_TRUE(GemvInt4(x, w, &ref, Opts(GemvInt4Path::kScalar, 1)).ok());
        EXPECT_TRUE(at::equal(y, ref))
            << "max |diff| " << (y - ref).abs().max().item<float>();
      }
    }
  }
}

TEST_P(GemvInt4PathTest, RowsAreTheSameInAnyBatchAndOutputDType) {
  const Int4Weight w = Quantized(at::randn({200, 1100}) * 0.02);
  const at::Tensor x = at::randn({8, 1100}).to(at::kBFloat16);
  at::Tensor all;
  ASSERT_TRUE(GemvInt4(x, w, &all, Opts(GetParam())).ok());
  for (int64_t b = 0; b < 8; ++b) {
    at::Tensor one;
    ASSERT_TRUE(GemvInt4(x.narrow(0, b, 1), w, &one, Opts(GetParam(), 1)).ok());
    EXPECT_TRUE(at::equal(one, all.narrow(0, b, 1))) << "row " << b;
  }
  at::Tensor y16 = at::empty({8, 200}, at::kBFloat16);
  ASSERT_TRUE(GemvInt4(x, w, &y16, Opts(GetParam())).ok());
  EXPECT_TRUE(at::equal(y16, all.to(at::kBFloat16)));
}

// Against the exact product with the dequantized weight: the activations'
// int8 rounding (|xq·d - x| ≤ d / 2 with d = max|x_g| / 127 ≤ max|x| / 127)
// bounds the error by Σ|w|·d / 2, plus f32 sums (K·2^-24 relative).
TEST_P(GemvInt4PathTest, CloseToTheExactProductOnTheDequantizedWeight) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "N=" << s.n << " K=" << s.k);
    const Int4Weight w = Quantized(at::randn({s.n, s.k}) * 0.02);
    const at::Tensor x = at::randn({2, s.k});
    at::Tensor y;
    ASSERT_TRUE(GemvInt4(x, w, &y, Opts(GetParam())).ok());
    const at::Tensor wd = DequantizeInt4(w).to(at::kDouble), xd = x.to(at::kDouble);
    const at::Tensor want = at::matmul(xd, wd.t());
    const at::Tensor amax = xd.abs().max().item<double>() * at::ones_like(xd);
    const at::Tensor bound = at::matmul(amax / 127 / 2, wd.abs().t()) +
                             at::matmul(xd.abs(), wd.abs().t()) * (s.k * 6e-8) + 1e-9;
    EXPECT_TRUE(((y.to(at::kDouble) - want).abs() <= bound).all().item<bool>())
        << "max |err| " << (y.to(at::kDouble) - want).abs().max().item<double>();
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, GemvInt4PathTest,
                         ::testing::Values(GemvInt4Path::kAvx512Vnni, GemvInt4Path::kAvx2,
                                           GemvInt4Path::kScalar),
                         [](const auto& info) { return std::string(GemvInt4PathName(info.param)); });

TEST(GemvInt4Test, BadInputGetsAClearStatus) {
  const Int4Weight w = Quantized(at::randn({8, 64}));
  at::Tensor y;
  EXPECT_EQ(GemvInt4(at::randn({2, 64}), Int4Weight(), &y).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GemvInt4(at::randn({2, 63}), w, &y).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GemvInt4(at::randn({2, 64}), w, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GemvInt4(at::randn({2, 64}).to(at::kInt), w, &y).code(),
            absl::StatusCode::kInvalidArgument);
  at::Tensor wrong = at::empty({2, 5}, at::kFloat);
  EXPECT_EQ(GemvInt4(at::randn({2, 64}), w, &wrong).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ParseGemvInt4Path("avx9").ok());
  EXPECT_TRUE(ParseGemvInt4Path("auto").ok());
}

// VLM_GEMV_INT4_PATH (set by the ctest variants) picks the default path.
TEST(GemvInt4Test, EnvironmentPicksTheDefaultPath) {
  const char* env = std::getenv("VLM_GEMV_INT4_PATH");
  if (env == nullptr) GTEST_SKIP() << "VLM_GEMV_INT4_PATH not set";
  absl::StatusOr<GemvInt4Path> want = ParseGemvInt4Path(env);
  ASSERT_TRUE(want.ok());
  if (!GemvInt4PathSupported(*want)) GTEST_SKIP() << env << " cannot run here";
  EXPECT_EQ(DefaultGemvInt4Path(), *want);
}

struct Case {
  int64_t m, n, k;
};
const std::vector<Case> kGemmCases = {
    {1, 37, 40}, {3, 70, 520}, {13, 96, 1024}, {29, 37, 1100}, {64, 70, 2048}, {300, 40, 544},
};

class GemmInt4PathTest : public ::testing::TestWithParam<GemmPath> {
 protected:
  void SetUp() override {
    at::set_num_threads(2);
    at::manual_seed(20261204);
    if (GetParam() == GemmPath::kAmx) {
      RecordProperty("amx", testing::UseAmxEmulationUnlessHardware());
    }
    std::string missing;
    if (!GemmPathSupported(GetParam(), &missing)) {
      GTEST_SKIP() << "the " << GemmPathName(GetParam()) << " path cannot run here: " << missing;
    }
  }
  GemmOptions Opts(Activation act = Activation::kNone) const {
    GemmOptions o;
    o.activation = act;
    o.path = GetParam();
    return o;
  }
};

at::Tensor DequantBf16(const Int4Weight& w) { return DequantizeInt4(w).to(at::kBFloat16); }

TEST_P(GemmInt4PathTest, EqualsGemmOnTheDequantizedWeightBitForBit) {
  for (const Case& c : kGemmCases) {
    SCOPED_TRACE(::testing::Message() << "M=" << c.m << " N=" << c.n << " K=" << c.k);
    const Int4Weight w = Quantized(HeavyTailed(c.n, c.k));
    ASSERT_FALSE(w.empty());
    const at::Tensor x = at::randn({c.m, c.k}).to(at::kBFloat16);
    absl::StatusOr<PackedWeight> packed = PackedWeight::Pack(DequantBf16(w), {}, GetParam());
    ASSERT_TRUE(packed.ok()) << packed.status();
    for (at::ScalarType out : {at::kBFloat16, at::kFloat}) {
      GemmOptions o = Opts();
      o.out_dtype = out;
      at::Tensor y, ref;
      ASSERT_TRUE(GemmInt4(x, w, &y, o).ok());
      ASSERT_TRUE(Gemm(x, *packed, &ref, o).ok());
      EXPECT_TRUE(at::equal(y, ref))
          << "max |diff| " << (y.to(at::kFloat) - ref.to(at::kFloat)).abs().max().item<float>();
    }
  }
}

TEST_P(GemmInt4PathTest, GateUpWithSiluMulEqualsPackGateUp) {
  for (const Case& c : kGemmCases) {
    SCOPED_TRACE(::testing::Message() << "M=" << c.m << " I=" << c.n << " K=" << c.k);
    const Int4Weight w = Quantized(at::randn({2 * c.n, c.k}) * 0.05);
    const at::Tensor d = DequantBf16(w);
    absl::StatusOr<PackedWeight> packed =
        PackedWeight::PackGateUp(d.narrow(0, 0, c.n), d.narrow(0, c.n, c.n), GetParam());
    ASSERT_TRUE(packed.ok()) << packed.status();
    const at::Tensor x = at::randn({c.m, c.k}).to(at::kBFloat16);
    at::Tensor y, ref;
    ASSERT_TRUE(GemmInt4(x, w, &y, Opts(Activation::kSiluMul)).ok());
    ASSERT_TRUE(Gemm(x, *packed, &ref, Opts(Activation::kSiluMul)).ok());
    EXPECT_TRUE(at::equal(y, ref));
  }
}

TEST_P(GemmInt4PathTest, ResidualInPlaceAndRowsBatchInvariant) {
  const Int4Weight w = Quantized(at::randn({70, 1100}) * 0.05);
  absl::StatusOr<PackedWeight> packed = PackedWeight::Pack(DequantBf16(w), {}, GetParam());
  ASSERT_TRUE(packed.ok()) << packed.status();
  const at::Tensor x = at::randn({37, 1100}).to(at::kBFloat16);
  at::Tensor base = at::randn({42, 70}).to(at::kBFloat16);
  at::Tensor a = base.clone(), b = base.clone();
  at::Tensor ya = a.narrow(0, 2, 37), yb = b.narrow(0, 2, 37);
  GemmOptions oa = Opts(), ob = Opts();
  oa.residual = ya;
  ob.residual = yb;
  ASSERT_TRUE(GemmInt4(x, w, &ya, oa).ok());
  ASSERT_TRUE(Gemm(x, *packed, &yb, ob).ok());
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_FALSE(at::equal(a, base));
  at::Tensor all;
  ASSERT_TRUE(GemmInt4(x, w, &all, Opts()).ok());
  for (int64_t r : {0, 5, 36}) {
    at::Tensor one;
    ASSERT_TRUE(GemmInt4(x.narrow(0, r, 1), w, &one, Opts()).ok());
    EXPECT_TRUE(at::equal(one, all.narrow(0, r, 1))) << "row " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(BlockedPaths, GemmInt4PathTest,
                         ::testing::Values(GemmPath::kAvx512Bf16, GemmPath::kAmx, GemmPath::kAvx2),
                         [](const auto& info) { return std::string(GemmPathName(info.param)); });

TEST(GemmInt4Test, BadInputGetsAClearStatus) {
  const Int4Weight w = Quantized(at::randn({8, 64}));
  at::Tensor y;
  EXPECT_EQ(GemmInt4(at::randn({2, 64}), Int4Weight(), &y).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GemmInt4(at::randn({2, 63}), w, &y).code(), absl::StatusCode::kInvalidArgument);
  GemmOptions torch;
  torch.path = GemmPath::kTorch;
  EXPECT_EQ(GemmInt4(at::randn({2, 64}), w, &y, torch).code(),
            absl::StatusCode::kFailedPrecondition);
  const Int4Weight odd = Quantized(at::randn({7, 64}));
  GemmOptions silu;
  silu.activation = Activation::kSiluMul;
  EXPECT_EQ(GemmInt4(at::randn({2, 64}), odd, &y, silu).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace vlm::kernels
