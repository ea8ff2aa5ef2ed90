// The grammar compiler: JSON Schema / JSON mode / regex translation, checked
// by feeding whole outputs byte by byte (Matcher::AcceptBytes + CanEnd) and
// by its errors. Regexes are compared with std::regex on enumerated strings;
// integer ranges against arithmetic.
#include <regex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "services/language/grammar/json_schema.h"
#include "services/language/grammar/matcher.h"
#include "tests/unit/grammar_test_util.h"

namespace vlm::grammar {
namespace {

using json = nlohmann::json;

std::shared_ptr<const Vocabulary> TinyVocab() {
  static auto v = *Vocabulary::Create({"", "a"}, {0});
  return v;
}

class Lang {
 public:
  explicit Lang(std::shared_ptr<const Grammar> g)
      : cg_(std::make_shared<CompiledGrammar>(std::move(g), TinyVocab())) {}
  bool Matches(const std::string& s) const {
    Matcher m(cg_);
    return m.AcceptBytes(s) && m.CanEnd();
  }
  bool IsPrefix(const std::string& s) const {
    Matcher m(cg_);
    return m.AcceptBytes(s);
  }
  const Grammar& grammar() const { return cg_->grammar(); }

 private:
  std::shared_ptr<const CompiledGrammar> cg_;
};

Lang Schema(const std::string& schema, bool whitespace = true) {
  JsonFormat f;
  f.whitespace = whitespace;
  absl::StatusOr<std::shared_ptr<const Grammar>> g = CompileJsonSchema(schema, f);
  EXPECT_TRUE(g.ok()) << schema << ": " << g.status();
  if (!g.ok()) g = CompileJsonMode(false);
  return Lang(*g);
}

Lang Regex(const std::string& pattern) {
  absl::StatusOr<std::shared_ptr<const Grammar>> g = CompileRegex(pattern);
  EXPECT_TRUE(g.ok()) << pattern << ": " << g.status();
  if (!g.ok()) g = CompileRegex("x");
  return Lang(*g);
}

absl::Status SchemaError(const std::string& schema, JsonFormat f = {}) {
  absl::StatusOr<std::shared_ptr<const Grammar>> g = CompileJsonSchema(schema, f);
  return g.status();
}

TEST(GrammarCompilerTest, StringsAreJsonStringsWithOneSpellingPerCharacter) {
  Lang l = Schema(R"({"type":"string"})");
  for (const char* ok : {R"("")", R"("abc")", R"("a\"b")", R"("a\\b")", "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"",
                         R"("\n\t\u0001")", R"("/")"}) {
    EXPECT_TRUE(l.Matches(ok)) << ok;
  }
  for (const char* bad : {"abc", R"("abc)", "\"\x01\"", R"("\u0041")", R"("\/")", "\"\xc3\"",
                          "\"\xed\xa0\x80\"", "\"\xc0\xaf\"", R"("\x")", R"("a" )"}) {
    EXPECT_FALSE(l.Matches(bad)) << bad;
  }
}

TEST(GrammarCompilerTest, ScalarTypes) {
  Lang i = Schema(R"({"type":"integer"})");
  for (const char* ok : {"0", "-5", "123", "999999999999999999"}) EXPECT_TRUE(i.Matches(ok)) << ok;
  for (const char* bad : {"01", "-0", "1.0", "+1", "", "1e5", "1000000000000000000"}) {
    EXPECT_FALSE(i.Matches(bad)) << bad;
  }
  Lang n = Schema(R"({"type":"number"})");
  for (const char* ok : {"0", "1.5", "-0.25e+10", "3E7", "-12.000"}) EXPECT_TRUE(n.Matches(ok)) << ok;
  for (const char* bad : {".5", "1.", "1e", "--1", "0x1", "NaN"}) EXPECT_FALSE(n.Matches(bad)) << bad;
  Lang b = Schema(R"({"type":"boolean"})");
  EXPECT_TRUE(b.Matches("true"));
  EXPECT_TRUE(b.Matches("false"));
  EXPECT_FALSE(b.Matches("null"));
  Lang nullable = Schema(R"({"type":["string","null"]})");
  EXPECT_TRUE(nullable.Matches("null"));
  EXPECT_TRUE(nullable.Matches(R"("x")"));
  EXPECT_FALSE(nullable.Matches("1"));
  Lang openapi = Schema(R"({"type":"integer","nullable":true})");
  EXPECT_TRUE(openapi.Matches("null"));
  EXPECT_TRUE(openapi.Matches("7"));
}

