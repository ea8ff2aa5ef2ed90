// Starts the real vlm-language on loopback with the tiny checkpoint and talks
// to it as the gateway would: readiness gating during the projector warm-up,
// streamed greedy and sampled generation, an image request, stop strings,
// max_tokens, CountTokens, every kind of bad input (INVALID_ARGUMENT naming
// the field, and the server keeps serving), admission (RESOURCE_EXHAUSTED),
// cancellation and deadlines.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "services/language/text/tokenizer.h"
#include "tests/integration/service_process.h"
#include "vlm/v1/language.grpc.pb.h"

namespace vlm {
namespace {

using testing::Eventually;
using testing::ServiceProcess;
using v1::GenerateRequest;
using v1::GenerateResponse;

constexpr char kService[] = "vlm.v1.Language";

std::string TinyCheckpoint() {
  const char* dir = std::getenv("VLM_BINARY_DIR");
  return std::string(dir ? dir : ".") + "/tiny_checkpoint";
}

// One vlm-language process on loopback ports of its own, with the tiny
// checkpoint, one intra-op thread and `flags`; logs under `name`.
std::unique_ptr<ServiceProcess> StartLanguage(const std::string& name,
                                              const std::vector<std::string>& flags,
                                              std::vector<std::string> env = {}) {
  std::vector<std::string> args = {"--model_dir=" + TinyCheckpoint(), "--grpc_address=127.0.0.1:0",
                                   "--metrics_address=127.0.0.1:0", "--intra_op_threads=1"};
  args.insert(args.end(), flags.begin(), flags.end());
  return std::make_unique<ServiceProcess>(
      VLM_LANGUAGE_PATH, args, testing::TestLogDir("language_service_test") + "/" + name,
      std::move(env));
}

// A one-user-turn text request with greedy defaults the tests rely on.
GenerateRequest TextRequest(const std::string& text, int max_tokens = 8) {
  GenerateRequest r;
  r.set_add_generation_prompt(true);
  v1::LanguageMessage* m = r.add_messages();
  m->set_role("user");
  m->add_content()->set_text(text);
  r.mutable_params()->set_max_tokens(max_tokens);
  r.mutable_params()->mutable_sampling()->set_temperature(0.0f);
  r.mutable_params()->set_ignore_eos(true);
  return r;
}

uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

// Deterministic random [rows, cols] features in `dtype`.
void RandomTensor(v1::Tensor* t, int64_t rows, int64_t cols, v1::DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  t->set_dtype(dtype);
  t->add_shape(rows);
  t->add_shape(cols);
  std::string data;
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float v = normal(rng);
    if (dtype == v1::DTYPE_BF16) {
      const uint16_t b = ToBf16(v);
      data.append(reinterpret_cast<const char*>(&b), 2);
    } else {
      data.append(reinterpret_cast<const char*>(&v), 4);
    }
  }
  t->set_data(data);
}

// Appends an image part with grid (1, h, w) and tiny-model features (vision
// hidden 64, two deepstack taps).
v1::VisionFeatures* AddImage(GenerateRequest* r, int64_t h, int64_t w, uint32_t seed,
                             v1::DType dtype = v1::DTYPE_BF16) {
  v1::VisionFeatures* image = r->mutable_messages(0)->add_content()->mutable_image();
  image->mutable_grid()->set_t(1);
  image->mutable_grid()->set_h(h);
  image->mutable_grid()->set_w(w);
  RandomTensor(image->mutable_last_hidden(), h * w, 64, dtype, seed);
  for (int k = 0; k < 2; ++k) RandomTensor(image->add_deepstack(), h * w, 64, dtype, seed + 1 + k);
  return image;
}

struct Streamed {
  grpc::Status status;
  std::vector<GenerateResponse> responses;
  std::string text;             // all deltas concatenated, the last message's included
  std::vector<int32_t> ids;
  GenerateResponse last;
};

Streamed Generate(v1::Language::Stub& stub, const GenerateRequest& request,
                  absl::Duration deadline = absl::Seconds(60),
                  grpc::ClientContext* ctx_in = nullptr,
                  const std::function<void(const GenerateResponse&)>& on_response = nullptr) {
  grpc::ClientContext local;
  grpc::ClientContext* ctx = ctx_in ? ctx_in : &local;
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  Streamed out;
  std::unique_ptr<grpc::ClientReader<GenerateResponse>> reader = stub.Generate(ctx, request);
  GenerateResponse response;
  while (reader->Read(&response)) {
    if (on_response) on_response(response);
    out.text += response.text();
    out.ids.insert(out.ids.end(), response.token_ids().begin(), response.token_ids().end());
    out.responses.push_back(response);
  }
  out.status = reader->Finish();
  if (!out.responses.empty()) out.last = out.responses.back();
  return out;
}

// ---------------------------------------------------------------------------

TEST(LanguageWarmUpTest, AnswersUnavailableWhileTheProjectorWarmsUp) {
  std::unique_ptr<ServiceProcess> server = StartLanguage("warmup", {}, {"VLM_TEST_WARMUP_DELAY_MS=2500"});
  ASSERT_TRUE(server->WaitListening(absl::Seconds(30))) << server->LogTail();
  auto channel = grpc::CreateChannel(server->grpc_target(), grpc::InsecureChannelCredentials());
  auto stub = v1::Language::NewStub(channel);

  // Wait for the warm-up phase proper (tokenizer and headers may come first).
  std::string last_message;
  ASSERT_TRUE(Eventually(
      [&] {
        Streamed r = Generate(*stub, TextRequest("hi"), absl::Seconds(5));
        last_message = r.status.error_message();
        return r.status.error_code() == grpc::StatusCode::UNAVAILABLE &&
               absl::StrContains(last_message, "projector warming up");
      },
      absl::Seconds(20)))
      << last_message;
  EXPECT_EQ(server->Health(kService, absl::Seconds(5)), "NOT_SERVING");
  grpc::ClientContext ctx;
  v1::CountTokensResponse count;
  grpc::Status s = stub->CountTokens(&ctx, TextRequest("hi"), &count);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "warming up")) << s.error_message();

  ASSERT_TRUE(server->WaitServing(kService, absl::Seconds(30))) << server->LogTail();
  Streamed ok = Generate(*stub, TextRequest("hi", 2));
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.ids.size(), 2u);
}

