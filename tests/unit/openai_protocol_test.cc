// The OpenAI wire format of the gateway's HTTP front end, without processes:
// request parsing (every field, null as absent, errors naming `param`), the
// status table, the renaming of validation messages, chunk/completion JSON,
// and API keys.
#include <map>
#include "services/gateway/openai_protocol.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "services/gateway/api_keys.h"
#include "services/gateway/chat_pipeline.h"
#include "services/gateway/http_status.h"

namespace vlm::gateway {
namespace {

using json = nlohmann::json;

ParseOptions Options(bool remote = false) {
  ParseOptions o;
  o.served_model_name = "tiny";
  o.allow_remote_images = remote;
  return o;
}

std::optional<ApiError> Parse(const json& body, OpenAiChatRequest* out, bool remote = false) {
  return ParseChatCompletionRequest(body.dump(), Options(remote), out);
}

json Body() {
  return json{{"model", "tiny"}, {"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}};
}

TEST(OpenAiRequestTest, EveryParameterReachesTheChatRequest) {
  json body = Body();
  body["messages"] = json::array(
      {{{"role", "developer"}, {"content", "be brief"}},
       {{"role", "user"},
        {"content",
         json::array({{{"type", "text"}, {"text", "look"}},
                      {{"type", "image_url"},
                       {"image_url", {{"url", "data:image/png;base64," + absl::Base64Escape("PNGBYTES")},
                                      {"detail", "low"}}}}})}},
       {{"role", "assistant"}, {"content", "ok"}},
       {{"role", "user"}, {"content", "again"}}});
  body["max_completion_tokens"] = 17;
  body["max_tokens"] = 99;  // max_completion_tokens wins
  body["temperature"] = 0.5;
  body["top_p"] = 0.9;
  body["top_k"] = -1;
  body["min_p"] = 0.05;
  body["seed"] = 42;
  body["stop"] = json::array({"END", "STOP"});
  body["presence_penalty"] = 0.5;
  body["frequency_penalty"] = -0.5;
  body["repetition_penalty"] = 1.1;
  body["logprobs"] = true;
  body["top_logprobs"] = 5;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  body["n"] = 3;
  body["user"] = "someone";  // ignored
  OpenAiChatRequest out;
  ASSERT_EQ(Parse(body, &out), std::nullopt);
  const v1::ChatRequest& r = out.request;
  EXPECT_EQ(r.n(), 3);
  ASSERT_EQ(r.messages_size(), 4);
  EXPECT_EQ(r.messages(0).role(), "system");
  EXPECT_EQ(r.messages(1).content_size(), 2);
  EXPECT_EQ(r.messages(1).content(0).text(), "look");
  EXPECT_EQ(r.messages(1).content(1).image().data(), "PNGBYTES");
  EXPECT_EQ(r.messages(2).role(), "assistant");
  const v1::GenerationParams& p = r.params();
  EXPECT_EQ(p.max_tokens(), 17);
  EXPECT_FLOAT_EQ(p.sampling().temperature(), 0.5f);
  EXPECT_FLOAT_EQ(p.sampling().top_p(), 0.9f);
  EXPECT_TRUE(p.sampling().has_top_k());
  EXPECT_EQ(p.sampling().top_k(), 0);  // -1 = disabled
  EXPECT_FLOAT_EQ(p.sampling().min_p(), 0.05f);
  EXPECT_EQ(p.sampling().seed(), 42u);
  ASSERT_EQ(p.stop_size(), 2);
  EXPECT_EQ(p.stop(1), "STOP");
  EXPECT_FLOAT_EQ(p.sampling().presence_penalty(), 0.5f);
  EXPECT_FLOAT_EQ(p.sampling().frequency_penalty(), -0.5f);
  EXPECT_FLOAT_EQ(p.sampling().repetition_penalty(), 1.1f);
  EXPECT_TRUE(p.logprobs());
  EXPECT_EQ(p.top_logprobs(), 5);
  EXPECT_TRUE(out.stream);
  EXPECT_TRUE(out.include_usage);
  EXPECT_TRUE(out.logprobs);
}

// image_url.detail: a pixel budget carried in the image's options.
TEST(OpenAiRequestTest, DetailBecomesThePixelBudget) {
  auto parse = [](json detail, OpenAiChatRequest* out) {
    json url = {{"url", "data:image/png;base64," + absl::Base64Escape("PNGBYTES")}};
    if (!detail.is_discarded()) url["detail"] = std::move(detail);
    json body = Body();
    body["messages"][0]["content"] =
        json::array({{{"type", "image_url"}, {"image_url", std::move(url)}}});
    return Parse(body, out);
  };
  struct Case {
    json detail;
    int64_t max_pixels;  // 0 = the vision service's default
  };
  for (const Case& c : {Case{"low", 262144}, Case{"LOW", 262144}, Case{"high", int64_t{1} << 40},
                        Case{"auto", 0}, Case{nullptr, 0}, Case{json::value_t::discarded, 0}}) {
    OpenAiChatRequest out;
    ASSERT_EQ(parse(c.detail, &out), std::nullopt) << c.detail.dump();
    const v1::ImagePart& image = out.request.messages(0).content(0).image();
    EXPECT_EQ(image.data(), "PNGBYTES");
    EXPECT_EQ(image.options().max_pixels(), c.max_pixels) << c.detail.dump();
    EXPECT_EQ(image.options().min_pixels(), 0);
  }
  for (const json& bad : {json("medium"), json(3), json::array()}) {
    OpenAiChatRequest out;
    std::optional<ApiError> e = parse(bad, &out);
    ASSERT_NE(e, std::nullopt) << bad.dump();
    EXPECT_EQ(e->param, "messages[0].content[0].image_url.detail");
    EXPECT_EQ(e->code, grpc::StatusCode::INVALID_ARGUMENT);
  }
}

TEST(OpenAiRequestTest, NullMeansAbsentAndModelDefaultsToTheServedOne) {
  json body = Body();
  body.erase("model");
  body["temperature"] = nullptr;
  body["stop"] = nullptr;
  body["max_tokens"] = nullptr;
  body["stream_options"] = nullptr;
  OpenAiChatRequest out;
  ASSERT_EQ(Parse(body, &out), std::nullopt);
  EXPECT_EQ(out.model, "tiny");
  EXPECT_FALSE(out.request.params().sampling().has_temperature());
  EXPECT_FALSE(out.request.params().has_max_tokens());
  EXPECT_EQ(out.request.params().stop_size(), 0);
  json single = Body();
  single["stop"] = "\n";
  ASSERT_EQ(Parse(single, &out), std::nullopt);
}

TEST(OpenAiRequestTest, ErrorsNameTheParameter) {
  struct Case {
    json body;
    std::string param;
    grpc::StatusCode code;
  };
  auto with = [](const char* key, json value) {
    json b = Body();
    b[key] = std::move(value);
    return b;
  };
  auto content = [](json parts) {
    json b = Body();
    b["messages"][0]["content"] = std::move(parts);
    return b;
  };
  auto image = [&](const std::string& url) {
    return content(json::array({{{"type", "image_url"}, {"image_url", {{"url", url}}}}}));
  };
  json no_messages = Body();
  no_messages.erase("messages");
  json role = Body();
  role["messages"][0]["role"] = 7;
  const std::vector<Case> cases = {
      {no_messages, "messages", grpc::StatusCode::INVALID_ARGUMENT},
      {with("messages", json::array()), "messages", grpc::StatusCode::INVALID_ARGUMENT},
      {role, "messages[0].role", grpc::StatusCode::INVALID_ARGUMENT},
      {with("temperature", true), "temperature", grpc::StatusCode::INVALID_ARGUMENT},
      {with("max_tokens", 2.5), "max_tokens", grpc::StatusCode::INVALID_ARGUMENT},
      {with("max_tokens", 0), "max_tokens", grpc::StatusCode::INVALID_ARGUMENT},
      {with("max_tokens", int64_t{1} << 40), "max_tokens", grpc::StatusCode::INVALID_ARGUMENT},
      {with("stop", json::array({"a", 3})), "stop[1]", grpc::StatusCode::INVALID_ARGUMENT},
      {with("top_logprobs", 2), "top_logprobs", grpc::StatusCode::INVALID_ARGUMENT},
      {with("n", 0), "n", grpc::StatusCode::INVALID_ARGUMENT},
      {with("n", -2), "n", grpc::StatusCode::INVALID_ARGUMENT},
      {with("n", "2"), "n", grpc::StatusCode::INVALID_ARGUMENT},
      {with("tools", json::array({{{"type", "function"}}})), "tools[0].function",
       grpc::StatusCode::INVALID_ARGUMENT},
      {with("tools", json::array({{{"type", "x"}}})), "tools[0].type",
       grpc::StatusCode::INVALID_ARGUMENT},
      {with("tool_choice", "required"), "tool_choice", grpc::StatusCode::INVALID_ARGUMENT},
      {with("functions", json::array({{{"name", "f"}}})), "functions",
       grpc::StatusCode::INVALID_ARGUMENT},
      {with("response_format", {{"type", "xml"}}), "response_format.type",
       grpc::StatusCode::INVALID_ARGUMENT},
      {with("response_format", {{"type", "json_schema"}}), "response_format.json_schema",
       grpc::StatusCode::INVALID_ARGUMENT},
      {with("response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "x"}}}}),
       "response_format.json_schema.schema", grpc::StatusCode::INVALID_ARGUMENT},
      {with("stream_options", {{"include_usage", true}}), "stream_options",
       grpc::StatusCode::INVALID_ARGUMENT},
      {with("model", "gpt-4o"), "model", grpc::StatusCode::NOT_FOUND},
      {content(json::array({{{"type", "audio"}}})), "messages[0].content[0].type",
       grpc::StatusCode::INVALID_ARGUMENT},
      {content(42), "messages[0].content", grpc::StatusCode::INVALID_ARGUMENT},
      {image("data:image/png;base64,%%%"), "messages[0].content[0].image_url.url",
       grpc::StatusCode::INVALID_ARGUMENT},
      {image("data:image/png,rawbytes"), "messages[0].content[0].image_url.url",
       grpc::StatusCode::INVALID_ARGUMENT},
      {image("data:application/pdf;base64,aGVsbG8="), "messages[0].content[0].image_url.url",
       grpc::StatusCode::INVALID_ARGUMENT},
      {image("https://example.invalid/cat.png"), "messages[0].content[0].image_url.url",
       grpc::StatusCode::INVALID_ARGUMENT},
      {image("file:///etc/passwd"), "messages[0].content[0].image_url.url",
       grpc::StatusCode::INVALID_ARGUMENT},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body.dump().substr(0, 200));
    OpenAiChatRequest out;
    std::optional<ApiError> e = Parse(c.body, &out);
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->param, c.param) << e->message;
    EXPECT_EQ(e->code, c.code) << e->message;
    EXPECT_FALSE(e->message.empty());
  }
  OpenAiChatRequest out;
  std::optional<ApiError> e = ParseChatCompletionRequest("{\"messages\": [", Options(), &out);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->error_code, "invalid_json");
  EXPECT_EQ(e->param, "");
}

TEST(OpenAiRequestTest, ResponseFormatToolsAndToolHistoryReachTheChatRequest) {
  // The schema keeps the client's key order (output property order).
  const std::string text = R"({"model": "tiny", "messages": [
      {"role": "user", "content": "weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "w", "strict": true,
      "schema": {"type": "object", "properties": {"zeta": {"type": "string"},
                 "alpha": {"type": "integer"}}}}},
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d",
      "parameters": {"type": "object", "properties": {"z": {}, "a": {}}}}}],
    "tool_choice": "auto"})";
  OpenAiChatRequest out;
  ASSERT_EQ(ParseChatCompletionRequest(text, Options(), &out), std::nullopt);
  const v1::ChatRequest& r = out.request;
  EXPECT_EQ(r.params().json_schema(),
            R"({"type":"object","properties":{"zeta":{"type":"string"},"alpha":{"type":"integer"}}})");
  ASSERT_EQ(r.tools_size(), 1);
  EXPECT_EQ(r.tools(0).name(), "get_weather");
  EXPECT_EQ(r.tools(0).parameters(), R"({"type":"object","properties":{"z":{},"a":{}}})");
  EXPECT_EQ(r.tool_choice().mode(), v1::TOOL_CHOICE_AUTO);
  EXPECT_TRUE(out.tool_calls);
  ASSERT_EQ(r.messages_size(), 3);
  ASSERT_EQ(r.messages(1).tool_calls_size(), 1);
  EXPECT_EQ(r.messages(1).tool_calls(0).name(), "get_weather");
  EXPECT_EQ(r.messages(1).tool_calls(0).arguments(), R"({"city": "Paris"})");
  EXPECT_EQ(r.messages(1).content_size(), 0);
  EXPECT_EQ(r.messages(2).role(), "tool");
  EXPECT_EQ(r.messages(2).tool_call_id(), "call_1");

  json named = Body();
  named["tools"] = json::parse(R"([{"type": "function", "function": {"name": "f"}}])");
  named["tool_choice"] = {{"type", "function"}, {"function", {{"name", "f"}}}};
  OpenAiChatRequest n;
  ASSERT_EQ(Parse(named, &n), std::nullopt);
  EXPECT_EQ(n.request.tool_choice().mode(), v1::TOOL_CHOICE_FUNCTION);
  EXPECT_EQ(n.request.tool_choice().function(), "f");
  named["response_format"] = {{"type", "json_object"}};
  OpenAiChatRequest both;
  std::optional<ApiError> e = Parse(named, &both);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->param, "response_format");
  json object = Body();
  object["response_format"] = {{"type", "json_object"}};
  OpenAiChatRequest o;
  ASSERT_EQ(Parse(object, &o), std::nullopt);
  EXPECT_TRUE(o.request.params().json_object());
  EXPECT_FALSE(o.tool_calls);
}

