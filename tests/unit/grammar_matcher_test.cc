// Token masks against a brute-force reference, on a synthetic vocabulary and
// on the real Qwen3 vocabulary: at every sampled state, token t is in
// FillMask's mask iff feeding t's bytes to the automaton directly (no cache)
// keeps it alive (every live state can complete: the compiler drops states
// that cannot). Random walks over allowed tokens must end in JSON that an
// independent validator accepts, within a bound for bounded schemas.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "services/language/grammar/grammar_cache.h"
#include "services/language/grammar/json_schema.h"
#include "services/language/grammar/matcher.h"
#include "services/language/grammar/tokenizer_vocabulary.h"
#include "services/language/text/tokenizer.h"
#include "tests/unit/grammar_test_util.h"

namespace vlm::grammar {
namespace {

using json = nlohmann::json;

// Every single byte (so every output is reachable), JSON-shaped pieces that
// cross token boundaries the way byte-level BPE does ('"' closing a string
// and opening the next key), and random strings over JSON characters.
// Id 0 is the stop token.
std::shared_ptr<const Vocabulary> SyntheticVocab() {
  static auto v = [] {
    std::vector<std::string> t = {""};
    for (int b = 1; b < 256; ++b) t.push_back(std::string(1, static_cast<char>(b)));
    for (const char* s : {"{\"", "\":", "\": ", "\", \"", "\",\"", "\"}", "\"}]", "}]", "]}", "true", "null",
                          "false", "12", ".5", "e+", "\\n", "\\u00", "\"name\"", "name", "ab", "\xc3\xa9",
                          "\"\xc3", "\xa9\"", ", ", ",\n", "[{", "\"},{\"", "\": \"", "-0", "00", "2024",
                          "-01-", "T12", ":00", "Z\"", "@", ".com", "\": [", "\":{\"", "\"}}", "}\n"}) {
      t.push_back(s);
    }
    std::mt19937 rng(7);
    const std::string alphabet = "{}[]\",:0123456789.-+eE abcxyzntrulfs\\\n";
    for (int i = 0; i < 3000; ++i) {
      std::string s;
      const int len = 2 + rng() % 5;
      for (int k = 0; k < len; ++k) s += alphabet[rng() % alphabet.size()];
      t.push_back(s);
    }
    return *Vocabulary::Create(std::move(t), {0});
  }();
  return v;
}

std::string TokenizerDir() {
  const char* dir = std::getenv("VLM_TOKENIZER_DIR");
  if (dir && *dir) return dir;
  const char* cache = std::getenv("VLM_CACHE_DIR");
  const char* home = std::getenv("HOME");
  return (cache && *cache ? std::string(cache) : std::string(home ? home : "/root") + "/.cache/vlm") +
         "/tokenizer";
}

std::shared_ptr<const Vocabulary> QwenVocab() {
  static std::shared_ptr<const Vocabulary> v = [] {
    absl::StatusOr<std::unique_ptr<language::Tokenizer>> tok = language::Tokenizer::Load(TokenizerDir());
    EXPECT_TRUE(tok.ok()) << tok.status();
    if (!tok.ok()) return std::shared_ptr<const Vocabulary>();
    absl::StatusOr<std::shared_ptr<const Vocabulary>> vocab = VocabularyFromTokenizer(**tok, 151936);
    EXPECT_TRUE(vocab.ok()) << vocab.status();
    return vocab.ok() ? *vocab : nullptr;
  }();
  return v;
}

// Schemas covering every supported feature; bounded ones have every string,
// array and recursion bounded.
struct SchemaCase {
  const char* name;
  const char* schema;
  bool bounded;
};
const std::vector<SchemaCase>& Cases() {
  static const std::vector<SchemaCase> cases = {
      {"person", R"({"type":"object","properties":{"name":{"type":"string","maxLength":12},
        "age":{"type":"integer","minimum":0,"maximum":150},"email":{"type":"string","format":"email"}},
        "required":["name","age"]})", false},
      {"bounded_object", R"({"type":"object","properties":{"id":{"type":"string","format":"uuid"},
        "tags":{"type":"array","items":{"type":"string","minLength":1,"maxLength":6},"maxItems":3},
        "score":{"type":"number","minimum":-1,"maximum":1},"ok":{"type":"boolean"},"day":{"type":"string","format":"date"}},
        "required":["id","tags","ok"]})", true},
      {"enum_anyof", R"({"type":"object","properties":{"color":{"enum":["red","green","blue"]},
        "v":{"anyOf":[{"type":"integer","minimum":-5,"maximum":5},{"type":"null"},{"const":"x"}]},
        "when":{"type":"string","format":"date-time"}},"required":["color","v"]})", true},
      {"nested_arrays", R"({"type":"array","items":{"type":"array","items":{"type":"integer","minimum":0,"maximum":99},
        "minItems":1,"maxItems":2},"minItems":1,"maxItems":3})", true},
      {"additional", R"({"type":"object","properties":{"k":{"type":"string","maxLength":3}},"required":["k"],
        "additionalProperties":{"type":"integer","minimum":0,"maximum":9}})", false},
      {"recursive", R"({"$defs":{"n":{"type":"object","properties":{"v":{"type":"integer","minimum":0,"maximum":9},
        "next":{"anyOf":[{"$ref":"#/$defs/n"},{"type":"null"}]}},"required":["v","next"]}},"$ref":"#/$defs/n"})", false},
      {"oneof_pattern", R"({"oneOf":[{"type":"string","pattern":"^[A-Z]{2}-[0-9]{3}$"},{"type":"integer","maximum":-1}]})",
       false},
      {"nullable_types", R"({"type":"object","properties":{"a":{"type":["string","null"],"maxLength":4},
        "b":{"type":"number"}},"required":["a","b"],"additionalProperties":false})", false},
  };
  return cases;
}

