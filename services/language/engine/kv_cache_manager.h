// The KV cache manager: which blocks of the BlockPool each sequence holds,
// and the prefix cache over them. A sequence's blocks cover cache indices
// [0, blocks*block_size); entry i holds indices [i*block_size, (i+1)*block_size).
//
// Prefix cache (when enabled): a block full of computed tokens is registered
// under its prefix key (block_key.h), prompt or generated tokens alike, so a
// later request whose tokens start the same way (e.g. the next turn of a
// conversation, answer included) reuses it instead of recomputing. Matching
// never covers a whole prompt: its last token is always recomputed so its
// logits exist. Thread-safety: none (the engine thread owns it).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "services/language/engine/block_key.h"
#include "services/language/engine/block_pool.h"

namespace vlm::language {

// The blocks one sequence holds (owned through its KvCacheManager).
struct KvBlocks {
  std::vector<int32_t> table;  // block ids in cache-index order
  std::vector<BlockKey> keys;  // prefix keys of the sequence's full blocks computed so far
  size_t registered = 0;       // table[0, registered) are in the prefix cache
};

class KvCacheManager {
 public:
  KvCacheManager(int64_t num_blocks, int64_t block_size, bool prefix_cache);

  int64_t block_size() const { return block_size_; }
  bool prefix_cache() const { return prefix_cache_; }
  const BlockPool& pool() const { return pool_; }
  // Blocks needed for `tokens` cache indices: ceil(tokens / block_size).
  int64_t BlocksFor(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

  // For a sequence holding no blocks: takes a reference on the longest run of
  // cached blocks whose keys match tokens[0, limit) (limit < tokens.size():
  // the last token stays uncomputed) and returns the tokens they cover (a
  // multiple of block_size; 0 with the prefix cache off).
  int64_t AcquirePrefix(KvBlocks& seq, absl::Span<const int32_t> tokens,
                        absl::Span<const KeyedImageSpan> images, int64_t limit);
  // Grows the table to cover `num_tokens` cache indices. false, allocating
  // nothing, when the pool cannot supply the blocks (cached unreferenced
  // blocks are evicted first).
  bool Grow(KvBlocks& seq, int64_t num_tokens);
  // Registers the blocks now full of computed tokens (tokens[0, computed)).
  void RegisterFull(KvBlocks& seq, absl::Span<const int32_t> tokens,
                    absl::Span<const KeyedImageSpan> images, int64_t computed);
  // Releases every block (last block first, so the LRU evicts a sequence's
  // tail before its shared head). Keys stay: they depend on tokens only.
  void Free(KvBlocks& seq);

 private:
  int64_t block_size_;
  bool prefix_cache_;
  BlockPool pool_;
};

}  // namespace vlm::language
