#include "services/gateway/http_status.h"

namespace vlm::gateway {

int HttpStatusForCode(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return 200;
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE: return 400;
    case grpc::StatusCode::UNAUTHENTICATED: return 401;
    case grpc::StatusCode::PERMISSION_DENIED: return 403;
    case grpc::StatusCode::NOT_FOUND: return 404;
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return 429;
    case grpc::StatusCode::CANCELLED: return 499;
    case grpc::StatusCode::UNIMPLEMENTED: return 501;
    case grpc::StatusCode::UNAVAILABLE: return 503;
    case grpc::StatusCode::DEADLINE_EXCEEDED: return 504;
    default: return 500;
  }
}

const char* OpenAiErrorType(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE: return "invalid_request_error";
    case grpc::StatusCode::UNAUTHENTICATED: return "authentication_error";
    case grpc::StatusCode::PERMISSION_DENIED: return "permission_error";
    case grpc::StatusCode::NOT_FOUND: return "not_found_error";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "rate_limit_error";
    case grpc::StatusCode::CANCELLED: return "cancelled";
    case grpc::StatusCode::UNAVAILABLE: return "service_unavailable";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "timeout";
    default: return "server_error";
  }
}

bool ShouldRetryAfter(grpc::StatusCode code) {
  return code == grpc::StatusCode::RESOURCE_EXHAUSTED || code == grpc::StatusCode::UNAVAILABLE;
}

}  // namespace vlm::gateway
