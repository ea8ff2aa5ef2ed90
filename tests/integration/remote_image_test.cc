// Remote image URLs through the real processes on loopback (vlm-vision,
// vlm-language, vlm-gateway on the tiny checkpoint) and an image server on
// 127.0.0.1 started by the test:
//
// - a gateway with --allow_remote_images refuses the loopback URL with a 400
//   naming the image, and its image server sees no request;
// - the same gateway with the test-only VLM_TEST_ALLOW_LOOPBACK_IMAGES=1
//   serves it; its limits (size, type, status), redirects re-checked per hop,
//   and several images arriving in the request's order;
// - the test-only variable does not turn fetching on without the flag.
//
// No request leaves loopback: refused targets are loopback or 0.0.0.0.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/sha256.h"
#include "tests/integration/service_process.h"
#include "tests/integration/test_png.h"

namespace vlm {
namespace {

using json = nlohmann::json;
using testing::Eventually;
using testing::ServiceProcess;

constexpr char kParam[] = "messages[0].content[1].image_url.url";

int HttpPort(const ServiceProcess& p) { return testing::GatewayHttpPort(p.Stdout()); }

struct Gateway {
  std::unique_ptr<ServiceProcess> process;
  int port = 0;
};

class RemoteImageHttpTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* binary_dir = std::getenv("VLM_BINARY_DIR");
    ASSERT_NE(binary_dir, nullptr) << "run through ctest (VLM_BINARY_DIR)";
    model_dir_ = std::string(binary_dir) + "/tiny_checkpoint";
    log_dir_ = testing::TestLogDir("remote_image_http_test");