// One server for the rest: one sequence slot, one queue place, a small context.
class LanguageServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ =
        StartLanguage("service", {"--max_sequences=1", "--max_queue=1", "--max_context=1024"});
    ASSERT_TRUE(server_->WaitListening(absl::Seconds(30))) << server_->LogTail();
    channel_ = new std::shared_ptr<grpc::Channel>(
        grpc::CreateChannel(server_->grpc_target(), grpc::InsecureChannelCredentials()));
    ASSERT_TRUE(server_->WaitServing(kService, absl::Seconds(60))) << server_->LogTail();
    auto tokenizer = language::Tokenizer::Load(TinyCheckpoint());
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = tokenizer->release();
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    delete channel_;
    server_.reset();
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(tokenizer_, nullptr);
    stub_ = v1::Language::NewStub(*channel_);
  }
  void TearDown() override {
    EXPECT_TRUE(server_->Alive()) << "vlm-language died\n" << server_->LogTail();
  }

  int32_t CountTokens(const GenerateRequest& request, v1::CountTokensResponse* out = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::CountTokensResponse response;
    grpc::Status s = stub_->CountTokens(&ctx, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    if (out) *out = response;
    return response.usage().prompt_tokens();
  }

  static inline std::unique_ptr<ServiceProcess> server_;
  static std::shared_ptr<grpc::Channel>* channel_;
  static language::Tokenizer* tokenizer_;
  std::unique_ptr<v1::Language::Stub> stub_;
};
std::shared_ptr<grpc::Channel>* LanguageServiceTest::channel_ = nullptr;
language::Tokenizer* LanguageServiceTest::tokenizer_ = nullptr;

