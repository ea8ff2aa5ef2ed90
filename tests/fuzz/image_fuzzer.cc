// libFuzzer target: image decoding (JPEG, PNG, WebP, EXIF orientation) and
// Qwen3-VL preprocessing (smart_resize, bicubic resize, patchify).
//
// Input: byte 0 selects what runs, the rest is the payload.
//   bits 0-1: preprocessing preset (below); preset 3 has invalid options and
//             must be refused.
//   bit 6:    SmartResize on three little-endian int64 read from the payload
//             (height, width, max_pixels) instead of an image: any sizes must
//             give a status or a grid within the contract, never UB.
//   bit 7:    ExifOrientation on the payload (a TIFF/EXIF block), then the
//             orientation applied to a small image.
//   otherwise the payload is an image file: DecodeImage (limits small enough
//   for the fuzzer: 4 Mpixel), then PreprocessImage with the preset.
// Properties: a decoded image has width*height*3 bytes; a preprocessed one has
// a size that is a multiple of patch_size * merge_size and num_patches *
// patch_dim finite values.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/string_view.h"
#include "services/vision/image_decoder.h"
#include "services/vision/preprocess.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

using namespace vlm::vision;  // NOLINT: a fuzz target of this one module

PreprocessOptions Preset(int which) {
  PreprocessOptions o;
  switch (which) {
    case 0:  // Qwen3-VL patching, a small pixel budget
      o.min_pixels = 1024;
      o.max_pixels = 16384;
      break;
    case 1:  // Qwen2-VL-like patching (14 x 2)
      o.patch_size = 14;
      o.min_pixels = 784;
      o.max_pixels = 50176;
      break;
    case 2:  // one merged patch at most, odd normalisation
      o.min_pixels = 1;
      o.max_pixels = 1024;
      o.merge_size = 1;
      o.temporal_patch_size = 1;
      o.image_mean = {0.1f, 0.2f, 0.3f};
      o.image_std = {0.9f, 1e-3f, 5.0f};
      break;
    default:  // invalid: min_pixels > max_pixels
      o.min_pixels = 2048;
      o.max_pixels = 1024;
      break;
  }
  return o;
}

int64_t ReadI64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{p[i]} << (8 * i);
  return static_cast<int64_t>(v);
}

void FuzzSmartResize(const uint8_t* data, size_t size) {
  if (size < 24) return;
  const int64_t h = ReadI64(data), w = ReadI64(data + 8), max_pixels = ReadI64(data + 16);
  auto r = SmartResize(h, w, 32, 1024, max_pixels);
  if (!r.ok()) return;
  FUZZ_CHECK(r->height > 0 && r->width > 0 && r->height % 32 == 0 && r->width % 32 == 0,
             "SmartResize(%lld, %lld) gave %lldx%lld", static_cast<long long>(h),
             static_cast<long long>(w), static_cast<long long>(r->height),
             static_cast<long long>(r->width));
}

void FuzzExif(const uint8_t* data, size_t size) {
  const int orientation =
      ExifOrientation(absl::string_view(reinterpret_cast<const char*>(data), size));
  RgbImage image;
  image.width = 3;
  image.height = 2;
  image.pixels.resize(3 * 2 * 3);
  for (size_t i = 0; i < image.pixels.size(); ++i) image.pixels[i] = static_cast<uint8_t>(i);
  RgbImage out = ApplyExifOrientation(image, orientation);
  FUZZ_CHECK(out.pixels.size() == 18 && out.width * out.height == 6,
             "orientation %d gave %dx%d with %zu bytes", orientation, out.width, out.height,
             out.pixels.size());
}

void FuzzImage(int preset, const uint8_t* data, size_t size) {
  DecodeLimits limits;
  limits.max_decoded_pixels = 4 << 20;
  auto decoded = DecodeImage(absl::string_view(reinterpret_cast<const char*>(data), size), limits);
  if (!decoded.ok()) return;
  const RgbImage& image = decoded->image;
  FUZZ_CHECK(image.width > 0 && image.height > 0 &&
                 image.pixels.size() == static_cast<size_t>(image.width) * image.height * 3,
             "decoded %dx%d with %zu bytes", image.width, image.height, image.pixels.size());
  const PreprocessOptions options = Preset(preset);
  auto result = PreprocessImage(image, options);
  if (preset == 3) {
    FUZZ_CHECK(!result.ok(), "min_pixels > max_pixels was accepted");
    return;
  }
  if (!result.ok()) return;  // e.g. the aspect ratio limit
  const int64_t factor = int64_t{options.patch_size} * options.merge_size;
  FUZZ_CHECK(result->resized_size.height % factor == 0 && result->resized_size.width % factor == 0,
             "resized to %lldx%lld, factor %lld",
             static_cast<long long>(result->resized_size.width),
             static_cast<long long>(result->resized_size.height), static_cast<long long>(factor));
  const PreprocessedImage& p = result->patches;
  FUZZ_CHECK(p.grid_h * options.patch_size == result->resized_size.height &&
                 p.grid_w * options.patch_size == result->resized_size.width,
             "grid %lldx%lld", static_cast<long long>(p.grid_h), static_cast<long long>(p.grid_w));
  FUZZ_CHECK(p.pixel_values.size() == static_cast<size_t>(p.num_patches() * p.patch_dim),
             "%zu values for %lld patches of %lld", p.pixel_values.size(),
             static_cast<long long>(p.num_patches()), static_cast<long long>(p.patch_dim));
  for (float v : p.pixel_values) FUZZ_CHECK(std::isfinite(v), "non-finite pixel value");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  if (mode & 0x80) {
    FuzzExif(data + 1, size - 1);
  } else if (mode & 0x40) {
    FuzzSmartResize(data + 1, size - 1);
  } else {
    FuzzImage(mode & 3, data + 1, size - 1);
  }
  return 0;
}
