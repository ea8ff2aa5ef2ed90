#include "services/gateway/image_size.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace vlm::gateway {
namespace {

absl::Status Bad(const char* format, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(format, " header: ", std::string(what)));
}

uint32_t Be16(std::string_view b, size_t at) {
  return (static_cast<uint32_t>(static_cast<uint8_t>(b[at])) << 8) |
         static_cast<uint8_t>(b[at + 1]);
}
uint32_t Be32(std::string_view b, size_t at) { return (Be16(b, at) << 16) | Be16(b, at + 2); }
uint32_t Le16(std::string_view b, size_t at) {
  return static_cast<uint8_t>(b[at]) | (static_cast<uint32_t>(static_cast<uint8_t>(b[at + 1])) << 8);
}
uint32_t Le24(std::string_view b, size_t at) {
  return Le16(b, at) | (static_cast<uint32_t>(static_cast<uint8_t>(b[at + 2])) << 16);
}
uint32_t Le32(std::string_view b, size_t at) { return Le16(b, at) | (Le16(b, at + 2) << 16); }

ImageDimensions Dims(int64_t w, int64_t h, const char* format) {
  ImageDimensions d;
  d.width = w;
  d.height = h;
  d.format = format;
  return d;
}

absl::StatusOr<ImageDimensions> Jpeg(std::string_view b) {
  size_t at = 2;  // after SOI
  while (true) {
    // A marker: one or more 0xFF fill bytes, then the code.
    if (at >= b.size()) return Bad("JPEG", "truncated before a frame header (SOF)");
    if (static_cast<uint8_t>(b[at]) != 0xFF) return Bad("JPEG", "expected a marker");
    while (at < b.size() && static_cast<uint8_t>(b[at]) == 0xFF) ++at;
    if (at >= b.size()) return Bad("JPEG", "truncated inside a marker");
    const uint8_t code = static_cast<uint8_t>(b[at++]);
    if (code == 0xD8 || code == 0x01 || (code >= 0xD0 && code <= 0xD7)) continue;  // no length
    if (code == 0xD9 || code == 0xDA) return Bad("JPEG", "no frame header (SOF) before the scan");
    if (at + 2 > b.size()) return Bad("JPEG", "truncated segment length");
    const uint32_t length = Be16(b, at);
    if (length < 2) return Bad("JPEG", "segment length below 2");
    const bool sof = code >= 0xC0 && code <= 0xCF && code != 0xC4 && code != 0xC8 && code != 0xCC;
    if (sof) {
      if (length < 8 || at + 7 > b.size()) return Bad("JPEG", "truncated frame header (SOF)");
      const uint32_t height = Be16(b, at + 3);
      const uint32_t width = Be16(b, at + 5);
      // Height 0 means "defined by a DNL marker later"; no camera writes it.
      if (width == 0 || height == 0) return Bad("JPEG", "frame header with a zero dimension");
      return Dims(width, height, "jpeg");
    }
    at += length;
  }
}

absl::StatusOr<ImageDimensions> Png(std::string_view b) {
  // signature (8), IHDR length (4), "IHDR" (4), width (4), height (4)
  if (b.size() < 24) return Bad("PNG", "truncated before the IHDR chunk's size");
  if (b.substr(12, 4) != "IHDR") return Bad("PNG", "the first chunk is not IHDR");
  const uint32_t width = Be32(b, 16), height = Be32(b, 20);
  if (width == 0 || height == 0 || width > 0x7FFFFFFFu || height > 0x7FFFFFFFu) {
    return Bad("PNG", "IHDR size out of range");
  }
  return Dims(width, height, "png");
}

absl::StatusOr<ImageDimensions> Webp(std::string_view b) {
  // "RIFF" size "WEBP", then the first chunk: fourcc (4), size (4), data.
  if (b.size() < 20) return Bad("WebP", "truncated before the first chunk");
  const std::string_view chunk = b.substr(12, 4);
  const std::string_view data = b.substr(20);
  if (chunk == "VP8 ") {
    // frame tag (3), start code 9D 01 2A, width (14 bits), height (14 bits)
    if (data.size() < 10) return Bad("WebP", "truncated VP8 frame header");
    if (static_cast<uint8_t>(data[3]) != 0x9D || static_cast<uint8_t>(data[4]) != 0x01 ||
        static_cast<uint8_t>(data[5]) != 0x2A) {
      return Bad("WebP", "bad VP8 start code");
    }
    const uint32_t width = Le16(data, 6) & 0x3FFF, height = Le16(data, 8) & 0x3FFF;
    if (width == 0 || height == 0) return Bad("WebP", "VP8 frame with a zero dimension");
    return Dims(width, height, "webp");
  }
  if (chunk == "VP8L") {
    // signature 0x2F, then width-1 (14 bits) and height-1 (14 bits), little-endian
    if (data.size() < 5) return Bad("WebP", "truncated VP8L header");
    if (static_cast<uint8_t>(data[0]) != 0x2F) return Bad("WebP", "bad VP8L signature");
    const uint32_t bits = Le32(data, 1);
    return Dims((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, "webp");
  }
  if (chunk == "VP8X") {
    // flags (4), canvas width-1 (24 bits), canvas height-1 (24 bits)
    if (data.size() < 10) return Bad("WebP", "truncated VP8X header");
    return Dims(int64_t{Le24(data, 4)} + 1, int64_t{Le24(data, 7)} + 1, "webp");
  }
  return Bad("WebP", "the first chunk is not VP8, VP8L or VP8X");
}

}  // namespace

absl::StatusOr<ImageDimensions> ReadImageDimensions(std::string_view b) {
  if (b.size() >= 3 && static_cast<uint8_t>(b[0]) == 0xFF && static_cast<uint8_t>(b[1]) == 0xD8 &&
      static_cast<uint8_t>(b[2]) == 0xFF) {
    return Jpeg(b);
  }
  if (b.size() >= 8 && b.substr(0, 8) == std::string_view("\x89PNG\r\n\x1a\n", 8)) return Png(b);
  if (b.size() >= 12 && b.substr(0, 4) == "RIFF" && b.substr(8, 4) == "WEBP") return Webp(b);
  return absl::InvalidArgumentError("not a JPEG, PNG or WebP image (unrecognised signature)");
}

}  // namespace vlm::gateway
