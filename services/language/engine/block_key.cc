#include "services/language/engine/block_key.h"

#include <algorithm>
#include <cstring>

#include "common/sha256.h"

namespace vlm::language {
namespace {

BlockKey FromDigest(const Sha256Digest& d) {
  BlockKey k;
  std::memcpy(&k.hi, d.data(), 8);
  std::memcpy(&k.lo, d.data() + 8, 8);
  return k;
}

}  // namespace

std::string BlockKey::Hex() const {
  uint8_t bytes[16];
  std::memcpy(bytes, &hi, 8);
  std::memcpy(bytes + 8, &lo, 8);
  return HexEncode(bytes, sizeof bytes);
}

struct ImageKeyBuilder::State {
  Sha256Hasher hasher;
};

ImageKeyBuilder::ImageKeyBuilder(int64_t t, int64_t h, int64_t w) : state_(new State) {
  const int64_t grid[3] = {t, h, w};
  state_->hasher.Update("vlm-image-key-v1", 16);
  state_->hasher.Update(grid, sizeof grid);
}
ImageKeyBuilder::~ImageKeyBuilder() { delete state_; }

void ImageKeyBuilder::AddTensor(int dtype_tag, const void* data, size_t bytes) {
  const int64_t header[2] = {dtype_tag, static_cast<int64_t>(bytes)};
  state_->hasher.Update(header, sizeof header);
  state_->hasher.Update(data, bytes);
}

BlockKey ImageKeyBuilder::Finish() { return FromDigest(state_->hasher.Finish()); }

std::vector<BlockKey> ComputeBlockKeys(absl::Span<const int32_t> tokens, int64_t block_size,
                                       absl::Span<const KeyedImageSpan> images,
                                       absl::Span<const BlockKey> from_keys) {
  const int64_t full = static_cast<int64_t>(tokens.size()) / block_size;
  std::vector<BlockKey> keys(from_keys.begin(), from_keys.end());
  if (static_cast<int64_t>(keys.size()) > full) keys.resize(full);
  Sha256Hasher hasher;
  size_t image = 0;
  for (int64_t b = static_cast<int64_t>(keys.size()); b < full; ++b) {
    const int64_t begin = b * block_size, end = begin + block_size;
    const BlockKey parent = b == 0 ? BlockKey{} : keys[b - 1];
    hasher.Update(&parent, sizeof parent);
    hasher.Update(tokens.data() + begin, block_size * sizeof(int32_t));
    while (image < images.size() && images[image].start + images[image].length <= begin) ++image;
    for (size_t i = image; i < images.size() && images[i].start < end; ++i) {
      const KeyedImageSpan& span = images[i];
      const int64_t lo = std::max(begin, span.start);
      const int64_t hi = std::min(end, span.start + span.length);
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t offset = p - span.start;
        hasher.Update(&span.key, sizeof span.key);
        hasher.Update(&offset, sizeof offset);
      }
    }
    keys.push_back(FromDigest(hasher.Finish()));
  }
  return keys;
}

}  // namespace vlm::language
