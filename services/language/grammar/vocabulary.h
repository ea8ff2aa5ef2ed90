// The tokenizer's vocabulary as byte strings, with a byte trie over it, for
// computing token masks (matcher.h). Immutable and thread-safe once built.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace vlm::grammar {

class Vocabulary {
 public:
  // token_bytes[id]: the bytes token `id` decodes to; empty for ids a grammar
  // never produces (special/control tokens, unused ids). stop_tokens end the
  // output: allowed exactly when the grammar can end. The mask covers
  // token_bytes.size() ids (the model's vocabulary may be larger than the
  // tokenizer's: pad with empty strings).
  static absl::StatusOr<std::shared_ptr<const Vocabulary>> Create(
      std::vector<std::string> token_bytes, std::vector<int32_t> stop_tokens);

  int32_t size() const { return static_cast<int32_t>(tokens_.size()); }
  // 32-bit words of a token bitmask (bit i of word i/32 is token i).
  int32_t mask_words() const { return (size() + 31) / 32; }
  const std::string& token(int32_t id) const { return tokens_[id]; }
  const std::vector<int32_t>& stop_tokens() const { return stop_tokens_; }
  bool is_stop(int32_t id) const { return id >= 0 && id < size() && is_stop_[id]; }
  int max_token_bytes() const { return max_len_; }

  // Byte trie in preorder: node 0 is the root (empty prefix); node i's
  // subtree is [i, trie_end(i)); the tokens ending at nodes [a, b) are
  // trie_tokens()[trie_token_begin(a) .. trie_token_begin(b)).
  int32_t trie_size() const { return static_cast<int32_t>(byte_.size()); }
  uint8_t trie_byte(int32_t node) const { return byte_[node]; }
  int32_t trie_depth(int32_t node) const { return depth_[node]; }
  int32_t trie_end(int32_t node) const { return end_[node]; }
  int32_t trie_token_begin(int32_t node) const { return token_begin_[node]; }
  const std::vector<int32_t>& trie_tokens() const { return token_ids_; }

 private:
  Vocabulary() = default;
  std::vector<std::string> tokens_;
  std::vector<int32_t> stop_tokens_;
  std::vector<uint8_t> is_stop_;
  int max_len_ = 0;
  std::vector<uint8_t> byte_;
  std::vector<int32_t> depth_, end_, token_begin_, token_ids_;
};

// Bytes of a byte-level BPE vocabulary entry (GPT-2's byte-to-unicode
// mapping, as in Qwen's tokenizer.json: "Ġ" is ' ', "Ċ" is '\n').
// INVALID_ARGUMENT if a character is not part of the mapping.
absl::StatusOr<std::string> ByteLevelDecode(absl::string_view token);

}  // namespace vlm::grammar
