#include "services/gateway/openai_protocol.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "services/gateway/http_status.h"

namespace vlm::gateway {
namespace {

using json = nlohmann::json;

ApiError Invalid(std::string param, std::string message) {
  ApiError e;
  e.code = grpc::StatusCode::INVALID_ARGUMENT;
  e.message = std::move(message);
  e.param = std::move(param);
  return e;
}

const char* TypeName(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::object: return "an object";
    case json::value_t::array: return "an array";
    case json::value_t::string: return "a string";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    case json::value_t::number_float: return "a number";
    default: return "an unknown value";
  }
}

ApiError WrongType(const std::string& param, const char* want, const json& got) {
  return Invalid(param, absl::StrCat(param, " must be ", want, ", not ", TypeName(got)));
}

// A field that is present and not null.
const json* Field(const json& object, const char* name) {
  auto it = object.find(name);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<ApiError> GetNumber(const json& body, const char* name, std::optional<float>* out) {
  const json* v = Field(body, name);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number()) return WrongType(name, "a number", *v);
  *out = v->get<float>();
  return std::nullopt;
}

std::optional<ApiError> GetInt(const json& body, const char* name, std::optional<int64_t>* out) {
  const json* v = Field(body, name);
  if (v == nullptr) return std::nullopt;
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    *out = u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
               ? std::numeric_limits<int64_t>::max()
               : static_cast<int64_t>(u);
    return std::nullopt;
  }
  if (!v->is_number_integer()) return WrongType(name, "an integer", *v);
  *out = v->get<int64_t>();
  return std::nullopt;
}

std::optional<ApiError> GetBool(const json& body, const char* name, bool* out) {
  const json* v = Field(body, name);
  if (v == nullptr) return std::nullopt;
  if (!v->is_boolean()) return WrongType(name, "a boolean", *v);
  *out = v->get<bool>();
  return std::nullopt;
}

// int32 fields: out of range is a 400, never a silent wrap.
std::optional<ApiError> ToInt32(const char* name, int64_t value, int32_t* out) {
  if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max()) {
    return Invalid(name, absl::StrCat(name, " is ", value, "; out of range"));
  }
  *out = static_cast<int32_t>(value);
  return std::nullopt;
}

// data:[<mediatype>][;base64],<data> -> image bytes.
std::optional<ApiError> DecodeDataUrl(const std::string& param, absl::string_view url,
                                      std::string* bytes) {
  const size_t comma = url.find(',');
  if (comma == absl::string_view::npos) {
    return Invalid(param, absl::StrCat(param, " is a malformed data URL (no ',')"));
  }
  const absl::string_view header = url.substr(5, comma - 5);  // after "data:"
  const absl::string_view payload = url.substr(comma + 1);
  const std::vector<absl::string_view> attributes = absl::StrSplit(header, ';');
  const std::string media_type = absl::AsciiStrToLower(attributes.empty() ? "" : attributes[0]);
  if (!absl::StartsWith(media_type, "image/")) {
    return Invalid(param, absl::StrCat(param, " is a data URL of type \"",
                                       media_type.empty() ? "text/plain" : media_type,
                                       "\"; only image data URLs (data:image/...;base64,...) "
                                       "are accepted"));
  }
  bool base64 = false;
  for (size_t i = 1; i < attributes.size(); ++i) {
    base64 |= absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(attributes[i]), "base64");
  }
  if (!base64) {
    return Invalid(param, absl::StrCat(param, " must be base64-encoded (data:", media_type,
                                       ";base64,...)"));
  }
  if (payload.empty()) return Invalid(param, absl::StrCat(param, " holds no image data"));
  if (!absl::Base64Unescape(payload, bytes) || bytes->empty()) {
    return Invalid(param, absl::StrCat(param, " is not valid base64"));
  }
  return std::nullopt;
}

// OpenAI's image_url.detail as a pixel budget for the vision service:
// "low" -> options.detail_low_max_pixels, "high" -> options.detail_high_max_pixels
// (the vision service lowers it to its --max_pixels_limit), "auto" or absent ->
// the vision service's default (--default_max_pixels).
std::optional<ApiError> ParseImageDetail(const json& image_url, const std::string& param,
                                         const ParseOptions& options, v1::ImageOptions* budget) {
  const json* detail = Field(image_url, "detail");
  if (detail == nullptr || detail->is_null()) return std::nullopt;
  if (!detail->is_string()) return WrongType(param, "a string", *detail);
  const std::string value = absl::AsciiStrToLower(detail->get<std::string>());
  if (value == "auto") return std::nullopt;
  if (value == "low") {
    budget->set_max_pixels(options.detail_low_max_pixels);
  } else if (value == "high") {
    budget->set_max_pixels(options.detail_high_max_pixels);
  } else {
    return Invalid(param, absl::StrCat(param, " is \"", detail->get<std::string>(),
                                       "\"; must be \"low\", \"high\" or \"auto\""));
  }
  return std::nullopt;
}

