// config.json / generation_config.json / preprocessor_config.json parsing.
// Expected numbers are the spec's (docs/qwen3-vl-model.md §1, §3, §7.4, §9),
// written out here by hand, not produced by the parser.
#include "common/model_config.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace vlm {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::ordered_json;

// Spec §9, verbatim.
Json TinyConfig() {
  return Json::parse(R"({
  "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
  "image_token_id": 151655, "video_token_id": 151656,
  "vision_start_token_id": 151652, "vision_end_token_id": 151653,
  "tie_word_embeddings": true,
  "text_config": {
    "model_type": "qwen3_vl_text", "vocab_size": 151936, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu", "rms_norm_eps": 1e-06,
    "max_position_embeddings": 262144, "rope_theta": 5000000,
    "rope_scaling": {"mrope_interleaved": true, "mrope_section": [6, 5, 5], "rope_type": "default"},
    "attention_bias": false, "attention_dropout": 0.0, "tie_word_embeddings": true
  },
  "vision_config": {
    "model_type": "qwen3_vl", "depth": 4, "hidden_size": 64, "intermediate_size": 128,
    "num_heads": 4, "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64,
    "num_position_embeddings": 2304, "deepstack_visual_indexes": [0, 2]
  }
})");
}

// Spec §1, transformers 4.57 key layout.
Json Real2BConfig457() {
  return Json::parse(R"({
  "architectures": ["Qwen3VLForConditionalGeneration"],
  "image_token_id": 151655,
  "model_type": "qwen3_vl",
  "text_config": {
    "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 151643,
    "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 262144, "model_type": "qwen3_vl_text",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_interleaved": true, "mrope_section": [24, 20, 20], "rope_type": "default"},
    "rope_theta": 5000000, "tie_word_embeddings": true, "use_cache": true, "vocab_size": 151936
  },
  "tie_word_embeddings": true,
  "transformers_version": "4.57.0.dev0",
  "video_token_id": 151656,
  "vision_config": {
    "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1024, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096,
    "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304,
    "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2
  },
  "vision_end_token_id": 151653,
  "vision_start_token_id": 151652
})");
}

// The same model in the transformers v5 layout: rope_parameters holds
// rope_theta, torch_dtype -> dtype at the top, vision model_type qwen3_vl_vision.
Json Real2BConfigV5() {
  Json c = Real2BConfig457();
  Json& t = c["text_config"];
  t.erase("rope_scaling");
  t.erase("rope_theta");
  t.erase("dtype");
  t["rope_parameters"] = Json::parse(
      R"({"mrope_interleaved": true, "mrope_section": [24, 20, 20], "rope_theta": 5000000.0,
          "rope_type": "default"})");
  c["torch_dtype"] = "bfloat16";
  c["vision_config"]["model_type"] = "qwen3_vl_vision";
  c["transformers_version"] = "5.0.0";
  return c;
}

// Navigates "text_config.rope_scaling.mrope_section" -> parent object + last key.
std::pair<Json*, std::string> Locate(Json& root, const std::string& dotted) {
  std::vector<std::string> parts = absl::StrSplit(dotted, '.');
  Json* node = &root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) node = &(*node)[parts[i]];
  return {node, parts.back()};
}

absl::StatusOr<ModelConfig> Parse(const Json& j) { return ParseModelConfig(j.dump(), "config.json"); }

std::string ErrorOf(const Json& j) {
  auto c = Parse(j);
  if (c.ok()) return "<ok>";
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  return std::string(c.status().message());
}

