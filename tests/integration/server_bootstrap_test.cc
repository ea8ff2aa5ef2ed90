// Starts the real vlm-test-server binary on loopback and checks what every
// service gets from the bootstrap: health (Check and Watch), reflection,
// metrics over HTTP, readiness, and the drain on SIGTERM.
//
// This binary is a reflection *client*; it must not link grpc++_reflection
// (toolchain.md, trap 2), so it compiles reflection.proto itself.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "tests/integration/service_process.h"
#include "tests/unit/metrics_text.h"
#include "vlm/v1/vision.grpc.pb.h"

namespace vlm {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

constexpr char kService[] = "vlm.v1.VisionEncoder";

using testing::Eventually;

// One vlm-test-server process (tests/integration/service_process.h); killed
// (SIGKILL) on destruction if still running.
class ServerProcess : public testing::ServiceProcess {
 public:
  explicit ServerProcess(const std::vector<std::string>& flags,
                         const std::vector<std::string>& env = {})
      : ServiceProcess(VLM_TEST_SERVER_PATH, flags, NextLogPrefix(), env) {}

 private:
  static std::string NextLogPrefix() {
    static int count = 0;
    return testing::TestLogDir("server_bootstrap_test") + "/server-" + std::to_string(++count);
  }
};

std::string HealthCheck(grpc::health::v1::Health::Stub& stub, const std::string& service) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  grpc::Status status = stub.Check(&ctx, request, &response);
  if (!status.ok()) return "error: " + status.error_message();
  return HealthCheckResponse::ServingStatus_Name(response.status());
}

grpc::Status Encode(vlm::v1::VisionEncoder::Stub& stub, const std::string& hash,
                    vlm::v1::EncodeResponse* response, int deadline_s = 30) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_s));
  vlm::v1::EncodeRequest request;
  request.set_content_hash(hash);
  return stub.Encode(&ctx, request, response);
}

// Follows a health Watch stream on its own thread.
class HealthWatcher {
 public:
  HealthWatcher(std::shared_ptr<grpc::Channel> channel, const std::string& service)
      : stub_(grpc::health::v1::Health::NewStub(channel)) {
    thread_ = std::thread([this, service] {
      HealthCheckRequest request;
      request.set_service(service);
      auto reader = stub_->Watch(&ctx_, request);
      HealthCheckResponse response;
      while (reader->Read(&response)) {
        absl::MutexLock lock(&mu_);
        const std::string name = HealthCheckResponse::ServingStatus_Name(response.status());
        if (statuses_.empty() || statuses_.back() != name) statuses_.push_back(name);
      }
      reader->Finish();
      absl::MutexLock lock(&mu_);
      done_ = true;
    });
  }
  ~HealthWatcher() {
    ctx_.TryCancel();
    thread_.join();
  }
  // Distinct consecutive statuses seen so far.
  std::vector<std::string> statuses() {
    absl::MutexLock lock(&mu_);
    return statuses_;
  }
  bool done() {
    absl::MutexLock lock(&mu_);
    return done_;
  }

 private:
  std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
  grpc::ClientContext ctx_;
  std::thread thread_;
  absl::Mutex mu_;
  std::vector<std::string> statuses_;
  bool done_ = false;
};

