// Server bootstrap shared by every service: a gRPC server with health
// (grpc.health.v1) and reflection (v1alpha), the metrics HTTP server
// (/metrics, /healthz, /readyz), readiness, and a graceful drain on SIGTERM/SIGINT.
//
// A service's main():
//
//   int main(int argc, char** argv) {
//     vlm::ParseCommandLine(argc, argv, "vision-encoder: images to ViT features");
//     vlm::LogEffectiveConfiguration("vision");
//     const std::string name = vlm::v1::VisionEncoder::service_full_name();
//     vlm::Server server(vlm::ServerOptions::FromFlags());
//     VisionService service(&server.readiness());  // handlers call readiness CheckGrpc(name)
//     server.AddService(&service, name, "loading weights");
//     if (absl::Status s = server.Start(); !s.ok()) {  // prints "vlm: listening grpc=.. metrics=.."
//       vlm::LogError("vision", "cannot start", {{"error", s.ToString()}});
//       return 1;
//     }
//     std::thread loader([&] {
//       absl::Status loaded = service.Load();  // vlm::LoadPhaseTimer per phase
//       if (loaded.ok()) server.readiness().SetServing(name);
//       else server.Shutdown(loaded);          // Wait() returns this error
//     });
//     absl::Status done = server.Wait();       // SIGTERM/SIGINT -> drain -> returns
//     loader.join();
//     return done.ok() ? 0 : 1;
//   }
//
// and every handler starts with
//
//     if (grpc::Status s = readiness_->CheckGrpc(kServiceName); !s.ok()) return s;
//
// which answers UNAVAILABLE "vlm.v1.VisionEncoder is not serving: loading weights"
// while warming up and UNAVAILABLE "server is draining" after SIGTERM; other
// errors go through vlm::ToGrpcStatus (common/grpc_status.h).
//
// Drain: on SIGTERM/SIGINT (or Shutdown()), every service and "" go NOT_SERVING
// (health watchers see it, /readyz answers 503), RPCs already running get up to
// --drain_timeout_s to finish, then remaining calls (health watches, streams past
// the deadline) are cancelled and Wait() returns. A second signal ends the drain
// at once. Health and reflection calls do not hold the drain up.
//
// Every RPC except health and reflection is counted in
// vlm_grpc_server_handled_total{method,code}, timed in
// vlm_grpc_server_handling_seconds{method,code} and, while running, in
// vlm_grpc_server_inflight_requests.
//
// Flags (env VLM_<NAME> too): --grpc_address, --metrics_address,
// --max_message_mb, --drain_timeout_s, and TLS for the gRPC port (common/tls.h):
// --tls_cert + --tls_key serve TLS, --tls_client_ca also requires client
// certificates signed by that CA (mTLS), --tls_refresh_s is how often the files
// are re-read (rotation without a restart). The metrics HTTP port stays plain
// HTTP: it carries /metrics, /healthz and /readyz for scrapers and probes.
// Clients may send HTTP/2 keepalive pings every >= 1 s, with or without calls.
// Every service sets its own default addresses before ParseCommandLine, e.g.
// absl::SetFlag(&FLAGS_grpc_address, "0.0.0.0:50052"): gateway 50051 / 9090,
// vision 50052 / 9091, language 50053 / 9092 (gRPC / metrics), so the three
// started with their defaults on one host form a working system.
#ifndef VLM_COMMON_SERVER_H_
#define VLM_COMMON_SERVER_H_

#include <grpcpp/server.h>
#include <grpcpp/support/status.h>

#include <atomic>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "common/readiness.h"
#include "common/tls.h"

ABSL_DECLARE_FLAG(std::string, grpc_address);
ABSL_DECLARE_FLAG(std::string, metrics_address);
ABSL_DECLARE_FLAG(int, max_message_mb);
ABSL_DECLARE_FLAG(double, drain_timeout_s);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_client_ca);
ABSL_DECLARE_FLAG(double, tls_refresh_s);

namespace vlm {

struct ServerCallStats;  // per-RPC accounting (server.cc)

struct ServerOptions {
  std::string grpc_address = "0.0.0.0:50051";    // port 0 picks a free port
  std::string metrics_address = "0.0.0.0:9090";  // port 0 picks one; "" disables HTTP
  int max_message_mb = 128;                      // send and receive limit per message
  absl::Duration drain_timeout = absl::Seconds(25);
  bool handle_signals = true;  // SIGTERM/SIGINT handlers from Start() until the drain ends
  TlsServerFiles tls;          // not enabled(): plaintext gRPC

  static ServerOptions FromFlags();
};

class Server {
 public:
  explicit Server(ServerOptions options);
  ~Server();  // shuts down (without waiting for a drain) if still running
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  Readiness& readiness() { return readiness_; }

  // Before Start(). `service` is not owned and must outlive the Server.
  // `health_name` (the full proto service name) starts NOT_SERVING with `reason`.
  void AddService(grpc::Service* service, std::string_view health_name,
                  std::string_view reason = "starting");

  // Starts the metrics HTTP server and the gRPC server, installs the signal
  // handlers, logs and prints to stdout the line
  //   vlm: listening grpc=HOST:PORT metrics=HOST:PORT
  // (metrics=none when disabled). Errors: cannot bind, bad address, bad TLS
  // files (InvalidArgument naming the file).
  absl::Status Start();

  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }
  std::string grpc_address() const { return grpc_bound_address_; }
  std::string metrics_address() const { return metrics_ ? metrics_->address() : ""; }
  grpc::Server* grpc_server() { return server_.get(); }  // e.g. for InProcessChannel

  // Blocks until SIGTERM/SIGINT or Shutdown(), drains, stops both servers.
  // Returns the status given to Shutdown() (OK after a signal).
  absl::Status Wait();

  // Starts the drain from any thread (not from a signal handler). Idempotent.
  void Shutdown(absl::Status why = absl::OkStatus());

  // RPCs currently running, health and reflection excluded.
  int inflight() const;

 private:
  void Drain();

  ServerOptions options_;
  Readiness readiness_;
  std::vector<grpc::Service*> services_;
  std::shared_ptr<ServerCallStats> stats_;
  std::unique_ptr<MetricsHttpServer> metrics_;
  std::unique_ptr<grpc::Server> server_;
  int grpc_port_ = 0;
  std::string grpc_bound_address_;
  int wake_pipe_[2] = {-1, -1};  // Shutdown() wakes Wait()
  absl::Mutex mu_;
  absl::Status shutdown_status_ ABSL_GUARDED_BY(mu_);
  bool shutdown_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ = false;
};

}  // namespace vlm

#endif  // VLM_COMMON_SERVER_H_
