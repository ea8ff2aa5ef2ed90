// Validation of a public ChatRequest before it costs anything: shape, sizes,
// counts and sampling ranges. A refusal is INVALID_ARGUMENT whose message
// names the field and the limit, e.g.
//   "image 2 is 25000000 bytes; max_image_bytes is 20971520"
//   "params.sampling.top_p is 1.5; must be in (0, 1]"
// Images are numbered 1, 2, ... in request order (as in every gateway error).
#ifndef VLM_SERVICES_GATEWAY_VALIDATION_H_
#define VLM_SERVICES_GATEWAY_VALIDATION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "vlm/v1/gateway.pb.h"

namespace vlm::gateway {

// Operator limits (flags of vlm-gateway with the same names).
struct ValidationLimits {
  int max_messages = 256;
  int max_images_per_request = 8;
  int64_t max_image_bytes = 20 << 20;
  int64_t max_text_bytes = 256 << 10;  // all text parts of all messages together
  int max_tokens_limit = 8192;         // largest params.max_tokens accepted
  int max_stop_strings = 16;
  int max_stop_string_bytes = 256;
  int max_request_id_bytes = 128;
};

// Conversation shape (as the chat template needs it): roles system/user/
// assistant, a system message only first, images only in user messages, not
// ending with an assistant message.
// Fixed ranges (the wire contract's, common.proto):
//   temperature >= 0, top_k >= 0, top_p in (0, 1], min_p in [0, 1),
//   repetition_penalty > 0, presence/frequency_penalty in [-2, 2],
//   top_logprobs in [0, 20]; non-finite numbers are refused.
absl::Status ValidateChatRequest(const v1::ChatRequest& request, const ValidationLimits& limits);

// True for 64 hex digits (either case).
bool IsSha256Hex(std::string_view text);

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_VALIDATION_H_
