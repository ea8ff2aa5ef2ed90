#include "services/gateway/tool_calls.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace vlm::gateway {
namespace {

using json = nlohmann::json;

// A field that is present and not null.
const json* Field(const json& object, const char* name) {
  auto it = object.find(name);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

}  // namespace

ParsedToolCalls ParseToolCallText(const std::string& text, const std::string& id_prefix) {
  static const std::string kOpen("<tool_call>");
  static const std::string kClose("</tool_call>");
  ParsedToolCalls out;
  const size_t first = text.find(kOpen);
  if (first == std::string::npos) {
    out.content = text;
    return out;
  }
  size_t pos = first;
  while (pos != std::string::npos) {
    const size_t body = pos + kOpen.size();
    const size_t close = text.find(kClose, body);
    const std::string inner = text.substr(body, close == std::string::npos ? std::string::npos
                                                                           : close - body);
    const json call = json::parse(inner, nullptr, /*allow_exceptions=*/false);
    const json* name = call.is_object() ? Field(call, "name") : nullptr;
    const json* arguments = call.is_object() ? Field(call, "arguments") : nullptr;
    if (name == nullptr || !name->is_string() || arguments == nullptr ||
        !(arguments->is_object() || arguments->is_string())) {
      out.calls.clear();
      out.content = text;
      return out;
    }
    v1::ToolCall c;
    c.set_id(absl::StrCat(id_prefix, out.calls.size()));
    c.set_name(name->get<std::string>());
    c.set_arguments(arguments->is_string() ? arguments->get<std::string>() : arguments->dump(-1, ' ', false, json::error_handler_t::replace));
    out.calls.push_back(std::move(c));
    if (close == std::string::npos) break;
    // Only whitespace may separate blocks; anything else is not a call list.
    size_t next = close + kClose.size();
    while (next < text.size() && absl::ascii_isspace(static_cast<unsigned char>(text[next]))) ++next;
    if (next == text.size()) break;
    if (text.compare(next, kOpen.size(), kOpen) != 0) {
      out.calls.clear();
      out.content = text;
      return out;
    }
    pos = next;
  }
  out.content = std::string(absl::StripTrailingAsciiWhitespace(text.substr(0, first)));
  return out;
}

std::string ToolCallIdPrefix(const std::string& request_id, int choice) {
  return choice == 0 ? absl::StrCat("call_", request_id, "_")
                     : absl::StrCat("call_", request_id, "_c", choice, "_");
}

}  // namespace vlm::gateway
