// The row-invariant f32 product (common/kernels/gemm_f32.h), on every path
// this CPU supports, each forced through GemmF32Options::path:
//   - a row's result is bit-identical for every row count 1..300 and to the
//     row computed alone, with 1 and 2 threads;
//   - every path gives the same bits as the scalar path (the order is the
//     same), and the order is observable (another order gives other bits);
//   - the error against a float64 product stays within the bound of the
//     order's error analysis;
//   - strided operands, K = 0, NaN rows; shape/dtype errors as statuses.
#include "common/kernels/gemm_f32.h"

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

namespace vlm::kernels {
namespace {

constexpr GemmF32Path kPaths[] = {GemmF32Path::kAvx512, GemmF32Path::kAvx2, GemmF32Path::kScalar};

at::Tensor Product(const at::Tensor& x, const at::Tensor& w, GemmF32Path path, int threads = 0) {
  GemmF32Options o;
  o.path = path;
  o.threads = threads;
  absl::StatusOr<at::Tensor> y = GemmF32(x, w, o);
  EXPECT_TRUE(y.ok()) << y.status();
  return y.ok() ? *y : at::Tensor();
}

// Bitwise equality (at::equal would call NaN != NaN and -0 == +0).
bool SameBits(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) return false;
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  return std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.nbytes()) == 0;
}

class GemmF32PathTest : public ::testing::TestWithParam<GemmF32Path> {
 protected:
  void SetUp() override {
    at::manual_seed(11);
    std::string missing;
    if (!GemmF32PathSupported(GetParam(), &missing)) {
      GTEST_SKIP() << "the " << GemmF32PathName(GetParam()) << " path needs " << missing;
    }
  }
};

// For M = 1..300 the first M rows of one call equal the call over all 300
// rows, and every row equals the row computed alone. K covers a multiple of
// the 16 lanes, tails of 1 and 15, and K < 16; N covers tails of every
// register tile. The scalar path (std::fma per product) gets smaller shapes.
TEST_P(GemmF32PathTest, RowsDoNotDependOnRowCount) {
  struct Shape {
    int64_t n, k;
  };
  const bool scalar = GetParam() == GemmF32Path::kScalar;
  const std::vector<Shape> shapes = scalar ? std::vector<Shape>{{7, 33}, {5, 16}}
                                           : std::vector<Shape>{{37, 129}, {64, 64}, {13, 207},
                                                                {6, 5}, {200, 48}};
  for (int threads : {1, 2}) {
    for (const Shape& s : shapes) {
      const at::Tensor x = at::randn({300, s.k});
      const at::Tensor w = at::randn({s.n, s.k}) * 0.1;
      const at::Tensor all = Product(x, w, GetParam(), threads);
      std::vector<int64_t> differ;
      for (int64_t rows = 1; rows <= 300; ++rows) {
        if (!SameBits(Product(x.narrow(0, 0, rows), w, GetParam(), threads), all.narrow(0, 0, rows))) {
          differ.push_back(rows);
        }
      }
      std::vector<int64_t> alone;
      for (int64_t r = 0; r < 300; ++r) {
        if (!SameBits(Product(x.narrow(0, r, 1), w, GetParam(), threads), all.narrow(0, r, 1))) {
          alone.push_back(r);
        }
      }
      EXPECT_TRUE(differ.empty()) << GemmF32PathName(GetParam()) << " [" << s.n << ", " << s.k
                                  << "] threads " << threads << ": " << differ.size()
                                  << " of 300 row counts differ, first M = " << differ[0];
      EXPECT_TRUE(alone.empty()) << GemmF32PathName(GetParam()) << " [" << s.n << ", " << s.k
                                 << "] threads " << threads << ": " << alone.size()
                                 << " rows differ from the row alone, first " << alone[0];
    }
  }
}

// A decoder-sized shape (the 2B's k/v projection, K = 2048) with enough work
// per call to split over threads: every M = 1..40 and a few larger ones.
TEST_P(GemmF32PathTest, LargeShapeRowsDoNotDependOnRowCountOrThreads) {
  if (GetParam() == GemmF32Path::kScalar) GTEST_SKIP() << "covered by PathsGiveIdenticalBits";
  const at::Tensor x = at::randn({160, 2048});
  const at::Tensor w = at::randn({1024, 2048}) * 0.02;
  const at::Tensor all = Product(x, w, GetParam(), 2);
  EXPECT_TRUE(SameBits(Product(x, w, GetParam(), 1), all));
  for (int64_t rows = 1; rows <= 160; rows += rows < 40 ? 1 : 17) {
    for (int threads : {1, 2}) {
      EXPECT_TRUE(SameBits(Product(x.narrow(0, 0, rows), w, GetParam(), threads), all.narrow(0, 0, rows)))
          << GemmF32PathName(GetParam()) << " M = " << rows << " threads " << threads;
    }
  }
}

