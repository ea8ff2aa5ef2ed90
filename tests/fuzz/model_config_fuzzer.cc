// libFuzzer target: the checkpoint's JSON configuration parsers.
//
// Input: byte 0 modulo 3 selects config.json, generation_config.json or
// preprocessor_config.json; the rest is the file's text. Any text must give a
// status, never a crash; an accepted file must hold the invariants the header
// promises (every shape positive, rotary sections within head_dim / 2, a
// square position table, positive pixel budgets ...), because the model code
// divides and allocates by them without checking again.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/model_config.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

void CheckModelConfig(const vlm::ModelConfig& c) {
  const vlm::TextConfig& t = c.text;
  FUZZ_CHECK(t.vocab_size > 0 && t.hidden_size > 0 && t.intermediate_size > 0 &&
                 t.num_hidden_layers > 0 && t.num_attention_heads > 0 &&
                 t.num_key_value_heads > 0 && t.head_dim > 0 && t.head_dim % 2 == 0,
             "accepted a non-positive text shape");
  FUZZ_CHECK(t.rms_norm_eps > 0 && std::isfinite(t.rms_norm_eps) && t.rope_theta > 0 &&
                 std::isfinite(t.rope_theta),
             "accepted eps %g / rope_theta %g", t.rms_norm_eps, t.rope_theta);
  int64_t sections = 0;
  for (int64_t s : t.mrope_section) {
    FUZZ_CHECK(s >= 0 && s <= t.head_dim / 2, "mrope section %lld", static_cast<long long>(s));
    sections += s;
  }
  FUZZ_CHECK(sections <= t.head_dim / 2, "mrope sections sum to %lld",
             static_cast<long long>(sections));
  const vlm::VisionConfig& v = c.vision;
  FUZZ_CHECK(v.depth > 0 && v.hidden_size > 0 && v.num_heads > 0 && v.patch_size > 0 &&
                 v.spatial_merge_size > 0 && v.temporal_patch_size > 0 && v.in_channels > 0 &&
                 v.out_hidden_size > 0 && v.num_position_embeddings > 0,
             "accepted a non-positive vision shape");
  FUZZ_CHECK(v.hidden_size % v.num_heads == 0 && v.head_dim() > 0, "vision head_dim %lld",
             static_cast<long long>(v.head_dim()));
  const int64_t grid = v.pos_grid();
  FUZZ_CHECK(grid > 0 && grid * grid == v.num_position_embeddings,
             "num_position_embeddings %lld is not a square (grid %lld)",
             static_cast<long long>(v.num_position_embeddings), static_cast<long long>(grid));
  for (int64_t index : v.deepstack_visual_indexes) {
    FUZZ_CHECK(index >= 0 && index < v.depth, "deepstack index %lld of depth %lld",
               static_cast<long long>(index), static_cast<long long>(v.depth));
  }
}

void CheckPreprocessorConfig(const vlm::PreprocessorConfig& p) {
  FUZZ_CHECK(p.min_pixels > 0 && p.max_pixels > 0 && p.patch_size > 0 &&
                 p.temporal_patch_size > 0 && p.merge_size > 0,
             "accepted a non-positive preprocessor size");
  for (double s : p.image_std) FUZZ_CHECK(s > 0 && std::isfinite(s), "image_std %g", s);
  FUZZ_CHECK(p.rescale_factor > 0 && std::isfinite(p.rescale_factor), "rescale_factor %g",
             p.rescale_factor);
}

void CheckGenerationConfig(const vlm::GenerationConfig& g) {
  FUZZ_CHECK(g.top_p > 0 && g.top_p <= 1, "top_p %g", g.top_p);
  FUZZ_CHECK(g.repetition_penalty > 0 && std::isfinite(g.repetition_penalty),
             "repetition_penalty %g", g.repetition_penalty);
  FUZZ_CHECK(!g.max_new_tokens || *g.max_new_tokens > 0, "max_new_tokens %lld",
             static_cast<long long>(*g.max_new_tokens));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 3) {
    case 0:
      if (auto c = vlm::ParseModelConfig(text); c.ok()) CheckModelConfig(*c);
      break;
    case 1:
      if (auto g = vlm::ParseGenerationConfig(text); g.ok()) CheckGenerationConfig(*g);
      break;
    default:
      if (auto p = vlm::ParsePreprocessorConfig(text); p.ok()) CheckPreprocessorConfig(*p);
      break;
  }
  return 0;
}
