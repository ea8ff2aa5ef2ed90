// The gateway (service, router, health, admission) in-process against fake
// vision and language backends on loopback: behaviours that are hard to
// provoke in the real services on demand (a replica answering UNAVAILABLE, an
// undecodable image, a stream that fails after some chunks) and exact checks of
// what reaches the backends (image order, deadline, cancellation).
// tests/integration/gateway_test.cc runs the same story on the real binaries.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/metrics.h"
#include "common/server.h"
#include "common/sha256.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "services/gateway/admission.h"
#include "services/gateway/backend_health.h"
#include "services/gateway/gateway_service.h"
#include "services/gateway/router.h"
#include "tests/unit/metrics_text.h"
#include "vlm/v1/gateway.grpc.pb.h"
#include "vlm/v1/language.grpc.pb.h"
#include "vlm/v1/vision.grpc.pb.h"

namespace vlm::gateway {
namespace {

using std::chrono::system_clock;

bool Eventually(const std::function<bool()>& condition, absl::Duration timeout = absl::Seconds(5)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return condition();
}

// A plain gRPC server on 127.0.0.1:0 with the default health service.
class FakeServer {
 public:
  FakeServer(grpc::Service* service, const std::string& health_name) : health_name_(health_name) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(service);
    server_ = builder.BuildAndStart();
    SetServing(true);
  }
  ~FakeServer() { Stop(); }
  void SetServing(bool serving) {
    if (server_) server_->GetHealthCheckService()->SetServingStatus(health_name_, serving);
  }
  void Stop() {
    if (server_) {
      server_->Shutdown(system_clock::now());
      server_->Wait();
      server_.reset();
    }
  }
  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  std::string health_name_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// Encodes anything into a 1x4x4 grid; bytes starting with "bad" are undecodable.
class FakeVision final : public v1::VisionEncoder::Service {
 public:
  explicit FakeVision(std::string name) : name_(std::move(name)) {}

  grpc::Status Encode(grpc::ServerContext*, const v1::EncodeRequest* request,
                      v1::EncodeResponse* response) override {
    calls_.fetch_add(1);
    if (unavailable_.load()) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, name_ + " is overloaded");
    }
    std::string hash;
    absl::MutexLock lock(&mu_);
    if (request->has_content_hash()) {
      hash = request->content_hash();
      if (seen_.count(hash) == 0) {
        return grpc::Status(grpc::StatusCode::NOT_FOUND,
                            "content hash not cached on this replica; send the image bytes");
      }
    } else {
      if (absl::StartsWith(request->image(), "bad")) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "cannot decode image: not a JPEG, PNG or WebP file");
      }
      hash = Sha256Hex(request->image());
    }
    const bool hit = seen_.count(hash) != 0;
    seen_[hash]++;
    response->set_cache(hit ? v1::CACHE_LEVEL_MEMORY : v1::CACHE_LEVEL_MISS);
    auto* f = response->mutable_features();
    f->mutable_grid()->set_t(1);
    f->mutable_grid()->set_h(4);
    f->mutable_grid()->set_w(4);
    f->set_content_hash(hash);
    f->mutable_last_hidden()->set_dtype(v1::DTYPE_BF16);
    f->mutable_last_hidden()->add_shape(16);
    f->mutable_last_hidden()->add_shape(8);
    f->mutable_last_hidden()->set_data(std::string(16 * 8 * 2, '\0'));
    response->set_replica(name_);
    return grpc::Status::OK;
  }

  // Answers the budget once one is set; UNIMPLEMENTED before (an older vision service).
  grpc::Status GetImageBudget(grpc::ServerContext*, const v1::ImageBudgetRequest*,
                              v1::ImageBudget* response) override {
    budget_calls_.fetch_add(1);
    absl::MutexLock lock(&mu_);
    if (!budget_) return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "no GetImageBudget");
    *response = *budget_;
    return grpc::Status::OK;
  }
  void set_budget(int64_t default_max_pixels, int64_t max_pixels_limit) {
    v1::ImageBudget b;
    b.set_default_min_pixels(65536);
    b.set_default_max_pixels(default_max_pixels);
    b.set_min_pixels_limit(1024);
    b.set_max_pixels_limit(max_pixels_limit);
    b.set_patch_size(16);
    b.set_merge_size(2);
    b.set_temporal_patch_size(2);
    b.set_max_aspect_ratio(200);
    absl::MutexLock lock(&mu_);
    budget_ = b;
  }

  int calls() const { return calls_.load(); }
  int budget_calls() const { return budget_calls_.load(); }
  void set_unavailable(bool v) { unavailable_ = v; }

 private:
  const std::string name_;
  std::atomic<int> calls_{0};
  std::atomic<int> budget_calls_{0};
  std::atomic<bool> unavailable_{false};
  absl::Mutex mu_;
  std::map<std::string, int> seen_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::ImageBudget> budget_ ABSL_GUARDED_BY(mu_);
};

