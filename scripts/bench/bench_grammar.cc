// vlm-bench-grammar: structured-output costs on the real Qwen3 vocabulary.
//
//   vlm-bench-grammar [--model DIR] [--steps 64] [--repeat 5]
//
// For a few schemas: compile time (schema -> automaton), then one generation
// of --steps tokens chosen at random among the allowed ones (fixed seed),
// replayed: the first pass fills the per-state token cache (cold), later
// passes reuse it (warm). Columns: median compile ms; states of the
// automaton; cold ms per step (mean, includes the trie walks); warm mask µs
// per step (median and 90th percentile over steps, median over --repeat
// passes);
// accept µs per token; and the bound the cache replaces: checking every
// token of the vocabulary against the automaton directly, ms per step.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "services/language/grammar/json_schema.h"
#include "services/language/grammar/matcher.h"
#include "services/language/grammar/tokenizer_vocabulary.h"
#include "services/language/text/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace vlm::grammar;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string DefaultModelDir() {
  if (const char* cache = std::getenv("VLM_CACHE_DIR"); cache && *cache) {
    return std::string(cache) + "/tokenizer";
  }
  const char* home = std::getenv("HOME");
  return std::string(home ? home : "/root") + "/.cache/vlm/tokenizer";
}

enum class Kind { kSchema, kJsonObject, kRegex };

struct Case {
  const char* name;
  Kind kind;
  const char* text;
};

}  // namespace

