#include "services/gateway/backend_health.h"

#include <prometheus/gauge.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/metrics.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace vlm::gateway {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

prometheus::Family<prometheus::Gauge>& BackendServingFamily() {
  static auto& family = prometheus::BuildGauge()
                            .Name("vlm_gateway_backend_serving")
                            .Help("1 while a backend replica is SERVING and routed to (language: also its model matches).")
                            .Register(MetricsRegistry());
  return family;
}

prometheus::Gauge& ReadyGauge() {
  static auto& gauge = prometheus::BuildGauge()
                           .Name("vlm_gateway_ready")
                           .Help("1 while the gateway is SERVING (>= 1 language and >= 1 vision replica).")
                           .Register(MetricsRegistry())
                           .Add({});
  return gauge;
}

}  // namespace

const char* BackendStatusName(BackendStatus status) {
  switch (status) {
    case BackendStatus::kUnknown: return "not yet known";
    case BackendStatus::kServing: return "SERVING";
    case BackendStatus::kNotServing: return "NOT_SERVING";
    case BackendStatus::kUnreachable: return "unreachable";
  }
  return "?";
}

HealthWatch::HealthWatch(std::string name, std::shared_ptr<grpc::Channel> channel,
                         std::string service, HealthWatchOptions options,
                         std::function<void()> on_change)
    : name_(std::move(name)),
      channel_(std::move(channel)),
      service_(std::move(service)),
      options_(options),
      on_change_(std::move(on_change)) {
  thread_ = std::thread([this] { Run(); });
}

HealthWatch::~HealthWatch() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    if (call_ != nullptr) call_->TryCancel();
    stop_cv_.SignalAll();
  }
  thread_.join();
}

BackendState HealthWatch::state() const {
  absl::MutexLock lock(&mu_);
  return BackendState{name_, status_, detail_};
}

void HealthWatch::Set(BackendStatus status, std::string detail) {
  {
    absl::MutexLock lock(&mu_);
    if (stop_ || (status_ == status && detail_ == detail)) return;
    if (status_ != status) {
      LogInfo("gateway", "backend health changed",
              {{"backend", name_},
               {"service", service_},
               {"from", BackendStatusName(status_)},
               {"to", BackendStatusName(status)},
               {"detail", detail}});
    }
    status_ = status;
    detail_ = std::move(detail);
  }
  if (on_change_) on_change_();
}

void HealthWatch::Run() {
  std::unique_ptr<grpc::health::v1::Health::Stub> stub = grpc::health::v1::Health::NewStub(channel_);
  absl::Duration backoff = options_.retry_initial;
  for (;;) {
    grpc::ClientContext context;
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      call_ = &context;
    }
    HealthCheckRequest request;
    request.set_service(service_);
    std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader = stub->Watch(&context, request);
    HealthCheckResponse response;
    while (reader->Read(&response)) {
      backoff = options_.retry_initial;  // the backend answered: reconnect quickly next time
      switch (response.status()) {
        case HealthCheckResponse::SERVING:
          Set(BackendStatus::kServing, "");
          break;
        case HealthCheckResponse::SERVICE_UNKNOWN:
          Set(BackendStatus::kNotServing, absl::StrCat("does not serve ", service_));
          break;
        default:
          Set(BackendStatus::kNotServing, "");
          break;
      }
    }
    const grpc::Status status = reader->Finish();
    {
      absl::MutexLock lock(&mu_);
      call_ = nullptr;
      if (stop_) return;
    }
    Set(BackendStatus::kUnreachable,
        status.ok() ? "health stream ended" : status.error_message());
    absl::MutexLock lock(&mu_);
    const absl::Time wake = absl::Now() + backoff;
    while (!stop_ && absl::Now() < wake) stop_cv_.WaitWithDeadline(&mu_, wake);
    backoff = std::min(backoff * 2, options_.retry_max);
  }
}

namespace {

std::string Describe(const BackendState& s) {
  return absl::StrCat(s.name, " ", BackendStatusName(s.status),
                      s.detail.empty() ? "" : absl::StrCat(" (", s.detail, ")"));
}

bool AnyServing(absl::Span<const BackendState> states) {
  for (const BackendState& s : states) {
    if (s.status == BackendStatus::kServing) return true;
  }
  return false;
}

std::string DescribeAll(absl::Span<const BackendState> states) {
  std::vector<std::string> parts;
  for (const BackendState& s : states) parts.push_back(Describe(s));
  return absl::StrJoin(parts, "; ");
}

}  // namespace

absl::Status EvaluateReadiness(absl::Span<const BackendState> language,
                               absl::Span<const BackendState> vision) {
  if (language.empty()) return absl::FailedPreconditionError("no language replica is known");
  if (!AnyServing(language)) {
    if (language.size() == 1) {
      const BackendState& only = language[0];
      return absl::FailedPreconditionError(absl::StrCat(
          "language service ", only.name, " is ", BackendStatusName(only.status),
          only.detail.empty() ? "" : absl::StrCat(" (", only.detail, ")")));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("no language replica is SERVING: ", DescribeAll(language)));
  }
  if (vision.empty()) return absl::FailedPreconditionError("no vision replica is known");
  if (AnyServing(vision)) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("no vision replica is SERVING: ", DescribeAll(vision)));
}

BackendHealth::BackendHealth(Readiness* readiness, std::string service)
    : readiness_(readiness), service_(std::move(service)) {}

BackendHealth::~BackendHealth() { Stop(); }

void BackendHealth::Start(States language, States vision) {
  {
    absl::MutexLock lock(&mu_);
    language_ = std::move(language);
    vision_ = std::move(vision);
    started_ = true;
  }
  Update();
}

void BackendHealth::Stop() {
  absl::MutexLock lock(&mu_);
  started_ = false;
  language_ = nullptr;
  vision_ = nullptr;
}

void BackendHealth::Update() {
  absl::MutexLock update(&update_mu_);
  std::vector<BackendState> language_states;
  std::vector<BackendState> vision_states;
  {
    absl::MutexLock lock(&mu_);
    if (!started_) return;
    language_states = language_();
    vision_states = vision_();
  }

  auto& family = BackendServingFamily();
  for (const auto& [backend, states] :
       {std::pair<const char*, const std::vector<BackendState>*>{"language", &language_states},
        {"vision", &vision_states}}) {
    std::set<std::string> exported;
    for (const BackendState& replica : *states) {
      family.Add({{"backend", backend}, {"target", replica.name}})
          .Set(replica.status == BackendStatus::kServing ? 1 : 0);
      exported.insert(replica.name);
    }
    for (const std::string& gone : exported_[backend]) {
      // A replica DNS no longer lists: drop its series rather than freeze it.
      if (exported.count(gone) == 0) {
        family.Remove(&family.Add({{"backend", backend}, {"target", gone}}));
      }
    }
    exported_[backend] = std::move(exported);
  }

  const absl::Status ready = EvaluateReadiness(language_states, vision_states);
  const std::string reason = ready.ok() ? "" : std::string(ready.message());
  if (reason == published_) return;
  published_ = reason;
  ReadyGauge().Set(ready.ok() ? 1 : 0);
  if (ready.ok()) {
    readiness_->SetServing(service_);
  } else {
    readiness_->SetNotServing(service_, reason);
  }
}

}  // namespace vlm::gateway
