// Deterministic PNG pictures for tests and benches that send images through
// the services (libpng's simplified API; link PNG::PNG).
#ifndef VLM_TESTS_INTEGRATION_TEST_PNG_H_
#define VLM_TESTS_INTEGRATION_TEST_PNG_H_

#include <png.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace vlm::testing {

// rgb: width x height x 3 bytes, rows top to bottom. "" if libpng fails.
inline std::string EncodePng(const uint8_t* rgb, int width, int height) {
  png_image image = {};
  image.version = PNG_IMAGE_VERSION;
  image.width = width;
  image.height = height;
  image.format = PNG_FORMAT_RGB;
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&image, nullptr, &size, 0, rgb, 0, nullptr)) return "";
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&image, out.data(), &size, 0, rgb, 0, nullptr)) return "";
  out.resize(size);
  return out;
}

// A picture whose pixels depend on (x, y, seed): different seeds give different
// content hashes, the same seed the same bytes.
inline std::string PatternPng(int width, int height, int seed) {
  std::vector<uint8_t> rgb(static_cast<size_t>(width) * height * 3);
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      uint8_t* px = &rgb[(static_cast<size_t>(y) * width + x) * 3];
      px[0] = static_cast<uint8_t>(x * 7 + seed * 31);
      px[1] = static_cast<uint8_t>(y * 5 + seed * 17);
      px[2] = static_cast<uint8_t>((x ^ y) * 3 + seed * 13);
    }
  }
  return EncodePng(rgb.data(), width, height);
}

}  // namespace vlm::testing

#endif  // VLM_TESTS_INTEGRATION_TEST_PNG_H_