// Streams the words of the last text part; the first delta lists the images
// ("images=2 ab12cd34,ef56ab78 "). "slow N" streams N tokens 20 ms apart,
// "die" fails after two chunks.
class FakeLanguage final : public v1::Language::Service {
 public:
  explicit FakeLanguage(std::string fingerprint = "fake-model") : fingerprint_(std::move(fingerprint)) {}
  grpc::Status ReplicaInfo(grpc::ServerContext*, const v1::ReplicaInfoRequest*,
                           v1::ReplicaInfoResponse* response) override {
    response->set_model_fingerprint(fingerprint_);
    response->set_running(running_.load());
    return grpc::Status::OK;
  }
  // Every Generate fails UNAVAILABLE before its first response (a replica
  // going away between two health updates).
  void set_unavailable(bool v) { unavailable_ = v; }
  int generates() const { return generates_.load(); }
  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    generates_.fetch_add(1);
    if (unavailable_.load()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "going away");
    std::string text;
    std::vector<std::string> hashes;
    for (const auto& m : request->messages()) {
      for (const auto& p : m.content()) {
        if (p.has_text()) text = p.text();
        if (p.has_image()) hashes.push_back(p.image().content_hash().substr(0, 8));
      }
    }
    {
      absl::MutexLock lock(&mu_);
      last_request_ = *request;
      last_deadline_ = context->deadline();
    }
    auto send = [&](const std::string& delta) {
      v1::GenerateResponse r;
      r.set_text(delta);
      r.add_token_ids(1);
      return writer->Write(r);
    };
    int tokens = 0;
    if (absl::StartsWith(text, "slow")) {
      int n = 0;
      (void)absl::SimpleAtoi(text.substr(5), &n);
      running_.fetch_add(1);
      for (; tokens < n; ++tokens) {
        if (context->IsCancelled()) {
          running_.fetch_sub(1);
          stopped_early_.fetch_add(1);
          return grpc::Status(grpc::StatusCode::CANCELLED, "generation cancelled");
        }
        send("tok ");
        absl::SleepFor(absl::Milliseconds(20));
      }
      running_.fetch_sub(1);
    } else if (text == "die") {
      send("one ");
      send("two ");
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "Socket closed");
    } else {
      send(absl::StrCat("images=", hashes.size(), " ", absl::StrJoin(hashes, ","), " "));
      ++tokens;
      std::vector<std::string> words = absl::StrSplit(text, ' ', absl::SkipEmpty());
      for (size_t i = 0; i < words.size(); ++i) {
        send(i + 1 < words.size() ? words[i] + " " : words[i]);
        ++tokens;
      }
    }
    v1::GenerateResponse last;
    last.set_finish_reason(v1::FINISH_REASON_STOP);
    last.mutable_usage()->set_prompt_tokens(10 + 4 * static_cast<int>(hashes.size()));
    last.mutable_usage()->set_image_tokens(4 * static_cast<int>(hashes.size()));
    last.mutable_usage()->set_completion_tokens(tokens);
    last.mutable_timings()->set_prefill_ms(1.5);
    last.mutable_timings()->set_decode_ms(2.5);
    writer->Write(last);
    return grpc::Status::OK;
  }

  v1::GenerateRequest last_request() {
    absl::MutexLock lock(&mu_);
    return last_request_;
  }
  system_clock::time_point last_deadline() {
    absl::MutexLock lock(&mu_);
    return last_deadline_;
  }
  int running() const { return running_.load(); }
  int stopped_early() const { return stopped_early_.load(); }

 private:
  absl::Mutex mu_;
  v1::GenerateRequest last_request_ ABSL_GUARDED_BY(mu_);
  system_clock::time_point last_deadline_ ABSL_GUARDED_BY(mu_);
  const std::string fingerprint_;
  std::atomic<int> running_{0};
  std::atomic<int> stopped_early_{0};
  std::atomic<int> generates_{0};
  std::atomic<bool> unavailable_{false};
};

// A language service of an older protocol: no ReplicaInfo.
class LanguageWithoutInfo final : public v1::Language::Service {};

