#include "services/language/grammar/tokenizer_vocabulary.h"

#include "absl/strings/str_cat.h"

namespace vlm::grammar {

absl::StatusOr<std::shared_ptr<const Vocabulary>> VocabularyFromTokenizer(
    const language::Tokenizer& tokenizer, int32_t mask_size) {
  const int32_t n = tokenizer.vocab_size();
  if (mask_size == 0) mask_size = n;
  if (mask_size < n) {
    return absl::InvalidArgumentError(
        absl::StrCat("mask size ", mask_size, " is below the tokenizer's ", n, " ids"));
  }
  std::vector<std::string> bytes(mask_size);
  for (int32_t id = 0; id < n; ++id) {
    if (!tokenizer.IsValidId(id) || tokenizer.IsAdded(id)) continue;
    absl::StatusOr<std::string> token = tokenizer.IdToToken(id);
    if (!token.ok()) return token.status();
    absl::StatusOr<std::string> b = ByteLevelDecode(*token);
    if (!b.ok()) return b.status();
    bytes[id] = *std::move(b);
  }
  std::vector<int32_t> stops;
  for (int32_t id : {tokenizer.special_ids().im_end, tokenizer.special_ids().endoftext}) {
    if (id >= 0) stops.push_back(id);
  }
  return Vocabulary::Create(std::move(bytes), std::move(stops));
}

}  // namespace vlm::grammar
