// The whole system on loopback: two vlm-vision replicas, vlm-language and
// vlm-gateway as real processes on the tiny checkpoint, driven through the
// public API. One process set is shared by the suite (started once, about a
// second each); tests that kill a service restart it before they end.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <png.h>
#include <signal.h>
#include <webp/encode.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/sha256.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "services/gateway/router.h"
#include "tests/integration/chat_request.h"
#include "tests/integration/service_process.h"
#include "tests/unit/metrics_text.h"
#include "vlm/v1/gateway.grpc.pb.h"

namespace vlm {
namespace {

using testing::Eventually;
using testing::ServiceProcess;

// --- images ------------------------------------------------------------------

struct Pixels {
  int width = 96;
  int height = 64;
  std::vector<uint8_t> rgb;
};

// A deterministic picture per seed; different seeds give different pixels.
Pixels MakePixels(int seed, int width = 96, int height = 64) {
  Pixels p;
  p.width = width;
  p.height = height;
  p.rgb.resize(static_cast<size_t>(width) * height * 3);
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      uint8_t* px = &p.rgb[(static_cast<size_t>(y) * width + x) * 3];
      px[0] = static_cast<uint8_t>(x * 7 + seed * 31);
      px[1] = static_cast<uint8_t>(y * 5 + seed * 17);
      px[2] = static_cast<uint8_t>((x ^ y) * 3 + seed * 13);
    }
  }
  return p;
}

std::string Png(const Pixels& p) {
  png_image image = {};
  image.version = PNG_IMAGE_VERSION;
  image.width = p.width;
  image.height = p.height;
  image.format = PNG_FORMAT_RGB;
  png_alloc_size_t size = 0;
  png_image_write_to_memory(&image, nullptr, &size, 0, p.rgb.data(), 0, nullptr);
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&image, out.data(), &size, 0, p.rgb.data(), 0, nullptr)) return "";
  out.resize(size);
  return out;
}

std::string LosslessWebp(const Pixels& p) {
  uint8_t* data = nullptr;
  const size_t size = WebPEncodeLosslessRGB(p.rgb.data(), p.width, p.height, p.width * 3, &data);
  std::string out(reinterpret_cast<const char*>(data), size);
  WebPFree(data);
  return out;
}

// --- clients -----------------------------------------------------------------

std::string Metrics(int port) {
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(5, 0);
  auto res = client.Get("/metrics");
  return res && res->status == 200 ? res->body : "";
}

double Metric(int port, const std::string& key) {
  return metrics_text::MetricValue(Metrics(port), key).value_or(0);
}

v1::ChatRequest Request(const std::string& text, const std::vector<std::string>& images = {},
                        int max_tokens = 12) {
  return testing::GreedyChat(text, images, max_tokens);
}

v1::ChatRequest LongRequest() { return testing::EndlessChat(); }

// --- the process set -----------------------------------------------------------

// Long enough for the gateway to start and sample a few times while the
// language service warms up, on a machine shared with parallel builds.
constexpr int kWarmupDelayMs = 4000;

struct WarmupRecord {
  bool language_was_not_serving = false;
  bool gateway_served_before_language = false;
  int not_serving_samples_with_vision_up = 0;  // gateway NOT_SERVING, vision up, language warming
  bool chatted_while_warming = false;  // a Chat call began and ended within the warm-up
  grpc::Status chat_while_warming;
  bool became_serving = false;
};

class GatewayTest : public ::testing::Test {
 protected:
  static std::unique_ptr<ServiceProcess> StartVision(const std::string& name, int port = 0) {
    return std::make_unique<ServiceProcess>(
        VLM_VISION_PATH,
        std::vector<std::string>{"--model_dir=" + model_dir_,
                                 absl::StrCat("--grpc_address=127.0.0.1:", port),
                                 "--metrics_address=127.0.0.1:0", "--replica_name=" + name,
                                 "--intra_op_threads=1", "--drain_timeout_s=2"},
        log_dir_ + "/" + name);
  }

