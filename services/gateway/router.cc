#include "common/grpc_status.h"
#include "services/gateway/router.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <prometheus/counter.h>
#include <sys/socket.h>

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/sha256.h"

namespace vlm::gateway {
namespace {

struct RouterMetrics {
  prometheus::Family<prometheus::Counter>& calls =
      prometheus::BuildCounter()
          .Name("vlm_gateway_vision_calls_total")
          .Help("Encode calls made by the gateway, by vision replica and status code.")
          .Register(MetricsRegistry());
  prometheus::Counter& retries =
      prometheus::BuildCounter()
          .Name("vlm_gateway_vision_retries_total")
          .Help("Encode calls repeated on the next replica after UNAVAILABLE.")
          .Register(MetricsRegistry())
          .Add({});
};

RouterMetrics& Metrics() {
  static RouterMetrics* metrics = new RouterMetrics();
  return *metrics;
}

std::string FormatHostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                             : absl::StrCat(host, ":", port);
}

}  // namespace

uint64_t RendezvousWeight(std::string_view replica, std::string_view key) {
  Sha256Hasher hasher;
  hasher.Update(replica);
  hasher.Update("\n");
  hasher.Update(key);
  const Sha256Digest digest = hasher.Finish();
  uint64_t weight = 0;
  for (int i = 0; i < 8; ++i) weight = (weight << 8) | digest[i];
  return weight;
}

std::vector<std::string> RendezvousOrder(std::string_view key, std::vector<std::string> replicas) {
  std::vector<std::pair<uint64_t, std::string>> weighted;
  weighted.reserve(replicas.size());
  for (std::string& r : replicas) {
    const uint64_t w = RendezvousWeight(r, key);
    weighted.emplace_back(w, std::move(r));
  }
  std::sort(weighted.begin(), weighted.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  std::vector<std::string> order;
  order.reserve(weighted.size());
  for (auto& [w, r] : weighted) order.push_back(std::move(r));
  return order;
}

absl::StatusOr<std::vector<std::string>> ParseTargetList(std::string_view list) {
  std::vector<std::string> targets;
  std::set<std::string> seen;
  for (absl::string_view piece : absl::StrSplit(absl::string_view(list.data(), list.size()), ',')) {
    const std::string entry(absl::StripAsciiWhitespace(piece));
    if (entry.empty()) continue;
    absl::StatusOr<std::pair<std::string, int>> host_port = ParseHostPort(entry);
    if (!host_port.ok() || host_port->first.empty() || entry[0] == ':' ||
        host_port->second <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("target \"", entry, "\" is not host:port with a non-zero port"));
    }
    if (seen.insert(entry).second) targets.push_back(entry);
  }
  return targets;
}

absl::StatusOr<std::vector<std::string>> ResolveHostPort(const std::string& host_port) {
  absl::StatusOr<std::pair<std::string, int>> parsed = ParseHostPort(host_port);
  if (!parsed.ok() || parsed->first.empty() || parsed->second <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", host_port, "\" is not host:port with a non-zero port"));
  }
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = ::getaddrinfo(parsed->first.c_str(), nullptr, &hints, &result);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", parsed->first, ": ", ::gai_strerror(rc)));
  }
  std::set<std::string> addresses;
  for (addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* addr = nullptr;
    if (ai->ai_family == AF_INET) {
      addr = &reinterpret_cast<sockaddr_in*>(ai->ai_addr)->sin_addr;
    } else if (ai->ai_family == AF_INET6) {
      addr = &reinterpret_cast<sockaddr_in6*>(ai->ai_addr)->sin6_addr;
    } else {
      continue;
    }
    if (::inet_ntop(ai->ai_family, addr, text, sizeof(text)) != nullptr) {
      addresses.insert(FormatHostPort(text, parsed->second));
    }
  }
  ::freeaddrinfo(result);
  if (addresses.empty()) {
    return absl::UnavailableError(absl::StrCat(parsed->first, " has no IPv4/IPv6 address"));
  }
  return std::vector<std::string>(addresses.begin(), addresses.end());
}

