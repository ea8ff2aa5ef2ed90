#include "services/gateway/language_router.h"

#include <prometheus/counter.h>

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/sha256.h"

namespace vlm::gateway {
namespace {

constexpr char kService[] = "vlm.v1.Language";

// Netstring framing ("<len>:<bytes>,"): no two different prefixes hash alike.
void Field(Sha256Hasher& h, std::string_view s) {
  h.Update(absl::StrCat(s.size(), ":"));
  h.Update(s);
  h.Update(",");
}

std::string Short(const std::string& fingerprint) { return fingerprint.substr(0, 12); }

}  // namespace

std::string ConversationRouteKey(const v1::ChatRequest& request,
                                 absl::Span<const std::string> image_keys) {
  Sha256Hasher h;
  Field(h, "vlm-route-key-v1");
  size_t image = 0;
  for (const v1::ChatMessage& message : request.messages()) {
    Field(h, message.role());
    for (const v1::ContentPart& part : message.content()) {
      if (part.has_image()) {
        Field(h, "image");
        Field(h, image < image_keys.size() ? image_keys[image] : "");
        ++image;
      } else {
        Field(h, "text");
        Field(h, part.text());
      }
    }
    if (message.role() == "user") break;  // the first user turn closes the prefix
  }
  return h.FinishHex();
}

bool OverLoadBound(int load, int least_load, const LoadBound& bound) {
  return load > least_load + bound.slack && load > bound.factor * least_load;
}

RoutePlan PlanAffinityRoute(std::string_view key, absl::Span<const ReplicaLoad> replicas,
                            const LoadBound& bound, std::string_view remembered) {
  RoutePlan plan;
  if (replicas.empty()) return plan;
  std::map<std::string, int> load;
  std::vector<std::string> names;
  int least = replicas[0].load;
  for (const ReplicaLoad& r : replicas) {
    load[r.name] = r.load;
    names.push_back(r.name);
    least = std::min(least, r.load);
  }
  std::vector<std::string> preferred = RendezvousOrder(key, std::move(names));
  if (!remembered.empty()) {
    auto it = std::find(preferred.begin(), preferred.end(), remembered);
    if (it != preferred.end()) std::rotate(preferred.begin(), it, it + 1);
  }
  size_t chosen = 0;
  while (chosen < preferred.size() && OverLoadBound(load[preferred[chosen]], least, bound)) {
    ++chosen;
  }
  if (chosen == preferred.size()) chosen = 0;  // unreachable: the least-loaded one is within
  plan.route = chosen == 0 ? "affinity" : "load";
  plan.order.push_back(preferred[chosen]);
  for (size_t i = 0; i < preferred.size(); ++i) {
    if (i != chosen) plan.order.push_back(preferred[i]);
  }
  return plan;
}

RoutePlan PlanRoundRobinRoute(uint64_t counter, absl::Span<const ReplicaLoad> replicas) {
  RoutePlan plan;
  if (replicas.empty()) return plan;
  std::vector<std::string> names;
  for (const ReplicaLoad& r : replicas) names.push_back(r.name);
  std::sort(names.begin(), names.end());
  const size_t first = counter % names.size();
  for (size_t i = 0; i < names.size(); ++i) plan.order.push_back(names[(first + i) % names.size()]);
  plan.route = "round_robin";
  return plan;
}

void AffinityMemory::Remember(const std::string& key, const std::string& replica) {
  if (capacity_ == 0) return;
  absl::MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it != index_.end()) {
    it->second->second = replica;
    lru_.splice(lru_.begin(), lru_, it->second);
    return;
  }
  lru_.emplace_front(key, replica);
  index_[key] = lru_.begin();
  if (lru_.size() > capacity_) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
}

std::string AffinityMemory::Recall(const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return "";
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->second;
}

size_t AffinityMemory::size() const {
  absl::MutexLock lock(&mu_);
  return lru_.size();
}

absl::StatusOr<LanguageRouting> ParseLanguageRouting(std::string_view name) {
  if (name == "affinity") return LanguageRouting::kAffinity;
  if (name == "round_robin") return LanguageRouting::kRoundRobin;
  return absl::InvalidArgumentError(
      absl::StrCat("language routing \"", std::string(name), "\": expected affinity or round_robin"));
}

// --- replicas ---------------------------------------------------------------------

LanguageReplica::Call::Call(std::shared_ptr<LanguageReplica> replica) : replica_(std::move(replica)) {
  replica_->inflight_.fetch_add(1);
}

LanguageReplica::Call::~Call() { replica_->inflight_.fetch_sub(1); }

LanguageReplica::~LanguageReplica() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    if (call_ != nullptr) call_->TryCancel();
    cv_.SignalAll();
  }
  if (poller_.joinable()) poller_.join();
  watch_.reset();  // its callback may still Kick(): mu_ is still alive
}