void ExpectReal2B(const ModelConfig& c) {
  EXPECT_EQ(c.model_type, "qwen3_vl");
  EXPECT_EQ(c.image_token_id, 151655);
  EXPECT_EQ(c.video_token_id, 151656);
  EXPECT_EQ(c.vision_start_token_id, 151652);
  EXPECT_EQ(c.vision_end_token_id, 151653);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.tie_warning, "");
  const TextConfig& t = c.text;
  EXPECT_EQ(t.vocab_size, 151936);
  EXPECT_EQ(t.hidden_size, 2048);
  EXPECT_EQ(t.intermediate_size, 6144);
  EXPECT_EQ(t.num_hidden_layers, 28);
  EXPECT_EQ(t.num_attention_heads, 16);
  EXPECT_EQ(t.num_key_value_heads, 8);
  EXPECT_EQ(t.head_dim, 128);
  EXPECT_DOUBLE_EQ(t.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(t.rope_theta, 5e6);
  EXPECT_EQ(t.mrope_section, (std::array<int64_t, 3>{24, 20, 20}));
  EXPECT_TRUE(t.mrope_interleaved);
  EXPECT_EQ(t.hidden_act, "silu");
  EXPECT_FALSE(t.attention_bias);
  EXPECT_TRUE(t.tie_word_embeddings);
  EXPECT_EQ(t.max_position_embeddings, 262144);
  EXPECT_EQ(t.dtype, "bfloat16");
  const VisionConfig& v = c.vision;
  EXPECT_EQ(v.depth, 24);
  EXPECT_EQ(v.hidden_size, 1024);
  EXPECT_EQ(v.intermediate_size, 4096);
  EXPECT_EQ(v.num_heads, 16);
  EXPECT_EQ(v.head_dim(), 64);
  EXPECT_EQ(v.hidden_act, "gelu_pytorch_tanh");
  EXPECT_EQ(v.in_channels, 3);
  EXPECT_EQ(v.patch_size, 16);
  EXPECT_EQ(v.spatial_merge_size, 2);
  EXPECT_EQ(v.temporal_patch_size, 2);
  EXPECT_EQ(v.out_hidden_size, 2048);
  EXPECT_EQ(v.num_position_embeddings, 2304);
  EXPECT_EQ(v.pos_grid(), 48);
  EXPECT_EQ(v.deepstack_visual_indexes, (std::vector<int64_t>{5, 11, 17}));
}

TEST(ModelConfigTest, ParsesReal2BIn457Layout) {
  auto c = Parse(Real2BConfig457());
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectReal2B(*c);
}

TEST(ModelConfigTest, ParsesReal2BInV5Layout) {
  auto c = Parse(Real2BConfigV5());
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectReal2B(*c);
}

TEST(ModelConfigTest, AcceptsTorchDtypeInsideTextConfig) {
  Json j = Real2BConfig457();
  j["text_config"].erase("dtype");
  j["text_config"]["torch_dtype"] = "float32";
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->text.dtype, "float32");
}

TEST(ModelConfigTest, ParsesTinyConfig) {
  auto c = Parse(TinyConfig());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->text.vocab_size, 151936);
  EXPECT_EQ(c->text.hidden_size, 64);
  EXPECT_EQ(c->text.intermediate_size, 128);
  EXPECT_EQ(c->text.num_hidden_layers, 4);
  EXPECT_EQ(c->text.num_attention_heads, 4);
  EXPECT_EQ(c->text.num_key_value_heads, 2);
  EXPECT_EQ(c->text.head_dim, 32);
  EXPECT_EQ(c->text.mrope_section, (std::array<int64_t, 3>{6, 5, 5}));
  EXPECT_DOUBLE_EQ(c->text.rope_theta, 5e6);
  EXPECT_EQ(c->text.dtype, "");  // the tiny config states none
  EXPECT_EQ(c->vision.depth, 4);
  EXPECT_EQ(c->vision.hidden_size, 64);
  EXPECT_EQ(c->vision.num_heads, 4);
  EXPECT_EQ(c->vision.head_dim(), 16);
  EXPECT_EQ(c->vision.out_hidden_size, 64);
  EXPECT_EQ(c->vision.pos_grid(), 48);
  EXPECT_EQ(c->vision.deepstack_visual_indexes, (std::vector<int64_t>{0, 2}));
  EXPECT_TRUE(c->tie_word_embeddings);
}

TEST(ModelConfigTest, TinyVariantWithSixteenPositionEmbeddings) {
  Json j = TinyConfig();
  j["vision_config"]["num_position_embeddings"] = 16;
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->vision.pos_grid(), 4);
}

