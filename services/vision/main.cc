// vlm-vision: the vision-encoder service (vlm.v1.VisionEncoder).
//
//   vlm-vision --model_dir=/models/qwen3-vl-2b --cache_dir=/var/cache/vlm-vision
//
// Health is NOT_SERVING until the weights are mapped and a warm-up forward has
// run; SIGTERM drains (see common/server.h). gRPC on :50052 and metrics on
// :9091 by default, so that the three services started with their defaults on
// one host do not collide. Flags: --helpfull.
#include <thread>

#include "absl/flags/flag.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/omp_wait_policy.h"
#include "common/server.h"
#include "services/vision/vision_service.h"

int main(int argc, char** argv) {
  vlm::EnsureOmpWaitPolicy(argv);  // before any thread: see omp_wait_policy.h
  absl::SetFlag(&FLAGS_grpc_address, "0.0.0.0:50052");
  absl::SetFlag(&FLAGS_metrics_address, "0.0.0.0:9091");
  vlm::ParseCommandLine(argc, argv, "vlm-vision: images to Qwen3-VL vision features (gRPC)");
  vlm::LogEffectiveConfiguration("vision");
  absl::StatusOr<vlm::vision::VisionServiceConfig> config =
      vlm::vision::VisionServiceConfig::FromFlags();
  if (!config.ok()) {
    vlm::LogError("vision", "bad configuration", {{"error", config.status().ToString()}});
    return 2;
  }
  const std::string name = vlm::vision::VisionService::kServiceName;

  vlm::Server server(vlm::ServerOptions::FromFlags());
  vlm::vision::VisionService service(*config, &server.readiness());
  server.AddService(&service, name, "loading weights");
  if (absl::Status s = server.Start(); !s.ok()) {
    vlm::LogError("vision", "cannot start", {{"error", s.ToString()}});
    return 1;
  }
  std::thread loader([&] {
    absl::Status loaded = service.Load();
    if (loaded.ok()) {
      server.readiness().SetServing(name);
    } else {
      vlm::LogError("vision", "cannot load the vision encoder", {{"error", loaded.ToString()}});
      server.Shutdown(loaded);
    }
  });
  absl::Status done = server.Wait();
  loader.join();
  return done.ok() ? 0 : 1;
}
