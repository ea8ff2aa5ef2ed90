// Fault injection with the real binaries on loopback (tiny checkpoint): what
// clients see when a backend dies, hangs, or a client misbehaves, and that the
// system recovers. Every call carries a deadline and every test bounds its waits.
//
//   - language SIGKILLed while streams run: every stream ends UNAVAILABLE
//     naming the language service, promptly; the gateway's readiness drops and
//     returns after a restart on the same port;
//   - one of two vision replicas SIGKILLed under load: no request is lost;
//   - a backend SIGSTOPped: deadlines fire on time and admission slots are freed;
//   - a client that opens a long stream and never reads: other clients are served;
//   - the vision disk cache directory unwritable or full: encodes are still
//     served and the failures are counted (vlm_vision_cache_disk_errors_total).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/integration/chat_request.h"
#include "tests/integration/service_process.h"
#include "tests/integration/test_png.h"
#include "tests/unit/metrics_text.h"
#include "vlm/v1/gateway.grpc.pb.h"
#include "vlm/v1/vision.grpc.pb.h"

namespace vlm {
namespace {

namespace fs = std::filesystem;
using testing::Eventually;
using testing::ServiceProcess;

std::string LogDir() { return testing::TestLogDir("fault_injection_test"); }
std::string TinyCheckpoint() {
  const char* dir = std::getenv("VLM_BINARY_DIR");
  return dir != nullptr ? std::string(dir) + "/tiny_checkpoint" : "";
}

v1::ChatRequest Request(const std::string& text, const std::vector<std::string>& images = {},
                        int max_tokens = 4) {
  return testing::GreedyChat(text, images, max_tokens);
}

v1::ChatRequest LongRequest(int max_tokens = 4000) { return testing::EndlessChat(max_tokens); }

// A metric of a service's /metrics; -1 if absent or unreachable.
double Metric(const ServiceProcess& p, const std::string& key) {
  httplib::Client client("127.0.0.1", p.metrics_port);
  client.set_read_timeout(5, 0);
  auto res = client.Get("/metrics");
  if (!res || res->status != 200) return -1;
  return metrics_text::MetricValue(res->body, key).value_or(-1);
}

// The final status of one call and how long it took.
struct Outcome {
  grpc::Status status;
  absl::Duration elapsed;
  int chunks = 0;
};

// The real system: `vision_replicas` vision processes, language, gateway.
class Stack {
 public:
  struct Options {
    int vision_replicas = 1;
    std::vector<std::string> vision_flags;
    std::vector<std::string> language_flags;
    std::vector<std::string> gateway_flags;
  };

  static Options With(int vision_replicas, std::vector<std::string> language_flags,
                      std::vector<std::string> gateway_flags = {}) {
    Options o;
    o.vision_replicas = vision_replicas;
    o.language_flags = std::move(language_flags);
    o.gateway_flags = std::move(gateway_flags);
    return o;
  }

  Stack(std::string name, Options options) : name_(std::move(name)), options_(std::move(options)) {}

  ::testing::AssertionResult Start() {
    for (int i = 0; i < options_.vision_replicas; ++i) vision_.push_back(StartVision(i));
    language_ = StartLanguage();
    for (auto& v : vision_) {
      if (!v->WaitListening()) return ::testing::AssertionFailure() << v->LogTail();
    }
    if (!language_->WaitListening()) return ::testing::AssertionFailure() << language_->LogTail();
    std::string targets;
    for (auto& v : vision_) targets += (targets.empty() ? "" : ",") + v->grpc_target();
    std::vector<std::string> flags = {"--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                                      "--http_address=127.0.0.1:0",
                                      "--language_target=" + language_->grpc_target(),
                                      "--vision_targets=" + targets,
                                      "--backend_reconnect_max_ms=200", "--drain_timeout_s=2"};
    flags.insert(flags.end(), options_.gateway_flags.begin(), options_.gateway_flags.end());
    gateway_ = std::make_unique<ServiceProcess>(VLM_GATEWAY_PATH, flags,
                                                LogDir() + "/" + name_ + "-gateway");
    if (!gateway_->WaitListening()) return ::testing::AssertionFailure() << gateway_->LogTail();
    stub_ = v1::VisionLanguage::NewStub(
        grpc::CreateChannel(gateway_->grpc_target(), grpc::InsecureChannelCredentials()));
    if (!GatewayServing(absl::Seconds(60))) {
      return ::testing::AssertionFailure() << "gateway never SERVING\n" << gateway_->LogTail();
    }
    return ::testing::AssertionSuccess();
  }