// Spec §9 "Keys the config must set", plus the two sub-objects.
const std::vector<std::string>& RequiredKeys457() {
  static const std::vector<std::string> keys = {
      "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
      "tie_word_embeddings", "text_config", "vision_config",
      "text_config.vocab_size", "text_config.hidden_size", "text_config.intermediate_size",
      "text_config.num_hidden_layers", "text_config.num_attention_heads",
      "text_config.num_key_value_heads", "text_config.head_dim", "text_config.rms_norm_eps",
      "text_config.rope_theta", "text_config.rope_scaling", "text_config.rope_scaling.mrope_section",
      "text_config.hidden_act", "text_config.attention_bias", "text_config.tie_word_embeddings",
      "vision_config.depth", "vision_config.hidden_size", "vision_config.intermediate_size",
      "vision_config.num_heads", "vision_config.hidden_act", "vision_config.in_channels",
      "vision_config.patch_size", "vision_config.spatial_merge_size",
      "vision_config.temporal_patch_size", "vision_config.out_hidden_size",
      "vision_config.num_position_embeddings", "vision_config.deepstack_visual_indexes"};
  return keys;
}

TEST(ModelConfigTest, EachMissingRequiredKeyIsNamed) {
  for (const Json& base : {TinyConfig(), Real2BConfig457()}) {
    for (const std::string& key : RequiredKeys457()) {
      Json j = base;
      auto [parent, last] = Locate(j, key);
      ASSERT_TRUE(parent->contains(last)) << key;
      parent->erase(last);
      EXPECT_EQ(ErrorOf(j), "config.json: " + key + ": missing") << key;
    }
  }
}

TEST(ModelConfigTest, EachMissingRequiredKeyIsNamedInV5Layout) {
  std::vector<std::string> keys;
  for (const std::string& key : RequiredKeys457()) {
    if (key.rfind("text_config.rope_", 0) == 0) continue;
    keys.push_back(key);
  }
  keys.push_back("text_config.rope_parameters.mrope_section");
  for (const std::string& key : keys) {
    Json j = Real2BConfigV5();
    auto [parent, last] = Locate(j, key);
    ASSERT_TRUE(parent->contains(last)) << key;
    parent->erase(last);
    EXPECT_EQ(ErrorOf(j), "config.json: " + key + ": missing") << key;
  }
  // rope_theta may live in rope_parameters or beside it; absent from both it is named.
  Json j = Real2BConfigV5();
  j["text_config"]["rope_parameters"].erase("rope_theta");
  EXPECT_EQ(ErrorOf(j), "config.json: text_config.rope_theta: missing");
  j["text_config"]["rope_theta"] = 5000000;
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->text.rope_theta, 5e6);
}

TEST(ModelConfigTest, NullCountsAsMissing) {
  Json j = TinyConfig();
  j["text_config"]["head_dim"] = nullptr;
  EXPECT_EQ(ErrorOf(j), "config.json: text_config.head_dim: missing");
}

TEST(ModelConfigTest, WrongTypesAreNamed) {
  struct Case {
    std::string key;
    Json value;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"text_config.head_dim", "128", "text_config.head_dim: expected integer, got string"},
      {"text_config.hidden_size", 64.0, "text_config.hidden_size: expected integer, got float"},
      {"text_config.vocab_size", true, "text_config.vocab_size: expected integer, got boolean"},
      {"text_config.rms_norm_eps", "1e-6", "text_config.rms_norm_eps: expected number, got string"},
      {"text_config.rope_theta", Json::array(), "text_config.rope_theta: expected number, got array"},
      {"text_config.hidden_act", 1, "text_config.hidden_act: expected string, got integer"},
      {"text_config.attention_bias", "false",
       "text_config.attention_bias: expected boolean, got string"},
      {"text_config.tie_word_embeddings", 1,
       "text_config.tie_word_embeddings: expected boolean, got integer"},
      {"text_config.rope_scaling", "default",
       "text_config.rope_scaling: expected object, got string"},
      {"text_config.rope_scaling.mrope_section", 16,
       "text_config.rope_scaling.mrope_section: expected array of integers, got integer"},
      {"text_config.rope_scaling.mrope_section", Json::parse(R"([6, "5", 5])"),
       "text_config.rope_scaling.mrope_section[1]: expected integer, got string"},
      {"text_config.rope_scaling.mrope_interleaved", "yes",
       "text_config.rope_scaling.mrope_interleaved: expected boolean, got string"},
      {"text_config", Json::array(), "text_config: expected object, got array"},
      {"vision_config", "x", "vision_config: expected object, got string"},
      {"image_token_id", "151655", "image_token_id: expected integer, got string"},
      {"tie_word_embeddings", "true", "tie_word_embeddings: expected boolean, got string"},
      {"vision_config.depth", 4.5, "vision_config.depth: expected integer, got float"},
      {"vision_config.deepstack_visual_indexes", Json::parse(R"([0, 2.0])"),
       "vision_config.deepstack_visual_indexes[1]: expected integer, got float"},
      {"vision_config.deepstack_visual_indexes", Json::object(),
       "vision_config.deepstack_visual_indexes: expected array of integers, got object"},
      {"vision_config.hidden_act", false, "vision_config.hidden_act: expected string, got boolean"},
      {"vision_config.num_position_embeddings", "2304",
       "vision_config.num_position_embeddings: expected integer, got string"},
      {"text_config.dtype", 16, "text_config.dtype: expected string, got integer"},
  };
  for (const Case& c : cases) {
    Json j = TinyConfig();
    auto [parent, last] = Locate(j, c.key);
    (*parent)[last] = c.value;
    EXPECT_EQ(ErrorOf(j), "config.json: " + c.message) << c.key;
  }
}

