// GenerationState, the per-sequence logic after the model, fed scripted
// logits rows (logit 10 at the script's next id, 0 elsewhere: greedy picks
// it): one chunk per token, EOS, stop strings across tokens, held-back text
// released at the end, max_tokens and logprobs.
#include "services/language/engine/generation_state.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <random>
#include <regex>
#include <vector>

#include "nlohmann/json.hpp"
#include "services/language/grammar/grammar_cache.h"
#include "services/language/grammar/tokenizer_vocabulary.h"

namespace vlm::language {
namespace {

constexpr int64_t kVocab = 151936;

class GenerationStateTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* dir = std::getenv("VLM_TOKENIZER_DIR");
    auto t = Tokenizer::Load(dir ? dir : "");
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = t->release();
  }
  static void TearDownTestSuite() { delete tokenizer_; }

  std::vector<int32_t> Ids(const std::string& text) {
    auto ids = tokenizer_->Encode(text);
    EXPECT_TRUE(ids.ok());
    return *ids;
  }
  GenerationRequest Request(int64_t max_tokens) {
    GenerationRequest r;
    r.prompt_ids = Ids("Hello");
    r.sampling.temperature = 0.0f;
    r.max_tokens = max_tokens;
    return r;
  }

  static Tokenizer* tokenizer_;
};
Tokenizer* GenerationStateTest::tokenizer_ = nullptr;

// What a run streamed and how it ended.
struct Collected {
  std::vector<GenerationChunk> chunks;
  std::string text;
  std::vector<int32_t> ids;
  GenerationResult result;
  int64_t rows = 0;  // logits rows consumed
};

// Runs `request` on GenerationState over the scripted rows (then id 0) until
// it finishes, then Finish.
Collected Generate(const GenerationRequest& request, const Tokenizer* tokenizer,
                   const std::vector<int32_t>& script, std::vector<int32_t> eos_ids) {
  const GenerationStateConfig config{std::move(eos_ids)};
  GenerationState state(request, tokenizer, config);
  Collected out;
  for (;;) {
    std::vector<float> row(kVocab, 0.0f);
    const int32_t id = out.rows < static_cast<int64_t>(script.size()) ? script[out.rows] : 0;
    row[id] = 10.0f;
    ++out.rows;
    auto step = state.Next(row);
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) break;
    EXPECT_EQ(step->chunk.token_ids.size(), 1u);
    EXPECT_EQ(state.last_token(), step->chunk.token_ids.back());
    out.chunks.push_back(step->chunk);
    out.text += step->chunk.text;
    out.ids.insert(out.ids.end(), step->chunk.token_ids.begin(), step->chunk.token_ids.end());
    if (step->finished) break;
  }
  state.Finish();
  out.result = state.result();
  return out;
}

TEST_F(GenerationStateTest, StreamsOneChunkPerTokenUntilMaxTokens) {
  std::vector<int32_t> script = Ids(" one two three four five");
  GenerationRequest request = Request(3);
  Collected out = Generate(request, tokenizer_, script, {151645, 151643});
  EXPECT_EQ(out.result.finish, FinishReason::kLength);
  EXPECT_EQ(out.result.finish_detail, "max_tokens");
  EXPECT_EQ(out.result.completion_tokens, 3);
  EXPECT_EQ(out.result.prompt_tokens, static_cast<int64_t>(request.prompt_ids.size()));
  EXPECT_EQ(out.chunks.size(), 3u);
  EXPECT_EQ(out.ids, std::vector<int32_t>(script.begin(), script.begin() + 3));
  EXPECT_EQ(out.text + out.result.tail_text, " one two three");
}

