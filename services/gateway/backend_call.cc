#include "common/grpc_status.h"
#include "services/gateway/backend_call.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace vlm::gateway {

std::shared_ptr<grpc::Channel> CreateBackendChannel(const std::string& target,
                                                    const ChannelOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  const int min_ms = static_cast<int>(absl::ToInt64Milliseconds(options.min_reconnect_backoff));
  const int max_ms = static_cast<int>(absl::ToInt64Milliseconds(options.max_reconnect_backoff));
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, min_ms);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, min_ms);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, max_ms);
  // Each backend gets its own connection, not one shared through gRPC's
  // global subchannel pool (a replica's channel is torn down when DNS drops it).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (options.keepalive_time > absl::ZeroDuration()) {
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS,
                static_cast<int>(absl::ToInt64Milliseconds(options.keepalive_time)));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                static_cast<int>(absl::ToInt64Milliseconds(options.keepalive_timeout)));
    // Health watches are long calls that carry no data for hours: keep pinging.
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
  if (options.credentials == nullptr) {
    return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  }
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  return grpc::CreateCustomChannel(target, options.credentials, args);
}

absl::Time FromGrpcDeadline(std::chrono::system_clock::time_point deadline) {
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

std::unique_ptr<grpc::ClientContext> BackendContext(const grpc::ServerContextBase* parent,
                                                    absl::Time deadline,
                                                    std::string_view request_id) {
  std::unique_ptr<grpc::ClientContext> context =
      parent != nullptr ? grpc::ClientContext::FromServerContext(*parent)
                        : std::make_unique<grpc::ClientContext>();
  // With a parent the call ends at the earlier of both deadlines.
  if (deadline != absl::InfiniteFuture()) context->set_deadline(absl::ToChronoTime(deadline));
  if (!request_id.empty()) context->AddMetadata("x-request-id", std::string(request_id));
  return context;
}

grpc::Status MapVisionError(int image_number, const grpc::Status& status,
                            std::string_view replica, int attempts) {
  if (status.ok()) return status;
  const std::string image = absl::StrCat("image ", image_number);
  const std::string& message = status.error_message();
  switch (status.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE:
      // The caller's own mistake: keep the vision service's words.
      return grpc::Status(status.error_code(), absl::StrCat(image, ": ", message));
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return grpc::Status(status.error_code(),
                          absl::StrCat(image, ": vision service is at capacity: ", message));
    case grpc::StatusCode::UNAVAILABLE:
      return grpc::Status(
          status.error_code(),
          absl::StrCat(image, ": vision service unavailable after ", attempts,
                       attempts == 1 ? " attempt" : " attempts",
                       replica.empty() ? "" : absl::StrCat(" (last replica ", std::string(replica), ")"), ": ",
                       message));
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return grpc::Status(status.error_code(),
                          absl::StrCat(image, ": deadline exceeded while encoding: ", message));
    case grpc::StatusCode::CANCELLED:
      return grpc::Status(status.error_code(),
                          absl::StrCat(image, ": cancelled while encoding: ", message));
    default:
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          absl::StrCat(image, ": vision service failed (",
                                       GrpcCodeName(status.error_code()), "): ", message));
  }
}

grpc::Status MapLanguageError(const grpc::Status& status, int completion_chunks,
                              std::string_view target) {
  if (status.ok()) return status;
  const std::string& message = status.error_message();
  const std::string progress =
      completion_chunks > 0 ? absl::StrCat(" (after ", completion_chunks, " streamed chunks)") : "";
  switch (status.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE:
      return grpc::Status(status.error_code(), absl::StrCat("language service: ", message));
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      if (absl::StrContains(message, "larger than max")) {
        // gRPC's message size limit, not load: the image features did not fit.
        return grpc::Status(status.error_code(),
                            absl::StrCat("the request's image features are too large for the "
                                         "language service (raise its --max_message_mb, or send "
                                         "fewer or smaller images): ",
                                         message));
      }
      return grpc::Status(status.error_code(),
                          absl::StrCat("language service is at capacity: ", message));
    case grpc::StatusCode::UNAVAILABLE:
      return grpc::Status(
          status.error_code(),
          absl::StrCat("language service unavailable",
                       target.empty() ? "" : absl::StrCat(" (", std::string(target), ")"), ": ",
                       message, progress));
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return grpc::Status(status.error_code(),
                          absl::StrCat("deadline exceeded while generating: ", message, progress));
    case grpc::StatusCode::CANCELLED:
      return grpc::Status(status.error_code(),
                          absl::StrCat("cancelled while generating: ", message, progress));
    default:
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          absl::StrCat("language service failed (",
                                       GrpcCodeName(status.error_code()), "): ", message,
                                       progress));
  }
}

}  // namespace vlm::gateway