  static std::unique_ptr<ServiceProcess> StartLanguage(int port, int warmup_delay_ms) {
    return std::make_unique<ServiceProcess>(
        VLM_LANGUAGE_PATH,
        std::vector<std::string>{"--model_dir=" + model_dir_,
                                 absl::StrCat("--grpc_address=127.0.0.1:", port),
                                 "--metrics_address=127.0.0.1:0", "--intra_op_threads=1",
                                 "--max_sequences=1", "--max_queue=8", "--drain_timeout_s=2"},
        log_dir_ + "/language",
        std::vector<std::string>{absl::StrCat("VLM_TEST_WARMUP_DELAY_MS=", warmup_delay_ms)});
  }

  static void SetUpTestSuite() {
    const char* binary_dir = std::getenv("VLM_BINARY_DIR");
    ASSERT_NE(binary_dir, nullptr) << "run through ctest (VLM_BINARY_DIR)";
    model_dir_ = std::string(binary_dir) + "/tiny_checkpoint";
    log_dir_ = testing::TestLogDir("gateway_test");

    // The vision replicas first, up to SERVING, so that their start-up does not
    // use up the language service's warm-up window (it opens when vlm-language
    // listens); the gateway right after the language service listens.
    vision_a_ = StartVision("vision-a");
    vision_b_ = StartVision("vision-b");
    for (ServiceProcess* v : {vision_a_.get(), vision_b_.get()}) {
      ASSERT_TRUE(v->WaitListening()) << v->LogTail();
      ASSERT_TRUE(v->WaitServing("vlm.v1.VisionEncoder")) << v->LogTail();
    }
    language_ = StartLanguage(0, kWarmupDelayMs);
    ASSERT_TRUE(language_->WaitListening()) << language_->LogTail();
    gateway_ = std::make_unique<ServiceProcess>(
        VLM_GATEWAY_PATH,
        std::vector<std::string>{
            "--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
            "--http_address=127.0.0.1:0",
            "--language_target=" + language_->grpc_target(),
            "--vision_targets=" + vision_a_->grpc_target() + "," + vision_b_->grpc_target(),
            "--backend_reconnect_max_ms=200", "--drain_timeout_s=2"},
        log_dir_ + "/gateway");
    ASSERT_TRUE(gateway_->WaitListening()) << gateway_->LogTail();
    stub_ = v1::VisionLanguage::NewStub(
        grpc::CreateChannel(gateway_->grpc_target(), grpc::InsecureChannelCredentials()));

    // Readiness during the language warm-up. Gateway first, then language:
    // a SERVING gateway must then see a SERVING language. Only an explicit
    // NOT_SERVING counts as warming up: a health call that failed (its 2 s
    // deadline on a starved machine) says nothing about the language service.
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    while (absl::Now() < give_up) {
      const std::string gateway = gateway_->Health();
      const std::string language = language_->Health("vlm.v1.Language");
      const bool vision_up = vision_a_->Health("vlm.v1.VisionEncoder") == "SERVING";
      if (language == "NOT_SERVING") {
        warmup_.language_was_not_serving = true;
        if (gateway == "SERVING") warmup_.gateway_served_before_language = true;
        if (gateway == "NOT_SERVING" && vision_up) {
          ++warmup_.not_serving_samples_with_vision_up;
          if (!warmup_.chatted_while_warming) {
            grpc::ClientContext ctx;
            ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
            v1::ChatResponse response;
            const grpc::Status chat = stub_->Chat(&ctx, Request("hello"), &response);
            // The warm-up may end between the sample and the call: the call
            // counts only if the language service still warms up after it.
            if (language_->Health("vlm.v1.Language") == "NOT_SERVING") {
              warmup_.chat_while_warming = chat;
              warmup_.chatted_while_warming = true;
            }
          }
        }
      }
      if (gateway == "SERVING") {
        warmup_.became_serving = true;
        break;
      }
      absl::SleepFor(absl::Milliseconds(25));
    }
  }

  static void TearDownTestSuite() {
    stub_.reset();
    // SIGTERM: every service drains and exits 0.
    for (auto* p : {&gateway_, &vision_a_, &vision_b_, &language_}) {
      if (*p == nullptr) continue;
      std::optional<int> code = (*p)->Stop(SIGTERM, absl::Seconds(20));
      EXPECT_EQ(code, std::optional<int>(0)) << (*p)->LogTail();
      p->reset();
    }
  }

