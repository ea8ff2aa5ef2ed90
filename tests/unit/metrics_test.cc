#include "common/metrics.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <prometheus/counter.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/unit/metrics_text.h"

namespace vlm {
namespace {

TEST(MetricsTest, RegistryIsOnePerProcess) {
  EXPECT_EQ(&MetricsRegistry(), &MetricsRegistry());
  EXPECT_EQ(SharedMetricsRegistry().get(), &MetricsRegistry());
}

TEST(MetricsTest, ProcessGaugesAreRefreshedAtRender) {
  // Touch 64 MiB: the next render must see resident memory grow by about that much.
  const std::optional<double> before = metrics_text::MetricValue(RenderMetrics(), "vlm_process_resident_memory_bytes");
  ASSERT_TRUE(before.has_value());
  constexpr size_t kBytes = 64 << 20;
  std::unique_ptr<char[]> block(new char[kBytes]);
  std::memset(block.get(), 1, kBytes);
  const std::string text = RenderMetrics();
  volatile char sink = block[kBytes - 1];
  (void)sink;

  const std::optional<double> rss = metrics_text::MetricValue(text, "vlm_process_resident_memory_bytes");
  const std::optional<double> peak =
      metrics_text::MetricValue(text, "vlm_process_peak_resident_memory_bytes");
  ASSERT_TRUE(rss.has_value());
  ASSERT_TRUE(peak.has_value());
  EXPECT_GE(*rss - *before, 60.0 * (1 << 20));
  EXPECT_GE(*peak, *rss);

  const std::optional<double> start = metrics_text::MetricValue(text, "vlm_process_start_time_seconds");
  ASSERT_TRUE(start.has_value());
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  EXPECT_LE(*start, now + 1);
  EXPECT_GE(*start, now - 600);  // this test process started moments ago

  EXPECT_NE(text.find("# TYPE vlm_build_info gauge"), std::string::npos);
  const std::optional<double> build = metrics_text::MetricValue(text, "vlm_build_info");
  ASSERT_TRUE(build.has_value());
  EXPECT_EQ(*build, 1.0);
  const std::string build_line = metrics_text::MetricLine(text, "vlm_build_info");
  for (const char* label : {"version=\"", "git_commit=\"", "compiler=\""}) {
    EXPECT_NE(build_line.find(label), std::string::npos) << build_line;
  }
}

TEST(MetricsTest, ReadProcessMemoryAgreesWithItself) {
  absl::StatusOr<ProcessMemory> memory = ReadProcessMemory();
  ASSERT_TRUE(memory.ok()) << memory.status();
  EXPECT_GT(memory->resident_bytes, 1 << 20);
  EXPECT_GE(memory->peak_resident_bytes, memory->resident_bytes);
}

TEST(MetricsTest, LoadPhasesAreGaugesByPhase) {
  RecordLoadPhase("weights", 1.5);
  {
    LoadPhaseTimer timer("warmup");
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  LoadPhaseTimer stopped("header");
  const double seconds = stopped.Stop();
  EXPECT_EQ(stopped.Stop(), seconds);  // recorded once

  const std::string text = RenderMetrics();
  EXPECT_EQ(metrics_text::MetricValue(text, "vlm_model_load_seconds{phase=\"weights\"}"), 1.5);
  const std::optional<double> warmup =
      metrics_text::MetricValue(text, "vlm_model_load_seconds{phase=\"warmup\"}");
  ASSERT_TRUE(warmup.has_value());
  EXPECT_GE(*warmup, 0.03);
  EXPECT_LT(*warmup, 5.0);
  EXPECT_TRUE(metrics_text::MetricValue(text, "vlm_model_load_seconds{phase=\"header\"}").has_value());
}

TEST(MetricsTest, LatencyHistogramUsesDefaultBuckets) {
  const auto buckets = DefaultLatencyBuckets();
  ASSERT_GE(buckets.size(), 10u);
  EXPECT_DOUBLE_EQ(buckets.front(), 0.001);
  EXPECT_GE(buckets.back(), 60.0);
  EXPECT_TRUE(std::is_sorted(buckets.begin(), buckets.end()));

  auto& family = LatencyHistogramFamily("vlm_test_request_seconds", "Test latency.");
  auto& histogram = family.Add({{"rpc", "Encode"}}, buckets);
  histogram.Observe(0.003);
  histogram.Observe(0.2);
  const std::string text = RenderMetrics();
  EXPECT_EQ(metrics_text::MetricValue(text, "vlm_test_request_seconds_count{rpc=\"Encode\"}"), 2.0);
  EXPECT_EQ(metrics_text::MetricValue(text, "vlm_test_request_seconds_bucket{rpc=\"Encode\",le=\"0.005\"}"),
            1.0);
  EXPECT_EQ(metrics_text::MetricValue(text, "vlm_test_request_seconds_bucket{rpc=\"Encode\",le=\"+Inf\"}"),
            2.0);
  // Registering the same family again returns the same one.
  EXPECT_EQ(&LatencyHistogramFamily("vlm_test_request_seconds", "Test latency."), &family);
}

TEST(MetricsTest, ParseHostPort) {
  using HP = std::pair<std::string, int>;
  EXPECT_EQ(*ParseHostPort("127.0.0.1:9090"), HP("127.0.0.1", 9090));
  EXPECT_EQ(*ParseHostPort(":0"), HP("0.0.0.0", 0));
  EXPECT_EQ(*ParseHostPort("[::1]:80"), HP("::1", 80));
  EXPECT_EQ(*ParseHostPort("localhost:1"), HP("localhost", 1));
  EXPECT_FALSE(ParseHostPort("127.0.0.1").ok());
  EXPECT_FALSE(ParseHostPort("127.0.0.1:http").ok());
  EXPECT_FALSE(ParseHostPort("127.0.0.1:70000").ok());
  EXPECT_FALSE(ParseHostPort("::1:80").ok());
}

TEST(MetricsHttpServerTest, ServesMetricsHealthAndReadiness) {
  std::atomic<bool> ready{false};
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start("127.0.0.1:0", [&]() -> absl::Status {
        return ready ? absl::OkStatus() : absl::UnavailableError("projector warming up");
      });
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);
  EXPECT_EQ((*server)->address(), "127.0.0.1:" + std::to_string((*server)->port()));

  httplib::Client client("127.0.0.1", (*server)->port());
  auto metrics = client.Get("/metrics");
  ASSERT_TRUE(metrics) << httplib::to_string(metrics.error());
  EXPECT_EQ(metrics->status, 200);
  EXPECT_EQ(metrics->get_header_value("Content-Type").rfind("text/plain; version=0.0.4", 0), 0u);
  EXPECT_TRUE(metrics_text::MetricValue(metrics->body, "vlm_process_resident_memory_bytes").has_value());

  auto healthz = client.Get("/healthz");
  ASSERT_TRUE(healthz);
  EXPECT_EQ(healthz->status, 200);

  auto readyz = client.Get("/readyz");
  ASSERT_TRUE(readyz);
  EXPECT_EQ(readyz->status, 503);
  EXPECT_EQ(readyz->body, "projector warming up\n");
  ready = true;
  readyz = client.Get("/readyz");
  ASSERT_TRUE(readyz);
  EXPECT_EQ(readyz->status, 200);

  auto missing = client.Get("/nope");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);

  (*server)->Stop();
  (*server)->Stop();  // idempotent
  httplib::Client after("127.0.0.1", (*server)->port());
  after.set_connection_timeout(1);
  EXPECT_FALSE(after.Get("/healthz"));
}

TEST(MetricsHttpServerTest, PortInUseIsAnError) {
  auto first = MetricsHttpServer::Start("127.0.0.1:0", nullptr);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second =
      MetricsHttpServer::Start("127.0.0.1:" + std::to_string((*first)->port()), nullptr);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(MetricsHttpServer::Start("no-port", nullptr).ok());
}

}  // namespace
}  // namespace vlm
