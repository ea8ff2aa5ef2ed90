// vlm-test-server: the server bootstrap around a trivial VisionEncoder, for the
// bootstrap's integration test. Encode echoes content_hash into
// features.content_hash; content_hash "sleep:<ms>" first sleeps that long
// (returning CANCELLED if the call is cancelled meanwhile), to test the drain.
#include <grpcpp/grpcpp.h>

#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/server.h"
#include "vlm/v1/vision.grpc.pb.h"

ABSL_FLAG(int, ready_after_ms, 0, "milliseconds of pretend warm-up before SERVING");

namespace {

class TestVisionService final : public vlm::v1::VisionEncoder::Service {
 public:
  explicit TestVisionService(const vlm::Readiness* readiness) : readiness_(readiness) {}

  grpc::Status Encode(grpc::ServerContext* context, const vlm::v1::EncodeRequest* request,
                      vlm::v1::EncodeResponse* response) override {
    if (grpc::Status s = readiness_->CheckGrpc(vlm::v1::VisionEncoder::service_full_name());
        !s.ok()) {
      return s;
    }
    absl::string_view hash = request->content_hash();
    int sleep_ms = 0;
    if (absl::ConsumePrefix(&hash, "sleep:") && absl::SimpleAtoi(hash, &sleep_ms)) {
      const absl::Time until = absl::Now() + absl::Milliseconds(sleep_ms);
      while (absl::Now() < until) {
        if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
        absl::SleepFor(absl::Milliseconds(5));
      }
    }
    response->mutable_features()->set_content_hash(request->content_hash());
    response->set_replica("vlm-test-server");
    return grpc::Status::OK;
  }

 private:
  const vlm::Readiness* readiness_;
};

}  // namespace

int main(int argc, char** argv) {
  vlm::ParseCommandLine(argc, argv, "vlm-test-server: the server bootstrap around a test service");
  vlm::LogEffectiveConfiguration("test-server");
  const std::string name = vlm::v1::VisionEncoder::service_full_name();

  vlm::Server server(vlm::ServerOptions::FromFlags());
  TestVisionService service(&server.readiness());
  server.AddService(&service, name, "warming up");
  if (absl::Status s = server.Start(); !s.ok()) {
    vlm::LogError("test-server", "cannot start", {{"error", s.ToString()}});
    return 1;
  }
  absl::Notification stop;
  std::thread warmup([&] {
    if (!stop.WaitForNotificationWithTimeout(
            absl::Milliseconds(absl::GetFlag(FLAGS_ready_after_ms)))) {
      server.readiness().SetServing(name);
    }
  });
  absl::Status done = server.Wait();
  stop.Notify();
  warmup.join();
  return done.ok() ? 0 : 1;
}
