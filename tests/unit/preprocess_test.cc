// smart_resize, the Pillow bicubic resize, the normalisation table and the
// patch order, against the worked values and formulas of qwen3-vl-model.md §3
// and a few outputs of PIL.Image.resize (Pillow 9.4) quoted below. The
// bit-exact comparison on whole images is preprocess_reference_test.
#include "services/vision/preprocess.h"

#include <cmath>
#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace vlm::vision {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMin = 65536;
constexpr int64_t kMax = 16777216;

ImageSize Smart(int64_t h, int64_t w, int64_t min_pixels = kMin, int64_t max_pixels = kMax) {
  absl::StatusOr<ImageSize> s = SmartResize(h, w, 32, min_pixels, max_pixels);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : ImageSize{};
}

RgbImage MakeImage(int width, int height, const std::vector<uint8_t>& pixels) {
  RgbImage image;
  image.width = width;
  image.height = height;
  image.pixels = pixels;
  return image;
}

TEST(SmartResizeTest, WorkedValuesOfTheSpec) {
  // H x W -> h x w (spec §3 step 2).
  EXPECT_EQ(Smart(480, 640), (ImageSize{480, 640}));
  EXPECT_EQ(Smart(1000, 1000), (ImageSize{992, 992}));
  EXPECT_EQ(Smart(656, 656), (ImageSize{640, 640}));  // 20.5 rounds to 20
  EXPECT_EQ(Smart(100, 100), (ImageSize{256, 256}));
  EXPECT_EQ(Smart(32, 32), (ImageSize{256, 256}));
  EXPECT_EQ(Smart(50, 300), (ImageSize{128, 640}));
  EXPECT_EQ(Smart(720, 1280), (ImageSize{704, 1280}));
  EXPECT_EQ(Smart(3000, 4000), (ImageSize{3008, 4000}));  // 12.0 M < 16.8 M: not reduced
  EXPECT_EQ(Smart(6000, 8000), (ImageSize{3520, 4704}));
  EXPECT_EQ(Smart(10, 10), (ImageSize{256, 256}));  // round gives 0 first
}

TEST(SmartResizeTest, GridsOfTheWorkedValues) {
  const ImageSize s = Smart(480, 640);
  EXPECT_EQ(s.height / 16, 30);
  EXPECT_EQ(s.width / 16, 40);
  EXPECT_EQ(Smart(6000, 8000).height / 16, 220);
  EXPECT_EQ(Smart(6000, 8000).width / 16, 294);
  EXPECT_EQ(Smart(50, 300).width / 16, 40);
}

TEST(SmartResizeTest, RoundsHalfToEven) {
  // No min/max effect: 1.5 -> 2, 2.5 -> 2, 3.5 -> 4 (std::round would give 3 for 2.5).
  EXPECT_EQ(Smart(48, 48, 1, kMax), (ImageSize{64, 64}));
  EXPECT_EQ(Smart(80, 80, 1, kMax), (ImageSize{64, 64}));
  EXPECT_EQ(Smart(112, 112, 1, kMax), (ImageSize{128, 128}));
}

TEST(SmartResizeTest, AspectRatioTwoHundredPassesAndAboveIsRefused) {
  EXPECT_TRUE(SmartResize(1, 200, 32, kMin, kMax).ok());
  EXPECT_TRUE(SmartResize(2000, 10, 32, kMin, kMax).ok());
  absl::StatusOr<ImageSize> wide = SmartResize(10, 2010, 32, kMin, kMax);
  ASSERT_FALSE(wide.ok());
  EXPECT_EQ(wide.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wide.status().message(), HasSubstr("aspect ratio 201"));
  EXPECT_THAT(wide.status().message(), HasSubstr("maximum aspect ratio is 200"));
  EXPECT_FALSE(SmartResize(201, 1, 32, kMin, kMax).ok());
}

TEST(SmartResizeTest, NonPositiveSizesAreRefused) {
  EXPECT_FALSE(SmartResize(0, 10, 32, kMin, kMax).ok());
  EXPECT_FALSE(SmartResize(10, -1, 32, kMin, kMax).ok());
}

// Found by tests/fuzz/image_fuzzer (regressions/image/smart_resize_overflow):
// 1128 x 2^56 overflowed height * width and h_bar * w_bar (undefined behaviour);
// a huge min_pixels or a negative max_pixels made the double -> int64
// conversions overflow. Each is now a status naming the bound.
TEST(SmartResizeTest, SizesAndBudgetsBeyondTheBoundsAreRefusedNotOverflowed) {
  EXPECT_THAT(SmartResize(1128, int64_t{1} << 56, 32, kMin, kMax).status().message(),
              HasSubstr("pixels per side"));
  EXPECT_THAT(SmartResize(int64_t{1} << 62, int64_t{1} << 62, 32, kMin, kMax).status().message(),
              HasSubstr("pixels per side"));
  EXPECT_THAT(SmartResize(100, 100, int64_t{1} << 40, kMin, kMax).status().message(),
              HasSubstr("factor"));
  EXPECT_THAT(SmartResize(100, 100, 32, int64_t{1} << 62, int64_t{1} << 62).status().message(),
              HasSubstr("min_pixels"));
  EXPECT_THAT(SmartResize(100, 100, 32, kMin, -1).status().message(), HasSubstr("max_pixels"));
  // The largest accepted values still give a grid of whole factors.
  const int64_t side = kSmartResizeMaxSide;
  const ImageSize big = Smart(side, side, 1, kSmartResizeMaxPixels);
  EXPECT_EQ(big.height % 32, 0);
  EXPECT_LE(big.height * big.width, kSmartResizeMaxPixels);
  const ImageSize tiny = Smart(1, 1, kSmartResizeMaxPixels, kSmartResizeMaxPixels);
  EXPECT_EQ(tiny.height % 32, 0);
  EXPECT_GE(tiny.height * tiny.width, kSmartResizeMaxPixels);
}

