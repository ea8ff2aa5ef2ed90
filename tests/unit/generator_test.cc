// The generation loop over a scripted fake model (greedy picks the script's
// next id): streaming, EOS, stop strings across tokens, max_tokens,
// cancellation between decode steps, and what the model is asked to do.
#include "services/language/engine/generator.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace vlm::language {
namespace {

constexpr int64_t kVocab = 151936;

// Emits `script` one id per step (logit 10 for it, 0 elsewhere), then id 0.
class ScriptedModel : public GenerationModel {
 public:
  explicit ScriptedModel(std::vector<int32_t> script) : script_(std::move(script)) {}

  absl::StatusOr<std::unique_ptr<Sequence>> NewSequence(int64_t capacity) override {
    capacity_ = capacity;
    return std::make_unique<Sequence>();
  }
  absl::Status ProjectImages(Sequence&, absl::Span<const ImageFeatures> images) override {
    projected_ += static_cast<int>(images.size());
    return absl::OkStatus();
  }
  absl::StatusOr<at::Tensor> Prefill(Sequence&, absl::Span<const int32_t> ids) override {
    prefilled_ = static_cast<int64_t>(ids.size());
    return Next();
  }
  absl::StatusOr<at::Tensor> DecodeStep(Sequence&, int32_t id) override {
    fed_.push_back(id);
    return Next();
  }

  int64_t capacity_ = 0;
  int64_t prefilled_ = 0;
  int projected_ = 0;
  std::vector<int32_t> fed_;  // ids given to DecodeStep

 private:
  at::Tensor Next() {
    at::Tensor logits = at::zeros({kVocab}, at::kFloat);
    const int32_t id = step_ < script_.size() ? script_[step_] : 0;
    ++step_;
    logits[id] = 10.0f;
    return logits;
  }
  std::vector<int32_t> script_;
  size_t step_ = 0;
};

class GeneratorTest : public ::testing::Test {
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
Tokenizer* GeneratorTest::tokenizer_ = nullptr;

struct Collected {
  std::vector<GenerationChunk> chunks;
  std::string text;
  std::vector<int32_t> ids;
  ChunkSink Sink() {
    return [this](const GenerationChunk& c) {
      chunks.push_back(c);
      text += c.text;
      ids.insert(ids.end(), c.token_ids.begin(), c.token_ids.end());
      return true;
    };
  }
};

TEST_F(GeneratorTest, StreamsOneChunkPerTokenUntilMaxTokens) {
  std::vector<int32_t> script = Ids(" one two three four five");
  ScriptedModel model(script);
  Generator generator(&model, tokenizer_, {{151645, 151643}});
  Collected out;
  GenerationRequest request = Request(3);
  auto result = generator.Generate(request, out.Sink());
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->finish, FinishReason::kLength);
  EXPECT_EQ(result->completion_tokens, 3);
  EXPECT_EQ(out.chunks.size(), 3u);
  EXPECT_EQ(out.ids, std::vector<int32_t>(script.begin(), script.begin() + 3));
  EXPECT_EQ(out.text + result->tail_text, " one two three");
  // The last sampled token is never fed back: max_tokens - 1 decode steps.
  EXPECT_EQ(model.fed_, std::vector<int32_t>(script.begin(), script.begin() + 2));
  EXPECT_EQ(model.prefilled_, static_cast<int64_t>(request.prompt_ids.size()));
  EXPECT_EQ(model.capacity_, static_cast<int64_t>(request.prompt_ids.size()) + 3);
}

TEST_F(GeneratorTest, EosEndsTheTextWithoutItsOwnText) {
  std::vector<int32_t> script = Ids(" done");
  script.push_back(151645);  // <|im_end|>
  script.push_back(Ids(" never")[0]);
  ScriptedModel model(script);
  Generator generator(&model, tokenizer_, {{151645, 151643}});
  Collected out;
  GenerationRequest request = Request(10);
  request.include_special_tokens = true;  // even then the EOS text is not emitted
  auto result = generator.Generate(request, out.Sink());
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->finish, FinishReason::kStop);
  EXPECT_EQ(result->finish_detail, "eos");
  EXPECT_EQ(out.text + result->tail_text, " done");
  EXPECT_EQ(out.ids.back(), 151645);
  EXPECT_EQ(result->completion_tokens, static_cast<int64_t>(script.size()) - 1);

