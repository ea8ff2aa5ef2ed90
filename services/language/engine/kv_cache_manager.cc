#include "services/language/engine/kv_cache_manager.h"

#include <algorithm>

namespace vlm::language {

KvCacheManager::KvCacheManager(int64_t num_blocks, int64_t block_size, bool prefix_cache)
    : block_size_(block_size), prefix_cache_(prefix_cache), pool_(num_blocks) {}

int64_t KvCacheManager::AcquirePrefix(KvBlocks& seq, absl::Span<const int32_t> tokens,
                                      absl::Span<const KeyedImageSpan> images, int64_t limit) {
  if (!prefix_cache_ || !seq.table.empty()) return 0;
  limit = std::min<int64_t>(limit, static_cast<int64_t>(tokens.size()) - 1);
  if (limit < block_size_) return 0;
  if (static_cast<int64_t>(seq.keys.size()) < limit / block_size_) {
    seq.keys = ComputeBlockKeys(tokens.subspan(0, limit), block_size_, images, seq.keys);
  }
  const int64_t candidates = limit / block_size_;
  for (int64_t b = 0; b < candidates; ++b) {
    std::optional<int32_t> block = pool_.Acquire(seq.keys[b]);
    if (!block) break;
    seq.table.push_back(*block);
  }
  seq.registered = seq.table.size();
  return static_cast<int64_t>(seq.table.size()) * block_size_;
}

bool KvCacheManager::Grow(KvBlocks& seq, int64_t num_tokens) {
  const int64_t need = BlocksFor(num_tokens) - static_cast<int64_t>(seq.table.size());
  if (need <= 0) return true;
  if (need > pool_.num_available()) return false;
  for (int64_t i = 0; i < need; ++i) seq.table.push_back(*pool_.Allocate());
  return true;
}

void KvCacheManager::RegisterFull(KvBlocks& seq, absl::Span<const int32_t> tokens,
                                  absl::Span<const KeyedImageSpan> images, int64_t computed) {
  if (!prefix_cache_) return;
  const size_t full = std::min<size_t>(computed / block_size_, seq.table.size());
  if (full <= seq.registered) return;
  if (seq.keys.size() < full) {
    seq.keys = ComputeBlockKeys(tokens.subspan(0, full * block_size_), block_size_, images,
                                seq.keys);
  }
  for (size_t b = seq.registered; b < full; ++b) pool_.Register(seq.table[b], seq.keys[b]);
  seq.registered = full;
}

void KvCacheManager::Free(KvBlocks& seq) {
  for (auto it = seq.table.rbegin(); it != seq.table.rend(); ++it) pool_.Release(*it);
  seq.table.clear();
  seq.registered = 0;
}

}  // namespace vlm::language
