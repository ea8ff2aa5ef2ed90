// The metrics HTTP server must start in a process that has LibTorch loaded
// (prometheus-cpp's civetweb Exposer cannot: toolchain.md, trap 1).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include "common/metrics.h"
#include "tests/unit/metrics_text.h"

namespace vlm {
namespace {

TEST(MetricsTorchTest, HttpServerStartsInALibTorchProcess) {
  at::set_num_threads(1);
  const at::Tensor ones = at::ones({64, 64});
  EXPECT_EQ(at::matmul(ones, ones).sum().item<float>(), 64.0f * 64 * 64);

  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start("127.0.0.1:0", nullptr);
  ASSERT_TRUE(server.ok()) << server.status();
  httplib::Client client("127.0.0.1", (*server)->port());
  auto response = client.Get("/metrics");
  ASSERT_TRUE(response) << httplib::to_string(response.error());
  EXPECT_EQ(response->status, 200);
  const std::optional<double> rss =
      metrics_text::MetricValue(response->body, "vlm_process_resident_memory_bytes");
  ASSERT_TRUE(rss.has_value());
  EXPECT_GT(*rss, 1 << 20);
  auto ready = client.Get("/readyz");
  ASSERT_TRUE(ready);
  EXPECT_EQ(ready->status, 200);
}

}  // namespace
}  // namespace vlm
