#include "services/language/text/chat_template.h"

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "services/language/text/utf8.h"

namespace vlm::language {
namespace {

constexpr char kImageBlock[] = "<|vision_start|><|image_pad|><|vision_end|>";
constexpr const char* kVisionTokens[] = {"<|vision_start|>", "<|vision_end|>",
                                              "<|image_pad|>", "<|video_pad|>", "<|vision_pad|>"};

absl::Status Invalid(size_t message, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("messages[", message, "]: ", what));
}

}  // namespace

absl::StatusOr<std::string> RenderChatTemplate(absl::Span<const ChatMessage> messages,
                                               const ChatTemplateOptions& options) {
  if (messages.empty()) return absl::InvalidArgumentError("the conversation has no messages");
  std::string out;
  int image_count = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const bool system = m.role == "system";
    const bool user = m.role == "user";
    if (!system && !user && m.role != "assistant") {
      return Invalid(i, absl::StrCat("unknown role \"", absl::CHexEscape(m.role),
                                     "\"; expected \"system\", \"user\" or \"assistant\""));
    }
    if (system && i != 0) return Invalid(i, "a system message must be the first message");
    absl::StrAppend(&out, "<|im_start|>", m.role, "\n");
    for (size_t k = 0; k < m.content.size(); ++k) {
      const ChatPart& part = m.content[k];
      if (part.kind == ChatPart::Kind::kImage) {
        if (!user) {
          return Invalid(i, absl::StrCat("content[", k, "] is an image; images are allowed in ",
                                         "user messages only, not in ", m.role, " messages"));
        }
        ++image_count;
        if (options.add_vision_id) absl::StrAppend(&out, "Picture ", image_count, ": ");
        out += kImageBlock;
        continue;
      }
      if (absl::Status s = utf8::Validate(
              part.text, absl::StrCat("messages[", i, "].content[", k, "].text"));
          !s.ok()) {
        return s;
      }
      for (const char* token : kVisionTokens) {
        if (part.text.find(token) != std::string::npos) {
          return Invalid(i, absl::StrCat("content[", k, "] contains the control token ", token,
                                         "; send images as image parts"));
        }
      }
      out += part.text;
    }
    out += "<|im_end|>\n";
  }
  if (options.add_generation_prompt) {
    if (messages.back().role == "assistant") {
      return Invalid(messages.size() - 1,
                     "the conversation ends with an assistant message but a generation prompt "
                     "was requested; end with a user message");
    }
    out += "<|im_start|>assistant\n";
  }
  return out;
}

absl::StatusOr<int64_t> ImageTokenCount(const ImageGrid& grid, int64_t merge_size) {
  if (merge_size < 1) return absl::InvalidArgumentError("merge size must be positive");
  const auto describe = [&] { return absl::StrCat("[", grid.t, ", ", grid.h, ", ", grid.w, "]"); };
  if (grid.t < 1 || grid.h < 1 || grid.w < 1 || grid.h % merge_size != 0 ||
      grid.w % merge_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("image grid ", describe(), " is invalid: t, h and w must be positive and h, w ",
                     "multiples of the merge size ", merge_size));
  }
  // Bound each factor first so the product cannot overflow.
  if (grid.t > kMaxImageTokens || grid.h > kMaxImageTokens || grid.w > kMaxImageTokens ||
      grid.t * (grid.h / merge_size) > kMaxImageTokens ||
      grid.t * (grid.h / merge_size) * (grid.w / merge_size) > kMaxImageTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("image grid ", describe(), " needs more than ", kMaxImageTokens, " tokens"));
  }
  return grid.t * (grid.h / merge_size) * (grid.w / merge_size);
}

absl::StatusOr<std::vector<int32_t>> ExpandImagePlaceholders(absl::Span<const int32_t> ids,
                                                             absl::Span<const ImageGrid> grids,
                                                             int32_t image_pad_id,
                                                             int64_t merge_size,
                                                             std::vector<ImageSpan>* spans) {
  std::vector<int64_t> counts;
  counts.reserve(grids.size());
  int64_t extra = 0;
  for (const ImageGrid& g : grids) {
    absl::StatusOr<int64_t> n = ImageTokenCount(g, merge_size);
    if (!n.ok()) return n.status();
    counts.push_back(*n);
    extra += *n - 1;
  }
  size_t placeholders = 0;
  for (int32_t id : ids) placeholders += id == image_pad_id;
  if (placeholders != grids.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the prompt has ", placeholders,
                                                   " image placeholders but ", grids.size(),
                                                   " images were given"));
  }
  std::vector<int32_t> out;
  out.reserve(ids.size() + extra);
  if (spans != nullptr) spans->clear();
  size_t k = 0;
  for (int32_t id : ids) {
    if (id != image_pad_id) {
      out.push_back(id);
      continue;
    }
    if (spans != nullptr) {
      spans->push_back({static_cast<int64_t>(out.size()), counts[k], grids[k]});
    }
    out.insert(out.end(), counts[k], image_pad_id);
    ++k;
  }
  return out;
}

absl::StatusOr<Prompt> BuildPrompt(const Tokenizer& tokenizer,
                                   absl::Span<const ChatMessage> messages,
                                   const ChatTemplateOptions& options, int64_t merge_size) {
  Prompt prompt;
  std::vector<ImageGrid> grids;
  for (size_t i = 0; i < messages.size(); ++i) {
    for (size_t k = 0; k < messages[i].content.size(); ++k) {
      const ChatPart& part = messages[i].content[k];
      if (part.kind != ChatPart::Kind::kImage) continue;
      if (absl::StatusOr<int64_t> n = ImageTokenCount(part.grid, merge_size); !n.ok()) {
        return Invalid(i, absl::StrCat("content[", k, "]: ", n.status().message()));
      }
      grids.push_back(part.grid);
    }
  }
  absl::StatusOr<std::string> text = RenderChatTemplate(messages, options);
  if (!text.ok()) return text.status();
  prompt.text = *std::move(text);
  const int32_t image_pad = tokenizer.special_ids().image_pad;
  if (image_pad < 0 && !grids.empty()) {
    return absl::FailedPreconditionError("the tokenizer has no <|image_pad|> token");
  }
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Encode(prompt.text);
  if (!ids.ok()) return ids.status();
  absl::StatusOr<std::vector<int32_t>> expanded =
      ExpandImagePlaceholders(*ids, grids, image_pad, merge_size, &prompt.images);
  if (!expanded.ok()) return expanded.status();
  prompt.ids = *std::move(expanded);
  return prompt;
}

}  // namespace vlm::language
