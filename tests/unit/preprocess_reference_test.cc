// Decoding and preprocessing compared bit-exactly with the independent
// Pillow/numpy reference (tests/reference/preprocess_ref.py), which ctest runs
// into the build tree before this test (fixture preprocess_goldens).
#include <openssl/evp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/vision/image_decoder.h"
#include "services/vision/preprocess.h"

namespace vlm::vision {
namespace {

using ::testing::HasSubstr;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::string Sha256Hex(absl::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &size, EVP_sha256(), nullptr);
  std::string hex;
  char buf[3];
  for (unsigned int i = 0; i < size; ++i) {
    std::snprintf(buf, sizeof(buf), "%02x", digest[i]);
    hex += buf;
  }
  return hex;
}

// Number of differing bytes and the first differing offset (or -1).
std::pair<size_t, long> CompareBytes(const void* a, const void* b, size_t size) {
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  size_t count = 0;
  long first = -1;
  for (size_t i = 0; i < size; ++i) {
    if (x[i] != y[i]) {
      if (first < 0) first = static_cast<long>(i);
      ++count;
    }
  }
  return {count, first};
}

class PreprocessReferenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* dir = std::getenv("VLM_PREPROCESS_GOLDEN_DIR");
    ASSERT_NE(dir, nullptr) << "VLM_PREPROCESS_GOLDEN_DIR is not set (run through ctest)";
    root_ = dir;
    const std::string manifest = ReadFile(root_ + "/golden/goldens.json");
    ASSERT_FALSE(manifest.empty()) << "no goldens in " << root_ << " (run through ctest)";
    goldens_ = nlohmann::json::parse(manifest)["images"];
  }

  std::string root_;
  nlohmann::json goldens_;
};

TEST_F(PreprocessReferenceTest, EveryTestImageMatchesPillowBitExactly) {
  ASSERT_GE(goldens_.size(), 12u);
  int accepted = 0, rejected = 0;
  for (const auto& rec : goldens_) {
    const std::string file = rec["file"];
    SCOPED_TRACE(file);
    const std::string bytes = ReadFile(root_ + "/images/" + file);
    ASSERT_FALSE(bytes.empty());

    // Decode with the aspect limit lifted so that even the refused images'
    // pixels are compared; the default limits are checked below.
    DecodeLimits relaxed;
    relaxed.max_aspect_ratio = 1e9;
    absl::StatusOr<DecodedImage> decoded = DecodeImage(bytes, relaxed);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    const RgbImage& rgb = decoded->image;
    ASSERT_EQ(rgb.width, rec["decoded"]["width"].get<int>());
    ASSERT_EQ(rgb.height, rec["decoded"]["height"].get<int>());
    EXPECT_EQ(Sha256Hex(rgb.bytes()), rec["decoded"]["sha256"].get<std::string>());
    if (rec["decoded"].contains("file")) {
      const std::string want = ReadFile(root_ + "/golden/" + rec["decoded"]["file"].get<std::string>());
      ASSERT_EQ(want.size(), rgb.pixels.size());
      auto [diff, first] = CompareBytes(want.data(), rgb.pixels.data(), want.size());
      EXPECT_EQ(diff, 0u) << "decoded bytes differ; first at byte " << first;
    }

    PreprocessOptions options;
    options.min_pixels = rec["min_pixels"];
    options.max_pixels = rec["max_pixels"];
    if (!rec["ok"].get<bool>()) {
      ++rejected;
      // The reference raised; so must the decoder (header check) and
      // smart_resize.
      absl::StatusOr<DecodedImage> strict = DecodeImage(bytes);
      ASSERT_FALSE(strict.ok());
      EXPECT_EQ(strict.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(strict.status().message(), HasSubstr("maximum aspect ratio is 200"));
      absl::StatusOr<PreprocessResult> pre = PreprocessImage(rgb, options);
      ASSERT_FALSE(pre.ok());
      EXPECT_THAT(pre.status().message(), HasSubstr("aspect ratio"));
      continue;
    }
    ++accepted;
    ASSERT_TRUE(DecodeImage(bytes).ok());

    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<PreprocessResult> pre = PreprocessImage(rgb, options);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(pre.ok()) << pre.status();
    std::printf("%-36s %5dx%-5d -> %5dx%-5d  preprocess %.1f ms\n", file.c_str(), rgb.width,
                rgb.height, pre->resized.width, pre->resized.height, ms);

    ASSERT_EQ(pre->resized.width, rec["resized"]["width"].get<int>());
    ASSERT_EQ(pre->resized.height, rec["resized"]["height"].get<int>());
    const std::string want_resized =
        ReadFile(root_ + "/golden/" + rec["resized"]["file"].get<std::string>());
    ASSERT_EQ(want_resized.size(), pre->resized.pixels.size());
    auto [rdiff, rfirst] =
        CompareBytes(want_resized.data(), pre->resized.pixels.data(), want_resized.size());
    EXPECT_EQ(rdiff, 0u) << "resized bytes differ from Pillow's; first at byte " << rfirst;

    const auto grid = rec["grid_thw"];
    EXPECT_EQ(pre->patches.grid_t, grid[0].get<int64_t>());
    EXPECT_EQ(pre->patches.grid_h, grid[1].get<int64_t>());
    EXPECT_EQ(pre->patches.grid_w, grid[2].get<int64_t>());
    ASSERT_EQ(pre->patches.num_patches(), rec["pixel_values"]["rows"].get<int64_t>());
    ASSERT_EQ(pre->patches.patch_dim, rec["pixel_values"]["cols"].get<int64_t>());
    const std::string want_pv =
        ReadFile(root_ + "/golden/" + rec["pixel_values"]["file"].get<std::string>());
    ASSERT_EQ(want_pv.size(), pre->patches.pixel_values.size() * sizeof(float));
    auto [pdiff, pfirst] =
        CompareBytes(want_pv.data(), pre->patches.pixel_values.data(), want_pv.size());
    EXPECT_EQ(pdiff, 0u) << "pixel_values differ bitwise; first at float " << pfirst / 4;
  }
  std::printf("%d images accepted, %d refused, all compared with the reference\n", accepted,
              rejected);
  EXPECT_GE(accepted, 12);
  EXPECT_GE(rejected, 2);
}

}  // namespace
}  // namespace vlm::vision
