// Prometheus metrics: one registry per process, served over HTTP by cpp-httplib
// (prometheus-cpp's civetweb Exposer cannot start in a LibTorch process).
//
//   auto& hits = prometheus::BuildCounter().Name("vlm_cache_hits_total")
//                    .Help("...").Register(vlm::MetricsRegistry()).Add({});
//   vlm::LoadPhaseTimer t("vision_weights");   // sets vlm_model_load_seconds{phase=...}
//
// Always present (refreshed at each scrape): vlm_process_resident_memory_bytes,
// vlm_process_peak_resident_memory_bytes, vlm_process_start_time_seconds,
// vlm_build_info{version,git_commit,compiler} = 1.
// Names carry the vlm_ prefix and Prometheus unit suffixes (_seconds, _bytes, _total).
#ifndef VLM_COMMON_METRICS_H_
#define VLM_COMMON_METRICS_H_

#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vlm {

// The process-wide registry (created on first use, never destroyed). Thread-safe.
prometheus::Registry& MetricsRegistry();
std::shared_ptr<prometheus::Registry> SharedMetricsRegistry();

// Sets vlm_model_load_seconds{phase="<phase>"} to `seconds`.
void RecordLoadPhase(std::string_view phase, double seconds);

// Measures a load phase on the monotonic clock and records it on Stop() or at
// destruction, whichever comes first.
class LoadPhaseTimer {
 public:
  explicit LoadPhaseTimer(std::string phase);
  ~LoadPhaseTimer();
  LoadPhaseTimer(const LoadPhaseTimer&) = delete;
  LoadPhaseTimer& operator=(const LoadPhaseTimer&) = delete;
  double Stop();  // records and returns the seconds; later calls return the same value

 private:
  std::string phase_;
  std::chrono::steady_clock::time_point start_;
  double seconds_ = -1;
};

// Latency buckets in seconds, 1 ms to 120 s (about x2 apart): fits RPCs from a
// cache hit to a long generation.
prometheus::Histogram::BucketBoundaries DefaultLatencyBuckets();
// A histogram family on MetricsRegistry(); `name` should end in _seconds. Add
// children with family.Add({{"label", "value"}}, DefaultLatencyBuckets()).
prometheus::Family<prometheus::Histogram>& LatencyHistogramFamily(const std::string& name,
                                                                  const std::string& help);

// Memory of this process from /proc/self/status (VmRSS, VmHWM).
struct ProcessMemory {
  int64_t resident_bytes = 0;
  int64_t peak_resident_bytes = 0;
};
absl::StatusOr<ProcessMemory> ReadProcessMemory();
// Seconds since the epoch when this process started (/proc/self/stat + btime).
absl::StatusOr<double> ReadProcessStartTime();

// Refreshes the process gauges, then renders MetricsRegistry() in the
// Prometheus text format 0.0.4.
std::string RenderMetrics();
inline constexpr char kMetricsContentType[] = "text/plain; version=0.0.4; charset=utf-8";

// "host:port", "[v6addr]:port" or ":port" (all interfaces) -> (host, port).
absl::StatusOr<std::pair<std::string, int>> ParseHostPort(std::string_view address);

// GET /metrics, GET /healthz (200 while the process runs), GET /readyz (200
// when `ready` returns OK, else 503 with the status message as body).
class MetricsHttpServer {
 public:
  using ReadyCheck = std::function<absl::Status()>;

  // Binds `address` (port 0 picks a free port) and serves on a background
  // thread. An empty `ready` means always ready.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(std::string_view address,
                                                                  ReadyCheck ready);
  ~MetricsHttpServer();  // Stop()
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  void Stop();  // idempotent; returns once the server thread has exited
  const std::string& host() const { return host_; }
  int port() const { return port_; }  // the bound port
  std::string address() const;        // host:port as bound

 private:
  struct Impl;
  MetricsHttpServer(std::unique_ptr<Impl> impl, std::string host, int port);

  std::unique_ptr<Impl> impl_;
  std::string host_;
  int port_;
};

}  // namespace vlm

#endif  // VLM_COMMON_METRICS_H_
