// Token masks for a compiled grammar over a vocabulary.
//
// CompiledGrammar pairs a Grammar with a Vocabulary and caches, per
// automaton state, which tokens are decided by that state alone (xgrammar's
// "context-independent" tokens): walking the vocabulary's byte trie once
// from the state, with the caller's stack unknown, sorts every token into
// accepted (its bytes stay inside the state's rule), rejected (dead inside
// the rule, and the rule cannot end before the token dies) or uncertain (the
// rule can end mid-token, so the rest depends on the callers). Matcher fills
// a mask by OR-ing the cached sets of its current states and checking only
// the uncertain tokens against its real stack.
//
// Matcher keeps a set of configurations (state, stack); stacks are
// persistent (frames in an append-only arena, shared by parents), so a step
// copies nothing and Rollback() only truncates.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "services/language/grammar/grammar.h"
#include "services/language/grammar/vocabulary.h"

namespace vlm::grammar {

// Thread-safe: the mask cache is shared by all matchers of the grammar.
class CompiledGrammar {
 public:
  CompiledGrammar(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const Vocabulary> vocab);

  const Grammar& grammar() const { return *grammar_; }
  const Vocabulary& vocab() const { return *vocab_; }
  // States whose token sets have been computed so far.
  size_t cached_states() const;

  // Per-state token classification (see the file comment).
  struct StateTokens {
    bool stores_rejected = false;  // ids lists rejected tokens (else accepted ones)
    std::vector<int32_t> ids;
    std::vector<int32_t> uncertain;
  };
  const StateTokens& TokensFor(int32_t state) const;
  // The id of the token that is exactly byte b, or -1.
  int32_t ByteToken(uint8_t b) const { return byte_token_[b]; }

 private:
  std::shared_ptr<const Grammar> grammar_;
  std::shared_ptr<const Vocabulary> vocab_;
  int32_t byte_token_[256];
  mutable std::mutex mu_;
  mutable absl::flat_hash_map<int32_t, std::unique_ptr<StateTokens>> cache_;
};

// One sequence's position in the grammar. Not thread-safe.
class Matcher {
 public:
  explicit Matcher(std::shared_ptr<const CompiledGrammar> grammar);

  // Consumes a token; false (state unchanged) if the token is not allowed.
  // A stop token is allowed exactly when CanEnd(), and terminates.
  bool AcceptToken(int32_t id);
  // Consumes raw bytes (forced text); false (state unchanged) if not allowed.
  bool AcceptBytes(absl::string_view bytes);
  // Sets bit i of mask[i / 32] iff token i is allowed now; mask has
  // vocab().mask_words() words. After termination no bit is set.
  void FillMask(uint32_t* mask);
  // True if the output so far is complete (a stop token is allowed).
  bool CanEnd() const;
  // Bytes of the shortest completion from here (0 when CanEnd()).
  int64_t MinBytesToEnd() const;
  // MinBytesToEnd() after token `id`, without consuming it; -1 if `id` is
  // not allowed (0 for an allowed stop token).
  int64_t MinBytesToEndAfter(int32_t id);
  // Budget enforcement: the allowed tokens after which a complete output
  // still fits in `tokens_left` - 1 more tokens (one byte each, plus the
  // stop token): the stop token when CanEnd(), and the single-byte tokens on
  // such a path. Never empty while MinBytesToEnd() + 1 <= tokens_left (every
  // byte has a token of its own in a byte-level vocabulary).
  void FillMaskWithinBudget(int64_t tokens_left, uint32_t* mask);
  // True once a stop token was accepted.
  bool IsTerminated() const { return history_.back().terminated; }
  // Undoes the last n accepted tokens (or AcceptBytes calls); false if
  // fewer were accepted.
  bool Rollback(int n);
  void Reset();
  int num_accepted() const { return static_cast<int>(history_.size()) - 1; }

  // Reference check without the cache: would `id` be accepted now? Tests
  // compare FillMask against it.
  bool IsTokenAllowedUncached(int32_t id);

  const CompiledGrammar& compiled() const { return *cg_; }

  struct Frame {
    int32_t ret;
    int32_t parent;
  };
  struct Config {
    int32_t state;
    int32_t frame;
  };

 private:
  struct Snapshot {
    std::vector<Config> set;  // closed set of configurations
    int flags = 0;
    size_t arena_size = 0;
    bool terminated = false;
  };
  // Steps the current set by `bytes`; on success *out holds the new set.
  bool Feed(absl::string_view bytes, Snapshot* out);
  // Whether `bytes` keep the current set alive; leaves the state unchanged.
  bool Alive(absl::string_view bytes);
  int64_t MinBytesToEnd(const std::vector<Config>& set) const;

  std::shared_ptr<const CompiledGrammar> cg_;
  const Grammar& g_;
  std::vector<Frame> arena_;
  std::vector<Snapshot> history_;  // back() is the current state
  std::vector<Config> scratch_a_, scratch_b_;
  std::vector<uint32_t> tmp_mask_;
};

// Sets logits[i] to -infinity for every id i < n whose bit in `mask` is 0
// (ids at or beyond mask_ids count as disallowed): the sampler then draws only
// allowed tokens, under any temperature / top-k / top-p.
void MaskLogits(const uint32_t* mask, int32_t mask_ids, float* logits, int32_t n);

}  // namespace vlm::grammar
