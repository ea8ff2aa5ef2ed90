// Shared by the grammar tests: an independent JSON Schema validator (written
// from the specification, not from the compiler) and small helpers.
#pragma once

#include <cmath>
#include <regex>
#include <string>

#include "nlohmann/json.hpp"

namespace vlm::grammar::testing {

using json = nlohmann::json;

inline size_t CodepointCount(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

inline bool FormatOk(const std::string& format, const std::string& s) {
  static const std::regex kDate(R"(\d{4}-(\d{2})-(\d{2}))");
  static const std::regex kTime(R"((\d{2}):(\d{2}):(\d{2})(\.\d+)?(Z|[+-]\d{2}:\d{2}))");
  static const std::regex kUuid(R"([0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12})");
  static const std::regex kEmail(R"([^@\s]+@[^@\s.]+(\.[^@\s.]+)+)");
  std::smatch m;
  auto date_ok = [&](const std::string& d) {
    std::smatch dm;
    if (!std::regex_match(d, dm, kDate)) return false;
    int mo = std::stoi(dm[1]), day = std::stoi(dm[2]);
    return mo >= 1 && mo <= 12 && day >= 1 && day <= 31;
  };
  auto time_ok = [&](const std::string& t) {
    std::smatch tm;
    if (!std::regex_match(t, tm, kTime)) return false;
    return std::stoi(tm[1]) < 24 && std::stoi(tm[2]) < 60 && std::stoi(tm[3]) < 60;
  };
  if (format == "date") return date_ok(s);
  if (format == "time") return time_ok(s);
  if (format == "date-time") {
    size_t t = s.find('T');
    return t != std::string::npos && date_ok(s.substr(0, t)) && time_ok(s.substr(t + 1));
  }
  if (format == "uuid") return std::regex_match(s, kUuid);
  if (format == "email") return std::regex_match(s, kEmail);
  return false;
}

inline const json* ResolvePointer(const json& root, const std::string& ref) {
  if (ref == "#") return &root;
  try {
    return &root.at(json::json_pointer(ref.substr(1)));
  } catch (...) {
    return nullptr;
  }
}

// True iff `v` is valid against `schema` (keywords of the supported set).
inline bool Validate(const json& v, const json& schema, const json& root, std::string* why,
                     int depth = 0) {
  auto fail = [&](const std::string& w) {
    if (why) *why = w + " at " + v.dump().substr(0, 80);
    return false;
  };
  if (depth > 200) return fail("too deep");
  if (schema.is_boolean()) return schema.get<bool>() || fail("false schema");
  if (schema.contains("$ref")) {
    const json* t = ResolvePointer(root, schema["$ref"]);
    return t && Validate(v, *t, root, why, depth + 1);
  }
  if (schema.contains("allOf")) {
    for (const json& s : schema["allOf"]) {
      if (!Validate(v, s, root, why, depth + 1)) return false;
    }
  }
  if (schema.contains("anyOf")) {
    bool any = false;
    for (const json& s : schema["anyOf"]) any |= Validate(v, s, root, nullptr, depth + 1);
    if (!any && !(schema.value("nullable", false) && v.is_null())) return fail("anyOf");
  }
  if (schema.contains("oneOf")) {
    int n = 0;
    for (const json& s : schema["oneOf"]) n += Validate(v, s, root, nullptr, depth + 1);
    if (n != 1) return fail("oneOf matched " + std::to_string(n));
  }
  if (schema.contains("const") && v != schema["const"]) return fail("const");
  if (schema.contains("enum")) {
    bool found = false;
    for (const json& e : schema["enum"]) found |= e == v;
    if (!found) return fail("enum");
  }
  if (schema.contains("type")) {
    std::vector<std::string> types;
    if (schema["type"].is_string()) types.push_back(schema["type"]);
    else for (const json& t : schema["type"]) types.push_back(t);
    if (schema.value("nullable", false)) types.push_back("null");
    bool ok = false;
    for (const std::string& t : types) {
      if (t == "object") ok |= v.is_object();
      if (t == "array") ok |= v.is_array();
      if (t == "string") ok |= v.is_string();
      if (t == "number") ok |= v.is_number();
      if (t == "integer") ok |= v.is_number_integer();
      if (t == "boolean") ok |= v.is_boolean();
      if (t == "null") ok |= v.is_null();
    }
    if (!ok) return fail("type");
  }
  if (v.is_object()) {
    const json props = schema.value("properties", json::object());
    for (const json& r : schema.value("required", json::array())) {
      if (!v.contains(r.get<std::string>())) return fail("required " + r.get<std::string>());
    }
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (props.contains(it.key())) {
        if (!Validate(it.value(), props[it.key()], root, why, depth + 1)) return false;
      } else if (schema.contains("additionalProperties")) {
        if (!Validate(it.value(), schema["additionalProperties"], root, why, depth + 1)) return false;
      }
    }
  }
  if (v.is_array()) {
    if (schema.contains("minItems") && v.size() < schema["minItems"].get<size_t>()) return fail("minItems");
    if (schema.contains("maxItems") && v.size() > schema["maxItems"].get<size_t>()) return fail("maxItems");
    if (schema.contains("items")) {
      for (const json& x : v) {
        if (!Validate(x, schema["items"], root, why, depth + 1)) return false;
      }
    }
  }
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    const size_t n = CodepointCount(s);
    if (schema.contains("minLength") && n < schema["minLength"].get<size_t>()) return fail("minLength");
    if (schema.contains("maxLength") && n > schema["maxLength"].get<size_t>()) return fail("maxLength");
    if (schema.contains("pattern") && !std::regex_search(s, std::regex(schema["pattern"].get<std::string>()))) {
      return fail("pattern");
    }
    if (schema.contains("format") && !FormatOk(schema["format"], s)) return fail("format");
  }
  if (v.is_number()) {
    const double x = v.get<double>();
    if (schema.contains("minimum") && x < schema["minimum"].get<double>()) return fail("minimum");
    if (schema.contains("maximum") && x > schema["maximum"].get<double>()) return fail("maximum");
    if (schema.contains("exclusiveMinimum") && x <= schema["exclusiveMinimum"].get<double>()) return fail("exclusiveMinimum");
    if (schema.contains("exclusiveMaximum") && x >= schema["exclusiveMaximum"].get<double>()) return fail("exclusiveMaximum");
  }
  return true;
}

}  // namespace vlm::grammar::testing