void LanguageReplica::Kick() {
  absl::MutexLock lock(&mu_);
  kicked_ = true;
  cv_.SignalAll();
}

// Polls ReplicaInfo every `refresh` while the replica is SERVING (at once
// after a health change). A replica that leaves SERVING must answer again
// before it is routed to: it may come back serving another model.
void LanguageReplica::PollLoop(absl::Duration refresh, const std::function<void()>& on_change) {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      const absl::Time wake = absl::Now() + refresh;
      while (!stop_ && !kicked_ && absl::Now() < wake) cv_.WaitWithDeadline(&mu_, wake);
      if (stop_) return;
      kicked_ = false;
    }
    bool changed = false;
    if (!watch_->serving()) {
      absl::MutexLock lock(&mu_);
      changed = info_state_ != InfoState::kUnknown;
      info_state_ = InfoState::kUnknown;
    } else {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(
          absl::Now() + std::clamp(refresh * 2, absl::Milliseconds(200), absl::Seconds(2))));
      {
        absl::MutexLock lock(&mu_);
        if (stop_) return;
        call_ = &context;
      }
      v1::ReplicaInfoResponse info;
      const grpc::Status status = stub_->ReplicaInfo(&context, v1::ReplicaInfoRequest(), &info);
      absl::MutexLock lock(&mu_);
      call_ = nullptr;
      if (stop_) return;
      if (status.ok()) {
        changed = info_state_ != InfoState::kOk || fingerprint_ != info.model_fingerprint();
        info_state_ = InfoState::kOk;
        fingerprint_ = info.model_fingerprint();
        others_load_ = std::max(0, info.running() + info.waiting() - inflight_.load());
        info_error_.clear();
      } else if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
        changed = info_state_ != InfoState::kUnimplemented;
        info_state_ = InfoState::kUnimplemented;
        info_error_ = status.error_message();
      } else {
        info_error_ = status.error_message();  // transient: keep what is known
      }
    }
    if (changed && on_change) on_change();
  }
}

// --- the router --------------------------------------------------------------------

namespace {

prometheus::Family<prometheus::Counter>& RequestsFamily() {
  static auto& family =
      prometheus::BuildCounter()
          .Name("vlm_gateway_language_requests_total")
          .Help("Generate calls made by the gateway, by language replica and route "
                "(affinity, load, failover, round_robin).")
          .Register(MetricsRegistry());
  return family;
}

}  // namespace

struct LanguageRouter::Snapshot {
  struct Entry {
    std::shared_ptr<LanguageReplica> replica;
    BackendState state;  // effective: kServing only when routable
    std::string fingerprint;
    int load = 0;
  };
  std::vector<Entry> entries;  // by name
  std::string reference;       // the fingerprint routed to ("" if none known)
};

LanguageRouter::LanguageRouter(LanguageRouterOptions options, std::function<void()> on_change)
    : options_(std::move(options)),
      on_change_(std::move(on_change)),
      memory_(options_.affinity_entries) {
  on_replica_change_ = [this] {
    ReportModels();
    if (on_change_) on_change_();
  };
}

absl::StatusOr<std::unique_ptr<LanguageRouter>> LanguageRouter::Create(
    LanguageRouterOptions options, std::function<void()> on_change) {
  if (options.max_attempts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("language_max_attempts is ", options.max_attempts, "; must be >= 1"));
  }
  if (options.bound.slack < 0 || options.bound.factor < 1) {
    return absl::InvalidArgumentError(
        "the language load bound needs slack >= 0 and factor >= 1");
  }
  if (options.info_refresh <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the ReplicaInfo refresh interval must be positive");
  }
  if (options.dns_target.empty() && options.static_targets.empty()) {
    return absl::InvalidArgumentError(
        "no language replica: give --language_targets (host:port,...) or --language_dns");
  }
  if (!options.dns_target.empty() && options.dns_refresh <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the DNS refresh interval must be positive");
  }
  if (options.dns_target.empty()) {
    // A name that resolves to nothing is a typo, not a replica still starting.
    for (const std::string& target : options.static_targets) {
      absl::StatusOr<std::vector<std::string>> addresses = options.resolver(target);
      if (!addresses.ok()) {
        return absl::NotFoundError(absl::StrCat("language target \"", target,
                                                "\" does not resolve: ",
                                                addresses.status().message()));
      }
    }
  }
  std::unique_ptr<LanguageRouter> router(new LanguageRouter(std::move(options), std::move(on_change)));
  if (router->options_.dns_target.empty()) {
    router->SetReplicas(router->options_.static_targets);
  } else {
    if (absl::Status s = router->Resolve(); !s.ok()) {
      return absl::NotFoundError(absl::StrCat("--language_dns ", router->options_.dns_target,
                                              " lists no language replica: ", s.message()));
    }
    router->resolver_ = std::thread([r = router.get()] { r->ResolveLoop(); });
  }
  return router;
}