// The gateway wired as in main.cc, on 127.0.0.1:0.
class Gateway {
 public:
  Gateway(std::vector<std::string> vision, const std::string& language, int max_inflight = 4,
          int max_queue = 4)
      : Gateway(std::move(vision), std::vector<std::string>{language}, max_inflight, max_queue) {}
  Gateway(std::vector<std::string> vision, std::vector<std::string> language, int max_inflight = 4,
          int max_queue = 4)
      : server_(Options()), health_(&server_.readiness(), GatewayService::kServiceName) {
    VisionRouterOptions router_options;
    router_options.static_targets = std::move(vision);
    router_options.health.retry_initial = absl::Milliseconds(20);
    router_options.health.retry_max = absl::Milliseconds(200);
    router_options.channel.max_reconnect_backoff = absl::Milliseconds(200);
    router_ = *VisionRouter::Create(router_options, [this] { health_.Update(); });
    LanguageRouterOptions language_options;
    language_options.static_targets = std::move(language);
    language_options.health = router_options.health;
    language_options.channel = router_options.channel;
    language_options.info_refresh = absl::Milliseconds(50);
    language_ = *LanguageRouter::Create(language_options, [this] { health_.Update(); });
    admission_ = std::make_unique<Admission>(max_inflight, max_queue);
    GatewayOptions options;
    options.limits.max_images_per_request = 3;
    service_ = std::make_unique<GatewayService>(options, &server_.readiness(), admission_.get(),
                                                router_.get(), language_.get());
    server_.AddService(service_.get(), GatewayService::kServiceName, "waiting for backends");
    EXPECT_TRUE(server_.Start().ok());
    health_.Start([this] { return language_->Replicas(); },
                  [this] { return router_->Replicas(); });
    auto client_channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_.grpc_port()),
                                              grpc::InsecureChannelCredentials());
    stub_ = v1::VisionLanguage::NewStub(client_channel);
    health_stub_ = grpc::health::v1::Health::NewStub(client_channel);
  }
  ~Gateway() {
    health_.Stop();
    language_.reset();
    router_.reset();
  }

  static ServerOptions Options() {
    ServerOptions o;
    o.grpc_address = "127.0.0.1:0";
    o.metrics_address = "";
    o.handle_signals = false;
    o.drain_timeout = absl::Seconds(1);
    return o;
  }

  std::string Health() {
    grpc::ClientContext ctx;
    ctx.set_deadline(system_clock::now() + std::chrono::seconds(2));
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status s = health_stub_->Check(&ctx, req, &resp);
    if (!s.ok()) return "error: " + s.error_message();
    return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
  }
  bool WaitServing(absl::Duration timeout = absl::Seconds(5)) {
    return Eventually([&] { return Health() == "SERVING"; }, timeout);
  }

  v1::VisionLanguage::Stub& stub() { return *stub_; }
  VisionRouter& router() { return *router_; }
  LanguageRouter& language() { return *language_; }
  Admission& admission() { return *admission_; }

 private:
  Server server_;
  BackendHealth health_;
  std::unique_ptr<VisionRouter> router_;
  std::unique_ptr<LanguageRouter> language_;
  std::unique_ptr<Admission> admission_;
  std::unique_ptr<GatewayService> service_;
  std::unique_ptr<v1::VisionLanguage::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;
};

v1::ChatRequest Request(const std::string& text, const std::vector<std::string>& images = {}) {
  v1::ChatRequest r;
  auto* m = r.add_messages();
  m->set_role("user");
  for (const std::string& image : images) m->add_content()->mutable_image()->set_data(image);
  m->add_content()->set_text(text);
  return r;
}

grpc::Status Chat(Gateway& g, const v1::ChatRequest& request, v1::ChatResponse* response,
                  absl::Duration deadline = absl::Seconds(10)) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  return g.stub().Chat(&ctx, request, response);
}

class GatewayFakeTest : public ::testing::Test {
 protected:
  GatewayFakeTest()
      : vision_a_("vision-a"),
        vision_b_("vision-b"),
        server_a_(&vision_a_, "vlm.v1.VisionEncoder"),
        server_b_(&vision_b_, "vlm.v1.VisionEncoder"),
        language_server_(&language_, "vlm.v1.Language") {}

  FakeVision vision_a_;
  FakeVision vision_b_;
  FakeLanguage language_;
  FakeServer server_a_;
  FakeServer server_b_;
  FakeServer language_server_;
};