std::shared_ptr<const CompiledGrammar> Compile(const std::string& schema,
                                               std::shared_ptr<const Vocabulary> vocab) {
  absl::StatusOr<std::shared_ptr<const Grammar>> g = CompileJsonSchema(schema);
  EXPECT_TRUE(g.ok()) << schema << ": " << g.status();
  if (!g.ok()) return nullptr;
  return std::make_shared<CompiledGrammar>(*g, std::move(vocab));
}

bool Bit(const std::vector<uint32_t>& mask, int32_t id) { return (mask[id >> 5] >> (id & 31)) & 1; }

// FillMask equals the uncached reference for every token of the vocabulary.
void ExpectMaskMatchesReference(Matcher& m, const std::string& where) {
  const Vocabulary& v = m.compiled().vocab();
  std::vector<uint32_t> mask(v.mask_words());
  m.FillMask(mask.data());
  int mismatches = 0;
  for (int32_t id = 0; id < v.size(); ++id) {
    const bool expected = m.IsTokenAllowedUncached(id);
    if (Bit(mask, id) != expected && ++mismatches <= 5) {
      ADD_FAILURE() << where << ": token " << id << " \"" << v.token(id) << "\" mask " << Bit(mask, id)
                    << " reference " << expected;
    }
  }
  EXPECT_EQ(mismatches, 0) << where;
}

struct Walk {
  std::string text;
  bool terminated = false;
  int steps = 0;
};

// Picks allowed tokens at random (the stop token with probability 1/2 once
// allowed) until termination or max_steps; checks each mask on the way if
// `check_every` > 0 (every n-th step).
Walk RandomWalk(std::shared_ptr<const CompiledGrammar> cg, uint32_t seed, int max_steps, int check_every,
                const std::string& name) {
  const Vocabulary& v = cg->vocab();
  Matcher m(cg);
  std::mt19937 rng(seed);
  std::vector<uint32_t> mask(v.mask_words());
  Walk w;
  for (; w.steps < max_steps && !m.IsTerminated(); ++w.steps) {
    if (check_every > 0 && w.steps % check_every == 0) {
      ExpectMaskMatchesReference(m, name + " step " + std::to_string(w.steps) + " after \"" + w.text + "\"");
    }
    m.FillMask(mask.data());
    std::vector<int32_t> allowed;
    for (int32_t id = 0; id < v.size(); ++id) {
      if (Bit(mask, id)) allowed.push_back(id);
    }
    if (allowed.empty()) {
      ADD_FAILURE() << name << ": no token allowed after \"" << w.text << "\"";
      break;
    }
    int32_t pick = allowed[rng() % allowed.size()];
    if (m.CanEnd() && rng() % 2 == 0) pick = v.stop_tokens()[0];
    EXPECT_TRUE(m.AcceptToken(pick)) << name << ": token " << pick << " from the mask was refused";
    if (!v.is_stop(pick)) w.text += v.token(pick);
  }
  w.terminated = m.IsTerminated();
  return w;
}

