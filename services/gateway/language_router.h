// Routing of Generate calls over the language replicas.
//
// Prefix affinity with bounded load. A request's route key is derived from
// its conversation prefix: the system messages and the first user message
// (text and image content hashes), which every later turn of the same
// conversation repeats. Rendezvous hashing of that key over the routable
// replicas gives the conversation's home, so every gateway replica picks the
// same home without coordination and turn 2 lands where turn 1 left its KV
// prefix and projected image. A replica over the load bound (its running +
// waiting sequences exceed the least-loaded replica's by more than `slack`
// and by more than `factor` times) passes the request to the next replica in
// hash order. Where a conversation was served last is remembered (a bounded
// LRU of route keys), so a conversation sent away once by the bound stays
// with the replica that holds its prefix.
//
// Replicas come from a static list or a DNS name (a Kubernetes headless
// Service) re-resolved in the background. Each replica's health is watched,
// and its ReplicaInfo is polled for its model fingerprint and load. A replica
// is routable while it is SERVING and serves the model most replicas serve
// (ties: the fingerprint seen first); one serving another model, or one that
// does not answer ReplicaInfo (another protocol), is not routed to and is
// reported in Replicas() and the log.
//
// Failover belongs to the caller (chat_pipeline.cc): a call that fails
// UNAVAILABLE before its first response moves on to the next replica of the
// plan; after a response has been streamed it cannot.
//
// Thread-safety: every public method may be called from any thread.
#ifndef VLM_SERVICES_GATEWAY_LANGUAGE_ROUTER_H_
#define VLM_SERVICES_GATEWAY_LANGUAGE_ROUTER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "services/gateway/backend_call.h"
#include "services/gateway/backend_health.h"
#include "services/gateway/router.h"
#include "vlm/v1/gateway.pb.h"
#include "vlm/v1/language.grpc.pb.h"

namespace vlm::gateway {

// The route key of `request` (hex SHA-256): its messages up to and including
// the first user message, each as its role, its texts and its images' content
// hashes. `image_keys` are the hex SHA-256 of every image of the request, in
// request order (the pipeline has them from encoding).
std::string ConversationRouteKey(const v1::ChatRequest& request,
                                 absl::Span<const std::string> image_keys);

// --- the routing policy, a pure function --------------------------------------

struct LoadBound {
  int slack = 2;        // sequences a replica may carry beyond the least-loaded one
  double factor = 1.5;  // ... and beyond this multiple of it
};

// True when a replica carrying `load` sequences is over the bound, given the
// least-loaded routable replica's `least_load`.
bool OverLoadBound(int load, int least_load, const LoadBound& bound);

struct ReplicaLoad {
  std::string name;
  int load = 0;  // running + waiting sequences, as best known
};

struct RoutePlan {
  std::vector<std::string> order;  // replicas to try, in order
  std::string route;               // why order[0]: "affinity", "load" or "round_robin"
};

// Affinity: the replicas in rendezvous order of `key`, `remembered` (where the
// conversation was served last; "" if none or no longer routable) moved to
// the front; then the first of them within the load bound is tried first
// (route "load" when that is not the preferred one), the others follow in
// that order.
RoutePlan PlanAffinityRoute(std::string_view key, absl::Span<const ReplicaLoad> replicas,
                            const LoadBound& bound, std::string_view remembered = "");
// Round robin (the baseline): the replicas by name, rotated by `counter`.
RoutePlan PlanRoundRobinRoute(uint64_t counter, absl::Span<const ReplicaLoad> replicas);

// Where conversations were served last: route key -> replica, the least
// recently used entry dropped beyond `capacity`. Thread-safe.
class AffinityMemory {
 public:
  explicit AffinityMemory(size_t capacity) : capacity_(capacity) {}
  void Remember(const std::string& key, const std::string& replica);
  std::string Recall(const std::string& key);  // "" if unknown
  size_t size() const;

 private:
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::list<std::pair<std::string, std::string>> lru_ ABSL_GUARDED_BY(mu_);  // front: newest
  std::unordered_map<std::string, std::list<std::pair<std::string, std::string>>::iterator>
      index_ ABSL_GUARDED_BY(mu_);
};

// --- the router ------------------------------------------------------------------

// Counts one Generate call in vlm_gateway_language_requests_total{replica,route}.
void CountLanguageRequest(const std::string& replica, const std::string& route);

enum class LanguageRouting { kAffinity, kRoundRobin };
absl::StatusOr<LanguageRouting> ParseLanguageRouting(std::string_view name);

struct LanguageRouterOptions {
  std::vector<std::string> static_targets;  // used when dns_target is empty
  std::string dns_target;                   // host:port, resolved every dns_refresh
  absl::Duration dns_refresh = absl::Seconds(5);
  Resolver resolver = ResolveHostPort;  // replaceable in tests
  LanguageRouting routing = LanguageRouting::kAffinity;
  LoadBound bound;
  int max_attempts = 3;  // Generate calls per request, each on another replica
  absl::Duration info_refresh = absl::Milliseconds(500);  // ReplicaInfo polls
  size_t affinity_entries = 100000;                        // AffinityMemory capacity
  ChannelOptions channel;
  HealthWatchOptions health;
};

// One language replica; handed out by Plan and kept alive by its holder.
class LanguageReplica {
 public:
  const std::string& name() const { return name_; }
  v1::Language::StubInterface& stub() const { return *stub_; }