TEST(GrammarCompilerTest, ObjectsKeepSchemaOrderAndRequiredProperties) {
  Lang l = Schema(R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"},
                      "c":{"type":"boolean"}},"required":["a","c"]})");
  EXPECT_TRUE(l.Matches(R"({"a":1,"c":true})"));
  EXPECT_TRUE(l.Matches(R"({"a":1,"b":"x","c":true})"));
  EXPECT_TRUE(l.Matches("{ \"a\": 1, \"b\": \"x\",\n\"c\": false }"));
  EXPECT_FALSE(l.Matches(R"({"c":true,"a":1})"));      // schema order
  EXPECT_FALSE(l.Matches(R"({"a":1})"));               // c is required
  EXPECT_FALSE(l.Matches(R"({"a":1,"c":true,"d":1})"));  // no extra properties
  EXPECT_FALSE(l.Matches("{\"a\":  1,\"c\":true}"));   // at most one whitespace
  EXPECT_FALSE(l.Matches("{\"a\" :1,\"c\":true}"));    // none before ':'
  Lang compact = Schema(R"({"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]})", false);
  EXPECT_TRUE(compact.Matches(R"({"a":1})"));
  EXPECT_FALSE(compact.Matches(R"({"a": 1})"));
  Lang optional = Schema(R"({"properties":{"x":{"type":"integer"},"y":{"type":"integer"}}})");
  for (const char* ok : {"{}", R"({"x":1})", R"({"y":2})", R"({"x":1,"y":2})"}) EXPECT_TRUE(optional.Matches(ok)) << ok;
  EXPECT_FALSE(optional.Matches(R"({,"y":2})"));
  EXPECT_FALSE(optional.Matches(R"({"x":1,})"));
}

TEST(GrammarCompilerTest, AdditionalPropertiesNeverRepeatAListedKey) {
  Lang any = Schema(R"({"type":"object","properties":{"a":{"type":"integer"}},"additionalProperties":true})");
  EXPECT_TRUE(any.Matches(R"({"a":1,"zz":[1,{"k":null}]})"));
  EXPECT_TRUE(any.Matches(R"({"ab":1,"":2})"));
  EXPECT_TRUE(any.Matches("{}"));
  EXPECT_FALSE(any.Matches(R"({"a":1,"a":2})"));
  EXPECT_FALSE(any.Matches(R"({"b":1,"a":2})"));  // listed properties come first
  Lang bare = Schema(R"({"type":"object"})");
  EXPECT_TRUE(bare.Matches(R"({"x":[1],"y":{"z":null}})"));
  EXPECT_TRUE(bare.Matches("{}"));
  Lang typed = Schema(R"({"type":"object","additionalProperties":{"type":"integer"},"required":["n"]})");
  EXPECT_TRUE(typed.Matches(R"({"n":1,"x":2})"));
  EXPECT_FALSE(typed.Matches(R"({"n":1,"x":"s"})"));
  EXPECT_FALSE(typed.Matches(R"({"x":2})"));
}

