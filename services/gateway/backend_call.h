// How the gateway calls its backends: channels, per-call contexts that carry
// the caller's deadline and cancellation, and the mapping of backend errors to
// what the gateway's client sees (the code keeps its meaning, never a bare
// UNKNOWN, and the message says which backend and which image failed).
#ifndef VLM_SERVICES_GATEWAY_BACKEND_CALL_H_
#define VLM_SERVICES_GATEWAY_BACKEND_CALL_H_

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <memory>
#include <string>
#include <string_view>

#include "absl/time/time.h"

namespace vlm::gateway {

struct ChannelOptions {
  // gRPC's reconnect backoff towards a backend that went away (gRPC's own
  // default grows to 120 s; a restarted backend should be found within about this).
  absl::Duration min_reconnect_backoff = absl::Milliseconds(100);
  absl::Duration max_reconnect_backoff = absl::Seconds(1);
  // HTTP/2 keepalive: a ping after `keepalive_time` without traffic, the
  // connection dropped if its ack takes longer than `keepalive_timeout`. A
  // backend that hangs (SIGSTOP, a stuck process, a dead node behind an open
  // TCP path) then turns unreachable: its health watch fails, routing skips
  // it, and its calls fail UNAVAILABLE instead of waiting for their deadline.
  // Zero disables. Servers built on common/server.h accept pings every >= 1 s.
  absl::Duration keepalive_time = absl::Seconds(20);
  absl::Duration keepalive_timeout = absl::Seconds(10);
  // Shared by every backend channel (common/tls.h MakeChannelCredentials);
  // null means plaintext. `tls_server_name`, if set, is the name the
  // backends' certificates carry (targets are pod IPs from DNS, not that name).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string tls_server_name;
};

// A channel to `target` ("host:port") with `options.credentials`, no message
// size limit (the backends' servers enforce theirs) and the reconnect backoff above.
std::shared_ptr<grpc::Channel> CreateBackendChannel(const std::string& target,
                                                    const ChannelOptions& options);

// A context for one backend call made on behalf of `parent` (may be null):
// the parent's deadline and cancellation propagate, `deadline` (may be
// infinite) bounds the call further, and `request_id` travels as x-request-id.
std::unique_ptr<grpc::ClientContext> BackendContext(const grpc::ServerContextBase* parent,
                                                    absl::Time deadline,
                                                    std::string_view request_id);

// grpc's deadline type <-> absl::Time (time_point::max() is InfiniteFuture()).
absl::Time FromGrpcDeadline(std::chrono::system_clock::time_point deadline);


// A vision error for image `image_number` (1-based, in request order), after
// `attempts` calls, the last one on `replica`:
//   INVALID_ARGUMENT "image 2: <message>",
//   UNAVAILABLE "image 2: vision service unavailable after 3 attempts: <message>", ...
grpc::Status MapVisionError(int image_number, const grpc::Status& status,
                            std::string_view replica, int attempts);

// A language error; `completion_chunks` says how far the stream had come and
// `target` ("host:port", may be empty) which language service was called:
//   UNAVAILABLE "language service unavailable (10.0.0.7:50051): <message>
//                (after 7 streamed chunks)", ...
grpc::Status MapLanguageError(const grpc::Status& status, int completion_chunks,
                              std::string_view target = "");

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_BACKEND_CALL_H_