void ExpectValid(const std::string& text, const char* schema_text, const std::string& where) {
  json value = json::parse(text, nullptr, false);
  ASSERT_FALSE(value.is_discarded()) << where << ": not JSON: " << text;
  const json schema = json::parse(schema_text);
  std::string why;
  EXPECT_TRUE(testing::Validate(value, schema, schema, &why)) << where << ": " << why << "\n" << text;
}

TEST(GrammarMatcherTest, SyntheticVocabularyMasksMatchBruteForceAndWalksValidate) {
  for (const SchemaCase& c : Cases()) {
    auto cg = Compile(c.schema, SyntheticVocab());
    ASSERT_TRUE(cg);
    int terminated = 0;
    for (uint32_t seed = 0; seed < 12; ++seed) {
      Walk w = RandomWalk(cg, seed, 600, seed < 3 ? 1 : 0, c.name);
      if (c.bounded) {
        EXPECT_TRUE(w.terminated) << c.name << " seed " << seed << " did not end: " << w.text;
      }
      if (w.terminated) {
        ++terminated;
        ExpectValid(w.text, c.schema, std::string(c.name) + " seed " + std::to_string(seed));
      }
    }
    EXPECT_GE(terminated, 6) << c.name;
  }
}

TEST(GrammarMatcherTest, BoundedSchemaTerminatesWithinItsLongestOutput) {
  // A stop is never picked voluntarily: the walk must still end, because
  // the grammar runs out of non-stop tokens.
  const char* schema = R"({"type":"object","properties":{"a":{"type":"string","maxLength":5},
      "b":{"type":"array","items":{"enum":[1,22,333]},"maxItems":4}},"required":["a","b"]})";
  auto cg = Compile(schema, SyntheticVocab());
  ASSERT_TRUE(cg);
  const int bound = static_cast<int>(std::string(R"({ "a": "\u0000\u0000\u0000\u0000\u0000", "b": [ 333, 333, 333, 333 ] })").size());
  for (uint32_t seed = 0; seed < 20; ++seed) {
    Matcher m(cg);
    std::mt19937 rng(seed);
    std::vector<uint32_t> mask(cg->vocab().mask_words());
    std::string text;
    int steps = 0;
    while (!m.IsTerminated() && steps <= bound) {
      m.FillMask(mask.data());
      std::vector<int32_t> allowed;
      for (int32_t id = 1; id < cg->vocab().size(); ++id) {
        if (Bit(mask, id)) allowed.push_back(id);
      }
      int32_t pick = allowed.empty() ? 0 : allowed[rng() % allowed.size()];
      ASSERT_TRUE(m.AcceptToken(pick));
      if (pick) text += cg->vocab().token(pick);
      ++steps;
    }
    EXPECT_TRUE(m.IsTerminated()) << text;
    EXPECT_LE(static_cast<int>(text.size()), bound);
    ExpectValid(text, schema, "bounded seed " + std::to_string(seed));
  }
}