std::optional<ApiError> ParseContentPart(const json& part, const std::string& where,
                                         const ParseOptions& options, int message_index,
                                         v1::ChatMessage* message, OpenAiChatRequest* out) {
  if (!part.is_object()) return WrongType(where, "an object", part);
  const json* type = Field(part, "type");
  if (type == nullptr || !type->is_string()) {
    return Invalid(where + ".type", absl::StrCat(where, ".type must be \"text\" or \"image_url\""));
  }
  const std::string kind = type->get<std::string>();
  if (kind == "text") {
    const json* text = Field(part, "text");
    if (text == nullptr || !text->is_string()) {
      return WrongType(where + ".text", "a string", text ? *text : json());
    }
    message->add_content()->set_text(text->get<std::string>());
    return std::nullopt;
  }
  if (kind != "image_url") {
    return Invalid(where + ".type", absl::StrCat(where, ".type is \"", kind,
                                                 "\"; must be \"text\" or \"image_url\""));
  }
  const json* image = Field(part, "image_url");
  std::string param = where + ".image_url";
  const json* url = image;
  if (image != nullptr && image->is_object()) {
    url = Field(*image, "url");
    param += ".url";
  }
  if (url == nullptr || !url->is_string()) {
    return WrongType(param, "a string (an image URL)", url ? *url : json());
  }
  v1::ImageOptions budget;
  if (image != nullptr && image->is_object()) {
    if (auto e = ParseImageDetail(*image, where + ".image_url.detail", options, &budget)) return e;
  }
  const std::string& text = url->get_ref<const std::string&>();
  if (absl::StartsWithIgnoreCase(text, "data:")) {
    std::string bytes;
    if (auto e = DecodeDataUrl(param, text, &bytes)) return e;
    v1::ImagePart* part = message->add_content()->mutable_image();
    part->set_data(std::move(bytes));
    if (budget.max_pixels() != 0) *part->mutable_options() = budget;
    return std::nullopt;
  }
  if (absl::StartsWithIgnoreCase(text, "http://") || absl::StartsWithIgnoreCase(text, "https://")) {
    if (!options.allow_remote_images) {
      ApiError e = Invalid(param, absl::StrCat(param,
                                               " is a remote URL; this server does not fetch "
                                               "images (--allow_remote_images is off): send the "
                                               "image inline as data:image/...;base64,..."));
      e.error_code = "remote_images_disabled";
      return e;
    }
    RemoteImage remote;
    remote.message = message_index;
    remote.part = message->content_size();
    remote.url = text;
    remote.param = param;
    out->remote_images.push_back(std::move(remote));
    v1::ImagePart* part = message->add_content()->mutable_image();  // filled by the front end
    if (budget.max_pixels() != 0) *part->mutable_options() = budget;
    return std::nullopt;
  }
  return Invalid(param, absl::StrCat(param, " must be a data:image/...;base64 URL",
                                     options.allow_remote_images ? " or an http(s) URL" : ""));
}

