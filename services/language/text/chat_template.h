// The Qwen3-VL Instruct chat template (qwen3-vl-model.md section 7.2),
// implemented natively for the message shapes of the public API (system, user
// and assistant messages of text and image parts), and image placeholder
// expansion (section 7.3).
//
// Stricter than the Jinja template, which silently drops or ignores what an
// API client almost certainly did not mean; these are rejected with
// INVALID_ARGUMENT instead:
//   - an empty conversation;
//   - a role other than "system", "user", "assistant" or "tool";
//   - a system message that is not the first message (the template drops it);
//   - an image in a system or assistant message (the template ignores it, but
//     the caller would have paid for encoding it);
//   - a conversation ending with an assistant message when a generation
//     prompt is requested (the model would start a second reply);
//   - text containing <|vision_start|>, <|vision_end|>, <|image_pad|>,
//     <|video_pad|> or <|vision_pad|>: the tokenizer would read them as
//     control tokens and the image placeholders would no longer line up.
// Tools (Qwen3's format): with options.tools the system turn lists them; an
// assistant message's tool_calls follow its text as <tool_call> blocks; a run
// of "tool" messages (results) renders as one user turn of <tool_response>
// blocks, images allowed as in user content.
// Other special-token strings in text are tokenized as control tokens, as HF
// does (section 10, pitfall 26). A message with no parts renders as an empty
// turn, as in the template.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "services/language/text/tokenizer.h"

namespace vlm::language {

// An image's patch grid in 16x16-patch units (vlm.v1.ImageGrid).
struct ImageGrid {
  int64_t t = 1;
  int64_t h = 0;
  int64_t w = 0;
};

// One part of a message: text, or an image known by its grid.
struct ChatPart {
  enum class Kind { kText, kImage };
  Kind kind = Kind::kText;
  std::string text;  // kText
  ImageGrid grid;    // kImage

  static ChatPart Text(std::string text) { return {Kind::kText, std::move(text), {}}; }
  static ChatPart Image(ImageGrid grid) { return {Kind::kImage, {}, grid}; }
};

// A call an assistant message made (rendered as
// <tool_call>\n{"name": "<name>", "arguments": <arguments>}\n</tool_call>).
struct ChatToolCall {
  std::string name;
  std::string arguments;  // JSON text, emitted verbatim
};

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" or "tool"
  std::vector<ChatPart> content;
  std::vector<ChatToolCall> tool_calls;  // assistant only
};

struct ChatTemplateOptions {
  // Append "<|im_start|>assistant\n" so the model writes the next reply.
  bool add_generation_prompt = true;
  // Prefix each image with "Picture n: " (n counts images over the conversation).
  bool add_vision_id = false;
  // Tools offered to the model, each as ToolJson renders it: listed in the
  // system turn inside <tools></tools> with Qwen3's instructions.
  std::vector<std::string> tools;
};

// A tool as the template lists it: {"type": "function", "function": {"name",
// "description" (if any), "parameters" (if any)}} in HF's `tojson` form
// (", " and ": " separators, keys in the given order, non-ASCII unescaped).
// INVALID_ARGUMENT if `parameters_json` is not a JSON object.
absl::StatusOr<std::string> ToolJson(const std::string& name, const std::string& description,
                                     const std::string& parameters_json);

// The rendered prompt text, before placeholder expansion: one
// <|vision_start|><|image_pad|><|vision_end|> per image.
absl::StatusOr<std::string> RenderChatTemplate(absl::Span<const ChatMessage> messages,
                                               const ChatTemplateOptions& options = {});

// Tokens an image occupies in the language model: t*h*w / merge_size^2.
// INVALID_ARGUMENT unless t, h, w >= 1, h and w are multiples of merge_size
// and the count is at most kMaxImageTokens.
inline constexpr int64_t kMaxImageTokens = int64_t{1} << 20;
absl::StatusOr<int64_t> ImageTokenCount(const ImageGrid& grid, int64_t merge_size = 2);

// Where image k's tokens lie in the expanded ids.
struct ImageSpan {
  int64_t offset = 0;  // index of its first <|image_pad|>
  int64_t length = 0;  // ImageTokenCount(grid)
  ImageGrid grid;
};

// Replaces the k-th `image_pad_id` in `ids` by ImageTokenCount(grids[k])
// copies. INVALID_ARGUMENT if the number of placeholders differs from
// grids.size(). `spans` (optional) receives one entry per image.
absl::StatusOr<std::vector<int32_t>> ExpandImagePlaceholders(absl::Span<const int32_t> ids,
                                                             absl::Span<const ImageGrid> grids,
                                                             int32_t image_pad_id,
                                                             int64_t merge_size = 2,
                                                             std::vector<ImageSpan>* spans = nullptr);

// A model-ready prompt: rendered text, expanded ids, image positions.
struct Prompt {
  std::string text;
  std::vector<int32_t> ids;
  std::vector<ImageSpan> images;  // in conversation order
};

// Render + tokenize + expand.
absl::StatusOr<Prompt> BuildPrompt(const Tokenizer& tokenizer,
                                   absl::Span<const ChatMessage> messages,
                                   const ChatTemplateOptions& options = {},
                                   int64_t merge_size = 2);

}  // namespace vlm::language
