#include "common/model_config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/numeric/int128.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace vlm {
namespace {

using Json = nlohmann::json;

const char* JsonTypeName(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "integer";
    case Json::value_t::number_float: return "float";
    case Json::value_t::string: return "string";
    case Json::value_t::array: return "array";
    case Json::value_t::object: return "object";
    default: return "unknown";
  }
}

// Reads typed fields of one JSON object and phrases every error as
// "<source>: <prefix><key>: <problem>".
class Fields {
 public:
  Fields(const Json& obj, std::string source, std::string prefix)
      : obj_(obj), source_(std::move(source)), prefix_(std::move(prefix)) {}

  std::string Key(const std::string& key) const { return prefix_ + key; }

  absl::Status Error(const std::string& key, const std::string& problem) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", Key(key), ": ", problem));
  }
  absl::Status Missing(const std::string& key) const { return Error(key, "missing"); }
  absl::Status WrongType(const std::string& key, const char* expected, const Json& got) const {
    return Error(key, absl::StrCat("expected ", expected, ", got ", JsonTypeName(got)));
  }

  // Present and not null.
  bool Has(const std::string& key) const {
    auto it = obj_.find(key);
    return it != obj_.end() && !it->is_null();
  }
  const Json& At(const std::string& key) const { return obj_.at(key); }

  absl::StatusOr<int64_t> Int(const std::string& key) const {
    if (!Has(key)) return Missing(key);
    return AsInt(key, At(key));
  }
  absl::StatusOr<int64_t> AsInt(const std::string& key, const Json& v) const {
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) return Error(key, "out of range");
      return static_cast<int64_t>(v.get<uint64_t>());
    }
    if (v.is_number_integer()) return v.get<int64_t>();
    return WrongType(key, "integer", v);
  }
  absl::StatusOr<double> Number(const std::string& key) const {
    if (!Has(key)) return Missing(key);
    const Json& v = At(key);
    if (!v.is_number()) return WrongType(key, "number", v);
    return v.get<double>();
  }
  absl::StatusOr<bool> Bool(const std::string& key) const {
    if (!Has(key)) return Missing(key);
    const Json& v = At(key);
    if (!v.is_boolean()) return WrongType(key, "boolean", v);
    return v.get<bool>();
  }
  absl::StatusOr<std::string> String(const std::string& key) const {
    if (!Has(key)) return Missing(key);
    const Json& v = At(key);
    if (!v.is_string()) return WrongType(key, "string", v);
    return v.get<std::string>();
  }
  absl::StatusOr<const Json*> Object(const std::string& key) const {
    if (!Has(key)) return Missing(key);
    const Json& v = At(key);
    if (!v.is_object()) return WrongType(key, "object", v);
    return &v;
  }
  absl::StatusOr<std::vector<int64_t>> IntList(const std::string& key) const {
    if (!Has(key)) return Missing(key);
    const Json& v = At(key);
    if (!v.is_array()) return WrongType(key, "array of integers", v);
    std::vector<int64_t> out;
    for (size_t i = 0; i < v.size(); ++i) {
      auto x = AsInt(absl::StrCat(key, "[", i, "]"), v[i]);
      if (!x.ok()) return x.status();
      out.push_back(*x);
    }
    return out;
  }
  absl::StatusOr<std::vector<double>> NumberList(const std::string& key) const {
    if (!Has(key)) return Missing(key);
    const Json& v = At(key);
    if (!v.is_array()) return WrongType(key, "array of numbers", v);
    std::vector<double> out;
    for (size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_number()) return WrongType(absl::StrCat(key, "[", i, "]"), "number", v[i]);
      out.push_back(v[i].get<double>());
    }
    return out;
  }

  // Optional variants: leave `*out` untouched when absent (or null).
  template <typename T, typename Getter>
  absl::Status Optional(const std::string& key, T* out, Getter get) const {
    if (!Has(key)) return absl::OkStatus();
    auto v = (this->*get)(key);
    if (!v.ok()) return v.status();
    *out = *v;
    return absl::OkStatus();
  }

  const std::string& source() const { return source_; }

 private:
  const Json& obj_;
  std::string source_;
  std::string prefix_;
};