TEST_F(GenerationStateTest, EosEndsTheTextWithoutItsOwnText) {
  std::vector<int32_t> script = Ids(" done");
  script.push_back(151645);  // <|im_end|>
  script.push_back(Ids(" never")[0]);
  GenerationRequest request = Request(10);
  request.include_special_tokens = true;  // even then the EOS text is not emitted
  Collected out = Generate(request, tokenizer_, script, {151645, 151643});
  EXPECT_EQ(out.result.finish, FinishReason::kStop);
  EXPECT_EQ(out.result.finish_detail, "eos");
  EXPECT_EQ(out.text + out.result.tail_text, " done");
  EXPECT_EQ(out.ids.back(), 151645);
  EXPECT_EQ(out.result.completion_tokens, static_cast<int64_t>(script.size()) - 1);

  // ignore_eos: the EOS token is an ordinary token.
  request.ignore_eos = true;
  request.max_tokens = static_cast<int64_t>(script.size());
  Collected out2 = Generate(request, tokenizer_, script, {151645, 151643});
  EXPECT_EQ(out2.result.finish, FinishReason::kLength);
  EXPECT_EQ(out2.text + out2.result.tail_text, " done<|im_end|> never");
}

TEST_F(GenerationStateTest, StopStringAcrossTokensIsHeldBackAndCut) {
  std::vector<int32_t> script = Ids("alpha beta gamma delta");
  GenerationRequest request = Request(20);
  request.stop = {"a gam"};  // spans " beta" | " gamma"
  Collected out = Generate(request, tokenizer_, script, {151645});
  EXPECT_EQ(out.result.finish, FinishReason::kStop);
  EXPECT_EQ(out.result.finish_detail, "stop string 0");
  EXPECT_EQ(out.text + out.result.tail_text, "alpha bet");
  EXPECT_LT(out.result.completion_tokens, static_cast<int64_t>(script.size()));
}

TEST_F(GenerationStateTest, HeldBackTextIsReleasedAtTheEnd) {
  std::vector<int32_t> script = Ids("one two");
  GenerationRequest request = Request(static_cast<int64_t>(script.size()));
  request.stop = {" twofold"};
  Collected out = Generate(request, tokenizer_, script, {151645});
  EXPECT_EQ(out.result.finish, FinishReason::kLength);
  EXPECT_EQ(out.text, "one");
  EXPECT_EQ(out.result.tail_text, " two");
}

TEST_F(GenerationStateTest, LogprobsCarryTokenTexts) {
  std::vector<int32_t> script = Ids(" hi");
  GenerationRequest request = Request(1);
  request.logprobs = true;
  request.top_logprobs = 2;
  Collected out = Generate(request, tokenizer_, script, {151645});
  ASSERT_EQ(out.chunks.size(), 1u);
  ASSERT_EQ(out.chunks[0].logprobs.size(), 1u);
  const GeneratedTokenLogprob& lp = out.chunks[0].logprobs[0];
  EXPECT_EQ(lp.chosen.id, script[0]);
  EXPECT_EQ(lp.chosen.token, " hi");
  // logit 10 vs 151668 zeros (padding masked): log(e^10 / (e^10 + 151668)).
  EXPECT_NEAR(lp.chosen.logprob, 10.0 - std::log(std::exp(10.0) + 151668.0), 1e-3);
  ASSERT_EQ(lp.top.size(), 2u);
  EXPECT_EQ(lp.top[0].id, script[0]);
  EXPECT_EQ(lp.top[1].id, 0);  // ties among zeros: lowest id
  EXPECT_EQ(lp.top[1].token, "!");
}

// Structured output: random logits (a seeded normal row per step, so the
// model "prefers" arbitrary tokens, EOS included) under temperature, top-k and
// top-p still give output the grammar accepts, ended by the grammar; logprobs
// are of the constrained distribution.
class ConstrainedGenerationTest : public GenerationStateTest {
 protected:
  static void SetUpTestSuite() {
    GenerationStateTest::SetUpTestSuite();
    auto vocab = grammar::VocabularyFromTokenizer(*tokenizer_);
    ASSERT_TRUE(vocab.ok()) << vocab.status();
    cache_ = new grammar::GrammarCache(*vocab, 8);
  }
  static void TearDownTestSuite() {
    delete cache_;
    GenerationStateTest::TearDownTestSuite();
  }

