#include "common/server.h"

#include <fcntl.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/server_interceptor.h>
#include <poll.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/grpc_status.h"
#include "common/log.h"

// Each service sets its own defaults before parsing (help shows them as
// "currently"), so the three started with defaults on one host do not collide.
ABSL_FLAG(std::string, grpc_address, "0.0.0.0:50051",
          "gRPC listen address host:port (port 0 picks a free port); default per service: "
          "gateway 0.0.0.0:50051, vision 0.0.0.0:50052, language 0.0.0.0:50053");
ABSL_FLAG(std::string, metrics_address, "0.0.0.0:9090",
          "HTTP address for /metrics, /healthz and /readyz (port 0 picks one; empty disables); "
          "default per service: gateway 0.0.0.0:9090, vision 0.0.0.0:9091, language 0.0.0.0:9092");
ABSL_FLAG(int, max_message_mb, 128, "largest gRPC message sent or received, in MiB");
ABSL_FLAG(double, drain_timeout_s, 25,
          "after SIGTERM, seconds that running RPCs get to finish before they are cancelled");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of the gRPC port; with --tls_key the port serves TLS only");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle; when set, clients must present a certificate it signed (mTLS)");
ABSL_FLAG(double, tls_refresh_s, 60,
          "seconds between re-reads of the TLS files (a replaced certificate is served "
          "without a restart)");

namespace vlm {
namespace {

// Time for health watchers to receive NOT_SERVING before their streams are cancelled.
constexpr absl::Duration kHealthNoticeGrace = absl::Milliseconds(100);
// How long Shutdown may overrun the drain deadline (a handler ignoring
// cancellation) before the process gives up and exits.
constexpr absl::Duration kShutdownOverrun = absl::Seconds(10);

// --- signals: a self-pipe, so the handler only calls write(2) -------------
int g_signal_pipe[2] = {-1, -1};

extern "C" void OnShutdownSignal(int signo) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(signo);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &byte, 1);
  errno = saved_errno;
}

absl::Status SetShutdownSignalAction(void (*handler)(int)) {
  struct sigaction action = {};
  action.sa_handler = handler;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int signo : {SIGTERM, SIGINT}) {
    if (::sigaction(signo, &action, nullptr) != 0) {
      return absl::InternalError(absl::StrCat("sigaction: ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

absl::Status InstallSignalHandlers() {
  static std::once_flag once;
  static absl::Status pipe_status;
  std::call_once(once, [] {
    if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
      pipe_status = absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
    }
  });
  if (!pipe_status.ok()) return pipe_status;
  return SetShutdownSignalAction(OnShutdownSignal);
}

// Reads whatever is in a non-blocking pipe; returns the last byte or -1.
int DrainPipe(int fd) {
  unsigned char buf[64];
  int last = -1;
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n > 0) {
      last = buf[n - 1];
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return last;
  }
}

// Waits up to `timeout` (may be infinite) for one of `fds` to be readable;
// returns its index or -1.
int PollReadable(const std::vector<int>& fds, absl::Duration timeout) {
  std::vector<pollfd> pfds;
  for (int fd : fds) pfds.push_back(pollfd{fd, POLLIN, 0});
  const int ms = timeout == absl::InfiniteDuration()
                     ? -1
                     : static_cast<int>(absl::ToInt64Milliseconds(timeout));
  int n = ::poll(pfds.data(), pfds.size(), ms);
  if (n <= 0) return -1;
  for (size_t i = 0; i < pfds.size(); ++i) {
    if (pfds[i].revents != 0) return static_cast<int>(i);
  }
  return -1;
}


// "host:port" as given, with the port replaced by the bound one.
std::string WithBoundPort(const std::string& address, int port) {
  absl::StatusOr<std::pair<std::string, int>> host_port = ParseHostPort(address);
  if (!host_port.ok()) return address;  // e.g. unix:/path
  const std::string& host = host_port->first;
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                             : absl::StrCat(host, ":", port);
}

}  // namespace

// Per-call accounting shared by the interceptors and the drain.
struct ServerCallStats {
  std::atomic<int> inflight{0};
  prometheus::Gauge& inflight_gauge = prometheus::BuildGauge()
                                          .Name("vlm_grpc_server_inflight_requests")
                                          .Help("RPCs being handled (health and reflection excluded).")
                                          .Register(MetricsRegistry())
                                          .Add({});
  prometheus::Family<prometheus::Counter>& handled =
      prometheus::BuildCounter()
          .Name("vlm_grpc_server_handled_total")
          .Help("RPCs completed, by service, method and status code.")
          .Register(MetricsRegistry());
  prometheus::Family<prometheus::Histogram>& latency = LatencyHistogramFamily(
      "vlm_grpc_server_handling_seconds",
      "Time from the start of an RPC to its status, by service, method and status code.");
};

namespace {

class CallInterceptor : public grpc::experimental::Interceptor {
 public:
  CallInterceptor(std::shared_ptr<ServerCallStats> stats, std::string service, std::string method)
      : stats_(std::move(stats)),
        service_(std::move(service)),
        method_(std::move(method)),
        start_(std::chrono::steady_clock::now()) {
    stats_->inflight.fetch_add(1);
    stats_->inflight_gauge.Increment();
  }
  ~CallInterceptor() override {
    stats_->inflight_gauge.Decrement();
    stats_->inflight.fetch_sub(1);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const std::string code = GrpcCodeName(methods->GetSendStatus().error_code());
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      const prometheus::Labels labels = {
          {"grpc_service", service_}, {"grpc_method", method_}, {"grpc_code", code}};
      stats_->handled.Add(labels).Increment();
      stats_->latency.Add(labels, DefaultLatencyBuckets()).Observe(seconds);
    }
    methods->Proceed();
  }

 private:
  std::shared_ptr<ServerCallStats> stats_;
  std::string service_;
  std::string method_;
  std::chrono::steady_clock::time_point start_;
};

class CallInterceptorFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CallInterceptorFactory(std::shared_ptr<ServerCallStats> stats)
      : stats_(std::move(stats)) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const std::string full = info->method() != nullptr ? info->method() : "";
    // Health watches and reflection streams are infrastructure, not work.
    if (absl::StartsWith(full, "/grpc.health.") || absl::StartsWith(full, "/grpc.reflection.")) {
      return nullptr;
    }
    // "/pkg.Service/Method"
    const size_t slash = full.rfind('/');
    std::string service = slash != std::string::npos && slash > 0 ? full.substr(1, slash - 1) : "";
    std::string method = slash != std::string::npos ? full.substr(slash + 1) : full;
    return new CallInterceptor(stats_, std::move(service), std::move(method));
  }

 private:
  std::shared_ptr<ServerCallStats> stats_;
};

}  // namespace