  std::unique_ptr<ServiceProcess> StartVision(int index, int port = 0) {
    std::vector<std::string> flags = {"--model_dir=" + TinyCheckpoint(),
                                      absl::StrCat("--grpc_address=127.0.0.1:", port),
                                      "--metrics_address=127.0.0.1:0",
                                      absl::StrCat("--replica_name=vision-", index),
                                      "--intra_op_threads=1", "--drain_timeout_s=2"};
    flags.insert(flags.end(), options_.vision_flags.begin(), options_.vision_flags.end());
    return std::make_unique<ServiceProcess>(VLM_VISION_PATH, flags,
                                            absl::StrCat(LogDir(), "/", name_, "-vision-", index));
  }
  std::unique_ptr<ServiceProcess> StartLanguage(int port = 0) {
    std::vector<std::string> flags = {"--model_dir=" + TinyCheckpoint(),
                                      absl::StrCat("--grpc_address=127.0.0.1:", port),
                                      "--metrics_address=127.0.0.1:0", "--intra_op_threads=1",
                                      "--drain_timeout_s=2"};
    flags.insert(flags.end(), options_.language_flags.begin(), options_.language_flags.end());
    return std::make_unique<ServiceProcess>(VLM_LANGUAGE_PATH, flags,
                                            LogDir() + "/" + name_ + "-language");
  }

  bool GatewayServing(absl::Duration timeout) {
    return gateway_->WaitServing("", timeout);
  }

  Outcome Chat(const v1::ChatRequest& request, absl::Duration deadline,
               v1::ChatResponse* response = nullptr) {
    v1::ChatResponse local;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    const absl::Time start = absl::Now();
    Outcome o;
    o.status = stub_->Chat(&ctx, request, response != nullptr ? response : &local);
    o.elapsed = absl::Now() - start;
    return o;
  }

  // Streams to the end; `on_chunk` runs after each chunk.
  Outcome Stream(const v1::ChatRequest& request, absl::Duration deadline,
                 const std::function<void()>& on_chunk = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    const absl::Time start = absl::Now();
    auto reader = stub_->ChatStream(&ctx, request);
    v1::ChatChunk chunk;
    Outcome o;
    while (reader->Read(&chunk)) {
      ++o.chunks;
      if (on_chunk) on_chunk();
    }
    o.status = reader->Finish();
    o.elapsed = absl::Now() - start;
    return o;
  }

  // Log tails of every process, for failure messages.
  std::string Logs() {
    std::string out;
    for (auto& v : vision_) out += "--- vision ---\n" + v->LogTail(10);
    if (language_) out += "--- language ---\n" + language_->LogTail(10);
    if (gateway_) out += "--- gateway ---\n" + gateway_->LogTail(10);
    return out;
  }

  std::vector<std::unique_ptr<ServiceProcess>> vision_;
  std::unique_ptr<ServiceProcess> language_;
  std::unique_ptr<ServiceProcess> gateway_;
  std::unique_ptr<v1::VisionLanguage::Stub> stub_;

 private:
  std::string name_;
  Options options_;
};

// --- language SIGKILLed mid stream -------------------------------------------------

TEST(FaultInjectionTest, LanguageKilledMidStreamEndsEveryStreamUnavailableAndRecovers) {
  Stack stack("kill-language", Stack::With(1, {"--max_sequences=2", "--max_queue=8"}));
  ASSERT_TRUE(stack.Start());
  constexpr int kStreams = 4;  // 2 decode, 2 wait in the language queue
  const absl::Duration deadline = absl::Seconds(40);
  std::vector<Outcome> outcomes(kStreams);
  std::atomic<int> streaming{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      bool counted = false;
      outcomes[i] = stack.Stream(LongRequest(), deadline, [&] {
        if (!counted) streaming.fetch_add(1);
        counted = true;
      });
    });
  }
  ASSERT_TRUE(Eventually([&] { return streaming.load() >= 2; }, absl::Seconds(30))) << stack.Logs();
  const int language_port = stack.language_->grpc_port;
  const std::string unavailable =
      absl::StrCat("language service unavailable (", stack.language_->grpc_target(), "): ");
  const absl::Time killed = absl::Now();
  ASSERT_EQ(stack.language_->Stop(SIGKILL), std::optional<int>(-SIGKILL));
  for (auto& t : threads) t.join();
  for (const Outcome& o : outcomes) {
    EXPECT_EQ(o.status.error_code(), grpc::StatusCode::UNAVAILABLE) << o.status.error_message();
    EXPECT_TRUE(absl::StartsWith(o.status.error_message(), unavailable))
        << o.status.error_message();
  }
  // Nobody waited for the deadline: the failure reached every client at once.
  EXPECT_LT(absl::Now() - killed, absl::Seconds(10));