#define VLM_ASSIGN(lhs, expr)            \
  do {                                   \
    auto vlm_assign_tmp_ = (expr);       \
    if (!vlm_assign_tmp_.ok()) return vlm_assign_tmp_.status(); \
    lhs = *std::move(vlm_assign_tmp_);   \
  } while (0)

#define VLM_RETURN_IF_ERROR(expr)        \
  do {                                   \
    absl::Status vlm_status_ = (expr);   \
    if (!vlm_status_.ok()) return vlm_status_; \
  } while (0)

absl::StatusOr<Json> ParseObject(const std::string& text, const std::string& source) {
  Json root;
  try {
    root = Json::parse(text);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": invalid JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": expected a JSON object at the top level, got ", JsonTypeName(root)));
  }
  return root;
}

absl::Status Semantic(const std::string& source, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", message));
}

absl::Status CheckPositive(const Fields& f, const std::string& key, int64_t v) {
  if (v <= 0) return f.Error(key, absl::StrCat("must be positive, got ", v));
  return absl::OkStatus();
}

bool IsPerfectSquare(int64_t n, int64_t* root) {
  if (n < 0) return false;
  // floor(sqrt(INT64_MAX)): r * r stays in range (the double root of a value
  // near INT64_MAX rounds above it).
  constexpr int64_t kMaxRoot = 3037000499;
  int64_t r = std::min<int64_t>(
      kMaxRoot, static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(n)))));
  while (r * r > n) --r;
  while (r < kMaxRoot && (r + 1) * (r + 1) <= n) ++r;
  if (root) *root = r;
  return r * r == n;
}

// The dtype is informational; "dtype" (newer) or "torch_dtype" (older).
absl::StatusOr<std::string> ReadDtype(const Fields& f) {
  std::string dtype;
  if (f.Has("dtype")) {
    VLM_ASSIGN(dtype, f.String("dtype"));
  } else if (f.Has("torch_dtype")) {
    VLM_ASSIGN(dtype, f.String("torch_dtype"));
  }
  return dtype;
}

