#include "services/language/text/chat_template.h"

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "services/language/text/utf8.h"

namespace vlm::language {
namespace {

constexpr char kImageBlock[] = "<|vision_start|><|image_pad|><|vision_end|>";
constexpr const char* kVisionTokens[] = {"<|vision_start|>", "<|vision_end|>",
                                              "<|image_pad|>", "<|video_pad|>", "<|vision_pad|>"};

absl::Status Invalid(size_t message, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("messages[", message, "]: ", what));
}

constexpr char kToolsHeader[] =
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
constexpr char kToolsFooter[] =
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>";

// Python's json.dumps(ensure_ascii=False) string escaping.
void AppendPythonString(const std::string& s, std::string* out) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"': *out += "\\\""; break;
      case '\\': *out += "\\\\"; break;
      case '\n': *out += "\\n"; break;
      case '\r': *out += "\\r"; break;
      case '\t': *out += "\\t"; break;
      case '\b': *out += "\\b"; break;
      case '\f': *out += "\\f"; break;
      default:
        if (c < 0x20) {
          absl::StrAppend(out, "\\u00", absl::Hex(c, absl::kZeroPad2));
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

// HF's `tojson`: json.dumps with ", " / ": " separators, keys in order.
void AppendPythonJson(const nlohmann::ordered_json& v, std::string* out) {
  if (v.is_object()) {
    out->push_back('{');
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!first) *out += ", ";
      first = false;
      AppendPythonString(it.key(), out);
      *out += ": ";
      AppendPythonJson(it.value(), out);
    }
    out->push_back('}');
  } else if (v.is_array()) {
    out->push_back('[');
    for (size_t i = 0; i < v.size(); ++i) {
      if (i > 0) *out += ", ";
      AppendPythonJson(v[i], out);
    }
    out->push_back(']');
  } else if (v.is_string()) {
    AppendPythonString(v.get<std::string>(), out);
  } else if (v.is_boolean()) {
    *out += v.get<bool>() ? "true" : "false";
  } else if (v.is_null()) {
    *out += "null";
  } else {
    *out += v.dump();
  }
}

// Text spliced into the prompt outside content parts (tool calls, tool
// descriptions) must be UTF-8 and free of the vision control tokens, like
// content text.
absl::Status CheckSpliced(const std::string& text, const std::string& what) {
  if (absl::Status s = utf8::Validate(text, what); !s.ok()) return s;
  for (const char* token : kVisionTokens) {
    if (text.find(token) != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(what, " contains the control token ", token));
    }
  }
  return absl::OkStatus();
}

// The text of a message's parts (system turns: images are refused earlier).
std::string TextOf(const ChatMessage& m) {
  std::string text;
  for (const ChatPart& part : m.content) {
    if (part.kind == ChatPart::Kind::kText) text += part.text;
  }
  return text;
}

}  // namespace

absl::StatusOr<std::string> ToolJson(const std::string& name, const std::string& description,
                                     const std::string& parameters_json) {
  nlohmann::ordered_json function = nlohmann::ordered_json::object();
  function["name"] = name;
  if (!description.empty()) function["description"] = description;
  if (!parameters_json.empty()) {
    nlohmann::ordered_json parameters = nlohmann::ordered_json::parse(
        parameters_json, nullptr, /*allow_exceptions=*/false);
    if (parameters.is_discarded() || !parameters.is_object()) {
      return absl::InvalidArgumentError("parameters is not a JSON object");
    }
    function["parameters"] = std::move(parameters);
  }
  nlohmann::ordered_json tool = nlohmann::ordered_json::object();
  tool["type"] = "function";
  tool["function"] = std::move(function);
  std::string out;
  AppendPythonJson(tool, &out);
  return out;
}

absl::StatusOr<std::string> RenderChatTemplate(absl::Span<const ChatMessage> messages,
                                               const ChatTemplateOptions& options) {
  if (messages.empty()) return absl::InvalidArgumentError("the conversation has no messages");
  std::string out;
  int image_count = 0;
  const bool tools = !options.tools.empty();
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const bool system = m.role == "system";
    const bool user = m.role == "user";
    const bool tool = m.role == "tool";
    const bool assistant = m.role == "assistant";
    if (!system && !user && !assistant && !tool) {
      return Invalid(i, absl::StrCat("unknown role \"", absl::CHexEscape(m.role),
                                     "\"; expected \"system\", \"user\", \"assistant\" or "
                                     "\"tool\""));
    }
    if (system && i != 0) return Invalid(i, "a system message must be the first message");
    if (!m.tool_calls.empty() && !assistant) {
      return Invalid(i, "only assistant messages carry tool calls");
    }
    for (size_t c = 0; c < m.tool_calls.size(); ++c) {
      const std::string what = absl::StrCat("messages[", i, "].tool_calls[", c, "]");
      for (const std::string* text : {&m.tool_calls[c].name, &m.tool_calls[c].arguments}) {
        if (absl::Status s = CheckSpliced(*text, what); !s.ok()) return s;
      }
    }
    if (tools && i == 0) {
      for (size_t t = 0; t < options.tools.size(); ++t) {
        if (absl::Status s = CheckSpliced(options.tools[t], absl::StrCat("tools[", t, "]"));
            !s.ok()) {
          return s;
        }
      }
    }
    if (tools && i == 0) {
      out += "<|im_start|>system\n";
      if (system) {
        for (const ChatPart& part : m.content) {
          if (part.kind == ChatPart::Kind::kImage) {
            return Invalid(i, "images are allowed in user messages only, not in system messages");
          }
        }
        absl::StrAppend(&out, TextOf(m), "\n\n");
      }
      out += kToolsHeader;
      for (const std::string& t : options.tools) absl::StrAppend(&out, "\n", t);
      absl::StrAppend(&out, kToolsFooter, "<|im_end|>\n");
      if (system) continue;
    }
    if (tool) {
      if (i == 0 || messages[i - 1].role != "tool") out += "<|im_start|>user";
      out += "\n<tool_response>\n";
    } else {
      absl::StrAppend(&out, "<|im_start|>", m.role, "\n");
    }
    for (size_t k = 0; k < m.content.size(); ++k) {
      const ChatPart& part = m.content[k];
      if (part.kind == ChatPart::Kind::kImage) {
        if (!user && !tool) {
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
    if (tool) {
      out += "\n</tool_response>";
      if (i + 1 == messages.size() || messages[i + 1].role != "tool") out += "<|im_end|>\n";
      continue;
    }
    const bool has_text = !TextOf(m).empty();
    for (size_t c = 0; c < m.tool_calls.size(); ++c) {
      if (c > 0 || has_text) out += "\n";
      absl::StrAppend(&out, "<tool_call>\n{\"name\": \"", m.tool_calls[c].name,
                      "\", \"arguments\": ", m.tool_calls[c].arguments, "}\n</tool_call>");
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
  // Each piece was checked alone, but adjacent pieces (two text parts, text
  // and a tool call) can join into a control token ("<|vision_" + "start|>"):
  // the rendered text must hold exactly the image blocks' own.
  for (const char* token : kVisionTokens) {
    size_t n = 0;
    for (size_t pos = out.find(token); pos != std::string::npos; pos = out.find(token, pos + 1)) {
      ++n;
    }
    const bool image_token = absl::string_view(kImageBlock).find(token) != absl::string_view::npos;
    if (n != (image_token ? static_cast<size_t>(image_count) : 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the messages' text parts together form the control token ", token,
          " where they meet; send images as image parts"));
    }
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
