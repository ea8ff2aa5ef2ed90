// The grammar vocabulary of a byte-level BPE tokenizer: base tokens as their
// bytes; added tokens (special or not) are never produced by a grammar;
// <|im_end|> and <|endoftext|> are the stop tokens.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "services/language/grammar/vocabulary.h"
#include "services/language/text/tokenizer.h"

namespace vlm::grammar {

// `mask_size`: ids the mask covers (the model's embedding rows, e.g. 151936;
// at least the tokenizer's vocab_size(); 0 means the tokenizer's).
absl::StatusOr<std::shared_ptr<const Vocabulary>> VocabularyFromTokenizer(
    const language::Tokenizer& tokenizer, int32_t mask_size = 0);

}  // namespace vlm::grammar
