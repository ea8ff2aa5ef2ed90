// Width and height of an encoded image from its header alone (JPEG SOF, PNG
// IHDR, WebP VP8 / VP8L / VP8X), without decoding: the gateway estimates an
// image's cost before any work starts. Reads only inside the given bytes; any
// truncated or malformed header is INVALID_ARGUMENT naming what is wrong.
// The dimensions are the stored ones (a JPEG's EXIF rotation swaps them, which
// leaves the area and the token estimate unchanged).
#ifndef VLM_SERVICES_GATEWAY_IMAGE_SIZE_H_
#define VLM_SERVICES_GATEWAY_IMAGE_SIZE_H_

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace vlm::gateway {

struct ImageDimensions {
  int64_t width = 0;
  int64_t height = 0;
  const char* format = "";  // "jpeg", "png", "webp"
};

absl::StatusOr<ImageDimensions> ReadImageDimensions(std::string_view bytes);

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_IMAGE_SIZE_H_