  struct Run {
    std::string text;
    GenerationResult result;
    std::vector<GeneratedTokenLogprob> logprobs;
  };
  Run Constrained(grammar::GrammarKind kind, const std::string& text, uint64_t seed,
                  int64_t max_tokens, bool logprobs = false) {
    GenerationRequest request = Request(max_tokens);
    request.sampling.temperature = 1.0f;
    request.sampling.top_k = 50;
    request.sampling.top_p = 0.9f;
    request.sampling.seed = seed;
    request.logprobs = logprobs;
    request.top_logprobs = logprobs ? 3 : 0;
    auto compiled = cache_->Get(kind, text);
    EXPECT_TRUE(compiled.ok()) << compiled.status();
    request.grammar = *compiled;
    const GenerationStateConfig config{{151645, 151643}};
    GenerationState state(request, tokenizer_, config);
    // Rows are windows of one table of normal noise at a seeded offset per
    // step (drawing 151936 normals per step would dominate the test's time).
    static const std::vector<float>* noise = [] {
      auto* v = new std::vector<float>(2 * kVocab);
      std::mt19937 rng(42);
      std::normal_distribution<float> normal(0.0f, 3.0f);
      for (float& x : *v) x = normal(rng);
      return v;
    }();
    std::mt19937 rng(static_cast<uint32_t>(seed));
    Run run;
    for (int64_t i = 0; i < max_tokens; ++i) {
      const size_t offset = rng() % kVocab;
      std::vector<float> row(noise->begin() + offset, noise->begin() + offset + kVocab);
      row[151645] = 20.0f;  // the model wants to stop at once: only allowed at the end
      auto step = state.Next(row);
      EXPECT_TRUE(step.ok()) << step.status();
      if (!step.ok()) break;
      run.text += step->chunk.text;
      for (auto& lp : step->chunk.logprobs) run.logprobs.push_back(lp);
      if (step->finished) break;
    }
    state.Finish();
    run.text += state.result().tail_text;
    run.result = state.result();
    return run;
  }

  static grammar::GrammarCache* cache_;
};
grammar::GrammarCache* ConstrainedGenerationTest::cache_ = nullptr;

TEST_F(ConstrainedGenerationTest, JsonSchemaOutputParsesAndEndsWithTheGrammar) {
  const std::string schema = R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 8},
      "age": {"type": "integer", "minimum": 0, "maximum": 120},
      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
      "required": ["name", "age", "tags"]})";
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    Run run = Constrained(grammar::GrammarKind::kJsonSchema, schema, seed, 200);
    EXPECT_EQ(run.result.finish, FinishReason::kStop) << run.text;
    EXPECT_EQ(run.result.finish_detail, "grammar complete");
    const nlohmann::json v = nlohmann::json::parse(run.text, nullptr, false);
    ASSERT_TRUE(v.is_object()) << run.text;
    EXPECT_TRUE(v["name"].is_string() && v["name"].get<std::string>().size() <= 8 * 4) << run.text;
    EXPECT_TRUE(v["age"].is_number_integer() && v["age"] >= 0 && v["age"] <= 120) << run.text;
    EXPECT_TRUE(v["tags"].is_array() && v["tags"].size() <= 3) << run.text;
    EXPECT_GE(run.result.grammar_ms, 0.0);
  }
}