std::optional<ApiError> ParseMessages(const json& body, const ParseOptions& options,
                                      OpenAiChatRequest* out) {
  const json* messages = Field(body, "messages");
  if (messages == nullptr) return Invalid("messages", "messages is required");
  if (!messages->is_array()) return WrongType("messages", "an array", *messages);
  if (messages->empty()) return Invalid("messages", "messages must not be empty");
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    const std::string where = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return WrongType(where, "an object", m);
    const json* role = Field(m, "role");
    if (role == nullptr || !role->is_string()) {
      return WrongType(where + ".role", "a string", role ? *role : json());
    }
    std::string name = role->get<std::string>();
    if (name == "developer") name = "system";  // OpenAI's newer name for system
    if (name == "tool" || name == "function") {
      return Invalid(where + ".role", absl::StrCat(where, ".role \"", name,
                                                   "\" is not supported (no tool calling)"));
    }
    if (name != "system" && name != "user" && name != "assistant") {
      return Invalid(where + ".role",
                     absl::StrCat(where, ".role is \"", name,
                                  "\"; must be one of system, developer, user, assistant"));
    }
    if (Field(m, "tool_calls") != nullptr && !(*Field(m, "tool_calls")).empty()) {
      return Invalid(where + ".tool_calls", "tool calls are not supported");
    }
    v1::ChatMessage* message = out->request.add_messages();
    message->set_role(name);
    const json* content = Field(m, "content");
    const std::string content_where = where + ".content";
    if (content == nullptr) {
      return Invalid(content_where, absl::StrCat(content_where, " is required"));
    }
    if (content->is_string()) {
      message->add_content()->set_text(content->get<std::string>());
    } else if (content->is_array()) {
      for (size_t j = 0; j < content->size(); ++j) {
        if (auto e = ParseContentPart((*content)[j], absl::StrCat(content_where, "[", j, "]"),
                                      options, static_cast<int>(i), message, out)) {
          return e;
        }
      }
    } else {
      return WrongType(content_where, "a string or an array of content parts", *content);
    }
  }
  return std::nullopt;
}

// Proto field names in validation messages -> OpenAI parameter names.
struct Rename {
  const char* proto;
  const char* openai;
};
constexpr Rename kRenames[] = {
    {"params.sampling.temperature", "temperature"},
    {"params.sampling.top_k", "top_k"},
    {"params.sampling.top_p", "top_p"},
    {"params.sampling.min_p", "min_p"},
    {"params.sampling.repetition_penalty", "repetition_penalty"},
    {"params.sampling.presence_penalty", "presence_penalty"},
    {"params.sampling.frequency_penalty", "frequency_penalty"},
    {"params.max_tokens", "max_tokens"},
    {"params.top_logprobs", "top_logprobs"},
    {"params.stop", "stop"},
};

}  // namespace

ApiError ApiErrorFromStatus(const grpc::Status& status, const v1::ChatRequest* request) {
  ApiError e;
  e.code = status.error_code();
  e.message = status.error_message();
  if (e.code == grpc::StatusCode::INVALID_ARGUMENT) {
    for (const Rename& r : kRenames) {
      if (absl::StartsWith(e.message, r.proto)) {
        e.message = absl::StrCat(r.openai, e.message.substr(std::string_view(r.proto).size()));
        e.param = r.openai;
        break;
      }
    }
    if (e.param.empty()) {
      if (absl::StartsWith(e.message, "messages[")) {
        e.param = e.message.substr(0, e.message.find_first_of(" :"));
      } else if (int n = 0; request != nullptr && absl::StartsWith(e.message, "image ") &&
                            absl::SimpleAtoi(absl::string_view(e.message).substr(6).substr(
                                                 0, e.message.find_first_of(" :", 6) - 6),
                                             &n)) {
        e.param = "messages";
        int seen = 0;
        for (int i = 0; i < request->messages_size(); ++i) {
          for (int j = 0; j < request->messages(i).content_size(); ++j) {
            if (request->messages(i).content(j).has_image() && ++seen == n) {
              e.param = absl::StrCat("messages[", i, "].content[", j, "].image_url.url");
            }
          }
        }
      } else if (absl::StartsWith(e.message, "image ") || absl::StartsWith(e.message, "request has") ||
                 absl::StartsWith(e.message, "text is")) {
        e.param = "messages";
      }
    }
  }
  if (e.code == grpc::StatusCode::UNAUTHENTICATED) e.error_code = "invalid_api_key";
  if (e.code == grpc::StatusCode::RESOURCE_EXHAUSTED) e.error_code = "rate_limit_exceeded";
  return e;
}