// Error analysis of the order (gemm_f32.h). Lane j of y[m, n] is a chain of
// L = ceil(K / 16) fma operations, each rounding once; the tree adds 4
// roundings on the way to y. So every product x_k·w_k reaches y through at
// most L + 4 roundings, each a relative error of at most u = 2^-24 on the
// partial sum it ends, and the standard summation bound (Higham, Accuracy and
// Stability of Numerical Algorithms, §3.1, with fma: one rounding per step)
// gives
//   |ŷ - y| <= γ_{L+4} · Σ_k |x_k·w_k|,   γ_n = n·u / (1 - n·u),
// where y is the exact sum (taken in float64: its own error, ~K·2^-53
// relative, is far below the bound).
TEST_P(GemmF32PathTest, MatchesFloat64WithinTheOrdersErrorBound) {
  const bool scalar = GetParam() == GemmF32Path::kScalar;
  struct Shape {
    int64_t m, n, k;
  };
  const std::vector<Shape> shapes = scalar ? std::vector<Shape>{{3, 5, 1}, {4, 9, 100}, {2, 3, 1000}}
                                           : std::vector<Shape>{{3, 5, 1},
                                                                {7, 33, 17},
                                                                {9, 100, 2048},
                                                                {5, 64, 6144},
                                                                {300, 70, 300}};
  for (const Shape& s : shapes) {
    // Mixed magnitudes and signs: cancellation makes the relative error of
    // single outputs large, which is what the Σ|x·w| form of the bound allows.
    const at::Tensor x = at::randn({s.m, s.k}) * at::exp(at::randn({s.m, s.k}));
    const at::Tensor w = at::randn({s.n, s.k}) * 0.05;
    const at::Tensor got = Product(x, w, GetParam()).to(at::kDouble);
    const at::Tensor xd = x.to(at::kDouble), wd = w.to(at::kDouble);
    const at::Tensor exact = at::matmul(xd, wd.t());
    const at::Tensor magnitude = at::matmul(xd.abs(), wd.abs().t());
    const double u = std::ldexp(1.0, -24);
    const double n = static_cast<double>((s.k + 15) / 16 + 4);
    const double gamma = n * u / (1 - n * u);
    const at::Tensor ratio = (got - exact).abs() / (gamma * magnitude);
    const double worst = ratio.max().item<double>();
    EXPECT_LE(worst, 1.0) << GemmF32PathName(GetParam()) << " [" << s.m << ", " << s.n << ", "
                          << s.k << "]";
    std::printf("  %s M %ld N %ld K %ld: worst error %.2f of the bound\n",
                GemmF32PathName(GetParam()), static_cast<long>(s.m), static_cast<long>(s.n),
                static_cast<long>(s.k), worst);
  }
}

// Rows with unit stride along K but a longer row stride (a column slice), a
// transposed weight (copied) and an output with a row stride give the same bits.
TEST_P(GemmF32PathTest, StridedOperandsGiveTheSameBits) {
  const at::Tensor xw = at::randn({20, 90});
  const at::Tensor x = xw.narrow(1, 3, 70);  // row stride 90
  const at::Tensor w = at::randn({70, 45}).t();  // [45, 70], column-major
  const at::Tensor want = Product(x.contiguous(), w.contiguous(), GetParam());
  EXPECT_TRUE(SameBits(Product(x, w, GetParam()), want));
  at::Tensor wide = at::zeros({20, 60});
  at::Tensor y = wide.narrow(1, 5, 45);
  GemmF32Options o;
  o.path = GetParam();
  ASSERT_TRUE(GemmF32(x, w, &y, o).ok());
  EXPECT_TRUE(SameBits(y, want));
  EXPECT_EQ(wide.narrow(1, 0, 5).abs().sum().item<float>(), 0.0f);  // outside y untouched
}

