// What the vision encoder caches and under which key.
//
// A value is the pre-projector ViT features of one image (CachedFeatures). Keys
// are SHA-256 digests (see the Key* functions):
//   bytes key  = H(content hash of the encoded image, options, model fingerprint)
//   pixel key  = H(decoded RGB pixels, width, height, options, model fingerprint)
// The bytes key is derived from the content hash, so a request that carries only
// a content hash of bytes sent earlier finds the same entry. The pixel key lets
// the same picture sent in another container format hit. The byte layout of
// every key is pinned by embedding_cache_test (EmbeddingCacheKeys.MatchTheDocumentedLayout); the values
// are regenerated independently by tests/reference/cache_keys_ref.py.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/sha256.h"

namespace vlm::vision {

// ----------------------------------------------------------------------------
// Values

// Element type of a cached tensor; the numbers match vlm.v1.DType on the wire.
enum class FeatureDType : uint32_t { kBF16 = 1, kF16 = 2, kF32 = 3 };

// Bytes per element; 0 for a value outside the enum.
size_t FeatureDTypeSize(FeatureDType dtype);

// A dense row-major tensor as raw little-endian bytes.
struct FeatureTensor {
  FeatureDType dtype = FeatureDType::kBF16;
  std::vector<int64_t> shape;
  std::string data;  // exactly NumElements() * FeatureDTypeSize(dtype) bytes

  int64_t NumElements() const;  // -1 if a dimension is negative or it overflows
};

// The pre-projector features of one image: the last ViT block's output and the
// deepstack taps (each [patches, vision hidden] in the model's dtype), its grid.
struct CachedFeatures {
  int64_t grid_t = 0;
  int64_t grid_h = 0;
  int64_t grid_w = 0;
  FeatureTensor last_hidden;
  std::vector<FeatureTensor> deepstack;
  // Lowercase hex SHA-256 of the encoded bytes this value was computed from.
  // A hit through the pixel key returns the first image's hash: a service
  // reports the hash of the bytes it was sent, not this one.
  std::string content_hash;

  // Heap and object bytes this value holds (what the memory bound counts).
  size_t ByteSize() const;
  // Grid positive, tensors well-formed (known dtype, sizes match shapes).
  absl::Status Validate() const;
};

using FeaturesPtr = std::shared_ptr<const CachedFeatures>;

// ----------------------------------------------------------------------------
// Keys

struct CacheKey {
  Sha256Digest digest{};

  std::string Hex() const { return HexEncode(digest); }
  bool operator==(const CacheKey& other) const { return digest == other.digest; }
  bool operator!=(const CacheKey& other) const { return digest != other.digest; }
};

struct CacheKeyHash {
  size_t operator()(const CacheKey& key) const;  // digests are uniform: 8 bytes
};

// What else besides the image decides the features. Use the effective values
// (after server defaults are applied), so that "unset" and "the default" share
// entries, and a fingerprint that changes whenever the weights or the
// preprocessing config change.
struct CacheKeyContext {
  int64_t min_pixels = 0;
  int64_t max_pixels = 0;
  std::string model_fingerprint;
};

// Parses 64 hex characters (either case) into a digest; INVALID_ARGUMENT else.
absl::StatusOr<Sha256Digest> ParseContentHash(std::string_view hex);

// The bytes key of an image whose encoded bytes hash to `content_hash`.
CacheKey KeyForContentHash(const Sha256Digest& content_hash, const CacheKeyContext& context);
// Same as KeyForContentHash(Sha256(image_bytes), context).
CacheKey KeyForImageBytes(std::string_view image_bytes, const CacheKeyContext& context);
// The pixel key of a decoded image: `rgb` is width*height*3 bytes, interleaved
// RGB, rows top to bottom, after EXIF orientation and alpha handling.
CacheKey KeyForPixels(std::string_view rgb, int64_t width, int64_t height,
                      const CacheKeyContext& context);

// Where a value came from; the same levels as vlm.v1.CacheLevel.
enum class CacheLevel { kMiss, kMemory, kPixels, kDisk };
const char* CacheLevelName(CacheLevel level);  // "miss", "memory", "pixels", "disk"

}  // namespace vlm::vision