  void TearDown() override {
    if (HasFailure()) {
      for (auto* p : {&gateway_, &vision_a_, &vision_b_, &language_}) {
        if (*p != nullptr) std::fprintf(stderr, "--- log tail ---\n%s", (*p)->LogTail(15).c_str());
      }
    }
  }

  static grpc::Status Chat(const v1::ChatRequest& request, v1::ChatResponse* response,
                           absl::Duration deadline = absl::Seconds(60)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    return stub_->Chat(&ctx, request, response);
  }

  // Streams; returns the status, the deltas and the last chunk.
  static grpc::Status Stream(const v1::ChatRequest& request, std::vector<v1::ChatChunk>* chunks) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    auto reader = stub_->ChatStream(&ctx, request);
    v1::ChatChunk chunk;
    while (reader->Read(&chunk)) chunks->push_back(chunk);
    return reader->Finish();
  }

  // Vision replica name -> process, and target -> name.
  static ServiceProcess* Replica(const std::string& name) {
    return name == "vision-a" ? vision_a_.get() : vision_b_.get();
  }
  static std::string HomeReplica(const std::string& image_bytes) {
    const std::string home = gateway::RendezvousOrder(
        Sha256Hex(image_bytes), {vision_a_->grpc_target(), vision_b_->grpc_target()})[0];
    return home == vision_a_->grpc_target() ? "vision-a" : "vision-b";
  }
  static bool GatewayServing(absl::Duration timeout = absl::Seconds(60)) {
    return gateway_->WaitServing("", timeout);
  }

  static inline std::string model_dir_;
  static inline std::string log_dir_;
  static inline std::unique_ptr<ServiceProcess> vision_a_;
  static inline std::unique_ptr<ServiceProcess> vision_b_;
  static inline std::unique_ptr<ServiceProcess> language_;
  static inline std::unique_ptr<ServiceProcess> gateway_;
  static inline std::unique_ptr<v1::VisionLanguage::Stub> stub_;
  static inline WarmupRecord warmup_;
};

TEST_F(GatewayTest, NotServingUntilTheLanguageServiceHasWarmedUp) {
  EXPECT_TRUE(warmup_.language_was_not_serving) << "the warm-up delay was not observed";
  EXPECT_FALSE(warmup_.gateway_served_before_language);
  EXPECT_GT(warmup_.not_serving_samples_with_vision_up, 0)
      << "never saw vision up while language warmed up";
  ASSERT_TRUE(warmup_.chatted_while_warming) << "no Chat call fell inside the warm-up";
  EXPECT_EQ(warmup_.chat_while_warming.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(warmup_.chat_while_warming.error_message(), "language service"))
      << warmup_.chat_while_warming.error_message();
  EXPECT_TRUE(warmup_.became_serving);
  EXPECT_EQ(gateway_->Health("vlm.v1.VisionLanguage"), "SERVING");
  std::printf("warm-up: %d NOT_SERVING samples with vision up; chat meanwhile: %s\n",
              warmup_.not_serving_samples_with_vision_up,
              warmup_.chat_while_warming.error_message().c_str());
}