TEST_F(GatewayFakeTest, TextChatUnaryAndStreamingAgree) {
  Gateway g({server_a_.target()}, language_server_.target());
  ASSERT_TRUE(g.WaitServing());

  v1::ChatRequest request = Request("hello big world");
  request.set_request_id("req-1");
  v1::ChatResponse response;
  ASSERT_TRUE(Chat(g, request, &response).ok());
  EXPECT_EQ(response.text(), "images=0  hello big world");
  EXPECT_EQ(response.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(response.usage().completion_tokens(), 4);
  EXPECT_EQ(response.request_id(), "req-1");
  EXPECT_DOUBLE_EQ(response.timings().prefill_ms(), 1.5);
  EXPECT_GT(response.timings().total_ms(), 0);
  // The gateway asks for the generation prompt and forwards the request id.
  EXPECT_TRUE(language_.last_request().add_generation_prompt());
  EXPECT_EQ(language_.last_request().request_id(), "req-1");

  grpc::ClientContext ctx;
  auto reader = g.stub().ChatStream(&ctx, request);
  std::vector<std::string> deltas;
  v1::ChatChunk chunk;
  v1::ChatChunk last;
  while (reader->Read(&chunk)) {
    deltas.push_back(chunk.text());
    if (chunk.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) last = chunk;
    else EXPECT_FALSE(chunk.has_usage()) << "usage only on the last chunk";
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(deltas, (std::vector<std::string>{"images=0  ", "hello ", "big ", "world", ""}));
  EXPECT_EQ(last.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(last.usage().completion_tokens(), 4);
  EXPECT_EQ(last.request_id(), "req-1");
}

// With tools offered, the gRPC response carries the calls parsed from the
// text, as the HTTP API's message.tool_calls; with n = 2 each choice has its
// own (ids told apart by the choice), unary and streamed alike.
TEST_F(GatewayFakeTest, ToolCallsAreParsedForGrpcPerChoice) {
  Gateway g({server_a_.target()}, language_server_.target());
  ASSERT_TRUE(g.WaitServing());
  // The fake echoes the words: the answer is "images=0  Checking. <tool_call>...</tool_call>".
  v1::ChatRequest request = Request(
      R"(Checking. <tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>)");
  request.set_request_id("req-tools");
  v1::Tool* tool = request.add_tools();
  tool->set_name("get_weather");
  v1::ChatResponse response;
  ASSERT_TRUE(Chat(g, request, &response).ok());
  ASSERT_EQ(response.tool_calls_size(), 1) << response.text();
  EXPECT_EQ(response.tool_calls(0).id(), "call_req-tools_0");
  EXPECT_EQ(response.tool_calls(0).name(), "get_weather");
  EXPECT_EQ(nlohmann::json::parse(response.tool_calls(0).arguments()),
            nlohmann::json::parse(R"({"city": "Paris"})"));
  EXPECT_TRUE(absl::StrContains(response.text(), "<tool_call>"));  // the text stays the model's

  // tool_choice NONE: no parsing.
  v1::ChatRequest none = request;
  none.mutable_tool_choice()->set_mode(v1::TOOL_CHOICE_NONE);
  v1::ChatResponse plain;
  ASSERT_TRUE(Chat(g, none, &plain).ok());
  EXPECT_EQ(plain.tool_calls_size(), 0);

  // n = 2: unary gives both choices with their calls; streamed chunks carry
  // their choice, each choice ends with its own final chunk, usage on the last.
  request.set_n(2);
  v1::ChatResponse two;
  ASSERT_TRUE(Chat(g, request, &two).ok());
  ASSERT_EQ(two.choices_size(), 2);
  EXPECT_EQ(two.choices(1).index(), 1);
  EXPECT_EQ(two.choices(1).text(), response.text());
  ASSERT_EQ(two.choices(1).tool_calls_size(), 1);
  EXPECT_EQ(two.choices(1).tool_calls(0).id(), "call_req-tools_c1_0");
  EXPECT_EQ(two.usage().completion_tokens(), 2 * response.usage().completion_tokens());
  EXPECT_EQ(two.usage().prompt_tokens(), response.usage().prompt_tokens());

  grpc::ClientContext ctx;
  auto reader = g.stub().ChatStream(&ctx, request);
  std::map<int, std::string> text;
  std::map<int, int> finals;
  int with_usage = 0;
  v1::ChatChunk chunk;
  while (reader->Read(&chunk)) {
    text[chunk.index()] += chunk.text();
    if (chunk.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      ++finals[chunk.index()];
      EXPECT_EQ(chunk.tool_calls_size(), 1) << chunk.index();
    }
    if (chunk.has_usage()) {
      ++with_usage;
      EXPECT_EQ(chunk.choice_usage_size(), 2);
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(text[0], response.text());
  EXPECT_EQ(text[1], response.text());
  EXPECT_EQ(finals[0], 1);
  EXPECT_EQ(finals[1], 1);
  EXPECT_EQ(with_usage, 1);

  // Beyond --max_n (GatewayOptions::max_n, 8): INVALID_ARGUMENT naming n.
  request.set_n(9);
  v1::ChatResponse refused;
  const grpc::Status status = Chat(g, request, &refused);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(status.error_message(), "n is 9")) << status.error_message();
}

TEST_F(GatewayFakeTest, ImagesReachLanguageInOrderAndReportTheirCache) {
  Gateway g({server_a_.target()}, language_server_.target());
  ASSERT_TRUE(g.WaitServing());
  const std::string a = "image-a-bytes", b = "image-b-bytes";
  v1::ChatResponse r1;
  ASSERT_TRUE(Chat(g, Request("compare", {a, b}), &r1).ok());
  EXPECT_EQ(r1.text(), absl::StrCat("images=2 ", Sha256Hex(a).substr(0, 8), ",",
                                    Sha256Hex(b).substr(0, 8), " compare"));
  ASSERT_EQ(r1.images_size(), 2);
  EXPECT_EQ(r1.images(0).content_hash(), Sha256Hex(a));
  EXPECT_EQ(r1.images(1).content_hash(), Sha256Hex(b));
  EXPECT_EQ(r1.images(0).cache(), v1::CACHE_LEVEL_MISS);
  EXPECT_EQ(r1.images(0).tokens(), 4);  // 1x4x4 patches, 2x2 merge
  EXPECT_EQ(r1.images(0).replica(), "vision-a");
  EXPECT_EQ(r1.images(0).grid().h(), 4);
  EXPECT_EQ(r1.usage().image_tokens(), 8);

  // The same image again, then by its content hash alone: cache hits.
  v1::ChatResponse r2;
  ASSERT_TRUE(Chat(g, Request("again", {a}), &r2).ok());
  EXPECT_EQ(r2.images(0).cache(), v1::CACHE_LEVEL_MEMORY);
  v1::ChatRequest by_hash = Request("by hash");
  by_hash.mutable_messages(0)->mutable_content(0)->clear_text();
  by_hash.mutable_messages(0)->mutable_content(0)->mutable_image()->set_content_hash(Sha256Hex(a));
  by_hash.mutable_messages(0)->add_content()->set_text("by hash");
  v1::ChatResponse r3;
  ASSERT_TRUE(Chat(g, by_hash, &r3).ok()) << r3.DebugString();
  EXPECT_EQ(r3.images(0).cache(), v1::CACHE_LEVEL_MEMORY);
  EXPECT_EQ(r3.images(0).content_hash(), Sha256Hex(a));
}

TEST_F(GatewayFakeTest, AnImageAlwaysGoesToItsRendezvousReplica) {
  Gateway g({server_a_.target(), server_b_.target()}, language_server_.target());
  ASSERT_TRUE(g.WaitServing());
  ASSERT_TRUE(Eventually([&] { return g.router().ServingOrder("x").size() == 2; }));
  std::map<std::string, std::string> names = {{server_a_.target(), "vision-a"},
                                              {server_b_.target(), "vision-b"}};
  std::set<std::string> used;
  for (int i = 0; i < 12; ++i) {
    const std::string image = absl::StrCat("image-", i);
    const std::string home = names[g.router().ServingOrder(Sha256Hex(image))[0]];
    for (int repeat = 0; repeat < 2; ++repeat) {
      v1::ChatResponse r;
      ASSERT_TRUE(Chat(g, Request("hi", {image}), &r).ok());
      EXPECT_EQ(r.images(0).replica(), home) << image;
      EXPECT_EQ(r.images(0).cache(), repeat == 0 ? v1::CACHE_LEVEL_MISS : v1::CACHE_LEVEL_MEMORY);
    }
    used.insert(home);
  }
  EXPECT_EQ(used.size(), 2u) << "12 images should spread over both replicas";
}

TEST_F(GatewayFakeTest, UnavailableReplicaIsRetriedOnTheNextOne) {
  Gateway g({server_a_.target(), server_b_.target()}, language_server_.target());
  ASSERT_TRUE(g.WaitServing());
  ASSERT_TRUE(Eventually([&] { return g.router().ServingOrder("x").size() == 2; }));
  // An image whose home is vision-a; vision-a answers UNAVAILABLE but stays SERVING.
  std::string image;
  for (int i = 0; image.empty(); ++i) {
    const std::string candidate = absl::StrCat("img", i);
    if (g.router().ServingOrder(Sha256Hex(candidate))[0] == server_a_.target()) image = candidate;
  }
  vision_a_.set_unavailable(true);
  const std::string before = RenderMetrics();
  v1::ChatResponse r;
  ASSERT_TRUE(Chat(g, Request("hi", {image}), &r).ok());
  EXPECT_EQ(r.images(0).replica(), "vision-b");
  EXPECT_EQ(vision_a_.calls(), 1);
  const std::string after = RenderMetrics();
  EXPECT_EQ(metrics_text::MetricValue(after, "vlm_gateway_vision_retries_total").value_or(0) -
                metrics_text::MetricValue(before, "vlm_gateway_vision_retries_total").value_or(0),
            1);

  // Both UNAVAILABLE: bounded attempts, then UNAVAILABLE naming the image.
  vision_b_.set_unavailable(true);
  grpc::Status s = Chat(g, Request("hi", {image}), &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StartsWith(s.error_message(), "image 1: vision service unavailable after 3 attempts"))
      << s.error_message();
}

TEST_F(GatewayFakeTest, NotServingReplicaIsSkippedAndAStoppedOneFailsOver) {
  Gateway g({server_a_.target(), server_b_.target()}, language_server_.target());
  ASSERT_TRUE(g.WaitServing());
  ASSERT_TRUE(Eventually([&] { return g.router().ServingOrder("x").size() == 2; }));
  server_a_.SetServing(false);
  ASSERT_TRUE(Eventually([&] { return g.router().ServingOrder("x").size() == 1; }));
  EXPECT_EQ(g.Health(), "SERVING");  // one vision replica is enough
  for (int i = 0; i < 6; ++i) {
    v1::ChatResponse r;
    ASSERT_TRUE(Chat(g, Request("hi", {absl::StrCat("p", i)}), &r).ok());
    EXPECT_EQ(r.images(0).replica(), "vision-b");
  }
  EXPECT_EQ(vision_a_.calls(), 0);

  // The last replica stops: the gateway stops serving, with the reason.
  server_b_.Stop();
  ASSERT_TRUE(Eventually([&] { return g.Health() == "NOT_SERVING"; }));
  v1::ChatResponse r;
  grpc::Status s = Chat(g, Request("hi", {"p0"}), &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "no vision replica is SERVING")) << s.error_message();
  server_a_.SetServing(true);
  EXPECT_TRUE(g.WaitServing());
}

// A PNG's signature and IHDR: all the gateway's size estimate reads.
std::string PngHeader(uint32_t w, uint32_t h) {
  auto be32 = [](uint32_t v) {
    return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16),
                       static_cast<char>(v >> 8), static_cast<char>(v)};
  };
  return std::string("\x89PNG\r\n\x1a\n", 8) + be32(13) + "IHDR" + be32(w) + be32(h) +
         std::string("\x08\x02\x00\x00\x00", 5) + be32(0);
}

// The image cost estimate uses the budget the vision replicas report: the
// smallest over the replicas, asked once per replica and kept; no budget (an
// older vision service) means no estimate, never a refusal.
TEST_F(GatewayFakeTest, ImageCostFollowsTheBudgetTheReplicasReport) {
  Gateway g({server_a_.target(), server_b_.target()}, language_server_.target());
  ASSERT_TRUE(g.WaitServing());
  ASSERT_TRUE(Eventually([&] { return g.router().ServingOrder("x").size() == 2; }));
  const std::vector<std::string> photos = {PngHeader(12000, 9000), PngHeader(12001, 9000),
                                           PngHeader(12002, 9000)};
  absl::StatusOr<v1::ImageBudget> none = g.router().ImageBudget(absl::Now() + absl::Seconds(5));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(none.status().message(), "UNIMPLEMENTED")) << none.status();
  v1::ChatResponse r;
  ASSERT_TRUE(Chat(g, Request("hi", photos), &r).ok());  // no estimate: the fakes answer

  // At the checkpoint's 16.7 MP three 12000x9000 pictures are 3 x 16k tokens,
  // over max_image_tokens (32768): refused before any encode.
  vision_a_.set_budget(16777216, 16777216);
  vision_b_.set_budget(16777216, 16777216);
  const int encodes = vision_a_.calls() + vision_b_.calls();
  grpc::Status s = Chat(g, Request("hi", photos), &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "max_image_tokens is 32768")) << s.error_message();
  EXPECT_EQ(vision_a_.calls() + vision_b_.calls(), encodes);

  // Replicas that differ: the smallest default and limit, each asked once and kept.
  Gateway fresh({server_a_.target(), server_b_.target()}, language_server_.target());
  ASSERT_TRUE(fresh.WaitServing());
  ASSERT_TRUE(Eventually([&] { return fresh.router().ServingOrder("x").size() == 2; }));
  vision_b_.set_budget(262144, 1048576);
  const int asked = vision_a_.budget_calls() + vision_b_.budget_calls();
  absl::StatusOr<v1::ImageBudget> both = fresh.router().ImageBudget(absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->default_max_pixels(), 262144);
  EXPECT_EQ(both->max_pixels_limit(), 1048576);
  EXPECT_EQ(vision_a_.budget_calls() + vision_b_.budget_calls(), asked + 2);
  ASSERT_TRUE(Chat(fresh, Request("hi", photos), &r).ok()) << "3 x 256 tokens fit";
  EXPECT_EQ(vision_a_.budget_calls() + vision_b_.budget_calls(), asked + 2);
}

