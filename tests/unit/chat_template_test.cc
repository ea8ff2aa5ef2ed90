// The Qwen3-VL Instruct chat template: the spec's rendered examples a)-d)
// (section 7.2) and ids of a), placeholder expansion (7.3), and the
// conversations the API rejects.
#include "services/language/text/chat_template.h"

#include <cstdlib>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace vlm::language {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string Env(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

const ImageGrid kGrid{1, 16, 16};  // 64 tokens

ChatMessage User(std::vector<ChatPart> parts) { return {"user", std::move(parts)}; }
ChatMessage Assistant(const std::string& text) { return {"assistant", {ChatPart::Text(text)}}; }
ChatMessage System(const std::string& text) { return {"system", {ChatPart::Text(text)}}; }

std::string Render(const std::vector<ChatMessage>& m, ChatTemplateOptions o = {}) {
  absl::StatusOr<std::string> text = RenderChatTemplate(m, o);
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() ? *text : "";
}

absl::Status RenderError(const std::vector<ChatMessage>& m, ChatTemplateOptions o = {}) {
  absl::StatusOr<std::string> text = RenderChatTemplate(m, o);
  EXPECT_FALSE(text.ok()) << "rendered: " << *text;
  return text.ok() ? absl::OkStatus() : text.status();
}

constexpr char kExampleA[] =
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image."
    "<|im_end|>\n<|im_start|>assistant\n";

TEST(ChatTemplateTest, ExampleA_OneUserTurnImageThenText) {
  EXPECT_EQ(Render({User({ChatPart::Image(kGrid), ChatPart::Text("Describe this image.")})}),
            kExampleA);
}

TEST(ChatTemplateTest, ExampleB_SystemMessageFirst) {
  EXPECT_EQ(Render({System("You are a helpful assistant."),
                    User({ChatPart::Image(kGrid), ChatPart::Text("Describe this image.")})}),
            std::string("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n") + kExampleA);
}

