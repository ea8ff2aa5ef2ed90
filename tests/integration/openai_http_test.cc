// The gateway's OpenAI-compatible HTTP front end with the real processes on
// loopback (vlm-vision, vlm-language, vlm-gateway on the tiny checkpoint):
// response shapes, SSE framing as curl sees it, answers equal to gRPC's,
// images as data URLs and the cache, logprobs, every bad input's precise 4xx,
// API keys on HTTP and gRPC, admission refusals (429 + Retry-After), not-ready
// (503), and a client disconnect (streamed or not) that frees the language slot.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/integration/service_process.h"
#include "tests/integration/test_png.h"
#include "tests/unit/metrics_text.h"
#include "vlm/v1/gateway.grpc.pb.h"

namespace vlm {
namespace {

using json = nlohmann::json;
using testing::ServiceProcess;

constexpr char kApiKey[] = "sk-test-0123456789";

std::string DataUrl(const std::string& png) { return "data:image/png;base64," + absl::Base64Escape(png); }

bool Eventually(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return condition();
}

using testing::ReadFile;

int HttpPort(const std::string& out_path) { return testing::GatewayHttpPort(ReadFile(out_path)); }

struct CurlResult {
  int exit_code = -1;
  std::string headers;
  std::string body;
};

// Runs curl with `args` (body to a file, headers to another); bounded by --max-time.
CurlResult Curl(const std::string& dir, const std::vector<std::string>& args) {
  static int n = 0;
  const std::string base = absl::StrCat(dir, "/curl", ++n);
  std::string command = absl::StrCat("curl -sS --max-time 60 -D ", base, ".h -o ", base, ".b");
  for (const std::string& a : args) absl::StrAppend(&command, " '", a, "'");
  CurlResult r;
  const int status = std::system(command.c_str());
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.headers = ReadFile(base + ".h");
  r.body = ReadFile(base + ".b");
  return r;
}

int HttpCode(const CurlResult& r) {
  // The last status line (after any 100 Continue).
  static const std::regex kStatus(R"(HTTP/1\.1 (\d{3}))");
  int code = 0;
  for (std::sregex_iterator it(r.headers.begin(), r.headers.end(), kStatus), end; it != end; ++it) {
    code = std::stoi((*it)[1]);
  }
  return code;
}

json ChatBody(const std::string& text, int max_tokens = 6) {
  return json{{"model", "tiny_checkpoint"},
              {"messages", json::array({{{"role", "user"}, {"content", text}}})},
              {"max_tokens", max_tokens},
              {"temperature", 0}};
}

class OpenAiHttpTest : public ::testing::Test {
 protected:
  static std::unique_ptr<ServiceProcess> StartGateway(const std::string& name,
                                                      std::vector<std::string> extra) {
    std::vector<std::string> flags = {
        "--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
        "--http_address=127.0.0.1:0", "--model_dir=" + model_dir_,
        "--language_target=" + language_->grpc_target(),
        "--vision_targets=" + vision_->grpc_target(), "--backend_reconnect_max_ms=200",
        "--drain_timeout_s=2"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    return std::make_unique<ServiceProcess>(VLM_GATEWAY_PATH, flags, log_dir_ + "/" + name);
  }

  static void SetUpTestSuite() {
    const char* binary_dir = std::getenv("VLM_BINARY_DIR");
    ASSERT_NE(binary_dir, nullptr) << "run through ctest (VLM_BINARY_DIR)";
    model_dir_ = std::string(binary_dir) + "/tiny_checkpoint";
    log_dir_ = std::string(binary_dir) + "/tests/openai_http_test_logs";
    std::system(("mkdir -p " + log_dir_).c_str());
    vision_ = std::make_unique<ServiceProcess>(
        VLM_VISION_PATH,
        std::vector<std::string>{"--model_dir=" + model_dir_, "--grpc_address=127.0.0.1:0",
                                 "--metrics_address=127.0.0.1:0", "--intra_op_threads=1",
                                 "--drain_timeout_s=2",
                                 // above the tiny checkpoint's 65536: photo-sized budgets
                                 "--max_pixels_limit=1048576"},
        log_dir_ + "/vision");
    language_ = std::make_unique<ServiceProcess>(
        VLM_LANGUAGE_PATH,
        std::vector<std::string>{"--model_dir=" + model_dir_, "--grpc_address=127.0.0.1:0",
                                 "--metrics_address=127.0.0.1:0", "--intra_op_threads=1",
                                 "--max_sequences=1", "--max_queue=8", "--drain_timeout_s=2"},
        log_dir_ + "/language");
    ASSERT_TRUE(vision_->WaitListening()) << vision_->LogTail();
    ASSERT_TRUE(language_->WaitListening()) << language_->LogTail();

    std::ofstream(log_dir_ + "/api_keys") << "# test keys\n\n  other-key  \n" << kApiKey << "\n";
    gateway_ = StartGateway("gateway", {});
    // One running request at most and no queue: the second gets 429.
    keyed_ = StartGateway("gateway-keys", {"--api_keys_file=" + log_dir_ + "/api_keys",
                                           "--max_inflight=1", "--max_queue=0"});
    for (auto* g : {&gateway_, &keyed_}) {
      ASSERT_TRUE((*g)->WaitListening()) << (*g)->LogTail();
    }
    ASSERT_TRUE(Eventually([] { return HttpPort(log_dir_ + "/gateway.out") > 0; }, absl::Seconds(5)));
    ASSERT_TRUE(
        Eventually([] { return HttpPort(log_dir_ + "/gateway-keys.out") > 0; }, absl::Seconds(5)));
    http_port_ = HttpPort(log_dir_ + "/gateway.out");
    keyed_port_ = HttpPort(log_dir_ + "/gateway-keys.out");
    ASSERT_TRUE(Eventually(
        [] {
          httplib::Client c("127.0.0.1", http_port_);
          auto a = c.Get("/health");
          httplib::Client k("127.0.0.1", keyed_port_);
          auto b = k.Get("/health");
          return a && a->status == 200 && b && b->status == 200;
        },
        absl::Seconds(60)))
        << gateway_->LogTail();
  }

  static void TearDownTestSuite() {
    for (auto* p : {&gateway_, &keyed_, &vision_, &language_}) {
      if (*p == nullptr) continue;
      std::optional<int> code = (*p)->Stop(SIGTERM, absl::Seconds(20));
      EXPECT_EQ(code, std::optional<int>(0)) << (*p)->LogTail();
      p->reset();
    }
  }

  void TearDown() override {
    if (HasFailure()) {
      for (auto* p : {&gateway_, &keyed_, &vision_, &language_}) {
        if (*p != nullptr) std::fprintf(stderr, "--- log tail ---\n%s", (*p)->LogTail(15).c_str());
      }
    }
  }

  static std::string Url(const std::string& path, int port = 0) {
    return absl::StrCat("http://127.0.0.1:", port == 0 ? http_port_ : port, path);
  }

  static httplib::Result Post(const json& body, int port = 0,
                              const std::string& authorization = "") {
    httplib::Client client("127.0.0.1", port == 0 ? http_port_ : port);
    client.set_read_timeout(60, 0);
    httplib::Headers headers;
    if (!authorization.empty()) headers.emplace("Authorization", authorization);
    return client.Post("/v1/chat/completions", headers, body.dump(), "application/json");
  }

  static double Metric(int port, const std::string& key) {
    httplib::Client client("127.0.0.1", port);
    auto res = client.Get("/metrics");
    return res && res->status == 200 ? metrics_text::MetricValue(res->body, key).value_or(0) : -1;
  }

  static inline std::string model_dir_;
  static inline std::string log_dir_;
  static inline std::unique_ptr<ServiceProcess> vision_;
  static inline std::unique_ptr<ServiceProcess> language_;
  static inline std::unique_ptr<ServiceProcess> gateway_;
  static inline std::unique_ptr<ServiceProcess> keyed_;
  static inline int http_port_ = 0;
  static inline int keyed_port_ = 0;
};

TEST_F(OpenAiHttpTest, HealthModelsAndPageAreServed) {
  httplib::Client client("127.0.0.1", http_port_);
  auto health = client.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(json::parse(health->body)["status"], "SERVING");

  auto models = client.Get("/v1/models");
  ASSERT_TRUE(models);
  ASSERT_EQ(models->status, 200);
  const json m = json::parse(models->body);
  EXPECT_EQ(m["object"], "list");
  ASSERT_EQ(m["data"].size(), 1u);
  EXPECT_EQ(m["data"][0]["id"], "tiny_checkpoint");  // the checkpoint directory's name
  EXPECT_EQ(m["data"][0]["object"], "model");

  auto page = client.Get("/");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_TRUE(absl::StartsWith(page->get_header_value("Content-Type"), "text/html"));
  EXPECT_TRUE(absl::StrContains(page->body, "<script src=\"/app.js\">"));
  auto script = client.Get("/app.js");
  ASSERT_TRUE(script);
  EXPECT_EQ(script->status, 200);
  EXPECT_TRUE(absl::StartsWith(script->get_header_value("Content-Type"), "text/javascript"));
  EXPECT_TRUE(absl::StrContains(script->body, "/v1/chat/completions"));
}

TEST_F(OpenAiHttpTest, NonStreamingCompletionHasOpenAiShapeAndMatchesGrpc) {
  auto res = Post(ChatBody("Describe a sunny day.", 5));
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_TRUE(absl::StartsWith(res->get_header_value("Content-Type"), "application/json"));
  const json c = json::parse(res->body);
  EXPECT_TRUE(absl::StartsWith(c["id"].get<std::string>(), "chatcmpl-"));
  EXPECT_EQ(c["object"], "chat.completion");
  EXPECT_TRUE(c["created"].is_number_integer());
  EXPECT_EQ(c["model"], "tiny_checkpoint");
  ASSERT_EQ(c["choices"].size(), 1u);
  const json& choice = c["choices"][0];
  EXPECT_EQ(choice["index"], 0);
  EXPECT_EQ(choice["message"]["role"], "assistant");
  EXPECT_TRUE(choice["logprobs"].is_null());
  EXPECT_EQ(choice["finish_reason"], "length");  // random weights never say EOS within 5
  const json& usage = c["usage"];
  EXPECT_EQ(usage["completion_tokens"], 5);
  EXPECT_EQ(usage["total_tokens"].get<int>(),
            usage["prompt_tokens"].get<int>() + usage["completion_tokens"].get<int>());
  EXPECT_TRUE(usage["prompt_tokens_details"]["cached_tokens"].is_number_integer());

  // The same request through gRPC gives the same greedy answer (one pipeline).
  auto stub = v1::VisionLanguage::NewStub(
      grpc::CreateChannel(gateway_->grpc_target(), grpc::InsecureChannelCredentials()));
  v1::ChatRequest request;
  auto* m = request.add_messages();
  m->set_role("user");
  m->add_content()->set_text("Describe a sunny day.");
  request.mutable_params()->set_max_tokens(5);
  request.mutable_params()->mutable_sampling()->set_temperature(0);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::ChatResponse grpc_response;
  ASSERT_TRUE(stub->Chat(&ctx, request, &grpc_response).ok());
  EXPECT_EQ(choice["message"]["content"], grpc_response.text());
  EXPECT_EQ(usage["prompt_tokens"], grpc_response.usage().prompt_tokens());
}

TEST_F(OpenAiHttpTest, CurlSeesSseFramingRoleDeltasFinishUsageAndDone) {
  json body = ChatBody("Tell me about rivers.", 6);
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  const CurlResult r = Curl(log_dir_, {"-N", "-H", "Content-Type: application/json", "-d",
                                       body.dump(), Url("/v1/chat/completions")});
  ASSERT_EQ(r.exit_code, 0) << r.headers;
  EXPECT_EQ(HttpCode(r), 200);
  EXPECT_TRUE(absl::StrContains(r.headers, "Content-Type: text/event-stream")) << r.headers;
  EXPECT_TRUE(absl::StrContains(r.headers, "Transfer-Encoding: chunked")) << r.headers;

  // Every event is exactly "data: <payload>\n\n"; the last payload is [DONE].
  ASSERT_TRUE(absl::EndsWith(r.body, "data: [DONE]\n\n")) << r.body;
  std::vector<std::string> events = absl::StrSplit(r.body, "\n\n", absl::SkipEmpty());
  ASSERT_GE(events.size(), 4u) << r.body;
  std::vector<json> chunks;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    ASSERT_TRUE(absl::StartsWith(events[i], "data: ")) << events[i];
    ASSERT_EQ(events[i].find('\n'), std::string::npos) << "one line per event: " << events[i];
    chunks.push_back(json::parse(events[i].substr(6)));
  }
  const std::string id = chunks[0]["id"];
  EXPECT_TRUE(absl::StartsWith(id, "chatcmpl-"));
  for (const json& c : chunks) {
    EXPECT_EQ(c["id"], id);
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    EXPECT_EQ(c["model"], "tiny_checkpoint");
    EXPECT_EQ(c["created"], chunks[0]["created"]);
    EXPECT_TRUE(c.contains("usage"));  // null on all but the last (include_usage)
  }
  EXPECT_EQ(chunks[0]["choices"][0]["delta"]["role"], "assistant");
  std::string text;
  for (size_t i = 1; i + 2 < chunks.size(); ++i) {
    EXPECT_TRUE(chunks[i]["choices"][0]["finish_reason"].is_null());
    EXPECT_TRUE(chunks[i]["usage"].is_null());
    text += chunks[i]["choices"][0]["delta"]["content"].get<std::string>();
  }
  const json& finish = chunks[chunks.size() - 2];
  EXPECT_EQ(finish["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(finish["choices"][0]["delta"].empty());
  EXPECT_GT(finish["x_vlm"]["timings_ms"]["total"].get<double>(), 0);
  const json& usage_chunk = chunks.back();
  EXPECT_TRUE(usage_chunk["choices"].empty());
  EXPECT_EQ(usage_chunk["usage"]["completion_tokens"], 6);

  // The streamed text is the non-streamed answer.
  auto res = Post(ChatBody("Tell me about rivers.", 6));
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  EXPECT_EQ(text, json::parse(res->body)["choices"][0]["message"]["content"]);
}

// n > 1: n choices of one prompt, the 2nd..nth prefilled from the prefix cache,
// usage counting the prompt once; with a seed each choice is reproducible and
// choice 0 is the n = 1 answer; streamed chunks name their choice.
TEST_F(OpenAiHttpTest, NChoicesShareThePromptAndStreamWithTheirIndex) {
  const std::string prompt =
      "Write three different short titles for a story about a lighthouse keeper who finds a "
      "message in a bottle on a stormy winter night, and explain each one briefly.";
  constexpr int kTokens = 12;
  json body = ChatBody(prompt, kTokens);
  // The whole distribution (no top_k/top_p cut) and no early EOS: the tiny
  // checkpoint's random weights are sharply peaked, so only this lets seeds matter.
  body["temperature"] = 2.0;
  body["top_p"] = 1.0;
  body["top_k"] = 0;
  body["ignore_eos"] = true;
  body["seed"] = 1234;
  body["n"] = 3;
  auto res = Post(body);
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json c = json::parse(res->body);
  ASSERT_EQ(c["choices"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(c["choices"][i]["index"], i);
    EXPECT_EQ(c["choices"][i]["finish_reason"], "length");
  }
  const int prompt_tokens = c["usage"]["prompt_tokens"];
  EXPECT_GT(prompt_tokens, 32);
  EXPECT_EQ(c["usage"]["completion_tokens"], 3 * kTokens);  // summed over the choices
  EXPECT_EQ(c["usage"]["total_tokens"], prompt_tokens + 3 * kTokens);
  // The 2nd and 3rd prompt came from the prefix cache (all but the last partial block).
  ASSERT_EQ(c["x_vlm"]["choice_usage"].size(), 3u);
  for (int i = 1; i < 3; ++i) {
    const json& u = c["x_vlm"]["choice_usage"][i];
    EXPECT_EQ(u["prompt_tokens"], prompt_tokens);
    EXPECT_EQ(u["completion_tokens"], kTokens);
    EXPECT_GE(u["prompt_tokens_details"]["cached_tokens"].get<int>(), prompt_tokens - 32) << u;
  }
  // Each choice has its own seed (choice 0 the request's, choice i
  // SplitMix64(seed + i * golden ratio)): the choices are not all alike, and
  // each is the n = 1 answer at its seed.
  std::set<std::string> distinct;
  for (const json& choice : c["choices"]) distinct.insert(choice["message"]["content"].get<std::string>());
  EXPECT_GE(distinct.size(), 2u) << res->body;
  auto again = Post(body);
  ASSERT_TRUE(again);
  ASSERT_EQ(again->status, 200);
  EXPECT_EQ(json::parse(again->body)["choices"], c["choices"]);
  for (int i = 0; i < 3; ++i) {
    uint64_t seed = 1234;
    if (i > 0) {
      uint64_t z = seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      seed = z ^ (z >> 31);
    }
    json one = body;
    one.erase("n");
    one["seed"] = static_cast<int64_t>(seed);  // the same 64 bits (the API reads int64)
    auto single = Post(one);
    ASSERT_TRUE(single);
    ASSERT_EQ(single->status, 200) << single->body;
    EXPECT_EQ(json::parse(single->body)["choices"][0]["message"]["content"],
              c["choices"][i]["message"]["content"])
        << "choice " << i;
  }

  // Streamed: every choice opens with its role chunk, its deltas add up to the
  // non-streamed text, it ends with its own finish chunk; one usage chunk last.
  json stream = body;
  stream["stream"] = true;
  stream["stream_options"] = {{"include_usage", true}};
  const CurlResult r = Curl(log_dir_, {"-N", "-H", "Content-Type: application/json", "-d",
                                       stream.dump(), Url("/v1/chat/completions")});
  ASSERT_EQ(r.exit_code, 0) << r.headers;
  ASSERT_EQ(HttpCode(r), 200) << r.body;
  ASSERT_TRUE(absl::EndsWith(r.body, "data: [DONE]\n\n")) << r.body;
  std::vector<std::string> events = absl::StrSplit(r.body, "\n\n", absl::SkipEmpty());
  std::map<int, std::string> text;
  std::map<int, int> roles, finishes;
  int usage_chunks = 0;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json chunk = json::parse(events[i].substr(6));
    if (chunk["choices"].empty()) {
      ++usage_chunks;
      EXPECT_EQ(chunk["usage"]["completion_tokens"], 3 * kTokens);
      EXPECT_EQ(chunk["usage"]["prompt_tokens"], prompt_tokens);
      continue;
    }
    const int index = chunk["choices"][0]["index"];
    const json& delta = chunk["choices"][0]["delta"];
    if (delta.contains("role")) {
      EXPECT_EQ(text[index], "") << "role chunk first";
      ++roles[index];
    }
    if (delta.contains("content")) text[index] += delta["content"].get<std::string>();
    if (chunk["choices"][0]["finish_reason"].is_string()) ++finishes[index];
  }
  EXPECT_EQ(usage_chunks, 1);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(roles[i], 1) << i;
    EXPECT_EQ(finishes[i], 1) << i;
    EXPECT_EQ(text[i], c["choices"][i]["message"]["content"]) << i;
  }

  // More than --max_n (8): a 400 naming n.
  json too_many = body;
  too_many["n"] = 9;
  auto refused = Post(too_many);
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 400);
  EXPECT_EQ(json::parse(refused->body)["error"]["param"], "n") << refused->body;
}

TEST_F(OpenAiHttpTest, ImageDataUrlIsEncodedOnceThenServedFromTheCache) {
  const std::string png = testing::PatternPng(96, 64, 7);
  json body = ChatBody("", 3);
  body["messages"][0]["content"] = json::array(
      {{{"type", "image_url"}, {"image_url", {{"url", DataUrl(png)}, {"detail", "high"}}}},
       {{"type", "text"}, {"text", "What is in this picture?"}}});
  json first, second;
  for (json* out : {&first, &second}) {
    auto res = Post(body);
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    *out = json::parse(res->body);
  }
  const json& image1 = first["x_vlm"]["images"][0];
  const json& image2 = second["x_vlm"]["images"][0];
  EXPECT_EQ(image1["tokens"], 6);  // 96x64 -> 4x6 patches -> 6 merged tokens
  EXPECT_EQ(first["x_vlm"]["image_tokens"], 6);
  EXPECT_EQ(image2["content_hash"], image1["content_hash"]);
  EXPECT_TRUE(image2["cache_hit"].get<bool>()) << second.dump();
  EXPECT_GT(first["usage"]["prompt_tokens"].get<int>(), 6);
}

// A 12-megapixel phone photo (4000x3000 JPEG), made by Pillow at test time;
// "" if Pillow is missing.
std::string PhonePhotoJpeg(const std::string& dir) {
  const std::string path = dir + "/photo_4000x3000.jpg";
  const std::string script =
      "import sys\n"
      "from PIL import Image\n"
      "g = Image.radial_gradient('L').resize((4000, 3000))\n"
      "Image.merge('RGB', (g, g.transpose(Image.FLIP_LEFT_RIGHT), g.rotate(90))).save("
      "sys.argv[1], quality=85)\n";
  std::ofstream(dir + "/make_photo.py") << script;
  if (std::system(("/usr/bin/python3 " + dir + "/make_photo.py " + path).c_str()) != 0) return "";
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

json PhotoBody(const std::string& jpeg, const char* detail) {
  json url = {{"url", "data:image/jpeg;base64," + absl::Base64Escape(jpeg)}};
  if (detail != nullptr) url["detail"] = detail;
  json body = ChatBody("", 2);
  body["messages"][0]["content"] = json::array(
      {{{"type", "image_url"}, {"image_url", url}}, {{"type", "text"}, {"text", "What is it?"}}});
  return body;
}

// The photo as a new user sends it: no options. It is resized to the server's
// default budget (0.5 MP: 608x832, 38x52 patches), never refused for size;
// detail "low" gives 512x512's budget.
TEST_F(OpenAiHttpTest, PhonePhotoIsResizedToTheBudgetNotRefused) {
  const std::string jpeg = PhonePhotoJpeg(log_dir_);
  ASSERT_FALSE(jpeg.empty()) << "Pillow (python3-pil) could not write the photo";
  struct Case {
    const char* detail;
    json grid;
    int64_t max_pixels;
  };
  // smart_resize(3000, 4000, 32, 65536, 524288): beta = 4.784, floor(3000 / 4.784 / 32) * 32
  // = 608, floor(4000 / 4.784 / 32) * 32 = 832; with 262144: floor(3000 / 6.77 / 32) * 32 = 416, floor(4000 / 6.77 / 32) * 32 = 576.
  for (const Case& c : {Case{nullptr, json::array({1, 38, 52}), 524288},
                        Case{"auto", json::array({1, 38, 52}), 524288},
                        Case{"low", json::array({1, 26, 36}), 262144}}) {
    auto res = Post(PhotoBody(jpeg, c.detail));
    ASSERT_TRUE(res);
    ASSERT_EQ(res->status, 200) << res->body;
    const json out = json::parse(res->body);
    const json& image = out["x_vlm"]["images"][0];
    EXPECT_EQ(image["grid"], c.grid) << out.dump();
    EXPECT_EQ(image["max_pixels"], c.max_pixels) << out.dump();
    EXPECT_EQ(image["tokens"], c.grid[1].get<int>() * c.grid[2].get<int>() / 4);
  }
}

TEST_F(OpenAiHttpTest, LogprobsComeInOpenAiShape) {
  json body = ChatBody("Count to three.", 4);
  body["logprobs"] = true;
  body["top_logprobs"] = 3;
  auto res = Post(body);
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json c = json::parse(res->body);
  const json& content = c["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 4u);
  std::string joined;
  for (const json& t : content) {
    EXPECT_LE(t["logprob"].get<double>(), 0);
    ASSERT_EQ(t["top_logprobs"].size(), 3u);
    // The chosen token under greedy sampling is the most likely one.
    EXPECT_EQ(t["top_logprobs"][0]["logprob"], t["logprob"]);
    const std::string token = t["token"];
    ASSERT_EQ(t["bytes"].size(), token.size());
    joined += token;
  }
  EXPECT_EQ(joined, c["choices"][0]["message"]["content"]);
}

TEST_F(OpenAiHttpTest, BadInputGetsItsPrecise4xxAndTheGatewayKeepsServing) {
  const std::string big = std::string(50 << 20, 'a');  // 50 MB
  std::ofstream(log_dir_ + "/big.json") << "{\"messages\": \"" << big << "\"}";
  std::ofstream(log_dir_ + "/deep.json") << std::string(1 << 20, '[') << std::string(1 << 20, ']');
  struct Case {
    std::string name;
    std::string body;  // "@file" for a file
    int status;
    std::string param;  // "" = null
    std::string message_part;
  };
  auto with_image_url = [](const std::string& url) {
    json b = ChatBody("", 3);
    b["messages"][0]["content"] =
        json::array({{{"type", "image_url"}, {"image_url", {{"url", url}}}}});
    return b.dump();
  };
  json wrong_type = ChatBody("hi");
  wrong_type["temperature"] = "hot";
  json wrong_max = ChatBody("hi");
  wrong_max["max_tokens"] = "ten";
  json unknown_role = ChatBody("hi");
  unknown_role["messages"][0]["role"] = "wizard";
  json tool_role = ChatBody("hi");
  tool_role["messages"][0]["role"] = "tool";
  json out_of_range = ChatBody("hi");
  out_of_range["top_p"] = 1.5;
  json other_model = ChatBody("hi");
  other_model["model"] = "gpt-4o";
  const std::vector<Case> cases = {
      {"malformed JSON", "{\"messages\": [", 400, "", "not valid JSON"},
      {"not an object", "[1, 2]", 400, "", "JSON object"},
      {"nested a million deep", "@" + log_dir_ + "/deep.json", 400, "", "deeper than 32"},
      {"messages wrong type", R"({"messages": "hello"})", 400, "messages", "must be an array"},
      {"temperature wrong type", wrong_type.dump(), 400, "temperature", "must be a number"},
      {"max_tokens wrong type", wrong_max.dump(), 400, "max_tokens", "must be an integer"},
      {"unknown role", unknown_role.dump(), 400, "messages[0].role", "wizard"},
      {"tool role without tool_call_id", tool_role.dump(), 400, "messages[0].tool_call_id",
       "must be a string"},
      {"top_p out of range", out_of_range.dump(), 400, "top_p", "top_p is 1.5"},
      {"50 MB body", "@" + log_dir_ + "/big.json", 413, "", "larger than"},
      {"bad base64", with_image_url("data:image/png;base64,!!notbase64!!"), 400,
       "messages[0].content[0].image_url.url", "not valid base64"},
      {"non-image data URL", with_image_url("data:text/plain;base64,aGVsbG8="), 400,
       "messages[0].content[0].image_url.url", "text/plain"},
      {"bytes that are no image", with_image_url("data:image/png;base64,aGVsbG8="), 400,
       "messages[0].content[0].image_url.url", "image 1"},
      {"http image URL", with_image_url("http://127.0.0.1:1/cat.png"), 400,
       "messages[0].content[0].image_url.url", "allow_remote_images"},
      {"another model", other_model.dump(), 404, "model", "gpt-4o"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string data = absl::StartsWith(c.body, "@") ? c.body : c.body;
    const CurlResult r = Curl(log_dir_, {"-H", "Content-Type: application/json",
                                         "--data-binary", data, Url("/v1/chat/completions")});
    EXPECT_EQ(HttpCode(r), c.status) << r.headers << r.body;
    json error;
    ASSERT_NO_THROW(error = json::parse(r.body)) << r.body;
    ASSERT_TRUE(error.contains("error")) << r.body;
    const json& e = error["error"];
    EXPECT_TRUE(absl::StrContains(e["message"].get<std::string>(), c.message_part)) << r.body;
    EXPECT_EQ(e["type"], c.status == 404 ? "not_found_error" : "invalid_request_error");
    if (c.param.empty()) {
      EXPECT_TRUE(e["param"].is_null()) << r.body;
    } else {
      EXPECT_EQ(e["param"], c.param) << r.body;
    }
    EXPECT_TRUE(e.contains("code"));
    // Still serving after each one.
    auto ok = Post(ChatBody("still there?", 2));
    ASSERT_TRUE(ok);
    EXPECT_EQ(ok->status, 200) << ok->body;
  }
  httplib::Client client("127.0.0.1", http_port_);
  auto missing = client.Get("/v1/nothing");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(json::parse(missing->body)["error"]["type"], "not_found_error");
  EXPECT_GE(Metric(gateway_->metrics_port,
                   R"(vlm_gateway_http_requests_total{route="/v1/chat/completions",status="413"})"),
            1);
}

TEST_F(OpenAiHttpTest, ClientDisconnectCancelsTheGenerationAndFreesTheSlot) {
  // 8192 tokens take the tiny model well over 10 s: only a cancellation ends it in time.
  json body = ChatBody("Tell me a very long story.", 8192);
  body["ignore_eos"] = true;
  body["stream"] = true;
  const std::string out = log_dir_ + "/disconnect.sse";
  std::remove(out.c_str());
  const pid_t curl = ::fork();
  if (curl == 0) {
    ::execlp("curl", "curl", "-sN", "--max-time", "120", "-o", out.c_str(), "-H",
             "Content-Type: application/json", "-d", body.dump().c_str(),
             Url("/v1/chat/completions").c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_GT(curl, 0);
  // Tokens are flowing: the stream is open and the language slot is taken.
  ASSERT_TRUE(Eventually([&] { return ReadFile(out).size() > 2000; }, absl::Seconds(30)))
      << "no streamed data; " << ReadFile(out);
  EXPECT_EQ(Metric(gateway_->metrics_port, "vlm_gateway_http_sse_streams_open"), 1);
  EXPECT_EQ(Metric(gateway_->metrics_port, "vlm_gateway_admission_running"), 1);
  EXPECT_EQ(Metric(language_->metrics_port, "vlm_language_sequences_running"), 1);

  ::kill(curl, SIGKILL);
  int status = 0;
  ::waitpid(curl, &status, 0);
  const absl::Time killed = absl::Now();
  EXPECT_TRUE(Eventually(
      [&] {
        return Metric(gateway_->metrics_port, "vlm_gateway_admission_running") == 0 &&
               Metric(gateway_->metrics_port, "vlm_gateway_http_sse_streams_open") == 0 &&
               Metric(language_->metrics_port, "vlm_language_sequences_running") == 0;
      },
      absl::Seconds(5)));
  std::printf("slot freed %.0f ms after the client was killed\n",
              absl::ToDoubleMilliseconds(absl::Now() - killed));
  const std::string streamed = ReadFile(out);
  EXPECT_FALSE(absl::StrContains(streamed, "[DONE]"));
  // The single language slot (--max_sequences=1) is free again.
  auto res = Post(ChatBody("Are you free?", 2));
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
}

// n > 1: a client gone cancels every choice, the running one and those
// queued behind it on the single language slot.
TEST_F(OpenAiHttpTest, ClientDisconnectCancelsEveryChoice) {
  json body = ChatBody("Tell me three very long stories, one after another.", 8192);
  body["ignore_eos"] = true;
  body["stream"] = true;
  body["n"] = 3;
  const std::string out = log_dir_ + "/disconnect_n.sse";
  std::remove(out.c_str());
  const pid_t curl = ::fork();
  if (curl == 0) {
    ::execlp("curl", "curl", "-sN", "--max-time", "120", "-o", out.c_str(), "-H",
             "Content-Type: application/json", "-d", body.dump().c_str(),
             Url("/v1/chat/completions").c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_GT(curl, 0);
  // Choice 0 is streaming and the other two wait for the slot (--max_sequences=1).
  ASSERT_TRUE(Eventually(
      [&] {
        return ReadFile(out).size() > 2000 &&
               Metric(language_->metrics_port, "vlm_language_queue_depth") == 2;
      },
      absl::Seconds(30)))
      << "streamed " << ReadFile(out).size() << " bytes, queue depth "
      << Metric(language_->metrics_port, "vlm_language_queue_depth");
  EXPECT_EQ(Metric(language_->metrics_port, "vlm_language_sequences_running"), 1);

  ::kill(curl, SIGKILL);
  int status = 0;
  ::waitpid(curl, &status, 0);
  EXPECT_TRUE(Eventually(
      [&] {
        return Metric(gateway_->metrics_port, "vlm_gateway_admission_running") == 0 &&
               Metric(language_->metrics_port, "vlm_language_sequences_running") == 0 &&
               Metric(language_->metrics_port, "vlm_language_queue_depth") == 0;
      },
      absl::Seconds(5)))
      << "running " << Metric(language_->metrics_port, "vlm_language_sequences_running")
      << ", queued " << Metric(language_->metrics_port, "vlm_language_queue_depth");
  auto res = Post(ChatBody("Are you free?", 2));
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
}

TEST_F(OpenAiHttpTest, NonStreamedClientDisconnectCancelsTheGenerationAndFreesTheSlot) {
  // The OpenAI SDKs' default mode: nothing is written until the end, so only
  // the gateway's watch on the connection can notice the client leaving.
  json body = ChatBody("Tell me a very long story.", 8192);
  body["ignore_eos"] = true;
  const double gone_before = Metric(gateway_->metrics_port, "vlm_gateway_http_client_gone_total");
  const pid_t curl = ::fork();
  if (curl == 0) {
    ::execlp("curl", "curl", "-s", "--max-time", "120", "-o", "/dev/null", "-H",
             "Content-Type: application/json", "-d", body.dump().c_str(),
             Url("/v1/chat/completions").c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_GT(curl, 0);
  ASSERT_TRUE(Eventually(
      [&] { return Metric(language_->metrics_port, "vlm_language_sequences_running") == 1; },
      absl::Seconds(30)));
  EXPECT_EQ(Metric(gateway_->metrics_port, "vlm_gateway_admission_running"), 1);
  absl::SleepFor(absl::Milliseconds(300));  // generating, not just admitted
  ::kill(curl, SIGKILL);
  int status = 0;
  ::waitpid(curl, &status, 0);
  const absl::Time killed = absl::Now();
  EXPECT_TRUE(Eventually(
      [&] {
        return Metric(gateway_->metrics_port, "vlm_gateway_admission_running") == 0 &&
               Metric(language_->metrics_port, "vlm_language_sequences_running") == 0;
      },
      absl::Seconds(5)));
  std::printf("slot freed %.0f ms after the non-streaming client was killed\n",
              absl::ToDoubleMilliseconds(absl::Now() - killed));
  EXPECT_EQ(Metric(gateway_->metrics_port, "vlm_gateway_http_client_gone_total"), gone_before + 1);
  EXPECT_EQ(Metric(gateway_->metrics_port, "vlm_gateway_http_unwatched_requests_total"), 0);
  auto res = Post(ChatBody("Are you free?", 2));
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
}

TEST_F(OpenAiHttpTest, ApiKeysGuardHttpAndGrpcButNotHealthOrThePage) {
  auto none = Post(ChatBody("hi", 2), keyed_port_);
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 401);
  EXPECT_EQ(none->get_header_value("WWW-Authenticate"), "Bearer");
  const json e = json::parse(none->body)["error"];
  EXPECT_EQ(e["type"], "authentication_error");
  EXPECT_EQ(e["code"], "invalid_api_key");

  auto wrong = Post(ChatBody("hi", 2), keyed_port_, "Bearer sk-wrong");
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 401);
  EXPECT_TRUE(absl::StrContains(wrong->body, "incorrect API key"));
  auto right = Post(ChatBody("hi", 2), keyed_port_, absl::StrCat("Bearer ", kApiKey));
  ASSERT_TRUE(right);
  EXPECT_EQ(right->status, 200) << right->body;
  auto other = Post(ChatBody("hi", 2), keyed_port_, "Bearer other-key");  // trimmed line
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 200) << other->body;

  httplib::Client client("127.0.0.1", keyed_port_);
  EXPECT_EQ(client.Get("/v1/models")->status, 401);
  EXPECT_EQ(client.Get("/health")->status, 200);
  EXPECT_EQ(client.Get("/")->status, 200);

  auto stub = v1::VisionLanguage::NewStub(
      grpc::CreateChannel(keyed_->grpc_target(), grpc::InsecureChannelCredentials()));
  v1::ChatRequest request;
  auto* m = request.add_messages();
  m->set_role("user");
  m->add_content()->set_text("hi");
  request.mutable_params()->set_max_tokens(2);
  v1::ChatResponse response;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    EXPECT_EQ(stub->Chat(&ctx, request, &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    ctx.AddMetadata("authorization", absl::StrCat("Bearer ", kApiKey));
    grpc::Status s = stub->Chat(&ctx, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
}

TEST_F(OpenAiHttpTest, AdmissionRefusalIs429WithRetryAfter) {
  // keyed_ runs one request at most, with no queue.
  json body = ChatBody("A long story, please.", 4000);
  body["ignore_eos"] = true;
  body["stream"] = true;
  const std::string out = log_dir_ + "/busy.sse";
  std::remove(out.c_str());
  const pid_t curl = ::fork();
  if (curl == 0) {
    const std::string auth = absl::StrCat("Authorization: Bearer ", kApiKey);
    ::execlp("curl", "curl", "-sN", "--max-time", "120", "-o", out.c_str(), "-H", auth.c_str(),
             "-H", "Content-Type: application/json", "-d", body.dump().c_str(),
             Url("/v1/chat/completions", keyed_port_).c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_TRUE(Eventually([&] { return ReadFile(out).size() > 500; }, absl::Seconds(30)));
  auto refused = Post(ChatBody("me too", 2), keyed_port_, absl::StrCat("Bearer ", kApiKey));
  ::kill(curl, SIGKILL);
  ::waitpid(curl, nullptr, 0);
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 429) << refused->body;
  EXPECT_EQ(refused->get_header_value("Retry-After"), "1");
  EXPECT_EQ(json::parse(refused->body)["error"]["type"], "rate_limit_error");
  EXPECT_TRUE(Eventually(
      [&] { return Metric(keyed_->metrics_port, "vlm_gateway_admission_running") == 0; },
      absl::Seconds(10)));
}

TEST_F(OpenAiHttpTest, NotReadyIs503AndHealthSaysWhy) {
  // A gateway whose language service does not exist never becomes SERVING.
  std::unique_ptr<ServiceProcess> lonely = std::make_unique<ServiceProcess>(
      VLM_GATEWAY_PATH,
      std::vector<std::string>{"--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                               "--http_address=127.0.0.1:0", "--language_target=127.0.0.1:1",
                               "--vision_targets=" + vision_->grpc_target(),
                               "--drain_timeout_s=1"},
      log_dir_ + "/gateway-lonely");
  ASSERT_TRUE(lonely->WaitListening()) << lonely->LogTail();
  ASSERT_TRUE(Eventually([&] { return HttpPort(log_dir_ + "/gateway-lonely.out") > 0; },
                         absl::Seconds(5)));
  const int port = HttpPort(log_dir_ + "/gateway-lonely.out");
  httplib::Client client("127.0.0.1", port);
  auto health = client.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 503);
  EXPECT_EQ(json::parse(health->body)["status"], "NOT_SERVING");
  json body = ChatBody("hi");
  body["model"] = "qwen3-vl";  // no --model_dir: the default id
  auto res = Post(body, port);
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 503) << res->body;
  EXPECT_EQ(res->get_header_value("Retry-After"), "1");
  EXPECT_EQ(json::parse(res->body)["error"]["type"], "service_unavailable");
  EXPECT_EQ(lonely->Stop(SIGTERM, absl::Seconds(20)), std::optional<int>(0)) << lonely->LogTail();
}

// A gateway of its own, started for one test, with its HTTP port once SERVING.
struct ExtraGateway {
  std::unique_ptr<ServiceProcess> process;
  int port = 0;
};

class OpenAiHttpExtraTest : public OpenAiHttpTest {
 protected:
  static ExtraGateway Start(const std::string& name, std::vector<std::string> flags) {
    ExtraGateway g;
    g.process = StartGateway(name, std::move(flags));
    EXPECT_TRUE(g.process->WaitListening()) << g.process->LogTail();
    const std::string out = log_dir_ + "/" + name + ".out";
    EXPECT_TRUE(Eventually([&] { return HttpPort(out) > 0; }, absl::Seconds(5)));
    g.port = HttpPort(out);
    EXPECT_TRUE(Eventually(
        [&] {
          httplib::Client c("127.0.0.1", g.port);
          auto r = c.Get("/health");
          return r && r->status == 200;
        },
        absl::Seconds(30)));
    return g;
  }
};

TEST_F(OpenAiHttpExtraTest, DeadlineIs504) {
  ExtraGateway g = Start("gateway-deadline", {"--default_deadline_s=0.3"});
  json body = ChatBody("A story that takes long.", 8192);
  body["ignore_eos"] = true;
  auto res = Post(body, g.port);
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 504) << res->body;
  EXPECT_EQ(json::parse(res->body)["error"]["type"], "timeout");
  EXPECT_EQ(g.process->Stop(SIGTERM, absl::Seconds(20)), std::optional<int>(0));
}

// The gateway reads the photo's size from its JPEG header and refuses at once
// a deadline its ViT floor cannot meet, naming the estimate.
TEST_F(OpenAiHttpExtraTest, ImpossibleDeadlineForAPhotoIs504BeforeAnyEncode) {
  const std::string jpeg = PhonePhotoJpeg(log_dir_);
  ASSERT_FALSE(jpeg.empty()) << "Pillow (python3-pil) could not write the photo";
  ExtraGateway g = Start("gateway-estimate", {"--image_min_ms_per_patch=100",
                                              "--default_deadline_s=60"});
  auto res = Post(PhotoBody(jpeg, nullptr), g.port);
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 504) << res->body;
  const std::string message = json::parse(res->body)["error"]["message"];
  EXPECT_NE(message.find("image 1 (4000x3000, resized to 832x608: 1976 patches)"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("at least 197600 ms"), std::string::npos) << message;
  EXPECT_EQ(g.process->Stop(SIGTERM, absl::Seconds(20)), std::optional<int>(0));
}

TEST_F(OpenAiHttpExtraTest, SigtermLetsAnOpenStreamFinishThenExits0) {
  ExtraGateway g = Start("gateway-drain", {"--drain_timeout_s=20"});
  json body = ChatBody("A story of medium length.", 600);
  body["ignore_eos"] = true;
  body["stream"] = true;
  const std::string out = log_dir_ + "/drain.sse";
  std::remove(out.c_str());
  const pid_t curl = ::fork();
  if (curl == 0) {
    ::execlp("curl", "curl", "-sN", "--max-time", "60", "-o", out.c_str(), "-H",
             "Content-Type: application/json", "-d", body.dump().c_str(),
             Url("/v1/chat/completions", g.port).c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_TRUE(Eventually([&] { return ReadFile(out).size() > 500; }, absl::Seconds(30)));
  ::kill(g.process->pid(), SIGTERM);
  int status = 0;
  ::waitpid(curl, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  const std::string streamed = ReadFile(out);
  EXPECT_TRUE(absl::EndsWith(streamed, "data: [DONE]\n\n")) << streamed.substr(streamed.size() - 300);
  EXPECT_TRUE(absl::StrContains(streamed, "\"finish_reason\":\"length\""));
  // Signal 0 sends nothing: only wait for the exit the first SIGTERM started.
  EXPECT_EQ(g.process->Stop(0, absl::Seconds(30)), std::optional<int>(0)) << g.process->LogTail();
}

}  // namespace
}  // namespace vlm
