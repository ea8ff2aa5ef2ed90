// The ViT through common/kernels (packed GEMM + flash attention) against the
// previous LibTorch path and the float32 forward, on the tiny checkpoint, with
// the GEMM on avx512bf16 and on amx (the AMX emulation where the CPU has none).
#include <cstdlib>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "common/cpu_features.h"
#include "common/kernels/amx_emulation_support.h"
#include "common/kernels/flash_attention.h"
#include "common/kernels/gemm.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "services/vision/vision_model.h"

namespace vlm {
namespace {

std::string CheckpointDir() {
  const char* v = std::getenv("VLM_TINY_CHECKPOINT");
  if (v && *v) return v;
  const char* b = std::getenv("VLM_BINARY_DIR");
  return std::string(b && *b ? b : ".") + "/tiny_checkpoint";
}

double MinRowCosine(const at::Tensor& a, const at::Tensor& b) {
  return at::cosine_similarity(a.to(at::kDouble), b.to(at::kDouble), 1).min().item<double>();
}

// Param: the GEMM path made the default for the test; amx runs on real tiles
// where the CPU has them, else on the AMX emulation.
class VisionKernelsTest : public ::testing::TestWithParam<kernels::GemmPath> {
 protected:
  void SetUp() override {
    at::set_num_threads(2);
    if (!kernels::FlashAttentionSupported()) GTEST_SKIP() << "this CPU has no AVX-512 BF16";
    if (!GetCpuFeatures().avx512bf16) {
      GTEST_SKIP() << "the " << kernels::GemmPathName(GetParam())
                   << " path needs AVX-512 BF16, which this CPU or VLM_ISA does not offer";
    }
    before_ = kernels::DefaultGemmPath();
    if (GetParam() == kernels::GemmPath::kAmx) {
      RecordProperty("amx", kernels::testing::UseAmxEmulationUnlessHardware());
    }
    ASSERT_TRUE(kernels::SetDefaultGemmPath(GetParam()).ok());
    if (GetCpuFeatures().amx_bf16 && GetParam() != kernels::GemmPath::kAmx) {
      GTEST_SKIP() << "AMX CPU: the ViT keeps oneDNN's AMX unless the GEMM path is amx";
    }
    auto checkpoint = SafetensorsCheckpoint::Open(CheckpointDir());
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    checkpoint_ = std::move(*checkpoint);
    auto config = LoadModelConfig(CheckpointDir());
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *config;
  }
  void TearDown() override { (void)kernels::SetDefaultGemmPath(before_); }
  // kernels false: the LibTorch path, which the model takes when the process's
  // GEMM path is torch at Load.
  std::unique_ptr<VisionModel> Load(ComputeDType dtype, bool kernels) {
    VisionModelOptions o;
    o.compute_dtype = dtype;
    if (!kernels) {
      EXPECT_TRUE(kernels::SetDefaultGemmPath(kernels::GemmPath::kTorch).ok());
    }
    auto m = VisionModel::Load(*checkpoint_, config_, o);
    if (!kernels) {
      EXPECT_TRUE(kernels::SetDefaultGemmPath(GetParam()).ok());
    }
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? std::move(*m) : nullptr;
  }
  std::unique_ptr<SafetensorsCheckpoint> checkpoint_;
  ModelConfig config_;
  kernels::GemmPath before_ = kernels::GemmPath::kTorch;
};

TEST_P(VisionKernelsTest, KernelPathAgreesWithLibTorchPathAndFloat32) {
  auto fast = Load(ComputeDType::kBFloat16, true);
  auto old = Load(ComputeDType::kBFloat16, false);
  auto f32 = Load(ComputeDType::kFloat32, true);
  ASSERT_TRUE(fast && old && f32);
  ASSERT_TRUE(fast->uses_kernels());
  EXPECT_NE(fast->load_summary().find(std::string("gemm ") + kernels::GemmPathName(GetParam())),
            std::string::npos)
      << fast->load_summary();
  EXPECT_FALSE(old->uses_kernels());
  EXPECT_FALSE(f32->uses_kernels());  // float32 stays on LibTorch
  EXPECT_GT(fast->packed_weight_bytes(), 0u);
  EXPECT_EQ(old->packed_weight_bytes(), 0u);
  at::manual_seed(3);
  const int64_t merge = config_.vision.spatial_merge_size;
  // Two images (one segment longer than a 128-key block) and a two-frame video.
  const std::vector<GridThw> grids = {{1, 4 * merge, 6 * merge}, {1, 8 * merge, 10 * merge},
                                      {2, 2 * merge, 2 * merge}};
  int64_t n = 0;
  for (const auto& g : grids) n += g[0] * g[1] * g[2];
  const at::Tensor pixels = at::randn({n, fast->patch_dim()});
  auto a = fast->Forward(pixels, grids);
  auto b = old->Forward(pixels, grids);
  auto c = f32->Forward(pixels, grids);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->last_hidden.scalar_type(), at::kBFloat16);
  const double vs_old = MinRowCosine(a->last_hidden, b->last_hidden);
  const double vs_f32 = MinRowCosine(a->last_hidden, c->last_hidden);
  const double old_vs_f32 = MinRowCosine(b->last_hidden, c->last_hidden);
  std::printf("min row cosine: kernels vs LibTorch bf16 %.6f, kernels vs f32 %.6f, "
              "LibTorch bf16 vs f32 %.6f\n", vs_old, vs_f32, old_vs_f32);
  EXPECT_GE(vs_old, 0.999);
  EXPECT_GE(vs_f32, 0.999);
  ASSERT_EQ(a->deepstack.size(), c->deepstack.size());
  for (size_t j = 0; j < a->deepstack.size(); ++j) {
    EXPECT_GE(MinRowCosine(a->deepstack[j], c->deepstack[j]), 0.999) << "tap " << j;
  }
}

TEST_P(VisionKernelsTest, ImageFeaturesDoNotDependOnTheBatch) {
  auto fast = Load(ComputeDType::kBFloat16, true);
  ASSERT_TRUE(fast);
  const int64_t m = config_.vision.spatial_merge_size;
  const std::vector<GridThw> both = {{1, 2 * m, 4 * m}, {1, 6 * m, 2 * m}};
  const int64_t n0 = 8 * m * m, n1 = 12 * m * m;
  at::manual_seed(5);
  const at::Tensor pixels = at::randn({n0 + n1, fast->patch_dim()});
  auto together = fast->Forward(pixels, both);
  auto alone = fast->Forward(pixels.narrow(0, n0, n1), {both[1]});
  ASSERT_TRUE(together.ok() && alone.ok());
  // Row-invariant GEMM + per-image attention: the same bits either way.
  EXPECT_TRUE(at::equal(together->last_hidden.narrow(0, n0, n1), alone->last_hidden));
}

INSTANTIATE_TEST_SUITE_P(GemmPaths, VisionKernelsTest,
                         ::testing::Values(kernels::GemmPath::kAvx512Bf16, kernels::GemmPath::kAmx),
                         [](const auto& info) { return std::string(kernels::GemmPathName(info.param)); });

}  // namespace
}  // namespace vlm