int main(int argc, char** argv) {
  std::string model = DefaultModelDir();
  int steps = 64, repeat = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--model")) model = argv[i + 1];
    else if (!std::strcmp(argv[i], "--steps")) steps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--repeat")) repeat = std::atoi(argv[i + 1]);
  }
  auto t0 = Clock::now();
  auto tok = vlm::language::Tokenizer::Load(model);
  if (!tok.ok()) {
    std::fprintf(stderr, "tokenizer: %s\n", std::string(tok.status().message()).c_str());
    return 1;
  }
  auto vocab = VocabularyFromTokenizer(**tok, 151936);
  if (!vocab.ok()) {
    std::fprintf(stderr, "vocabulary: %s\n", std::string(vocab.status().message()).c_str());
    return 1;
  }
  std::printf("vocabulary: %d ids, %d trie nodes, built in %.0f ms (with tokenizer load)\n\n",
              (*vocab)->size(), (*vocab)->trie_size(), Ms(Clock::now() - t0));

  const std::vector<Case> cases = {
      {"person (3 props, email)", Kind::kSchema,
       R"({"type":"object","properties":{"name":{"type":"string","maxLength":40},
        "age":{"type":"integer","minimum":0,"maximum":150},"email":{"type":"string","format":"email"}},
        "required":["name","age","email"]})"},
      {"tool call (8 props, enum, array)", Kind::kSchema,
       R"({"type":"object","properties":{"function":{"enum":["get_weather","search","book_flight"]},
        "city":{"type":"string"},"country":{"type":"string","minLength":2,"maxLength":2},
        "date":{"type":"string","format":"date"},"days":{"type":"integer","minimum":1,"maximum":14},
        "units":{"enum":["metric","imperial"]},"tags":{"type":"array","items":{"type":"string"},"maxItems":5},
        "confidence":{"type":"number","minimum":0,"maximum":1}},
        "required":["function","city","country","date","days","units","tags","confidence"],
        "additionalProperties":false})"},
      {"recursive tree ($ref)", Kind::kSchema,
       R"({"$defs":{"node":{"type":"object","properties":{"name":{"type":"string"},
        "children":{"type":"array","items":{"$ref":"#/$defs/node"}}},"required":["name","children"]}},
        "$ref":"#/$defs/node"})"},
      {"json_object mode", Kind::kJsonObject, ""},
      {"4 strings maxLength 64", Kind::kSchema,
       R"({"type":"object","properties":{"a":{"type":"string","maxLength":64},"b":{"type":"string","maxLength":64},
        "c":{"type":"string","maxLength":64},"d":{"type":"string","maxLength":64}},"required":["a","b","c","d"]})"},
      {"regex (phone)", Kind::kRegex, R"(\+?[0-9]{1,3}[ -]?\(?[0-9]{3}\)?[ -]?[0-9]{3}-[0-9]{4})"},
  };

  std::printf("| grammar | compile ms | states | steps | cold ms/step | warm mask us/step (median) | warm p90 us | accept us | all-token check ms/step |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  const int words = (*vocab)->mask_words();
  std::vector<uint32_t> mask(words);
  for (const Case& c : cases) {
    std::vector<double> compile_ms;
    std::shared_ptr<const Grammar> grammar;
    for (int r = 0; r < repeat; ++r) {
      auto s = Clock::now();
      absl::StatusOr<std::shared_ptr<const Grammar>> g =
          c.kind == Kind::kSchema ? CompileJsonSchema(c.text)
          : c.kind == Kind::kJsonObject ? CompileJsonMode(true)
                                               : CompileRegex(c.text);
      compile_ms.push_back(Ms(Clock::now() - s));
      if (!g.ok()) {
        std::fprintf(stderr, "%s: %s\n", c.name, std::string(g.status().message()).c_str());
        return 1;
      }
      grammar = *g;
    }
    auto cg = std::make_shared<CompiledGrammar>(grammar, *vocab);
    // Cold pass: choose the tokens.
    std::mt19937 rng(1);
    std::vector<int32_t> chosen;
    Matcher m(cg);
    double cold_mask_ms = 0;
    for (int i = 0; i < steps && !m.IsTerminated(); ++i) {
      auto s = Clock::now();
      m.FillMask(mask.data());
      cold_mask_ms += Ms(Clock::now() - s);
      std::vector<int32_t> allowed;
      for (int32_t id = 0; id < (*vocab)->size(); ++id) {
        if ((mask[id >> 5] >> (id & 31)) & 1) allowed.push_back(id);
      }
      int32_t pick = allowed[rng() % allowed.size()];
      // Prefer continuing over stopping so every case runs its steps.
      if ((*vocab)->is_stop(pick) && allowed.size() > 2) pick = allowed[(rng() % (allowed.size() - 2)) + 1];
      if ((*vocab)->is_stop(pick)) break;
      m.AcceptToken(pick);
      chosen.push_back(pick);
    }
    const double cold_per_step = chosen.empty() ? 0 : cold_mask_ms / chosen.size();
    // Warm passes: replay.
    std::vector<double> medians, maxes, accepts;
    for (int r = 0; r < repeat; ++r) {
      Matcher w(cg);
      std::vector<double> per_step;
      double accept_us = 0;
      for (int32_t id : chosen) {
        auto s = Clock::now();
        w.FillMask(mask.data());
        per_step.push_back(Ms(Clock::now() - s) * 1000);
        s = Clock::now();
        w.AcceptToken(id);
        accept_us += Ms(Clock::now() - s) * 1000;
      }
      medians.push_back(Median(per_step));
      std::sort(per_step.begin(), per_step.end());
      maxes.push_back(per_step.empty() ? 0 : per_step[per_step.size() * 9 / 10]);
      accepts.push_back(chosen.empty() ? 0 : accept_us / chosen.size());
    }
    // The bound: every token checked against the automaton, at a few steps.
    Matcher b(cg);
    std::vector<double> brute;
    for (size_t i = 0; i < chosen.size(); ++i) {
      if (i % 16 == 0) {
        auto s = Clock::now();
        int allowed = 0;
        for (int32_t id = 0; id < (*vocab)->size(); ++id) allowed += b.IsTokenAllowedUncached(id);
        brute.push_back(Ms(Clock::now() - s));
        (void)allowed;
      }
      b.AcceptToken(chosen[i]);
    }
    std::printf("| %s | %.2f | %d | %zu | %.1f | %.0f | %.0f | %.1f | %.1f |\n", c.name, Median(compile_ms),
                grammar->num_states(), chosen.size(), cold_per_step, Median(medians), Median(maxes), Median(accepts),
                Median(brute));
    std::fflush(stdout);
  }
  std::printf("\n%d steps per grammar (fewer if the output ended); medians of %d passes.\n", steps, repeat);
  return 0;
}