TEST_F(LanguageServiceTest, GreedyTextStreamsDeltasThatConcatenateToTheCompletion) {
  const GenerateRequest request = TextRequest("Write a short poem about the sea.", 24);
  Streamed r = Generate(*stub_, request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(r.ids.size(), 24u);
  // One message per token, then the last one with no token.
  ASSERT_EQ(r.responses.size(), 25u);
  for (size_t i = 0; i + 1 < r.responses.size(); ++i) {
    EXPECT_EQ(r.responses[i].token_ids_size(), 1);
    EXPECT_EQ(r.responses[i].finish_reason(), v1::FINISH_REASON_UNSPECIFIED);
  }
  absl::StatusOr<std::string> decoded = tokenizer_->Decode(r.ids, /*skip_special_tokens=*/true);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(r.text, *decoded);
  EXPECT_FALSE(r.text.empty());

  EXPECT_EQ(r.last.finish_reason(), v1::FINISH_REASON_LENGTH);
  const int32_t prompt = CountTokens(request);
  EXPECT_GT(prompt, 10);
  EXPECT_EQ(r.last.usage().prompt_tokens(), prompt);
  EXPECT_EQ(r.last.usage().image_tokens(), 0);
  EXPECT_EQ(r.last.usage().completion_tokens(), 24);
  EXPECT_EQ(r.last.usage().total_tokens(), prompt + 24);
  const v1::LanguageTimings& t = r.last.timings();
  EXPECT_GT(t.prefill_ms(), 0);
  EXPECT_GT(t.decode_ms(), 0);
  EXPECT_GE(t.first_token_ms(), t.prefill_ms());
  EXPECT_GE(t.total_ms(), t.first_token_ms());

  // Greedy is deterministic.
  Streamed again = Generate(*stub_, request);
  ASSERT_TRUE(again.status.ok());
  EXPECT_EQ(again.ids, r.ids);
}

TEST_F(LanguageServiceTest, SeededSamplingRepeatsAndLogprobsDescribeTheChoice) {
  // The tiny checkpoint's random weights make peaked distributions (top-1
  // margins of 8 to 40 nats): a high temperature makes the seed matter.
  GenerateRequest request = TextRequest("Tell me something.", 12);
  v1::SamplingParams* s = request.mutable_params()->mutable_sampling();
  s->set_temperature(8.0f);
  s->set_top_k(0);
  s->set_top_p(1.0f);
  s->set_seed(1234);
  request.mutable_params()->set_top_logprobs(3);
  Streamed a = Generate(*stub_, request);
  Streamed b = Generate(*stub_, request);
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  ASSERT_TRUE(b.status.ok());
  EXPECT_EQ(a.ids, b.ids);
  bool some_seed_differs = false;
  for (uint64_t seed : {999, 31337, 4242}) {
    s->set_seed(seed);
    Streamed c = Generate(*stub_, request);
    ASSERT_TRUE(c.status.ok());
    some_seed_differs = some_seed_differs || c.ids != a.ids;
  }
  EXPECT_TRUE(some_seed_differs);

  for (size_t i = 0; i + 1 < a.responses.size(); ++i) {
    const GenerateResponse& resp = a.responses[i];
    ASSERT_EQ(resp.logprobs_size(), 1);
    const v1::TokenLogprob& lp = resp.logprobs(0);
    EXPECT_EQ(lp.token_id(), resp.token_ids(0));
    EXPECT_LE(lp.logprob(), 0.0f);
    ASSERT_EQ(lp.top_size(), 3);
    EXPECT_GE(lp.top(0).logprob(), lp.top(1).logprob());
    EXPECT_GE(lp.top(1).logprob(), lp.top(2).logprob());
    EXPECT_GE(lp.top(0).logprob(), lp.logprob());
    for (const v1::TopLogprob& t : lp.top()) EXPECT_LT(t.token_id(), tokenizer_->vocab_size());
  }
  // Greedy picks the top alternative.
  GenerateRequest greedy = TextRequest("Tell me something.", 4);
  greedy.mutable_params()->set_top_logprobs(2);
  Streamed g = Generate(*stub_, greedy);
  ASSERT_TRUE(g.status.ok());
  for (size_t i = 0; i + 1 < g.responses.size(); ++i) {
    EXPECT_EQ(g.responses[i].logprobs(0).top(0).token_id(), g.responses[i].token_ids(0));
  }
}

TEST_F(LanguageServiceTest, OneImageRequestCountsImageTokens) {
  GenerateRequest request = TextRequest("What is in this picture?", 6);
  AddImage(&request, 4, 6, 7);  // 4x6 patches -> 6 image tokens
  v1::CountTokensResponse count;
  const int32_t prompt = CountTokens(request, &count);
  EXPECT_EQ(count.usage().image_tokens(), 6);
  Streamed r = Generate(*stub_, request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.ids.size(), 6u);
  EXPECT_EQ(r.last.usage().prompt_tokens(), prompt);
  EXPECT_EQ(r.last.usage().image_tokens(), 6);
  EXPECT_GT(r.last.timings().projector_ms(), 0);
  // The image matters, and the same features give the same answer.
  Streamed same = Generate(*stub_, request);
  ASSERT_TRUE(same.status.ok());
  EXPECT_EQ(same.ids, r.ids);
  GenerateRequest other = TextRequest("What is in this picture?", 6);
  AddImage(&other, 4, 6, 8);
  GenerateRequest f32 = TextRequest("What is in this picture?", 6);
  AddImage(&f32, 4, 6, 7, v1::DTYPE_F32);
  Streamed f = Generate(*stub_, f32);
  EXPECT_TRUE(f.status.ok()) << f.status.error_message();
  Streamed o = Generate(*stub_, other);
  ASSERT_TRUE(o.status.ok());
  Streamed text_only = Generate(*stub_, TextRequest("What is in this picture?", 6));
  ASSERT_TRUE(text_only.status.ok());
  EXPECT_TRUE(o.ids != r.ids || text_only.ids != r.ids);
}

TEST_F(LanguageServiceTest, StopStringEndsTheStreamBeforeIt) {
  const GenerateRequest plain = TextRequest("Count from one to twenty.", 24);
  Streamed full = Generate(*stub_, plain);
  ASSERT_TRUE(full.status.ok());
  ASSERT_GE(full.text.size(), 8u) << full.text;
  // A stop string taken from the middle of the greedy completion, spanning a
  // token boundary where possible.
  const std::string stop = full.text.substr(full.text.size() / 2, 3);
  const size_t at = full.text.find(stop);
  GenerateRequest request = plain;
  request.mutable_params()->add_stop("never-appears-\xE2\x82\xAC");
  request.mutable_params()->add_stop(stop);
  Streamed r = Generate(*stub_, request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.text, full.text.substr(0, at)) << "stop=" << stop;
  EXPECT_EQ(r.last.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_LT(r.ids.size(), full.ids.size());
  EXPECT_EQ(r.last.usage().completion_tokens(), static_cast<int32_t>(r.ids.size()));
  // A stop at the very start releases nothing.
  GenerateRequest first = plain;
  first.mutable_params()->add_stop(full.text.substr(0, 1));
  Streamed f = Generate(*stub_, first);
  ASSERT_TRUE(f.status.ok());
  EXPECT_EQ(f.text, "");
  EXPECT_EQ(f.last.finish_reason(), v1::FINISH_REASON_STOP);
}

// Structured output over gRPC: a JSON schema, a regex and a required tool
// call each end with FINISH_REASON_STOP and a complete, valid output.
TEST_F(LanguageServiceTest, ConstraintsGiveCompleteOutputs) {
  GenerateRequest schema = TextRequest("Give me a record.", 120);
  schema.mutable_params()->set_ignore_eos(false);
  schema.mutable_params()->set_json_schema(R"({"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
      "required": ["name", "ok"]})");
  Streamed r = Generate(*stub_, schema);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.last.finish_reason(), v1::FINISH_REASON_STOP) << r.text;
  EXPECT_TRUE(absl::StartsWith(r.text, "{")) << r.text;
  EXPECT_TRUE(absl::StrContains(r.text, "\"name\"") && absl::StrContains(r.text, "\"ok\""))
      << r.text;

  GenerateRequest regex = TextRequest("A code?", 20);
  regex.mutable_params()->set_regex("[A-Z]{2}-[0-9]{3}");
  r = Generate(*stub_, regex);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.last.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(r.text.size(), 6u) << r.text;
  EXPECT_EQ(r.text[2], '-') << r.text;

  GenerateRequest tool = TextRequest("Look up SKU 7.", 100);
  v1::Tool* t = tool.add_tools();
  t->set_name("lookup_sku");
  t->set_parameters(R"({"type": "object", "properties": {"sku": {"type": "integer",
      "minimum": 0, "maximum": 99}}, "required": ["sku"]})");
  tool.mutable_tool_choice()->set_mode(v1::TOOL_CHOICE_REQUIRED);
  r = Generate(*stub_, tool);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.last.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_TRUE(absl::StartsWith(r.text, "<tool_call>\n{\"name\":")) << r.text;
  EXPECT_TRUE(absl::StrContains(r.text, "lookup_sku")) << r.text;
  EXPECT_TRUE(absl::EndsWith(r.text, "}\n</tool_call>")) << r.text;
}