TEST_F(GatewayTest, TextOneImageAndTwoImageChatsUnaryAndStreaming) {
  ASSERT_TRUE(GatewayServing());
  const std::vector<std::vector<std::string>> cases = {
      {}, {Png(MakePixels(1))}, {Png(MakePixels(2)), Png(MakePixels(3, 64, 128))}};
  for (const auto& images : cases) {
    SCOPED_TRACE(absl::StrCat(images.size(), " images"));
    const v1::ChatRequest request = Request("Describe what you see.", images);
    v1::ChatResponse unary;
    grpc::Status s = Chat(request, &unary);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_NE(unary.finish_reason(), v1::FINISH_REASON_UNSPECIFIED);
    EXPECT_GE(unary.usage().completion_tokens(), 1);
    EXPECT_LE(unary.usage().completion_tokens(), 12);
    EXPECT_EQ(unary.usage().total_tokens(),
              unary.usage().prompt_tokens() + unary.usage().completion_tokens());
    ASSERT_EQ(unary.images_size(), static_cast<int>(images.size()));
    int image_tokens = 0;
    for (int i = 0; i < unary.images_size(); ++i) {
      const v1::ImageResult& im = unary.images(i);
      EXPECT_EQ(im.content_hash(), Sha256Hex(images[i]));
      EXPECT_EQ(im.tokens(), im.grid().t() * im.grid().h() * im.grid().w() / 4);
      EXPECT_EQ(im.replica(), HomeReplica(images[i]));
      EXPECT_GT(im.vision_ms(), 0);
      image_tokens += im.tokens();
    }
    if (images.size() == 2) {
      // 96x64 -> 4x6 patches (6 tokens); 64x128 -> 8x4 patches (8 tokens).
      EXPECT_EQ(unary.images(0).grid().h(), 4);
      EXPECT_EQ(unary.images(0).grid().w(), 6);
      EXPECT_EQ(unary.images(1).tokens(), 8);
    }
    EXPECT_EQ(unary.usage().image_tokens(), image_tokens);
    EXPECT_GT(unary.usage().prompt_tokens(), image_tokens);
    EXPECT_GT(unary.timings().total_ms(), 0);
    EXPECT_GT(unary.timings().prefill_ms(), 0);
    EXPECT_GT(unary.timings().first_token_ms(), 0);
    if (!images.empty()) {
      EXPECT_GT(unary.timings().vision_ms(), 0);
    }
    EXPECT_FALSE(unary.request_id().empty());

    // Streaming gives the same greedy text, in order, with the totals last.
    std::vector<v1::ChatChunk> chunks;
    s = Stream(request, &chunks);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_GE(chunks.size(), 2u);
    std::string text;
    for (size_t i = 0; i < chunks.size(); ++i) {
      text += chunks[i].text();
      const bool last = i + 1 == chunks.size();
      EXPECT_EQ(chunks[i].finish_reason() != v1::FINISH_REASON_UNSPECIFIED, last) << i;
      EXPECT_EQ(chunks[i].has_usage(), last) << i;
    }
    EXPECT_EQ(text, unary.text());
    const v1::ChatChunk& last = chunks.back();
    EXPECT_EQ(last.finish_reason(), unary.finish_reason());
    EXPECT_EQ(last.usage().completion_tokens(), unary.usage().completion_tokens());
    EXPECT_EQ(last.usage().prompt_tokens(), unary.usage().prompt_tokens());
    EXPECT_EQ(last.images_size(), unary.images_size());
    if (!images.empty()) {
      EXPECT_NE(last.images(0).cache(), v1::CACHE_LEVEL_MISS);  // the second time
    }
  }
}