TEST(OpenAiErrorTest, SchemaErrorsFromTheLanguageServiceNameResponseFormatOrTheTool) {
  ApiError e = ApiErrorFromStatus(grpc::Status(
      grpc::StatusCode::INVALID_ARGUMENT,
      "params.json_schema is not a supported schema: unsupported keyword \"if\" at #"));
  EXPECT_EQ(e.param, "response_format");
  EXPECT_EQ(e.message.rfind("response_format is not a supported schema", 0), 0u) << e.message;
  e = ApiErrorFromStatus(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                      "tools[1].parameters is not a supported schema: x"));
  EXPECT_EQ(e.param, "tools[1].parameters");
}

TEST(OpenAiResponseTest, ToolCallBlocksBecomeToolCallsPlainAndStreamed) {
  const std::string text =
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
      "{\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": "
      "{}}\n</tool_call>";
  ChunkFormatter format("chatcmpl-abc", 1, "tiny", false, false);
  format.set_tool_calls(true);
  v1::ChatResponse response;
  response.set_text(text);
  response.set_finish_reason(v1::FINISH_REASON_STOP);
  const json c = json::parse(format.Completion(response));
  const json& choice = c["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_EQ(choice["message"]["content"], "Let me check.");
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 2u);
  EXPECT_EQ(choice["message"]["tool_calls"][0]["id"], "call_abc_0");
  EXPECT_EQ(choice["message"]["tool_calls"][0]["type"], "function");
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(choice["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            json::parse(R"({"city": "Paris"})"));

  // Streamed in small pieces: content comes out before the first block, the
  // calls at the end, and the deltas add up to the same message.
  ChunkFormatter stream("chatcmpl-abc", 1, "tiny", false, false);
  stream.set_tool_calls(true);
  std::string content;
  std::map<int, json> calls;
  auto take = [&](const std::string& chunk) {
    const json j = json::parse(chunk);
    if (j["choices"].empty()) return;
    const json& delta = j["choices"][0]["delta"];
    if (delta.contains("content")) content += delta["content"].get<std::string>();
    if (delta.contains("tool_calls")) {
      for (const json& t : delta["tool_calls"]) {
        json& call = calls[t["index"].get<int>()];
        if (t.contains("id")) call["id"] = t["id"];
        if (t["function"].contains("name")) call["name"] = t["function"]["name"];
        call["arguments"] = call.value("arguments", "") + t["function"]["arguments"].get<std::string>();
      }
    }
  };
  for (size_t i = 0; i + 3 < text.size(); i += 3) {
    v1::ChatChunk piece;
    piece.set_text(text.substr(i, 3));
    take(stream.DeltaChunk(piece));
    EXPECT_EQ(content, text.substr(0, content.size()));
  }
  v1::ChatChunk last;
  last.set_text(text.substr(text.size() - (text.size() % 3 == 0 ? 3 : text.size() % 3)));
  last.set_finish_reason(v1::FINISH_REASON_STOP);
  std::string finish;
  for (const std::string& chunk : stream.FinalChunks(last)) {
    take(chunk);
    const json j = json::parse(chunk);
    if (!j["choices"].empty() && j["choices"][0]["finish_reason"].is_string()) {
      finish = j["choices"][0]["finish_reason"];
    }
  }
  EXPECT_EQ(content, "Let me check.");
  EXPECT_EQ(finish, "tool_calls");
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0]["name"], "get_weather");
  EXPECT_EQ(calls[0]["id"], "call_abc_0");
  EXPECT_EQ(json::parse(calls[0]["arguments"].get<std::string>()), json::parse(R"({"city": "Paris"})"));
  EXPECT_EQ(calls[1]["name"], "f");

  // Text that only looks like a call stays content.
  ChunkFormatter plain("chatcmpl-x", 1, "tiny", false, false);
  plain.set_tool_calls(true);
  response.set_text("a <tool_call> b");
  const json p = json::parse(plain.Completion(response));
  EXPECT_EQ(p["choices"][0]["message"]["content"], "a <tool_call> b");
  EXPECT_EQ(p["choices"][0]["finish_reason"], "stop");
  EXPECT_FALSE(p["choices"][0]["message"].contains("tool_calls"));
}