TEST_F(LanguageServiceTest, MaxTokensAndContextEndWithLength) {
  Streamed r = Generate(*stub_, TextRequest("Hello", 3));
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.ids.size(), 3u);
  EXPECT_EQ(r.last.finish_reason(), v1::FINISH_REASON_LENGTH);
  // max_tokens larger than the room left: the context (1024) ends it.
  std::string text;
  for (int i = 0; i < 1000; ++i) text += " word";
  GenerateRequest request = TextRequest(text, 100);
  const int32_t prompt = CountTokens(request);
  ASSERT_LT(prompt, 1024);
  ASSERT_GT(prompt, 1024 - 100);
  Streamed c = Generate(*stub_, request);
  ASSERT_TRUE(c.status.ok()) << c.status.error_message();
  EXPECT_EQ(static_cast<int32_t>(c.ids.size()), 1024 - prompt);
  EXPECT_EQ(c.last.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(c.last.usage().total_tokens(), 1024);
}

TEST_F(LanguageServiceTest, EveryBadInputIsInvalidArgumentNamingTheField) {
  struct Case {
    const char* name;
    std::function<void(GenerateRequest*)> mutate;
    const char* field;  // must appear in the message
  };
  const std::vector<Case> cases = {
      {"features rows vs grid",
       [](GenerateRequest* r) {
         v1::VisionFeatures* image = AddImage(r, 4, 4, 1);
         image->mutable_last_hidden()->Clear();
         RandomTensor(image->mutable_last_hidden(), 12, 64, v1::DTYPE_BF16, 1);
       },
       "messages[0].content[1].image.last_hidden"},
      {"features width",
       [](GenerateRequest* r) {
         v1::VisionFeatures* image = AddImage(r, 4, 4, 1);
         image->mutable_deepstack(1)->Clear();
         RandomTensor(image->mutable_deepstack(1), 16, 32, v1::DTYPE_BF16, 1);
       },
       "messages[0].content[1].image.deepstack[1]"},
      {"features bytes",
       [](GenerateRequest* r) {
         AddImage(r, 4, 4, 1)->mutable_last_hidden()->mutable_data()->resize(100);
       },
       "messages[0].content[1].image.last_hidden"},
      {"wrong dtype",
       [](GenerateRequest* r) {
         AddImage(r, 4, 4, 1)->mutable_last_hidden()->set_dtype(v1::DTYPE_F16);
       },
       "messages[0].content[1].image.last_hidden.dtype"},
      {"unspecified dtype",
       [](GenerateRequest* r) {
         AddImage(r, 4, 4, 1)->mutable_deepstack(0)->set_dtype(v1::DTYPE_UNSPECIFIED);
       },
       "messages[0].content[1].image.deepstack[0].dtype"},
      {"missing deepstack",
       [](GenerateRequest* r) { AddImage(r, 4, 4, 1)->mutable_deepstack()->RemoveLast(); },
       "messages[0].content[1].image.deepstack"},
      {"grid not a multiple of the merge size",
       [](GenerateRequest* r) { AddImage(r, 3, 4, 1); },
       "messages[0].content[1].image.grid"},
      {"grid of zero",
       [](GenerateRequest* r) { AddImage(r, 4, 4, 1)->mutable_grid()->set_t(0); },
       "messages[0].content[1].image.grid"},
      {"grid vs placeholders",
       [](GenerateRequest* r) {
         r->mutable_messages(0)->mutable_content(0)->set_text("look: <|image_pad|>");
       },
       "messages[0]"},
      {"prompt longer than the context",
       [](GenerateRequest* r) {
         std::string text;
         for (int i = 0; i < 1100; ++i) text += " word";
         r->mutable_messages(0)->mutable_content(0)->set_text(text);
       },
       "messages"},
      {"max_tokens 0", [](GenerateRequest* r) { r->mutable_params()->set_max_tokens(0); },
       "params.max_tokens"},
      {"max_tokens absurd",
       [](GenerateRequest* r) { r->mutable_params()->set_max_tokens(1 << 30); },
       "params.max_tokens"},
      {"negative temperature",
       [](GenerateRequest* r) { r->mutable_params()->mutable_sampling()->set_temperature(-1); },
       "params.sampling.temperature"},
      {"top_p 0", [](GenerateRequest* r) { r->mutable_params()->mutable_sampling()->set_top_p(0); },
       "params.sampling.top_p"},
      {"top_p above 1",
       [](GenerateRequest* r) { r->mutable_params()->mutable_sampling()->set_top_p(1.5f); },
       "params.sampling.top_p"},
      {"negative top_k",
       [](GenerateRequest* r) { r->mutable_params()->mutable_sampling()->set_top_k(-1); },
       "params.sampling.top_k"},
      {"min_p 1", [](GenerateRequest* r) { r->mutable_params()->mutable_sampling()->set_min_p(1); },
       "params.sampling.min_p"},
      {"repetition penalty 0",
       [](GenerateRequest* r) {
         r->mutable_params()->mutable_sampling()->set_repetition_penalty(0);
       },
       "params.sampling.repetition_penalty"},
      {"presence penalty 3",
       [](GenerateRequest* r) { r->mutable_params()->mutable_sampling()->set_presence_penalty(3); },
       "params.sampling.presence_penalty"},
      {"frequency penalty -3",
       [](GenerateRequest* r) {
         r->mutable_params()->mutable_sampling()->set_frequency_penalty(-3);
       },
       "params.sampling.frequency_penalty"},
      {"top_logprobs 21", [](GenerateRequest* r) { r->mutable_params()->set_top_logprobs(21); },
       "params.top_logprobs"},
      {"top_logprobs -1", [](GenerateRequest* r) { r->mutable_params()->set_top_logprobs(-1); },
       "params.top_logprobs"},
      {"empty stop string", [](GenerateRequest* r) { r->mutable_params()->add_stop(""); },
       "params.stop[0]"},
      {"empty conversation", [](GenerateRequest* r) { r->clear_messages(); }, "messages"},
      {"unknown role", [](GenerateRequest* r) { r->mutable_messages(0)->set_role("robot"); },
       "messages[0].role"},
      {"unsupported schema keyword",
       [](GenerateRequest* r) { r->mutable_params()->set_json_schema(R"({"not": {}})"); },
       "params.json_schema"},
      {"schema that is not JSON",
       [](GenerateRequest* r) { r->mutable_params()->set_json_schema("{"); }, "params.json_schema"},
      {"regex with a backreference",
       [](GenerateRequest* r) { r->mutable_params()->set_regex("(a)\\1"); }, "params.regex"},
      {"shortest output longer than max_tokens",
       [](GenerateRequest* r) {
         r->mutable_params()->set_max_tokens(3);
         r->mutable_params()->set_json_schema(R"({"const": "longer than three"})");
       },
       "params.json_schema"},
      {"named tool that is not among tools",
       [](GenerateRequest* r) {
         r->add_tools()->set_name("f");
         r->mutable_tool_choice()->set_mode(vlm::v1::TOOL_CHOICE_FUNCTION);
         r->mutable_tool_choice()->set_function("g");
       },
       "tool_choice.function"},
      {"tool with a bad schema",
       [](GenerateRequest* r) {
         vlm::v1::Tool* t = r->add_tools();
         t->set_name("f");
         t->set_parameters(R"({"type": "nope"})");
         r->mutable_tool_choice()->set_mode(vlm::v1::TOOL_CHOICE_REQUIRED);
       },
       "tools[0].parameters"},
      {"empty part",
       [](GenerateRequest* r) { r->mutable_messages(0)->add_content(); },
       "messages[0].content[1]"},
      {"invalid UTF-8",
       [](GenerateRequest* r) {
         r->mutable_messages(0)->mutable_content(0)->set_text("bad \xC3\x28 text");
       },
       "messages[0].content[0].text"},
  };
  for (const Case& c : cases) {
    GenerateRequest request = TextRequest("Describe the image.", 4);
    c.mutate(&request);
    Streamed r = Generate(*stub_, request, absl::Seconds(30));
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.name << ": " << r.status.error_message();
    EXPECT_TRUE(absl::StrContains(r.status.error_message(), c.field))
        << c.name << ": \"" << r.status.error_message() << "\" does not name " << c.field;
    EXPECT_TRUE(r.responses.empty()) << c.name;
  }
  // Still serving.
  Streamed ok = Generate(*stub_, TextRequest("Hello", 2));
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.ids.size(), 2u);
}