TEST_F(GatewayTest, SameImageTwiceIsACacheHitInResponseAndVisionMetrics) {
  ASSERT_TRUE(GatewayServing());
  const std::string image = Png(MakePixels(100));
  v1::ChatResponse first;
  ASSERT_TRUE(Chat(Request("What is this?", {image}), &first).ok());
  EXPECT_EQ(first.images(0).cache(), v1::CACHE_LEVEL_MISS);
  ServiceProcess* replica = Replica(first.images(0).replica());
  const double hits = Metric(replica->metrics_port, R"(vlm_vision_cache_hits_total{level="memory"})");
  v1::ChatResponse second;
  ASSERT_TRUE(Chat(Request("And now?", {image}), &second).ok());
  EXPECT_EQ(second.images(0).cache(), v1::CACHE_LEVEL_MEMORY);
  EXPECT_EQ(second.images(0).replica(), first.images(0).replica());
  EXPECT_EQ(second.images(0).content_hash(), first.images(0).content_hash());
  EXPECT_EQ(Metric(replica->metrics_port, R"(vlm_vision_cache_hits_total{level="memory"})"),
            hits + 1);

  // The same pixels as PNG, then as lossless WebP: the pixel-level key hits.
  // (Different bytes hash differently; pick a picture whose two files share a
  // home replica, where that replica's pixel key lives.)
  int seed = 200;
  while (HomeReplica(Png(MakePixels(seed))) != HomeReplica(LosslessWebp(MakePixels(seed)))) ++seed;
  const std::string png = Png(MakePixels(seed));
  const std::string webp = LosslessWebp(MakePixels(seed));
  ASSERT_NE(png, webp);
  v1::ChatResponse as_png, as_webp;
  ASSERT_TRUE(Chat(Request("Look.", {png}), &as_png).ok());
  replica = Replica(as_png.images(0).replica());
  const double pixel_hits = Metric(replica->metrics_port, R"(vlm_vision_cache_hits_total{level="pixels"})");
  ASSERT_TRUE(Chat(Request("Look.", {webp}), &as_webp).ok());
  EXPECT_EQ(as_png.images(0).cache(), v1::CACHE_LEVEL_MISS);
  EXPECT_EQ(as_webp.images(0).cache(), v1::CACHE_LEVEL_PIXELS);
  EXPECT_NE(as_webp.images(0).content_hash(), as_png.images(0).content_hash());
  EXPECT_EQ(Metric(replica->metrics_port, R"(vlm_vision_cache_hits_total{level="pixels"})"),
            pixel_hits + 1);
  // Same pixels, same features: the greedy answers agree.
  EXPECT_EQ(as_webp.text(), as_png.text());
}

TEST_F(GatewayTest, ImagesStickToTheirReplicaAndFailOverWhenItDies) {
  ASSERT_TRUE(GatewayServing());
  std::set<std::string> homes;
  std::string victim_image;  // an image whose home is vision-a
  for (int seed = 300; homes.size() < 2 || seed < 306; ++seed) {
    const std::string image = Png(MakePixels(seed));
    const std::string home = HomeReplica(image);
    for (int repeat = 0; repeat < 2; ++repeat) {
      v1::ChatResponse r;
      ASSERT_TRUE(Chat(Request("Hi.", {image}, 2), &r).ok());
      EXPECT_EQ(r.images(0).replica(), home) << "seed " << seed;
      EXPECT_EQ(r.images(0).cache(), repeat == 0 ? v1::CACHE_LEVEL_MISS : v1::CACHE_LEVEL_MEMORY);
    }
    homes.insert(home);
    if (home == "vision-a" && victim_image.empty()) victim_image = image;
  }
  ASSERT_FALSE(victim_image.empty());

  // vision-a dies: its images go to vision-b and the requests still succeed.
  const int port_a = vision_a_->grpc_port;
  vision_a_->Stop(SIGKILL);
  for (int repeat = 0; repeat < 2; ++repeat) {
    v1::ChatResponse r;
    grpc::Status s = Chat(Request("Hi.", {victim_image}, 2), &r);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(r.images(0).replica(), "vision-b");
    EXPECT_EQ(r.images(0).cache(), repeat == 0 ? v1::CACHE_LEVEL_MISS : v1::CACHE_LEVEL_MEMORY);
  }
  EXPECT_EQ(gateway_->Health(), "SERVING");  // one replica is enough

  // Back on its port, vision-a gets its images back (a cold cache: a miss).
  vision_a_ = StartVision("vision-a", port_a);
  ASSERT_TRUE(vision_a_->WaitListening()) << vision_a_->LogTail();
  ASSERT_TRUE(vision_a_->WaitServing("vlm.v1.VisionEncoder", absl::Seconds(60)))
      << vision_a_->LogTail();
  v1::ChatResponse r;
  ASSERT_TRUE(Eventually(
      [&] {
        return Chat(Request("Hi.", {victim_image}, 2), &r).ok() &&
               r.images(0).replica() == "vision-a";
      },
      absl::Seconds(10)));
}

