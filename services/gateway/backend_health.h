// The gateway's view of its backends' health, and its own readiness.
//
// A HealthWatch follows one backend's grpc.health.v1 Watch stream for one
// service name on its own thread, reconnecting with backoff when the stream
// breaks. BackendHealth turns the language watch and the vision replicas'
// watches into the gateway's readiness: SERVING only while the language
// service is SERVING and at least one vision replica is. None of this runs on
// the request path: the gateway's own health is answered by gRPC's health
// service from the last published state.
#ifndef VLM_SERVICES_GATEWAY_BACKEND_HEALTH_H_
#define VLM_SERVICES_GATEWAY_BACKEND_HEALTH_H_

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/readiness.h"

namespace vlm::gateway {

enum class BackendStatus {
  kUnknown,      // no answer yet
  kServing,
  kNotServing,   // NOT_SERVING or SERVICE_UNKNOWN
  kUnreachable,  // the watch stream failed; retrying
};
const char* BackendStatusName(BackendStatus status);  // "SERVING", "unreachable", ...

struct BackendState {
  std::string name;  // target address
  BackendStatus status = BackendStatus::kUnknown;
  std::string detail;  // e.g. the error of the last failed watch
};

struct HealthWatchOptions {
  absl::Duration retry_initial = absl::Milliseconds(100);  // doubled per failure
  absl::Duration retry_max = absl::Seconds(1);
};

class HealthWatch {
 public:
  // Starts watching `service` on `channel` at once. `on_change` runs on the
  // watch's thread after each change of state, with no lock held.
  HealthWatch(std::string name, std::shared_ptr<grpc::Channel> channel, std::string service,
              HealthWatchOptions options, std::function<void()> on_change);
  ~HealthWatch();  // cancels the stream and joins the thread
  HealthWatch(const HealthWatch&) = delete;
  HealthWatch& operator=(const HealthWatch&) = delete;

  BackendState state() const;
  bool serving() const { return state().status == BackendStatus::kServing; }

 private:
  void Run();
  void Set(BackendStatus status, std::string detail);

  const std::string name_;
  const std::shared_ptr<grpc::Channel> channel_;
  const std::string service_;
  const HealthWatchOptions options_;
  const std::function<void()> on_change_;
  mutable absl::Mutex mu_;
  absl::CondVar stop_cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* call_ ABSL_GUARDED_BY(mu_) = nullptr;
  BackendStatus status_ ABSL_GUARDED_BY(mu_) = BackendStatus::kUnknown;
  std::string detail_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// The gateway's readiness rule: OK when `language` is SERVING and at least one
// of `vision` is; otherwise FailedPrecondition with the reason, e.g.
// "language service 127.0.0.1:50053 is NOT_SERVING".
absl::Status EvaluateReadiness(const BackendState& language, absl::Span<const BackendState> vision);

// Publishes EvaluateReadiness into `readiness` for `service` whenever Update()
// runs (the watches call it), and exports vlm_gateway_backend_serving.
class BackendHealth {
 public:
  using VisionStates = std::function<std::vector<BackendState>()>;

  BackendHealth(Readiness* readiness, std::string service);
  ~BackendHealth();  // Stop()
  BackendHealth(const BackendHealth&) = delete;
  BackendHealth& operator=(const BackendHealth&) = delete;

  // Starts watching the language service's vlm.v1.Language status on
  // `channel`; vision states come from `vision` (the router's replicas).
  void Start(std::string language_target, std::shared_ptr<grpc::Channel> channel,
             VisionStates vision, HealthWatchOptions options);
  // Stops the language watch; later Update() calls do nothing. Idempotent.
  void Stop();

  // Re-evaluates and publishes. Thread-safe; a no-op before Start().
  void Update();

 private:
  Readiness* const readiness_;
  const std::string service_;
  absl::Mutex update_mu_;  // serializes Update() so the last evaluation wins
  // Lock order: update_mu_, mu_, then a watch's or the router's own lock.
  mutable absl::Mutex mu_ ABSL_ACQUIRED_AFTER(update_mu_);
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  VisionStates vision_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<HealthWatch> language_ ABSL_GUARDED_BY(mu_);
  std::string published_ ABSL_GUARDED_BY(update_mu_) = "\x01";  // last published reason
  std::set<std::string> exported_vision_ ABSL_GUARDED_BY(update_mu_);  // gauge label values
};

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_BACKEND_HEALTH_H_
