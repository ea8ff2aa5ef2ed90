// libFuzzer target: the gateway's request validation, from a serialized
// vlm.v1.ChatRequest (the bytes a client sends).
//
// Every parsable message is validated under the default limits and under
// small ones. Properties of an accepted request:
//   - it is within the limits (messages, images, image bytes, text bytes,
//     stop strings, max_tokens, request_id);
//   - the image cost estimate (image headers) answers OK, INVALID_ARGUMENT
//     or DEADLINE_EXCEEDED;
//   - its conversation renders with the chat template (the header promises
//     the shape "as the chat template needs it"), unless its text contains a
//     vision control token, which only the language service refuses.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "services/gateway/validation.h"
#include "services/language/text/chat_template.h"
#include "google/protobuf/stubs/logging.h"
#include "tests/fuzz/fuzz_check.h"
#include "vlm/v1/gateway.pb.h"

namespace {

using vlm::gateway::ValidationLimits;

void CheckWithinLimits(const vlm::v1::ChatRequest& r, const ValidationLimits& limits) {
  FUZZ_CHECK(r.messages_size() >= 1 && r.messages_size() <= limits.max_messages,
             "%d messages accepted", r.messages_size());
  FUZZ_CHECK(static_cast<int>(r.request_id().size()) <= limits.max_request_id_bytes,
             "request_id of %zu bytes accepted", r.request_id().size());
  int images = 0;
  int64_t text_bytes = 0;
  for (const auto& m : r.messages()) {
    for (const auto& p : m.content()) {
      if (p.has_image()) {
        ++images;
        const auto& image = p.image();
        FUZZ_CHECK(image.has_data() ? !image.data().empty() &&
                                          static_cast<int64_t>(image.data().size()) <=
                                              limits.max_image_bytes
                                    : vlm::gateway::IsSha256Hex(image.content_hash()),
                   "image %d accepted with %zu bytes / hash \"%s\"", images, image.data().size(),
                   image.content_hash().substr(0, 80).c_str());
      } else {
        FUZZ_CHECK(p.has_text(), "a part with neither text nor image accepted");
        text_bytes += static_cast<int64_t>(p.text().size());
      }
    }
  }
  for (const auto& s : r.params().stop()) text_bytes += static_cast<int64_t>(s.size());
  FUZZ_CHECK(images <= limits.max_images_per_request, "%d images accepted", images);
  FUZZ_CHECK(text_bytes <= limits.max_text_bytes, "%lld text bytes accepted",
             static_cast<long long>(text_bytes));
  FUZZ_CHECK(r.params().stop_size() <= limits.max_stop_strings, "%d stop strings accepted",
             r.params().stop_size());
  FUZZ_CHECK(!r.params().has_max_tokens() ||
                 (r.params().max_tokens() >= 1 &&
                  r.params().max_tokens() <= limits.max_tokens_limit),
             "max_tokens %d accepted", r.params().max_tokens());
}

bool MentionsVisionToken(const vlm::v1::ChatRequest& r) {
  for (const auto& m : r.messages()) {
    for (const auto& p : m.content()) {
      if (!p.has_text()) continue;
      for (const char* token : {"<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                "<|video_pad|>", "<|vision_pad|>"}) {
        if (p.text().find(token) != std::string::npos) return true;
      }
    }
  }
  return false;
}

void CheckRenders(const vlm::v1::ChatRequest& r) {
  std::vector<vlm::language::ChatMessage> messages;
  for (const auto& m : r.messages()) {
    vlm::language::ChatMessage& out = messages.emplace_back();
    out.role = m.role();
    for (const auto& p : m.content()) {
      if (p.has_image()) {
        out.content.push_back(vlm::language::ChatPart::Image({1, 2, 2}));
      } else {
        out.content.push_back(vlm::language::ChatPart::Text(p.text()));
      }
    }
  }
  auto rendered = vlm::language::RenderChatTemplate(messages);
  FUZZ_CHECK(rendered.ok() || MentionsVisionToken(r),
             "accepted request does not render: %s", rendered.status().ToString().c_str());
}

}  // namespace

// Protobuf logs every refused UTF-8 string field; refusals are expected here.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  vlm::v1::ChatRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  ValidationLimits defaults;
  ValidationLimits small;
  small.max_messages = 3;
  small.max_images_per_request = 1;
  small.max_image_bytes = 16;
  small.max_text_bytes = 64;
  small.max_tokens_limit = 4;
  small.max_stop_strings = 1;
  small.max_stop_string_bytes = 4;
  small.max_request_id_bytes = 8;
  for (const ValidationLimits* limits : {&defaults, &small}) {
    if (!vlm::gateway::ValidateChatRequest(request, *limits).ok()) continue;
    CheckWithinLimits(request, *limits);
    CheckRenders(request);
    // The cost estimate reads every inline image's header: any bytes, no crash,
    // and only its two refusals.
    const absl::Status cost =
        vlm::gateway::CheckImageCost(request, limits->image_cost, absl::Seconds(1));
    FUZZ_CHECK(cost.ok() || absl::IsInvalidArgument(cost) || absl::IsDeadlineExceeded(cost),
               "image cost estimate returned %s", cost.ToString().c_str());
  }
  return 0;
}