absl::Status ParseText(const Json& obj, const std::string& source, TextConfig* t) {
  Fields f(obj, source, "text_config.");
  if (f.Has("model_type")) {
    std::string mt;
    VLM_ASSIGN(mt, f.String("model_type"));
    if (mt != "qwen3_vl_text") {
      return f.Error("model_type", absl::StrCat("expected \"qwen3_vl_text\", got \"", mt, "\""));
    }
  }
  VLM_ASSIGN(t->vocab_size, f.Int("vocab_size"));
  VLM_ASSIGN(t->hidden_size, f.Int("hidden_size"));
  VLM_ASSIGN(t->intermediate_size, f.Int("intermediate_size"));
  VLM_ASSIGN(t->num_hidden_layers, f.Int("num_hidden_layers"));
  VLM_ASSIGN(t->num_attention_heads, f.Int("num_attention_heads"));
  VLM_ASSIGN(t->num_key_value_heads, f.Int("num_key_value_heads"));
  VLM_ASSIGN(t->head_dim, f.Int("head_dim"));
  VLM_ASSIGN(t->rms_norm_eps, f.Number("rms_norm_eps"));
  VLM_ASSIGN(t->hidden_act, f.String("hidden_act"));
  VLM_ASSIGN(t->attention_bias, f.Bool("attention_bias"));
  VLM_ASSIGN(t->tie_word_embeddings, f.Bool("tie_word_embeddings"));
  VLM_RETURN_IF_ERROR(f.Optional("max_position_embeddings", &t->max_position_embeddings,
                                 &Fields::Int));
  VLM_ASSIGN(t->dtype, ReadDtype(f));

  // RoPE: v5 saves everything in rope_parameters; 4.57 saves rope_theta beside
  // a rope_scaling object. A transitional file may carry both; rope_parameters wins.
  const char* rope_key = f.Has("rope_parameters") ? "rope_parameters" : "rope_scaling";
  const Json* rope = nullptr;
  VLM_ASSIGN(rope, f.Object(rope_key));
  Fields r(*rope, source, absl::StrCat("text_config.", rope_key, "."));
  const bool theta_in_rope = r.Has("rope_theta");
  const Fields& theta_fields = theta_in_rope ? r : f;
  VLM_ASSIGN(t->rope_theta, theta_fields.Number("rope_theta"));
  std::vector<int64_t> section;
  VLM_ASSIGN(section, r.IntList("mrope_section"));
  if (section.size() != 3) {
    return r.Error("mrope_section", absl::StrCat("expected 3 integers, got ", section.size()));
  }
  for (int i = 0; i < 3; ++i) {
    if (section[i] < 0) {
      return r.Error("mrope_section", absl::StrCat("entries must be >= 0, got ", section[i]));
    }
    t->mrope_section[i] = section[i];
  }
  VLM_RETURN_IF_ERROR(r.Optional("mrope_interleaved", &t->mrope_interleaved, &Fields::Bool));
  std::string rope_type = "default";
  if (r.Has("rope_type")) {
    VLM_ASSIGN(rope_type, r.String("rope_type"));
  } else if (r.Has("type")) {
    VLM_ASSIGN(rope_type, r.String("type"));
  }
  if (rope_type != "default") {
    return r.Error("rope_type",
                   absl::StrCat("\"", rope_type, "\" is not supported (only \"default\")"));
  }

  // Semantics.
  VLM_RETURN_IF_ERROR(CheckPositive(f, "vocab_size", t->vocab_size));
  VLM_RETURN_IF_ERROR(CheckPositive(f, "hidden_size", t->hidden_size));
  VLM_RETURN_IF_ERROR(CheckPositive(f, "intermediate_size", t->intermediate_size));
  VLM_RETURN_IF_ERROR(CheckPositive(f, "num_hidden_layers", t->num_hidden_layers));
  VLM_RETURN_IF_ERROR(CheckPositive(f, "num_attention_heads", t->num_attention_heads));
  VLM_RETURN_IF_ERROR(CheckPositive(f, "num_key_value_heads", t->num_key_value_heads));
  VLM_RETURN_IF_ERROR(CheckPositive(f, "head_dim", t->head_dim));
  if (f.Has("max_position_embeddings")) {
    VLM_RETURN_IF_ERROR(CheckPositive(f, "max_position_embeddings", t->max_position_embeddings));
  }
  if (!(t->rms_norm_eps > 0) || !std::isfinite(t->rms_norm_eps)) {
    return f.Error("rms_norm_eps", absl::StrCat("must be positive, got ", t->rms_norm_eps));
  }
  if (!(t->rope_theta > 0) || !std::isfinite(t->rope_theta)) {
    return theta_fields.Error("rope_theta", absl::StrCat("must be positive, got ", t->rope_theta));
  }
  if (t->num_attention_heads % t->num_key_value_heads != 0) {
    return Semantic(source, absl::StrCat("text_config.num_attention_heads (", t->num_attention_heads,
                                         ") is not a multiple of text_config.num_key_value_heads (",
                                         t->num_key_value_heads, ")"));
  }
  if (t->head_dim % 2 != 0) {
    return f.Error("head_dim", absl::StrCat("must be even for rotary embedding, got ", t->head_dim));
  }
  const int64_t half = t->head_dim / 2;
  // Entries are >= 0 (checked above); compared against half one by one so that
  // no sum or product of file values can overflow.
  const bool sums_to_half = section[0] <= half && section[1] <= half - section[0] &&
                            section[2] == half - section[0] - section[1];
  if (!sums_to_half) {
    std::ostringstream sum;
    sum << absl::int128(section[0]) + section[1] + section[2];
    return Semantic(source, absl::StrCat("text_config.", rope_key, ".mrope_section [",
                                         absl::StrJoin(section, ", "), "] sums to ", sum.str(),
                                         " but head_dim/2 is ", half));
  }
  // 3 * m > half  <=>  m > floor(half / 3), without the product.
  if (std::max(section[1], section[2]) > half / 3) {
    std::ostringstream product;
    product << absl::int128(3) * std::max(section[1], section[2]);
    return Semantic(source,
                    absl::StrCat("text_config.", rope_key, ".mrope_section [",
                                 absl::StrJoin(section, ", "),
                                 "]: 3*max(section[1], section[2]) = ",
                                 product.str(), " exceeds head_dim/2 = ",
                                 half, " (the interleaved layout cannot give H and W their share)"));
  }
  if (t->hidden_act != "silu") {
    return f.Error("hidden_act", absl::StrCat("\"", t->hidden_act,
                                              "\" is not supported (the decoder MLP is \"silu\")"));
  }
  if (t->attention_bias) {
    return f.Error("attention_bias", "true is not supported (Qwen3-VL attention has no biases)");
  }
  return absl::OkStatus();
}

