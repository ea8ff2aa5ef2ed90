#include "services/language/grammar/json_schema.h"

#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "services/language/grammar/char_set.h"
#include "services/language/grammar/regex.h"

namespace vlm::grammar {
namespace {

// ordered_json keeps `properties` in document order: that order is the
// order of the generated keys.
using json = nlohmann::ordered_json;
using ExprId = GrammarBuilder::ExprId;
using RuleId = GrammarBuilder::RuleId;

constexpr int kMaxSchemaDepth = 64;     // nested subschemas along one path
constexpr int kMaxTextNesting = 256;    // brackets in the schema text
constexpr int64_t kMaxCount = 4096;     // minItems/maxItems/minLength/maxLength that expand
constexpr int kIntDigits = 18;          // unbounded integers: at most 18 digits
constexpr int kFractionDigits = 15;     // fraction digits of a generated number
constexpr int kExponentDigits = 2;      // exponent digits of a generated number
constexpr double kMaxBound = 9e17;      // numeric bounds beyond this are refused

// Formats as regular expressions over the decoded string. Approximations:
// date allows day 31 in every month (and Feb 29/30/31); time requires
// seconds and an offset (RFC 3339); email is a common dot-atom form without
// quoted local parts or IP literals; hostname does not enforce the 63/253
// length limits.
const std::map<std::string, std::string>& Formats() {
  static const auto* m = [] {
    const std::string date = "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])";
    const std::string time =
        "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])";
    const std::string label = "[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?";
    const std::string octet = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])";
    return new std::map<std::string, std::string>{
        {"date", date},
        {"time", time},
        {"date-time", date + "T" + time},
        {"email", "[A-Za-z0-9_+-]+(\\.[A-Za-z0-9_+-]+)*@(" + label + "\\.)+[A-Za-z]{2,}"},
        {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
        {"ipv4", "(" + octet + "\\.){3}" + octet},
        {"hostname", label + "(\\." + label + ")*"},
    };
  }();
  return *m;
}

const absl::flat_hash_set<std::string>& Annotations() {
  static const auto* s = new absl::flat_hash_set<std::string>{
      "title", "description", "default", "examples", "$schema", "$id", "$comment",
      "deprecated", "readOnly", "writeOnly", "$defs", "definitions"};
  return *s;
}

const absl::flat_hash_set<std::string>& Supported() {
  static const auto* s = new absl::flat_hash_set<std::string>{
      "type", "properties", "required", "additionalProperties", "enum", "const", "anyOf",
      "oneOf", "allOf", "items", "minItems", "maxItems", "minLength", "maxLength", "pattern",
      "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "$ref",
      "nullable"};
  return *s;
}

// Deepest bracket nesting of JSON text (outside strings): the parser and the
// translation recurse, so the depth is checked before parsing.
int TextNesting(absl::string_view text) {
  int depth = 0, max_depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      max_depth = std::max(max_depth, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return max_depth;
}

std::string Pow10Minus1(int digits) { return std::string(digits, '9'); }

class SchemaTranslator {
 public:
  SchemaTranslator(GrammarBuilder& b, const json& root, const JsonFormat& f)
      : b_(b), root_(root), f_(f) {}

  absl::StatusOr<RuleId> Run() {
    RuleId root_rule = b_.AddRule("root");
    absl::StatusOr<ExprId> e = Translate(root_, "#", 0);
    if (!e.ok()) return e.status();
    b_.SetRuleBody(root_rule, *e);
    // Referenced definitions, each translated once (cycles are calls).
    while (!pending_.empty()) {
      auto [ref, rule] = pending_.back();
      pending_.pop_back();
      absl::StatusOr<const json*> target = Resolve(ref);
      if (!target.ok()) return target.status();
      absl::StatusOr<ExprId> body = Translate(**target, ref, 0);
      if (!body.ok()) return body.status();
      b_.SetRuleBody(rule, *body);
    }
    return root_rule;
  }

  // JSON mode: the rule of any JSON value.
  RuleId AnyRule() {
    if (any_rule_ >= 0) return any_rule_;
    any_rule_ = b_.AddRule("any");
    const ExprId value = b_.Call(any_rule_);
    const ExprId member = b_.Seq({AnyString(), Colon(), value});
    b_.SetRuleBody(any_rule_, b_.Alt({Container('{', member, '}'), Container('[', value, ']'),
                                      AnyString(), Number(), b_.Literal("true"),
                                      b_.Literal("false"), b_.Literal("null")}));
    return any_rule_;
  }

  // '{' or '[' ws? (item (sep item)*)? ws? '}' or ']'
  ExprId Container(char open, ExprId item, char close) {
    return b_.Seq({b_.Byte(open), Ws(),
                   b_.Optional(b_.Seq({item, b_.Star(b_.Seq({Sep(), item}))})), Ws(),
                   b_.Byte(close)});
  }

 private:
  absl::Status Error(const std::string& pointer, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("schema at ", pointer, ": ", what));
  }

  ExprId Ws() {
    if (!f_.whitespace) return b_.Empty();
    ByteSet s;
    s.set(' ');
    s.set('\n');
    return b_.Optional(b_.Bytes(s));
  }
  ExprId Sep() { return b_.Seq({b_.Byte(','), Ws()}); }
  ExprId Colon() { return b_.Seq({b_.Byte(':'), Ws()}); }

  ExprId StringChar() {
    if (string_char_ < 0) string_char_ = JsonStringChars(b_, CodepointSet::All());
    return string_char_;
  }
  ExprId AnyString() { return b_.Seq({b_.Byte('"'), b_.Star(StringChar()), b_.Byte('"')}); }

  ExprId Digits(int min, int max) { return b_.Repeat(b_.ByteRange('0', '9'), min, max); }

  ExprId Number() {
    const ExprId integer = b_.Seq({b_.Optional(b_.Byte('-')),
                                   b_.Alt({b_.Byte('0'), b_.Seq({b_.ByteRange('1', '9'), Digits(0, kIntDigits - 1)})})});
    const ExprId fraction = b_.Seq({b_.Byte('.'), Digits(1, kFractionDigits)});
    ByteSet e, sign;
    e.set('e');
    e.set('E');
    sign.set('+');
    sign.set('-');
    const ExprId exponent = b_.Seq({b_.Bytes(e), b_.Optional(b_.Bytes(sign)), Digits(1, kExponentDigits)});
    return b_.Seq({integer, b_.Optional(fraction), b_.Optional(exponent)});
  }

  // 0 or a signed non-zero integer (no "-0"), at most kIntDigits digits.
  ExprId IntegerUnbounded() {
    const ExprId nonzero = b_.Seq({b_.ByteRange('1', '9'), Digits(0, kIntDigits - 1)});
    return b_.Alt({b_.Byte('0'), b_.Seq({b_.Optional(b_.Byte('-')), nonzero})});
  }

  // Decimal strings lo..hi of equal length (leading zeros allowed here; the
  // caller places the first digit).
  ExprId SameLength(const std::string& lo, const std::string& hi) {
    const size_t n = lo.size();
    if (n == 0) return b_.Empty();
    if (lo[0] == hi[0]) return b_.Seq({b_.Byte(lo[0]), SameLength(lo.substr(1), hi.substr(1))});
    const std::string rest_lo = lo.substr(1), rest_hi = hi.substr(1);
    if (rest_lo == std::string(n - 1, '0') && rest_hi == std::string(n - 1, '9')) {
      return b_.Seq({b_.ByteRange(lo[0], hi[0]), Digits(n - 1, n - 1)});
    }
    std::vector<ExprId> options;
    options.push_back(b_.Seq({b_.Byte(lo[0]), SameLength(rest_lo, std::string(n - 1, '9'))}));
    if (hi[0] - lo[0] >= 2) {
      options.push_back(b_.Seq({b_.ByteRange(lo[0] + 1, hi[0] - 1), Digits(n - 1, n - 1)}));
    }
    options.push_back(b_.Seq({b_.Byte(hi[0]), SameLength(std::string(n - 1, '0'), rest_hi)}));
    return b_.Alt(std::move(options));
  }

  // Magnitudes a..b (0 <= a <= b < 10^18) in canonical decimal.
  ExprId MagnitudeRange(uint64_t a, uint64_t b) {
    std::vector<ExprId> options;
    const std::string sa = std::to_string(a), sb = std::to_string(b);
    for (size_t d = sa.size(); d <= sb.size(); ++d) {
      const std::string lo = d == sa.size() ? sa : "1" + std::string(d - 1, '0');
      const std::string hi = d == sb.size() ? sb : Pow10Minus1(static_cast<int>(d));
      options.push_back(SameLength(lo, hi));
    }
    return b_.Alt(std::move(options));
  }

  // Integers in [lo, hi] (exact); absent bounds are +-(10^18 - 1).
  ExprId IntegerRange(std::optional<int64_t> lo, std::optional<int64_t> hi) {
    const int64_t kLimit = 999999999999999999LL;
    const int64_t a = lo ? std::max(*lo, -kLimit) : -kLimit;
    const int64_t z = hi ? std::min(*hi, kLimit) : kLimit;
    if (a > z) return b_.Nothing();
    std::vector<ExprId> options;
    if (a < 0) {  // negative part: magnitudes max(1, -z) .. -a
      const uint64_t m_lo = z < 0 ? static_cast<uint64_t>(-z) : 1;
      options.push_back(b_.Seq({b_.Byte('-'), MagnitudeRange(m_lo, static_cast<uint64_t>(-a))}));
    }
    if (z >= 0) options.push_back(MagnitudeRange(a > 0 ? a : 0, z));
    return b_.Alt(std::move(options));
  }

  absl::StatusOr<std::optional<double>> Bound(const json& s, const char* key,
                                              const std::string& pointer) {
    if (!s.contains(key)) return std::optional<double>();
    const json& v = s[key];
    if (v.is_boolean()) return std::optional<double>();  // draft 4 exclusive flags
    if (!v.is_number()) return Error(pointer, absl::StrCat(key, " must be a number"));
    const double d = v.get<double>();
    if (!std::isfinite(d) || std::fabs(d) > kMaxBound) {
      return Error(pointer, absl::StrCat(key, " is outside the supported range +-9e17"));
    }
    return std::optional<double>(d);
  }

  struct NumericBounds {
    std::optional<double> lo, hi;
    bool lo_exclusive = false, hi_exclusive = false;
  };
  absl::StatusOr<NumericBounds> Bounds(const json& s, const std::string& pointer) {
    NumericBounds nb;
    absl::StatusOr<std::optional<double>> min = Bound(s, "minimum", pointer);
    absl::StatusOr<std::optional<double>> max = Bound(s, "maximum", pointer);
    absl::StatusOr<std::optional<double>> xmin = Bound(s, "exclusiveMinimum", pointer);
    absl::StatusOr<std::optional<double>> xmax = Bound(s, "exclusiveMaximum", pointer);
    for (auto* st : {&min, &max, &xmin, &xmax}) {
      if (!st->ok()) return st->status();
    }
    nb.lo = *min;
    nb.hi = *max;
    if (s.contains("exclusiveMinimum") && s["exclusiveMinimum"].is_boolean()) {
      nb.lo_exclusive = s["exclusiveMinimum"].get<bool>();
    }
    if (s.contains("exclusiveMaximum") && s["exclusiveMaximum"].is_boolean()) {
      nb.hi_exclusive = s["exclusiveMaximum"].get<bool>();
    }
    if (*xmin && (!nb.lo || **xmin >= *nb.lo)) {
      nb.lo = *xmin;
      nb.lo_exclusive = true;
    }
    if (*xmax && (!nb.hi || **xmax <= *nb.hi)) {
      nb.hi = *xmax;
      nb.hi_exclusive = true;
    }
    return nb;
  }

  // Smallest / largest integer inside the bounds.
  static std::optional<int64_t> IntLo(const NumericBounds& nb) {
    if (!nb.lo) return std::nullopt;
    return static_cast<int64_t>(nb.lo_exclusive ? std::floor(*nb.lo) + 1 : std::ceil(*nb.lo));
  }
  static std::optional<int64_t> IntHi(const NumericBounds& nb) {
    if (!nb.hi) return std::nullopt;
    return static_cast<int64_t>(nb.hi_exclusive ? std::ceil(*nb.hi) - 1 : std::floor(*nb.hi));
  }

  absl::StatusOr<ExprId> IntegerExpr(const json& s, const std::string& pointer) {
    if (s.contains("multipleOf")) return Error(pointer, "unsupported keyword 'multipleOf'");
    absl::StatusOr<NumericBounds> nb = Bounds(s, pointer);
    if (!nb.ok()) return nb.status();
    if (!nb->lo && !nb->hi) return IntegerUnbounded();
    return IntegerRange(IntLo(*nb), IntHi(*nb));
  }

  // Numbers with bounds (an approximation that only produces valid values):
  // integers inside the bounds, and x.ddd where the whole interval
  // (x, x+1) (or (x-1, x) for negative x) lies inside the bounds; the last
  // fraction digit is not 0; no exponent and no "-0.ddd".
  absl::StatusOr<ExprId> NumberExpr(const json& s, const std::string& pointer) {
    absl::StatusOr<NumericBounds> nb = Bounds(s, pointer);
    if (!nb.ok()) return nb.status();
    if (!nb->lo && !nb->hi) return Number();
    const ExprId fraction = b_.Seq({b_.Byte('.'), Digits(0, kFractionDigits - 1), b_.ByteRange('1', '9')});
    std::vector<ExprId> options;
    options.push_back(IntegerRange(IntLo(*nb), IntHi(*nb)));
    std::optional<int64_t> ceil_lo, floor_hi;
    if (nb->lo) ceil_lo = static_cast<int64_t>(std::ceil(*nb->lo));
    if (nb->hi) floor_hi = static_cast<int64_t>(std::floor(*nb->hi));
    // x >= 0: x in [max(ceil(lo), 0), floor(hi) - 1]
    {
      std::optional<int64_t> lo = ceil_lo ? std::max<int64_t>(*ceil_lo, 0) : 0;
      std::optional<int64_t> hi;
      if (floor_hi) hi = *floor_hi - 1;
      if (!hi || *lo <= *hi) options.push_back(b_.Seq({IntegerRange(lo, hi), fraction}));
    }
    // x <= -1: x in [ceil(lo) + 1, min(floor(hi), -1)]
    {
      std::optional<int64_t> lo;
      if (ceil_lo) lo = *ceil_lo + 1;
      std::optional<int64_t> hi = floor_hi ? std::min<int64_t>(*floor_hi, -1) : -1;
      if (!lo || *lo <= *hi) options.push_back(b_.Seq({IntegerRange(lo, hi), fraction}));
    }
    return b_.Alt(std::move(options));
  }

  absl::StatusOr<int64_t> Count(const json& s, const char* key, int64_t fallback,
                                const std::string& pointer) {
    if (!s.contains(key)) return fallback;
    const json& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0) {
      return Error(pointer, absl::StrCat(key, " must be a non-negative integer"));
    }
    const int64_t n = v.get<int64_t>();
    if (n > kMaxCount) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "schema at ", pointer, ": ", key, " ", n, " is above the supported ", kMaxCount));
    }
    return n;
  }

  absl::StatusOr<ExprId> StringExpr(const json& s, const std::string& pointer) {
    absl::StatusOr<int64_t> min = Count(s, "minLength", 0, pointer);
    if (!min.ok()) return min.status();
    absl::StatusOr<int64_t> max = Count(s, "maxLength", -1, pointer);
    if (!max.ok()) return max.status();
    const bool has_length = s.contains("minLength") || s.contains("maxLength");
    std::optional<std::string> pattern;
    if (s.contains("pattern")) {
      if (!s["pattern"].is_string()) return Error(pointer, "pattern must be a string");
      pattern = s["pattern"].get<std::string>();
    }
    if (s.contains("format")) {
      if (!s["format"].is_string()) return Error(pointer, "format must be a string");
      const std::string format = s["format"].get<std::string>();
      auto it = Formats().find(format);
      if (it == Formats().end()) {
        return Error(pointer, absl::StrCat("unsupported format '", format, "'"));
      }
      if (pattern) return Error(pointer, "pattern together with format is not supported");
      pattern = it->second;
    }
    ExprId content;
    if (pattern) {
      if (has_length) {
        return Error(pointer, "minLength/maxLength together with pattern or format is not supported");
      }
      absl::StatusOr<ExprId> r = TranslateRegex(b_, *pattern, RegexEncoding::kJsonString);
      if (!r.ok()) return Error(pointer, r.status().message());
      content = *r;
    } else {
      if (*max >= 0 && *max < *min) return Error(pointer, "maxLength is below minLength");
      content = b_.Repeat(StringChar(), static_cast<int32_t>(*min), static_cast<int32_t>(*max));
    }
    return b_.Seq({b_.Byte('"'), content, b_.Byte('"')});
  }

  absl::StatusOr<ExprId> ArrayExpr(const json& s, const std::string& pointer, int depth) {
    if (s.contains("prefixItems")) return Error(pointer, "unsupported keyword 'prefixItems'");
    ExprId item;
    if (s.contains("items")) {
      absl::StatusOr<ExprId> e = Translate(s["items"], pointer + "/items", depth + 1);
      if (!e.ok()) return e.status();
      item = *e;
    } else {
      item = b_.Call(AnyRule());
    }
    absl::StatusOr<int64_t> min = Count(s, "minItems", 0, pointer);
    if (!min.ok()) return min.status();
    absl::StatusOr<int64_t> max = Count(s, "maxItems", -1, pointer);
    if (!max.ok()) return max.status();
    if (*max >= 0 && *max < *min) return Error(pointer, "maxItems is below minItems");
    if (*max == 0) return b_.Seq({b_.Byte('['), Ws(), Ws(), b_.Byte(']')});
    const ExprId inner =
        b_.Seq({item, b_.Repeat(b_.Seq({Sep(), item}), static_cast<int32_t>(std::max<int64_t>(*min - 1, 0)),
                                *max < 0 ? -1 : static_cast<int32_t>(*max - 1))});
    return b_.Seq({b_.Byte('['), Ws(), *min == 0 ? b_.Optional(inner) : inner, Ws(), b_.Byte(']')});
  }

  // Keys of additional properties: ASCII strings without escapes that are
  // none of `names` (so a listed property is never written twice).
  ExprId ExtraKey(const std::vector<std::string>& names) {
    ByteSet plain;
    for (int c = 0x20; c < 0x7F; ++c) plain.set(c);
    plain.reset('"');
    plain.reset('\\');
    struct Node {
      std::map<uint8_t, int> kids;
      bool terminal = false;
    };
    std::vector<Node> trie(1);
    for (const std::string& name : names) {
      bool ascii_plain = true;
      for (char c : name) ascii_plain &= plain.test(static_cast<uint8_t>(c));
      if (!ascii_plain) continue;  // such a name can never equal an extra key
      int t = 0;
      for (char c : name) {
        const uint8_t u = static_cast<uint8_t>(c);
        auto it = trie[t].kids.find(u);
        if (it == trie[t].kids.end()) {
          trie.emplace_back();
          it = trie[t].kids.emplace(u, static_cast<int>(trie.size() - 1)).first;
        }
        t = it->second;
      }
      trie[t].terminal = true;
    }
    const ExprId any_tail = b_.Star(b_.Bytes(plain));
    std::function<ExprId(int)> rec = [&](int t) -> ExprId {
      std::vector<ExprId> options;
      if (!trie[t].terminal) options.push_back(b_.Empty());
      ByteSet other = plain;
      for (const auto& [c, kid] : trie[t].kids) {
        other.reset(c);
        options.push_back(b_.Seq({b_.Byte(c), rec(kid)}));
      }
      options.push_back(b_.Seq({b_.Bytes(other), any_tail}));
      return b_.Alt(std::move(options));
    };
    return b_.Seq({b_.Byte('"'), rec(0), b_.Byte('"')});
  }

  absl::StatusOr<ExprId> ObjectExpr(const json& s, const std::string& pointer, int depth) {
    for (const char* k : {"patternProperties", "propertyNames", "minProperties", "maxProperties",
                          "dependentRequired", "dependentSchemas", "unevaluatedProperties"}) {
      if (s.contains(k)) return Error(pointer, absl::StrCat("unsupported keyword '", k, "'"));
    }
    std::vector<std::pair<std::string, const json*>> props;
    static const json kTrue = true;
    if (s.contains("properties")) {
      if (!s["properties"].is_object()) return Error(pointer, "properties must be an object");
      for (const auto& [name, sub] : s["properties"].items()) props.emplace_back(name, &sub);
    }
    std::set<std::string> required;
    if (s.contains("required")) {
      if (!s["required"].is_array()) return Error(pointer, "required must be an array");
      for (const json& r : s["required"]) {
        if (!r.is_string()) return Error(pointer, "required must list strings");
        required.insert(r.get<std::string>());
      }
    }
    const json* additional = nullptr;  // nullptr: no extra properties
    if (s.contains("additionalProperties")) {
      const json& a = s["additionalProperties"];
      if (a.is_boolean()) {
        if (a.get<bool>()) additional = &kTrue;
      } else if (a.is_object()) {
        additional = &a;
      } else {
        return Error(pointer, "additionalProperties must be a boolean or a schema");
      }
    }
    // With no properties listed, an absent additionalProperties means any
    // members ({"type":"object"} is any object); with properties listed it
    // means none beyond them.
    if (!s.contains("additionalProperties") && !s.contains("properties")) additional = &kTrue;
    for (const std::string& r : required) {
      bool listed = false;
      for (const auto& p : props) listed |= p.first == r;
      if (listed) continue;
      if (!additional) {
        return Error(pointer, absl::StrCat("required property '", r,
                                           "' is not in properties and additionalProperties is false"));
      }
      props.emplace_back(r, additional);
    }
    std::vector<ExprId> items;
    std::vector<bool> is_required;
    std::vector<std::string> names;
    for (const auto& [name, sub] : props) {
      absl::StatusOr<ExprId> value = Translate(*sub, pointer + "/properties/" + name, depth + 1);
      if (!value.ok()) return value.status();
      std::string key;
      try {
        key = json(name).dump();
      } catch (const std::exception& e) {
        return Error(pointer, "property name is not valid UTF-8");
      }
      items.push_back(b_.Seq({b_.Literal(key), Colon(), *value}));
      is_required.push_back(required.count(name) > 0);
      names.push_back(name);
    }
    const size_t n = items.size();
    // The first written property has no comma before it: one alternative
    // per possible first property (only optional ones can be skipped).
    std::vector<ExprId> tails(n + 1);
    tails[n] = b_.Empty();
    for (size_t k = n; k-- > 0;) {
      const ExprId with_sep = b_.Seq({Sep(), items[k]});
      tails[k] = b_.Seq({is_required[k] ? with_sep : b_.Optional(with_sep), tails[k + 1]});
    }
    std::vector<ExprId> firsts;
    bool can_be_empty = true;
    for (size_t i = 0; i < n; ++i) {
      firsts.push_back(b_.Seq({items[i], tails[i + 1]}));
      if (is_required[i]) {
        can_be_empty = false;
        break;
      }
    }
    ExprId body;
    if (additional) {
      absl::StatusOr<ExprId> value = Translate(*additional, pointer + "/additionalProperties", depth + 1);
      if (!value.ok()) return value.status();
      const ExprId extra = b_.Seq({ExtraKey(names), Colon(), *value});
      const ExprId more = b_.Star(b_.Seq({Sep(), extra}));
      std::vector<ExprId> options;
      if (n > 0) options.push_back(b_.Seq({b_.Alt(firsts), more}));
      if (can_be_empty) {
        options.push_back(b_.Seq({extra, more}));
        options.push_back(b_.Empty());
      }
      body = b_.Alt(std::move(options));
    } else {
      body = n == 0 ? b_.Empty() : can_be_empty ? b_.Optional(b_.Alt(firsts)) : b_.Alt(firsts);
    }
    return b_.Seq({b_.Byte('{'), Ws(), body, Ws(), b_.Byte('}')});
  }

  absl::StatusOr<ExprId> Typed(const json& s, const std::string& type, const std::string& pointer,
                               int depth) {
    if (type == "object") return ObjectExpr(s, pointer, depth);
    if (type == "array") return ArrayExpr(s, pointer, depth);
    if (type == "string") return StringExpr(s, pointer);
    if (type == "integer") return IntegerExpr(s, pointer);
    if (type == "number") return NumberExpr(s, pointer);
    if (type == "boolean") return b_.Alt({b_.Literal("true"), b_.Literal("false")});
    if (type == "null") return b_.Literal("null");
    return Error(pointer, absl::StrCat("unknown type '", type, "'"));
  }

  static bool MatchesType(const json& v, const std::string& type) {
    if (type == "object") return v.is_object();
    if (type == "array") return v.is_array();
    if (type == "string") return v.is_string();
    if (type == "integer") {
      return v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>());
    }
    if (type == "number") return v.is_number();
    if (type == "boolean") return v.is_boolean();
    if (type == "null") return v.is_null();
    return false;
  }

  absl::StatusOr<ExprId> Literal(const json& v, const std::string& pointer) {
    try {
      return b_.Literal(v.dump());
    } catch (const std::exception& e) {
      return Error(pointer, "enum/const value cannot be serialized");
    }
  }

  // const / enum: the listed values of the schema's type(s) (all when none), as
  // literals.
  absl::StatusOr<ExprId> EnumOrConst(const json& s, const std::vector<std::string>& types,
                                     const std::string& pointer) {
    std::vector<const json*> values;
    if (s.contains("const")) {
      values.push_back(&s["const"]);
    } else {
      if (!s["enum"].is_array() || s["enum"].empty()) return Error(pointer, "enum must be a non-empty array");
      for (const json& v : s["enum"]) values.push_back(&v);
    }
    std::vector<ExprId> options;
    for (const json* v : values) {
      bool ok = types.empty();
      for (const std::string& t : types) ok |= MatchesType(*v, t);
      if (!ok) continue;
      absl::StatusOr<ExprId> lit = Literal(*v, pointer);
      if (!lit.ok()) return lit.status();
      options.push_back(*lit);
    }
    if (options.empty()) return Error(pointer, "no enum/const value has the schema's type");
    return b_.Alt(std::move(options));
  }

  absl::StatusOr<ExprId> Translate(const json& s, const std::string& pointer, int depth) {
    if (depth > kMaxSchemaDepth) return Error(pointer, "schema nests too deeply");
    if (b_.overflowed()) {
      return absl::ResourceExhaustedError("grammar too large: too many expression nodes");
    }
    if (s.is_boolean()) return s.get<bool>() ? b_.Call(AnyRule()) : b_.Nothing();
    if (!s.is_object()) return Error(pointer, "a schema must be an object or a boolean");
    std::vector<std::string> validation;
    for (const auto& [key, value] : s.items()) {
      if (Annotations().contains(key)) continue;
      if (!Supported().contains(key)) {
        // Keywords of one type that this compiler refuses are named by the
        // type handlers; everything else is refused here.
        static const absl::flat_hash_set<std::string> kNamedLater = {
            "multipleOf", "prefixItems", "patternProperties", "propertyNames", "minProperties",
            "maxProperties", "dependentRequired", "dependentSchemas", "unevaluatedProperties"};
        if (!kNamedLater.contains(key)) {
          return Error(pointer, absl::StrCat("unsupported keyword '", key, "'"));
        }
      }
      validation.push_back(key);
    }
    auto only = [&](const char* keyword, std::initializer_list<const char*> allowed) -> absl::Status {
      for (const std::string& k : validation) {
        if (k == keyword) continue;
        bool ok = false;
        for (const char* a : allowed) ok |= k == a;
        if (!ok) {
          return Error(pointer, absl::StrCat("'", keyword, "' together with '", k, "' is not supported"));
        }
      }
      return absl::OkStatus();
    };
    if (s.contains("$ref")) {
      if (absl::Status st = only("$ref", {}); !st.ok()) return st;
      if (!s["$ref"].is_string()) return Error(pointer, "$ref must be a string");
      absl::StatusOr<RuleId> rule = RuleForRef(s["$ref"].get<std::string>(), pointer);
      if (!rule.ok()) return rule.status();
      return b_.Call(*rule);
    }
    if (s.contains("allOf")) {
      if (absl::Status st = only("allOf", {}); !st.ok()) return st;
      if (!s["allOf"].is_array() || s["allOf"].size() != 1) {
        return Error(pointer, "allOf is supported with exactly one member");
      }
      return Translate(s["allOf"][0], pointer + "/allOf/0", depth + 1);
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (!s.contains(key)) continue;
      if (absl::Status st = only(key, {"nullable"}); !st.ok()) return st;
      if (!s[key].is_array() || s[key].empty()) return Error(pointer, absl::StrCat(key, " must be a non-empty array"));
      std::vector<ExprId> options;
      for (size_t i = 0; i < s[key].size(); ++i) {
        absl::StatusOr<ExprId> e = Translate(s[key][i], absl::StrCat(pointer, "/", key, "/", i), depth + 1);
        if (!e.ok()) return e.status();
        options.push_back(*e);
      }
      if (s.contains("nullable") && s["nullable"] == true) options.push_back(b_.Literal("null"));
      return b_.Alt(std::move(options));
    }

    std::vector<std::string> types;
    if (s.contains("type")) {
      const json& t = s["type"];
      if (t.is_string()) {
        types.push_back(t.get<std::string>());
      } else if (t.is_array() && !t.empty()) {
        for (const json& x : t) {
          if (!x.is_string()) return Error(pointer, "type must be a string or an array of strings");
          types.push_back(x.get<std::string>());
        }
      } else {
        return Error(pointer, "type must be a string or an array of strings");
      }
    }
    if (s.contains("nullable") && s["nullable"] == true && !types.empty()) types.push_back("null");

    if (s.contains("const") || s.contains("enum")) return EnumOrConst(s, types, pointer);

    if (types.empty()) {
      auto has = [&](std::initializer_list<const char*> keys) {
        for (const char* k : keys) {
          if (s.contains(k)) return true;
        }
        return false;
      };
      if (has({"properties", "required", "additionalProperties"})) {
        types = {"object"};
      } else if (has({"items", "minItems", "maxItems"})) {
        types = {"array"};
      } else if (has({"minLength", "maxLength", "pattern", "format"})) {
        types = {"string"};
      } else if (has({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})) {
        types = {"number"};
      } else {
        return b_.Call(AnyRule());
      }
      if (s.contains("nullable") && s["nullable"] == true) types.push_back("null");
    }
    std::vector<ExprId> options;
    for (const std::string& t : types) {
      absl::StatusOr<ExprId> e = Typed(s, t, pointer, depth);
      if (!e.ok()) return e.status();
      options.push_back(*e);
    }
    return b_.Alt(std::move(options));
  }

  absl::StatusOr<RuleId> RuleForRef(const std::string& ref, const std::string& pointer) {
    if (ref.empty() || ref[0] != '#') {
      return Error(pointer, absl::StrCat("$ref '", ref, "' is not local to the schema (#...)"));
    }
    auto it = ref_rules_.find(ref);
    if (it != ref_rules_.end()) return it->second;
    absl::StatusOr<const json*> target = Resolve(ref);
    if (!target.ok()) return target.status();
    const RuleId rule = b_.AddRule(ref);
    ref_rules_.emplace(ref, rule);
    pending_.emplace_back(ref, rule);
    return rule;
  }

  // JSON pointer in the root document ("#", "#/$defs/x", "#/a~1b/0").
  absl::StatusOr<const json*> Resolve(const std::string& ref) {
    const json* cur = &root_;
    size_t pos = 1;
    if (ref.size() > 1 && ref[1] != '/') {
      return absl::InvalidArgumentError(absl::StrCat("$ref '", ref, "': only JSON pointers are supported"));
    }
    while (pos < ref.size()) {
      const size_t next = ref.find('/', pos + 1);
      std::string token = ref.substr(pos + 1, next == std::string::npos ? std::string::npos : next - pos - 1);
      std::string unescaped;
      for (size_t i = 0; i < token.size(); ++i) {
        if (token[i] == '~' && i + 1 < token.size() && (token[i + 1] == '0' || token[i + 1] == '1')) {
          unescaped += token[i + 1] == '0' ? '~' : '/';
          ++i;
        } else {
          unescaped += token[i];
        }
      }
      if (cur->is_object() && cur->contains(unescaped)) {
        cur = &(*cur)[unescaped];
      } else if (cur->is_array() && !unescaped.empty() &&
                 unescaped.find_first_not_of("0123456789") == std::string::npos &&
                 unescaped.size() < 9 && std::stoul(unescaped) < cur->size()) {
        cur = &(*cur)[std::stoul(unescaped)];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("$ref '", ref, "' does not resolve"));
      }
      if (next == std::string::npos) break;
      pos = next;
    }
    return cur;
  }

  GrammarBuilder& b_;
  const json& root_;
  JsonFormat f_;
  RuleId any_rule_ = -1;
  ExprId string_char_ = -1;
  std::map<std::string, RuleId> ref_rules_;
  std::vector<std::pair<std::string, RuleId>> pending_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchema(absl::string_view schema_json,
                                                                 const JsonFormat& format) {
  return CompileJsonSchemaBetween(schema_json, "", "", format);
}

absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchemaBetween(
    absl::string_view schema_json, absl::string_view prefix, absl::string_view suffix,
    const JsonFormat& format) {
  if (TextNesting(schema_json) > kMaxTextNesting) {
    return absl::InvalidArgumentError(
        absl::StrCat("schema nests more than ", kMaxTextNesting, " levels"));
  }
  json schema = json::parse(schema_json.begin(), schema_json.end(), nullptr, /*allow_exceptions=*/false);
  if (schema.is_discarded()) return absl::InvalidArgumentError("schema is not valid JSON");
  GrammarBuilder b(format.limits);
  SchemaTranslator t(b, schema, format);
  absl::StatusOr<RuleId> root = t.Run();
  if (!root.ok()) return root.status();
  if (prefix.empty() && suffix.empty()) return b.Build(*root);
  const RuleId outer = b.AddRule("between");
  b.SetRuleBody(outer, b.Seq({b.Literal(prefix), b.Call(*root), b.Literal(suffix)}));
  return b.Build(outer);
}

absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonMode(bool object_only,
                                                               const JsonFormat& format) {
  GrammarBuilder b(format.limits);
  static const json kEmpty = json::object();
  SchemaTranslator t(b, kEmpty, format);
  const RuleId any = t.AnyRule();
  if (!object_only) return b.Build(any);
  const RuleId root = b.AddRule("object");
  // An object whose member values are any JSON value.
  GrammarBuilder::ExprId key = b.Seq({b.Byte('"'), b.Star(JsonStringChars(b, CodepointSet::All())), b.Byte('"')});
  GrammarBuilder::ExprId ws = format.whitespace ? b.Optional(b.Bytes(ByteSet().set(' ').set('\n'))) : b.Empty();
  GrammarBuilder::ExprId member = b.Seq({key, b.Byte(':'), ws, b.Call(any)});
  b.SetRuleBody(root, t.Container('{', member, '}'));
  return b.Build(root);
}

absl::StatusOr<std::shared_ptr<const Grammar>> CompileRegex(absl::string_view pattern,
                                                            const GrammarLimits& limits) {
  GrammarBuilder b(limits);
  absl::StatusOr<GrammarBuilder::ExprId> e = TranslateRegex(b, pattern, RegexEncoding::kUtf8);
  if (!e.ok()) return e.status();
  const GrammarBuilder::RuleId root = b.AddRule("regex");
  b.SetRuleBody(root, *e);
  return b.Build(root);
}

}  // namespace vlm::grammar
