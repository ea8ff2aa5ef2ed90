// The one table from the gateway's status codes (gRPC / absl, the same
// numbers) to HTTP statuses and OpenAI error types, so both front ends report
// a failure the same way:
//
//   INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE  400 invalid_request_error
//   UNAUTHENTICATED                                      401 authentication_error
//   PERMISSION_DENIED                                    403 permission_error
//   NOT_FOUND                                            404 not_found_error
//   RESOURCE_EXHAUSTED                                   429 rate_limit_error (+ Retry-After)
//   CANCELLED                                            499 (client closed the request)
//   UNIMPLEMENTED                                        501 server_error
//   UNAVAILABLE                                          503 service_unavailable (+ Retry-After)
//   DEADLINE_EXCEEDED                                    504 timeout
//   anything else                                        500 server_error
//
// A body too large for the HTTP server is 413 (request_too_large) before any
// status exists.
#ifndef VLM_SERVICES_GATEWAY_HTTP_STATUS_H_
#define VLM_SERVICES_GATEWAY_HTTP_STATUS_H_

#include <grpcpp/support/status.h>

namespace vlm::gateway {

int HttpStatusForCode(grpc::StatusCode code);
// The OpenAI error object's "type" for `code`.
const char* OpenAiErrorType(grpc::StatusCode code);
// Whether the response should carry Retry-After (the refusal is transient).
bool ShouldRetryAfter(grpc::StatusCode code);

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_HTTP_STATUS_H_