// Starts a long generation on its own thread; it holds the only slot.
class LongGeneration {
 public:
  LongGeneration(v1::Language::Stub* stub, int max_tokens) {
    thread_ = std::thread([this, stub, max_tokens] {
      result_ = Generate(*stub, TextRequest("Tell me a long story.", max_tokens),
                         absl::Seconds(120), &ctx_, [this](const GenerateResponse&) {
                           absl::MutexLock lock(&mu_);
                           ++received_;
                         });
      absl::MutexLock lock(&mu_);
      done_ = true;
    });
  }
  ~LongGeneration() {
    ctx_.TryCancel();
    if (thread_.joinable()) thread_.join();
  }
  bool WaitStarted() {
    return Eventually(
        [&] {
          absl::MutexLock lock(&mu_);
          return received_ > 0;
        },
        absl::Seconds(30));
  }
  Streamed Cancel() {
    ctx_.TryCancel();
    if (thread_.joinable()) thread_.join();
    return result_;
  }
  bool done() {
    absl::MutexLock lock(&mu_);
    return done_;
  }

 private:
  grpc::ClientContext ctx_;
  std::thread thread_;
  Streamed result_;
  absl::Mutex mu_;
  int received_ = 0;
  bool done_ = false;
};

TEST_F(LanguageServiceTest, FullSlotsAndQueueAnswerResourceExhaustedAndCancelFreesTheSlot) {
  auto long_one = std::make_unique<LongGeneration>(stub_.get(), 1000);
  ASSERT_TRUE(long_one->WaitStarted());
  // The queue's one place.
  Streamed queued;
  std::thread waiter([&] { queued = Generate(*stub_, TextRequest("Hi", 2), absl::Seconds(60)); });
  absl::SleepFor(absl::Milliseconds(300));
  // Slot and queue are full.
  Streamed rejected = Generate(*stub_, TextRequest("Hi", 2));
  EXPECT_EQ(rejected.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << rejected.status.error_message();
  EXPECT_FALSE(long_one->done()) << "the long generation finished too early for this test";

  // Cancelling the running call frees its slot for the queued one.
  const absl::Time cancel_at = absl::Now();
  Streamed cancelled = long_one->Cancel();
  EXPECT_EQ(cancelled.status.error_code(), grpc::StatusCode::CANCELLED);
  waiter.join();
  EXPECT_TRUE(queued.status.ok()) << queued.status.error_message();
  EXPECT_EQ(queued.ids.size(), 2u);
  EXPECT_LT(absl::Now() - cancel_at, absl::Seconds(10));
  EXPECT_LT(queued.last.timings().queue_ms(), 60000);
  EXPECT_GT(queued.last.timings().queue_ms(), 100);
}

TEST_F(LanguageServiceTest, DeadlinesAreHonouredWhileDecodingAndWhileQueued) {
  const absl::Time start = absl::Now();
  Streamed late = Generate(*stub_, TextRequest("Tell me a long story.", 1000),
                           absl::Milliseconds(400));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // The server stopped it too: the slot is free at once.
  Streamed next = Generate(*stub_, TextRequest("Hi", 2));
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_LT(next.last.timings().queue_ms(), 2000);

  auto long_one = std::make_unique<LongGeneration>(stub_.get(), 1000);
  ASSERT_TRUE(long_one->WaitStarted());
  const absl::Time queued_at = absl::Now();
  Streamed queued = Generate(*stub_, TextRequest("Hi", 2), absl::Milliseconds(300));
  EXPECT_EQ(queued.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_LT(absl::Now() - queued_at, absl::Seconds(3));
  long_one->Cancel();

  // The server notices the cancel at its next decode step and the expired
  // waiter at its next poll; then the slot and the queue are free again.
  Streamed ok;
  EXPECT_TRUE(Eventually(
      [&] {
        ok = Generate(*stub_, TextRequest("Hi", 2));
        return ok.status.ok();
      },
      absl::Seconds(5)))
      << ok.status.error_message();
}

TEST_F(LanguageServiceTest, MetricsCountTokensAndExposeQueueState) {
  Streamed r = Generate(*stub_, TextRequest("Hello", 3));
  ASSERT_TRUE(r.status.ok());
  httplib::Client http("127.0.0.1", server_->metrics_port);
  auto res = http.Get("/metrics");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  const std::string& body = res->body;
  for (const char* name :
       {"vlm_language_time_to_first_token_seconds_count", "vlm_language_inter_token_latency_seconds_count",
        "vlm_language_prompt_tokens_total", "vlm_language_generated_tokens_total",
        "vlm_language_queue_depth", "vlm_language_sequences_running",
        "vlm_language_generations_total{finish_reason=\"length\"}",
        "vlm_process_resident_memory_bytes"}) {
    EXPECT_TRUE(absl::StrContains(body, name)) << name;
  }
  std::smatch m;
  static const std::regex kGenerated(R"(vlm_language_generated_tokens_total (\d+))");
  ASSERT_TRUE(std::regex_search(body, m, kGenerated));
  EXPECT_GE(std::stoi(m[1]), 3);
  EXPECT_TRUE(absl::StrContains(body, "vlm_language_sequences_running 0"));
}

// The serving engine through the wire: a KV budget smaller than the context,
// several sequences per batch, the prefix cache.
class LanguageEngineServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Tiny model in bf16: 1 KiB of KV per token, so 1 MiB holds 1024 tokens.
    server_ = StartLanguage("engine", {"--max_sequences=4", "--max_queue=8", "--max_context=4096",
                                       "--kv_cache_mb=1", "--kv_block_size=16",
                                       "--max_batch_tokens=128"});
    ASSERT_TRUE(server_->WaitListening(absl::Seconds(30))) << server_->LogTail();
    channel_ = new std::shared_ptr<grpc::Channel>(
        grpc::CreateChannel(server_->grpc_target(), grpc::InsecureChannelCredentials()));
    ASSERT_TRUE(server_->WaitServing(kService, absl::Seconds(60))) << server_->LogTail();
  }
  static void TearDownTestSuite() {
    delete channel_;
    server_.reset();
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    stub_ = v1::Language::NewStub(*channel_);
  }
  void TearDown() override {
    EXPECT_TRUE(server_->Alive()) << "vlm-language died\n" << server_->LogTail();
  }
  std::string Metrics() {
    httplib::Client http("127.0.0.1", server_->metrics_port);
    auto res = http.Get("/metrics");
    return res && res->status == 200 ? res->body : "";
  }
  static inline std::unique_ptr<ServiceProcess> server_;
  static std::shared_ptr<grpc::Channel>* channel_;
  std::unique_ptr<v1::Language::Stub> stub_;
};
std::shared_ptr<grpc::Channel>* LanguageEngineServiceTest::channel_ = nullptr;

