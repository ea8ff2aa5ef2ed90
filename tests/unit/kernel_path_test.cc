// The start-up choice of the GEMM path (kernel_path.h), without AMX hardware:
// the check is run with the emulated AMX kernel as the candidate (agrees,
// and is slower, so rejected for speed), with deliberately wrong candidates
// (rejected for their results), with a failing one, and the decision and
// the metric are checked for forced and automatic choices.
#include "common/kernels/kernel_path.h"

#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/kernels/amx_emulation_support.h"
#include "common/kernels/gemm_internal.h"
#include "common/metrics.h"

namespace vlm::kernels {
namespace {

class KernelPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::UseAmxEmulation();  // the AMX candidate is the emulation, even on AMX hardware
    if (!GemmPathSupported(GemmPath::kAvx512Bf16)) GTEST_SKIP() << "no AVX-512 BF16 here";
    options_.m = 40;  // one 32-row block and a tail; small, as the emulation is slow
    options_.n = 70;
    options_.k = 300;
    options_.timing_runs = 2;
  }
  void TearDown() override { internal::SetAmxBlockKernel(nullptr); }
  PathCheckOptions options_;
};

// A candidate that computes on the reference path and then spoils the result.
GemmCandidate Spoiled(std::string name, std::function<void(at::Tensor&)> spoil) {
  GemmCandidate base = CandidateForPath(GemmPath::kAvx512Bf16);
  return {std::move(name), [base, spoil](const at::Tensor& x, const PackedWeight& w, at::Tensor* y) {
            absl::Status s = base.run(x, w, y);
            if (s.ok()) spoil(*y);
            return s;
          }};
}

TEST_F(KernelPathTest, EmulatedAmxAgreesWithAvx512Bf16) {
  const PathCheck check = CheckGemmCandidate(CandidateForPath(GemmPath::kAmx),
                                             CandidateForPath(GemmPath::kAvx512Bf16), options_);
  EXPECT_TRUE(check.error.empty()) << check.error;
  EXPECT_TRUE(check.agrees) << check.Describe();
  EXPECT_LE(check.candidate_worst, 1.0);
  EXPECT_GT(check.candidate_seconds, 0.0);
  EXPECT_GT(check.reference_seconds, 0.0);
}

TEST_F(KernelPathTest, WrongCandidatesAreRejected) {
  // One element off by one bf16 ulp of its magnitude; a dropped last K
  // element (the kind of tail bug a blocking error makes); rows shifted by one.
  const std::vector<GemmCandidate> wrong = {
      Spoiled("one element", [](at::Tensor& y) { y[7][3] = y[7][3] * (1 + 1.0 / 128) + 1e-3; }),
      Spoiled("rows shifted", [](at::Tensor& y) { y.copy_(y.roll(1, 0)); }),
      Spoiled("NaN", [](at::Tensor& y) { y[0][0] = std::numeric_limits<float>::quiet_NaN(); }),
  };
  for (const GemmCandidate& c : wrong) {
    const PathCheck check = CheckGemmCandidate(c, CandidateForPath(GemmPath::kAvx512Bf16), options_);
    EXPECT_FALSE(check.agrees) << c.name << ": " << check.Describe();
    absl::StatusOr<KernelPathChoice> choice = ChooseKernelPath(std::nullopt, c, "", options_);
    ASSERT_TRUE(choice.ok()) << choice.status();
    EXPECT_EQ(choice->path, GemmPath::kAvx512Bf16) << c.name;
    EXPECT_NE(choice->reason.find("amx rejected, results wrong"), std::string::npos)
        << choice->reason;
  }
  // A K tail dropped: the last K element's products missing.
  GemmCandidate base = CandidateForPath(GemmPath::kAvx512Bf16);
  GemmCandidate short_k{"K tail dropped", [base](const at::Tensor& x, const PackedWeight& w,
                                                 at::Tensor* y) {
                          at::Tensor xs = x.clone();
                          xs.select(1, x.size(1) - 1).zero_();
                          return base.run(xs, w, y);
                        }};
  EXPECT_FALSE(CheckGemmCandidate(short_k, base, options_).agrees);
}

TEST_F(KernelPathTest, AFailingCandidateIsRejectedWithItsError) {
  GemmCandidate failing{"broken", [](const at::Tensor&, const PackedWeight&, at::Tensor*) {
                          return absl::InternalError("tile state lost");
                        }};
  absl::StatusOr<KernelPathChoice> choice = ChooseKernelPath(std::nullopt, failing, "", options_);
  ASSERT_TRUE(choice.ok());
  EXPECT_EQ(choice->path, GemmPath::kAvx512Bf16);
  EXPECT_NE(choice->reason.find("tile state lost"), std::string::npos) << choice->reason;
}