struct VisionRouter::Replica {
  std::string name;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::VisionEncoder::Stub> stub;
  std::unique_ptr<HealthWatch> watch;  // destroyed first: its thread uses nothing else here
};

VisionRouter::VisionRouter(VisionRouterOptions options, std::function<void()> on_health_change)
    : options_(std::move(options)), on_health_change_(std::move(on_health_change)) {}

absl::StatusOr<std::unique_ptr<VisionRouter>> VisionRouter::Create(
    VisionRouterOptions options, std::function<void()> on_health_change) {
  if (options.max_attempts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("vision_max_attempts is ", options.max_attempts, "; must be >= 1"));
  }
  if (options.dns_target.empty() && options.static_targets.empty()) {
    return absl::InvalidArgumentError("no vision replica: give a target list or a DNS name");
  }
  if (!options.dns_target.empty() && options.dns_refresh <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the DNS refresh interval must be positive");
  }
  std::unique_ptr<VisionRouter> router(
      new VisionRouter(std::move(options), std::move(on_health_change)));
  if (router->options_.dns_target.empty()) {
    router->SetReplicas(router->options_.static_targets);
  } else {
    router->RefreshNow();
    router->resolver_ = std::thread([r = router.get()] { r->ResolveLoop(); });
  }
  return router;
}

VisionRouter::~VisionRouter() {
  {
    absl::MutexLock lock(&stop_mu_);
    stop_ = true;
    stop_cv_.SignalAll();
  }
  if (resolver_.joinable()) resolver_.join();
  std::map<std::string, std::shared_ptr<Replica>> replicas;
  {
    absl::MutexLock lock(&mu_);
    replicas.swap(replicas_);
  }
  replicas.clear();  // joins the watches outside mu_ (their callbacks may read Replicas())
}

void VisionRouter::SetReplicas(const std::vector<std::string>& targets) {
  std::vector<std::shared_ptr<Replica>> removed;
  std::vector<std::string> added;
  {
    absl::MutexLock lock(&mu_);
    const std::set<std::string> wanted(targets.begin(), targets.end());
    for (auto it = replicas_.begin(); it != replicas_.end();) {
      if (wanted.count(it->first) == 0) {
        removed.push_back(std::move(it->second));
        it = replicas_.erase(it);
      } else {
        ++it;
      }
    }
    for (const std::string& target : wanted) {
      if (replicas_.count(target) != 0) continue;
      auto replica = std::make_shared<Replica>();
      replica->name = target;
      replica->channel = CreateBackendChannel(target, options_.channel);
      replica->stub = v1::VisionEncoder::NewStub(replica->channel);
      replica->watch = std::make_unique<HealthWatch>(target, replica->channel,
                                                     "vlm.v1.VisionEncoder", options_.health,
                                                     on_health_change_);
      replicas_.emplace(target, std::move(replica));
      added.push_back(target);
    }
  }
  for (const auto& replica : removed) {
    LogInfo("gateway", "vision replica removed", {{"replica", replica->name}});
  }
  for (const std::string& target : added) {
    LogInfo("gateway", "vision replica added", {{"replica", target}});
  }
  removed.clear();  // in-flight calls may still hold a replica; the last one out frees it
  if (on_health_change_) on_health_change_();
}

void VisionRouter::RefreshNow() {
  if (options_.dns_target.empty()) return;
  absl::MutexLock lock(&resolve_mu_);
  absl::StatusOr<std::vector<std::string>> targets = options_.resolver(options_.dns_target);
  if (!targets.ok() || targets->empty()) {
    // Keep the last known set: a resolver hiccup must not empty the pool.
    const std::string error =
        targets.ok() ? "no addresses" : std::string(targets.status().message());
    if (error != last_resolve_error_) {
      LogWarning("gateway", "vision DNS resolution failed; keeping the known replicas",
                 {{"name", options_.dns_target}, {"error", error}});
      last_resolve_error_ = error;
    }
    if (on_health_change_) on_health_change_();
    return;
  }
  last_resolve_error_.clear();
  SetReplicas(*targets);
}