TEST(ModelConfigTest, RejectsMalformedJson) {
  EXPECT_THAT(std::string(ParseModelConfig("{\"a\": ", "x.json").status().message()),
              HasSubstr("x.json: invalid JSON"));
  EXPECT_THAT(std::string(ParseModelConfig("[1, 2]", "x.json").status().message()),
              HasSubstr("x.json: expected a JSON object"));
}

TEST(ModelConfigTest, SemanticViolationsAreExplained) {
  struct Case {
    std::string key;
    Json value;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {"text_config.hidden_size", 0, "text_config.hidden_size: must be positive, got 0"},
      {"text_config.num_hidden_layers", -1, "text_config.num_hidden_layers: must be positive"},
      {"vision_config.patch_size", 0, "vision_config.patch_size: must be positive"},
      {"text_config.num_key_value_heads", 3,
       "text_config.num_attention_heads (4) is not a multiple of text_config.num_key_value_heads (3)"},
      {"vision_config.num_heads", 3,
       "vision_config.hidden_size (64) is not a multiple of vision_config.num_heads (3)"},
      {"vision_config.num_position_embeddings", 2300,
       "vision_config.num_position_embeddings: 2300 is not a perfect square"},
      {"text_config.rope_scaling.mrope_section", Json::parse("[6, 5, 4]"),
       "mrope_section [6, 5, 4] sums to 15 but head_dim/2 is 16"},
      {"text_config.rope_scaling.mrope_section", Json::parse("[4, 6, 6]"),
       "3*max(section[1], section[2]) = 18 exceeds head_dim/2 = 16"},
      {"text_config.rope_scaling.mrope_section", Json::parse("[8, 8]"),
       "text_config.rope_scaling.mrope_section: expected 3 integers, got 2"},
      {"vision_config.out_hidden_size", 128,
       "vision_config.out_hidden_size (128) must equal text_config.hidden_size (64)"},
      {"vision_config.deepstack_visual_indexes", Json::parse("[0, 4]"),
       "index 4 is outside [0, depth = 4)"},
      {"vision_config.deepstack_visual_indexes", Json::parse("[-1]"),
       "index -1 is outside [0, depth = 4)"},
      {"vision_config.deepstack_visual_indexes", Json::parse("[2, 0]"), "strictly increasing"},
      {"vision_config.deepstack_visual_indexes", Json::parse("[0, 1, 2, 3]"),
       "deepstack_visual_indexes has 4 entries but the decoder has only 3 layers"},
      {"text_config.hidden_act", "gelu", "text_config.hidden_act: \"gelu\" is not supported"},
      {"vision_config.hidden_act", "gelu", "vision_config.hidden_act: \"gelu\" is not supported"},
      {"text_config.rope_scaling.rope_type", "yarn",
       "text_config.rope_scaling.rope_type: \"yarn\" is not supported"},
      {"text_config.attention_bias", true, "text_config.attention_bias: true is not supported"},
      {"text_config.rms_norm_eps", 0, "text_config.rms_norm_eps: must be positive"},
      {"text_config.rope_theta", -1, "text_config.rope_theta: must be positive"},
      {"vision_config.in_channels", 4, "vision_config.in_channels: must be 3"},
      {"text_config.vocab_size", 1000,
       "image_token_id: 151655 is outside the vocabulary [0, text_config.vocab_size = 1000)"},
      {"vision_config.model_type", "siglip", "vision_config.model_type: expected"},
      {"model_type", "qwen2_vl", "model_type: expected \"qwen3_vl\""},
  };
  for (const Case& c : cases) {
    Json j = TinyConfig();
    auto [parent, last] = Locate(j, c.key);
    (*parent)[last] = c.value;
    if (c.fragment.find("has 4 entries") != std::string::npos) {
      j["text_config"]["num_hidden_layers"] = 3;
      j["vision_config"]["depth"] = 6;
    }
    EXPECT_THAT(ErrorOf(j), HasSubstr(c.fragment)) << c.key << " = " << c.value.dump();
  }
}