TEST(SmartResizeTest, MaxPixelsBranchNeverGoesBelowOneFactor) {
  // beta shrinks the short side below 32: max(factor, ...) keeps 32.
  const ImageSize s = Smart(20, 3000, 1024, 4096);
  EXPECT_EQ(s.height, 32);
  EXPECT_EQ(s.width % 32, 0);
}

TEST(PreprocessOptionsTest, ValidatesPixelBudget) {
  PreprocessOptions o;
  EXPECT_TRUE(ValidatePreprocessOptions(o).ok());
  o.min_pixels = 0;
  EXPECT_THAT(ValidatePreprocessOptions(o).message(), HasSubstr("min_pixels must be positive"));
  o = PreprocessOptions();
  o.max_pixels = -5;
  EXPECT_THAT(ValidatePreprocessOptions(o).message(), HasSubstr("max_pixels must be positive"));
  o = PreprocessOptions();
  o.min_pixels = 1000;
  o.max_pixels = 999;
  absl::Status s = ValidatePreprocessOptions(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("min_pixels (1000) must not exceed max_pixels (999)"));
  o = PreprocessOptions();
  o.image_std[1] = 0.0f;
  EXPECT_FALSE(ValidatePreprocessOptions(o).ok());

  // PreprocessImage validates before doing anything.
  o = PreprocessOptions();
  o.min_pixels = 0;
  RgbImage one = MakeImage(1, 1, {1, 2, 3});
  EXPECT_EQ(PreprocessImage(one, o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ResizeBicubicTest, UpscaleMatchesPillow) {
  // PIL: Image.fromarray(row).resize((7, 1), Image.BICUBIC)
  RgbImage row = MakeImage(4, 1, {0, 10, 200, 255, 20, 100, 0, 30, 0, 255, 40, 255});
  RgbImage out = ResizeBicubic(row, 7, 1);
  const std::vector<uint8_t> pil = {0,   9,  208, 87, 13, 174, 251, 19,  108, 128, 25,
                                    28,  4,  31,  8,  168, 37, 174, 255, 41,  255};
  EXPECT_EQ(out.pixels, pil);
}

TEST(ResizeBicubicTest, DownscaleMatchesPillowOnBothAxes) {
  std::vector<uint8_t> px;
  for (int i = 0; i < 8; ++i) {
    px.push_back(static_cast<uint8_t>((i * 37) % 256));
    px.push_back(static_cast<uint8_t>((i * 91) % 256));
    px.push_back(i % 2 ? 255 : 0);
  }
  const std::vector<uint8_t> pil = {33, 78, 112, 136, 107, 127, 143, 108, 143};
  EXPECT_EQ(ResizeBicubic(MakeImage(8, 1, px), 3, 1).pixels, pil);  // horizontal only
  EXPECT_EQ(ResizeBicubic(MakeImage(1, 8, px), 1, 3).pixels, pil);  // vertical only
}

TEST(ResizeBicubicTest, TwoAxesMatchPillow) {
  // PIL: 4x1 -> 3x5; every output row equals the first.
  RgbImage row = MakeImage(4, 1, {0, 10, 200, 255, 20, 100, 0, 30, 0, 255, 40, 255});
  RgbImage out = ResizeBicubic(row, 3, 5);
  ASSERT_EQ(out.width, 3);
  ASSERT_EQ(out.height, 5);
  const std::vector<uint8_t> pil_row = {78, 12, 181, 128, 25, 38, 177, 38, 186};
  for (int y = 0; y < 5; ++y) {
    EXPECT_EQ(std::vector<uint8_t>(out.pixels.begin() + y * 9, out.pixels.begin() + y * 9 + 9),
              pil_row);
  }
}

TEST(ResizeBicubicTest, SameSizeIsACopyAndConstantStaysConstant) {
  std::vector<uint8_t> px(37 * 23 * 3);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>(i * 7);
  RgbImage image = MakeImage(37, 23, px);
  EXPECT_EQ(ResizeBicubic(image, 37, 23).pixels, px);

  RgbImage flat = MakeImage(50, 40, std::vector<uint8_t>(50 * 40 * 3, 201));
  for (auto [w, h] : {std::pair{13, 97}, {200, 9}, {50, 41}, {1, 1}}) {
    RgbImage out = ResizeBicubic(flat, w, h);
    ASSERT_EQ(out.pixels.size(), static_cast<size_t>(w) * h * 3);
    for (uint8_t v : out.pixels) ASSERT_EQ(v, 201) << w << "x" << h;
  }
}

TEST(NormalizationTableTest, SlowPathRoundingNotTheFusedOne) {
  const std::array<float, 256> t = NormalizationTable(1.0 / 255.0, 0.5f, 0.5f);
  EXPECT_EQ(t[0], -1.0f);
  EXPECT_EQ(t[255], 1.0f);
  for (int i = 1; i < 256; ++i) EXPECT_LT(t[i - 1], t[i]);
  // Spec pitfall 27: the fused (u8 - 127.5f) / 127.5f differs on 128 of the
  // 256 values, by at most 6e-8.
  int differing = 0;
  float max_diff = 0;
  for (int u = 0; u < 256; ++u) {
    const float fused = (static_cast<float>(u) - 127.5f) / 127.5f;
    if (fused != t[u]) ++differing;
    max_diff = std::max(max_diff, std::fabs(fused - t[u]));
  }
  EXPECT_EQ(differing, 128);
  EXPECT_LE(max_diff, 6e-8f);
}

TEST(PatchifyTest, RowsInMergeOrderColumnsChannelFrameYX) {
  // 64x96 image (grid 4x6); each pixel encodes its position and channel.
  const int h = 64, w = 96;
  auto value = [](int y, int x, int c) { return static_cast<uint8_t>((y * 7 + x * 3 + c * 50) % 256); };
  RgbImage image;
  image.width = w;
  image.height = h;
  image.pixels.resize(static_cast<size_t>(w) * h * 3);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < 3; ++c) image.pixels[(y * w + x) * 3 + c] = value(y, x, c);

  PreprocessOptions o;
  const PreprocessedImage p = Patchify(image, o);
  ASSERT_EQ(p.grid_t, 1);
  ASSERT_EQ(p.grid_h, 4);
  ASSERT_EQ(p.grid_w, 6);
  ASSERT_EQ(p.patch_dim, 1536);
  ASSERT_EQ(p.pixel_values.size(), 24u * 1536u);
  const std::array<float, 256> norm = NormalizationTable(1.0 / 255.0, 0.5f, 0.5f);
  const int gh = 4, gw = 6, t = 0;
  int checked = 0;
  // The explicit formula of spec §3 step 6.
  for (int bh = 0; bh < gh / 2; ++bh)
    for (int bw = 0; bw < gw / 2; ++bw)
      for (int ih = 0; ih < 2; ++ih)
        for (int iw = 0; iw < 2; ++iw)
          for (int c = 0; c < 3; ++c)
            for (int f = 0; f < 2; ++f)
              for (int py = 0; py < 16; ++py)
                for (int px = 0; px < 16; ++px) {
                  const int row = (((t * (gh / 2) + bh) * (gw / 2) + bw) * 2 + ih) * 2 + iw;
                  const int col = ((c * 2 + f) * 16 + py) * 16 + px;
                  const float want = norm[value((bh * 2 + ih) * 16 + py, (bw * 2 + iw) * 16 + px, c)];
                  ASSERT_EQ(p.pixel_values[static_cast<size_t>(row) * 1536 + col], want)
                      << "row " << row << " col " << col;
                  ++checked;
                }
  EXPECT_EQ(checked, 24 * 1536);
}

TEST(PreprocessImageTest, MultipleOf32IsNotResampled) {
  std::vector<uint8_t> px(640 * 480 * 3);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>((i * 13) ^ (i >> 7));
  RgbImage image = MakeImage(640, 480, px);
  absl::StatusOr<PreprocessResult> r = PreprocessImage(image, PreprocessOptions());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->resized_size, (ImageSize{480, 640}));
  EXPECT_EQ(r->resized.pixels, px);
  EXPECT_EQ(r->patches.grid_h, 30);
  EXPECT_EQ(r->patches.grid_w, 40);
  EXPECT_EQ(r->patches.num_patches(), 1200);  // 300 LLM tokens
}

TEST(PreprocessImageTest, PerCallPixelBudget) {
  RgbImage image = MakeImage(1000, 1000, std::vector<uint8_t>(1000 * 1000 * 3, 77));
  PreprocessOptions o;
  o.min_pixels = 4096;
  o.max_pixels = 256 * 256;
  absl::StatusOr<PreprocessResult> r = PreprocessImage(image, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->resized_size, (ImageSize{256, 256}));
  EXPECT_EQ(r->patches.pixel_values.size(), 256u * 1536u);
}

TEST(PreprocessImageTest, RejectsInconsistentImage) {
  RgbImage bad = MakeImage(10, 10, std::vector<uint8_t>(5));
  EXPECT_EQ(PreprocessImage(bad, PreprocessOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace vlm::vision