absl::Status ParseVision(const Json& obj, const std::string& source, VisionConfig* v) {
  Fields f(obj, source, "vision_config.");
  if (f.Has("model_type")) {
    std::string mt;
    VLM_ASSIGN(mt, f.String("model_type"));
    if (mt != "qwen3_vl" && mt != "qwen3_vl_vision") {
      return f.Error("model_type",
                     absl::StrCat("expected \"qwen3_vl\" or \"qwen3_vl_vision\", got \"", mt, "\""));
    }
  }
  VLM_ASSIGN(v->depth, f.Int("depth"));
  VLM_ASSIGN(v->hidden_size, f.Int("hidden_size"));
  VLM_ASSIGN(v->intermediate_size, f.Int("intermediate_size"));
  VLM_ASSIGN(v->num_heads, f.Int("num_heads"));
  VLM_ASSIGN(v->hidden_act, f.String("hidden_act"));
  VLM_ASSIGN(v->in_channels, f.Int("in_channels"));
  VLM_ASSIGN(v->patch_size, f.Int("patch_size"));
  VLM_ASSIGN(v->spatial_merge_size, f.Int("spatial_merge_size"));
  VLM_ASSIGN(v->temporal_patch_size, f.Int("temporal_patch_size"));
  VLM_ASSIGN(v->out_hidden_size, f.Int("out_hidden_size"));
  VLM_ASSIGN(v->num_position_embeddings, f.Int("num_position_embeddings"));
  VLM_ASSIGN(v->deepstack_visual_indexes, f.IntList("deepstack_visual_indexes"));

  for (const char* key : {"depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                          "patch_size", "spatial_merge_size", "temporal_patch_size",
                          "out_hidden_size", "num_position_embeddings"}) {
    int64_t value = 0;
    VLM_ASSIGN(value, f.Int(key));
    VLM_RETURN_IF_ERROR(CheckPositive(f, key, value));
  }
  if (v->in_channels != 3) {
    return f.Error("in_channels", absl::StrCat("must be 3 (RGB), got ", v->in_channels));
  }
  if (v->hidden_size % v->num_heads != 0) {
    return Semantic(source, absl::StrCat("vision_config.hidden_size (", v->hidden_size,
                                         ") is not a multiple of vision_config.num_heads (",
                                         v->num_heads, ")"));
  }
  if (v->head_dim() % 4 != 0) {
    return Semantic(source, absl::StrCat("vision head_dim = hidden_size/num_heads = ", v->head_dim(),
                                         " must be a multiple of 4 (2-D rotary over row and column)"));
  }
  if (!IsPerfectSquare(v->num_position_embeddings, nullptr)) {
    return f.Error("num_position_embeddings",
                   absl::StrCat(v->num_position_embeddings, " is not a perfect square"));
  }
  if (v->hidden_act != "gelu_pytorch_tanh") {
    return f.Error("hidden_act",
                   absl::StrCat("\"", v->hidden_act,
                                "\" is not supported (the ViT MLP is \"gelu_pytorch_tanh\")"));
  }
  const auto& ds = v->deepstack_visual_indexes;
  for (size_t i = 0; i < ds.size(); ++i) {
    if (ds[i] < 0 || ds[i] >= v->depth) {
      return f.Error("deepstack_visual_indexes",
                     absl::StrCat("index ", ds[i], " is outside [0, depth = ", v->depth, ")"));
    }
    if (i > 0 && ds[i] <= ds[i - 1]) {
      return f.Error("deepstack_visual_indexes",
                     absl::StrCat("must be strictly increasing, got [", absl::StrJoin(ds, ", "), "]"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

int64_t VisionConfig::pos_grid() const {
  int64_t root = 0;
  IsPerfectSquare(num_position_embeddings, &root);
  return root;
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source) {
  Json root;
  VLM_ASSIGN(root, ParseObject(json_text, source));
  Fields top(root, source, "");
  ModelConfig c;
  if (top.Has("model_type")) {
    VLM_ASSIGN(c.model_type, top.String("model_type"));
    if (c.model_type != "qwen3_vl") {
      return top.Error("model_type", absl::StrCat("expected \"qwen3_vl\", got \"", c.model_type, "\""));
    }
  }
  VLM_ASSIGN(c.image_token_id, top.Int("image_token_id"));
  VLM_ASSIGN(c.video_token_id, top.Int("video_token_id"));
  VLM_ASSIGN(c.vision_start_token_id, top.Int("vision_start_token_id"));
  VLM_ASSIGN(c.vision_end_token_id, top.Int("vision_end_token_id"));
  bool top_tie = false;
  VLM_ASSIGN(top_tie, top.Bool("tie_word_embeddings"));

  const Json* text = nullptr;
  VLM_ASSIGN(text, top.Object("text_config"));
  VLM_RETURN_IF_ERROR(ParseText(*text, source, &c.text));
  const Json* vision = nullptr;
  VLM_ASSIGN(vision, top.Object("vision_config"));
  VLM_RETURN_IF_ERROR(ParseVision(*vision, source, &c.vision));
  if (c.text.dtype.empty()) VLM_ASSIGN(c.text.dtype, ReadDtype(top));

  // Cross-section checks.
  if (c.vision.out_hidden_size != c.text.hidden_size) {
    return Semantic(source, absl::StrCat("vision_config.out_hidden_size (", c.vision.out_hidden_size,
                                         ") must equal text_config.hidden_size (",
                                         c.text.hidden_size, ")"));
  }
  if (static_cast<int64_t>(c.vision.deepstack_visual_indexes.size()) > c.text.num_hidden_layers) {
    return Semantic(source,
                    absl::StrCat("vision_config.deepstack_visual_indexes has ",
                                 c.vision.deepstack_visual_indexes.size(),
                                 " entries but the decoder has only ", c.text.num_hidden_layers,
                                 " layers (text_config.num_hidden_layers)"));
  }
  const std::pair<const char*, int64_t> token_ids[] = {
      {"image_token_id", c.image_token_id},
      {"video_token_id", c.video_token_id},
      {"vision_start_token_id", c.vision_start_token_id},
      {"vision_end_token_id", c.vision_end_token_id}};
  for (const auto& [key, id] : token_ids) {
    if (id < 0 || id >= c.text.vocab_size) {
      return top.Error(key, absl::StrCat(id, " is outside the vocabulary [0, text_config.vocab_size = ",
                                         c.text.vocab_size, ")"));
    }
  }

  // Tying: HF 4.5x ties according to text_config's flag.
  c.tie_word_embeddings = c.text.tie_word_embeddings;
  if (top_tie != c.text.tie_word_embeddings) {
    c.tie_warning = absl::StrCat(
        source, ": tie_word_embeddings is ", top_tie ? "true" : "false",
        " at the top level but ", c.text.tie_word_embeddings ? "true" : "false",
        " in text_config; using text_config's (",
        c.text.tie_word_embeddings ? "tied" : "untied", " head), as transformers does");
  }
  return c;
}

absl::StatusOr<GenerationConfig> ParseGenerationConfig(const std::string& json_text,
                                                       const std::string& source) {
  Json root;
  VLM_ASSIGN(root, ParseObject(json_text, source));
  Fields f(root, source, "");
  GenerationConfig g;
  if (f.Has("eos_token_id")) {
    const Json& v = f.At("eos_token_id");
    if (v.is_array()) {
      VLM_ASSIGN(g.eos_token_ids, f.IntList("eos_token_id"));
    } else if (v.is_number_integer()) {
      int64_t id = 0;
      VLM_ASSIGN(id, f.Int("eos_token_id"));
      g.eos_token_ids.push_back(id);
    } else {
      return f.WrongType("eos_token_id", "integer or array of integers", v);
    }
    for (int64_t id : g.eos_token_ids) {
      if (id < 0) return f.Error("eos_token_id", absl::StrCat("negative id ", id));
    }
  }
  if (f.Has("bos_token_id")) VLM_ASSIGN(g.bos_token_id, f.Int("bos_token_id"));
  if (f.Has("pad_token_id")) VLM_ASSIGN(g.pad_token_id, f.Int("pad_token_id"));
  if (f.Has("max_new_tokens")) VLM_ASSIGN(g.max_new_tokens, f.Int("max_new_tokens"));
  VLM_RETURN_IF_ERROR(f.Optional("do_sample", &g.do_sample, &Fields::Bool));
  VLM_RETURN_IF_ERROR(f.Optional("temperature", &g.temperature, &Fields::Number));
  VLM_RETURN_IF_ERROR(f.Optional("top_k", &g.top_k, &Fields::Int));
  VLM_RETURN_IF_ERROR(f.Optional("top_p", &g.top_p, &Fields::Number));
  VLM_RETURN_IF_ERROR(f.Optional("repetition_penalty", &g.repetition_penalty, &Fields::Number));

  if (!(g.temperature >= 0) || !std::isfinite(g.temperature)) {
    return f.Error("temperature", absl::StrCat("must be >= 0, got ", g.temperature));
  }
  if (g.top_k < 0) return f.Error("top_k", absl::StrCat("must be >= 0, got ", g.top_k));
  if (!(g.top_p > 0 && g.top_p <= 1)) {
    return f.Error("top_p", absl::StrCat("must be in (0, 1], got ", g.top_p));
  }
  if (!(g.repetition_penalty > 0) || !std::isfinite(g.repetition_penalty)) {
    return f.Error("repetition_penalty", absl::StrCat("must be positive, got ", g.repetition_penalty));
  }
  if (g.max_new_tokens && *g.max_new_tokens <= 0) {
    return f.Error("max_new_tokens", absl::StrCat("must be positive, got ", *g.max_new_tokens));
  }
  return g;
}

absl::StatusOr<PreprocessorConfig> ParsePreprocessorConfig(const std::string& json_text,
                                                           const std::string& source) {
  Json root;
  VLM_ASSIGN(root, ParseObject(json_text, source));
  Fields f(root, source, "");
  PreprocessorConfig p;

  // size.shortest_edge / size.longest_edge are min / max pixels (areas); the
  // legacy top-level min_pixels / max_pixels override them.
  const bool legacy_min = f.Has("min_pixels");
  const bool legacy_max = f.Has("max_pixels");
  if (legacy_min) VLM_ASSIGN(p.min_pixels, f.Int("min_pixels"));
  if (legacy_max) VLM_ASSIGN(p.max_pixels, f.Int("max_pixels"));
  if (!legacy_min || !legacy_max) {
    const Json* size = nullptr;
    if (!f.Has("size")) {
      return f.Missing(legacy_min ? "size.longest_edge" : "size.shortest_edge");
    }
    VLM_ASSIGN(size, f.Object("size"));
    Fields s(*size, source, "size.");
    if (!legacy_min) VLM_ASSIGN(p.min_pixels, s.Int("shortest_edge"));
    if (!legacy_max) VLM_ASSIGN(p.max_pixels, s.Int("longest_edge"));
  }
  VLM_ASSIGN(p.patch_size, f.Int("patch_size"));
  VLM_ASSIGN(p.temporal_patch_size, f.Int("temporal_patch_size"));
  VLM_ASSIGN(p.merge_size, f.Int("merge_size"));
  const std::pair<const char*, std::array<double, 3>*> stats[] = {{"image_mean", &p.image_mean},
                                                                   {"image_std", &p.image_std}};
  for (const auto& [key, out] : stats) {
    std::vector<double> values;
    VLM_ASSIGN(values, f.NumberList(key));
    if (values.size() != 3) {
      return f.Error(key, absl::StrCat("expected 3 numbers, got ", values.size()));
    }
    for (int i = 0; i < 3; ++i) (*out)[i] = values[i];
  }
  VLM_RETURN_IF_ERROR(f.Optional("rescale_factor", &p.rescale_factor, &Fields::Number));
  VLM_RETURN_IF_ERROR(f.Optional("do_resize", &p.do_resize, &Fields::Bool));
  VLM_RETURN_IF_ERROR(f.Optional("do_rescale", &p.do_rescale, &Fields::Bool));
  VLM_RETURN_IF_ERROR(f.Optional("do_normalize", &p.do_normalize, &Fields::Bool));
  VLM_RETURN_IF_ERROR(f.Optional("do_convert_rgb", &p.do_convert_rgb, &Fields::Bool));
  VLM_RETURN_IF_ERROR(f.Optional("resample", &p.resample, &Fields::Int));

  const std::string min_key = legacy_min ? "min_pixels" : "size.shortest_edge";
  const std::string max_key = legacy_max ? "max_pixels" : "size.longest_edge";
  if (p.min_pixels <= 0) return f.Error(min_key, absl::StrCat("must be positive, got ", p.min_pixels));
  if (p.max_pixels <= 0) return f.Error(max_key, absl::StrCat("must be positive, got ", p.max_pixels));
  if (p.min_pixels > p.max_pixels) {
    return Semantic(source, absl::StrCat(min_key, " (", p.min_pixels, ") exceeds ", max_key, " (",
                                         p.max_pixels, ")"));
  }
  VLM_RETURN_IF_ERROR(CheckPositive(f, "patch_size", p.patch_size));
  VLM_RETURN_IF_ERROR(CheckPositive(f, "temporal_patch_size", p.temporal_patch_size));
  VLM_RETURN_IF_ERROR(CheckPositive(f, "merge_size", p.merge_size));
  for (int i = 0; i < 3; ++i) {
    if (!(p.image_std[i] > 0) || !std::isfinite(p.image_std[i])) {
      return f.Error(absl::StrCat("image_std[", i, "]"),
                     absl::StrCat("must be positive, got ", p.image_std[i]));
    }
    if (!std::isfinite(p.image_mean[i])) {
      return f.Error(absl::StrCat("image_mean[", i, "]"), "must be finite");
    }
  }
  if (!(p.rescale_factor > 0) || !std::isfinite(p.rescale_factor)) {
    return f.Error("rescale_factor", absl::StrCat("must be positive, got ", p.rescale_factor));
  }
  return p;
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::InternalError(absl::StrCat(path, ": cannot open: ", std::strerror(err)));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::InternalError(absl::StrCat(path, ": read error"));
  return ss.str();
}

namespace {
std::string JoinPath(const std::string& dir, const char* file) {
  if (dir.empty()) return file;
  return dir.back() == '/' ? dir + file : dir + "/" + file;
}
}  // namespace

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  const std::string path = JoinPath(dir, "config.json");
  std::string text;
  VLM_ASSIGN(text, ReadFileToString(path));
  return ParseModelConfig(text, path);
}

absl::StatusOr<GenerationConfig> LoadGenerationConfig(const std::string& dir) {
  const std::string path = JoinPath(dir, "generation_config.json");
  std::string text;
  VLM_ASSIGN(text, ReadFileToString(path));
  return ParseGenerationConfig(text, path);
}

absl::StatusOr<PreprocessorConfig> LoadPreprocessorConfig(const std::string& dir) {
  const std::string path = JoinPath(dir, "preprocessor_config.json");
  std::string text;
  VLM_ASSIGN(text, ReadFileToString(path));
  return ParsePreprocessorConfig(text, path);
}

}  // namespace vlm