// Values near INT64_MAX used to overflow (undefined behaviour, seen by UBSan in
// tests/fuzz/model_config_fuzzer; inputs in tests/fuzz/regressions/model_config):
// the perfect-square search squared 3037000500, the mrope checks summed and
// tripled the entries. Each is now refused with the usual message.
TEST(ModelConfigTest, ValuesNearInt64MaxAreRefusedWithoutOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  Json j = TinyConfig();
  j["vision_config"]["num_position_embeddings"] = kMax;
  EXPECT_THAT(ErrorOf(j), HasSubstr("9223372036854775807 is not a perfect square"));
  j = TinyConfig();
  j["vision_config"]["num_position_embeddings"] = int64_t{3037000499} * 3037000499;
  EXPECT_THAT(ErrorOf(j), ::testing::Not(HasSubstr("perfect square")));  // the largest square passes that check
  j = TinyConfig();
  j["text_config"]["rope_scaling"]["mrope_section"] = Json::array({kMax, kMax, 2});
  EXPECT_THAT(ErrorOf(j), HasSubstr("sums to 18446744073709551616 but head_dim/2 is 16"));
  j = TinyConfig();
  const int64_t half = (kMax - 1) / 2;  // head_dim = kMax - 1 (even)
  j["text_config"]["head_dim"] = kMax - 1;
  const int64_t big = 3100000000000000000;  // 3 * big > INT64_MAX
  j["text_config"]["rope_scaling"]["mrope_section"] = Json::array({0, big, half - big});
  EXPECT_THAT(ErrorOf(j), HasSubstr("3*max(section[1], section[2]) = 9300000000000000000 "
                                    "exceeds head_dim/2 = 4611686018427387903"));
}

TEST(ModelConfigTest, TextConfigTieFlagDecidesAndDisagreementWarns) {
  Json j = TinyConfig();
  j["tie_word_embeddings"] = false;
  auto c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_THAT(c->tie_warning, HasSubstr("false at the top level but true in text_config"));

  j = TinyConfig();
  j["text_config"]["tie_word_embeddings"] = false;
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_FALSE(c->tie_warning.empty());

  j["tie_word_embeddings"] = false;
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->tie_warning, "");
}

TEST(ModelConfigTest, RopeTypeMayBeAbsentOrLegacyKey) {
  Json j = TinyConfig();
  j["text_config"]["rope_scaling"].erase("rope_type");
  j["text_config"]["rope_scaling"].erase("mrope_interleaved");
  EXPECT_TRUE(Parse(j).ok());
  j["text_config"]["rope_scaling"]["type"] = "dynamic";
  EXPECT_THAT(ErrorOf(j), HasSubstr("\"dynamic\" is not supported"));
}

// --- generation_config.json (spec §7.4) -----------------------------------

TEST(GenerationConfigTest, ParsesQwenValues) {
  auto g = ParseGenerationConfig(R"({
    "bos_token_id": 151643, "pad_token_id": 151643, "do_sample": true,
    "eos_token_id": [151645, 151643], "temperature": 0.7, "top_k": 20, "top_p": 0.8,
    "repetition_penalty": 1.0, "transformers_version": "4.57.0.dev0"})");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->eos_token_ids, (std::vector<int64_t>{151645, 151643}));
  EXPECT_EQ(g->bos_token_id, 151643);
  EXPECT_EQ(g->pad_token_id, 151643);
  EXPECT_TRUE(g->do_sample);
  EXPECT_DOUBLE_EQ(g->temperature, 0.7);
  EXPECT_EQ(g->top_k, 20);
  EXPECT_DOUBLE_EQ(g->top_p, 0.8);
  EXPECT_DOUBLE_EQ(g->repetition_penalty, 1.0);
  EXPECT_FALSE(g->max_new_tokens.has_value());
}