LanguageRouter::~LanguageRouter() {
  {
    absl::MutexLock lock(&stop_mu_);
    stop_ = true;
    stop_cv_.SignalAll();
  }
  if (resolver_.joinable()) resolver_.join();
  std::map<std::string, std::shared_ptr<LanguageReplica>> replicas;
  {
    absl::MutexLock lock(&mu_);
    replicas.swap(replicas_);
  }
  replicas.clear();  // joins polls and watches outside mu_ (their callbacks take it)
}

void LanguageRouter::SetReplicas(const std::vector<std::string>& targets) {
  std::vector<std::shared_ptr<LanguageReplica>> removed;
  std::vector<std::string> added;
  {
    absl::MutexLock lock(&mu_);
    const std::set<std::string> wanted(targets.begin(), targets.end());
    for (auto it = replicas_.begin(); it != replicas_.end();) {
      if (wanted.count(it->first) == 0) {
        removed.push_back(std::move(it->second));
        reported_.erase(it->first);
        it = replicas_.erase(it);
      } else {
        ++it;
      }
    }
    for (const std::string& target : wanted) {
      if (replicas_.count(target) != 0) continue;
      std::shared_ptr<LanguageReplica> replica(new LanguageReplica());
      replica->name_ = target;
      replica->channel_ = CreateBackendChannel(target, options_.channel);
      replica->stub_ = v1::Language::NewStub(replica->channel_);
      LanguageReplica* raw = replica.get();
      const std::function<void()>* on_replica_change = &on_replica_change_;
      replica->watch_ = std::make_unique<HealthWatch>(
          target, replica->channel_, kService, options_.health, [raw, on_replica_change] {
            raw->Kick();
            (*on_replica_change)();
          });
      replica->poller_ = std::thread([raw, refresh = options_.info_refresh, on_replica_change] {
        raw->PollLoop(refresh, *on_replica_change);
      });
      replicas_.emplace(target, std::move(replica));
      added.push_back(target);
    }
  }
  for (const auto& replica : removed) {
    LogInfo("gateway", "language replica removed", {{"replica", replica->name()}});
  }
  for (const std::string& target : added) {
    LogInfo("gateway", "language replica added", {{"replica", target}});
  }
  removed.clear();  // in-flight calls may still hold a replica; the last one out frees it
  if (on_change_) on_change_();
}

absl::Status LanguageRouter::Resolve() {
  absl::MutexLock lock(&resolve_mu_);
  absl::StatusOr<std::vector<std::string>> targets = options_.resolver(options_.dns_target);
  if (!targets.ok() || targets->empty()) {
    // Keep the last known set: a resolver hiccup must not empty the pool.
    const std::string error =
        targets.ok() ? "no addresses" : std::string(targets.status().message());
    if (error != last_resolve_error_) {
      LogWarning("gateway", "language DNS resolution failed; keeping the known replicas",
                 {{"name", options_.dns_target}, {"error", error}});
      last_resolve_error_ = error;
    }
    return absl::UnavailableError(error);
  }
  last_resolve_error_.clear();
  SetReplicas(*targets);
  return absl::OkStatus();
}

void LanguageRouter::RefreshNow() {
  if (!options_.dns_target.empty()) Resolve().IgnoreError();  // logged; the known set stays
}

