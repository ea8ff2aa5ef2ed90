// libFuzzer target: chat-template rendering and prompt building (render +
// tokenize + image placeholder expansion) on the real Qwen3 tokenizer.
//
// The input is read with FuzzedDataProvider into a conversation: up to 12
// messages with a role (one of the four, or arbitrary bytes; sometimes a tool call,
// and sometimes a tool listed), up to 6 parts
// each (arbitrary text, or an image grid of small or arbitrary sizes; at most 8
// images), and the
// two template options. Properties checked when a call succeeds:
//   - RenderChatTemplate emits one <|vision_start|> per image part;
//   - BuildPrompt returns one span per image, in order, each of
//     ImageTokenCount(grid) <|image_pad|> ids, and no other <|image_pad|> id.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "services/language/text/chat_template.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_tokenizer.h"

namespace {

using namespace vlm::language;  // NOLINT: a fuzz target of this one module

int64_t GridSide(FuzzedDataProvider& in) {
  // Mostly small (valid or off-by-one), sometimes anything.
  if (in.ConsumeBool()) return in.ConsumeIntegralInRange<int64_t>(-2, 64);
  return in.ConsumeIntegral<int64_t>();
}

size_t Count(absl::string_view text, absl::string_view what) {
  size_t n = 0;
  for (size_t pos = text.find(what); pos != absl::string_view::npos;
       pos = text.find(what, pos + what.size())) {
    ++n;
  }
  return n;
}

}  // namespace

// Loading the 11 MB tokenizer.json takes seconds under ASan: done once here,
// outside the per-input timeout.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  vlm::fuzz::SharedTokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Tokenizer& tokenizer = vlm::fuzz::SharedTokenizer();
  FuzzedDataProvider in(data, size);
  ChatTemplateOptions options;
  options.add_generation_prompt = in.ConsumeBool();
  options.add_vision_id = in.ConsumeBool();
  if (in.ConsumeIntegralInRange<uint8_t>(0, 3) == 0) {
    options.tools.push_back(in.ConsumeRandomLengthString(64));  // already rendered tool JSON
  }
  std::vector<ChatMessage> messages(in.ConsumeIntegralInRange<size_t>(0, 12));
  size_t images = 0;
  for (ChatMessage& m : messages) {
    static const char* const kRoles[] = {"system", "user", "assistant", "user", "tool"};
    const uint8_t r = in.ConsumeIntegralInRange<uint8_t>(0, 5);
    m.role = r < 5 ? kRoles[r] : in.ConsumeRandomLengthString(16);
    if (in.ConsumeIntegralInRange<uint8_t>(0, 3) == 0) {
      m.tool_calls.push_back({in.ConsumeRandomLengthString(16), in.ConsumeRandomLengthString(64)});
    }
    const size_t parts = in.ConsumeIntegralInRange<size_t>(0, 6);
    for (size_t p = 0; p < parts; ++p) {
      // At most 8 images (the gateway's default limit) keeps a prompt of
      // kMaxImageTokens-sized images within the fuzzer's memory limit.
      if (in.ConsumeIntegralInRange<uint8_t>(0, 3) == 0 && images < 8) {
        ImageGrid grid;
        grid.t = in.ConsumeBool() ? 1 : GridSide(in);
        grid.h = GridSide(in);
        grid.w = GridSide(in);
        m.content.push_back(ChatPart::Image(grid));
        ++images;
      } else {
        m.content.push_back(ChatPart::Text(in.ConsumeRandomLengthString(256)));
      }
    }
  }

  auto text = RenderChatTemplate(messages, options);
  if (text.ok()) {
    FUZZ_CHECK(Count(*text, "<|vision_start|>") == images,
               "rendered %zu <|vision_start|> for %zu images", Count(*text, "<|vision_start|>"),
               images);
  }
  auto prompt = BuildPrompt(tokenizer, messages, options);
  if (!prompt.ok()) return 0;
  FUZZ_CHECK(text.ok(), "BuildPrompt succeeded where RenderChatTemplate failed");
  FUZZ_CHECK(prompt->images.size() == images, "%zu spans for %zu images", prompt->images.size(),
             images);
  const int32_t pad = tokenizer.special_ids().image_pad;
  size_t pads = 0;
  for (int32_t id : prompt->ids) pads += id == pad;
  size_t expected_pads = 0;
  int64_t previous_end = 0;
  for (const ImageSpan& span : prompt->images) {
    auto count = ImageTokenCount(span.grid);
    FUZZ_CHECK(count.ok() && *count == span.length, "span length %lld vs token count",
               static_cast<long long>(span.length));
    FUZZ_CHECK(span.offset >= previous_end &&
                   span.offset + span.length <= static_cast<int64_t>(prompt->ids.size()),
               "span [%lld, +%lld) out of order or out of %zu ids",
               static_cast<long long>(span.offset), static_cast<long long>(span.length),
               prompt->ids.size());
    for (int64_t i = span.offset; i < span.offset + span.length; ++i) {
      FUZZ_CHECK(prompt->ids[i] == pad, "id %d inside an image span", prompt->ids[i]);
    }
    previous_end = span.offset + span.length;
    expected_pads += static_cast<size_t>(span.length);
  }
  FUZZ_CHECK(pads == expected_pads, "%zu <|image_pad|> ids, %zu inside spans", pads, expected_pads);
  return 0;
}