TEST(GenerationConfigTest, SingleEosAndReferenceDefaults) {
  auto g = ParseGenerationConfig(R"({"eos_token_id": 151645, "pad_token_id": null})");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->eos_token_ids, (std::vector<int64_t>{151645}));
  EXPECT_FALSE(g->bos_token_id.has_value());
  EXPECT_FALSE(g->pad_token_id.has_value());
  // transformers GenerationConfig defaults.
  EXPECT_FALSE(g->do_sample);
  EXPECT_DOUBLE_EQ(g->temperature, 1.0);
  EXPECT_EQ(g->top_k, 50);
  EXPECT_DOUBLE_EQ(g->top_p, 1.0);
  EXPECT_DOUBLE_EQ(g->repetition_penalty, 1.0);
}

TEST(GenerationConfigTest, RejectsWrongTypesAndRanges) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"eos_token_id": "151645"})", "eos_token_id: expected integer or array of integers, got string"},
      {R"({"eos_token_id": [151645, "x"]})", "eos_token_id[1]: expected integer, got string"},
      {R"({"eos_token_id": 1.5})", "eos_token_id: expected integer or array of integers, got float"},
      {R"({"top_k": 2.5})", "top_k: expected integer, got float"},
      {R"({"do_sample": "true"})", "do_sample: expected boolean, got string"},
      {R"({"temperature": "hot"})", "temperature: expected number, got string"},
      {R"({"top_p": 0})", "top_p: must be in (0, 1]"},
      {R"({"top_p": 1.5})", "top_p: must be in (0, 1]"},
      {R"({"temperature": -1})", "temperature: must be >= 0"},
      {R"({"top_k": -1})", "top_k: must be >= 0"},
      {R"({"max_new_tokens": 0})", "max_new_tokens: must be positive"},
  };
  for (const auto& [text, fragment] : cases) {
    auto g = ParseGenerationConfig(text);
    ASSERT_FALSE(g.ok()) << text;
    EXPECT_THAT(std::string(g.status().message()),
                HasSubstr("generation_config.json: " + fragment)) << text;
  }
}

// --- preprocessor_config.json (spec §3) -----------------------------------

constexpr char k2BPreprocessor[] = R"({
  "size": {"longest_edge": 16777216, "shortest_edge": 65536},
  "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
  "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast"})";

TEST(PreprocessorConfigTest, ParsesReal2BValuesAsPixelAreas) {
  auto p = ParsePreprocessorConfig(k2BPreprocessor);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->min_pixels, 65536);     // 256 x 256
  EXPECT_EQ(p->max_pixels, 16777216);  // 4096 x 4096
  EXPECT_EQ(p->patch_size, 16);
  EXPECT_EQ(p->temporal_patch_size, 2);
  EXPECT_EQ(p->merge_size, 2);
  EXPECT_EQ(p->image_mean, (std::array<double, 3>{0.5, 0.5, 0.5}));
  EXPECT_EQ(p->image_std, (std::array<double, 3>{0.5, 0.5, 0.5}));
  // Class defaults for what the file omits.
  EXPECT_DOUBLE_EQ(p->rescale_factor, 1.0 / 255.0);
  EXPECT_TRUE(p->do_resize);
  EXPECT_TRUE(p->do_rescale);
  EXPECT_TRUE(p->do_normalize);
  EXPECT_TRUE(p->do_convert_rgb);
  EXPECT_EQ(p->resample, 3);
}

TEST(PreprocessorConfigTest, LegacyMinMaxPixelsOverrideSize) {
  Json j = Json::parse(k2BPreprocessor);
  j["min_pixels"] = 4096;
  j["max_pixels"] = 65536;
  auto p = ParsePreprocessorConfig(j.dump());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->min_pixels, 4096);
  EXPECT_EQ(p->max_pixels, 65536);

  // Only one legacy key: the other comes from size.
  j = Json::parse(k2BPreprocessor);
  j["max_pixels"] = 1000000;
  p = ParsePreprocessorConfig(j.dump());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->min_pixels, 65536);
  EXPECT_EQ(p->max_pixels, 1000000);

  // Both legacy keys and no size at all is fine; null legacy keys are ignored.
  j = Json::parse(k2BPreprocessor);
  j.erase("size");
  j["min_pixels"] = 3136;
  j["max_pixels"] = 12845056;
  p = ParsePreprocessorConfig(j.dump());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->min_pixels, 3136);
  j = Json::parse(k2BPreprocessor);
  j["min_pixels"] = nullptr;
  p = ParsePreprocessorConfig(j.dump());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->min_pixels, 65536);
}

