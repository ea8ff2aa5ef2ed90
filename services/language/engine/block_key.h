// Prefix keys of full KV blocks (the prefix cache's identity):
//   key(block i) = SHA-256(key(block i-1), the block's token ids, and for
//                          every image-pad token in it: its image's key and
//                          the token's offset within that image)
// truncated to 128 bits. An image's key is SHA-256 over its grid and its
// feature bytes as received (last_hidden + deepstack), never only a
// client-supplied content hash, so a caller cannot poison the cache by sending
// other features under a known image's hash. Pure functions: thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"

namespace vlm::language {

struct BlockKey {
  uint64_t hi = 0, lo = 0;
  bool operator==(const BlockKey& o) const { return hi == o.hi && lo == o.lo; }
  bool operator!=(const BlockKey& o) const { return !(*this == o); }
  std::string Hex() const;
};
struct BlockKeyHash {
  size_t operator()(const BlockKey& k) const { return static_cast<size_t>(k.hi ^ (k.lo * 31)); }
};

// Where one image's pad tokens sit in a sequence: [start, start + length).
struct KeyedImageSpan {
  int64_t start = 0;
  int64_t length = 0;
  BlockKey key;  // ImageKey of its features
};

// SHA-256 over grid (t, h, w as int64) and each feature tensor's dtype tag
// and bytes, in order (last_hidden, then deepstack levels).
class ImageKeyBuilder {
 public:
  ImageKeyBuilder(int64_t t, int64_t h, int64_t w);
  ~ImageKeyBuilder();
  void AddTensor(int dtype_tag, const void* data, size_t bytes);
  BlockKey Finish();

 private:
  struct State;
  State* state_;
};

// Keys of the full blocks of tokens[0, n) (n / block_size of them), chained
// from the empty-prefix key. `images` sorted by start, non-overlapping.
// `from_keys` are keys of the first blocks already known (a prefix of the
// result): computing continues from there.
std::vector<BlockKey> ComputeBlockKeys(absl::Span<const int32_t> tokens, int64_t block_size,
                                       absl::Span<const KeyedImageSpan> images,
                                       absl::Span<const BlockKey> from_keys = {});

}  // namespace vlm::language