    cat_ = testing::PatternPng(96, 64, 11);
    dog_ = testing::PatternPng(64, 128, 12);
    images_ = new httplib::Server();
    images_->set_pre_routing_handler([](const httplib::Request&, httplib::Response&) {
      absl::MutexLock lock(&hits_mu_);
      ++hits_;
      return httplib::Server::HandlerResponse::Unhandled;
    });
    images_->Get("/cat.png", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(cat_, "image/png");
    });
    images_->Get("/dog.png", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(dog_, "image/png");
    });
    images_->Get("/note.txt", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("just text", "text/plain");
    });
    images_->Get("/huge.png", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(cat_ + std::string(200000, '\0'), "image/png");
    });
    images_->Get("/moved.png", [](const httplib::Request&, httplib::Response& res) {
      res.status = 301;
      res.set_header("Location", "/cat.png");
    });
    images_->Get("/to-unspecified.png", [](const httplib::Request&, httplib::Response& res) {
      res.status = 302;
      res.set_header("Location", absl::StrCat("http://0.0.0.0:", images_port_, "/cat.png"));
    });
    images_port_ = images_->bind_to_any_port("127.0.0.1");
    ASSERT_GT(images_port_, 0);
    images_thread_ = new std::thread([] { images_->listen_after_bind(); });

    vision_ = std::make_unique<ServiceProcess>(
        VLM_VISION_PATH,
        std::vector<std::string>{"--model_dir=" + model_dir_, "--grpc_address=127.0.0.1:0",
                                 "--metrics_address=127.0.0.1:0", "--intra_op_threads=1",
                                 "--drain_timeout_s=2"},
        log_dir_ + "/vision");
    language_ = std::make_unique<ServiceProcess>(
        VLM_LANGUAGE_PATH,
        std::vector<std::string>{"--model_dir=" + model_dir_, "--grpc_address=127.0.0.1:0",
                                 "--metrics_address=127.0.0.1:0", "--intra_op_threads=1",
                                 "--drain_timeout_s=2"},
        log_dir_ + "/language");
    ASSERT_TRUE(vision_->WaitListening()) << vision_->LogTail();
    ASSERT_TRUE(language_->WaitListening()) << language_->LogTail();

    // What a deployment runs: the flag, no test setting.
    guarded_ = StartGateway("gateway-guarded", {"--allow_remote_images"}, {});
    // The test-only setting lets the loopback image server through.
    loopback_ = StartGateway("gateway-loopback",
                             {"--allow_remote_images", "--max_image_bytes=100000"},
                             {"VLM_TEST_ALLOW_LOOPBACK_IMAGES=1"});
    // The test setting alone does not turn fetching on.
    off_ = StartGateway("gateway-off", {}, {"VLM_TEST_ALLOW_LOOPBACK_IMAGES=1"});
    for (Gateway* g : {&guarded_, &loopback_, &off_}) {
      ASSERT_TRUE(g->process->WaitListening()) << g->process->LogTail();
      ASSERT_TRUE(Eventually([&] { return HttpPort(*g->process) > 0; }, absl::Seconds(5)));
      g->port = HttpPort(*g->process);
      ASSERT_TRUE(Eventually(
          [&] {
            httplib::Client c("127.0.0.1", g->port);
            auto r = c.Get("/health");
            return r && r->status == 200;
          },
          absl::Seconds(60)))
          << g->process->LogTail();
    }
  }

  static void TearDownTestSuite() {
    for (Gateway* g : {&guarded_, &loopback_, &off_}) {
      if (g->process == nullptr) continue;
      EXPECT_EQ(g->process->Stop(SIGTERM, absl::Seconds(20)), std::optional<int>(0))
          << g->process->LogTail();
      g->process.reset();
    }
    for (auto* p : {&vision_, &language_}) {
      if (*p == nullptr) continue;
      EXPECT_EQ((*p)->Stop(SIGTERM, absl::Seconds(20)), std::optional<int>(0)) << (*p)->LogTail();
      p->reset();
    }
    if (images_ != nullptr) images_->stop();
    if (images_thread_ != nullptr) images_thread_->join();
    delete images_thread_;
    delete images_;
    images_thread_ = nullptr;
    images_ = nullptr;
  }

  void TearDown() override {
    if (!HasFailure()) return;
    for (Gateway* g : {&guarded_, &loopback_, &off_}) {
      if (g->process != nullptr) {
        std::fprintf(stderr, "--- log tail ---\n%s", g->process->LogTail(15).c_str());
      }
    }
  }

  static Gateway StartGateway(const std::string& name, std::vector<std::string> extra,
                              std::vector<std::string> env) {
    std::vector<std::string> flags = {
        "--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
        "--http_address=127.0.0.1:0", "--model_dir=" + model_dir_,
        "--language_target=" + language_->grpc_target(),
        "--vision_targets=" + vision_->grpc_target(), "--backend_reconnect_max_ms=200",
        "--drain_timeout_s=2"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    Gateway g;
    g.process = std::make_unique<ServiceProcess>(VLM_GATEWAY_PATH, flags, log_dir_ + "/" + name,
                                                 std::move(env));
    return g;
  }

  static std::string ImageUrl(const std::string& path, const std::string& host = "127.0.0.1") {
    return absl::StrCat("http://", host, ":", images_port_, path);
  }

  // A chat request with a text part and one image part per URL.
  static httplib::Result Ask(const Gateway& g, const std::vector<std::string>& urls) {
    json content = json::array({{{"type", "text"}, {"text", "What is this?"}}});
    for (const std::string& url : urls) {
      content.push_back({{"type", "image_url"}, {"image_url", {{"url", url}}}});
    }
    const json body = {{"model", "tiny_checkpoint"},
                       {"messages", json::array({{{"role", "user"}, {"content", content}}})},
                       {"max_tokens", 2},
                       {"temperature", 0}};
    httplib::Client client("127.0.0.1", g.port);
    client.set_read_timeout(60, 0);
    return client.Post("/v1/chat/completions", body.dump(), "application/json");
  }

  static int Hits() {
    absl::MutexLock lock(&hits_mu_);
    return hits_;
  }

  static inline std::string model_dir_, log_dir_, cat_, dog_;
  static inline httplib::Server* images_ = nullptr;
  static inline std::thread* images_thread_ = nullptr;
  static inline int images_port_ = 0;
  static inline absl::Mutex hits_mu_;
  static inline int hits_ ABSL_GUARDED_BY(hits_mu_) = 0;
  static inline std::unique_ptr<ServiceProcess> vision_, language_;
  static inline Gateway guarded_, loopback_, off_;
};