  EXPECT_TRUE(Eventually(
      [&] { return stack.gateway_->Health() == "NOT_SERVING"; },
      absl::Seconds(5)));
  const Outcome refused = stack.Chat(Request("Hello"), absl::Seconds(10));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << refused.status.error_message();
  EXPECT_LT(refused.elapsed, absl::Seconds(5));
  EXPECT_TRUE(Eventually(
      [&] { return Metric(*stack.gateway_, "vlm_gateway_admission_running") == 0; },
      absl::Seconds(5)));

  // The language comes back at the same address. Its port came from the
  // kernel's ephemeral range, so while it was free another socket on the host
  // may have taken it as its local port (an outgoing connection of a test
  // running beside this one): the bind then fails with "address in use"
  // until that socket closes, so the restart retries the bind for a while.
  for (int attempt = 1;; ++attempt) {
    stack.language_ = stack.StartLanguage(language_port);
    if (stack.language_->WaitListening()) break;
    const std::string tail = stack.language_->LogTail();
    ASSERT_TRUE(absl::StrContains(tail, "cannot listen")) << tail;
    ASSERT_LT(attempt, 40) << tail;
    absl::SleepFor(absl::Milliseconds(250));
  }
  ASSERT_TRUE(stack.GatewayServing(absl::Seconds(30))) << stack.Logs();
  const Outcome again = stack.Chat(Request("Hello again"), absl::Seconds(30));
  EXPECT_TRUE(again.status.ok()) << again.status.error_message();
}

// --- one of two vision replicas SIGKILLed under load ---------------------------------

TEST(FaultInjectionTest, VisionReplicaKilledUnderLoadLosesNoRequest) {
  Stack stack("kill-vision", Stack::With(2, {"--max_queue=32"}));
  ASSERT_TRUE(stack.Start());
  constexpr int kClients = 4;
  constexpr int kPerClient = 6;
  std::atomic<int> done{0};
  std::mutex mu;
  std::vector<Outcome> outcomes;
  std::vector<std::string> replicas;
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      for (int i = 0; i < kPerClient; ++i) {
        // A new image every time: each request makes a real Encode call.
        v1::ChatResponse response;
        const Outcome o = stack.Chat(Request("Hi.", {testing::PatternPng(96, 64, 1000 + c * 100 + i)}, 1),
                                     absl::Seconds(60), &response);
        std::lock_guard<std::mutex> lock(mu);
        outcomes.push_back(o);
        if (o.status.ok() && response.images_size() == 1) replicas.push_back(response.images(0).replica());
        done.fetch_add(1);
      }
    });
  }
  ASSERT_TRUE(Eventually([&] { return done.load() >= kClients; }, absl::Seconds(60))) << stack.Logs();
  ASSERT_EQ(stack.vision_[0]->Stop(SIGKILL), std::optional<int>(-SIGKILL));
  const int done_at_kill = done.load();
  for (auto& t : threads) t.join();
  ASSERT_EQ(outcomes.size(), static_cast<size_t>(kClients * kPerClient));
  int ok = 0;
  for (const Outcome& o : outcomes) {
    EXPECT_TRUE(o.status.ok()) << o.status.error_code() << " " << o.status.error_message();
    ok += o.status.ok();
  }
  EXPECT_EQ(ok, kClients * kPerClient);
  EXPECT_LT(done_at_kill, kClients * kPerClient) << "the kill came after the load";
  // After the kill, only vision-1 answered.
  int after_kill_on_survivor = 0;
  for (size_t i = static_cast<size_t>(done_at_kill) + kClients; i < replicas.size(); ++i) {
    EXPECT_EQ(replicas[i], "vision-1");
    after_kill_on_survivor += replicas[i] == "vision-1";
  }
  std::printf("vision kill: %d requests done before it, %d ok in all, retries %.0f\n",
              done_at_kill, ok, Metric(*stack.gateway_, "vlm_gateway_vision_retries_total"));
  EXPECT_EQ(stack.gateway_->Health(), "SERVING");
}

// --- a backend SIGSTOPped ---------------------------------------------------------