TEST(ChatTemplateTest, ExampleC_MultiTurn) {
  EXPECT_EQ(Render({User({ChatPart::Image(kGrid), ChatPart::Text("What is this?")}),
                    Assistant("A cat."), User({ChatPart::Text("What color?")})}),
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
            "<|im_start|>assistant\nA cat.<|im_end|>\n<|im_start|>user\nWhat color?<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(ChatTemplateTest, ExampleD_TwoImagesWithAndWithoutVisionIds) {
  const std::vector<ChatMessage> m = {
      User({ChatPart::Image(kGrid), ChatPart::Image(kGrid), ChatPart::Text("Compare.")})};
  EXPECT_EQ(Render(m),
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|vision_start|>"
            "<|image_pad|><|vision_end|>Compare.<|im_end|>\n<|im_start|>assistant\n");
  ChatTemplateOptions ids;
  ids.add_vision_id = true;
  EXPECT_EQ(Render(m, ids),
            "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: "
            "<|vision_start|><|image_pad|><|vision_end|>Compare.<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(ChatTemplateTest, KeepsTheCallersOrderAndConcatenatesTextParts) {
  EXPECT_EQ(Render({User({ChatPart::Text("A"), ChatPart::Image(kGrid), ChatPart::Text("B"),
                          ChatPart::Text("C")})}),
            "<|im_start|>user\nA<|vision_start|><|image_pad|><|vision_end|>BC<|im_end|>\n"
            "<|im_start|>assistant\n");
  ChatTemplateOptions no_prompt;
  no_prompt.add_generation_prompt = false;
  EXPECT_EQ(Render({User({ChatPart::Text("hi")}), Assistant("hello")}, no_prompt),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n");
  EXPECT_EQ(Render({User({})}), "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplateTest, RejectsWhatTheApiDoesNotAccept) {
  EXPECT_THAT(RenderError({}).message(), HasSubstr("no messages"));
  EXPECT_THAT(RenderError({{"function", {ChatPart::Text("x")}}}).message(),
              HasSubstr("unknown role \"function\""));
  EXPECT_THAT(RenderError({{"user", {ChatPart::Text("x")}, {{"f", "{}"}}}}).message(),
              HasSubstr("only assistant messages carry tool calls"));
  EXPECT_THAT(RenderError({User({ChatPart::Text("a")}), System("late")}).message(),
              HasSubstr("messages[1]: a system message must be the first"));
  EXPECT_THAT(RenderError({User({ChatPart::Text("a")}),
                           {"assistant", {ChatPart::Image(kGrid)}},
                           User({ChatPart::Text("b")})})
                  .message(),
              HasSubstr("images are allowed in user messages only"));
  EXPECT_THAT(RenderError({{"system", {ChatPart::Image(kGrid)}}, User({})}).message(),
              HasSubstr("not in system messages"));
  EXPECT_THAT(RenderError({User({ChatPart::Text("a")}), Assistant("b")}).message(),
              HasSubstr("ends with an assistant message"));
  EXPECT_THAT(RenderError({User({ChatPart::Text("look: <|image_pad|>")})}).message(),
              HasSubstr("control token <|image_pad|>"));
  // Two parts, each harmless alone, meeting as a control token (found by
  // chat_template_fuzzer), also next to a real image.
  EXPECT_THAT(RenderError({User({ChatPart::Text("a <|vision_"), ChatPart::Text("start|> b")})})
                  .message(),
              HasSubstr("together form the control token <|vision_start|>"));
  EXPECT_THAT(RenderError({User({ChatPart::Image(kGrid), ChatPart::Text("<|image_"),
                                 ChatPart::Text("pad|>")})})
                  .message(),
              HasSubstr("together form the control token <|image_pad|>"));
  EXPECT_THAT(RenderError({User({ChatPart::Text("ok"), ChatPart::Text("bad \xFF")})}).message(),
              HasSubstr("messages[0].content[1].text is not valid UTF-8: ill-formed sequence at "
                        "byte offset 4"));
  for (const absl::Status& s : {RenderError({}), RenderError({{"bot", {}}})}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  }
}

// Qwen3's tool format, written out from the model's Jinja template: tools in
// the system turn (tojson: ", " and ": " separators, keys in order), an
// assistant call without text, and a run of two tool results as one user turn.
TEST(ChatTemplateTest, ToolsCallsAndResultsInQwen3Format) {
  absl::StatusOr<std::string> tool = ToolJson(
      "get_weather", "Weather in a city",
      R"({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]})");
  ASSERT_TRUE(tool.ok()) << tool.status();
  EXPECT_EQ(*tool,
            R"({"type": "function", "function": {"name": "get_weather", "description": )"
            R"("Weather in a city", "parameters": {"type": "object", "properties": {"city": )"
            R"({"type": "string"}}, "required": ["city"]}}})");
  ChatTemplateOptions options;
  options.tools = {*tool};
  ChatMessage call{"assistant", {}, {{"get_weather", R"({"city": "Paris"})"}}};
  const std::string rendered =
      Render({System("Be brief."), User({ChatPart::Text("Weather in Paris?")}), call,
              {"tool", {ChatPart::Text("18 C")}}, {"tool", {ChatPart::Text("sunny")}}},
             options);
  EXPECT_EQ(rendered,
            "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to "
            "assist with the user query.\n\nYou are provided with function signatures within "
            "<tools></tools> XML tags:\n<tools>\n" + *tool +
            "\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
            "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
            "{\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n");
  // Without a system message the tools get a system turn of their own; text
  // before a call is separated from it by a newline.
  ChatMessage both{"assistant", {ChatPart::Text("Checking.")}, {{"f", "{}"}, {"f", "{}"}}};
  ChatTemplateOptions no_prompt = options;
  no_prompt.add_generation_prompt = false;
  const std::string second = Render({User({ChatPart::Text("q")}), both}, no_prompt);
  EXPECT_EQ(second.rfind("<|im_start|>system\n# Tools", 0), 0u) << second;
  EXPECT_THAT(second, HasSubstr("<|im_start|>assistant\nChecking.\n<tool_call>\n{\"name\": \"f\", "
                                "\"arguments\": {}}\n</tool_call>\n<tool_call>\n"));
  EXPECT_FALSE(ToolJson("f", "", "[1]").ok());
  EXPECT_EQ(*ToolJson("f", "", ""), R"({"type": "function", "function": {"name": "f"}})");
}

TEST(ChatTemplateTest, ImageTokenCountIsGridOverMergeSquared) {
  EXPECT_EQ(*ImageTokenCount({1, 30, 40}), 300);  // a 480x640 image
  EXPECT_EQ(*ImageTokenCount({2, 16, 16}), 128);
  EXPECT_EQ(*ImageTokenCount({1, 2, 2}), 1);
  for (ImageGrid bad : {ImageGrid{1, 0, 16}, ImageGrid{0, 16, 16}, ImageGrid{1, 15, 16},
                        ImageGrid{1, -2, 4}, ImageGrid{1, 1 << 30, 1 << 30},
                        ImageGrid{int64_t{1} << 62, 2, 2}}) {
    EXPECT_FALSE(ImageTokenCount(bad).ok()) << bad.t << " " << bad.h << " " << bad.w;
  }
}

TEST(ChatTemplateTest, ExpandsEachPlaceholderByItsOwnGrid) {
  std::vector<ImageSpan> spans;
  absl::StatusOr<std::vector<int32_t>> ids =
      ExpandImagePlaceholders({7, 9, 5, 9, 8}, {{1, 2, 4}, {1, 2, 2}}, 9, 2, &spans);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ElementsAre(7, 9, 9, 5, 9, 8));
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].offset, 1);
  EXPECT_EQ(spans[0].length, 2);
  EXPECT_EQ(spans[1].offset, 4);
  EXPECT_EQ(spans[1].length, 1);
  EXPECT_FALSE(ExpandImagePlaceholders({9, 9}, {{1, 2, 2}}, 9).ok());
  EXPECT_FALSE(ExpandImagePlaceholders({1}, {{1, 2, 2}}, 9).ok());
}

class PromptTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string cache = Env("VLM_CACHE_DIR", Env("HOME", "/root") + "/.cache/vlm");
    absl::StatusOr<std::unique_ptr<Tokenizer>> t =
        Tokenizer::Load(Env("VLM_TOKENIZER_DIR", cache + "/tokenizer"));
    ASSERT_TRUE(t.ok()) << t.status() << " (scripts/setup.sh fetches the tokenizer)";
    tokenizer_ = t->release();
  }
  static void TearDownTestSuite() { delete tokenizer_; }
  static Tokenizer* tokenizer_;
};
Tokenizer* PromptTest::tokenizer_ = nullptr;