TEST_F(RemoteImageHttpTest, LoopbackUrlsAreRefusedWith400AndNeverFetched) {
  const int before = Hits();
  for (const std::string host : {"127.0.0.1", "localhost", "[::ffff:127.0.0.1]", "0.0.0.0"}) {
    SCOPED_TRACE(host);
    auto res = Ask(guarded_, {ImageUrl("/cat.png", host)});
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400) << res->body;
    const json e = json::parse(res->body)["error"];
    EXPECT_EQ(e["type"], "invalid_request_error");
    EXPECT_EQ(e["param"], kParam);
    EXPECT_EQ(e["code"], "image_url_not_allowed");
    const std::string message = e["message"];
    EXPECT_TRUE(absl::StartsWith(message, absl::StrCat("image 1 (", kParam, "): http://")))
        << message;
    EXPECT_TRUE(absl::StrContains(message, "only public addresses are fetched")) << message;
  }
  auto res = Ask(guarded_, {ImageUrl("/cat.png")});
  ASSERT_TRUE(res);
  EXPECT_TRUE(absl::StrContains(res->body, "127.0.0.1 is a loopback address")) << res->body;
  EXPECT_EQ(Hits(), before);
}

TEST_F(RemoteImageHttpTest, TheTestSettingAloneDoesNotEnableFetching) {
  auto res = Ask(off_, {ImageUrl("/cat.png")});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400) << res->body;
  EXPECT_EQ(json::parse(res->body)["error"]["code"], "remote_images_disabled");
}

TEST_F(RemoteImageHttpTest, LoopbackImagesAreServedOnlyWithTheTestSetting) {
  auto res = Ask(loopback_, {ImageUrl("/cat.png")});
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json images = json::parse(res->body)["x_vlm"]["images"];
  ASSERT_EQ(images.size(), 1u);
  EXPECT_EQ(images[0]["content_hash"], Sha256Hex(cat_));
  // A redirect to a loopback path is followed.
  res = Ask(loopback_, {ImageUrl("/moved.png")});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
}

TEST_F(RemoteImageHttpTest, ImagesOfARequestKeepTheirOrder) {
  auto res = Ask(loopback_, {ImageUrl("/dog.png"), ImageUrl("/cat.png"), ImageUrl("/dog.png")});
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json images = json::parse(res->body)["x_vlm"]["images"];
  ASSERT_EQ(images.size(), 3u);
  EXPECT_EQ(images[0]["content_hash"], Sha256Hex(dog_));
  EXPECT_EQ(images[1]["content_hash"], Sha256Hex(cat_));
  EXPECT_EQ(images[2]["content_hash"], Sha256Hex(dog_));
}

TEST_F(RemoteImageHttpTest, LimitsAndRefusalsNameTheImage) {
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"/note.txt", "is not a JPEG, PNG or WebP image", "image_fetch_failed"},
      {"/huge.png", "larger than 100000 bytes", "image_fetch_failed"},
      {"/missing.png", "answered HTTP 404", "image_fetch_failed"},
      {"/to-unspecified.png", "0.0.0.0 is an unspecified address", "image_url_not_allowed"},
  };
  for (const auto& [path, words, code] : cases) {
    SCOPED_TRACE(path);
    // The bad image second, after a good one: the error names image 2.
    auto res = Ask(loopback_, {ImageUrl("/cat.png"), ImageUrl(path)});
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400) << res->body;
    const json e = json::parse(res->body)["error"];
    EXPECT_EQ(e["param"], "messages[0].content[2].image_url.url");
    EXPECT_EQ(e["code"], code);
    const std::string message = e["message"];
    EXPECT_TRUE(absl::StartsWith(message, "image 2 (messages[0].content[2].image_url.url): "))
        << message;
    EXPECT_TRUE(absl::StrContains(message, words)) << message;
  }
}

}  // namespace
}  // namespace vlm
