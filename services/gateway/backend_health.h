// The gateway's view of its backends' health, and its own readiness.
//
// A HealthWatch follows one backend's grpc.health.v1 Watch stream for one
// service name on its own thread, reconnecting with backoff when the stream
// breaks. BackendHealth turns the language and vision replicas' states (the
// routers own their watches) into the gateway's readiness: SERVING only while
// at least one language replica and at least one vision replica are. None of this runs on
// the request path: the gateway's own health is answered by gRPC's health
// service from the last published state.
#ifndef VLM_SERVICES_GATEWAY_BACKEND_HEALTH_H_
#define VLM_SERVICES_GATEWAY_BACKEND_HEALTH_H_

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>

#include <functional>
#include <map>
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

// The gateway's readiness rule: OK when at least one of `language` and one of
// `vision` is SERVING; otherwise FailedPrecondition with the reason, e.g.
// "language service 127.0.0.1:50053 is NOT_SERVING" (one replica) or
// "no language replica is SERVING: a:1 unreachable (...); b:1 NOT_SERVING".
absl::Status EvaluateReadiness(absl::Span<const BackendState> language,
                               absl::Span<const BackendState> vision);

// Publishes EvaluateReadiness into `readiness` for `service` whenever Update()
// runs (the watches call it), and exports vlm_gateway_backend_serving.
class BackendHealth {
 public:
  using States = std::function<std::vector<BackendState>()>;

  BackendHealth(Readiness* readiness, std::string service);
  ~BackendHealth();  // Stop()
  BackendHealth(const BackendHealth&) = delete;
  BackendHealth& operator=(const BackendHealth&) = delete;

  // Starts publishing: the replicas' states come from `language` and
  // `vision` (the routers' Replicas()).
  void Start(States language, States vision);
  // Later Update() calls do nothing. Idempotent.
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
  States language_ ABSL_GUARDED_BY(mu_);
  States vision_ ABSL_GUARDED_BY(mu_);
  std::string published_ ABSL_GUARDED_BY(update_mu_) = "\x01";  // last published reason
  // Gauge label values exported, per backend kind ("language", "vision").
  std::map<std::string, std::set<std::string>> exported_ ABSL_GUARDED_BY(update_mu_);
};

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_BACKEND_HEALTH_H_
