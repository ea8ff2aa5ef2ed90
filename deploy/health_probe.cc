// vlm-health-probe: asks a server's grpc.health.v1 Check for one service name
// and exits 0 when it is SERVING. For container health checks without a shell
// (Docker HEALTHCHECK, compose) where Kubernetes' native gRPC probe is absent;
// grpc_health_probe is not packaged in Debian.
//
//   vlm-health-probe --addr 127.0.0.1:50051 --service vlm.v1.Language
//
// Against a TLS port give the CA (and, when the server requires client
// certificates, a client certificate and key): inside a pod, the pod's own
// mounted certificate serves as both
//
//   vlm-health-probe --addr 127.0.0.1:50051 --service vlm.v1.Language
//     --tls_ca /tls/ca.crt --tls_cert /tls/tls.crt --tls_key /tls/tls.key
//     --tls_server_name vlm-language
//
// Exit codes: 0 SERVING, 1 not SERVING (or unknown service), 2 unreachable or
// timed out, 3 bad usage. Prints one line saying which.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "common/tls.h"
#include "grpc/health/v1/health.grpc.pb.h"

// Deliberately not read from VLM_* variables: inside a service's container those
// describe the service (e.g. VLM_GRPC_ADDRESS=0.0.0.0:50051), not the probe.
ABSL_FLAG(std::string, addr, "127.0.0.1:50051", "server address host:port");
ABSL_FLAG(std::string, service, "", "health service name; empty asks about the whole server");
ABSL_FLAG(int, timeout_ms, 2000, "deadline of the Check call, milliseconds");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle of the server's certificate; any --tls_* flag "
          "makes the connection TLS");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (servers that require mTLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "name the server's certificate must carry (default: the host of --addr)");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("exits 0 when a gRPC server reports SERVING for --service");
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    std::fprintf(stderr, "vlm-health-probe: unexpected argument %s\n", positional[1]);
    return 3;
  }
  const std::string addr = absl::GetFlag(FLAGS_addr);
  const std::string service = absl::GetFlag(FLAGS_service);

  vlm::TlsChannelFiles tls;
  tls.ca = absl::GetFlag(FLAGS_tls_ca);
  tls.cert = absl::GetFlag(FLAGS_tls_cert);
  tls.key = absl::GetFlag(FLAGS_tls_key);
  tls.server_name = absl::GetFlag(FLAGS_tls_server_name);
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      vlm::MakeChannelCredentials(tls);
  if (!credentials.ok()) {
    std::fprintf(stderr, "vlm-health-probe: %s\n",
                 std::string(credentials.status().message()).c_str());
    return 3;
  }
  grpc::ChannelArguments args;
  vlm::ApplyTlsChannelArgs(tls, &args);
  auto channel = grpc::CreateCustomChannel(addr, *credentials, args);
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms)));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  const char* shown = service.empty() ? "\"\"" : service.c_str();
  if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
    std::printf("%s %s: unknown service\n", addr.c_str(), shown);
    return 1;
  }
  if (!status.ok()) {
    std::printf("%s %s: %d %s\n", addr.c_str(), shown, static_cast<int>(status.error_code()),
                status.error_message().c_str());
    return 2;
  }
  const std::string state =
      grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
  std::printf("%s %s: %s\n", addr.c_str(), shown, state.c_str());
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}