  // Counts a call of this gateway on the replica while it lives.
  class Call {
   public:
    explicit Call(std::shared_ptr<LanguageReplica> replica);
    ~Call();
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;
    LanguageReplica& replica() const { return *replica_; }

   private:
    std::shared_ptr<LanguageReplica> replica_;
  };

  ~LanguageReplica();

 private:
  friend class LanguageRouter;
  enum class InfoState { kUnknown, kOk, kUnimplemented };
  LanguageReplica() = default;
  void PollLoop(absl::Duration refresh, const std::function<void()>& on_change);
  void Kick();

  std::string name_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Language::StubInterface> stub_;
  std::atomic<int> inflight_{0};  // this gateway's calls on the replica
  mutable absl::Mutex mu_;
  InfoState info_state_ ABSL_GUARDED_BY(mu_) = InfoState::kUnknown;
  std::string fingerprint_ ABSL_GUARDED_BY(mu_);
  std::string info_error_ ABSL_GUARDED_BY(mu_);
  // Sequences of other clients (other gateways): running + waiting at the
  // last poll minus this gateway's calls then. A replica's load is this plus
  // this gateway's calls now, so a call that ends counts at once.
  int others_load_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool kicked_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* call_ ABSL_GUARDED_BY(mu_) = nullptr;  // the poll in flight
  absl::CondVar cv_;
  std::unique_ptr<HealthWatch> watch_;
  std::thread poller_;
};

class LanguageRouter {
 public:
  // InvalidArgument for an empty target list, a bad option; with a DNS name,
  // NotFound when the first resolution fails (an unresolvable name is a
  // start-up error; later failures keep the known replicas). `on_change`
  // runs on background threads, with no router lock held, whenever a
  // replica's health, model or presence changes.
  static absl::StatusOr<std::unique_ptr<LanguageRouter>> Create(LanguageRouterOptions options,
                                                                std::function<void()> on_change);
  ~LanguageRouter();  // stops re-resolution, the polls and the watches
  LanguageRouter(const LanguageRouter&) = delete;
  LanguageRouter& operator=(const LanguageRouter&) = delete;

  struct Plan {
    std::vector<std::shared_ptr<LanguageReplica>> order;  // at most max_attempts
    std::string route;  // of order[0]
    std::string key;    // the route key
  };
  // The replicas to try for a request with route key `key`, in order.
  Plan Route(const std::string& key) const;
  // The conversation of `key` was served by `replica` (its prefix is cached there).
  void Served(const std::string& key, const std::string& replica) const;

  // Every known replica with its effective state: SERVING only when routable;
  // a replica of another model or protocol is NOT_SERVING with the reason.
  std::vector<BackendState> Replicas() const;
  // "no language replica is SERVING (a NOT_SERVING, b unreachable ...)".
  std::string UnavailableReason() const;

  // Re-resolves the DNS name now (also done periodically). No-op for a static list.
  void RefreshNow();
  const LanguageRouterOptions& options() const { return options_; }

 private:
  struct Snapshot;
  LanguageRouter(LanguageRouterOptions options, std::function<void()> on_change);
  void SetReplicas(const std::vector<std::string>& targets);
  absl::Status Resolve();
  void ResolveLoop();
  Snapshot Take() const;
  void ReportModels();

  const LanguageRouterOptions options_;
  const std::function<void()> on_change_;
  std::function<void()> on_replica_change_;  // ReportModels + on_change_
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<LanguageReplica>> replicas_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> fingerprint_order_ ABSL_GUARDED_BY(mu_);  // first seen
  std::map<std::string, std::string> reported_ ABSL_GUARDED_BY(mu_);  // replica -> logged reason
  mutable std::atomic<uint64_t> round_robin_{0};
  mutable AffinityMemory memory_;
  absl::Mutex resolve_mu_;
  std::string last_resolve_error_ ABSL_GUARDED_BY(resolve_mu_);
  absl::Mutex stop_mu_;
  absl::CondVar stop_cv_;
  bool stop_ ABSL_GUARDED_BY(stop_mu_) = false;
  std::thread resolver_;
};

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_LANGUAGE_ROUTER_H_