// Unbounded grammars (JSON mode, a string without maxLength) still end with a
// complete output by max_tokens, whatever the model prefers: near the end
// only tokens that keep a completion in reach are drawn.
TEST_F(ConstrainedGenerationTest, OutputIsCompleteByMaxTokensEvenWhenUnbounded) {
  const std::string schema = R"({"type": "object", "properties": {"note": {"type": "string"},
      "n": {"type": "integer"}}, "required": ["note", "n"]})";
  auto compiled = cache_->Get(grammar::GrammarKind::kJsonSchema, schema);
  ASSERT_TRUE(compiled.ok());
  const int64_t shortest = (*compiled)->grammar().MinOutputBytes();
  EXPECT_EQ(shortest, static_cast<int64_t>(std::string(R"({"note":"","n":0})").size()));
  for (int64_t max_tokens : {shortest + 1, shortest + 2, shortest + 9, int64_t{60}}) {
    Run run = Constrained(grammar::GrammarKind::kJsonSchema, schema, 5 + max_tokens, max_tokens);
    EXPECT_EQ(run.result.finish_detail, "grammar complete") << max_tokens << ": " << run.text;
    EXPECT_LE(run.result.completion_tokens, max_tokens);
    const nlohmann::json v = nlohmann::json::parse(run.text, nullptr, false);
    EXPECT_TRUE(v.is_object() && v["note"].is_string() && v["n"].is_number_integer())
        << max_tokens << ": " << run.text;
  }
  for (int64_t max_tokens : {3, 10, 40}) {
    Run run = Constrained(grammar::GrammarKind::kJsonObject, "", 100 + max_tokens, max_tokens);
    EXPECT_EQ(run.result.finish_detail, "grammar complete") << run.text;
    EXPECT_TRUE(nlohmann::json::parse(run.text, nullptr, false).is_object()) << run.text;
  }
}

TEST_F(ConstrainedGenerationTest, RegexAndToolCallAndJsonMode) {
  Run digits = Constrained(grammar::GrammarKind::kRegex, "[0-9]{3}-[a-z]{2}", 7, 50);
  EXPECT_EQ(digits.result.finish_detail, "grammar complete");
  EXPECT_TRUE(std::regex_match(digits.text, std::regex("[0-9]{3}-[a-z]{2}"))) << digits.text;

  const std::string call = R"({"type": "object", "properties": {"name": {"const": "lookup_sku"},
      "arguments": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 6}},
      "required": ["sku"]}}, "required": ["name", "arguments"]})";
  Run tool = Constrained(grammar::GrammarKind::kToolCall, call, 3, 120);
  EXPECT_EQ(tool.result.finish_detail, "grammar complete");
  ASSERT_EQ(tool.text.rfind("<tool_call>\n", 0), 0u) << tool.text;
  ASSERT_GE(tool.text.size(), 25u);
  EXPECT_EQ(tool.text.substr(tool.text.size() - 13), "\n</tool_call>");
  const nlohmann::json body = nlohmann::json::parse(
      tool.text.substr(12, tool.text.size() - 25), nullptr, false);
  ASSERT_TRUE(body.is_object()) << tool.text;
  EXPECT_EQ(body["name"], "lookup_sku");
  EXPECT_TRUE(body["arguments"]["sku"].is_string());

  Run object = Constrained(grammar::GrammarKind::kJsonObject, "", 11, 120, /*logprobs=*/true);
  EXPECT_EQ(object.result.finish, FinishReason::kStop);
  EXPECT_TRUE(nlohmann::json::parse(object.text, nullptr, false).is_object()) << object.text;
  // Logprobs of the constrained distribution: the first token must open an
  // object, so every alternative listed is a token starting with '{' (or
  // whitespace-free: JSON mode allows no leading space) and the chosen one's
  // logprob is finite although EOS had logit 20.
  ASSERT_FALSE(object.logprobs.empty());
  const GeneratedTokenLogprob& first = object.logprobs[0];
  EXPECT_TRUE(std::isfinite(first.chosen.logprob));
  EXPECT_EQ(first.top.size(), 3u);
  for (const TopLogprobEntry& alt : first.top) {
    EXPECT_EQ(alt.token.substr(0, 1), "{") << alt.token;
    EXPECT_NE(alt.id, 151645);
  }
  double mass = 0;
  for (const TopLogprobEntry& alt : first.top) mass += std::exp(alt.logprob);
  EXPECT_LE(mass, 1.0 + 1e-4);
}

}  // namespace
}  // namespace vlm::language
