#include "services/vision/cache_key.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "services/vision/little_endian.h"

namespace vlm::vision {
namespace {

void HashContext(Sha256Hasher& hasher, const CacheKeyContext& context) {
  std::string fields;
  AppendI64(&fields, context.min_pixels);
  AppendI64(&fields, context.max_pixels);
  AppendU64(&fields, context.model_fingerprint.size());
  hasher.Update(fields);
  hasher.Update(context.model_fingerprint);
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

// ----------------------------------------------------------------------------
// Values

size_t FeatureDTypeSize(FeatureDType dtype) {
  switch (dtype) {
    case FeatureDType::kBF16:
    case FeatureDType::kF16:
      return 2;
    case FeatureDType::kF32:
      return 4;
  }
  return 0;
}

int64_t FeatureTensor::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

size_t CachedFeatures::ByteSize() const {
  size_t n = sizeof(CachedFeatures) + content_hash.size();
  auto add = [&n](const FeatureTensor& t) {
    n += t.data.size() + t.shape.size() * sizeof(int64_t);
  };
  add(last_hidden);
  for (const FeatureTensor& t : deepstack) {
    n += sizeof(FeatureTensor);
    add(t);
  }
  return n;
}

absl::Status CachedFeatures::Validate() const {
  if (grid_t <= 0 || grid_h <= 0 || grid_w <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("grid must be positive, got ", grid_t, "x", grid_h, "x", grid_w));
  }
  auto check = [](const FeatureTensor& t, const std::string& name) -> absl::Status {
    const size_t element = FeatureDTypeSize(t.dtype);
    if (element == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": unknown dtype ", static_cast<uint32_t>(t.dtype)));
    }
    if (t.shape.empty() || t.shape.size() > 8) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": rank ", t.shape.size(), " not in 1..8"));
    }
    const int64_t n = t.NumElements();
    if (n < 0 || static_cast<uint64_t>(n) > std::numeric_limits<size_t>::max() / element ||
        static_cast<size_t>(n) * element != t.data.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", t.data.size(), " data bytes do not match the shape"));
    }
    return absl::OkStatus();
  };
  if (absl::Status s = check(last_hidden, "last_hidden"); !s.ok()) return s;
  for (size_t i = 0; i < deepstack.size(); ++i) {
    if (absl::Status s = check(deepstack[i], absl::StrCat("deepstack[", i, "]")); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// ----------------------------------------------------------------------------
// Keys

size_t CacheKeyHash::operator()(const CacheKey& key) const {
  size_t h;
  std::memcpy(&h, key.digest.data(), sizeof(h));
  return h;
}

absl::StatusOr<Sha256Digest> ParseContentHash(std::string_view hex) {
  Sha256Digest digest;
  if (hex.size() != 2 * digest.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("content hash must be 64 hex characters, got ", hex.size()));
  }
  for (size_t i = 0; i < digest.size(); ++i) {
    const int hi = HexValue(hex[2 * i]);
    const int lo = HexValue(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return absl::InvalidArgumentError("content hash is not hexadecimal");
    digest[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return digest;
}

CacheKey KeyForContentHash(const Sha256Digest& content_hash, const CacheKeyContext& context) {
  static constexpr std::string_view kDomain("vlm.embedding_cache.bytes.v1\0", 29);
  Sha256Hasher hasher;
  hasher.Update(kDomain);
  hasher.Update(content_hash.data(), content_hash.size());
  HashContext(hasher, context);
  return CacheKey{hasher.Finish()};
}

CacheKey KeyForImageBytes(std::string_view image_bytes, const CacheKeyContext& context) {
  return KeyForContentHash(Sha256(image_bytes), context);
}

CacheKey KeyForPixels(std::string_view rgb, int64_t width, int64_t height,
                      const CacheKeyContext& context) {
  static constexpr std::string_view kDomain("vlm.embedding_cache.pixels.v1\0", 30);
  Sha256Hasher hasher;
  hasher.Update(kDomain);
  std::string fields;
  AppendI64(&fields, width);
  AppendI64(&fields, height);
  hasher.Update(fields);
  HashContext(hasher, context);
  fields.clear();
  AppendU64(&fields, rgb.size());
  hasher.Update(fields);
  hasher.Update(rgb);
  return CacheKey{hasher.Finish()};
}

const char* CacheLevelName(CacheLevel level) {
  switch (level) {
    case CacheLevel::kMiss:
      return "miss";
    case CacheLevel::kMemory:
      return "memory";
    case CacheLevel::kPixels:
      return "pixels";
    case CacheLevel::kDisk:
      return "disk";
  }
  return "unknown";
}

}  // namespace vlm::vision