TEST(GrammarMatcherTest, StopTokenRollbackAndTermination) {
  auto cg = Compile(R"({"type":"array","items":{"type":"integer"},"maxItems":2})", SyntheticVocab());
  ASSERT_TRUE(cg);
  Matcher m(cg);
  const Vocabulary& v = cg->vocab();
  auto id_of = [&](const std::string& s) {
    for (int32_t id = 1; id < v.size(); ++id) {
      if (v.token(id) == s) return id;
    }
    return -1;
  };
  std::vector<uint32_t> start(v.mask_words()), mask(v.mask_words());
  m.FillMask(start.data());
  EXPECT_FALSE(Bit(start, 0));
  EXPECT_FALSE(m.AcceptToken(0));
  ASSERT_TRUE(m.AcceptToken(id_of("[")));
  ASSERT_TRUE(m.AcceptToken(id_of("12")));
  EXPECT_FALSE(m.AcceptToken(id_of("}")));
  EXPECT_EQ(m.num_accepted(), 2);
  ASSERT_TRUE(m.AcceptToken(id_of("]")));
  EXPECT_TRUE(m.CanEnd());
  m.FillMask(mask.data());
  EXPECT_TRUE(Bit(mask, 0));
  EXPECT_FALSE(Bit(mask, id_of(",")));
  ASSERT_TRUE(m.Rollback(3));
  m.FillMask(mask.data());
  EXPECT_EQ(mask, start);
  EXPECT_FALSE(m.Rollback(1));
  for (const char* t : {"[", "12", ",", "-0"}) {
    if (std::string(t) == "-0") {
      EXPECT_FALSE(m.AcceptToken(id_of(t)));  // "-0" is not a canonical integer
      break;
    }
    ASSERT_TRUE(m.AcceptToken(id_of(t))) << t;
  }
  ASSERT_TRUE(m.AcceptToken(id_of("5")));
  ASSERT_TRUE(m.AcceptToken(id_of("]")));
  ASSERT_TRUE(m.AcceptToken(0));
  EXPECT_TRUE(m.IsTerminated());
  m.FillMask(mask.data());
  EXPECT_TRUE(std::all_of(mask.begin(), mask.end(), [](uint32_t w) { return w == 0; }));
  EXPECT_FALSE(m.AcceptToken(id_of("5")));
  ASSERT_TRUE(m.Rollback(1));
  EXPECT_FALSE(m.IsTerminated());
  EXPECT_TRUE(m.CanEnd());
}

TEST(GrammarVocabularyTest, ByteLevelDecodeInvertsGpt2Mapping) {
  EXPECT_EQ(*ByteLevelDecode("\xc4\xa0hello"), " hello");  // "Ġhello"
  EXPECT_EQ(*ByteLevelDecode("\xc4\x8a"), "\n");          // "Ċ"
  EXPECT_EQ(*ByteLevelDecode("\xc3\xa9"), "\xe9");        // 'é' stands for byte 0xE9
  EXPECT_FALSE(ByteLevelDecode(" ").ok());                  // a raw space is not in the mapping
  EXPECT_FALSE(ByteLevelDecode("\xe4\xb8\x80").ok());
}

TEST(GrammarVocabularyTest, TrieSpellsEveryTokenOnce) {
  auto v = *Vocabulary::Create({"", "ab", "a", "abc", "b", "ab", "", std::string("\xff\x00", 2)}, {0});
  std::vector<std::string> path(v->max_token_bytes() + 1);
  std::vector<int> seen(v->size(), 0);
  for (int32_t node = 1; node < v->trie_size(); ++node) {
    const int32_t d = v->trie_depth(node);
    path[d] = path[d - 1] + static_cast<char>(v->trie_byte(node));
    EXPECT_GT(v->trie_end(node), node);
    for (int32_t k = v->trie_token_begin(node); k < v->trie_token_begin(node + 1); ++k) {
      const int32_t id = v->trie_tokens()[k];
      EXPECT_EQ(path[d], v->token(id));
      ++seen[id];
    }
  }
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 1, 1, 1, 1, 0, 1}));  // stop and empty ids are not in the trie
  EXPECT_EQ(v->trie_size(), 1 + 3 + 1 + 2);                    // root, a-b-c, b, ff-00
  EXPECT_FALSE(Vocabulary::Create({"a"}, {5}).ok());
}

TEST(GrammarMatcherTest, MaskLogitsKeepsOnlyAllowedIds) {
  std::vector<uint32_t> mask = {0b1010u, 1u};  // ids 1, 3 and 32
  std::vector<float> logits(40, 2.0f);
  MaskLogits(mask.data(), 33, logits.data(), 40);
  for (int i = 0; i < 40; ++i) {
    EXPECT_EQ(std::isinf(logits[i]), !(i == 1 || i == 3 || i == 32)) << i;
  }
}

TEST(GrammarMatcherTest, CacheSharesCompiledGrammars) {
  GrammarCache cache(SyntheticVocab(), 2);
  auto a = cache.Get(GrammarKind::kJsonSchema, R"({"type":"integer"})");
  auto b = cache.Get(GrammarKind::kJsonSchema, R"({"type":"integer"})");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->get(), b->get());
  EXPECT_EQ(cache.hits(), 1);
  auto bad = cache.Get(GrammarKind::kJsonSchema, R"({"type":"integer","not":{}})");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  auto schema_true = cache.Get(GrammarKind::kJsonSchema, "true");
  auto regex_true = cache.Get(GrammarKind::kRegex, "true");  // same text, other kind
  ASSERT_TRUE(schema_true.ok() && regex_true.ok());
  EXPECT_NE(schema_true->get(), regex_true->get());
  EXPECT_EQ((*regex_true)->grammar().MinOutputBytes(), 4);
  EXPECT_EQ(cache.size(), 2u);  // capacity 2: the integer schema was evicted
  auto again = cache.Get(GrammarKind::kJsonSchema, R"({"type":"integer"})");
  ASSERT_TRUE(again.ok());
  EXPECT_NE(again->get(), a->get());
}