// A NaN in one row of x makes that row NaN and leaves the others as they were.
TEST_P(GemmF32PathTest, NanStaysInItsRow) {
  at::Tensor x = at::randn({9, 40});
  const at::Tensor w = at::randn({11, 40});
  const at::Tensor clean = Product(x, w, GetParam());
  x[4][17] = std::nanf("");
  const at::Tensor y = Product(x, w, GetParam());
  EXPECT_TRUE(y[4].isnan().all().item<bool>());
  for (int64_t r = 0; r < 9; ++r) {
    if (r != 4) {
      EXPECT_TRUE(SameBits(y[r], clean[r])) << "row " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, GemmF32PathTest, ::testing::ValuesIn(kPaths),
                         [](const ::testing::TestParamInfo<GemmF32Path>& info) {
                           return std::string(GemmF32PathName(info.param));
                         });

// Every supported path gives the bits of the scalar path: one order on all.
TEST(GemmF32Test, PathsGiveIdenticalBits) {
  at::manual_seed(12);
  for (auto [m, n, k] : {std::array<int64_t, 3>{1, 1, 1}, {5, 7, 15}, {4, 4, 16}, {6, 9, 17},
                         {13, 21, 100}, {3, 130, 513}, {2, 8, 2048}}) {
    const at::Tensor x = at::randn({m, k});
    const at::Tensor w = at::randn({n, k});
    const at::Tensor want = Product(x, w, GemmF32Path::kScalar);
    for (GemmF32Path path : kPaths) {
      if (!GemmF32PathSupported(path)) continue;
      EXPECT_TRUE(SameBits(Product(x, w, path), want))
          << GemmF32PathName(path) << " [" << m << ", " << n << ", " << k << "]";
    }
  }
}

// The bit-identity checks above have teeth: summing the same products in
// another order (one sequential fma chain) changes most outputs' last bits.
TEST(GemmF32Test, AnotherSummationOrderGivesOtherBits) {
  at::manual_seed(13);
  const at::Tensor x = at::randn({8, 512});
  const at::Tensor w = at::randn({32, 512});
  const at::Tensor y = Product(x, w, DefaultGemmF32Path());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  int differ = 0;
  for (int64_t m = 0; m < 8; ++m) {
    for (int64_t n = 0; n < 32; ++n) {
      float s = 0;
      for (int64_t k = 0; k < 512; ++k) s = std::fma(xp[m * 512 + k], wp[n * 512 + k], s);
      differ += s != y[m][n].item<float>();
    }
  }
  EXPECT_GT(differ, 8 * 32 / 4) << "orders agreeing this often would make the tests toothless";
}

TEST(GemmF32Test, EmptyKGivesZerosAndEmptyShapesWork) {
  const at::Tensor y = Product(at::randn({3, 0}), at::randn({4, 0}), DefaultGemmF32Path());
  EXPECT_TRUE(SameBits(y, at::zeros({3, 4})));
  EXPECT_EQ(Product(at::randn({0, 8}), at::randn({4, 8}), DefaultGemmF32Path()).sizes(),
            (at::IntArrayRef{0, 4}));
  EXPECT_EQ(Product(at::randn({2, 8}), at::randn({0, 8}), DefaultGemmF32Path()).sizes(),
            (at::IntArrayRef{2, 0}));
}

TEST(GemmF32Test, BadOperandsAreInvalidArgument) {
  const at::Tensor x = at::randn({2, 8}), w = at::randn({3, 8});
  auto code = [](absl::StatusOr<at::Tensor> r) { return r.status().code(); };
  EXPECT_EQ(code(GemmF32(x.to(at::kBFloat16), w)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(GemmF32(x, w.to(at::kDouble))), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(GemmF32(x, at::randn({3, 9}))), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(GemmF32(x.view({2, 2, 4}), w)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(GemmF32(at::Tensor(), w)), absl::StatusCode::kInvalidArgument);
  at::Tensor wrong = at::empty({2, 4});
  absl::Status s = GemmF32(x, w, &wrong);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[2, 3]"), std::string::npos) << s;
  at::Tensor column_major = at::empty({3, 2}).t();
  EXPECT_EQ(GemmF32(x, w, &column_major).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GemmF32(x, w, nullptr).code(), absl::StatusCode::kInvalidArgument);
  for (GemmF32Path path : kPaths) {
    GemmF32Options o;
    o.path = path;
    const bool ok = GemmF32(x, w, o).ok();
    EXPECT_EQ(ok, GemmF32PathSupported(path)) << GemmF32PathName(path);
  }
}

TEST(GemmF32Test, PathNamesParse) {
  for (GemmF32Path path : kPaths) EXPECT_EQ(*ParseGemmF32Path(GemmF32PathName(path)), path);
  EXPECT_TRUE(ParseGemmF32Path("auto").ok());
  EXPECT_TRUE(GemmF32PathSupported(*ParseGemmF32Path("auto")));
  EXPECT_EQ(ParseGemmF32Path("sse").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(GemmF32PathSupported(GemmF32Path::kScalar));
}

// VLM_GEMM_F32_PATH forces the default (ctest runs this with avx2 and scalar).
TEST(GemmF32Test, EnvironmentChoosesTheDefaultPath) {
  const char* env = std::getenv("VLM_GEMM_F32_PATH");
  if (env == nullptr || *env == '\0') {
    EXPECT_EQ(DefaultGemmF32Path(), *ParseGemmF32Path("auto"));
    return;
  }
  absl::StatusOr<GemmF32Path> want = ParseGemmF32Path(env);
  ASSERT_TRUE(want.ok()) << want.status();
  if (!GemmF32PathSupported(*want)) GTEST_SKIP() << env << " is not supported here";
  EXPECT_EQ(DefaultGemmF32Path(), *want);
}

}  // namespace
}  // namespace vlm::kernels