ServerOptions ServerOptions::FromFlags() {
  ServerOptions options;
  options.grpc_address = absl::GetFlag(FLAGS_grpc_address);
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  options.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  options.drain_timeout = absl::Seconds(absl::GetFlag(FLAGS_drain_timeout_s));
  options.tls.cert = absl::GetFlag(FLAGS_tls_cert);
  options.tls.key = absl::GetFlag(FLAGS_tls_key);
  options.tls.client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  options.tls.refresh = absl::Seconds(absl::GetFlag(FLAGS_tls_refresh_s));
  return options;
}

Server::Server(ServerOptions options)
    : options_(std::move(options)), stats_(std::make_shared<ServerCallStats>()) {}

Server::~Server() {
  if (server_ != nullptr && !stopped_) {
    readiness_.StartDraining("server is shutting down");
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
  }
  if (metrics_ != nullptr) metrics_->Stop();
  for (int fd : wake_pipe_) {
    if (fd >= 0) ::close(fd);
  }
}

void Server::AddService(grpc::Service* service, std::string_view health_name,
                        std::string_view reason) {
  services_.push_back(service);
  readiness_.SetNotServing(health_name, reason);
}

absl::Status Server::Start() {
  if (server_ != nullptr) return absl::FailedPreconditionError("server already started");
  if (options_.max_message_mb < 1 || options_.max_message_mb > 2047) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_mb is ", options_.max_message_mb, "; must be in [1, 2047]"));
  }
  if (options_.drain_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("drain_timeout must not be negative");
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(options_.tls);
  if (!credentials.ok()) return credentials.status();
  if (::pipe2(wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
  }
  if (options_.handle_signals) {
    if (absl::Status s = InstallSignalHandlers(); !s.ok()) return s;
  }

  if (!options_.metrics_address.empty()) {
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> metrics = MetricsHttpServer::Start(
        options_.metrics_address, [this] { return readiness_.Check(""); });
    if (!metrics.ok()) return metrics.status();
    metrics_ = *std::move(metrics);
  }

  static std::once_flag reflection_once;
  std::call_once(reflection_once, [] { grpc::reflection::InitProtoReflectionServerBuilderPlugin(); });
  grpc::EnableDefaultHealthCheckService(true);

  grpc::ServerBuilder builder;
  builder.AddListeningPort(options_.grpc_address, *credentials, &grpc_port_);
  const int max_bytes = options_.max_message_mb * 1024 * 1024;
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(max_bytes);
  // gRPC sets SO_REUSEPORT by default: two servers could share a fixed port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Clients (the gateway's backend channels) may send keepalive pings every
  // second, also on connections whose only call is an idle health watch; the
  // default (one per 5 minutes without data) would answer them with GOAWAY.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  for (grpc::Service* service : services_) builder.RegisterService(service);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(std::make_unique<CallInterceptorFactory>(stats_));
  builder.experimental().SetInterceptorCreators(std::move(creators));
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || grpc_port_ == 0) {
    server_.reset();
    if (metrics_ != nullptr) metrics_->Stop();
    metrics_.reset();
    return absl::UnavailableError(absl::StrCat("gRPC server cannot listen on ",
                                               options_.grpc_address,
                                               " (address in use or not local?)"));
  }
  readiness_.AttachHealthService(server_->GetHealthCheckService());

  grpc_bound_address_ = WithBoundPort(options_.grpc_address, grpc_port_);
  const std::string metrics_address = metrics_ ? metrics_->address() : "none";
  LogInfo("server", "listening",
          {{"grpc", grpc_bound_address_},
           {"metrics", metrics_address},
           {"max_message_mb", options_.max_message_mb},
           {"tls", DescribeTls(options_.tls)},
           {"drain_timeout_s", absl::ToDoubleSeconds(options_.drain_timeout)}});
  // The one stable line test harnesses and scripts look for.
  std::printf("vlm: listening grpc=%s metrics=%s\n", grpc_bound_address_.c_str(),
              metrics_address.c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

void Server::Shutdown(absl::Status why) {
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_requested_) return;
    shutdown_requested_ = true;
    shutdown_status_ = std::move(why);
  }
  if (wake_pipe_[1] >= 0) {
    const unsigned char byte = 0;
    [[maybe_unused]] ssize_t n = ::write(wake_pipe_[1], &byte, 1);
  }
}