TEST(GrammarMatcherTest, RegexAndJsonModeMasksMatchBruteForce) {
  for (const char* pattern : {"[a-z]{1,8}@[a-z]+\\.(com|org)", "-?(0|[1-9][0-9]*)(\\.[0-9]+)?", "(ab|c)*d{2,3}"}) {
    auto g = CompileRegex(pattern);
    ASSERT_TRUE(g.ok()) << g.status();
    auto cg = std::make_shared<CompiledGrammar>(*g, SyntheticVocab());
    for (uint32_t seed = 0; seed < 3; ++seed) {
      Walk w = RandomWalk(cg, seed, 200, 1, pattern);
      if (w.terminated) {
        EXPECT_TRUE(std::regex_match(w.text, std::regex(pattern))) << pattern << ": " << w.text;
      }
    }
  }
  for (bool object_only : {false, true}) {
    auto g = CompileJsonMode(object_only);
    ASSERT_TRUE(g.ok());
    auto cg = std::make_shared<CompiledGrammar>(*g, SyntheticVocab());
    for (uint32_t seed = 0; seed < 4; ++seed) {
      Walk w = RandomWalk(cg, seed, 300, 1, "json mode");
      if (!w.terminated) continue;
      json v = json::parse(w.text, nullptr, false);
      EXPECT_FALSE(v.is_discarded()) << w.text;
      if (object_only) {
        EXPECT_TRUE(v.is_object()) << w.text;
      }
    }
  }
}

TEST(GrammarMatcherTest, QwenVocabularyMasksMatchBruteForceAtSampledStates) {
  std::shared_ptr<const Vocabulary> qwen = QwenVocab();
  ASSERT_TRUE(qwen) << "the Qwen3 tokenizer is expected in " << TokenizerDir() << " (scripts/setup.sh)";
  EXPECT_EQ(qwen->size(), 151936);
  int validated = 0;
  for (const SchemaCase& c : Cases()) {
    auto cg = Compile(c.schema, qwen);
    ASSERT_TRUE(cg);
    // Full-vocabulary comparison at every 4th state of one walk, then two
    // more walks validated end to end.
    for (uint32_t seed = 0; seed < 3; ++seed) {
      Walk w = RandomWalk(cg, 100 + seed, 400, seed == 0 ? 4 : 0, std::string("qwen ") + c.name);
      if (w.terminated) {
        ++validated;
        ExpectValid(w.text, c.schema, std::string("qwen ") + c.name);
      }
    }
  }
  EXPECT_GE(validated, 12);
}

TEST(GrammarMatcherTest, QwenTokensCrossJsonBoundaries) {
  std::shared_ptr<const Vocabulary> qwen = QwenVocab();
  ASSERT_TRUE(qwen);
  auto cg = Compile(R"({"type":"object","properties":{"a":{"type":"string"},"b":{"type":"integer"}},"required":["a","b"]})",
                    qwen);
  ASSERT_TRUE(cg);
  Matcher m(cg);
  ASSERT_TRUE(m.AcceptBytes("{\"a\": \"hello"));
  std::vector<uint32_t> mask(qwen->mask_words());
  m.FillMask(mask.data());
  // Tokens that close the string and open the next key in one piece.
  int crossing = 0;
  for (int32_t id = 0; id < qwen->size(); ++id) {
    const std::string& t = qwen->token(id);
    if (t == "\"," || t == "\", \"" || t == "\",\"") {
      EXPECT_TRUE(Bit(mask, id)) << t;
      ++crossing;
    }
    if (t == "\"}" || t == "\":") {
      EXPECT_FALSE(Bit(mask, id)) << t;
    }
  }
  EXPECT_GE(crossing, 2);
}

}  // namespace
}  // namespace vlm::grammar