TEST(PreprocessorConfigTest, OptionalFlagsAreRead) {
  Json j = Json::parse(k2BPreprocessor);
  j["do_normalize"] = false;
  j["rescale_factor"] = 0.5;
  j["resample"] = 2;
  auto p = ParsePreprocessorConfig(j.dump());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->do_normalize);
  EXPECT_DOUBLE_EQ(p->rescale_factor, 0.5);
  EXPECT_EQ(p->resample, 2);
}

TEST(PreprocessorConfigTest, MissingAndInvalidFieldsAreNamed) {
  for (const std::string key : {"size.shortest_edge", "size.longest_edge", "patch_size",
                                "temporal_patch_size", "merge_size", "image_mean", "image_std"}) {
    Json j = Json::parse(k2BPreprocessor);
    auto [parent, last] = Locate(j, key);
    parent->erase(last);
    auto p = ParsePreprocessorConfig(j.dump());
    ASSERT_FALSE(p.ok()) << key;
    EXPECT_EQ(p.status().message(), "preprocessor_config.json: " + key + ": missing");
  }
  Json no_size = Json::parse(k2BPreprocessor);
  no_size.erase("size");
  EXPECT_EQ(ParsePreprocessorConfig(no_size.dump()).status().message(),
            "preprocessor_config.json: size.shortest_edge: missing");

  struct Case {
    std::string key;
    Json value;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {"size.shortest_edge", "65536", "size.shortest_edge: expected integer, got string"},
      {"size", 5, "size: expected object, got integer"},
      {"image_mean", Json::parse("[0.5, 0.5]"), "image_mean: expected 3 numbers, got 2"},
      {"image_std", Json::parse("[0.5, \"a\", 0.5]"), "image_std[1]: expected number, got string"},
      {"image_std", Json::parse("[0.5, 0, 0.5]"), "image_std[1]: must be positive"},
      {"patch_size", 0, "patch_size: must be positive"},
      {"merge_size", "2", "merge_size: expected integer, got string"},
      {"size.shortest_edge", 0, "size.shortest_edge: must be positive"},
      {"size.shortest_edge", 16777217,
       "size.shortest_edge (16777217) exceeds size.longest_edge (16777216)"},
      {"max_pixels", 1024, "size.shortest_edge (65536) exceeds max_pixels (1024)"},
      {"do_resize", 1, "do_resize: expected boolean, got integer"},
  };
  for (const Case& c : cases) {
    Json j = Json::parse(k2BPreprocessor);
    auto [parent, last] = Locate(j, c.key);
    (*parent)[last] = c.value;
    auto p = ParsePreprocessorConfig(j.dump());
    ASSERT_FALSE(p.ok()) << c.key;
    EXPECT_THAT(std::string(p.status().message()),
                HasSubstr("preprocessor_config.json: " + c.fragment)) << c.key;
  }
}

// --- files ------------------------------------------------------------------

TEST(ModelConfigFilesTest, LoadsFromDirectoryAndNamesMissingFiles) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("model_config_test_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  auto status = LoadModelConfig(dir.string()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(status.message()), HasSubstr("config.json"));
  EXPECT_EQ(LoadGenerationConfig(dir.string()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(LoadPreprocessorConfig(dir.string()).status().code(), absl::StatusCode::kNotFound);

  std::ofstream(dir / "config.json") << TinyConfig().dump(2);
  std::ofstream(dir / "preprocessor_config.json") << k2BPreprocessor;
  std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": [151645, 151643]})";
  auto c = LoadModelConfig(dir.string());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->text.hidden_size, 64);
  ASSERT_TRUE(LoadPreprocessorConfig(dir.string()).ok());
  ASSERT_TRUE(LoadGenerationConfig(dir.string()).ok());

  // Errors from a file name its path.
  Json bad = TinyConfig();
  bad["text_config"].erase("head_dim");
  std::ofstream(dir / "config.json") << bad.dump();
  EXPECT_EQ(LoadModelConfig(dir.string()).status().message(),
            (dir / "config.json").string() + ": text_config.head_dim: missing");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace vlm