  // ignore_eos: the EOS token is an ordinary token.
  ScriptedModel again(script);
  Generator g2(&again, tokenizer_, {{151645, 151643}});
  Collected out2;
  request.ignore_eos = true;
  request.max_tokens = static_cast<int64_t>(script.size());
  auto r2 = g2.Generate(request, out2.Sink());
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->finish, FinishReason::kLength);
  EXPECT_EQ(out2.text + r2->tail_text, " done<|im_end|> never");
}

TEST_F(GeneratorTest, StopStringAcrossTokensIsHeldBackAndCut) {
  std::vector<int32_t> script = Ids("alpha beta gamma delta");
  ScriptedModel model(script);
  Generator generator(&model, tokenizer_, {{151645}});
  Collected out;
  GenerationRequest request = Request(20);
  request.stop = {"a gam"};  // spans " beta" | " gamma"
  auto result = generator.Generate(request, out.Sink());
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->finish, FinishReason::kStop);
  EXPECT_EQ(out.text + result->tail_text, "alpha bet");
  EXPECT_LT(result->completion_tokens, static_cast<int64_t>(script.size()));
}

TEST_F(GeneratorTest, HeldBackTextIsReleasedAtTheEnd) {
  std::vector<int32_t> script = Ids("one two");
  ScriptedModel model(script);
  Generator generator(&model, tokenizer_, {{151645}});
  Collected out;
  GenerationRequest request = Request(static_cast<int64_t>(script.size()));
  request.stop = {" twofold"};
  auto result = generator.Generate(request, out.Sink());
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->finish, FinishReason::kLength);
  EXPECT_EQ(out.text, "one");
  EXPECT_EQ(result->tail_text, " two");
}

TEST_F(GeneratorTest, CancellationStopsBeforeTheNextDecodeStep) {
  std::vector<int32_t> script = Ids(" a b c d e f g h");
  ScriptedModel model(script);
  Generator generator(&model, tokenizer_, {{151645}});
  Collected out;
  int checks = 0;
  // Cancelled right after the third token was streamed.
  auto should_stop = [&] { return out.ids.size() >= 3 && ++checks > 0; };
  auto result = generator.Generate(Request(50), out.Sink(), should_stop);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->finish, FinishReason::kCancelled);
  EXPECT_EQ(out.ids.size(), 3u);
  EXPECT_EQ(model.fed_.size(), 2u);  // no decode step after the cancel
  EXPECT_EQ(checks, 1);

  // A sink that fails (client gone) ends it too.
  ScriptedModel m2(script);
  Generator g2(&m2, tokenizer_, {{151645}});
  int calls = 0;
  auto r2 = g2.Generate(Request(50), [&](const GenerationChunk&) { return ++calls < 2; });
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->finish, FinishReason::kCancelled);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(m2.fed_.size(), 1u);

  // Cancelled before anything ran: no projector, no prefill.
  ScriptedModel m3(script);
  Generator g3(&m3, tokenizer_, {{151645}});
  GenerationRequest with_image = Request(5);
  with_image.images.resize(1);
  auto r3 = g3.Generate(with_image, Collected().Sink(), [] { return true; });
  ASSERT_TRUE(r3.ok());
  EXPECT_EQ(r3->finish, FinishReason::kCancelled);
  EXPECT_EQ(m3.projected_, 0);
  EXPECT_EQ(m3.prefilled_, 0);
}

TEST_F(GeneratorTest, LogprobsCarryTokenTexts) {
  std::vector<int32_t> script = Ids(" hi");
  ScriptedModel model(script);
  Generator generator(&model, tokenizer_, {{151645}});
  Collected out;
  GenerationRequest request = Request(1);
  request.logprobs = true;
  request.top_logprobs = 2;
  auto result = generator.Generate(request, out.Sink());
  ASSERT_TRUE(result.ok());
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

TEST_F(GeneratorTest, RejectsAnEmptyPromptAndZeroMaxTokens) {
  ScriptedModel model({});
  Generator generator(&model, tokenizer_, {{151645}});
  GenerationRequest empty = Request(3);
  empty.prompt_ids.clear();
  EXPECT_EQ(generator.Generate(empty, Collected().Sink()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(generator.Generate(Request(0), Collected().Sink()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace vlm::language