TEST_F(GatewayFakeTest, DnsNameIsReResolvedAndAFailedResolutionKeepsTheReplicas) {
  absl::Mutex mu;
  std::vector<std::string> answer = {server_a_.target(), server_b_.target()};
  bool fail = false;
  std::atomic<int> changes{0};
  VisionRouterOptions options;
  options.dns_target = "vision-headless.test:50052";
  options.dns_refresh = absl::Milliseconds(30);
  options.resolver = [&](const std::string& name) -> absl::StatusOr<std::vector<std::string>> {
    EXPECT_EQ(name, "vision-headless.test:50052");
    absl::MutexLock lock(&mu);
    if (fail) return absl::UnavailableError("SERVFAIL");
    return answer;
  };
  options.health.retry_initial = absl::Milliseconds(20);
  std::unique_ptr<VisionRouter> router = *VisionRouter::Create(options, [&] { changes.fetch_add(1); });
  ASSERT_TRUE(Eventually([&] { return router->ServingOrder("k").size() == 2; }));

  {
    absl::MutexLock lock(&mu);
    answer = {server_a_.target()};  // vision-b leaves the Service
  }
  ASSERT_TRUE(Eventually([&] { return router->Replicas().size() == 1; }));
  EXPECT_EQ(router->Replicas()[0].name, server_a_.target());
  {
    absl::MutexLock lock(&mu);
    fail = true;
  }
  absl::SleepFor(absl::Milliseconds(150));
  EXPECT_EQ(router->Replicas().size(), 1u) << "a resolver failure must not empty the pool";
  {
    absl::MutexLock lock(&mu);
    fail = false;
    answer = {server_a_.target(), server_b_.target()};
  }
  ASSERT_TRUE(Eventually([&] { return router->ServingOrder("k").size() == 2; }));
  EXPECT_GT(changes.load(), 0);

  // Encode goes to the key's rendezvous home among the resolved addresses.
  const std::string image = "dns-image";
  v1::EncodeRequest request;
  request.set_image(image);
  VisionRouter::EncodeOutcome outcome =
      router->Encode(nullptr, absl::Now() + absl::Seconds(5), Sha256Hex(image), request);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  EXPECT_EQ(outcome.replica, RendezvousOrder(Sha256Hex(image),
                                             {server_a_.target(), server_b_.target()})[0]);
  EXPECT_EQ(outcome.attempts, 1);
}

