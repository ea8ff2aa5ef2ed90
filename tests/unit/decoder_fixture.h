// What the decoder tests share: where the tiny checkpoints and their text
// goldens are in the build tree, one golden case of the independent float32
// reference (tests/reference/text_ref.py) read into tensors, the relative error
// of a logits row, and the tiny model (projector + decoder) loaded in one call.
//
// Paths are under $VLM_BINARY_DIR (ctest sets it; "." otherwise), made by the
// ctest fixtures tiny_checkpoint, tiny_checkpoint_untied_f32, text_goldens and
// text_goldens_untied_f32, which a test using them lists in FIXTURES_REQUIRED.
// A read or load that fails records a GoogleTest failure (EXPECT) and returns
// a partly empty value: ASSERT on what the test needs (e.g. a non-null decoder).
#ifndef VLM_TESTS_UNIT_DECODER_FIXTURE_H_
#define VLM_TESTS_UNIT_DECODER_FIXTURE_H_

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/model_config.h"
#include "common/safetensors.h"
#include "services/language/model/decoder.h"
#include "services/language/model/projector.h"

namespace vlm::language::decoder_fixture {

inline std::string BinaryDir() {
  const char* dir = std::getenv("VLM_BINARY_DIR");
  return dir != nullptr && *dir != '\0' ? std::string(dir) : std::string(".");
}
// The tiny checkpoint (bf16, tied head) and its goldens.
inline std::string TinyDir() { return BinaryDir() + "/tiny_checkpoint"; }
inline std::string GoldenDir() { return BinaryDir() + "/goldens/text"; }
// The tiny checkpoint with an untied head, f32 weights in two shards, and its goldens.
inline std::string UntiedF32Dir() { return BinaryDir() + "/tiny_checkpoint_untied_f32"; }
inline std::string UntiedGoldenDir() { return BinaryDir() + "/goldens/text_untied_f32"; }

// f32 logits against the reference: max |diff| / max |logit| of each position.
constexpr double kF32Tolerance = 1e-4;

// The golden cases text_ref.py writes (text_<name>.safetensors).
inline constexpr const char* kCases[] = {"text", "one_image", "two_images"};

// One golden case: a prompt (with its images' vision features), the
// reference's MRoPE positions, its greedy continuation and its logits.
struct Case {
  std::string name;
  std::vector<int32_t> ids;  // the prompt, S tokens
  std::vector<GridThw> grids;
  at::Tensor last_hidden;        // the vision tower's output for all images, or undefined
  std::vector<at::Tensor> taps;  // its deepstack taps
  at::Tensor positions;          // [3, S] int64
  int64_t rope_delta = 0;
  std::vector<int32_t> greedy;  // G tokens
  at::Tensor logits;            // [S + G - 1, vocab]: row S - 1 + i predicts greedy[i]
  // prompt + greedy[:-1]: the teacher-forced full sequence.
  std::vector<int32_t> Full() const {
    std::vector<int32_t> full = ids;
    full.insert(full.end(), greedy.begin(), greedy.end() - 1);
    return full;
  }
};

// Reads `dir`/text_`name`.safetensors.
inline Case ReadCase(const std::string& dir, const std::string& name) {
  Case c;
  c.name = name;
  auto file = SafetensorsCheckpoint::Open(dir + "/text_" + name + ".safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return c;
  auto get = [&](const std::string& t) { return (*file)->Tensor(t).value().clone(); };
  const at::Tensor ids = get("input_ids");
  for (int64_t i = 0; i < ids.numel(); ++i) {
    c.ids.push_back(static_cast<int32_t>(ids[i].item<int64_t>()));
  }
  if ((*file)->Has("grid_thw")) {
    const at::Tensor g = get("grid_thw");
    for (int64_t i = 0; i < g.size(0); ++i) {
      c.grids.push_back(
          {g[i][0].item<int64_t>(), g[i][1].item<int64_t>(), g[i][2].item<int64_t>()});
    }
    c.last_hidden = get("features.last_hidden");
    for (int j = 0; (*file)->Has("features.deepstack." + std::to_string(j)); ++j) {
      c.taps.push_back(get("features.deepstack." + std::to_string(j)));
    }
  }
  c.positions = get("positions");
  c.rope_delta = get("rope_delta")[0].item<int64_t>();
  const at::Tensor greedy = get("greedy");
  for (int64_t i = 0; i < greedy.numel(); ++i) {
    c.greedy.push_back(static_cast<int32_t>(greedy[i].item<int64_t>()));
  }
  c.logits = get("logits");
  return c;
}

// max |got - want| / max |want| of one logits row.
inline double RowError(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).abs().max().item<double>() / want.abs().max().item<double>();
}

// A checkpoint's language side, loaded.
struct Model {
  std::shared_ptr<const SafetensorsCheckpoint> checkpoint;
  ModelConfig config;
  std::unique_ptr<Projector> projector;
  std::unique_ptr<Decoder> decoder;
};

// Loads the checkpoint in `dir` with both parts computing in `dtype`
// (options.compute_dtype is overwritten).
inline Model Load(const std::string& dir, ComputeDType dtype, DecoderOptions options = {}) {
  Model m;
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  if (!ckpt.ok()) return m;
  m.checkpoint = std::shared_ptr<const SafetensorsCheckpoint>(*std::move(ckpt));
  auto config = LoadModelConfig(dir);
  EXPECT_TRUE(config.ok()) << config.status();
  if (!config.ok()) return m;
  m.config = *config;
  ProjectorOptions po;
  po.compute_dtype = dtype;
  auto projector = Projector::Load(*m.checkpoint, m.config, po);
  EXPECT_TRUE(projector.ok()) << projector.status();
  if (projector.ok()) m.projector = *std::move(projector);
  options.compute_dtype = dtype;
  auto decoder = Decoder::Load(m.checkpoint, m.config, options);
  EXPECT_TRUE(decoder.ok()) << decoder.status();
  if (decoder.ok()) m.decoder = *std::move(decoder);
  return m;
}

}  // namespace vlm::language::decoder_fixture

#endif  // VLM_TESTS_UNIT_DECODER_FIXTURE_H_
