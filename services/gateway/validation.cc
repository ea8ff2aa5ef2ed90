#include "services/gateway/validation.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "services/gateway/image_size.h"
#include "services/vision/preprocess.h"

ABSL_FLAG(double, image_min_ms_per_patch, 0.05,
          "floor of the ViT time per 16x16 patch, in ms: a request whose deadline is shorter "
          "than its slowest image's patches times this is refused at once (0 disables)");
ABSL_FLAG(int64_t, max_image_tokens, 32768,
          "largest estimated image tokens of one request (0 = no limit)");

namespace vlm::gateway {
namespace {

absl::Status Invalid(std::string message) { return absl::InvalidArgumentError(std::move(message)); }

// "0.5" rather than "0.500000".
std::string Num(double value) { return absl::StrCat(value); }

absl::Status CheckFinite(const char* field, double value) {
  if (!std::isfinite(value)) return Invalid(absl::StrCat(field, " is not a finite number"));
  return absl::OkStatus();
}

absl::Status ValidateSampling(const v1::SamplingParams& s) {
  if (s.has_temperature()) {
    if (absl::Status st = CheckFinite("params.sampling.temperature", s.temperature()); !st.ok()) {
      return st;
    }
    if (s.temperature() < 0) {
      return Invalid(absl::StrCat("params.sampling.temperature is ", Num(s.temperature()),
                                  "; must be >= 0 (0 means greedy)"));
    }
  }
  if (s.has_top_k() && s.top_k() < 0) {
    return Invalid(absl::StrCat("params.sampling.top_k is ", s.top_k(),
                                "; must be >= 0 (0 disables)"));
  }
  if (s.has_top_p()) {
    if (absl::Status st = CheckFinite("params.sampling.top_p", s.top_p()); !st.ok()) return st;
    if (!(s.top_p() > 0 && s.top_p() <= 1)) {
      return Invalid(absl::StrCat("params.sampling.top_p is ", Num(s.top_p()),
                                  "; must be in (0, 1]"));
    }
  }
  if (s.has_min_p()) {
    if (absl::Status st = CheckFinite("params.sampling.min_p", s.min_p()); !st.ok()) return st;
    if (!(s.min_p() >= 0 && s.min_p() < 1)) {
      return Invalid(absl::StrCat("params.sampling.min_p is ", Num(s.min_p()),
                                  "; must be in [0, 1)"));
    }
  }
  if (s.has_repetition_penalty()) {
    if (absl::Status st = CheckFinite("params.sampling.repetition_penalty",
                                      s.repetition_penalty());
        !st.ok()) {
      return st;
    }
    if (!(s.repetition_penalty() > 0)) {
      return Invalid(absl::StrCat("params.sampling.repetition_penalty is ",
                                  Num(s.repetition_penalty()), "; must be > 0 (1 disables)"));
    }
  }
  for (const auto& [name, has, value] :
       {std::tuple{"params.sampling.presence_penalty", s.has_presence_penalty(),
                   s.presence_penalty()},
        std::tuple{"params.sampling.frequency_penalty", s.has_frequency_penalty(),
                   s.frequency_penalty()}}) {
    if (!has) continue;
    if (absl::Status st = CheckFinite(name, value); !st.ok()) return st;
    if (!(value >= -2 && value <= 2)) {
      return Invalid(absl::StrCat(name, " is ", Num(value), "; must be in [-2, 2]"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateImageOptions(const std::string& where, const v1::ImageOptions& options) {
  if (options.min_pixels() < 0) {
    return Invalid(absl::StrCat(where, ".min_pixels is ", options.min_pixels(), "; must be >= 0"));
  }
  if (options.max_pixels() < 0) {
    return Invalid(absl::StrCat(where, ".max_pixels is ", options.max_pixels(), "; must be >= 0"));
  }
  if (options.min_pixels() > 0 && options.max_pixels() > 0 &&
      options.min_pixels() > options.max_pixels()) {
    return Invalid(absl::StrCat(where, ".min_pixels (", options.min_pixels(),
                                ") is larger than max_pixels (", options.max_pixels(), ")"));
  }
  return absl::OkStatus();
}

// The image part `c` of `message` (`where`), the request's `images`-th image.
absl::Status ValidateImagePart(const v1::ChatRequest& request, const v1::ChatMessage& message,
                               const std::string& where, int c, int images,
                               const ValidationLimits& limits) {
  if (images > limits.max_images_per_request) {
    int total = 0;
    for (const auto& msg : request.messages()) {
      for (const auto& p : msg.content()) total += p.has_image() ? 1 : 0;
    }
    return Invalid(absl::StrCat("request has ", total, " images; max_images_per_request is ",
                                limits.max_images_per_request));
  }
  const v1::ImagePart& image = message.content(c).image();
  const std::string name = absl::StrCat("image ", images);
  if (message.role() != "user") {
    // The chat template ignores them there; refuse before paying for the encode.
    return Invalid(absl::StrCat(name, " is in a ", message.role(), " message (", where,
                                "); images go in user messages"));
  }
  switch (image.source_case()) {
    case v1::ImagePart::kData:
      if (image.data().empty()) return Invalid(absl::StrCat(name, " has empty data"));
      if (static_cast<int64_t>(image.data().size()) > limits.max_image_bytes) {
        return Invalid(absl::StrCat(name, " is ", image.data().size(),
                                    " bytes; max_image_bytes is ", limits.max_image_bytes));
      }
      break;
    case v1::ImagePart::kContentHash:
      if (!IsSha256Hex(image.content_hash())) {
        return Invalid(absl::StrCat(name, " content_hash \"", image.content_hash().substr(0, 80),
                                    "\" is not a hex SHA-256 (64 hex digits)"));
      }
      break;
    default:
      return Invalid(absl::StrCat(name, " (", where, ".content[", c,
                                  "]) has neither data nor content_hash"));
  }
  return ValidateImageOptions(name + " options", image.options());
}

}  // namespace

bool IsSha256Hex(std::string_view text) {
  if (text.size() != 64) return false;
  for (char c : text) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

absl::Status ValidateChatRequest(const v1::ChatRequest& request, const ValidationLimits& limits) {
  if (request.messages().empty()) return Invalid("messages is empty; send at least one message");
  if (request.messages_size() > limits.max_messages) {
    return Invalid(absl::StrCat("request has ", request.messages_size(), " messages; max_messages is ",
                                limits.max_messages));
  }
  if (static_cast<int>(request.request_id().size()) > limits.max_request_id_bytes) {
    return Invalid(absl::StrCat("request_id is ", request.request_id().size(),
                                " bytes; max_request_id_bytes is ", limits.max_request_id_bytes));
  }
  if (absl::Status s = ValidateImageOptions("image_options", request.image_options()); !s.ok()) {
    return s;
  }

  int images = 0;
  int64_t text_bytes = 0;
  for (int m = 0; m < request.messages_size(); ++m) {
    const v1::ChatMessage& message = request.messages(m);
    const std::string where = absl::StrCat("messages[", m, "]");
    if (message.role() != "system" && message.role() != "user" && message.role() != "assistant" &&
        message.role() != "tool") {
      return Invalid(absl::StrCat(where, ".role is \"", message.role(),
                                  "\"; must be \"system\", \"user\", \"assistant\" or \"tool\""));
    }
    for (const v1::ToolCall& call : message.tool_calls()) {
      text_bytes += static_cast<int64_t>(call.name().size() + call.arguments().size());
    }
    if (message.role() == "system" && m != 0) {
      return Invalid(absl::StrCat(where, " is a system message; only the first message may be one"));
    }
    for (int c = 0; c < message.content_size(); ++c) {
      const v1::ContentPart& part = message.content(c);
      switch (part.part_case()) {
        case v1::ContentPart::kText:
          text_bytes += static_cast<int64_t>(part.text().size());
          break;
        case v1::ContentPart::kImage: {
          ++images;
          if (absl::Status s = ValidateImagePart(request, message, where, c, images, limits);
              !s.ok()) {
            return s;
          }
          break;
        }
        default:
          return Invalid(absl::StrCat(where, ".content[", c, "] has neither text nor image"));
      }
    }
  }

  if (request.messages(request.messages_size() - 1).role() == "assistant") {
    return Invalid("the last message is an assistant message; end with a user message");
  }

  const v1::GenerationParams& params = request.params();
  for (const std::string& stop : params.stop()) text_bytes += static_cast<int64_t>(stop.size());
  // Schemas and tools are compiled by the language service; their size counts
  // as text.
  text_bytes += static_cast<int64_t>(params.json_schema().size() + params.regex().size());
  for (const v1::Tool& tool : request.tools()) {
    text_bytes += static_cast<int64_t>(tool.name().size() + tool.description().size() +
                                       tool.parameters().size());
  }
  if (text_bytes > limits.max_text_bytes) {
    return Invalid(absl::StrCat("text is ", text_bytes, " bytes; max_text_bytes is ",
                                limits.max_text_bytes));
  }
  if (params.has_max_tokens() &&
      (params.max_tokens() < 1 || params.max_tokens() > limits.max_tokens_limit)) {
    return Invalid(absl::StrCat("params.max_tokens is ", params.max_tokens(),
                                "; must be in [1, max_tokens_limit=", limits.max_tokens_limit, "]"));
  }
  if (params.stop_size() > limits.max_stop_strings) {
    return Invalid(absl::StrCat("params.stop has ", params.stop_size(),
                                " strings; max_stop_strings is ", limits.max_stop_strings));
  }
  for (int i = 0; i < params.stop_size(); ++i) {
    if (params.stop(i).empty()) return Invalid(absl::StrCat("params.stop[", i, "] is empty"));
    if (static_cast<int>(params.stop(i).size()) > limits.max_stop_string_bytes) {
      return Invalid(absl::StrCat("params.stop[", i, "] is ", params.stop(i).size(),
                                  " bytes; max_stop_string_bytes is ",
                                  limits.max_stop_string_bytes));
    }
  }
  if (params.top_logprobs() < 0 || params.top_logprobs() > 20) {
    return Invalid(absl::StrCat("params.top_logprobs is ", params.top_logprobs(),
                                "; must be in [0, 20]"));
  }
  return ValidateSampling(params.sampling());
}

std::vector<ImageEstimate> EstimateImages(const v1::ChatRequest& request,
                                          const ImageCostModel& model) {
  std::vector<ImageEstimate> out;
  vision::PreprocessOptions defaults;
  defaults.patch_size = model.patch_size;
  defaults.merge_size = model.merge_size;
  defaults.max_pixels = std::max<int64_t>(model.default_max_pixels, 1);
  defaults.min_pixels = std::min(model.min_pixels, defaults.max_pixels);
  const int64_t limit = std::max(model.max_pixels_limit, defaults.max_pixels);
  const int64_t factor = int64_t{model.patch_size} * model.merge_size;
  int number = 0;
  for (const v1::ChatMessage& message : request.messages()) {
    for (const v1::ContentPart& part : message.content()) {
      if (!part.has_image()) continue;
      ++number;
      const v1::ImagePart& image = part.image();
      if (image.source_case() != v1::ImagePart::kData) continue;
      absl::StatusOr<ImageDimensions> dims = ReadImageDimensions(image.data());
      if (!dims.ok()) continue;
      int64_t min_pixels = request.image_options().min_pixels();
      int64_t max_pixels = request.image_options().max_pixels();
      if (image.options().min_pixels() != 0) min_pixels = image.options().min_pixels();
      if (image.options().max_pixels() != 0) max_pixels = image.options().max_pixels();
      // As the vision service resolves it, except that no value is refused here
      // (min_pixels_limit 1): that is the vision service's to name.
      absl::StatusOr<vision::PreprocessOptions> budget =
          vision::ResolvePixelBudget(defaults, 1, limit, min_pixels, max_pixels);
      if (!budget.ok()) continue;
      absl::StatusOr<vision::ImageSize> size = vision::SmartResize(
          dims->height, dims->width, factor, budget->min_pixels, budget->max_pixels);
      if (!size.ok()) continue;
      ImageEstimate e;
      e.number = number;
      e.width = dims->width;
      e.height = dims->height;
      e.max_pixels = budget->max_pixels;
      e.resized_width = size->width;
      e.resized_height = size->height;
      e.patches = (size->height / model.patch_size) * (size->width / model.patch_size);
      e.tokens = e.patches / (int64_t{model.merge_size} * model.merge_size);
      e.min_ms = static_cast<double>(e.patches) * model.min_ms_per_patch;
      out.push_back(e);
    }
  }
  return out;
}

absl::Status CheckImageCost(const v1::ChatRequest& request, const ImageCostModel& model,
                            absl::Duration time_left) {
  const std::vector<ImageEstimate> estimates = EstimateImages(request, model);
  int64_t tokens = 0;
  const ImageEstimate* slowest = nullptr;
  for (const ImageEstimate& e : estimates) {
    tokens += e.tokens;
    if (slowest == nullptr || e.min_ms > slowest->min_ms) slowest = &e;
  }
  if (model.max_image_tokens > 0 && tokens > model.max_image_tokens) {
    return Invalid(absl::StrCat("the request's images take at least ", tokens,
                                " tokens (estimated from their sizes); max_image_tokens is ",
                                model.max_image_tokens,
                                ": send fewer or smaller images, or detail \"low\""));
  }
  if (slowest != nullptr && model.min_ms_per_patch > 0 &&
      absl::Milliseconds(slowest->min_ms) > time_left) {
    return absl::DeadlineExceededError(absl::StrFormat(
        "image %d (%dx%d, resized to %dx%d: %d patches) needs at least %.0f ms in the vision "
        "encoder (%.3g ms per patch); the deadline leaves %.0f ms",
        slowest->number, slowest->width, slowest->height, slowest->resized_width,
        slowest->resized_height, slowest->patches, slowest->min_ms, model.min_ms_per_patch,
        std::max(0.0, absl::ToDoubleMilliseconds(time_left))));
  }
  return absl::OkStatus();
}

absl::Status ApplyImageBudget(const v1::ImageBudget& budget, ImageCostModel* model) {
  if (budget.patch_size() < 1 || budget.merge_size() < 1 || budget.default_min_pixels() < 1 ||
      budget.default_max_pixels() < budget.default_min_pixels() ||
      budget.max_pixels_limit() < budget.default_max_pixels()) {
    return Invalid(absl::StrCat("unusable image budget from the vision service: ",
                                budget.ShortDebugString()));
  }
  model->patch_size = budget.patch_size();
  model->merge_size = budget.merge_size();
  model->min_pixels = budget.default_min_pixels();
  model->default_max_pixels = budget.default_max_pixels();
  model->max_pixels_limit = budget.max_pixels_limit();
  return absl::OkStatus();
}

ImageCostModel ImageCostModelFromFlags() {
  ImageCostModel model;
  model.min_ms_per_patch = absl::GetFlag(FLAGS_image_min_ms_per_patch);
  model.max_image_tokens = absl::GetFlag(FLAGS_max_image_tokens);
  return model;
}

}  // namespace vlm::gateway
