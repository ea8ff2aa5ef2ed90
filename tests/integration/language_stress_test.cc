// vlm-language under load, on the tiny checkpoint with a small KV cache
// (--kv_cache_mb=1: 64 blocks of 16 tokens): 64 requests from 16 client
// threads with random prompt and completion lengths, some cancelled mid-way,
// some with deadlines too short to finish. Every request must end with a
// status that fits what was asked, nothing may hang, and afterwards every KV
// block must be back (free or cached, none in use), as /metrics reports.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/integration/service_process.h"
#include "tests/unit/metrics_text.h"
#include "vlm/v1/language.grpc.pb.h"

namespace vlm {
namespace {

std::string BinaryDir() {
  const char* dir = std::getenv("VLM_BINARY_DIR");
  return dir ? dir : ".";
}

std::string Metrics(int port) {
  httplib::Client http("127.0.0.1", port);
  auto res = http.Get("/metrics");
  return res && res->status == 200 ? res->body : "";
}

double Metric(const std::string& text, const std::string& key) {
  return metrics_text::MetricValue(text, key).value_or(-1);
}

bool Eventually(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return condition();
}

enum class Kind { kComplete, kCancel, kShortDeadline };

struct Outcome {
  Kind kind;
  int max_tokens = 0;
  grpc::Status status;
  int tokens = 0;
  bool finished_message = false;  // a last message with finish reason and usage
  int usage_completion = -1;
};

TEST(LanguageStressTest, SixtyFourRequestsFromSixteenThreadsAllEndAndReturnEveryBlock) {
  testing::ServiceProcess server(
      VLM_LANGUAGE_PATH,
      {"--model_dir=" + BinaryDir() + "/tiny_checkpoint", "--grpc_address=127.0.0.1:0",
       "--metrics_address=127.0.0.1:0", "--intra_op_threads=1", "--max_sequences=8",
       "--max_queue=64", "--max_batch_tokens=64", "--kv_cache_mb=1", "--kv_block_size=16",
       "--max_context=1024"},
      BinaryDir() + "/language_stress_test_server");
  ASSERT_TRUE(server.WaitListening()) << server.LogTail();
  auto channel = grpc::CreateChannel(server.grpc_target(), grpc::InsecureChannelCredentials());
  auto stub = v1::Language::NewStub(channel);
  ASSERT_TRUE(Eventually(
      [&] {
        return Metric(Metrics(server.metrics_port), "vlm_language_kv_blocks{state=\"free\"}") > 0;
      },
      absl::Seconds(60)))
      << server.LogTail();
  const std::string before = Metrics(server.metrics_port);
  const double total_blocks = Metric(before, "vlm_language_kv_blocks{state=\"free\"}") +
                              Metric(before, "vlm_language_kv_blocks{state=\"cached\"}") +
                              Metric(before, "vlm_language_kv_blocks{state=\"used\"}");
  ASSERT_EQ(total_blocks, 64);

  const char* words[] = {"sea", "light", "stone", "river", "north", "glass", "wind", "tree"};
  std::vector<Outcome> outcomes(64);
  std::vector<std::thread> clients;
  const absl::Time start = absl::Now();
  for (int t = 0; t < 16; ++t) {
    clients.emplace_back([&, t] {
      std::mt19937 rng(1234 + t);
      for (int k = 0; k < 4; ++k) {
        Outcome& o = outcomes[t * 4 + k];
        o.kind = static_cast<Kind>(rng() % 3);
        o.max_tokens = 1 + static_cast<int>(rng() % 200);
        v1::GenerateRequest request;
        request.set_add_generation_prompt(true);
        auto* m = request.add_messages();
        m->set_role("user");
        std::string text = absl::StrCat("Thread ", t, " asks:");
        const int words_n = static_cast<int>(rng() % 300);
        for (int w = 0; w < words_n; ++w) absl::StrAppend(&text, " ", words[rng() % 8]);
        m->add_content()->set_text(text);
        request.mutable_params()->set_max_tokens(o.max_tokens);
        request.mutable_params()->set_ignore_eos(true);
        request.mutable_params()->mutable_sampling()->set_temperature(0.7f);
        grpc::ClientContext ctx;
        const int cancel_after = 1 + static_cast<int>(rng() % 8);
        ctx.set_deadline(absl::ToChronoTime(
            absl::Now() + (o.kind == Kind::kShortDeadline
                               ? absl::Milliseconds(20 + rng() % 300)
                               : absl::Seconds(90))));
        auto reader = stub->Generate(&ctx, request);
        v1::GenerateResponse response;
        while (reader->Read(&response)) {
          o.tokens += response.token_ids_size();
          if (response.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
            o.finished_message = true;
            o.usage_completion = response.usage().completion_tokens();
          }
          if (o.kind == Kind::kCancel && o.tokens >= cancel_after) ctx.TryCancel();
        }
        o.status = reader->Finish();
      }
    });
  }
  for (auto& c : clients) c.join();
  const absl::Duration took = absl::Now() - start;
  EXPECT_LT(took, absl::Seconds(150)) << "no request may hang";

  int ok = 0, cancelled = 0, late = 0;
  for (size_t i = 0; i < outcomes.size(); ++i) {
    const Outcome& o = outcomes[i];
    const std::string what = absl::StrCat("request ", i, " (kind ", static_cast<int>(o.kind),
                                          ", max_tokens ", o.max_tokens, "): ",
                                          o.status.error_code(), " ", o.status.error_message());
    switch (o.status.error_code()) {
      case grpc::StatusCode::OK:
        ++ok;
        EXPECT_TRUE(o.finished_message) << what;
        EXPECT_EQ(o.tokens, o.max_tokens) << what;
        EXPECT_EQ(o.usage_completion, o.tokens) << what;
        break;
      case grpc::StatusCode::CANCELLED:
        ++cancelled;
        EXPECT_EQ(o.kind, Kind::kCancel) << what;
        break;
      case grpc::StatusCode::DEADLINE_EXCEEDED:
        ++late;
        EXPECT_EQ(o.kind, Kind::kShortDeadline) << what;
        break;
      default:
        ADD_FAILURE() << what;
    }
    if (o.kind == Kind::kComplete) {
      EXPECT_TRUE(o.status.ok()) << what;
    }
  }
  EXPECT_GT(ok, 0);
  EXPECT_GT(cancelled + late, 0);

  // Every block returns: none in use, free + cached = all, nothing running or queued.
  std::string after;
  EXPECT_TRUE(Eventually(
      [&] {
        after = Metrics(server.metrics_port);
        return Metric(after, "vlm_language_kv_blocks{state=\"used\"}") == 0 &&
               Metric(after, "vlm_language_sequences_running") == 0 &&
               Metric(after, "vlm_language_queue_depth") == 0;
      },
      absl::Seconds(10)))
      << after;
  EXPECT_EQ(Metric(after, "vlm_language_kv_blocks{state=\"free\"}") +
                Metric(after, "vlm_language_kv_blocks{state=\"cached\"}"),
            64);
  EXPECT_TRUE(server.Exited() == false) << server.LogTail();
  std::printf("stress: %d ok, %d cancelled, %d deadline exceeded in %.1f s; preemptions %.0f\n",
              ok, cancelled, late, absl::ToDoubleSeconds(took),
              Metric(after, "vlm_language_preemptions_total"));
}

}  // namespace
}  // namespace vlm
