// Regular expressions (a practical subset of ECMAScript / JSON Schema
// `pattern` syntax) translated into grammar expressions. The whole output
// must match: ^ and $ are implied, and accepted only at the ends.
//
// Supported: literal characters (UTF-8), escapes \d \D \w \W \s \S \n \r \t
// \f \v \0 \xHH \uHHHH and escaped punctuation, classes [...] with ranges and
// negation, '.', groups (...), (?:...), (?<name>...), alternation |,
// quantifiers * + ? {m} {m,} {m,n} (lazy '?' accepted, meaningless here).
// Refused with INVALID_ARGUMENT naming the feature: backreferences,
// lookaround, word boundaries, anchors inside the pattern; quantifier bounds
// above 1000 are RESOURCE_EXHAUSTED.
#pragma once

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/language/grammar/grammar.h"

namespace vlm::grammar {

enum class RegexEncoding {
  kUtf8,        // the text itself (a regex-constrained output)
  kJsonString,  // the inside of a JSON string: characters escaped as in char_set.h
};

absl::StatusOr<GrammarBuilder::ExprId> TranslateRegex(GrammarBuilder& b, absl::string_view pattern,
                                                      RegexEncoding encoding);

}  // namespace vlm::grammar
