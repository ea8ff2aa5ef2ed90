// The projector (patch merger + deepstack mergers) on the tiny checkpoint
// against tests/reference/projector_ref.py (via text_ref.py's goldens).
#include "services/language/model/projector.h"

#include <cstdlib>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace vlm::language {
namespace {

std::string Env(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : fallback;
}

std::string BinaryDir() { return Env("VLM_BINARY_DIR", "."); }

struct Golden {
  at::Tensor last_hidden;
  std::vector<at::Tensor> taps;
  std::vector<GridThw> grids;
  at::Tensor image_embeds;
  std::vector<at::Tensor> deepstack_embeds;
};

Golden ReadGolden(const std::string& name) {
  const std::string path = BinaryDir() + "/goldens/text/text_" + name + ".safetensors";
  auto file = SafetensorsCheckpoint::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  auto get = [&](const std::string& t) { return (*file)->Tensor(t).value().clone(); };
  Golden g;
  g.last_hidden = get("features.last_hidden");
  for (int j = 0; (*file)->Has("features.deepstack." + std::to_string(j)); ++j) {
    g.taps.push_back(get("features.deepstack." + std::to_string(j)));
    g.deepstack_embeds.push_back(get("deepstack_embeds." + std::to_string(j)));
  }
  at::Tensor grid = get("grid_thw");
  for (int64_t i = 0; i < grid.size(0); ++i) {
    g.grids.push_back({grid[i][0].item<int64_t>(), grid[i][1].item<int64_t>(),
                       grid[i][2].item<int64_t>()});
  }
  g.image_embeds = get("image_embeds");
  return g;
}

double RelErr(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kFloat) - want).abs().max().item<double>() /
         want.abs().max().item<double>();
}

class ProjectorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ckpt = SafetensorsCheckpoint::Open(BinaryDir() + "/tiny_checkpoint");
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    checkpoint_ = *std::move(ckpt);
    auto config = LoadModelConfig(BinaryDir() + "/tiny_checkpoint");
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *config;
  }
  std::unique_ptr<Projector> Make(ComputeDType dtype) {
    ProjectorOptions o;
    o.compute_dtype = dtype;
    auto p = Projector::Load(*checkpoint_, config_, o);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : nullptr;
  }
  std::unique_ptr<SafetensorsCheckpoint> checkpoint_;
  ModelConfig config_;
};

TEST_F(ProjectorTest, Float32MatchesReference) {
  auto p = Make(ComputeDType::kFloat32);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->converted_weight_bytes() > 0, true);  // bf16 checkpoint, f32 compute
  for (const char* name : {"one_image", "two_images"}) {
    Golden g = ReadGolden(name);
    auto out = p->Forward(g.last_hidden, g.taps, g.grids);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->image_embeds.sizes(), g.image_embeds.sizes());
    EXPECT_LT(RelErr(out->image_embeds, g.image_embeds), 1e-5) << name;
    ASSERT_EQ(out->deepstack.size(), g.deepstack_embeds.size());
    for (size_t j = 0; j < g.deepstack_embeds.size(); ++j) {
      EXPECT_LT(RelErr(out->deepstack[j], g.deepstack_embeds[j]), 1e-5) << name << " ds " << j;
    }
  }
}

TEST_F(ProjectorTest, Bfloat16IsCloseAndZeroCopy) {
  auto p = Make(ComputeDType::kBFloat16);
  ASSERT_NE(p, nullptr);
  if (p->compute_dtype() != ComputeDType::kBFloat16) GTEST_SKIP() << p->load_summary();
  EXPECT_EQ(p->converted_weight_bytes(), 0u);
  EXPECT_GT(p->borrowed_weight_bytes(), 0u);
  Golden g = ReadGolden("two_images");
  // bf16 features on the wire.
  std::vector<at::Tensor> taps;
  for (const auto& t : g.taps) taps.push_back(t.to(at::kBFloat16));
  auto out = p->Forward(g.last_hidden.to(at::kBFloat16), taps, g.grids);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->image_embeds.scalar_type(), at::kBFloat16);
  EXPECT_LT(RelErr(out->image_embeds, g.image_embeds), 3e-2);
  for (size_t j = 0; j < g.deepstack_embeds.size(); ++j) {
    EXPECT_LT(RelErr(out->deepstack[j], g.deepstack_embeds[j]), 3e-2);
  }
}

TEST_F(ProjectorTest, WarmUpSucceeds) {
  for (ComputeDType d : {ComputeDType::kFloat32, ComputeDType::kBFloat16}) {
    auto p = Make(d);
    ASSERT_NE(p, nullptr);
    EXPECT_TRUE(p->WarmUp().ok());
  }
}

TEST_F(ProjectorTest, RejectsInputsNotMatchingTheGrid) {
  auto p = Make(ComputeDType::kFloat32);
  ASSERT_NE(p, nullptr);
  Golden g = ReadGolden("one_image");  // grid (1, 6, 8): 48 patches
  // Grid too large for the features.
  std::vector<GridThw> big = {{1, 8, 8}};
  auto r = p->Forward(g.last_hidden, g.taps, big);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("features"), std::string::npos) << r.status();
  // Odd grid.
  std::vector<GridThw> odd = {{1, 3, 16}};
  EXPECT_EQ(p->Forward(g.last_hidden, g.taps, odd).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Wrong width.
  EXPECT_EQ(p->Forward(g.last_hidden.narrow(1, 0, 32), g.taps, g.grids).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Wrong dtype.
  EXPECT_EQ(p->Forward(g.last_hidden.to(at::kInt), g.taps, g.grids).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Missing deepstack level.
  std::vector<at::Tensor> one_tap = {g.taps[0]};
  r = p->Forward(g.last_hidden, one_tap, g.grids);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("deepstack"), std::string::npos) << r.status();
  // A deepstack tap of the wrong shape.
  std::vector<at::Tensor> bad = {g.taps[0], g.taps[1].narrow(0, 0, 44)};
  EXPECT_EQ(p->Forward(g.last_hidden, bad, g.grids).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace vlm::language