TEST_F(GatewayFakeTest, ReadinessFollowsTheLanguageService) {
  language_server_.SetServing(false);
  Gateway g({server_a_.target()}, language_server_.target());
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(g.Health(), "NOT_SERVING");
  v1::ChatResponse r;
  grpc::Status s = Chat(g, Request("hi"), &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "language service")) << s.error_message();
  language_server_.SetServing(true);
  EXPECT_TRUE(g.WaitServing());
  EXPECT_TRUE(Chat(g, Request("hi"), &r).ok());
}

TEST_F(GatewayFakeTest, BackendErrorsAreMappedWithContext) {
  Gateway g({server_a_.target()}, language_server_.target());
  ASSERT_TRUE(g.WaitServing());
  v1::ChatResponse r;
  grpc::Status s = Chat(g, Request("hi", {"good", "bad-bytes"}), &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "image 2: cannot decode image: not a JPEG, PNG or WebP file");

  v1::ChatRequest unknown = Request("x");
  unknown.mutable_messages(0)->mutable_content(0)->mutable_image()->set_content_hash(
      std::string(64, 'a'));
  s = Chat(g, unknown, &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StartsWith(s.error_message(), "image 1: content hash not cached")) << s.error_message();

  // Streaming: two chunks arrive, then the failure with its meaning.
  grpc::ClientContext ctx;
  auto reader = g.stub().ChatStream(&ctx, Request("die"));
  v1::ChatChunk chunk;
  std::string text;
  while (reader->Read(&chunk)) text += chunk.text();
  s = reader->Finish();
  EXPECT_EQ(text, "one two ");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(s.error_message(), absl::StrCat("language service unavailable (", language_server_.target(),
                                            "): Socket closed (after 2 streamed chunks)"));

  // Validation happens before any backend call.
  const int calls = vision_a_.calls();
  s = Chat(g, Request("hi", {"1", "2", "3", "4"}), &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "request has 4 images; max_images_per_request is 3");
  EXPECT_EQ(vision_a_.calls(), calls);
}

