// The KV cache's block pool: fixed-size blocks (block_size tokens each) named
// by ids 0..num_blocks-1, with reference counts, a free list, and a cache of
// full blocks keyed by their prefix key (block_key.h) so identical prefixes
// share blocks. A block is in exactly one of three states:
//   free       ref 0, no key          on the free list
//   cached     ref 0, keyed           on the LRU list (still reusable by key)
//   in use     ref >= 1 (keyed or not)
// Allocate takes a free block, else evicts the least recently released cached
// block (its key is forgotten). Free blocks are handed out lowest id first and
// a released block is reused before any never-used one, so the blocks ever
// used (num_touched: their storage pages are committed) stay as few as the
// load allows. Thread-safety: none (the engine thread owns it).
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "services/language/engine/block_key.h"

namespace vlm::language {

class BlockPool {
 public:
  explicit BlockPool(int64_t num_blocks);

  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  // Blocks Allocate can still hand out (free + cached unreferenced).
  int64_t num_available() const { return static_cast<int64_t>(free_.size() + lru_.size()); }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }   // no key, ref 0
  int64_t num_cached() const { return static_cast<int64_t>(lru_.size()); }  // keyed, ref 0
  int64_t num_used() const { return num_blocks() - num_available(); }       // ref >= 1
  // Blocks handed out at least once since construction.
  int64_t num_touched() const { return touched_; }

  // A block with ref 1 and no key; nullopt when every block is in use.
  std::optional<int32_t> Allocate();
  // The block registered under `key`, with one more reference (leaving the
  // LRU if it was unreferenced); nullopt when the key is unknown.
  std::optional<int32_t> Acquire(const BlockKey& key);
  bool Contains(const BlockKey& key) const { return by_key_.contains(key); }
  // Registers the full, in-use `block` under `key`. If another block already
  // holds that key the existing one stays the cache entry and `block` stays
  // unkeyed (it returns to the free list when released). A block keeps its
  // first key.
  void Register(int32_t block, const BlockKey& key);
  // Drops one reference; at 0 a keyed block becomes cached (most recently
  // used end of the LRU), an unkeyed one free.
  void Release(int32_t block);

  int32_t ref_count(int32_t block) const { return blocks_[block].ref; }
  bool keyed(int32_t block) const { return blocks_[block].key.has_value(); }
  // "blocks=8 used=2 cached=1 free=5 | 0:r1 1:r1,k 2:k(lru0)": for tests and logs.
  std::string DebugString() const;

 private:
  struct Block {
    int32_t ref = 0;
    bool touched = false;  // handed out at least once
    std::optional<BlockKey> key;
    std::list<int32_t>::iterator lru_pos;  // valid while cached
  };
  std::vector<Block> blocks_;
  std::vector<int32_t> free_;                         // stack: lowest ids handed out first
  std::list<int32_t> lru_;                            // cached blocks, least recent first
  absl::flat_hash_map<BlockKey, int32_t, BlockKeyHash> by_key_;
  int64_t touched_ = 0;
};

}  // namespace vlm::language
