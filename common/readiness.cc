#include "common/readiness.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/grpc_status.h"
#include "common/log.h"

namespace vlm {

void Readiness::SetNotServing(std::string_view service, std::string_view reason) {
  if (service.empty()) {
    LogError("readiness", "the whole server follows its services; name a service");
    return;
  }
  absl::MutexLock lock(&mu_);
  ServiceState& state = services_[std::string(service)];
  const bool changed = state.serving || state.reason != reason || state.service.empty();
  state.service = std::string(service);
  state.serving = false;
  state.reason = std::string(reason);
  if (changed) {
    LogInfo("readiness", "not serving", {{"service", service}, {"reason", reason}});
  }
  PublishLocked(state.service);
}

void Readiness::SetServing(std::string_view service) {
  if (service.empty()) {
    LogError("readiness", "the whole server follows its services; name a service");
    return;
  }
  absl::MutexLock lock(&mu_);
  ServiceState& state = services_[std::string(service)];
  const bool changed = !state.serving;
  state.service = std::string(service);
  state.serving = true;
  state.reason.clear();
  if (changed) {
    LogInfo("readiness", draining_ ? "serving (ignored while draining)" : "serving",
            {{"service", service}});
  }
  PublishLocked(state.service);
}

void Readiness::StartDraining(std::string_view reason) {
  absl::MutexLock lock(&mu_);
  if (draining_) return;
  draining_ = true;
  drain_reason_ = std::string(reason);
  LogInfo("readiness", "draining", {{"reason", reason}});
  if (health_ != nullptr) {
    for (const auto& [name, state] : services_) PublishLocked(name);
    health_->Shutdown();  // every name NOT_SERVING, no later changes
  }
}

bool Readiness::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_;
}

bool Readiness::IsServing(std::string_view service) const {
  absl::MutexLock lock(&mu_);
  return CheckLocked(service).ok();
}

absl::Status Readiness::Check(std::string_view service) const {
  absl::MutexLock lock(&mu_);
  return CheckLocked(service);
}

grpc::Status Readiness::CheckGrpc(std::string_view service) const {
  return ToGrpcStatus(Check(service));
}

absl::Status Readiness::CheckLocked(std::string_view service) const {
  if (draining_) return absl::UnavailableError(drain_reason_);
  if (service.empty()) {
    if (services_.empty()) return absl::UnavailableError("no services registered yet");
    std::vector<std::string> waiting;
    for (const auto& [name, state] : services_) {
      if (!state.serving) waiting.push_back(absl::StrCat(name, " is not serving: ", state.reason));
    }
    if (waiting.empty()) return absl::OkStatus();
    return absl::UnavailableError(absl::StrJoin(waiting, "; "));
  }
  auto it = services_.find(service);
  if (it == services_.end()) {
    return absl::UnavailableError(absl::StrCat("unknown service \"", std::string(service), "\""));
  }
  if (!it->second.serving) {
    return absl::UnavailableError(absl::StrCat(std::string(service), " is not serving: ", it->second.reason));
  }
  return absl::OkStatus();
}

void Readiness::AttachHealthService(grpc::HealthCheckServiceInterface* health) {
  absl::MutexLock lock(&mu_);
  health_ = health;
  if (health_ == nullptr) return;
  for (const auto& [name, state] : services_) PublishLocked(name);
  PublishLocked("");
  if (draining_) health_->Shutdown();
}

void Readiness::PublishLocked(const std::string& service) {
  if (health_ == nullptr) return;
  health_->SetServingStatus(service, CheckLocked(service).ok());
  if (!service.empty()) health_->SetServingStatus("", CheckLocked("").ok());
}

std::vector<Readiness::ServiceState> Readiness::Snapshot() const {
  absl::MutexLock lock(&mu_);
  std::vector<ServiceState> out;
  out.reserve(services_.size());
  for (const auto& [name, state] : services_) out.push_back(state);
  return out;
}

}  // namespace vlm
