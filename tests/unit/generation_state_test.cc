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
#include <vector>

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

}  // namespace
}  // namespace vlm::language
