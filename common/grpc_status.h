// The one mapping between absl::Status (our errors) and grpc::Status (the wire).
// Codes map one to one; the message is kept verbatim, so write messages a client
// can act on ("image is 9000x9000 pixels; max_pixels is 16777216").
#ifndef VLM_COMMON_GRPC_STATUS_H_
#define VLM_COMMON_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace vlm {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// "INVALID_ARGUMENT" etc.: the canonical name, for logs, metric labels and CLIs.
const char* GrpcCodeName(grpc::StatusCode code);

}  // namespace vlm

#endif  // VLM_COMMON_GRPC_STATUS_H_