TEST_F(GatewayFakeTest, DeadlinePropagatesAndCancellationStopsTheBackend) {
  Gateway g({server_a_.target()}, language_server_.target());
  ASSERT_TRUE(g.WaitServing());
  const absl::Time client_deadline = absl::Now() + absl::Milliseconds(300);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(client_deadline));
  v1::ChatResponse r;
  grpc::Status s = g.stub().Chat(&ctx, Request("slow 500"), &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_LE(absl::FromChrono(language_.last_deadline()), client_deadline + absl::Milliseconds(5));
  EXPECT_TRUE(Eventually([&] { return language_.running() == 0; }, absl::Seconds(2)))
      << "the backend generation must stop at the deadline";
  EXPECT_EQ(language_.stopped_early(), 1);

  grpc::ClientContext stream_ctx;
  auto reader = g.stub().ChatStream(&stream_ctx, Request("slow 500"));
  v1::ChatChunk chunk;
  ASSERT_TRUE(reader->Read(&chunk));
  ASSERT_TRUE(reader->Read(&chunk));
  stream_ctx.TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(Eventually([&] { return language_.stopped_early() == 2; }, absl::Seconds(2)));
  EXPECT_EQ(language_.running(), 0);

  // A unary call has no write to fail: only propagation can stop the backend.
  grpc::ClientContext unary_ctx;
  std::thread cancel([&] {
    EXPECT_TRUE(Eventually([&] { return language_.running() == 1; }));
    unary_ctx.TryCancel();
  });
  s = g.stub().Chat(&unary_ctx, Request("slow 500"), &r);
  cancel.join();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(Eventually([&] { return language_.stopped_early() == 3; }, absl::Seconds(2)));
  EXPECT_EQ(language_.running(), 0);
}

TEST_F(GatewayFakeTest, AdmissionRefusesBeyondTheQueueAndHealthStaysFast) {
  Gateway g({server_a_.target()}, language_server_.target(), /*max_inflight=*/2, /*max_queue=*/1);
  ASSERT_TRUE(g.WaitServing());
  std::vector<std::thread> busy;
  std::atomic<int> ok{0};
  for (int i = 0; i < 3; ++i) {
    busy.emplace_back([&] {
      v1::ChatResponse r;
      if (Chat(g, Request("slow 25"), &r).ok()) ok.fetch_add(1);
    });
  }
  ASSERT_TRUE(Eventually([&] { return language_.running() == 2; }));
  ASSERT_TRUE(Eventually([&] { return g.admission().queued() == 1; }));
  v1::ChatResponse r;
  grpc::Status s = Chat(g, Request("hi"), &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "max_inflight=2")) << s.error_message();
  for (int i = 0; i < 5; ++i) {
    const absl::Time start = absl::Now();
    EXPECT_EQ(g.Health(), "SERVING");
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(50));
  }
  for (auto& t : busy) t.join();
  EXPECT_EQ(ok.load(), 3);  // the queued one ran after a slot freed
}

