// Image decoding for the vision encoder: JPEG (libjpeg-turbo), PNG (libpng) and
// WebP (libwebp) to 8-bit RGB, exactly as the reference processor loads a file
// (qwen3-vl-model.md §3 step 1): PIL.ImageOps.exif_transpose, then
// Image.convert("RGB").
//
//   - EXIF Orientation (JPEG APP1 "Exif", PNG eXIf, WebP EXIF chunk) is applied;
//     width/height are the sizes after it.
//   - Alpha is dropped, never composited; palette transparency is ignored; a
//     palette index past the PLTE entries reads as grey (i, i, i), as in Pillow.
//   - 16-bit PNG: RGB(A) and grey+alpha keep the high byte; 16-bit grey clips at
//     255 (Pillow's I -> RGB). 1/2/4-bit grey is scaled to 0..255.
//   - CMYK/YCCK JPEG: Adobe polarity (inverted) is assumed, then Pillow's
//     CMYK -> RGB formula.
//   - Animated WebP: the first frame on its canvas, as Pillow shows it.
//
// Limits (encoded bytes, decoded pixels, aspect ratio) are checked from the
// header before any pixel buffer is allocated. Every failure is an
// INVALID_ARGUMENT that names the problem and, where one applies, the limit.
// Bad input never crashes and never leaks (libjpeg/libpng errors are caught with
// setjmp/longjmp). Thread-safe: no shared state.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace vlm::vision {

// An 8-bit RGB image: rows top to bottom, pixels left to right, channels R, G,
// B, tightly packed (row stride = 3 * width).
struct RgbImage {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> pixels;  // [height, width, 3]

  // The pixel bytes, for hashing. Two images with the same dimensions and the
  // same bytes are the same picture whatever container they came in.
  absl::string_view bytes() const {
    return absl::string_view(reinterpret_cast<const char*>(pixels.data()), pixels.size());
  }
  // A fixed header to hash before bytes() so that equal bytes with different
  // dimensions never collide: "rgb8 <width>x<height>\n".
  std::string HashHeader() const;
};

enum class ImageFormat { kUnknown, kJpeg, kPng, kWebp, kGif, kBmp, kTiff };
const char* ImageFormatName(ImageFormat format);
// The container format from the first bytes (magic numbers only).
ImageFormat SniffImageFormat(absl::string_view bytes);

struct DecodeLimits {
  int64_t max_encoded_bytes = 64 << 20;        // bytes of the encoded file
  int64_t max_decoded_pixels = 100'000'000;    // width * height as stored
  double max_aspect_ratio = 200.0;             // max(w,h)/min(w,h); equal passes (spec §3 step 2)
};

struct DecodedImage {
  RgbImage image;                  // after EXIF orientation
  ImageFormat format = ImageFormat::kUnknown;
  int exif_orientation = 1;        // the tag that was applied (1 = none)
  // The stored size after EXIF orientation, and the JPEG DCT scale used: the
  // image is source * scale_num / 8 per side (rounded up); 8 = full size.
  int source_width = 0;
  int source_height = 0;
  int scale_num = 8;
};

// Given an image's stored size (after EXIF orientation), the smallest decoded
// size (width, height; same orientation) the caller can use.
using DecodeSizeHint = std::function<std::pair<int64_t, int64_t>(int64_t width, int64_t height)>;

// Decodes `bytes` (a whole JPEG, PNG or WebP file) to RGB. With `min_size`, a
// JPEG is decoded at the smallest libjpeg DCT scale n/8 (n = 1..8) that still
// gives at least min_size(width, height): a 12 MP photo headed for a 0.75 MP
// budget is decoded at 5/8 scale, 39% of the pixels (the DCT scaling is a
// proper low-pass; the image is then resized as usual). Other formats decode at full
// size. Limits apply to the stored size.
absl::StatusOr<DecodedImage> DecodeImage(absl::string_view bytes,
                                         const DecodeLimits& limits = DecodeLimits(),
                                         const DecodeSizeHint& min_size = nullptr);

// Applies an EXIF orientation (1..8) like PIL.ImageOps.exif_transpose; other
// values leave the image unchanged.
RgbImage ApplyExifOrientation(RgbImage image, int orientation);

// The Orientation tag (0x0112) of IFD0 of a TIFF/EXIF block (optionally
// prefixed by "Exif\0\0"); 1 if absent or unreadable.
int ExifOrientation(absl::string_view exif);

}  // namespace vlm::vision
