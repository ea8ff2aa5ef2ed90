// Sets of Unicode code points and their byte-level encodings, shared by the
// regular-expression and JSON Schema translators.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "services/language/grammar/grammar.h"

namespace vlm::grammar {

inline constexpr uint32_t kMaxCodepoint = 0x10FFFF;

// Sorted, disjoint, non-adjacent inclusive ranges. Surrogates (D800-DFFF) are
// never members: they have no UTF-8 encoding.
class CodepointSet {
 public:
  CodepointSet() = default;
  static CodepointSet All();
  static CodepointSet Of(uint32_t cp) { return Range(cp, cp); }
  static CodepointSet Range(uint32_t lo, uint32_t hi);

  void Add(uint32_t lo, uint32_t hi);
  void AddSet(const CodepointSet& other);
  CodepointSet Complement() const;
  CodepointSet Intersect(const CodepointSet& other) const;
  bool Contains(uint32_t cp) const;
  bool empty() const { return ranges_.empty(); }
  const std::vector<std::pair<uint32_t, uint32_t>>& ranges() const { return ranges_; }

 private:
  void Normalize();
  std::vector<std::pair<uint32_t, uint32_t>> ranges_;
};

// One character of `set`, UTF-8 encoded.
GrammarBuilder::ExprId Utf8Chars(GrammarBuilder& b, const CodepointSet& set);

// One character of `set` as written inside a JSON string: printable
// characters raw (UTF-8), '"' and '\' as \" and \\, control characters as
// \b \f \n \r \t or \u00XX. Each character has exactly this one spelling, so
// every output decodes without surrogate escapes.
GrammarBuilder::ExprId JsonStringChars(GrammarBuilder& b, const CodepointSet& set);

// Appends the UTF-8 encoding of `cp` to `out`.
void AppendUtf8(uint32_t cp, std::string* out);

}  // namespace vlm::grammar
