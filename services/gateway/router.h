// Routing of Encode calls over the vision replicas.
//
// The replica for an image is chosen by rendezvous (highest random weight)
// hashing of the image's SHA-256, so one image always lands on the same
// replica's cache, and adding or removing a replica moves only the images
// that hashed to it. Replicas come from a static list or from a DNS name (a
// Kubernetes headless Service) re-resolved in the background. Each replica's
// health is watched; replicas that are not SERVING are skipped, and a call
// that fails with UNAVAILABLE moves on to the next replica in hash order
// (bounded attempts, doubling backoff, never past the deadline).
#ifndef VLM_SERVICES_GATEWAY_ROUTER_H_
#define VLM_SERVICES_GATEWAY_ROUTER_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "services/gateway/backend_call.h"
#include "services/gateway/backend_health.h"
#include "vlm/v1/vision.grpc.pb.h"

namespace vlm::gateway {

// The weight of `replica` for `key`: the first 8 bytes (big-endian) of
// SHA-256(replica + "\n" + key).
uint64_t RendezvousWeight(std::string_view replica, std::string_view key);
// `replicas` by decreasing weight for `key` (ties by name).
std::vector<std::string> RendezvousOrder(std::string_view key, std::vector<std::string> replicas);

// "host:port[,host:port...]" -> entries; InvalidArgument names a bad entry.
absl::StatusOr<std::vector<std::string>> ParseTargetList(std::string_view list);

// host:port -> "ip:port" for every address of host (IPv6 as "[ip]:port"),
// sorted and without duplicates, through getaddrinfo.
using Resolver = std::function<absl::StatusOr<std::vector<std::string>>(const std::string&)>;
absl::StatusOr<std::vector<std::string>> ResolveHostPort(const std::string& host_port);

struct VisionRouterOptions {
  std::vector<std::string> static_targets;  // used when dns_target is empty
  std::string dns_target;                   // host:port, resolved every dns_refresh
  absl::Duration dns_refresh = absl::Seconds(5);
  Resolver resolver = ResolveHostPort;      // replaceable in tests
  int max_attempts = 3;                     // Encode calls per image, over replicas
  absl::Duration retry_backoff = absl::Milliseconds(25);  // before the 2nd call; doubles
  ChannelOptions channel;
  HealthWatchOptions health;
  absl::Duration budget_ttl = absl::Seconds(30);  // ImageBudget's cache per replica
};

class VisionRouter {
 public:
  // Resolves once (a DNS failure here is not fatal: the gateway stays
  // NOT_SERVING until a resolution succeeds) and starts the health watches.
  // `on_health_change` runs on background threads, with no router lock held,
  // whenever a replica's health changes or replicas come or go.
  static absl::StatusOr<std::unique_ptr<VisionRouter>> Create(VisionRouterOptions options,
                                                              std::function<void()> on_health_change);
  ~VisionRouter();  // stops re-resolution and the watches
  VisionRouter(const VisionRouter&) = delete;
  VisionRouter& operator=(const VisionRouter&) = delete;

  struct EncodeOutcome {
    grpc::Status status;
    v1::EncodeResponse response;
    std::string replica;  // where the last call went ("" if none was made)
    int attempts = 0;     // calls made
  };

  // Encodes `request` on the SERVING replicas in rendezvous order of `key`
  // (the image's hex SHA-256), moving to the next one on UNAVAILABLE. The
  // calls carry `parent`'s deadline and cancellation (parent may be null),
  // are bounded by `deadline`, and send `request_id` as x-request-id.
  EncodeOutcome Encode(const grpc::ServerContextBase* parent, absl::Time deadline,
                       std::string_view key, const v1::EncodeRequest& request,
                       std::string_view request_id = "") const;

  // SERVING replicas in rendezvous order of `key` (what Encode tries, in order).
  std::vector<std::string> ServingOrder(std::string_view key) const;
  // Every known replica and its health, by name.
  std::vector<BackendState> Replicas() const;

  // The vision service's pixel budget (GetImageBudget) for the gateway's cost
  // estimate: each SERVING replica's answer, kept for `budget_ttl` (a
  // restarted replica may have new flags), asked again when stale, by calls
  // bounded by `deadline`. Where replicas differ, the smallest budget (the
  // estimate stays a lower bound). UNAVAILABLE when no replica answered.
  absl::StatusOr<v1::ImageBudget> ImageBudget(absl::Time deadline) const;

  // Re-resolves the DNS name now (also done periodically). No-op for a static list.
  void RefreshNow();

 private:
  struct Replica;
  VisionRouter(VisionRouterOptions options, std::function<void()> on_health_change);
  void SetReplicas(const std::vector<std::string>& targets);
  void ResolveLoop();
  std::vector<std::shared_ptr<Replica>> Order(std::string_view key) const;

  const VisionRouterOptions options_;
  const std::function<void()> on_health_change_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Replica>> replicas_ ABSL_GUARDED_BY(mu_);
  absl::Mutex resolve_mu_;  // serializes resolutions (loop and RefreshNow)
  std::string last_resolve_error_ ABSL_GUARDED_BY(resolve_mu_);
  absl::Mutex stop_mu_;
  absl::CondVar stop_cv_;
  bool stop_ ABSL_GUARDED_BY(stop_mu_) = false;
  std::thread resolver_;
};

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_ROUTER_H_
