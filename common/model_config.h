// The checkpoint's JSON configuration: config.json (both the transformers 4.57
// rope_scaling/rope_theta layout and the v5 rope_parameters layout),
// generation_config.json and preprocessor_config.json.
//
// Every model-shape field is required: a missing or ill-typed field is an
// INVALID_ARGUMENT naming the file and the key (e.g.
// "config.json: text_config.head_dim: missing"). There are no silent defaults
// for shapes; only fields the reference itself defaults are defaulted, and
// those are listed beside the field.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace vlm {

struct TextConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  double rms_norm_eps = 0;
  double rope_theta = 0;
  std::array<int64_t, 3> mrope_section{};  // frequencies owned by T, H, W
  bool mrope_interleaved = true;           // informational; the layout is always interleaved
  std::string hidden_act;                  // "silu"
  bool attention_bias = false;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;     // a limit only
  std::string dtype;                       // "bfloat16" ("dtype" or "torch_dtype"); may be empty
};

struct VisionConfig {
  int64_t depth = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_heads = 0;
  std::string hidden_act;  // "gelu_pytorch_tanh"
  int64_t in_channels = 0;
  int64_t patch_size = 0;
  int64_t spatial_merge_size = 0;
  int64_t temporal_patch_size = 0;
  int64_t out_hidden_size = 0;
  int64_t num_position_embeddings = 0;  // a perfect square
  std::vector<int64_t> deepstack_visual_indexes;
  int64_t head_dim() const { return hidden_size / num_heads; }
  int64_t pos_grid() const;  // sqrt(num_position_embeddings)
};

struct ModelConfig {
  TextConfig text;
  VisionConfig vision;
  int64_t image_token_id = 0;
  int64_t video_token_id = 0;
  int64_t vision_start_token_id = 0;
  int64_t vision_end_token_id = 0;
  // The flag that decides tying: text_config's (what HF 4.5x uses). If the
  // top level disagrees, `tie_warning` says so.
  bool tie_word_embeddings = false;
  std::string tie_warning;
  std::string model_type;  // "qwen3_vl"
};

struct GenerationConfig {
  std::vector<int64_t> eos_token_ids;  // int or list in the file
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> pad_token_id;
  bool do_sample = false;          // reference default false
  double temperature = 1.0;        // reference default 1.0
  int64_t top_k = 50;              // reference default 50
  double top_p = 1.0;              // reference default 1.0
  double repetition_penalty = 1.0; // reference default 1.0
  std::optional<int64_t> max_new_tokens;
};

struct PreprocessorConfig {
  int64_t min_pixels = 0;  // size.shortest_edge, or legacy min_pixels (overrides)
  int64_t max_pixels = 0;  // size.longest_edge, or legacy max_pixels (overrides)
  int64_t patch_size = 0;
  int64_t temporal_patch_size = 0;
  int64_t merge_size = 0;
  std::array<double, 3> image_mean{};
  std::array<double, 3> image_std{};
  double rescale_factor = 1.0 / 255.0;  // class default
  bool do_resize = true;                // class defaults
  bool do_rescale = true;
  bool do_normalize = true;
  bool do_convert_rgb = true;
  int64_t resample = 3;                 // BICUBIC
};

// Parsers take the file's text and its display name (for messages).
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source = "config.json");
absl::StatusOr<GenerationConfig> ParseGenerationConfig(
    const std::string& json_text, const std::string& source = "generation_config.json");
absl::StatusOr<PreprocessorConfig> ParsePreprocessorConfig(
    const std::string& json_text, const std::string& source = "preprocessor_config.json");

// Readers of <dir>/config.json etc. NOT_FOUND names the missing file.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);
absl::StatusOr<GenerationConfig> LoadGenerationConfig(const std::string& dir);
absl::StatusOr<PreprocessorConfig> LoadPreprocessorConfig(const std::string& dir);

// Reads a whole file; NOT_FOUND / INTERNAL naming the path.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

}  // namespace vlm
