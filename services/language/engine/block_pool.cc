#include "services/language/engine/block_pool.h"

#include <cassert>

#include "absl/strings/str_cat.h"

namespace vlm::language {

BlockPool::BlockPool(int64_t num_blocks) : blocks_(static_cast<size_t>(num_blocks)) {
  free_.reserve(blocks_.size());
  for (int64_t i = num_blocks - 1; i >= 0; --i) free_.push_back(static_cast<int32_t>(i));
}

std::optional<int32_t> BlockPool::Allocate() {
  int32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    id = lru_.front();  // evict the least recently used cached block
    lru_.pop_front();
    by_key_.erase(*blocks_[id].key);
    blocks_[id].key.reset();
  } else {
    return std::nullopt;
  }
  blocks_[id].ref = 1;
  if (!blocks_[id].touched) {
    blocks_[id].touched = true;
    ++touched_;
  }
  return id;
}

std::optional<int32_t> BlockPool::Acquire(const BlockKey& key) {
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return std::nullopt;
  Block& b = blocks_[it->second];
  if (b.ref == 0) lru_.erase(b.lru_pos);
  ++b.ref;
  return it->second;
}

void BlockPool::Register(int32_t block, const BlockKey& key) {
  Block& b = blocks_[block];
  assert(b.ref > 0);
  if (b.key.has_value() || by_key_.contains(key)) return;
  b.key = key;
  by_key_.emplace(key, block);
}

void BlockPool::Release(int32_t block) {
  Block& b = blocks_[block];
  assert(b.ref > 0);
  if (--b.ref > 0) return;
  if (b.key.has_value()) {
    b.lru_pos = lru_.insert(lru_.end(), block);
  } else {
    free_.push_back(block);
  }
}

std::string BlockPool::DebugString() const {
  std::string out = absl::StrCat("blocks=", num_blocks(), " used=", num_used(),
                                 " cached=", num_cached(), " free=", num_free(), " |");
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const Block& b = blocks_[i];
    if (b.ref == 0 && !b.key) continue;
    absl::StrAppend(&out, " ", i, ":");
    if (b.ref > 0) absl::StrAppend(&out, "r", b.ref, b.key ? ",k" : "");
    else absl::StrAppend(&out, "k");
  }
  return out;
}

}  // namespace vlm::language
