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
#include "services/gateway/chat_pipeline.h"
#include "services/gateway/http_status.h"
#include "services/gateway/tool_calls.h"

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

// An assistant message's tool_calls: [{id, type: "function", function:
// {name, arguments (a JSON string)}}].
std::optional<ApiError> ParseToolCalls(const json& calls, const std::string& where,
                                       const std::string& role, v1::ChatMessage* message) {
  if (!calls.is_array()) return WrongType(where, "an array", calls);
  if (calls.empty()) return std::nullopt;
  if (role != "assistant") {
    return Invalid(where, absl::StrCat(where, " is allowed on assistant messages only"));
  }
  for (size_t k = 0; k < calls.size(); ++k) {
    const std::string at = absl::StrCat(where, "[", k, "]");
    const json& c = calls[k];
    if (!c.is_object()) return WrongType(at, "an object", c);
    const json* function = Field(c, "function");
    if (function == nullptr || !function->is_object()) {
      return WrongType(at + ".function", "an object", function ? *function : json());
    }
    const json* name = Field(*function, "name");
    if (name == nullptr || !name->is_string()) {
      return WrongType(at + ".function.name", "a string", name ? *name : json());
    }
    const json* arguments = Field(*function, "arguments");
    std::string args = "{}";
    if (arguments != nullptr) {
      if (!arguments->is_string()) return WrongType(at + ".function.arguments", "a string", *arguments);
      args = arguments->get<std::string>();
      if (!json::accept(args)) {
        return Invalid(at + ".function.arguments",
                       absl::StrCat(at, ".function.arguments is not JSON text"));
      }
    }
    v1::ToolCall* call = message->add_tool_calls();
    if (const json* id = Field(c, "id"); id != nullptr && id->is_string()) {
      call->set_id(id->get<std::string>());
    }
    call->set_name(name->get<std::string>());
    call->set_arguments(std::move(args));
  }
  return std::nullopt;
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
    if (name == "function") {
      return Invalid(where + ".role", absl::StrCat(where, ".role \"function\" (the legacy "
                                                   "functions API) is not supported; use tools"));
    }
    if (name != "system" && name != "user" && name != "assistant" && name != "tool") {
      return Invalid(where + ".role",
                     absl::StrCat(where, ".role is \"", name,
                                  "\"; must be one of system, developer, user, assistant, tool"));
    }
    v1::ChatMessage* message = out->request.add_messages();
    message->set_role(name);
    if (const json* calls = Field(m, "tool_calls")) {
      if (auto e = ParseToolCalls(*calls, where + ".tool_calls", name, message)) return e;
    }
    if (name == "tool") {
      const json* id = Field(m, "tool_call_id");
      if (id == nullptr || !id->is_string()) {
        return WrongType(where + ".tool_call_id", "a string", id ? *id : json());
      }
      message->set_tool_call_id(id->get<std::string>());
    }
    const json* content = Field(m, "content");
    const std::string content_where = where + ".content";
    if (content == nullptr && message->tool_calls_size() > 0) continue;  // a call without text
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
    {"params.json_schema", "response_format"},
    {"params.json_object", "response_format"},
    {"params.constraint", "response_format"},
    {"tool_choice.function", "tool_choice"},
    {"tool_choice", "tool_choice"},
};

}  // namespace