TEST_F(LanguageEngineServiceTest, PromptThatCannotFitTheKvBudgetAloneIsResourceExhausted) {
  Streamed big = Generate(*stub_, TextRequest("Tell me everything.", 2000));
  EXPECT_EQ(big.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(big.status.error_message(), "--kv_cache_mb"))
      << big.status.error_message();
  // Nothing else is affected.
  Streamed ok = Generate(*stub_, TextRequest("Hi", 3));
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.ids.size(), 3u);
}

TEST_F(LanguageEngineServiceTest, RepeatedImageConversationReusesTheCachedPrefix) {
  GenerateRequest request = TextRequest("Describe this picture in detail, please.", 6);
  AddImage(&request, 8, 8, 7);
  Streamed cold = Generate(*stub_, request);
  ASSERT_TRUE(cold.status.ok()) << cold.status.error_message();
  const int prompt = cold.last.usage().prompt_tokens();
  // The same conversation with a follow-up question appended.
  v1::LanguageMessage* answer = request.add_messages();
  answer->set_role("assistant");
  answer->add_content()->set_text(cold.text);
  v1::LanguageMessage* follow = request.add_messages();
  follow->set_role("user");
  follow->add_content()->set_text("And the colours?");
  Streamed hit = Generate(*stub_, request);
  ASSERT_TRUE(hit.status.ok()) << hit.status.error_message();
  EXPECT_GE(hit.last.usage().cached_prompt_tokens(), (prompt - 1) / 16 * 16 - 16)
      << "the first turn's prompt (image included) was reused";
  EXPECT_LT(hit.last.usage().cached_prompt_tokens(), hit.last.usage().prompt_tokens());
  // Exactly the same request again: everything but the last token is reused,
  // and the answer is the cold one.
  Streamed again = Generate(*stub_, request);
  ASSERT_TRUE(again.status.ok());
  EXPECT_EQ(again.ids, hit.ids);
  EXPECT_EQ(again.last.usage().cached_prompt_tokens(),
            (again.last.usage().prompt_tokens() - 1) / 16 * 16);
  const std::string metrics = Metrics();
  for (const char* name :
       {"vlm_language_prefix_cache_hit_tokens_total", "vlm_language_prefix_cache_miss_tokens_total",
        "vlm_language_kv_blocks{state=\"cached\"}", "vlm_language_kv_cache_budget_bytes",
        "vlm_language_batch_tokens_count", "vlm_language_batch_sequences_count",
        "vlm_language_preemptions_total", "vlm_language_iteration_seconds_count"}) {
    EXPECT_TRUE(absl::StrContains(metrics, name)) << name;
  }
}

TEST_F(LanguageEngineServiceTest, ConcurrentStreamsAnswerAsTheyDoAlone) {
  std::vector<GenerateRequest> requests;
  for (int i = 0; i < 4; ++i) {
    requests.push_back(TextRequest(absl::StrCat("Story number ", i, " begins with"), 10 + 5 * i));
  }
  std::vector<Streamed> alone;
  for (const auto& r : requests) alone.push_back(Generate(*stub_, r));
  std::vector<Streamed> together(requests.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back([&, i] { together[i] = Generate(*stub_, requests[i]); });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(together[i].status.ok()) << together[i].status.error_message();
    EXPECT_EQ(together[i].ids, alone[i].ids) << "request " << i;
    EXPECT_EQ(together[i].text, alone[i].text) << "request " << i;
  }
}

}  // namespace
}  // namespace vlm