// Reflection v1alpha: the names of the services the server offers.
std::set<std::string> ListServices(std::shared_ptr<grpc::Channel> channel) {
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto stream = stub->ServerReflectionInfo(&ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("");
  std::set<std::string> names;
  if (!stream->Write(request)) return names;
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  while (stream->Read(&response)) {
    for (const auto& s : response.list_services_response().service()) names.insert(s.name());
  }
  stream->Finish();
  return names;
}

// The file descriptor that defines `symbol`, as reflection serves it.
std::string FileContainingSymbol(std::shared_ptr<grpc::Channel> channel, const std::string& symbol) {
  auto stub = grpc::reflection::v1alpha::ServerReflection::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto stream = stub->ServerReflectionInfo(&ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_file_containing_symbol(symbol);
  stream->Write(request);
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  std::string name;
  while (stream->Read(&response)) {
    for (const auto& bytes : response.file_descriptor_response().file_descriptor_proto()) {
      google::protobuf::FileDescriptorProto file;
      if (file.ParseFromString(bytes) && name.empty()) name = file.name();
    }
  }
  stream->Finish();
  return name;
}

int FreeLoopbackPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

TEST(ServerBootstrapTest, HealthReflectionMetricsReadinessAndDrainOnSigterm) {
  ServerProcess server({"--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                        "--ready_after_ms=1500", "--drain_timeout_s=20"});
  ASSERT_TRUE(server.WaitListening(absl::Seconds(30))) << "no listening line";
  EXPECT_EQ(server.grpc_host, "127.0.0.1");
  EXPECT_GT(server.grpc_port, 0);
  EXPECT_GT(server.metrics_port, 0);

  auto channel = grpc::CreateChannel(server.grpc_target(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  auto vision = vlm::v1::VisionEncoder::NewStub(channel);
  httplib::Client http(server.metrics_host, server.metrics_port);
  HealthWatcher watcher(channel, "");

  // Warming up: alive, not ready, and RPCs say why.
  EXPECT_EQ(HealthCheck(*health, ""), "NOT_SERVING");
  EXPECT_EQ(HealthCheck(*health, kService), "NOT_SERVING");
  vlm::v1::EncodeResponse response;
  grpc::Status early = Encode(*vision, "abc", &response);
  EXPECT_EQ(early.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(early.error_message(), "vlm.v1.VisionEncoder is not serving: warming up");
  auto healthz = http.Get("/healthz");
  ASSERT_TRUE(healthz);
  EXPECT_EQ(healthz->status, 200);
  auto readyz = http.Get("/readyz");
  ASSERT_TRUE(readyz);
  EXPECT_EQ(readyz->status, 503);
  EXPECT_EQ(readyz->body, "vlm.v1.VisionEncoder is not serving: warming up\n");

  // Ready.
  ASSERT_TRUE(Eventually([&] { return HealthCheck(*health, "") == "SERVING"; }, absl::Seconds(20)));
  EXPECT_EQ(HealthCheck(*health, kService), "SERVING");
  readyz = http.Get("/readyz");
  ASSERT_TRUE(readyz);
  EXPECT_EQ(readyz->status, 200);
  ASSERT_TRUE(Encode(*vision, "abc", &response).ok());
  EXPECT_EQ(response.features().content_hash(), "abc");

  // Metrics over HTTP.
  auto metrics = http.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 200);
  EXPECT_EQ(metrics->get_header_value("Content-Type").rfind("text/plain; version=0.0.4", 0), 0u);
  const std::string& text = metrics->body;
  const auto rss = metrics_text::MetricValue(text, "vlm_process_resident_memory_bytes");
  const auto peak = metrics_text::MetricValue(text, "vlm_process_peak_resident_memory_bytes");
  ASSERT_TRUE(rss && peak) << text;
  EXPECT_GT(*rss, 1 << 20);
  EXPECT_GE(*peak, *rss);
  EXPECT_EQ(metrics_text::MetricValue(text, "vlm_build_info"), 1.0) << text;
  EXPECT_TRUE(metrics_text::MetricValue(text, "vlm_process_start_time_seconds").has_value());
  EXPECT_EQ(metrics_text::MetricValue(
                text,
                "vlm_grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"Encode\","
                "grpc_service=\"vlm.v1.VisionEncoder\"}"),
            1.0)
      << text;
  EXPECT_EQ(metrics_text::MetricValue(
                text,
                "vlm_grpc_server_handled_total{grpc_code=\"UNAVAILABLE\",grpc_method=\"Encode\","
                "grpc_service=\"vlm.v1.VisionEncoder\"}"),
            1.0)
      << text;

  // Reflection.
  const std::set<std::string> services = ListServices(channel);
  EXPECT_TRUE(services.count(kService)) << services.size();
  EXPECT_TRUE(services.count("grpc.health.v1.Health"));
  EXPECT_TRUE(services.count("grpc.reflection.v1alpha.ServerReflection"));
  EXPECT_EQ(FileContainingSymbol(channel, kService), "vlm/v1/vision.proto");

  // A slow RPC is in flight when SIGTERM arrives; it finishes during the drain.
  grpc::Status slow_status;
  vlm::v1::EncodeResponse slow_response;
  std::thread slow([&] { slow_status = Encode(*vision, "sleep:3000", &slow_response); });
  const bool in_flight = Eventually(
      [&] {
        auto m = http.Get("/metrics");
        return m && metrics_text::MetricValue(m->body, "vlm_grpc_server_inflight_requests") == 1.0;
      },
      absl::Seconds(10));
  EXPECT_TRUE(in_flight);
  ASSERT_EQ(kill(server.pid(), SIGTERM), 0);

  EXPECT_TRUE(Eventually([&] { return HealthCheck(*health, "") == "NOT_SERVING"; },
                         absl::Seconds(2)));
  EXPECT_EQ(HealthCheck(*health, kService), "NOT_SERVING");
  grpc::Status refused = Encode(*vision, "late", &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(refused.error_message(), "server is draining");
  readyz = http.Get("/readyz");
  ASSERT_TRUE(readyz);
  EXPECT_EQ(readyz->status, 503);
  EXPECT_EQ(readyz->body, "server is draining\n");
  healthz = http.Get("/healthz");
  ASSERT_TRUE(healthz);
  EXPECT_EQ(healthz->status, 200);  // still alive while draining

  slow.join();
  EXPECT_TRUE(slow_status.ok()) << slow_status.error_code() << " " << slow_status.error_message();
  EXPECT_EQ(slow_response.features().content_hash(), "sleep:3000");

  EXPECT_EQ(server.WaitExit(absl::Seconds(15)), 0);
  EXPECT_TRUE(Eventually([&] { return watcher.done(); }, absl::Seconds(5)));
  const std::vector<std::string> want = {"NOT_SERVING", "SERVING", "NOT_SERVING"};
  EXPECT_EQ(watcher.statuses(), want);
}

TEST(ServerBootstrapTest, DrainTimeoutCancelsRpcsThatRunTooLong) {
  // Configured through the environment this time (VLM_<FLAG>).
  ServerProcess server({"--metrics_address=127.0.0.1:0"},
                       {"VLM_GRPC_ADDRESS=127.0.0.1:0", "VLM_DRAIN_TIMEOUT_S=0.5"});
  ASSERT_TRUE(server.WaitListening(absl::Seconds(30)));
  auto channel = grpc::CreateChannel(server.grpc_target(), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  auto vision = vlm::v1::VisionEncoder::NewStub(channel);
  ASSERT_TRUE(Eventually([&] { return HealthCheck(*health, "") == "SERVING"; }, absl::Seconds(20)));

  grpc::Status slow_status;
  vlm::v1::EncodeResponse slow_response;
  std::thread slow([&] { slow_status = Encode(*vision, "sleep:60000", &slow_response, 120); });
  httplib::Client http(server.metrics_host, server.metrics_port);
  EXPECT_TRUE(Eventually(
      [&] {
        auto m = http.Get("/metrics");
        return m && metrics_text::MetricValue(m->body, "vlm_grpc_server_inflight_requests") == 1.0;
      },
      absl::Seconds(10)));
  const absl::Time sent = absl::Now();
  ASSERT_EQ(kill(server.pid(), SIGTERM), 0);
  EXPECT_EQ(server.WaitExit(absl::Seconds(15)), 0);
  slow.join();
  EXPECT_LT(absl::Now() - sent, absl::Seconds(10));
  EXPECT_FALSE(slow_status.ok());
}

TEST(ServerBootstrapTest, FixedPortsWorkAndAPortInUseFailsTheStart) {
  const int port = FreeLoopbackPort();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  ServerProcess first({"--grpc_address=" + address, "--metrics_address=127.0.0.1:0"});
  ASSERT_TRUE(first.WaitListening(absl::Seconds(30)));
  EXPECT_EQ(first.grpc_port, port);

  ServerProcess second({"--grpc_address=" + address, "--metrics_address=127.0.0.1:0"});
  EXPECT_FALSE(second.WaitListening(absl::Seconds(30)));
  EXPECT_EQ(second.WaitExit(absl::Seconds(10)), 1);

  ServerProcess bad_flag({"--grpc_address=127.0.0.1:0", "--max_message_mb=0"});
  EXPECT_FALSE(bad_flag.WaitListening(absl::Seconds(30)));
  EXPECT_EQ(bad_flag.WaitExit(absl::Seconds(10)), 1);

  ASSERT_EQ(kill(first.pid(), SIGINT), 0);
  EXPECT_EQ(first.WaitExit(absl::Seconds(15)), 0);
}

}  // namespace
}  // namespace vlm
