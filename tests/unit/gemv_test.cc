// Every GEMV path against at::matmul in f32 on the same bf16-rounded inputs.
#include "common/kernels/gemv.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

namespace vlm {
namespace {

// Reference: x and w rounded to bf16, product in f32 (OpenBLAS), [B, out].
at::Tensor Reference(const at::Tensor& x, const at::Tensor& w) {
  return at::matmul(x.to(at::kBFloat16).to(at::kFloat), w.to(at::kFloat).t());
}

// An output buffer full of NaN: any element Gemv fails to write shows up.
at::Tensor Poisoned(at::IntArrayRef shape, at::ScalarType dtype) {
  return at::full(shape, std::nanf(""), at::TensorOptions().dtype(dtype));
}

// ||y - ref|| / ||ref|| for f32 y. An f32 sum of n products errs by about
// sqrt(n) * 6e-8 relative, 3e-6 at n = 2055.
double RelativeError(const at::Tensor& y, const at::Tensor& ref) {
  const double num = (y.to(at::kDouble) - ref.to(at::kDouble)).norm().item<double>();
  const double den = ref.to(at::kDouble).norm().item<double>();
  return den == 0 ? num : num / den;
}

// A bf16 output is the f32 result rounded once: within half an ulp of bf16
// (2^-9 relative) plus the f32 summation error, so 2^-8 relative per element.
void ExpectBf16Close(const at::Tensor& y, const at::Tensor& ref, const std::string& what) {
  ASSERT_EQ(y.scalar_type(), at::kBFloat16) << what;
  const at::Tensor yf = y.to(at::kFloat);
  const float scale = ref.abs().max().item<float>();
  const at::Tensor excess = (yf - ref).abs() - (ref.abs() * (1.0f / 256) + 1e-6f * scale);
  EXPECT_LE(excess.max().item<float>(), 0.0f) << what;
}

class GemvPathTest : public ::testing::TestWithParam<GemvPath> {
 protected:
  void SetUp() override {
    at::set_num_threads(1);
    at::manual_seed(1234);
    std::string missing;
    if (!GemvPathSupported(GetParam(), &missing)) {
      GTEST_SKIP() << "CPU lacks " << missing << " needed by the " << GemvPathName(GetParam())
                   << " path";
    }
    options_.path = GetParam();
  }
  GemvOptions options_;
};

TEST_P(GemvPathTest, MatchesMatmulOnOddShapesBatchesAndDtypes) {
  for (int64_t in : {1, 31, 33, 64, 2048 + 7}) {
    for (int64_t out : {1, 3, 1000}) {
      const at::Tensor w = at::randn({out, in}).to(at::kBFloat16);
      for (int64_t batch : {1, 2, 3, 4, 5, 8}) {
        const at::Tensor x32 = at::randn({batch, in});
        const at::Tensor ref = Reference(x32, w);
        for (at::ScalarType xt : {at::kBFloat16, at::kFloat}) {
          const at::Tensor x = x32.to(xt);
          for (at::ScalarType yt : {at::kFloat, at::kBFloat16}) {
            const std::string what = "in=" + std::to_string(in) + " out=" + std::to_string(out) +
                                     " B=" + std::to_string(batch) + " x=" + at::toString(xt) +
                                     " y=" + at::toString(yt);
            at::Tensor y = Poisoned({batch, out}, yt);
            ASSERT_TRUE(Gemv(x, w, &y, options_).ok()) << what;
            if (yt == at::kFloat) {
              EXPECT_LT(RelativeError(y, ref), 1e-5) << what;
            } else {
              ExpectBf16Close(y, ref, what);
            }
          }
        }
      }
    }
  }
}

TEST_P(GemvPathTest, AccumulateAddsToOutput) {
  const at::Tensor w = at::randn({37, 100}).to(at::kBFloat16);
  const at::Tensor x = at::randn({3, 100}).to(at::kBFloat16);
  const at::Tensor y0 = at::randn({3, 37});
  at::Tensor y = y0.clone();
  GemvOptions options = options_;
  options.accumulate = true;
  ASSERT_TRUE(Gemv(x, w, &y, options).ok());
  EXPECT_LT(RelativeError(y, y0 + Reference(x, w)), 1e-5);

  at::Tensor yb = y0.to(at::kBFloat16);
  ASSERT_TRUE(Gemv(x, w, &yb, options).ok());
  ExpectBf16Close(yb, y0.to(at::kBFloat16).to(at::kFloat) + Reference(x, w), "bf16 accumulate");
}

TEST_P(GemvPathTest, MultiComputesEveryWeightFromOneInput) {
  // q/k/v of a small GQA layer: outputs of different widths from one x.
  const at::Tensor x = at::randn({2, 96}).to(at::kBFloat16);
  const std::vector<at::Tensor> ws = {at::randn({128, 96}).to(at::kBFloat16),
                                      at::randn({67, 96}).to(at::kBFloat16),
                                      at::randn({1, 96}).to(at::kBFloat16)};
  at::Tensor q, k = Poisoned({2, 67}, at::kFloat), v = Poisoned({2, 1}, at::kBFloat16);
  std::vector<at::Tensor*> ys = {&q, &k, &v};
  ASSERT_TRUE(GemvMulti(x, ws, ys, options_).ok());
  ASSERT_EQ(q.scalar_type(), at::kBFloat16);  // allocated with x's dtype
  ExpectBf16Close(q, Reference(x, ws[0]), "q");
  EXPECT_LT(RelativeError(k, Reference(x, ws[1])), 1e-5);
  ExpectBf16Close(v, Reference(x, ws[2]), "v");
}

TEST_P(GemvPathTest, TwoThreadsSplitRowsOfSeveralMatrices) {
  at::set_num_threads(2);
  const at::Tensor x = at::randn({3, 129});
  const std::vector<at::Tensor> ws = {at::randn({1000, 129}).to(at::kBFloat16),
                                      at::randn({77, 129}).to(at::kBFloat16),
                                      at::randn({33, 129}).to(at::kBFloat16)};
  // Back to back, so the worker is awake and joins most calls.
  std::vector<double> worst(ws.size(), 0.0);
  absl::Status status;
  for (int call = 0; call < 20 && status.ok(); ++call) {
    std::vector<at::Tensor> outs;
    for (const at::Tensor& w : ws) outs.push_back(Poisoned({3, w.size(0)}, at::kFloat));
    std::vector<at::Tensor*> ys = {&outs[0], &outs[1], &outs[2]};
    status = GemvMulti(x, ws, ys, options_);
    for (size_t i = 0; i < ws.size() && status.ok(); ++i) {
      const double err = RelativeError(outs[i], Reference(x, ws[i]));
      worst[i] = std::max(worst[i], std::isnan(err) ? 1.0 : err);
    }
  }
  at::set_num_threads(1);
  ASSERT_TRUE(status.ok()) << status;
  for (size_t i = 0; i < ws.size(); ++i) EXPECT_LT(worst[i], 1e-5) << "matrix " << i;
}

// Batch invariance (the decoder's batched decode relies on it): a row's
// result is bit-identical whatever rows share the call and wherever it sits
// among them, for B = 1..12 (beyond the 8 a call is meant for), on a
// 2B-shaped weight, 1 and 2 threads, f32 and bf16 outputs.
TEST_P(GemvPathTest, RowResultsDoNotDependOnTheOtherRows) {
  const int64_t in = 2048, out = GetParam() == GemvPath::kScalar ? 512 : 6144;
  const at::Tensor w = (at::randn({out, in}) * 0.05).to(at::kBFloat16);
  const at::Tensor x = at::randn({12, in}).to(at::kBFloat16);
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    for (at::ScalarType yt : {at::kFloat, at::kBFloat16}) {
      // Each row alone.
      at::Tensor alone = Poisoned({12, out}, yt);
      for (int64_t r = 0; r < 12; ++r) {
        at::Tensor y = alone.narrow(0, r, 1);
        ASSERT_TRUE(Gemv(x.narrow(0, r, 1), w, &y, options_).ok());
      }
      for (int64_t batch = 1; batch <= 12; ++batch) {
        for (int64_t first : {int64_t{0}, 12 - batch}) {
          at::Tensor y = Poisoned({batch, out}, yt);
          ASSERT_TRUE(Gemv(x.narrow(0, first, batch), w, &y, options_).ok());
          EXPECT_TRUE(at::equal(y, alone.narrow(0, first, batch)))
              << "B=" << batch << " rows from " << first << " threads " << threads << " y "
              << at::toString(yt);
        }
      }
      // GemvMulti: the same rows through two weights in one pass.
      const at::Tensor w2 = w.narrow(0, 0, 100);
      at::Tensor y1 = Poisoned({5, out}, yt), y2 = Poisoned({5, 100}, yt);
      std::vector<at::Tensor*> ys = {&y1, &y2};
      ASSERT_TRUE(GemvMulti(x.narrow(0, 3, 5), {w, w2}, ys, options_).ok());
      EXPECT_TRUE(at::equal(y1, alone.narrow(0, 3, 5)));
      EXPECT_TRUE(at::equal(y2, alone.narrow(0, 3, 5).narrow(1, 0, 100)));
    }
  }
  at::set_num_threads(1);
}

TEST_P(GemvPathTest, ConcurrentCallersEachGetTheirOwnResult) {
  // Two threads share the worker pool: one call runs on it, the other alone.
  at::set_num_threads(2);
  const at::Tensor x1 = at::randn({1, 200}), x2 = at::randn({2, 200});
  const at::Tensor w1 = at::randn({700, 200}).to(at::kBFloat16);
  const at::Tensor w2 = at::randn({300, 200}).to(at::kBFloat16);
  const at::Tensor ref1 = Reference(x1, w1), ref2 = Reference(x2, w2);
  std::vector<double> worst(2, 0.0);
  auto caller = [&](int id) {
    for (int i = 0; i < 50; ++i) {
      at::Tensor y = Poisoned({id == 0 ? 1 : 2, id == 0 ? 700 : 300}, at::kFloat);
      const absl::Status s = Gemv(id == 0 ? x1 : x2, id == 0 ? w1 : w2, &y, options_);
      const double err = s.ok() ? RelativeError(y, id == 0 ? ref1 : ref2) : 1.0;
      worst[id] = std::max(worst[id], std::isnan(err) ? 1.0 : err);
    }
  };
  std::thread other(caller, 1);
  caller(0);
  other.join();
  at::set_num_threads(1);
  EXPECT_LT(worst[0], 1e-5);
  EXPECT_LT(worst[1], 1e-5);
}

TEST_P(GemvPathTest, ReadsStridedWeightsInReadOnlyMemory) {
  // A [50, 70] view with row stride 75 in a PROT_READ mapping: any write
  // into the weights would fault.
  const int64_t rows = 50, in = 70, ld = 75;
  const size_t bytes = rows * ld * sizeof(uint16_t);
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  const at::Tensor full = at::randn({rows, ld}).to(at::kBFloat16);
  std::memcpy(mem, full.data_ptr(), bytes);
  ASSERT_EQ(mprotect(mem, bytes, PROT_READ), 0);
  const at::Tensor w = at::from_blob(mem, {rows, in}, {ld, 1}, at::kBFloat16);
  const at::Tensor x = at::randn({1, in});
  at::Tensor y = Poisoned({1, rows}, at::kFloat);
  ASSERT_TRUE(Gemv(x, w, &y, options_).ok());
  EXPECT_LT(RelativeError(y, Reference(x, full.narrow(1, 0, in))), 1e-5);
  munmap(mem, bytes);
}

INSTANTIATE_TEST_SUITE_P(AllPaths, GemvPathTest,
                         ::testing::Values(GemvPath::kAvx512Bf16, GemvPath::kAvx512,
                                           GemvPath::kAvx2, GemvPath::kScalar),
                         [](const ::testing::TestParamInfo<GemvPath>& info) {
                           return std::string(GemvPathName(info.param));
                         });

TEST(GemvTest, AgreesWithLibTorchBf16Linear) {
  at::set_num_threads(1);
  at::manual_seed(7);
  const at::Tensor x = at::randn({1, 2048}).to(at::kBFloat16);
  const at::Tensor w = at::randn({512, 2048}).to(at::kBFloat16);
  at::Tensor y;
  ASSERT_TRUE(Gemv(x, w, &y).ok());
  // LibTorch accumulates in f32 and rounds once to bf16 as well.
  const at::Tensor theirs = at::linear(x, w).to(at::kFloat);
  const at::Tensor ours = y.to(at::kFloat);
  const float slack = 1e-5f * theirs.abs().max().item<float>();
  EXPECT_LE(((ours - theirs).abs() - theirs.abs() / 128 - slack).max().item<float>(), 0.0f);
}

TEST(GemvTest, EmptyInputGivesZerosAndEmptyOutputsAreFine) {
  const at::Tensor w = at::empty({5, 0}, at::kBFloat16);
  at::Tensor y = Poisoned({2, 5}, at::kFloat);
  ASSERT_TRUE(Gemv(at::empty({2, 0}), w, &y).ok());
  EXPECT_EQ(y.abs().max().item<float>(), 0.0f);
  at::Tensor none;
  ASSERT_TRUE(Gemv(at::randn({0, 8}), at::randn({4, 8}).to(at::kBFloat16), &none).ok());
  EXPECT_EQ(none.sizes(), (std::vector<int64_t>{0, 4}));
}

TEST(GemvTest, RejectsBadArguments) {
  const at::Tensor x = at::randn({1, 16}).to(at::kBFloat16);
  const at::Tensor w = at::randn({8, 16}).to(at::kBFloat16);
  at::Tensor y;
  EXPECT_EQ(Gemv(x, w.to(at::kFloat), &y).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Gemv(x, at::randn({8, 15}).to(at::kBFloat16), &y).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Gemv(x.to(at::kDouble), w, &y).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Gemv(x, w.t(), &y).code(), absl::StatusCode::kInvalidArgument);  // in-stride 16
  at::Tensor wrong = at::empty({1, 9});
  EXPECT_EQ(Gemv(x, w, &wrong).code(), absl::StatusCode::kInvalidArgument);
  at::Tensor ints = at::empty({1, 8}, at::kInt);
  EXPECT_EQ(Gemv(x, w, &ints).code(), absl::StatusCode::kInvalidArgument);
  at::Tensor undefined;
  GemvOptions accumulate;
  accumulate.accumulate = true;
  EXPECT_EQ(Gemv(x, w, &undefined, accumulate).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Gemv(x, w, nullptr).code(), absl::StatusCode::kInvalidArgument);
  std::vector<at::Tensor> ws = {w, w};
  std::vector<at::Tensor*> ys = {&y};
  EXPECT_EQ(GemvMulti(x, ws, ys).code(), absl::StatusCode::kInvalidArgument);
}

TEST(GemvTest, PathNamesRoundTripAndScalarIsAlwaysSupported) {
  for (GemvPath p :
       {GemvPath::kAvx512Bf16, GemvPath::kAvx512, GemvPath::kAvx2, GemvPath::kScalar}) {
    absl::StatusOr<GemvPath> parsed = ParseGemvPath(GemvPathName(p));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, p);
  }
  EXPECT_FALSE(ParseGemvPath("avx9000").ok());
  absl::StatusOr<GemvPath> best = ParseGemvPath("auto");
  ASSERT_TRUE(best.ok());
  EXPECT_TRUE(GemvPathSupported(*best));
  EXPECT_TRUE(GemvPathSupported(GemvPath::kScalar));
  EXPECT_TRUE(GemvPathSupported(DefaultGemvPath()));
}

// ctest runs this once more with VLM_GEMV_PATH=avx2 (tests/CMakeLists.txt).
TEST(GemvTest, EnvironmentForcesDefaultPath) {
  const char* env = std::getenv("VLM_GEMV_PATH");
  if (env == nullptr) GTEST_SKIP() << "VLM_GEMV_PATH is not set";
  absl::StatusOr<GemvPath> forced = ParseGemvPath(env);
  ASSERT_TRUE(forced.ok());
  if (!GemvPathSupported(*forced)) GTEST_SKIP() << "CPU lacks the " << env << " path";
  EXPECT_EQ(DefaultGemvPath(), *forced);
}

}  // namespace
}  // namespace vlm
