#include "common/metrics.h"

#include <httplib.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/build_info.h"
#include "common/log.h"

namespace vlm {
namespace {

// The registry and the metrics every process has. Created once, never destroyed
// (metrics may be touched by threads still running during exit).
struct ProcessMetrics {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  prometheus::Gauge& resident = prometheus::BuildGauge()
                                    .Name("vlm_process_resident_memory_bytes")
                                    .Help("Resident set size of this process (VmRSS).")
                                    .Register(*registry)
                                    .Add({});
  prometheus::Gauge& peak_resident =
      prometheus::BuildGauge()
          .Name("vlm_process_peak_resident_memory_bytes")
          .Help("Peak resident set size of this process (VmHWM).")
          .Register(*registry)
          .Add({});
  prometheus::Gauge& start_time = prometheus::BuildGauge()
                                      .Name("vlm_process_start_time_seconds")
                                      .Help("Start time of this process since the Unix epoch.")
                                      .Register(*registry)
                                      .Add({});
  prometheus::Family<prometheus::Gauge>& load_seconds =
      prometheus::BuildGauge()
          .Name("vlm_model_load_seconds")
          .Help("Wall time of each model loading phase, in seconds.")
          .Register(*registry);

  ProcessMetrics() {
    const BuildInfo& info = GetBuildInfo();
    prometheus::BuildGauge()
        .Name("vlm_build_info")
        .Help("Build of this binary; the value is always 1.")
        .Register(*registry)
        .Add({{"version", info.version}, {"git_commit", info.git_commit}, {"compiler", info.compiler}})
        .Set(1);
    absl::StatusOr<double> start = ReadProcessStartTime();
    start_time.Set(start.ok() ? *start : absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  }

  void Refresh() {
    absl::StatusOr<ProcessMemory> memory = ReadProcessMemory();
    if (memory.ok()) {
      resident.Set(static_cast<double>(memory->resident_bytes));
      peak_resident.Set(static_cast<double>(memory->peak_resident_bytes));
    }
  }
};

ProcessMetrics& GetProcessMetrics() {
  static ProcessMetrics* metrics = new ProcessMetrics();
  return *metrics;
}

absl::StatusOr<std::string> ReadFile(const char* path) {
  std::ifstream in(path);
  if (!in) return absl::UnavailableError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// "VmRSS:\t  123456 kB" -> bytes.
bool ParseStatusKb(absl::string_view line, absl::string_view key, int64_t* bytes) {
  if (!absl::ConsumePrefix(&line, key)) return false;
  line = absl::StripAsciiWhitespace(line);
  if (!absl::ConsumeSuffix(&line, "kB")) return false;
  int64_t kb = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kb)) return false;
  *bytes = kb * 1024;
  return true;
}

}  // namespace

prometheus::Registry& MetricsRegistry() { return *GetProcessMetrics().registry; }
std::shared_ptr<prometheus::Registry> SharedMetricsRegistry() {
  return GetProcessMetrics().registry;
}

void RecordLoadPhase(std::string_view phase, double seconds) {
  GetProcessMetrics().load_seconds.Add({{"phase", std::string(phase)}}).Set(seconds);
  LogInfo("load", "phase done", {{"phase", phase}, {"seconds", seconds}});
}

LoadPhaseTimer::LoadPhaseTimer(std::string phase)
    : phase_(std::move(phase)), start_(std::chrono::steady_clock::now()) {}

LoadPhaseTimer::~LoadPhaseTimer() { Stop(); }

double LoadPhaseTimer::Stop() {
  if (seconds_ < 0) {
    seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    RecordLoadPhase(phase_, seconds_);
  }
  return seconds_;
}

prometheus::Histogram::BucketBoundaries DefaultLatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
          0.5,   1.0,    2.5,   5.0,  10.0,  25.0, 60.0, 120.0};
}

prometheus::Family<prometheus::Histogram>& LatencyHistogramFamily(const std::string& name,
                                                                  const std::string& help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(MetricsRegistry());
}

absl::StatusOr<ProcessMemory> ReadProcessMemory() {
  absl::StatusOr<std::string> status = ReadFile("/proc/self/status");
  if (!status.ok()) return status.status();
  ProcessMemory memory;
  bool have_rss = false, have_hwm = false;
  for (absl::string_view line : absl::StrSplit(*status, '\n')) {
    have_rss = have_rss || ParseStatusKb(line, "VmRSS:", &memory.resident_bytes);
    have_hwm = have_hwm || ParseStatusKb(line, "VmHWM:", &memory.peak_resident_bytes);
  }
  if (!have_rss || !have_hwm) {
    return absl::UnavailableError("VmRSS or VmHWM missing from /proc/self/status");
  }
  return memory;
}