// Language replicas that serve another model (their fingerprint differs from
// the majority's), speak an older protocol (no ReplicaInfo) or are not a
// language service at all are never routed to, and the gateway says why.
TEST(GatewayLanguageReplicasTest, AnotherModelOrProtocolIsNotRoutedToAndIsReported) {
  FakeVision vision("vision");
  FakeServer vision_server(&vision, "vlm.v1.VisionEncoder");
  FakeLanguage same_1, same_2, other("other-model");
  LanguageWithoutInfo old;
  FakeServer s1(&same_1, "vlm.v1.Language"), s2(&same_2, "vlm.v1.Language"),
      s_other(&other, "vlm.v1.Language"), s_old(&old, "vlm.v1.Language");
  Gateway g({vision_server.target()},
            std::vector<std::string>{s1.target(), s2.target(), s_other.target(), s_old.target(),
                                     vision_server.target()});
  ASSERT_TRUE(g.WaitServing());
  std::map<std::string, BackendState> states;
  ASSERT_TRUE(Eventually([&] {
    states.clear();
    for (const BackendState& s : g.language().Replicas()) states[s.name] = s;
    return states[s1.target()].status == BackendStatus::kServing &&
           states[s2.target()].status == BackendStatus::kServing &&
           absl::StrContains(states[s_other.target()].detail, "serves another model") &&
           absl::StrContains(states[s_old.target()].detail, "does not answer") &&
           absl::StrContains(states[vision_server.target()].detail, "does not serve vlm.v1.Language");
  })) << states[s_other.target()].detail << " / " << states[s_old.target()].detail << " / "
      << states[vision_server.target()].detail;
  std::set<std::string> used;
  for (int i = 0; i < 12; ++i) {
    v1::ChatResponse r;
    ASSERT_TRUE(Chat(g, Request(absl::StrCat("conversation ", i)), &r).ok());
    used.insert(r.language().replica());
    EXPECT_EQ(r.language().route(), "affinity");
    EXPECT_EQ(r.language().attempts(), 1);
  }
  EXPECT_EQ(used, (std::set<std::string>{s1.target(), s2.target()}));
  EXPECT_EQ(other.generates(), 0);
  const std::string metrics = RenderMetrics();
  EXPECT_EQ(metrics_text::MetricValue(metrics, absl::StrCat("vlm_gateway_backend_serving{backend=\"language\",target=\"",
                                                            s_other.target(), "\"}")),
            std::optional<double>(0));
  EXPECT_EQ(metrics_text::MetricValue(metrics, absl::StrCat("vlm_gateway_backend_serving{backend=\"language\",target=\"",
                                                            s1.target(), "\"}")),
            std::optional<double>(1));
}

// A replica that fails UNAVAILABLE before the first token (it went away
// between two health updates) hands the request to the next in hash order.
TEST(GatewayLanguageReplicasTest, UnavailableBeforeTheFirstTokenFailsOverToTheNextReplica) {
  FakeVision vision("vision");
  FakeServer vision_server(&vision, "vlm.v1.VisionEncoder");
  FakeLanguage failing, healthy;
  FakeServer s_failing(&failing, "vlm.v1.Language"), s_healthy(&healthy, "vlm.v1.Language");
  Gateway g({vision_server.target()}, std::vector<std::string>{s_failing.target(), s_healthy.target()});
  ASSERT_TRUE(g.WaitServing());
  ASSERT_TRUE(Eventually([&] { return g.language().Route("k").order.size() == 2; }));
  failing.set_unavailable(true);
  // A conversation whose home is the failing replica.
  v1::ChatRequest request;
  for (int i = 0;; ++i) {
    request = Request(absl::StrCat("question ", i));
    const std::string key = ConversationRouteKey(request, {});
    if (RendezvousOrder(key, {s_failing.target(), s_healthy.target()})[0] == s_failing.target()) break;
  }
  v1::ChatResponse r;
  ASSERT_TRUE(Chat(g, request, &r).ok());
  EXPECT_EQ(r.language().replica(), s_healthy.target());
  EXPECT_EQ(r.language().route(), "failover");
  EXPECT_EQ(r.language().attempts(), 2);
  EXPECT_EQ(failing.generates(), 1);
  // Its next turn goes where it was served, not back to the failing home.
  failing.set_unavailable(false);
  auto* answer = request.add_messages();
  answer->set_role("assistant");
  answer->add_content()->set_text(r.text());
  auto* next = request.add_messages();
  next->set_role("user");
  next->add_content()->set_text("and then?");
  ASSERT_TRUE(Chat(g, request, &r).ok());
  EXPECT_EQ(r.language().replica(), s_healthy.target());
  EXPECT_EQ(r.language().route(), "affinity");
  EXPECT_EQ(failing.generates(), 1);
  // With every replica failing, the error names the last one tried.
  failing.set_unavailable(true);
  healthy.set_unavailable(true);
  grpc::Status s = Chat(g, Request("anyone?"), &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StartsWith(s.error_message(), "language service unavailable (")) << s.error_message();
}

}  // namespace
}  // namespace vlm::gateway