ApiError ApiErrorFromStatus(const grpc::Status& status, const v1::ChatRequest* request) {
  ApiError e;
  e.code = status.error_code();
  e.message = status.error_message();
  if (e.code == grpc::StatusCode::INVALID_ARGUMENT) {
    // The language service's own validation (schemas, tools) comes prefixed
    // by the backend's name; the field it names leads once that is dropped.
    constexpr absl::string_view kLanguage = "language service: ";
    if (absl::StartsWith(e.message, kLanguage)) {
      const std::string rest = e.message.substr(kLanguage.size());
      for (const char* field : {"params.json_schema", "params.json_object", "params.constraint",
                                "params.regex", "tools[", "tool_choice"}) {
        if (absl::StartsWith(rest, field)) e.message = rest;
      }
    }
    for (const Rename& r : kRenames) {
      if (absl::StartsWith(e.message, r.proto)) {
        e.message = absl::StrCat(r.openai, e.message.substr(std::string_view(r.proto).size()));
        e.param = r.openai;
        break;
      }
    }
    if (e.param.empty() && absl::StartsWith(e.message, "n is ")) e.param = "n";
    if (e.param.empty()) {
      if (absl::StartsWith(e.message, "messages[") || absl::StartsWith(e.message, "tools")) {
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

// tools: [{type: "function", function: {name, description?, parameters?,
// strict?}}]; tool_choice: "none" | "auto" | "required" |
// {type: "function", function: {name}}; parallel_tool_calls is accepted (a
// required or named choice yields one call).
std::optional<ApiError> ParseTools(const json& body, const nlohmann::ordered_json& ordered,
                                   OpenAiChatRequest* out) {
  const json* tools = Field(body, "tools");
  if (tools != nullptr) {
    if (!tools->is_array()) return WrongType("tools", "an array", *tools);
    for (size_t i = 0; i < tools->size(); ++i) {
      const std::string at = absl::StrCat("tools[", i, "]");
      const json& t = (*tools)[i];
      if (!t.is_object()) return WrongType(at, "an object", t);
      const json* type = Field(t, "type");
      if (type == nullptr || *type != "function") {
        return Invalid(at + ".type", absl::StrCat(at, ".type must be \"function\""));
      }
      const json* function = Field(t, "function");
      if (function == nullptr || !function->is_object()) {
        return WrongType(at + ".function", "an object", function ? *function : json());
      }
      const json* name = Field(*function, "name");
      if (name == nullptr || !name->is_string()) {
        return WrongType(at + ".function.name", "a string", name ? *name : json());
      }
      v1::Tool* tool = out->request.add_tools();
      tool->set_name(name->get<std::string>());
      if (const json* d = Field(*function, "description")) {
        if (!d->is_string()) return WrongType(at + ".function.description", "a string", *d);
        tool->set_description(d->get<std::string>());
      }
      if (const json* p = Field(*function, "parameters")) {
        if (!p->is_object()) return WrongType(at + ".function.parameters", "an object", *p);
        tool->set_parameters(ordered.at("tools").at(i).at("function").at("parameters").dump());
      }
    }
  }
  bool parallel = true;
  if (auto e = GetBool(body, "parallel_tool_calls", &parallel)) return e;
  v1::ToolChoice* choice = out->request.mutable_tool_choice();
  const json* tool_choice = Field(body, "tool_choice");
  const bool has_tools = out->request.tools_size() > 0;
  if (tool_choice == nullptr) {
    choice->set_mode(has_tools ? v1::TOOL_CHOICE_AUTO : v1::TOOL_CHOICE_NONE);
  } else if (tool_choice->is_string()) {
    const std::string mode = tool_choice->get<std::string>();
    if (mode == "none") {
      choice->set_mode(v1::TOOL_CHOICE_NONE);
    } else if (mode == "auto") {
      choice->set_mode(has_tools ? v1::TOOL_CHOICE_AUTO : v1::TOOL_CHOICE_NONE);
    } else if (mode == "required") {
      choice->set_mode(v1::TOOL_CHOICE_REQUIRED);
    } else {
      return Invalid("tool_choice", absl::StrCat("tool_choice is \"", mode,
                                                 "\"; must be none, auto, required or "
                                                 "{\"type\": \"function\", ...}"));
    }
  } else if (tool_choice->is_object()) {
    const json* function = Field(*tool_choice, "function");
    const json* name = function && function->is_object() ? Field(*function, "name") : nullptr;
    if (name == nullptr || !name->is_string()) {
      return WrongType("tool_choice.function.name", "a string", name ? *name : json());
    }
    choice->set_mode(v1::TOOL_CHOICE_FUNCTION);
    choice->set_function(name->get<std::string>());
  } else {
    return WrongType("tool_choice", "a string or an object", *tool_choice);
  }
  if (!has_tools && choice->mode() != v1::TOOL_CHOICE_NONE) {
    return Invalid("tool_choice", "tool_choice requires tools");
  }
  out->tool_calls = has_tools && choice->mode() != v1::TOOL_CHOICE_NONE;
  return std::nullopt;
}

// response_format: {type: "text"} | {type: "json_object"} |
// {type: "json_schema", json_schema: {name, description?, schema, strict?}}.
// The output is constrained whether or not strict is set.
std::optional<ApiError> ParseResponseFormat(const json& body, const nlohmann::ordered_json& ordered,
                                            OpenAiChatRequest* out) {
  const json* format = Field(body, "response_format");
  if (format == nullptr) return std::nullopt;
  if (!format->is_object()) return WrongType("response_format", "an object", *format);
  const json* type = Field(*format, "type");
  if (type == nullptr || !type->is_string()) {
    return WrongType("response_format.type", "a string", type ? *type : json());
  }
  v1::GenerationParams* params = out->request.mutable_params();
  const std::string kind = type->get<std::string>();
  if (kind == "text") return std::nullopt;
  if (kind == "json_object") {
    params->set_json_object(true);
  } else if (kind == "json_schema") {
    const json* spec = Field(*format, "json_schema");
    if (spec == nullptr || !spec->is_object()) {
      return WrongType("response_format.json_schema", "an object", spec ? *spec : json());
    }
    const json* name = Field(*spec, "name");
    if (name == nullptr || !name->is_string()) {
      return WrongType("response_format.json_schema.name", "a string", name ? *name : json());
    }
    const json* schema = Field(*spec, "schema");
    if (schema == nullptr || !schema->is_object()) {
      return WrongType("response_format.json_schema.schema", "an object",
                       schema ? *schema : json());
    }
    bool strict = false;
    if (auto e = GetBool(*spec, "strict", &strict)) {
      e->param = "response_format.json_schema.strict";
      e->message = "response_format.json_schema." + e->message;
      return e;
    }
    params->set_json_schema(ordered.at("response_format").at("json_schema").at("schema").dump());
  } else {
    return Invalid("response_format.type",
                   absl::StrCat("response_format.type is \"", kind,
                                "\"; must be text, json_object or json_schema"));
  }
  const v1::ToolChoiceMode mode = out->request.tool_choice().mode();
  if (mode == v1::TOOL_CHOICE_REQUIRED || mode == v1::TOOL_CHOICE_FUNCTION) {
    return Invalid("response_format", "response_format cannot be combined with tool_choice "
                                      "required or a named function");
  }
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
  if (n && *n < 1) return Invalid("n", absl::StrCat("n is ", *n, "; it must be at least 1"));
  // The upper bound is the gateway's --max_n (ChatPipeline); beyond int32 is out anyway.
  if (n) out->request.set_n(static_cast<int32_t>(std::min<int64_t>(*n, 1 << 30)));
  if (const json* v = Field(body, "functions"); v != nullptr && !(v->is_array() && v->empty())) {
    return Invalid("functions", "functions (the legacy functions API) are not supported; use tools");
  }
  if (Field(body, "tools") != nullptr || Field(body, "response_format") != nullptr ||
      Field(body, "tool_choice") != nullptr) {
    // Schemas keep the client's key order (property order is output order),
    // so they are taken from an order-preserving parse of the same body.
    const nlohmann::ordered_json ordered =
        nlohmann::ordered_json::parse(body_text, nullptr, /*allow_exceptions=*/false);
    if (auto e = ParseTools(body, ordered, out)) return e;
    if (auto e = ParseResponseFormat(body, ordered, out)) return e;
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

// The gateway's own extras (x_vlm): what the page shows under an answer.
json Extras(const std::string& request_id, const v1::Usage& usage, const v1::ChatTimings& t,
            const google::protobuf::RepeatedPtrField<v1::ImageResult>& images,
            const v1::LanguageRoute& language) {
  json list = json::array();
  for (const v1::ImageResult& image : images) {
    list.push_back({{"content_hash", image.content_hash()},
                    {"cache", CacheLevelName(image.cache())},
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

std::string ChunkFormatter::RoleChunk(int index) const {
  json chunk = ChunkBase();
  chunk["choices"].push_back({{"index", index},
                              {"delta", {{"role", "assistant"}, {"content", ""}}},
                              {"logprobs", nullptr},
                              {"finish_reason", nullptr}});
  return DumpJson(chunk);
}

json ChunkFormatter::DeltaJson(int index, const json& delta,
                               const google::protobuf::RepeatedPtrField<v1::TokenLogprob>* logprobs,
                               const char* finish_reason) const {
  json chunk = ChunkBase();
  chunk["choices"].push_back(
      {{"index", index},
       {"delta", delta},
       {"logprobs", logprobs_ && logprobs != nullptr ? LogprobsJson(*logprobs) : json()},
       {"finish_reason", finish_reason == nullptr ? json() : json(finish_reason)}});
  return chunk;
}

std::string ChunkFormatter::ReleaseContent(int index, const std::string& text) const {
  static const std::string kOpen("<tool_call>");
  std::string& streamed = streams_[index].text;
  size_t& released = streams_[index].released;
  streamed += text;
  if (streamed.find(kOpen) != std::string::npos) {
    // A block started: content ends before it (whitespace before it held).
    size_t end = streamed.find(kOpen);
    while (end > released && absl::ascii_isspace(static_cast<unsigned char>(streamed[end - 1]))) {
      --end;
    }
    std::string out = end > released ? streamed.substr(released, end - released) : "";
    released = std::max(released, end);
    return out;
  }
  // Hold trailing whitespace and any tail that may grow into "<tool_call>".
  size_t end = streamed.size();
  for (size_t k = std::min(kOpen.size() - 1, streamed.size()); k > 0; --k) {
    if (absl::EndsWith(streamed, absl::string_view(kOpen).substr(0, k))) {
      end = streamed.size() - k;
      break;
    }
  }
  while (end > released && absl::ascii_isspace(static_cast<unsigned char>(streamed[end - 1]))) {
    --end;
  }
  std::string out = end > released ? streamed.substr(released, end - released) : "";
  released = std::max(released, end);
  return out;
}

std::string ChunkFormatter::DeltaChunk(const v1::ChatChunk& delta) const {
  const std::string content =
      tool_calls_ ? ReleaseContent(delta.index(), delta.text()) : delta.text();
  return DumpJson(DeltaJson(delta.index(), {{"content", content}}, &delta.logprobs(), nullptr));
}

namespace {

json ToolCallsJson(const std::vector<v1::ToolCall>& calls) {
  json list = json::array();
  for (const v1::ToolCall& c : calls) {
    list.push_back({{"id", c.id()},
                    {"type", "function"},
                    {"function", {{"name", c.name()}, {"arguments", c.arguments()}}}});
  }
  return list;
}

}  // namespace

std::vector<std::string> ChunkFormatter::FinalChunks(const v1::ChatChunk& last) const {
  std::vector<std::string> out;
  const char* finish = FinishReasonName(last.finish_reason());
  const int index = last.index();
  if (!tool_calls_) {
    if (!last.text().empty() || last.logprobs_size() > 0) out.push_back(DeltaChunk(last));
  } else {
    std::string& streamed = streams_[index].text;
    size_t& released = streams_[index].released;
    streamed += last.text();
    const ParsedToolCalls parsed = ParseToolCallText(streamed, CallIdPrefix(index));
    // Content not yet sent: the held tail, or everything held when the blocks
    // turned out not to be calls.
    const std::string& content = parsed.calls.empty() ? streamed : parsed.content;
    if (content.size() > released || last.logprobs_size() > 0) {
      const std::string rest = content.size() > released ? content.substr(released) : "";
      out.push_back(DumpJson(DeltaJson(index, {{"content", rest}}, &last.logprobs(), nullptr)));
    }
    released = streamed.size();
    for (size_t i = 0; i < parsed.calls.size(); ++i) {
      const v1::ToolCall& c = parsed.calls[i];
      out.push_back(DumpJson(DeltaJson(
          index, {{"tool_calls", json::array({{{"index", i},
                                        {"id", c.id()},
                                        {"type", "function"},
                                        {"function", {{"name", c.name()}, {"arguments", ""}}}}})}},
          nullptr, nullptr)));
      out.push_back(DumpJson(DeltaJson(
          index,
          {{"tool_calls",
            json::array({{{"index", i}, {"function", {{"arguments", c.arguments()}}}}})}},
          nullptr, nullptr)));
    }
    if (!parsed.calls.empty() && last.finish_reason() == v1::FINISH_REASON_STOP) {
      finish = "tool_calls";
    }
  }
  json finish_chunk = ChunkBase();
  finish_chunk["choices"].push_back({{"index", index},
                               {"delta", json::object()},
                               {"logprobs", nullptr},
                               {"finish_reason", finish}});
  // Only the request's last final chunk has usage (the others end one choice).
  if (!last.has_usage()) {
    out.push_back(DumpJson(finish_chunk));
    return out;
  }
  finish_chunk["x_vlm"] =
      Extras(last.request_id(), last.usage(), last.timings(), last.images(), last.language());
  if (last.choice_usage_size() > 0) {
    json list = json::array();
    for (const v1::Usage& u : last.choice_usage()) list.push_back(UsageJson(u));
    finish_chunk["x_vlm"]["choice_usage"] = std::move(list);
  }
  out.push_back(DumpJson(finish_chunk));
  if (include_usage_) {
    json usage = ChunkBase();
    usage["usage"] = UsageJson(last.usage());
    out.push_back(DumpJson(usage));
  }
  return out;
}

std::string ChunkFormatter::CallIdPrefix(int index) const {
  std::string id = id_;
  if (absl::StartsWith(id, "chatcmpl-")) id = id.substr(9);
  return ToolCallIdPrefix(id, index);
}

json ChunkFormatter::ChoiceJson(int index, const std::string& text, v1::FinishReason reason,
                               const google::protobuf::RepeatedPtrField<v1::TokenLogprob>& logprobs)
    const {
  json message = {{"role", "assistant"}, {"content", text}, {"refusal", nullptr}};
  std::string finish = FinishReasonName(reason);
  if (tool_calls_) {
    ParsedToolCalls parsed = ParseToolCallText(text, CallIdPrefix(index));
    if (!parsed.calls.empty()) {
      message["content"] = parsed.content.empty() ? json() : json(parsed.content);
      message["tool_calls"] = ToolCallsJson(parsed.calls);
      if (reason == v1::FINISH_REASON_STOP) finish = "tool_calls";
    }
  }
  return {{"index", index},
          {"message", std::move(message)},
          {"logprobs", logprobs_ ? LogprobsJson(logprobs) : json()},
          {"finish_reason", finish}};
}

std::string ChunkFormatter::Completion(const v1::ChatResponse& r) const {
  json choices = json::array();
  json extras = Extras(r.request_id(), r.usage(), r.timings(), r.images(), r.language());
  if (r.choices_size() == 0) {
    choices.push_back(ChoiceJson(0, r.text(), r.finish_reason(), r.logprobs()));
  } else {
    json usage = json::array();
    for (const v1::ChatChoice& c : r.choices()) {
      choices.push_back(ChoiceJson(c.index(), c.text(), c.finish_reason(), c.logprobs()));
      usage.push_back(UsageJson(c.usage()));
    }
    extras["choice_usage"] = std::move(usage);
  }
  json completion = {{"id", id_},
                     {"object", "chat.completion"},
                     {"created", created_},
                     {"model", model_},
                     {"choices", std::move(choices)},
                     {"usage", UsageJson(r.usage())},
                     {"x_vlm", std::move(extras)}};
  return DumpJson(completion);
}

}  // namespace vlm::gateway
