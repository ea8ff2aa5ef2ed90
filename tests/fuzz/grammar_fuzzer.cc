// libFuzzer target: the structured-output compiler and matcher.
//
// Input: byte 0 selects the compiler (even: JSON Schema, odd: regex); the
// rest is the schema or pattern. Any text must give a status, never a crash
// or a hang (small limits keep each compile short). A compiled grammar must
// keep its contracts: the shortest output is finite; along a walk that
// follows the mask over a byte vocabulary, every token in the mask is
// accepted, the mask agrees with the uncached check, some token is always
// allowed until termination, and a schema's finished output is JSON.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "services/language/grammar/json_schema.h"
#include "services/language/grammar/matcher.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

using namespace vlm::grammar;

// Id 0 stops; ids 1..256 are the single bytes 0..255; then a few
// multi-byte pieces that cross JSON tokens.
std::shared_ptr<const Vocabulary> ByteVocab() {
  static auto v = [] {
    std::vector<std::string> t = {""};
    for (int b = 0; b < 256; ++b) t.push_back(std::string(1, static_cast<char>(b)));
    for (const char* s : {"\":", "\",\"", "\"}", "{\"", "true", "null", "12", "\\n", "]}"}) t.push_back(s);
    return *Vocabulary::Create(std::move(t), {0});
  }();
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0 || size > 4096) return 0;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  const bool schema = data[0] % 2 == 0;
  JsonFormat format;
  format.limits.max_expr_nodes = 20000;
  format.limits.max_nfa_states = 50000;
  format.limits.max_dfa_states = 2000;
  format.limits.max_compile_ms = 1000;
  absl::StatusOr<std::shared_ptr<const Grammar>> g =
      schema ? CompileJsonSchema(text, format) : CompileRegex(text, format.limits);
  if (!g.ok()) return 0;
  FUZZ_CHECK((*g)->MinOutputBytes() >= 0 && (*g)->MinOutputBytes() < (int64_t{1} << 40),
             "shortest output %lld", static_cast<long long>((*g)->MinOutputBytes()));
  auto cg = std::make_shared<CompiledGrammar>(*g, ByteVocab());
  const Vocabulary& v = cg->vocab();
  Matcher m(cg);
  std::vector<uint32_t> mask(v.mask_words());
  std::string out;
  uint32_t rng = static_cast<uint32_t>(size) * 2654435761u + data[0];
  for (int step = 0; step < 64 && !m.IsTerminated(); ++step) {
    m.FillMask(mask.data());
    std::vector<int32_t> allowed;
    for (int32_t id = 0; id < v.size(); ++id) {
      const bool bit = (mask[id >> 5] >> (id & 31)) & 1;
      FUZZ_CHECK(bit == m.IsTokenAllowedUncached(id), "mask bit of token %d differs from the automaton", id);
      if (bit) allowed.push_back(id);
    }
    FUZZ_CHECK(!allowed.empty(), "no token allowed after %zu bytes", out.size());
    rng = rng * 1103515245u + 12345u;
    // Lean towards stopping so walks finish.
    int32_t pick = m.CanEnd() && (rng >> 16) % 3 == 0 ? 0 : allowed[(rng >> 8) % allowed.size()];
    FUZZ_CHECK(m.AcceptToken(pick), "token %d from the mask was refused", pick);
    if (pick != 0) out += v.token(pick);
  }
  if (schema && m.IsTerminated()) {
    FUZZ_CHECK(nlohmann::json::accept(out), "schema output is not JSON: %s", out.c_str());
  }
  return 0;
}