TEST(FaultInjectionTest, StoppedBackendLetsDeadlinesFireAndFreesTheSlots) {
  Stack stack("stop-backend", Stack::With(1, {}, {"--max_inflight=2", "--max_queue=4"}));
  ASSERT_TRUE(stack.Start());
  const absl::Duration deadline = absl::Milliseconds(1500);

  for (const std::string which : {"language", "vision"}) {
    ServiceProcess& victim = which == "language" ? *stack.language_ : *stack.vision_[0];
    ASSERT_TRUE(victim.Signal(SIGSTOP));
    // Four callers against two admission slots: two run, two queue; all must end on time.
    std::vector<Outcome> outcomes(4);
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; ++i) {
      threads.emplace_back([&, i] {
        // Vision is only called for images; each request brings a new one.
        const v1::ChatRequest request = which == "language"
                                            ? Request("Hello")
                                            : Request("Hi.", {testing::PatternPng(96, 64, 2000 + i)});
        outcomes[i] = stack.Chat(request, deadline);
      });
    }
    for (auto& t : threads) t.join();
    for (const Outcome& o : outcomes) {
      EXPECT_EQ(o.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
          << which << ": " << o.status.error_message();
      EXPECT_LT(o.elapsed, deadline + absl::Seconds(2)) << which;  // slack for a busy machine
    }
    // The admission slots are free again while the backend is still stopped.
    EXPECT_TRUE(Eventually(
        [&] {
          return Metric(*stack.gateway_, "vlm_gateway_admission_running") == 0 &&
                 Metric(*stack.gateway_, "vlm_gateway_admission_queued") == 0;
        },
        absl::Seconds(3)))
        << which;
    ASSERT_TRUE(victim.Signal(SIGCONT));
    const Outcome after = stack.Chat(which == "language" ? Request("Hello again")
                                                         : Request("Hi.", {testing::PatternPng(96, 64, 2100)}),
                                     absl::Seconds(30));
    EXPECT_TRUE(after.status.ok()) << which << ": " << after.status.error_message();
  }
}

TEST(FaultInjectionTest, HungVisionReplicaIsDetectedByKeepaliveAndItsImagesFailOver) {
  Stack stack("hung-vision", Stack::With(2, {}, {"--backend_keepalive_ms=1000",
                                                 "--backend_keepalive_timeout_ms=1000"}));
  ASSERT_TRUE(stack.Start());
  ServiceProcess& hung = *stack.vision_[0];
  const std::string series = "vlm_gateway_backend_serving{backend=\"vision\",target=\"" +
                             hung.grpc_target() + "\"}";
  ASSERT_EQ(Metric(*stack.gateway_, series), 1);
  ASSERT_TRUE(hung.Signal(SIGSTOP));
  // The open connection stays up at the TCP level; only the unanswered pings tell.
  EXPECT_TRUE(Eventually([&] { return Metric(*stack.gateway_, series) == 0; }, absl::Seconds(10)))
      << stack.Logs();
  EXPECT_EQ(stack.gateway_->Health(), "SERVING");  // vision-1 is enough
  for (int i = 0; i < 8; ++i) {
    v1::ChatResponse response;
    const Outcome o = stack.Chat(Request("Hi.", {testing::PatternPng(96, 64, 5000 + i)}, 1), absl::Seconds(10), &response);
    EXPECT_TRUE(o.status.ok()) << o.status.error_message();
    if (o.status.ok()) {
      EXPECT_EQ(response.images(0).replica(), "vision-1");
    }
  }
  ASSERT_TRUE(hung.Signal(SIGCONT));
  EXPECT_TRUE(Eventually([&] { return Metric(*stack.gateway_, series) == 1; }, absl::Seconds(15)))
      << stack.Logs();
}

// --- a client that never reads -------------------------------------------------------