int Server::inflight() const { return stats_->inflight.load(); }

absl::Status Server::Wait() {
  if (server_ == nullptr) return absl::FailedPreconditionError("server not started");
  if (stopped_) return absl::FailedPreconditionError("server already stopped");
  std::vector<int> fds = {wake_pipe_[0]};
  if (options_.handle_signals) fds.push_back(g_signal_pipe[0]);
  for (;;) {
    const int ready = PollReadable(fds, absl::InfiniteDuration());
    if (ready == 0) {
      DrainPipe(wake_pipe_[0]);
      absl::MutexLock lock(&mu_);
      LogInfo("server", "shutdown requested", {{"status", shutdown_status_.ToString()}});
      break;
    }
    if (ready == 1) {
      const int signo = DrainPipe(g_signal_pipe[0]);
      LogInfo("server", "signal received, draining",
              {{"signal", signo == SIGINT ? "SIGINT" : "SIGTERM"}, {"inflight", inflight()}});
      break;
    }
  }
  Drain();
  absl::MutexLock lock(&mu_);
  return shutdown_status_;
}

void Server::Drain() {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + options_.drain_timeout;
  const absl::Time notice_end = std::min(start + kHealthNoticeGrace, deadline);
  readiness_.StartDraining("server is draining");

  // Exits the process if a handler ignores cancellation for too long.
  absl::Notification stopped;
  std::thread watchdog([&stopped, limit = options_.drain_timeout + kShutdownOverrun] {
    if (!stopped.WaitForNotificationWithTimeout(limit)) {
      LogError("server", "shutdown overran the drain timeout; exiting",
               {{"limit_s", absl::ToDoubleSeconds(limit)}});
      std::_Exit(1);
    }
  });

  for (;;) {
    const absl::Time now = absl::Now();
    if (now >= deadline || (inflight() == 0 && now >= notice_end)) break;
    if (options_.handle_signals &&
        PollReadable({g_signal_pipe[0]}, std::min(absl::Milliseconds(10), deadline - now)) == 0) {
      DrainPipe(g_signal_pipe[0]);
      LogWarning("server", "second signal, ending the drain now", {{"inflight", inflight()}});
      break;
    }
    if (!options_.handle_signals) absl::SleepFor(absl::Milliseconds(10));
  }
  const int left = inflight();
  // Whatever is still open (health watches, calls past the deadline) is cancelled.
  server_->Shutdown(std::chrono::system_clock::now());
  server_->Wait();
  if (metrics_ != nullptr) metrics_->Stop();
  stopped_ = true;
  stopped.Notify();
  watchdog.join();
  // From here on a signal has its default effect (ends a slow exit at once).
  if (options_.handle_signals) SetShutdownSignalAction(SIG_DFL).IgnoreError();
  LogInfo("server", "stopped",
          {{"drain_s", absl::ToDoubleSeconds(absl::Now() - start)}, {"cancelled_inflight", left}});
}

}  // namespace vlm