void LanguageRouter::ResolveLoop() {
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

LanguageRouter::Snapshot LanguageRouter::Take() const {
  Snapshot snap;
  std::map<std::string, uint64_t> order;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, replica] : replicas_) snap.entries.push_back({replica, {}, "", 0});
    order = fingerprint_order_;
  }
  std::map<std::string, int> votes;
  std::vector<LanguageReplica::InfoState> info(snap.entries.size());
  std::vector<std::string> info_error(snap.entries.size());
  for (size_t i = 0; i < snap.entries.size(); ++i) {
    Snapshot::Entry& e = snap.entries[i];
    e.state = e.replica->watch_->state();
    {
      absl::MutexLock lock(&e.replica->mu_);
      info[i] = e.replica->info_state_;
      info_error[i] = e.replica->info_error_;
      e.fingerprint = e.replica->fingerprint_;
      e.load = e.replica->inflight_.load() + e.replica->others_load_;
    }
    if (e.state.status == BackendStatus::kServing && info[i] == LanguageReplica::InfoState::kOk) {
      ++votes[e.fingerprint];
    }
  }
  // The model most replicas serve; a tie goes to the fingerprint seen first.
  int best = 0;
  uint64_t best_order = UINT64_MAX;
  for (const auto& [fingerprint, count] : votes) {
    auto it = order.find(fingerprint);
    const uint64_t seen = it == order.end() ? UINT64_MAX - 1 : it->second;
    if (count > best || (count == best && seen < best_order)) {
      best = count;
      best_order = seen;
      snap.reference = fingerprint;
    }
  }
  for (size_t i = 0; i < snap.entries.size(); ++i) {
    Snapshot::Entry& e = snap.entries[i];
    if (e.state.status != BackendStatus::kServing) continue;
    e.state.status = BackendStatus::kNotServing;
    switch (info[i]) {
      case LanguageReplica::InfoState::kUnknown:
        e.state.detail = info_error[i].empty()
                             ? "waiting for its ReplicaInfo"
                             : absl::StrCat("ReplicaInfo failed: ", info_error[i]);
        break;
      case LanguageReplica::InfoState::kUnimplemented:
        e.state.detail = absl::StrCat(
            "does not answer vlm.v1.Language/ReplicaInfo (another protocol or version): ",
            info_error[i]);
        break;
      case LanguageReplica::InfoState::kOk:
        if (e.fingerprint == snap.reference) {
          e.state.status = BackendStatus::kServing;
        } else {
          e.state.detail = absl::StrCat("serves another model (fingerprint ", Short(e.fingerprint),
                                        "; the routed replicas serve ", Short(snap.reference), ")");
        }
        break;
    }
  }
  return snap;
}

void LanguageRouter::ReportModels() {
  Snapshot snap = Take();
  std::vector<std::pair<std::string, std::string>> to_log;
  {
    absl::MutexLock lock(&mu_);
    for (const Snapshot::Entry& e : snap.entries) {
      if (!e.fingerprint.empty() && fingerprint_order_.count(e.fingerprint) == 0) {
        const uint64_t next = fingerprint_order_.size();
        fingerprint_order_[e.fingerprint] = next;
      }
      // Only the model and protocol verdicts are reported here; health
      // changes are logged by the watches.
      const bool verdict = e.state.status == BackendStatus::kNotServing &&
                           (absl::StartsWith(e.state.detail, "serves another model") ||
                            absl::StartsWith(e.state.detail, "does not answer"));
      const std::string reason = verdict ? e.state.detail : "";
      std::string& last = reported_[e.state.name];
      if (reason != last) {
        if (!reason.empty()) to_log.emplace_back(e.state.name, reason);
        last = reason;
      }
    }
  }
  for (const auto& [name, reason] : to_log) {
    LogWarning("gateway", "language replica not routed to",
               {{"replica", name}, {"reason", reason}, {"fingerprint", snap.reference}});
  }
}

LanguageRouter::Plan LanguageRouter::Route(const std::string& key) const {
  Snapshot snap = Take();
  std::vector<ReplicaLoad> loads;
  std::map<std::string, std::shared_ptr<LanguageReplica>> by_name;
  for (const Snapshot::Entry& e : snap.entries) {
    if (e.state.status != BackendStatus::kServing) continue;
    loads.push_back({e.state.name, e.load});
    by_name[e.state.name] = e.replica;
  }
  RoutePlan route;
  if (options_.routing == LanguageRouting::kRoundRobin) {
    route = PlanRoundRobinRoute(round_robin_.fetch_add(1), loads);
  } else {
    route = PlanAffinityRoute(key, loads, options_.bound, memory_.Recall(key));
  }
  Plan plan;
  plan.key = key;
  plan.route = route.route;
  for (const std::string& name : route.order) {
    if (plan.order.size() >= static_cast<size_t>(options_.max_attempts)) break;
    plan.order.push_back(by_name.at(name));
  }
  return plan;
}

void LanguageRouter::Served(const std::string& key, const std::string& replica) const {
  if (options_.routing == LanguageRouting::kAffinity) memory_.Remember(key, replica);
}

void CountLanguageRequest(const std::string& replica, const std::string& route) {
  RequestsFamily().Add({{"replica", replica}, {"route", route}}).Increment();
}

std::vector<BackendState> LanguageRouter::Replicas() const {
  std::vector<BackendState> states;
  for (Snapshot::Entry& e : Take().entries) states.push_back(std::move(e.state));
  return states;
}

std::string LanguageRouter::UnavailableReason() const {
  std::vector<std::string> states;
  for (const BackendState& s : Replicas()) {
    states.push_back(absl::StrCat(s.name, " ", BackendStatusName(s.status),
                                  s.detail.empty() ? "" : absl::StrCat(" (", s.detail, ")")));
  }
  return absl::StrCat("no language replica is SERVING (",
                      states.empty() ? "none known" : absl::StrJoin(states, "; "), ")");
}

}  // namespace vlm::gateway
