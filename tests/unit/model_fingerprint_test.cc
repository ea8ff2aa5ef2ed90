#include "common/model_fingerprint.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "common/sha256.h"

namespace vlm {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "vlm_fingerprint_XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

constexpr char kConfig[] =
    R"({"model_type":"qwen3_vl","text_config":{"hidden_size":64,"rms_norm_eps":1e-06},)"
    R"("vision_config":{"depth":2,"hidden_size":32}})";

using Tensors = std::vector<std::pair<std::string, at::Tensor>>;

Tensors Base() {
  return {{"model.language_model.embed_tokens.weight", at::zeros({10, 4}, at::kBFloat16)},
          {"model.visual.patch_embed.proj.weight", at::zeros({8, 3, 2, 2, 2}, at::kBFloat16)},
          {"model.visual.blocks.0.norm1.weight", at::zeros({8}, at::kBFloat16)},
          {"lm_head.weight", at::zeros({10, 4}, at::kBFloat16)}};
}

std::unique_ptr<SafetensorsCheckpoint> Write(const TempDir& dir, const std::string& sub, const Tensors& tensors,
                                             int shards = 1, std::map<std::string, std::string> metadata = {}) {
  SafetensorsWriter w;
  for (const auto& [name, t] : tensors) EXPECT_TRUE(w.Add(name, t).ok());
  for (const auto& [k, v] : metadata) w.SetMetadata(k, v);
  EXPECT_TRUE(w.WriteSharded(dir / sub, shards).ok());
  auto ckpt = SafetensorsCheckpoint::Open(dir / sub);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  return std::move(*ckpt);
}

Tensors Replace(Tensors t, const std::string& name, at::Tensor value) {
  for (auto& [n, v] : t) {
    if (n == name) v = std::move(value);
  }
  return t;
}

std::string Vision(std::string_view config, const SafetensorsCheckpoint& ckpt) {
  auto fp = ComponentFingerprint(config, ckpt, "vision_config", "model.visual.");
  EXPECT_TRUE(fp.ok()) << fp.status();
  return fp.ok() ? *fp : "";
}

TEST(ModelFingerprintTest, IsLowercaseHexAndIndependentOfLayout) {
  TempDir dir;
  auto single = Write(dir, "single", Base());
  const Tensors base = Base();
  const Tensors reversed(base.rbegin(), base.rend());
  auto sharded = Write(dir, "sharded", reversed, 3);
  const std::string fp = ModelFingerprint(kConfig, *single);
  EXPECT_EQ(fp.size(), 64u);
  EXPECT_EQ(fp.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_EQ(ModelFingerprint(kConfig, *sharded), fp);
  EXPECT_EQ(Vision(kConfig, *sharded), Vision(kConfig, *single));
}

TEST(ModelFingerprintTest, HashesTheDocumentedFraming) {
  // Pins the v1 stream so fingerprints stay comparable across releases (disk caches).
  TempDir dir;
  auto ckpt = Write(dir, "m", {{"b", at::zeros({2, 3}, at::kHalf)}, {"a", at::zeros({1})}}, 1, {{"format", "pt"}});
  auto field = [](const std::string& s) { return std::to_string(s.size()) + ":" + s + ","; };
  const std::string config = "{}";
  const std::string stream = field("vlm-model-fingerprint-v1") + field("model") + field(config) + field("") +
                             field("format") + field("pt") + field("tensors") + field("a") + field("F32") +
                             field("1") + field("b") + field("F16") + field("2,3");
  EXPECT_EQ(ModelFingerprint(config, *ckpt), Sha256Hex(stream));
}

TEST(ModelFingerprintTest, ChangesWithConfigBytesTensorHeadersAndMetadata) {
  TempDir dir;
  auto base = Write(dir, "base", Base());
  const std::string fp = ModelFingerprint(kConfig, *base);
  EXPECT_NE(ModelFingerprint(std::string(kConfig) + " ", *base), fp);  // exact bytes
  auto shape = Write(dir, "shape", Replace(Base(), "lm_head.weight", at::zeros({11, 4}, at::kBFloat16)));
  EXPECT_NE(ModelFingerprint(kConfig, *shape), fp);
  auto dtype = Write(dir, "dtype", Replace(Base(), "lm_head.weight", at::zeros({10, 4}, at::kHalf)));
  EXPECT_NE(ModelFingerprint(kConfig, *dtype), fp);
  Tensors renamed = Base();
  renamed.back().first = "lm_head.weight2";
  EXPECT_NE(ModelFingerprint(kConfig, *Write(dir, "renamed", renamed)), fp);
  Tensors more = Base();
  more.emplace_back("extra", at::zeros({1}));
  EXPECT_NE(ModelFingerprint(kConfig, *Write(dir, "more", more)), fp);
  EXPECT_NE(ModelFingerprint(kConfig, *Write(dir, "seeded", Base(), 1, {{"seed", "1"}})), fp);
  // Values are not hashed: same headers, different weights, same fingerprint.
  auto values = Write(dir, "values", Replace(Base(), "lm_head.weight", at::ones({10, 4}, at::kBFloat16)));
  EXPECT_EQ(ModelFingerprint(kConfig, *values), fp);
}

TEST(ModelFingerprintTest, VisionFingerprintIgnoresTextChanges) {
  TempDir dir;
  auto base = Write(dir, "base", Base());
  const std::string vision = Vision(kConfig, *base);
  // Text weights, text config and formatting do not matter...
  auto text = Write(dir, "text", Replace(Base(), "lm_head.weight", at::zeros({12, 4}, at::kBFloat16)));
  EXPECT_EQ(Vision(kConfig, *text), vision);
  EXPECT_NE(ModelFingerprint(kConfig, *text), ModelFingerprint(kConfig, *base));
  const std::string reformatted =
      "{\n  \"vision_config\": {\"hidden_size\": 32, \"depth\": 2},\n  \"model_type\": \"qwen3_vl\",\n"
      "  \"text_config\": {\"hidden_size\": 128, \"rms_norm_eps\": 1e-5}\n}\n";
  EXPECT_EQ(Vision(reformatted, *base), vision);
  // ...vision weights' headers and vision_config do.
  auto vis = Write(dir, "vis", Replace(Base(), "model.visual.blocks.0.norm1.weight", at::zeros({8}, at::kFloat)));
  EXPECT_NE(Vision(kConfig, *vis), vision);
  const std::string deeper = R"({"vision_config":{"depth":3,"hidden_size":32}})";
  EXPECT_NE(Vision(deeper, *base), vision);
  // The prefix-restricted model fingerprint also ignores text tensors.
  EXPECT_EQ(ModelFingerprint(kConfig, *text, "model.visual."), ModelFingerprint(kConfig, *base, "model.visual."));
  EXPECT_NE(ModelFingerprint(kConfig, *vis, "model.visual."), ModelFingerprint(kConfig, *base, "model.visual."));
}

TEST(ModelFingerprintTest, ComponentFingerprintValidatesConfig) {
  TempDir dir;
  auto base = Write(dir, "base", Base());
  EXPECT_EQ(ComponentFingerprint("{not json", *base, "vision_config", "model.visual.").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComponentFingerprint("[]", *base, "vision_config", "model.visual.").status().code(),
            absl::StatusCode::kInvalidArgument);
  auto missing = ComponentFingerprint("{}", *base, "vision_config", "model.visual.");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("vision_config"), std::string::npos);
}

TEST(ModelFingerprintTest, OfDirReadsConfigJson) {
  TempDir dir;
  auto ckpt = Write(dir, "m", Base(), 2);
  EXPECT_EQ(ModelFingerprintOfDir(dir / "m").status().code(), absl::StatusCode::kNotFound);
  std::ofstream(dir / "m/config.json", std::ios::binary) << kConfig;
  auto fp = ModelFingerprintOfDir(dir / "m");
  ASSERT_TRUE(fp.ok()) << fp.status();
  EXPECT_EQ(*fp, ModelFingerprint(kConfig, *ckpt));
}

}  // namespace
}  // namespace vlm