TEST(OpenAiRequestTest, RemoteImagesAreLeftForTheFrontEndWhenAllowed) {
  json body = Body();
  body["messages"][0]["content"] = json::array(
      {{{"type", "text"}, {"text", "what?"}},
       {{"type", "image_url"}, {"image_url", {{"url", "http://127.0.0.1:9/a.png"}}}}});
  OpenAiChatRequest out;
  ASSERT_EQ(Parse(body, &out, /*remote=*/true), std::nullopt);
  ASSERT_EQ(out.remote_images.size(), 1u);
  EXPECT_EQ(out.remote_images[0].message, 0);
  EXPECT_EQ(out.remote_images[0].part, 1);
  EXPECT_TRUE(out.request.messages(0).content(1).has_image());
}

TEST(OpenAiErrorTest, StatusTableAndValidationMessagesBecomeOpenAiErrors) {
  EXPECT_EQ(HttpStatusForCode(grpc::StatusCode::INVALID_ARGUMENT), 400);
  EXPECT_EQ(HttpStatusForCode(grpc::StatusCode::UNAUTHENTICATED), 401);
  EXPECT_EQ(HttpStatusForCode(grpc::StatusCode::NOT_FOUND), 404);
  EXPECT_EQ(HttpStatusForCode(grpc::StatusCode::RESOURCE_EXHAUSTED), 429);
  EXPECT_EQ(HttpStatusForCode(grpc::StatusCode::UNAVAILABLE), 503);
  EXPECT_EQ(HttpStatusForCode(grpc::StatusCode::DEADLINE_EXCEEDED), 504);
  EXPECT_EQ(HttpStatusForCode(grpc::StatusCode::INTERNAL), 500);
  EXPECT_TRUE(ShouldRetryAfter(grpc::StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_FALSE(ShouldRetryAfter(grpc::StatusCode::INVALID_ARGUMENT));

  ApiError top_p = ApiErrorFromStatus(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                                   "params.sampling.top_p is 1.5; must be in (0, 1]"));
  EXPECT_EQ(top_p.param, "top_p");
  EXPECT_EQ(top_p.message, "top_p is 1.5; must be in (0, 1]");
  ApiError role = ApiErrorFromStatus(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                                  "messages[2].role is \"x\"; must be ..."));
  EXPECT_EQ(role.param, "messages[2].role");
  const json e = json::parse(ErrorJson(ApiErrorFromStatus(
      grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "gateway is at capacity"))));
  EXPECT_EQ(e["error"]["type"], "rate_limit_error");
  EXPECT_EQ(e["error"]["code"], "rate_limit_exceeded");
  EXPECT_TRUE(e["error"]["param"].is_null());
  EXPECT_EQ(e["error"]["message"], "gateway is at capacity");
}