TEST(FaultInjectionTest, ClientThatNeverReadsDoesNotBlockOtherClients) {
  Stack stack("slow-reader", Stack::With(1, {"--max_sequences=2"}));
  ASSERT_TRUE(stack.Start());
  // Small receive windows, so that flow control pushes back on the gateway at once.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  auto stalled_stub = v1::VisionLanguage::NewStub(grpc::CreateCustomChannel(
      stack.gateway_->grpc_target(), grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext stalled;
  stalled.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  auto never_read = stalled_stub->ChatStream(&stalled, LongRequest(8000));
  ASSERT_TRUE(Eventually(
      [&] { return Metric(*stack.language_, "vlm_language_sequences_running") >= 1; },
      absl::Seconds(20)));

  // Other clients are served while it sits there.
  for (int i = 0; i < 5; ++i) {
    const Outcome o = stack.Chat(Request(absl::StrCat("Question ", i), {}, 8), absl::Seconds(30));
    EXPECT_TRUE(o.status.ok()) << o.status.error_message();
    std::printf("chat %d beside a stalled stream: %.0f ms\n", i,
                absl::ToDoubleMilliseconds(o.elapsed));
  }
  EXPECT_EQ(Metric(*stack.gateway_, "vlm_gateway_admission_running"), 1)
      << "the stalled stream should still hold its slot";
  // Cancelled, it frees everything it held.
  stalled.TryCancel();
  EXPECT_EQ(never_read->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(Eventually(
      [&] {
        return Metric(*stack.gateway_, "vlm_gateway_admission_running") == 0 &&
               Metric(*stack.language_, "vlm_language_sequences_running") == 0;
      },
      absl::Seconds(10)))
      << stack.Logs();
}

// --- the disk cache directory fails ---------------------------------------------------

// Encodes `count` new images on `vision` directly; returns how many succeeded.
int EncodeNewImages(ServiceProcess& vision, int first_seed, int count, int side) {
  auto stub = v1::VisionEncoder::NewStub(
      grpc::CreateChannel(vision.grpc_target(), grpc::InsecureChannelCredentials()));
  int ok = 0;
  for (int i = 0; i < count; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::EncodeRequest request;
    request.set_image(testing::PatternPng(side, side, first_seed + i));
    v1::EncodeResponse response;
    const grpc::Status s = stub->Encode(&ctx, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    ok += s.ok();
  }
  return ok;
}

constexpr char kDiskErrors[] = "vlm_vision_cache_disk_errors_total";

TEST(FaultInjectionTest, UnwritableDiskCacheDirectoryStillServesAndCountsTheErrors) {
  const std::string dir = LogDir() + "/unwritable-cache";
  fs::remove_all(dir);
  ServiceProcess vision(VLM_VISION_PATH,
                        {"--model_dir=" + TinyCheckpoint(), "--grpc_address=127.0.0.1:0",
                         "--metrics_address=127.0.0.1:0", "--intra_op_threads=1",
                         "--cache_dir=" + dir},
                        LogDir() + "/unwritable-vision");
  ASSERT_TRUE(vision.WaitListening()) << vision.LogTail();
  ASSERT_TRUE(vision.WaitServing("vlm.v1.VisionEncoder", absl::Seconds(60))) << vision.LogTail();
  EXPECT_EQ(EncodeNewImages(vision, 3000, 1, 96), 1);
  EXPECT_EQ(Metric(vision, kDiskErrors), 0);
  // The directory goes away and a file takes its place: every write now fails
  // (a mode change would not stop a process running as root).
  fs::remove_all(dir);
  std::ofstream(dir) << "not a directory";
  EXPECT_EQ(EncodeNewImages(vision, 3100, 3, 96), 3);
  EXPECT_TRUE(Eventually([&] { return Metric(vision, kDiskErrors) >= 3; }, absl::Seconds(10)))
      << Metric(vision, kDiskErrors) << "\n" << vision.LogTail();
  EXPECT_EQ(vision.Health("vlm.v1.VisionEncoder"), "SERVING");
  fs::remove(dir);
}

TEST(FaultInjectionTest, FullDiskCacheStillServesAndCountsTheErrors) {
  const std::string dir = LogDir() + "/full-cache";
  fs::remove_all(dir);
  // A file size limit of 64 KiB (SIGXFSZ ignored, so writes fail with EFBIG as on a
  // full disk): feature files of 448x448 images are larger; the logs stay below it.
  ServiceProcess vision(
      "/bin/sh",
      {"-c", "trap '' XFSZ; exec /usr/bin/prlimit --fsize=65536 \"$@\"", "sh", VLM_VISION_PATH,
       "--model_dir=" + TinyCheckpoint(), "--grpc_address=127.0.0.1:0",
       "--metrics_address=127.0.0.1:0", "--intra_op_threads=1", "--cache_dir=" + dir},
      LogDir() + "/full-vision");
  ASSERT_TRUE(vision.WaitListening()) << vision.LogTail();
  ASSERT_TRUE(vision.WaitServing("vlm.v1.VisionEncoder", absl::Seconds(60))) << vision.LogTail();
  EXPECT_EQ(EncodeNewImages(vision, 4000, 3, 448), 3);
  EXPECT_TRUE(Eventually([&] { return Metric(vision, kDiskErrors) >= 3; }, absl::Seconds(10)))
      << Metric(vision, kDiskErrors) << "\n" << vision.LogTail();
  EXPECT_EQ(vision.Health("vlm.v1.VisionEncoder"), "SERVING");
}

}  // namespace
}  // namespace vlm