TEST(GrammarCompilerTest, EnumConstAnyOfArrays) {
  Lang e = Schema(R"({"enum":["red","green",1,null,{"k":[true]}]})");
  for (const char* ok : {R"("red")", R"("green")", "1", "null", R"({"k":[true]})"}) EXPECT_TRUE(e.Matches(ok)) << ok;
  EXPECT_FALSE(e.Matches(R"("blue")"));
  EXPECT_FALSE(e.Matches(R"("re")"));
  Lang typed_enum = Schema(R"({"type":"string","enum":["a",1]})");
  EXPECT_TRUE(typed_enum.Matches(R"("a")"));
  EXPECT_FALSE(typed_enum.Matches("1"));
  Lang c = Schema(R"({"const":"fixed"})");
  EXPECT_TRUE(c.Matches(R"("fixed")"));
  Lang a = Schema(R"({"anyOf":[{"type":"integer"},{"type":"object","properties":{"t":{"const":1}},"required":["t"]}]})");
  EXPECT_TRUE(a.Matches("5"));
  EXPECT_TRUE(a.Matches(R"({"t":1})"));
  EXPECT_FALSE(a.Matches(R"("x")"));
  Lang arr = Schema(R"({"type":"array","items":{"type":"integer"},"minItems":2,"maxItems":3})");
  EXPECT_FALSE(arr.Matches("[1]"));
  EXPECT_TRUE(arr.Matches("[1,2]"));
  EXPECT_TRUE(arr.Matches("[ 1, 2, 3 ]"));
  EXPECT_FALSE(arr.Matches("[1,2,3,4]"));
  EXPECT_FALSE(arr.Matches("[1,2,]"));
  Lang empty = Schema(R"({"type":"array","maxItems":0})");
  EXPECT_TRUE(empty.Matches("[]"));
  EXPECT_FALSE(empty.Matches("[1]"));
}

TEST(GrammarCompilerTest, StringLengthCountsCharactersNotBytes) {
  Lang l = Schema(R"({"type":"string","minLength":2,"maxLength":3})");
  EXPECT_FALSE(l.Matches(R"("a")"));
  EXPECT_TRUE(l.Matches(R"("ab")"));
  EXPECT_TRUE(l.Matches("\"\xc3\xa9\xc3\xa9\xc3\xa9\""));  // 3 characters, 6 bytes
  EXPECT_TRUE(l.Matches(R"("\n\"x")"));
  EXPECT_FALSE(l.Matches(R"("abcd")"));
}

TEST(GrammarCompilerTest, FormatsAndPatterns) {
  Lang date = Schema(R"({"type":"string","format":"date"})");
  EXPECT_TRUE(date.Matches(R"("2024-02-29")"));
  EXPECT_FALSE(date.Matches(R"("2024-13-01")"));
  EXPECT_FALSE(date.Matches(R"("2024-1-01")"));
  Lang dt = Schema(R"({"type":"string","format":"date-time"})");
  EXPECT_TRUE(dt.Matches(R"("2024-02-29T23:59:60Z")") == false);
  EXPECT_TRUE(dt.Matches(R"("2024-02-29T23:59:59.123+05:30")"));
  Lang email = Schema(R"({"type":"string","format":"email"})");
  EXPECT_TRUE(email.Matches(R"("first.last+x@mail.example.org")"));
  EXPECT_FALSE(email.Matches(R"("a@b")"));
  EXPECT_FALSE(email.Matches(R"("@b.com")"));
  Lang uuid = Schema(R"({"type":"string","format":"uuid"})");
  EXPECT_TRUE(uuid.Matches(R"("123e4567-e89b-12d3-a456-426614174000")"));
  EXPECT_FALSE(uuid.Matches(R"("123e4567e89b12d3a456426614174000")"));
  // A pattern constrains the decoded string: a '"' in it is written \".
  Lang p = Schema(R"({"type":"string","pattern":"^say \"[a-z]+\"$"})");
  EXPECT_TRUE(p.Matches(R"("say \"hi\"")"));
  EXPECT_FALSE(p.Matches(R"("say "hi"")"));
}

TEST(GrammarCompilerTest, IntegerBoundsAreExact) {
  struct Case {
    const char* schema;
    long lo, hi;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"type":"integer","minimum":-15,"maximum":123})", -15, 123},
           {R"({"type":"integer","minimum":7,"maximum":7})", 7, 7},
           {R"({"type":"integer","minimum":0,"maximum":1000})", 0, 1000},
           {R"({"type":"integer","exclusiveMinimum":-100,"exclusiveMaximum":-3})", -99, -4},
           {R"({"type":"integer","minimum":95})", 95, 1L << 40},
           {R"({"type":"integer","maximum":-1095})", -(1L << 40), -1095},
           {R"({"type":"integer","minimum":1.5,"maximum":99.9})", 2, 99}}) {
    Lang l = Schema(c.schema);
    for (long x = -2000; x <= 2000; ++x) {
      EXPECT_EQ(l.Matches(std::to_string(x)), x >= c.lo && x <= c.hi) << c.schema << " " << x;
    }
    EXPECT_EQ(l.Matches("1000000"), 1000000 <= c.hi && 1000000 >= c.lo) << c.schema;
  }
}