absl::StatusOr<double> ReadProcessStartTime() {
  absl::StatusOr<std::string> stat = ReadFile("/proc/self/stat");
  if (!stat.ok()) return stat.status();
  // Fields after the command name (which may hold spaces), starting at field 3.
  const size_t close = stat->rfind(')');
  if (close == std::string::npos) return absl::UnavailableError("bad /proc/self/stat");
  std::vector<absl::string_view> fields =
      absl::StrSplit(absl::string_view(*stat).substr(close + 1), ' ', absl::SkipEmpty());
  constexpr size_t kStartTimeIndex = 22 - 3;  // field 22 (starttime), clock ticks since boot
  uint64_t ticks = 0;
  if (fields.size() <= kStartTimeIndex || !absl::SimpleAtoi(fields[kStartTimeIndex], &ticks)) {
    return absl::UnavailableError("no starttime in /proc/self/stat");
  }
  absl::StatusOr<std::string> proc_stat = ReadFile("/proc/stat");
  if (!proc_stat.ok()) return proc_stat.status();
  for (absl::string_view line : absl::StrSplit(*proc_stat, '\n')) {
    int64_t btime = 0;
    if (absl::ConsumePrefix(&line, "btime ") &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &btime)) {
      return static_cast<double>(btime) +
             static_cast<double>(ticks) / static_cast<double>(sysconf(_SC_CLK_TCK));
    }
  }
  return absl::UnavailableError("no btime in /proc/stat");
}

std::string RenderMetrics() {
  ProcessMetrics& metrics = GetProcessMetrics();
  metrics.Refresh();
  return prometheus::TextSerializer().Serialize(metrics.registry->Collect());
}

absl::StatusOr<std::pair<std::string, int>> ParseHostPort(std::string_view address) {
  const absl::string_view a(address.data(), address.size());
  std::string host;
  absl::string_view port_text;
  if (absl::StartsWith(a, "[")) {
    const size_t close = a.find("]:");
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("bad address \"", a, "\": want [host]:port"));
    }
    host = std::string(a.substr(1, close - 1));
    port_text = a.substr(close + 2);
  } else {
    const size_t colon = a.rfind(':');
    if (colon == absl::string_view::npos || a.substr(0, colon).find(':') != absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("bad address \"", a, "\": want host:port"));
    }
    host = std::string(a.substr(0, colon));
    port_text = a.substr(colon + 1);
  }
  if (host.empty()) host = "0.0.0.0";
  int port = -1;
  if (!absl::SimpleAtoi(port_text, &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("bad port in address \"", a, "\""));
  }
  return std::make_pair(host, port);
}

struct MetricsHttpServer::Impl {
  httplib::Server http;
  std::thread thread;
  ReadyCheck ready;
};

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl, std::string host, int port)
    : impl_(std::move(impl)), host_(std::move(host)), port_(port) {}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    std::string_view address, ReadyCheck ready) {
  absl::StatusOr<std::pair<std::string, int>> host_port = ParseHostPort(address);
  if (!host_port.ok()) return host_port.status();
  auto [host, port] = *host_port;

  auto impl = std::make_unique<Impl>();
  impl->ready = std::move(ready);
  httplib::Server& http = impl->http;
  // Scrapes are rare and cheap: two workers, not httplib's default of eight.
  http.new_task_queue = [] { return new httplib::ThreadPool(2); };
  // httplib's default sets SO_REUSEPORT, which would let two processes share a
  // fixed port silently; SO_REUSEADDR alone still allows a quick restart.
  http.set_socket_options([](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  http.Get("/metrics", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(RenderMetrics(), kMetricsContentType);
  });
  http.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", "text/plain; charset=utf-8");
  });
  Impl* raw = impl.get();
  http.Get("/readyz", [raw](const httplib::Request&, httplib::Response& res) {
    absl::Status status = raw->ready ? raw->ready() : absl::OkStatus();
    if (status.ok()) {
      res.set_content("ok\n", "text/plain; charset=utf-8");
    } else {
      res.status = 503;
      res.set_content(absl::StrCat(status.message(), "\n"), "text/plain; charset=utf-8");
    }
  });

  if (port == 0) {
    port = http.bind_to_any_port(host);
  } else if (!http.bind_to_port(host, port)) {
    port = -1;
  }
  if (port <= 0) {
    return absl::UnavailableError(absl::StrCat("metrics server cannot bind ", std::string(address),
                                               " (address in use or not local?)"));
  }
  impl->thread = std::thread([raw] { raw->http.listen_after_bind(); });
  // Stop() before the accept loop runs would be lost; wait for it to start.
  for (int i = 0; i < 5000 && !http.is_running(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(std::move(impl), host, port));
}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

void MetricsHttpServer::Stop() {
  if (impl_ == nullptr || !impl_->thread.joinable()) return;
  impl_->http.stop();
  impl_->thread.join();
}

std::string MetricsHttpServer::address() const {
  return host_.find(':') != std::string::npos ? absl::StrCat("[", host_, "]:", port_)
                                              : absl::StrCat(host_, ":", port_);
}

}  // namespace vlm