TEST_F(GatewayTest, DeadlineExceededFreesTheLanguageSlot) {
  ASSERT_TRUE(GatewayServing());
  v1::ChatResponse r;
  const absl::Time start = absl::Now();
  grpc::Status s = Chat(LongRequest(), &r, absl::Milliseconds(400));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  // The language service stops that generation and frees its only slot.
  EXPECT_TRUE(Eventually(
      [] { return Metric(language_->metrics_port, "vlm_language_sequences_running") == 0; },
      absl::Seconds(3)));
  s = Chat(Request("Hello"), &r, absl::Seconds(30));
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(GatewayTest, CancelledStreamStopsTheGeneration) {
  ASSERT_TRUE(GatewayServing());
  const int port = language_->metrics_port;
  const std::string cancelled = R"(vlm_language_generations_total{finish_reason="cancelled"})";
  const double before = Metric(port, cancelled);
  const double tokens_before = Metric(port, "vlm_language_generated_tokens_total");
  grpc::ClientContext ctx;
  auto reader = stub_->ChatStream(&ctx, LongRequest());
  v1::ChatChunk chunk;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(reader->Read(&chunk));
  ctx.TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(Eventually([&] { return Metric(port, cancelled) == before + 1; }, absl::Seconds(3)))
      << Metrics(port);
  EXPECT_EQ(Metric(port, "vlm_language_sequences_running"), 0);
  EXPECT_LT(Metric(port, "vlm_language_generated_tokens_total") - tokens_before, 4000);
}

TEST_F(GatewayTest, HealthIsAnsweredWithin50msWhileLanguageIsSaturated) {
  ASSERT_TRUE(GatewayServing());
  // Three long generations against one sequence slot: one runs, two queue.
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::thread> streams;
  for (int i = 0; i < 3; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    streams.emplace_back([ctx = contexts.back().get()] {
      auto reader = stub_->ChatStream(ctx, LongRequest());
      v1::ChatChunk chunk;
      while (reader->Read(&chunk)) {
      }
      reader->Finish();
    });
  }
  const int port = language_->metrics_port;
  ASSERT_TRUE(Eventually(
      [&] {
        return Metric(port, "vlm_language_sequences_running") == 1 &&
               Metric(port, "vlm_language_queue_depth") == 2;
      },
      absl::Seconds(10)));
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(gateway_->grpc_target(), grpc::InsecureChannelCredentials()));
  std::vector<double> ms;
  for (int i = 0; i < 20; ++i) {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse resp;
    const absl::Time t0 = absl::Now();
    ASSERT_TRUE(stub->Check(&ctx, req, &resp).ok());
    ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
    absl::SleepFor(absl::Milliseconds(10));
  }
  for (auto& c : contexts) c->TryCancel();
  for (auto& t : streams) t.join();
  std::sort(ms.begin(), ms.end());
  EXPECT_LT(ms[ms.size() * 9 / 10], 50) << "p90 of 20 health checks, ms; max " << ms.back();
  std::printf("gateway health under saturation: median %.2f ms, max %.2f ms\n", ms[ms.size() / 2],
              ms.back());
  EXPECT_TRUE(Eventually([&] { return Metric(port, "vlm_language_sequences_running") == 0; },
                         absl::Seconds(5)));
}

TEST_F(GatewayTest, LanguageKilledMidStreamIsUnavailableAndRecoversAfterRestart) {
  ASSERT_TRUE(GatewayServing());
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  auto reader = stub_->ChatStream(&ctx, LongRequest());
  v1::ChatChunk chunk;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(reader->Read(&chunk));
  const int port = language_->grpc_port;
  language_->Stop(SIGKILL);
  while (reader->Read(&chunk)) {
  }
  grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StartsWith(s.error_message(), absl::StrCat("language service unavailable (",
                                                              language_->grpc_target(), "): ")))
      << s.error_message();
  EXPECT_TRUE(Eventually(
      [] { return gateway_->Health() == "NOT_SERVING"; }, absl::Seconds(5)));
  v1::ChatResponse r;
  s = Chat(Request("Hello"), &r, absl::Seconds(5));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);

  language_ = StartLanguage(port, 0);
  ASSERT_TRUE(language_->WaitListening()) << language_->LogTail();
  ASSERT_TRUE(GatewayServing(absl::Seconds(30)));
  s = Chat(Request("Hello again"), &r);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_GE(r.usage().completion_tokens(), 1);
}

}  // namespace
}  // namespace vlm