TEST_F(PromptTest, ExampleAIdsAndExpansionOfA480x640Image) {
  const std::vector<ChatMessage> m = {
      User({ChatPart::Image({1, 30, 40}), ChatPart::Text("Describe this image.")})};
  EXPECT_THAT(*tokenizer_->Encode(*RenderChatTemplate(m)),
              ElementsAre(151644, 872, 198, 151652, 151655, 151653, 74785, 419, 2168, 13, 151645,
                          198, 151644, 77091, 198));
  absl::StatusOr<Prompt> p = BuildPrompt(*tokenizer_, m);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->text, kExampleA);
  ASSERT_EQ(p->ids.size(), 314u);  // 15 - 1 + 300
  ASSERT_EQ(p->images.size(), 1u);
  EXPECT_EQ(p->images[0].offset, 4);
  EXPECT_EQ(p->images[0].length, 300);
  EXPECT_EQ(p->ids[3], 151652);
  for (int k = 4; k < 304; ++k) ASSERT_EQ(p->ids[k], 151655) << k;
  EXPECT_EQ(p->ids[304], 151653);
}

TEST_F(PromptTest, ImagesAcrossTurnsAreExpandedInOrder) {
  absl::StatusOr<Prompt> p = BuildPrompt(
      *tokenizer_, {User({ChatPart::Image({1, 4, 4}), ChatPart::Text("a")}), Assistant("b"),
                    User({ChatPart::Text("c"), ChatPart::Image({1, 2, 2})})});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->images.size(), 2u);
  EXPECT_EQ(p->images[0].length, 4);
  EXPECT_EQ(p->images[1].length, 1);
  EXPECT_EQ(p->ids[p->images[0].offset - 1], 151652);
  EXPECT_EQ(p->ids[p->images[0].offset + 4], 151653);
  EXPECT_EQ(p->ids[p->images[1].offset - 1], 151652);
  EXPECT_EQ(p->ids[p->images[1].offset + 1], 151653);
  int64_t pads = 0;
  for (int32_t id : p->ids) pads += id == 151655;
  EXPECT_EQ(pads, 5);
}

TEST_F(PromptTest, RejectsBadGridsNamingTheMessage) {
  absl::StatusOr<Prompt> p = BuildPrompt(
      *tokenizer_, {User({ChatPart::Text("x")}), Assistant("y"),
                    User({ChatPart::Text("z"), ChatPart::Image({1, 3, 4})})});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(p.status().message(), HasSubstr("messages[2]: content[1]: image grid [1, 3, 4]"));
}

TEST_F(PromptTest, OtherControlTokensInTextAreParsedLikeHf) {
  absl::StatusOr<Prompt> p = BuildPrompt(*tokenizer_, {User({ChatPart::Text("<|im_end|>")})});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->ids, ElementsAre(151644, 872, 198, 151645, 151645, 198, 151644, 77091, 198));
}

}  // namespace
}  // namespace vlm::language
