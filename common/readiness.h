// Readiness of a server and of each gRPC service in it, mirrored into the gRPC
// health service (grpc.health.v1) and checked by RPC handlers.
//
//   readiness.SetNotServing("vlm.v1.Language", "projector warming up");
//   ...warm up...
//   readiness.SetServing("vlm.v1.Language");
//
//   grpc::Status Generate(...) override {
//     if (grpc::Status s = readiness_.CheckGrpc(kServiceName); !s.ok()) return s;
//
// The whole server ("") is SERVING exactly when every registered service is.
// Liveness is not readiness: a process that runs is alive (see /healthz).
// Thread-safe.
#ifndef VLM_COMMON_READINESS_H_
#define VLM_COMMON_READINESS_H_

#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/support/status.h>

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace vlm {

class Readiness {
 public:
  struct ServiceState {
    std::string service;
    bool serving = false;
    std::string reason;  // why it is not serving; empty when serving
  };

  Readiness() = default;
  Readiness(const Readiness&) = delete;
  Readiness& operator=(const Readiness&) = delete;

  // Registers `service` if new. `service` must not be "" (the aggregate).
  void SetNotServing(std::string_view service, std::string_view reason);
  void SetServing(std::string_view service);

  // Every service goes NOT_SERVING with `reason`, for good: later SetServing
  // calls are ignored. Shuts the attached health service down (its watchers
  // see NOT_SERVING).
  void StartDraining(std::string_view reason = "server is draining");
  bool draining() const;

  // "" asks about the whole server.
  bool IsServing(std::string_view service = "") const;
  // OK when IsServing(service), otherwise UNAVAILABLE with the reason
  // ("vlm.v1.Language is not serving: projector warming up", "server is draining").
  absl::Status Check(std::string_view service = "") const;
  grpc::Status CheckGrpc(std::string_view service = "") const;

  // Mirrors every current and future status (and "") into `health`, which must
  // outlive this object or be detached with nullptr.
  void AttachHealthService(grpc::HealthCheckServiceInterface* health);

  // Registered services, sorted by name.
  std::vector<ServiceState> Snapshot() const;

 private:
  absl::Status CheckLocked(std::string_view service) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishLocked(const std::string& service) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, ServiceState, std::less<>> services_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  std::string drain_reason_ ABSL_GUARDED_BY(mu_);
  grpc::HealthCheckServiceInterface* health_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace vlm

#endif  // VLM_COMMON_READINESS_H_
