// Validation of a public ChatRequest before it costs anything: shape, sizes,
// counts and sampling ranges. A refusal is INVALID_ARGUMENT whose message
// names the field and the limit, e.g.
//   "image 2 is 25000000 bytes; max_image_bytes is 20971520"
//   "params.sampling.top_p is 1.5; must be in (0, 1]"
// Images are numbered 1, 2, ... in request order (as in every gateway error).
#ifndef VLM_SERVICES_GATEWAY_VALIDATION_H_
#define VLM_SERVICES_GATEWAY_VALIDATION_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "vlm/v1/gateway.pb.h"
#include "vlm/v1/vision.pb.h"

namespace vlm::gateway {

// The gateway's estimate of an image's cost from its header (width, height),
// before the image is encoded. Every estimate is a lower bound, so that only a
// request that surely fails is refused early:
//   - the pixel budget is the vision service's (GetImageBudget, fetched by the
//     router: its default for a request that sets none, a larger request
//     lowered to its max_pixels_limit), resized by the same smart_resize;
//   - the ViT time is patches * min_ms_per_patch. The default, 0.05 ms per
//     16x16 patch, is a floor for the Qwen3-VL-2B ViT (about 0.6 GFLOP per
//     patch before attention: 0.05 ms is 12 TFLOP/s, far above a CPU server;
//     2 cores measure 2-4.5 ms per patch), so only a deadline that cannot be
//     met is refused (DEADLINE_EXCEEDED naming the estimate). Images encode in
//     parallel: the slowest image bounds the request.
// Images whose header cannot be read, or that the model refuses (aspect ratio
// over 200), are left to the vision service, which names the problem.
struct ImageCostModel {
  int patch_size = 16;
  int merge_size = 2;
  int64_t min_pixels = 65536;           // the vision service's default min_pixels
  int64_t default_max_pixels = 524288;  // the vision service's default max_pixels
  int64_t max_pixels_limit = 786432;    // the vision service's limit on a request's max_pixels
  double min_ms_per_patch = 0.05;       // 0 disables the deadline check
  int64_t max_image_tokens = 32768;     // estimated image tokens of one request; 0 = no limit
};

// `model` with the vision service's budget and patch geometry (GetImageBudget).
// INVALID_ARGUMENT when the budget is not usable (sizes below 1, default above
// the limit): the caller then makes no estimate.
absl::Status ApplyImageBudget(const v1::ImageBudget& budget, ImageCostModel* model);

// An inline image's estimate; `number` is 1-based in request order.
struct ImageEstimate {
  int number = 0;
  int64_t width = 0, height = 0;  // from the header
  int64_t max_pixels = 0;         // the budget assumed
  int64_t resized_width = 0, resized_height = 0;
  int64_t patches = 0;
  int64_t tokens = 0;
  double min_ms = 0;
};

// Estimates for the request's inline images (images named by content_hash
// are skipped: their size is unknown here, and they are usually cached).
std::vector<ImageEstimate> EstimateImages(const v1::ChatRequest& request,
                                          const ImageCostModel& model);

// INVALID_ARGUMENT when the estimated image tokens exceed max_image_tokens,
// DEADLINE_EXCEEDED when the slowest image's minimum ViT time exceeds
// `time_left`; both messages name the estimate.
absl::Status CheckImageCost(const v1::ChatRequest& request, const ImageCostModel& model,
                            absl::Duration time_left);

// From the flags --image_min_ms_per_patch and --max_image_tokens (defined in
// validation.cc); the budget comes from the vision service (ApplyImageBudget).
ImageCostModel ImageCostModelFromFlags();

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
  ImageCostModel image_cost;
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