void VisionRouter::ResolveLoop() {
  for (;;) {
    {
      absl::MutexLock lock(&stop_mu_);
      const absl::Time wake = absl::Now() + options_.dns_refresh;
      while (!stop_ && absl::Now() < wake) stop_cv_.WaitWithDeadline(&stop_mu_, wake);
      if (stop_) return;
    }
    RefreshNow();
  }
}

std::vector<std::shared_ptr<VisionRouter::Replica>> VisionRouter::Order(std::string_view key) const {
  std::vector<std::string> serving;
  std::map<std::string, std::shared_ptr<Replica>> snapshot;
  {
    absl::MutexLock lock(&mu_);
    snapshot = replicas_;
  }
  for (const auto& [name, replica] : snapshot) {
    if (replica->watch->serving()) serving.push_back(name);
  }
  std::vector<std::shared_ptr<Replica>> order;
  for (const std::string& name : RendezvousOrder(key, std::move(serving))) {
    order.push_back(snapshot.at(name));
  }
  return order;
}

std::vector<std::string> VisionRouter::ServingOrder(std::string_view key) const {
  std::vector<std::string> names;
  for (const auto& replica : Order(key)) names.push_back(replica->name);
  return names;
}

std::vector<BackendState> VisionRouter::Replicas() const {
  absl::MutexLock lock(&mu_);
  std::vector<BackendState> states;
  for (const auto& [name, replica] : replicas_) states.push_back(replica->watch->state());
  return states;
}

VisionRouter::EncodeOutcome VisionRouter::Encode(const grpc::ServerContextBase* parent,
                                                 absl::Time deadline, std::string_view key,
                                                 const v1::EncodeRequest& request,
                                                 std::string_view request_id) const {
  EncodeOutcome outcome;
  const std::vector<std::shared_ptr<Replica>> order = Order(key);
  if (order.empty()) {
    std::vector<std::string> states;
    for (const BackendState& s : Replicas()) {
      states.push_back(absl::StrCat(s.name, " ", BackendStatusName(s.status)));
    }
    outcome.status = grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        absl::StrCat("no vision replica is SERVING (",
                     states.empty() ? "none known" : absl::StrJoin(states, ", "), ")"));
    return outcome;
  }
  absl::Duration backoff = options_.retry_backoff;
  for (int attempt = 0; attempt < options_.max_attempts; ++attempt) {
    if (attempt > 0) {
      // Back off, but never past the deadline and not after the caller left.
      const absl::Time wake = std::min(absl::Now() + backoff, deadline);
      while (absl::Now() < wake && !(parent != nullptr && parent->IsCancelled())) {
        absl::SleepFor(std::min(absl::Milliseconds(5), wake - absl::Now()));
      }
      if (absl::Now() >= deadline || (parent != nullptr && parent->IsCancelled())) break;
      backoff *= 2;
      Metrics().retries.Increment();
    }
    const Replica& replica = *order[attempt % order.size()];
    std::unique_ptr<grpc::ClientContext> context = BackendContext(parent, deadline, request_id);
    outcome.response.Clear();
    outcome.status = replica.stub->Encode(context.get(), request, &outcome.response);
    outcome.replica = replica.name;
    outcome.attempts = attempt + 1;
    Metrics()
        .calls.Add({{"replica", replica.name},
                    {"code", GrpcCodeName(outcome.status.error_code())}})
        .Increment();
    if (outcome.status.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    LogWarning("gateway", "vision replica unavailable",
               {{"replica", replica.name},
                {"attempt", attempt + 1},
                {"max_attempts", options_.max_attempts},
                {"error", outcome.status.error_message()}});
  }
  return outcome;
}

}  // namespace vlm::gateway
