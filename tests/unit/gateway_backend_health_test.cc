// vlm_gateway_backend_serving follows the vision replicas that DNS lists: a
// replica that leaves DNS loses its series (it must not stay frozen at its last
// value), one that comes back gets it again. The replicas are unreachable
// loopback ports; only the set of series is checked.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "common/readiness.h"
#include "services/gateway/backend_health.h"
#include "services/gateway/router.h"

namespace vlm::gateway {
namespace {

bool HasSeries(const std::string& target) {
  return absl::StrContains(RenderMetrics(),
                           "vlm_gateway_backend_serving{backend=\"vision\",target=\"" + target + "\"}");
}

TEST(GatewayBackendHealthTest, ReplicaThatLeavesDnsLosesItsServingSeries) {
  absl::Mutex mu;
  std::vector<std::string> listed = {"127.0.0.1:1", "127.0.0.1:2"};
  VisionRouterOptions options;
  options.dns_target = "vision.test:50051";
  options.dns_refresh = absl::Hours(1);  // resolutions only through RefreshNow()
  options.resolver = [&](const std::string&) -> absl::StatusOr<std::vector<std::string>> {
    absl::MutexLock lock(&mu);
    return listed;
  };
  Readiness readiness;
  BackendHealth health(&readiness, "vlm.v1.VisionLanguage");
  absl::StatusOr<std::unique_ptr<VisionRouter>> router =
      VisionRouter::Create(options, [&health] { health.Update(); });
  ASSERT_TRUE(router.ok()) << router.status();
  VisionRouter* r = router->get();
  health.Start([] { return std::vector<BackendState>{{"127.0.0.1:3", BackendStatus::kUnknown, ""}}; },
               [r] { return r->Replicas(); });
  EXPECT_TRUE(HasSeries("127.0.0.1:1"));
  EXPECT_TRUE(HasSeries("127.0.0.1:2"));

  {
    absl::MutexLock lock(&mu);
    listed = {"127.0.0.1:1"};
  }
  r->RefreshNow();
  EXPECT_TRUE(HasSeries("127.0.0.1:1"));
  EXPECT_FALSE(HasSeries("127.0.0.1:2")) << RenderMetrics();

  {
    absl::MutexLock lock(&mu);
    listed = {"127.0.0.1:1", "127.0.0.1:2"};
  }
  r->RefreshNow();
  EXPECT_TRUE(HasSeries("127.0.0.1:2"));
  health.Stop();
  router->reset();
}

}  // namespace
}  // namespace vlm::gateway