TEST(OpenAiResponseTest, ChunksCarryIdModelUsageAndFinishReason) {
  ChunkFormatter f("chatcmpl-x", 1700000000, "tiny", /*logprobs=*/true, /*include_usage=*/true);
  const json role = json::parse(f.RoleChunk());
  EXPECT_EQ(role["object"], "chat.completion.chunk");
  EXPECT_EQ(role["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(role["usage"].is_null());

  v1::ChatChunk delta;
  delta.set_text("Hé");
  v1::TokenLogprob* lp = delta.add_logprobs();
  lp->set_token("Hé");
  lp->set_logprob(-0.25f);
  lp->add_top()->set_token("Hé");
  const json d = json::parse(f.DeltaChunk(delta));
  EXPECT_EQ(d["choices"][0]["delta"]["content"], "Hé");
  const json& token = d["choices"][0]["logprobs"]["content"][0];
  EXPECT_EQ(token["bytes"], json::array({72, 195, 169}));
  EXPECT_EQ(token["top_logprobs"].size(), 1u);

  v1::ChatChunk last;
  last.set_finish_reason(v1::FINISH_REASON_STOP);
  last.mutable_usage()->set_prompt_tokens(10);
  last.mutable_usage()->set_completion_tokens(3);
  last.mutable_usage()->set_cached_prompt_tokens(8);
  v1::ImageResult* image = last.add_images();
  image->set_cache(v1::CACHE_LEVEL_MEMORY);
  image->mutable_budget()->set_min_pixels(65536);
  image->mutable_budget()->set_max_pixels(786432);
  const std::vector<std::string> final_chunks = f.FinalChunks(last);
  ASSERT_EQ(final_chunks.size(), 2u);  // no text left: finish + usage
  const json finish = json::parse(final_chunks[0]);
  EXPECT_EQ(finish["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(finish["x_vlm"]["images"][0]["cache"], "memory");
  EXPECT_TRUE(finish["x_vlm"]["images"][0]["cache_hit"].get<bool>());
  EXPECT_EQ(finish["x_vlm"]["images"][0]["max_pixels"], 786432);
  EXPECT_EQ(finish["x_vlm"]["images"][0]["min_pixels"], 65536);
  const json usage = json::parse(final_chunks[1]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["total_tokens"], 13);
  EXPECT_EQ(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 8);

  v1::ChatResponse response;
  response.set_text("done");
  response.set_finish_reason(v1::FINISH_REASON_LENGTH);
  const json c = json::parse(
      ChunkFormatter("chatcmpl-y", 1, "tiny", false, false).Completion(response));
  EXPECT_EQ(c["object"], "chat.completion");
  EXPECT_EQ(c["choices"][0]["message"]["content"], "done");
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(c["choices"][0]["logprobs"].is_null());
}

TEST(OpenAiResponseTest, InvalidUtf8InATokenIsReplacedNotThrown) {
  ChunkFormatter f("chatcmpl-z", 1, "tiny", true, false);
  v1::ChatChunk delta;
  delta.add_logprobs()->set_token("\xe4\xbd");  // half a character
  EXPECT_NO_THROW(json::parse(f.DeltaChunk(delta)));
}

TEST(ApiKeysTest, BearerKeysFromAFile) {
  const std::string path = ::testing::TempDir() + "/keys";
  std::ofstream(path) << "# comment\n\n  key-one  \nkey-two\n";
  absl::StatusOr<ApiKeys> keys = ApiKeys::LoadFile(path);
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ(keys->size(), 2u);
  EXPECT_TRUE(keys->CheckAuthorization("Bearer key-one").ok());
  EXPECT_TRUE(keys->CheckAuthorization("bearer key-two").ok());
  EXPECT_EQ(keys->CheckAuthorization("").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(keys->CheckAuthorization("Bearer key-on").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(keys->CheckAuthorization("Basic a2V5LW9uZQ==").code(),
            absl::StatusCode::kUnauthenticated);
  std::ofstream(path) << "# only a comment\n";
  EXPECT_EQ(ApiKeys::LoadFile(path).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ApiKeys::LoadFile(path + ".missing").ok());
}

TEST(ImageSniffTest, RecognisesCommonFormats) {
  EXPECT_EQ(SniffImageType("\xff\xd8\xff\xe0"), "image/jpeg");
  EXPECT_EQ(SniffImageType("\x89PNG\r\n\x1a\nrest"), "image/png");
  EXPECT_EQ(SniffImageType("RIFF1234WEBPVP8 "), "image/webp");
  EXPECT_EQ(SniffImageType("hello"), "");
}

}  // namespace
}  // namespace vlm::gateway

namespace vlm::gateway {
namespace {

TEST(OpenAiRequestTest, DeeplyNestedJsonIsRefusedWithoutCrashing) {
  // 1M levels in 2 MB: within the body limit; must not exhaust the stack.
  const std::string nested = std::string(1 << 20, '[') + std::string(1 << 20, ']');
  OpenAiChatRequest out;
  std::optional<ApiError> e = ParseChatCompletionRequest(nested, Options(), &out);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code, grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(e->message, "deeper than 32")) << e->message;
  // Brackets inside strings are text, not nesting.
  json body = Body();
  body["messages"][0]["content"] = std::string(100000, '[') + "\"{";
  EXPECT_EQ(ParseChatCompletionRequest(body.dump(), Options(), &out), std::nullopt);
}

TEST(CancellationTest, RunsTheRegisteredCallbackOnceAndLateRegistrationsAtOnce) {
  Cancellation c;
  int calls = 0;
  c.Register([&] { ++calls; });
  EXPECT_FALSE(c.cancelled());
  c.Cancel();
  c.Cancel();
  EXPECT_TRUE(c.cancelled());
  EXPECT_EQ(calls, 1);
  c.Unregister();
  int late = 0;
  c.Register([&] { ++late; });  // already cancelled: runs now
  EXPECT_EQ(late, 1);
  Cancellation quiet;
  quiet.Register([&] { ++calls; });
  quiet.Unregister();
  quiet.Cancel();
  EXPECT_EQ(calls, 1);
}

TEST(OpenAiRequestTest, NReachesTheRequestAndItsBoundErrorNamesN) {
  OpenAiChatRequest out;
  json body = Body();
  body["n"] = 4;
  ASSERT_EQ(Parse(body, &out), std::nullopt);
  EXPECT_EQ(out.request.n(), 4);
  OpenAiChatRequest absent;
  ASSERT_EQ(Parse(Body(), &absent), std::nullopt);
  EXPECT_EQ(absent.request.n(), 0);
  // The pipeline's bound (--max_n) comes back as a status naming n.
  const ApiError e = ApiErrorFromStatus(grpc::Status(
      grpc::StatusCode::INVALID_ARGUMENT, "n is 9; it must be between 1 and 8 (--max_n)"));
  EXPECT_EQ(e.param, "n");
  EXPECT_EQ(HttpStatusForCode(e.code), 400);
}

TEST(OpenAiResponseTest, SeveralChoicesCarryTheirIndexAndUsageComesOnceAtTheEnd) {
  ChunkFormatter f("chatcmpl-m", 1, "tiny", false, /*include_usage=*/true);
  f.set_tool_calls(true);
  EXPECT_EQ(json::parse(f.RoleChunk(2))["choices"][0]["index"], 2);
  v1::ChatChunk delta;
  delta.set_index(1);
  delta.set_text("one");
  EXPECT_EQ(json::parse(f.DeltaChunk(delta))["choices"][0]["index"], 1);
  v1::ChatChunk other;
  other.set_text("zero");
  const json zero = json::parse(f.DeltaChunk(other));
  EXPECT_EQ(zero["choices"][0]["index"], 0);
  EXPECT_EQ(zero["choices"][0]["delta"]["content"], "zero");  // each choice's own stream

  // A choice's end that is not the request's: its finish chunk only.
  v1::ChatChunk end0;
  end0.set_finish_reason(v1::FINISH_REASON_LENGTH);
  const std::vector<std::string> first = f.FinalChunks(end0);
  ASSERT_EQ(first.size(), 1u);
  const json finish0 = json::parse(first[0]);
  EXPECT_EQ(finish0["choices"][0]["index"], 0);
  EXPECT_EQ(finish0["choices"][0]["finish_reason"], "length");
  EXPECT_FALSE(finish0.contains("x_vlm"));
  EXPECT_TRUE(finish0["usage"].is_null());

  // The last choice's end carries the request's usage and each choice's own.
  v1::ChatChunk end1;
  end1.set_index(1);
  end1.set_text(" <tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>");
  end1.set_finish_reason(v1::FINISH_REASON_STOP);
  end1.mutable_usage()->set_prompt_tokens(10);
  end1.mutable_usage()->set_completion_tokens(7);
  end1.add_choice_usage()->set_completion_tokens(3);
  end1.add_choice_usage()->set_cached_prompt_tokens(10);
  std::string call_id;
  std::string finish1;
  json usage;
  for (const std::string& chunk : f.FinalChunks(end1)) {
    const json j = json::parse(chunk);
    if (j["choices"].empty()) {
      usage = j["usage"];
      continue;
    }
    EXPECT_EQ(j["choices"][0]["index"], 1);
    const json& d = j["choices"][0]["delta"];
    if (d.contains("tool_calls") && d["tool_calls"][0].contains("id")) {
      call_id = d["tool_calls"][0]["id"];
    }
    if (j["choices"][0]["finish_reason"].is_string()) {
      finish1 = j["choices"][0]["finish_reason"];
      ASSERT_EQ(j["x_vlm"]["choice_usage"].size(), 2u);
      EXPECT_EQ(j["x_vlm"]["choice_usage"][1]["prompt_tokens_details"]["cached_tokens"], 10);
    }
  }
  EXPECT_EQ(call_id, "call_m_c1_0");  // unique across choices
  EXPECT_EQ(finish1, "tool_calls");
  EXPECT_EQ(usage["total_tokens"], 17);

  // Non-streamed: one choice object per choice.
  v1::ChatResponse response;
  for (int i = 0; i < 3; ++i) {
    v1::ChatChoice* c = response.add_choices();
    c->set_index(i);
    c->set_text("answer " + std::to_string(i));
    c->set_finish_reason(i == 2 ? v1::FINISH_REASON_STOP : v1::FINISH_REASON_LENGTH);
    c->mutable_usage()->set_completion_tokens(i + 1);
  }
  response.set_text("answer 0");
  const json c = json::parse(ChunkFormatter("chatcmpl-n", 1, "tiny", false, false).Completion(response));
  ASSERT_EQ(c["choices"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(c["choices"][i]["index"], i);
    EXPECT_EQ(c["choices"][i]["message"]["content"], "answer " + std::to_string(i));
    EXPECT_EQ(c["x_vlm"]["choice_usage"][i]["completion_tokens"], i + 1);
  }
  EXPECT_EQ(c["choices"][2]["finish_reason"], "stop");
}

TEST(CollectingSinkTest, InterleavedChoicesAreGatheredPerIndex) {
  v1::ChatResponse response;
  CollectingSink sink(&response);
  auto chunk = [](int index, const char* text) {
    v1::ChatChunk c;
    c.set_index(index);
    c.set_text(text);
    return c;
  };
  for (v1::ChatChunk c : {chunk(0, "a"), chunk(1, "x"), chunk(0, "b"), chunk(1, "y")}) {
    ASSERT_TRUE(sink.OnDelta(c));
  }
  v1::ChatChunk end0 = chunk(0, "c");
  end0.set_finish_reason(v1::FINISH_REASON_LENGTH);
  ASSERT_TRUE(sink.OnFinal(end0));
  v1::ChatChunk end1 = chunk(1, "");
  end1.set_finish_reason(v1::FINISH_REASON_STOP);
  end1.mutable_usage()->set_completion_tokens(5);
  end1.add_choice_usage()->set_completion_tokens(3);
  end1.add_choice_usage()->set_completion_tokens(2);
  ASSERT_TRUE(sink.OnFinal(end1));
  ASSERT_EQ(response.choices_size(), 2);
  EXPECT_EQ(response.choices(0).text(), "abc");
  EXPECT_EQ(response.choices(1).text(), "xy");
  EXPECT_EQ(response.choices(1).index(), 1);
  EXPECT_EQ(response.choices(0).finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(response.choices(1).finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(response.choices(1).usage().completion_tokens(), 2);
  EXPECT_EQ(response.text(), "abc");  // choice 0 also at the top
  EXPECT_EQ(response.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(response.usage().completion_tokens(), 5);
}

}  // namespace
}  // namespace vlm::gateway