TEST(GrammarCompilerTest, NumberBoundsOnlyAdmitValuesInside) {
  const char* schema = R"({"type":"number","minimum":-2.5,"exclusiveMaximum":3})";
  Lang l = Schema(schema);
  const json s = json::parse(schema);
  int admitted = 0;
  for (int ip = -4; ip <= 4; ++ip) {
    for (const char* frac : {"", ".5", ".25", ".0", ".9", ".01"}) {
      for (const char* sign : {"", "-"}) {
        if (ip < 0 && *sign) continue;
        const std::string text = std::string(sign) + std::to_string(ip) + frac;
        if (!l.Matches(text)) continue;
        ++admitted;
        std::string why;
        EXPECT_TRUE(testing::Validate(json::parse(text), s, s, &why)) << text << ": " << why;
      }
    }
  }
  EXPECT_GT(admitted, 20);
  EXPECT_TRUE(l.Matches("2.75"));
  EXPECT_TRUE(l.Matches("-1.5"));
  EXPECT_FALSE(l.Matches("3"));
}

TEST(GrammarCompilerTest, RefsAndRecursion) {
  Lang tree = Schema(R"({"$defs":{"node":{"type":"object","properties":{
      "v":{"type":"integer"},"kids":{"type":"array","items":{"$ref":"#/$defs/node"}}},
      "required":["v"]}},"$ref":"#/$defs/node"})");
  EXPECT_TRUE(tree.Matches(R"({"v":1})"));
  EXPECT_TRUE(tree.Matches(R"({"v":1,"kids":[{"v":2,"kids":[{"v":3}]},{"v":4,"kids":[]}]})"));
  EXPECT_FALSE(tree.Matches(R"({"v":1,"kids":[{"kids":[]}]})"));
  Lang self = Schema(R"({"anyOf":[{"type":"null"},{"type":"array","items":{"$ref":"#"}}]})");
  EXPECT_TRUE(self.Matches("[[null,[]],null]"));
  Lang defs = Schema(R"({"definitions":{"a~b":{"type":"integer"}},"allOf":[{"$ref":"#/definitions/a~0b"}]})");
  EXPECT_TRUE(defs.Matches("12"));
}

TEST(GrammarCompilerTest, JsonModeAndMinOutputBytes) {
  absl::StatusOr<std::shared_ptr<const Grammar>> any = CompileJsonMode(false);
  ASSERT_TRUE(any.ok()) << any.status();
  Lang l(*any);
  for (const char* ok : {"0", "\"\"", "[]", R"({"a":[1,{"b":null}],"c":"d"})", "[1, 2,\n3]", "-1.5e3"}) {
    EXPECT_TRUE(l.Matches(ok)) << ok;
  }
  EXPECT_FALSE(l.Matches("{a:1}"));
  EXPECT_EQ((*any)->MinOutputBytes(), 1);
  absl::StatusOr<std::shared_ptr<const Grammar>> obj = CompileJsonMode(true);
  ASSERT_TRUE(obj.ok());
  EXPECT_FALSE(Lang(*obj).Matches("1"));
  EXPECT_TRUE(Lang(*obj).Matches(R"({"k":[1]})"));
  EXPECT_EQ((*obj)->MinOutputBytes(), 2);
  Lang name = Schema(R"({"type":"object","properties":{"name":{"type":"string","minLength":3}},"required":["name"]})");
  EXPECT_EQ(name.grammar().MinOutputBytes(), static_cast<int64_t>(std::string(R"({"name":"aaa"})").size()));
}

TEST(GrammarCompilerTest, ErrorsNameTheReason) {
  EXPECT_EQ(SchemaError("{").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(SchemaError("{").message().find("not valid JSON"), std::string::npos);
  absl::Status s = SchemaError(R"({"type":"object","properties":{"a":{"not":{"type":"string"}}}})");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("unsupported keyword 'not'"), std::string::npos) << s;
  EXPECT_NE(s.message().find("#/properties/a"), std::string::npos) << s;
  EXPECT_NE(SchemaError(R"({"type":"string","format":"ipv6"})").message().find("unsupported format"), std::string::npos);
  EXPECT_NE(SchemaError(R"({"type":"integer","multipleOf":3})").message().find("multipleOf"), std::string::npos);
  EXPECT_NE(SchemaError(R"({"$ref":"#/$defs/missing"})").message().find("does not resolve"), std::string::npos);
  EXPECT_NE(SchemaError(R"({"$ref":"http://x/y"})").message().find("not local"), std::string::npos);
  s = SchemaError(R"({"$defs":{"a":{"anyOf":[{"$ref":"#/$defs/a"},{"type":"null"}]}},"$ref":"#/$defs/a"})");
  EXPECT_NE(s.message().find("left-recursive"), std::string::npos) << s;
  EXPECT_NE(SchemaError(R"({"type":"integer","minimum":5,"maximum":4})").message().find("no value"), std::string::npos);
  EXPECT_NE(SchemaError(R"({"type":"string","pattern":"(a)\\1"})").message().find("backreference"), std::string::npos);
  EXPECT_EQ(SchemaError(R"({"type":"array","maxItems":100000})").code(), absl::StatusCode::kResourceExhausted);
  JsonFormat small;
  small.limits.max_dfa_states = 100;
  s = SchemaError(R"({"type":"string","maxLength":500})", small);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("too large"), std::string::npos) << s;
  JsonFormat quick;
  quick.limits.max_compile_ms = 0;
  s = SchemaError(R"({"type":"string","maxLength":500})", quick);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("ms"), std::string::npos) << s;
  EXPECT_EQ(SchemaError(std::string(300, '[') + std::string(300, ']')).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CompileRegex("a(?=b)").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CompileRegex("(ab").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CompileRegex("a{2000}").status().code(), absl::StatusCode::kResourceExhausted);
}

// Every string over a small alphabet up to a length: the grammar and
// std::regex agree on full matches.
void CompareWithStdRegex(const std::string& pattern, const std::string& alphabet, int max_len) {
  Lang l = Regex(pattern);
  const std::regex re(pattern, std::regex::ECMAScript);
  std::vector<std::string> frontier = {""};
  int matched = 0;
  for (int len = 0; len <= max_len; ++len) {
    std::vector<std::string> next;
    for (const std::string& s : frontier) {
      const bool expected = std::regex_match(s, re);
      matched += expected;
      ASSERT_EQ(l.Matches(s), expected) << pattern << " on \"" << s << "\"";
      if (len < max_len) {
        for (char c : alphabet) next.push_back(s + c);
      }
    }
    frontier = std::move(next);
  }
  EXPECT_GT(matched, 0) << pattern;
}

TEST(GrammarCompilerTest, RegexAgreesWithStdRegex) {
  CompareWithStdRegex("a(b|c)*d", "abcd", 6);
  CompareWithStdRegex("[0-9]{2,3}-[a-c]+", "01-ab", 6);
  CompareWithStdRegex("x?y+z*", "xyz", 6);
  CompareWithStdRegex("(ab|a)(c|bcd)", "abcd", 6);
  CompareWithStdRegex("[^a]b.", "abc\n", 4);
  CompareWithStdRegex("\\d\\w\\s", "a1 _\t", 4);
  CompareWithStdRegex("(?:a|b){2}c{0,2}", "abc", 6);
  CompareWithStdRegex("[a\\-c]+\\.", "a-c.b", 5);
  CompareWithStdRegex("^(a|)b*$", "ab", 5);
}

TEST(GrammarCompilerTest, RegexHandlesUtf8) {
  Lang l = Regex("[α-ω]+é?");
  EXPECT_TRUE(l.Matches("αβγ"));
  EXPECT_TRUE(l.Matches("ωé"));
  EXPECT_FALSE(l.Matches("a"));
  EXPECT_FALSE(l.Matches("\xce"));  // a truncated character
  Lang dot = Regex(".{2}");
  EXPECT_TRUE(dot.Matches("€😀"));
  EXPECT_FALSE(dot.Matches("€"));
  EXPECT_FALSE(dot.Matches("\xed\xa0\x80\xed\xb0\x80"));  // encoded surrogates are not UTF-8
}

}  // namespace
}  // namespace vlm::grammar