// The emulation agrees but is far slower than avx512bf16: rejected for speed.
// The avx512bf16 path checked against itself agrees; whichever run is faster,
// the reason names the outcome of both tests.
TEST_F(KernelPathTest, AutoTakesAmxOnlyWhenItAgreesAndIsFaster) {
  absl::StatusOr<KernelPathChoice> slow =
      ChooseKernelPath(std::nullopt, CandidateForPath(GemmPath::kAmx), "", options_);
  ASSERT_TRUE(slow.ok()) << slow.status();
  EXPECT_EQ(slow->path, GemmPath::kAvx512Bf16);
  EXPECT_NE(slow->reason.find("amx rejected, not faster"), std::string::npos) << slow->reason;
  std::printf("emulated amx: %s\n", slow->reason.c_str());

  // A candidate that agrees and takes no time at all (its result was
  // computed once beforehand): accepted.
  GemmCandidate ref = CandidateForPath(GemmPath::kAvx512Bf16);
  auto cached = std::make_shared<at::Tensor>();
  GemmCandidate instant{"amx", [ref, cached](const at::Tensor& x, const PackedWeight& w,
                                             at::Tensor* y) {
                          if (!cached->defined()) {
                            absl::Status s = ref.run(x, w, cached.get());
                            if (!s.ok()) return s;
                          }
                          *y = *cached;
                          return absl::OkStatus();
                        }};
  absl::StatusOr<KernelPathChoice> fast = ChooseKernelPath(std::nullopt, instant, "", options_);
  ASSERT_TRUE(fast.ok()) << fast.status();
  EXPECT_EQ(fast->path, GemmPath::kAmx) << fast->reason;
  EXPECT_NE(fast->reason.find("amx verified"), std::string::npos) << fast->reason;
  std::printf("instant candidate: %s\n", fast->reason.c_str());
}

TEST_F(KernelPathTest, NoAmxOrAForcedPathNeedsNoCheck) {
  absl::StatusOr<KernelPathChoice> none =
      ChooseKernelPath(std::nullopt, std::nullopt, "the CPU has no AMX-BF16 tiles", options_);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->path, GemmPath::kAvx512Bf16);
  EXPECT_NE(none->reason.find("no AMX (the CPU has no AMX-BF16 tiles)"), std::string::npos);
  for (GemmPath p : {GemmPath::kAmx, GemmPath::kAvx512Bf16, GemmPath::kTorch}) {
    absl::StatusOr<KernelPathChoice> forced = ChooseKernelPath(p, std::nullopt, "", options_);
    ASSERT_TRUE(forced.ok()) << forced.status();
    EXPECT_EQ(forced->path, p);
    EXPECT_NE(forced->reason.find("forced"), std::string::npos);
  }
  internal::SetAmxBlockKernel(nullptr);
  if (!testing::HaveAmxHardware()) {
    absl::StatusOr<KernelPathChoice> forced =
        ChooseKernelPath(GemmPath::kAmx, std::nullopt, "", options_);
    EXPECT_EQ(forced.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(forced.status().message().find("--kernel_path=amx cannot run here"),
              std::string::npos)
        << forced.status();
  }
}

TEST_F(KernelPathTest, ParsesTheFlagValues) {
  EXPECT_EQ(*ParseKernelPath("auto"), std::nullopt);
  EXPECT_EQ(*ParseKernelPath("amx"), GemmPath::kAmx);
  EXPECT_EQ(*ParseKernelPath("avx512bf16"), GemmPath::kAvx512Bf16);
  EXPECT_EQ(*ParseKernelPath("torch"), GemmPath::kTorch);
  absl::StatusOr<std::optional<GemmPath>> bad = ParseKernelPath("fastest");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("expected auto, amx, avx512bf16, avx2, torch"), std::string::npos)
      << bad.status();
}

TEST_F(KernelPathTest, StartupSetsTheDefaultAndExportsTheMetric) {
  internal::SetAmxBlockKernel(nullptr);  // the services never see the emulation
  absl::StatusOr<KernelPathChoice> choice = ChooseKernelPathAtStartup("test");
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(DefaultGemmPath(), choice->path);
  if (!testing::HaveAmxHardware()) {
    EXPECT_EQ(choice->path, GemmPath::kAvx512Bf16);
    EXPECT_NE(choice->reason.find("no AMX"), std::string::npos) << choice->reason;
  }
  const std::string text = RenderMetrics();
  const std::string chosen = std::string("vlm_kernel_path{op=\"gemm\",path=\"") +
                             GemmPathName(choice->path) + "\"} 1";
  EXPECT_NE(text.find(chosen), std::string::npos) << text;
  for (GemmPath p : {GemmPath::kAmx, GemmPath::kAvx512Bf16, GemmPath::kTorch}) {
    if (p == choice->path) continue;
    EXPECT_NE(text.find(std::string("vlm_kernel_path{op=\"gemm\",path=\"") + GemmPathName(p) +
                        "\"} 0"),
              std::string::npos)
        << GemmPathName(p);
  }
  // Once per process.
  absl::StatusOr<KernelPathChoice> again = ChooseKernelPathAtStartup("test");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->reason, choice->reason);
}

}  // namespace
}  // namespace vlm::kernels