std::string DumpJson(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string ErrorJson(const ApiError& error) {
  json e = {{"message", error.message},
            {"type", OpenAiErrorType(error.code)},
            {"param", error.param.empty() ? json() : json(error.param)},
            {"code", error.error_code.empty() ? json() : json(error.error_code)}};
  return DumpJson(json{{"error", std::move(e)}});
}

// The deepest nesting of arrays and objects in `text` (outside strings), up
// to `limit` + 1. The JSON parser recurses per level: a body of a million
// brackets would exhaust the stack, so depth is checked before parsing.
int NestingDepth(std::string_view text, int limit) {
  int depth = 0;
  int deepest = 0;
  bool in_string = false;
  bool escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) return deepest;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

// max_tokens / max_completion_tokens, sampling, stop strings, logprobs and
// ignore_eos into out->request.params.
std::optional<ApiError> ParseGenerationParams(const json& body, OpenAiChatRequest* out) {
  v1::GenerationParams* params = out->request.mutable_params();
  v1::SamplingParams* sampling = params->mutable_sampling();

  std::optional<int64_t> max_tokens, max_completion_tokens, top_k, seed, top_logprobs;
  if (auto e = GetInt(body, "max_tokens", &max_tokens)) return e;
  if (auto e = GetInt(body, "max_completion_tokens", &max_completion_tokens)) return e;
  if (max_completion_tokens || max_tokens) {
    const char* name = max_completion_tokens ? "max_completion_tokens" : "max_tokens";
    int32_t value = 0;
    if (auto e = ToInt32(name, max_completion_tokens ? *max_completion_tokens : *max_tokens, &value)) {
      return e;
    }
    if (value < 1) return Invalid(name, absl::StrCat(name, " is ", value, "; must be >= 1"));
    params->set_max_tokens(value);
  }

  struct FloatField {
    const char* name;
    void (v1::SamplingParams::*set)(float);
  };
  const FloatField floats[] = {
      {"temperature", &v1::SamplingParams::set_temperature},
      {"top_p", &v1::SamplingParams::set_top_p},
      {"min_p", &v1::SamplingParams::set_min_p},
      {"presence_penalty", &v1::SamplingParams::set_presence_penalty},
      {"frequency_penalty", &v1::SamplingParams::set_frequency_penalty},
      {"repetition_penalty", &v1::SamplingParams::set_repetition_penalty},
  };
  for (const FloatField& f : floats) {
    std::optional<float> number;
    if (auto e = GetNumber(body, f.name, &number)) return e;
    if (number) (sampling->*f.set)(*number);
  }
  if (auto e = GetInt(body, "top_k", &top_k)) return e;
  if (top_k) {
    int32_t value = 0;
    if (auto e = ToInt32("top_k", *top_k, &value)) return e;
    sampling->set_top_k(value == -1 ? 0 : value);  // -1: disabled (vLLM's convention)
  }
  if (auto e = GetInt(body, "seed", &seed)) return e;
  if (seed) sampling->set_seed(static_cast<uint64_t>(*seed));

  if (const json* stop = Field(body, "stop")) {
    if (stop->is_string()) {
      params->add_stop(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (size_t i = 0; i < stop->size(); ++i) {
        if (!(*stop)[i].is_string()) {
          return WrongType(absl::StrCat("stop[", i, "]"), "a string", (*stop)[i]);
        }
        params->add_stop((*stop)[i].get<std::string>());
      }
    } else {
      return WrongType("stop", "a string or an array of strings", *stop);
    }
  }

  if (auto e = GetBool(body, "logprobs", &out->logprobs)) return e;
  if (auto e = GetInt(body, "top_logprobs", &top_logprobs)) return e;
  if (top_logprobs) {
    if (!out->logprobs) return Invalid("top_logprobs", "top_logprobs requires logprobs: true");
    int32_t value = 0;
    if (auto e = ToInt32("top_logprobs", *top_logprobs, &value)) return e;
    params->set_top_logprobs(value);
  }
  params->set_logprobs(out->logprobs);

  bool ignore_eos = false;
  if (auto e = GetBool(body, "ignore_eos", &ignore_eos)) return e;
  params->set_ignore_eos(ignore_eos);

  return std::nullopt;
}

std::optional<ApiError> ParseChatCompletionRequest(std::string_view body_text,
                                                   const ParseOptions& options,
                                                   OpenAiChatRequest* out) {
  constexpr int kMaxDepth = 32;  // a chat request needs 6
  if (NestingDepth(body_text, kMaxDepth) > kMaxDepth) {
    ApiError error = Invalid("", absl::StrCat("the request body nests arrays or objects deeper "
                                              "than ", kMaxDepth, " levels"));
    error.error_code = "invalid_json";
    return error;
  }
  json body;
  try {
    body = json::parse(body_text);
  } catch (const json::parse_error& e) {
    ApiError error = Invalid("", absl::StrCat("the request body is not valid JSON: ", e.what()));
    error.error_code = "invalid_json";
    return error;
  }
  if (!body.is_object()) return Invalid("", "the request body must be a JSON object");

  if (const json* model = Field(body, "model")) {
    if (!model->is_string()) return WrongType("model", "a string", *model);
    out->model = model->get<std::string>();
    if (out->model != options.served_model_name) {
      ApiError e;
      e.code = grpc::StatusCode::NOT_FOUND;
      e.message = absl::StrCat("the model \"", out->model, "\" does not exist; this server serves \"",
                               options.served_model_name, "\" (GET /v1/models)");
      e.param = "model";
      e.error_code = "model_not_found";
      return e;
    }
  } else {
    out->model = options.served_model_name;
  }
  if (auto e = ParseMessages(body, options, out)) return e;

  if (auto e = ParseGenerationParams(body, out)) return e;

  std::optional<int64_t> n;
  if (auto e = GetInt(body, "n", &n)) return e;
  if (n && *n != 1) return Invalid("n", absl::StrCat("n is ", *n, "; only n=1 is supported"));
  for (const char* name : {"tools", "functions"}) {
    const json* v = Field(body, name);
    if (v != nullptr && !(v->is_array() && v->empty())) {
      return Invalid(name, absl::StrCat(name, " are not supported (no tool calling)"));
    }
  }
  if (const json* format = Field(body, "response_format")) {
    const json* type = format->is_object() ? Field(*format, "type") : nullptr;
    if (type == nullptr || *type != "text") {
      return Invalid("response_format", "only response_format {\"type\": \"text\"} is supported");
    }
  }

  if (auto e = GetBool(body, "stream", &out->stream)) return e;
  if (const json* stream_options = Field(body, "stream_options")) {
    if (!out->stream) {
      return Invalid("stream_options", "stream_options is only allowed when stream is true");
    }
    if (!stream_options->is_object()) {
      return WrongType("stream_options", "an object", *stream_options);
    }
    if (auto e = GetBool(*stream_options, "include_usage", &out->include_usage)) {
      e->param = "stream_options.include_usage";
      e->message = "stream_options." + e->message;
      return e;
    }
  }
  return std::nullopt;
}

std::string SniffImageType(std::string_view bytes) {
  const absl::string_view b(bytes.data(), bytes.size());
  if (b.size() >= 3 && static_cast<unsigned char>(b[0]) == 0xFF &&
      static_cast<unsigned char>(b[1]) == 0xD8 && static_cast<unsigned char>(b[2]) == 0xFF) {
    return "image/jpeg";
  }
  if (absl::StartsWith(b, "\x89PNG\r\n\x1a\n")) return "image/png";
  if (b.size() >= 12 && absl::StartsWith(b, "RIFF") && b.substr(8, 4) == "WEBP") {
    return "image/webp";
  }
  return "";
}

const char* FinishReasonName(v1::FinishReason reason) {
  return reason == v1::FINISH_REASON_LENGTH ? "length" : "stop";
}

json UsageJson(const v1::Usage& usage) {
  const int total = usage.total_tokens() != 0 ? usage.total_tokens()
                                              : usage.prompt_tokens() + usage.completion_tokens();
  return json{{"prompt_tokens", usage.prompt_tokens()},
              {"completion_tokens", usage.completion_tokens()},
              {"total_tokens", total},
              {"prompt_tokens_details", {{"cached_tokens", usage.cached_prompt_tokens()}}}};
}

namespace {

json Bytes(const std::string& text) {
  json bytes = json::array();
  for (unsigned char c : text) bytes.push_back(static_cast<int>(c));
  return bytes;
}

const char* CacheName(v1::CacheLevel level) {
  switch (level) {
    case v1::CACHE_LEVEL_MISS: return "miss";
    case v1::CACHE_LEVEL_MEMORY: return "memory";
    case v1::CACHE_LEVEL_PIXELS: return "pixels";
    case v1::CACHE_LEVEL_DISK: return "disk";
    default: return "unspecified";
  }
}

// The gateway's own extras (x_vlm): what the page shows under an answer.
json Extras(const std::string& request_id, const v1::Usage& usage, const v1::ChatTimings& t,
            const google::protobuf::RepeatedPtrField<v1::ImageResult>& images,
            const v1::LanguageRoute& language) {
  json list = json::array();
  for (const v1::ImageResult& image : images) {
    list.push_back({{"content_hash", image.content_hash()},
                    {"cache", CacheName(image.cache())},
                    {"cache_hit", image.cache() != v1::CACHE_LEVEL_MISS &&
                                      image.cache() != v1::CACHE_LEVEL_UNSPECIFIED},
                    {"grid", {image.grid().t(), image.grid().h(), image.grid().w()}},
                    {"tokens", image.tokens()},
                    {"vision_ms", image.vision_ms()},
                    {"replica", image.replica()},
                    {"max_pixels", image.budget().max_pixels()},
                    {"min_pixels", image.budget().min_pixels()}});
  }
  return json{{"request_id", request_id},
              {"image_tokens", usage.image_tokens()},
              {"timings_ms",
               {{"queue", t.queue_ms()},
                {"vision", t.vision_ms()},
                {"projector", t.projector_ms()},
                {"prefill", t.prefill_ms()},
                {"first_token", t.first_token_ms()},
                {"decode", t.decode_ms()},
                {"total", t.total_ms()}}},
              {"images", std::move(list)},
              {"language",
               {{"replica", language.replica()},
                {"route", language.route()},
                {"attempts", language.attempts()}}}};
}

}  // namespace

json LogprobsJson(const google::protobuf::RepeatedPtrField<v1::TokenLogprob>& logprobs) {
  json content = json::array();
  for (const v1::TokenLogprob& lp : logprobs) {
    json top = json::array();
    for (const v1::TopLogprob& t : lp.top()) {
      top.push_back({{"token", t.token()}, {"logprob", t.logprob()}, {"bytes", Bytes(t.token())}});
    }
    content.push_back({{"token", lp.token()},
                       {"logprob", lp.logprob()},
                       {"bytes", Bytes(lp.token())},
                       {"top_logprobs", std::move(top)}});
  }
  return json{{"content", std::move(content)}, {"refusal", nullptr}};
}

ChunkFormatter::ChunkFormatter(std::string id, int64_t created, std::string model, bool logprobs,
                               bool include_usage)
    : id_(std::move(id)),
      created_(created),
      model_(std::move(model)),
      logprobs_(logprobs),
      include_usage_(include_usage) {}

json ChunkFormatter::ChunkBase() const {
  json chunk = {{"id", id_},
                {"object", "chat.completion.chunk"},
                {"created", created_},
                {"model", model_},
                {"choices", json::array()}};
  if (include_usage_) chunk["usage"] = nullptr;
  return chunk;
}

std::string ChunkFormatter::RoleChunk() const {
  json chunk = ChunkBase();
  chunk["choices"].push_back({{"index", 0},
                              {"delta", {{"role", "assistant"}, {"content", ""}}},
                              {"logprobs", nullptr},
                              {"finish_reason", nullptr}});
  return DumpJson(chunk);
}

std::string ChunkFormatter::DeltaChunk(const v1::ChatChunk& delta) const {
  json chunk = ChunkBase();
  chunk["choices"].push_back(
      {{"index", 0},
       {"delta", {{"content", delta.text()}}},
       {"logprobs", logprobs_ ? LogprobsJson(delta.logprobs()) : json()},
       {"finish_reason", nullptr}});
  return DumpJson(chunk);
}

std::vector<std::string> ChunkFormatter::FinalChunks(const v1::ChatChunk& last) const {
  std::vector<std::string> out;
  if (!last.text().empty() || last.logprobs_size() > 0) out.push_back(DeltaChunk(last));
  json finish = ChunkBase();
  finish["choices"].push_back({{"index", 0},
                               {"delta", json::object()},
                               {"logprobs", nullptr},
                               {"finish_reason", FinishReasonName(last.finish_reason())}});
  finish["x_vlm"] =
      Extras(last.request_id(), last.usage(), last.timings(), last.images(), last.language());
  out.push_back(DumpJson(finish));
  if (include_usage_) {
    json usage = ChunkBase();
    usage["usage"] = UsageJson(last.usage());
    out.push_back(DumpJson(usage));
  }
  return out;
}

std::string ChunkFormatter::Completion(const v1::ChatResponse& r) const {
  json completion = {
      {"id", id_},
      {"object", "chat.completion"},
      {"created", created_},
      {"model", model_},
      {"choices",
       json::array({{{"index", 0},
                     {"message",
                      {{"role", "assistant"}, {"content", r.text()}, {"refusal", nullptr}}},
                     {"logprobs", logprobs_ ? LogprobsJson(r.logprobs()) : json()},
                     {"finish_reason", FinishReasonName(r.finish_reason())}}})},
      {"usage", UsageJson(r.usage())},
      {"x_vlm", Extras(r.request_id(), r.usage(), r.timings(), r.images(), r.language())}};
  return DumpJson(completion);
}

}  // namespace vlm::gateway
