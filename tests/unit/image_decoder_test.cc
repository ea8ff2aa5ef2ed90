// Image decoding: formats and modes converted the way Pillow's
// convert("RGB") does (spec §3 step 1), EXIF orientation, limits checked from
// the header, and bad input (every failure an INVALID_ARGUMENT that names the
// problem, never a crash). Test images are built here (zlib for PNG chunks,
// TurboJPEG, libwebp); the expected pixels follow from the spec's rules.
#include "services/vision/image_decoder.h"

#include <cmath>

#include <turbojpeg.h>
#include <webp/encode.h>
#include <zlib.h>

#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/vision/preprocess.h"

namespace vlm::vision {
namespace {

using ::testing::HasSubstr;

// ---- builders ---------------------------------------------------------------

std::string BigEndian32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

std::string PngChunk(const std::string& type, const std::string& data) {
  std::string body = type + data;
  const uLong crc = crc32(0, reinterpret_cast<const Bytef*>(body.data()), body.size());
  return BigEndian32(static_cast<uint32_t>(data.size())) + body +
         BigEndian32(static_cast<uint32_t>(crc));
}

std::string Deflate(const std::string& raw) {
  uLongf size = compressBound(raw.size());
  std::string out(size, '\0');
  compress2(reinterpret_cast<Bytef*>(&out[0]), &size, reinterpret_cast<const Bytef*>(raw.data()),
            raw.size(), 6);
  out.resize(size);
  return out;
}

std::string PngSignature() { return std::string("\x89PNG\r\n\x1a\n", 8); }

std::string Ihdr(uint32_t w, uint32_t h, int depth, int color_type, int interlace = 0) {
  return PngChunk("IHDR", BigEndian32(w) + BigEndian32(h) +
                              std::string{static_cast<char>(depth), static_cast<char>(color_type),
                                          0, 0, static_cast<char>(interlace)});
}

// `rows`: raw scanlines without the filter byte.
std::string MakePng(uint32_t w, uint32_t h, int depth, int color_type,
                    const std::vector<std::string>& rows, const std::string& extra = "") {
  std::string scan;
  for (const std::string& r : rows) scan += '\0' + r;
  return PngSignature() + Ihdr(w, h, depth, color_type) + extra + PngChunk("IDAT", Deflate(scan)) +
         PngChunk("IEND", "");
}

RgbImage Pattern(int w, int h, int seed) {
  RgbImage image;
  image.width = w;
  image.height = h;
  image.pixels.resize(static_cast<size_t>(w) * h * 3);
  std::mt19937 rng(seed);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      uint8_t* p = &image.pixels[(static_cast<size_t>(y) * w + x) * 3];
      p[0] = static_cast<uint8_t>(x * 255 / std::max(w - 1, 1));
      p[1] = static_cast<uint8_t>(y * 255 / std::max(h - 1, 1));
      p[2] = static_cast<uint8_t>(rng());
    }
  return image;
}

std::string RgbPng(const RgbImage& image) {
  std::vector<std::string> rows;
  for (int y = 0; y < image.height; ++y) {
    rows.emplace_back(reinterpret_cast<const char*>(&image.pixels[y * image.width * 3]),
                      image.width * 3);
  }
  return MakePng(image.width, image.height, 8, 2, rows);
}

std::string Jpeg(const RgbImage& image, bool grey = false) {
  tjhandle tj = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  std::vector<uint8_t> src = image.pixels;
  if (grey) {
    src.resize(static_cast<size_t>(image.width) * image.height);
    for (size_t i = 0; i < src.size(); ++i) src[i] = image.pixels[3 * i];
  }
  const int rc = tjCompress2(tj, src.data(), image.width, 0, image.height,
                             grey ? TJPF_GRAY : TJPF_RGB, &buf, &size,
                             grey ? TJSAMP_GRAY : TJSAMP_420, 90, 0);
  EXPECT_EQ(rc, 0) << tjGetErrorStr2(tj);
  std::string out(reinterpret_cast<const char*>(buf), size);
  tjFree(buf);
  tjDestroy(tj);
  return out;
}

std::string LosslessWebp(const RgbImage& image) {
  uint8_t* out = nullptr;
  const size_t size =
      WebPEncodeLosslessRGB(image.pixels.data(), image.width, image.height, image.width * 3, &out);
  std::string s(reinterpret_cast<const char*>(out), size);
  WebPFree(out);
  return s;
}

// A big-endian TIFF block with one IFD0 entry: Orientation (SHORT).
std::string ExifWithOrientation(int orientation, bool with_prefix = true) {
  std::string tiff = std::string("MM\0*", 4) + BigEndian32(8);
  tiff += std::string("\x00\x01", 2);                                    // one entry
  tiff += std::string("\x01\x12\x00\x03", 4) + BigEndian32(1);           // tag, SHORT, count 1
  tiff += std::string{0, static_cast<char>(orientation), 0, 0};          // value, padding
  tiff += BigEndian32(0);                                                // no next IFD
  return with_prefix ? std::string("Exif\0\0", 6) + tiff : tiff;
}

std::string WithApp1(const std::string& jpeg, const std::string& payload) {
  const size_t len = payload.size() + 2;
  std::string segment = std::string("\xFF\xE1", 2) +
                        std::string{static_cast<char>(len >> 8), static_cast<char>(len & 0xFF)} +
                        payload;
  return jpeg.substr(0, 2) + segment + jpeg.substr(2);
}

std::vector<uint8_t> Rgb(const RgbImage& image, int x, int y) {
  const uint8_t* p = &image.pixels[(static_cast<size_t>(y) * image.width + x) * 3];
  return {p[0], p[1], p[2]};
}

void ExpectInvalid(const absl::StatusOr<DecodedImage>& result, const std::string& substring) {
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr(substring));
}

// ---- formats and modes --------------------------------------------------------

TEST(ImageDecoderTest, DecodesRgbPngJpegAndWebp) {
  const RgbImage image = Pattern(37, 21, 1);
  absl::StatusOr<DecodedImage> png = DecodeImage(RgbPng(image));
  ASSERT_TRUE(png.ok()) << png.status();
  EXPECT_EQ(png->format, ImageFormat::kPng);
  EXPECT_EQ(png->image.pixels, image.pixels);

  absl::StatusOr<DecodedImage> webp = DecodeImage(LosslessWebp(image));
  ASSERT_TRUE(webp.ok()) << webp.status();
  EXPECT_EQ(webp->format, ImageFormat::kWebp);
  EXPECT_EQ(webp->image.pixels, image.pixels);

  absl::StatusOr<DecodedImage> jpeg = DecodeImage(Jpeg(image));
  ASSERT_TRUE(jpeg.ok()) << jpeg.status();
  EXPECT_EQ(jpeg->format, ImageFormat::kJpeg);
  EXPECT_EQ(jpeg->image.width, 37);
  EXPECT_EQ(jpeg->image.height, 21);
  // Lossy, but close on the smooth channels.
  EXPECT_NEAR(Rgb(jpeg->image, 36, 20)[0], 255, 12);
}

TEST(ImageDecoderTest, GreyJpegHasEqualChannels) {
  absl::StatusOr<DecodedImage> d = DecodeImage(Jpeg(Pattern(40, 30, 2), /*grey=*/true));
  ASSERT_TRUE(d.ok()) << d.status();
  for (size_t i = 0; i < d->image.pixels.size(); i += 3) {
    ASSERT_EQ(d->image.pixels[i], d->image.pixels[i + 1]);
    ASSERT_EQ(d->image.pixels[i], d->image.pixels[i + 2]);
  }
}

TEST(ImageDecoderTest, Png16BitGreyClipsAt255) {
  // Pillow opens it as I (0..65535) and convert("RGB") clips: not v >> 8.
  const uint16_t v[] = {0, 1, 254, 255, 256, 1000, 65535};
  std::string row;
  for (uint16_t x : v) row += {static_cast<char>(x >> 8), static_cast<char>(x & 0xFF)};
  absl::StatusOr<DecodedImage> d = DecodeImage(MakePng(7, 1, 16, 0, {row}));
  ASSERT_TRUE(d.ok()) << d.status();
  const uint8_t want[] = {0, 1, 254, 255, 255, 255, 255};
  for (int x = 0; x < 7; ++x) EXPECT_EQ(Rgb(d->image, x, 0), std::vector<uint8_t>(3, want[x]));
}

TEST(ImageDecoderTest, Png16BitColourKeepsHighByte) {
  std::string rgb16 = std::string("\x12\xAB\x00\xFF\xFF\x01", 6);
  absl::StatusOr<DecodedImage> d = DecodeImage(MakePng(1, 1, 16, 2, {rgb16}));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(Rgb(d->image, 0, 0), (std::vector<uint8_t>{0x12, 0x00, 0xFF}));

  std::string la16 = std::string("\x80\x7F\x00\x00", 4);  // grey 0x807F, alpha 0
  d = DecodeImage(MakePng(1, 1, 16, 4, {la16}));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(Rgb(d->image, 0, 0), (std::vector<uint8_t>{0x80, 0x80, 0x80}));
}

TEST(ImageDecoderTest, AlphaIsDroppedNotComposited) {
  std::string rgba = std::string("\x0A\x14\x1E\x00\xC8\x64\x32\x80", 8);  // alpha 0 and 128
  absl::StatusOr<DecodedImage> d = DecodeImage(MakePng(2, 1, 8, 6, {rgba}));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(Rgb(d->image, 0, 0), (std::vector<uint8_t>{10, 20, 30}));
  EXPECT_EQ(Rgb(d->image, 1, 0), (std::vector<uint8_t>{200, 100, 50}));
}

TEST(ImageDecoderTest, PaletteIgnoresTransparencyAndReadsMissingEntriesAsGrey) {
  const std::string plte = PngChunk("PLTE", std::string("\x0A\x14\x1E\x28\x32\x3C", 6));
  const std::string trns = PngChunk("tRNS", std::string("\x00\x80", 2));
  absl::StatusOr<DecodedImage> d =
      DecodeImage(MakePng(4, 1, 8, 3, {std::string("\x00\x01\x02\xC8", 4)}, plte + trns));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(Rgb(d->image, 0, 0), (std::vector<uint8_t>{10, 20, 30}));
  EXPECT_EQ(Rgb(d->image, 1, 0), (std::vector<uint8_t>{40, 50, 60}));
  EXPECT_EQ(Rgb(d->image, 2, 0), (std::vector<uint8_t>{2, 2, 2}));
  EXPECT_EQ(Rgb(d->image, 3, 0), (std::vector<uint8_t>{200, 200, 200}));
}

TEST(ImageDecoderTest, LowBitDepthGreyIsScaled) {
  // 2-bit samples 0,1,2,3 -> 0, 85, 170, 255; 1-bit 0,1 -> 0, 255.
  absl::StatusOr<DecodedImage> d = DecodeImage(MakePng(4, 1, 2, 0, {std::string("\x1B", 1)}));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(Rgb(d->image, 0, 0)[0], 0);
  EXPECT_EQ(Rgb(d->image, 1, 0)[0], 85);
  EXPECT_EQ(Rgb(d->image, 2, 0)[0], 170);
  EXPECT_EQ(Rgb(d->image, 3, 0)[0], 255);
  d = DecodeImage(MakePng(3, 1, 1, 0, {std::string("\xA0", 1)}));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(Rgb(d->image, 0, 0)[2], 255);
  EXPECT_EQ(Rgb(d->image, 1, 0)[2], 0);
  EXPECT_EQ(Rgb(d->image, 2, 0)[2], 255);
}

TEST(ImageDecoderTest, OneByOneImageDecodes) {
  absl::StatusOr<DecodedImage> d = DecodeImage(RgbPng(Pattern(1, 1, 3)));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->image.width, 1);
  EXPECT_EQ(d->image.height, 1);
}

// ---- EXIF orientation ------------------------------------------------------------

TEST(ExifTest, ParsesOrientationFromBothByteOrders) {
  EXPECT_EQ(ExifOrientation(ExifWithOrientation(6)), 6);
  EXPECT_EQ(ExifOrientation(ExifWithOrientation(8, /*with_prefix=*/false)), 8);
  std::string le = std::string("II*\0", 4) + std::string("\x08\0\0\0", 4) +
                   std::string("\x01\x00\x12\x01\x03\x00\x01\x00\x00\x00\x03\x00\x00\x00", 14);
  EXPECT_EQ(ExifOrientation(le), 3);
}

TEST(ExifTest, MalformedOrMissingMeansNoRotation) {
  EXPECT_EQ(ExifOrientation(""), 1);
  EXPECT_EQ(ExifOrientation("Exif\0\0garbage"), 1);
  const std::string full = ExifWithOrientation(6);
  EXPECT_EQ(ExifOrientation(full.substr(0, full.size() - 10)), 1);  // entry cut off
  EXPECT_EQ(ExifOrientation(ExifWithOrientation(9)), 1);             // out of range
}

TEST(ExifTest, OrientationTransformsMatchPillowTranspose) {
  // 3x2 image, pixel value = 10*y + x in every channel.
  RgbImage image;
  image.width = 3;
  image.height = 2;
  for (int y = 0; y < 2; ++y)
    for (int x = 0; x < 3; ++x)
      for (int c = 0; c < 3; ++c) image.pixels.push_back(static_cast<uint8_t>(10 * y + x));
  auto grid = [](const RgbImage& im) {
    std::vector<std::vector<int>> g(im.height, std::vector<int>(im.width));
    for (int y = 0; y < im.height; ++y)
      for (int x = 0; x < im.width; ++x) g[y][x] = im.pixels[(y * im.width + x) * 3];
    return g;
  };
  using G = std::vector<std::vector<int>>;
  // Input:  0  1  2
  //        10 11 12
  EXPECT_EQ(grid(ApplyExifOrientation(image, 1)), (G{{0, 1, 2}, {10, 11, 12}}));
  EXPECT_EQ(grid(ApplyExifOrientation(image, 2)), (G{{2, 1, 0}, {12, 11, 10}}));  // mirror
  EXPECT_EQ(grid(ApplyExifOrientation(image, 3)), (G{{12, 11, 10}, {2, 1, 0}}));  // 180
  EXPECT_EQ(grid(ApplyExifOrientation(image, 4)), (G{{10, 11, 12}, {0, 1, 2}}));  // flip
  EXPECT_EQ(grid(ApplyExifOrientation(image, 5)), (G{{0, 10}, {1, 11}, {2, 12}}));  // transpose
  EXPECT_EQ(grid(ApplyExifOrientation(image, 6)), (G{{10, 0}, {11, 1}, {12, 2}}));  // 90 cw
  EXPECT_EQ(grid(ApplyExifOrientation(image, 7)), (G{{12, 2}, {11, 1}, {10, 0}}));  // transverse
  EXPECT_EQ(grid(ApplyExifOrientation(image, 8)), (G{{2, 12}, {1, 11}, {0, 10}}));  // 90 ccw
}

TEST(ExifTest, JpegApp1OrientationIsApplied) {
  const RgbImage image = Pattern(48, 16, 4);
  absl::StatusOr<DecodedImage> d = DecodeImage(WithApp1(Jpeg(image), ExifWithOrientation(6)));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->exif_orientation, 6);
  EXPECT_EQ(d->image.width, 16);
  EXPECT_EQ(d->image.height, 48);
  // Orientation 6: the stored left column becomes the top row (red ramps down).
  EXPECT_LT(Rgb(d->image, 0, 0)[0], 30);
  EXPECT_GT(Rgb(d->image, 0, 47)[0], 225);
}

TEST(ExifTest, PngExifChunkIsApplied) {
  const RgbImage image = Pattern(5, 3, 5);
  std::vector<std::string> rows;
  for (int y = 0; y < 3; ++y) {
    rows.emplace_back(reinterpret_cast<const char*>(&image.pixels[y * 15]), 15);
  }
  const std::string exif = PngChunk("eXIf", ExifWithOrientation(8, /*with_prefix=*/false));
  absl::StatusOr<DecodedImage> d = DecodeImage(MakePng(5, 3, 8, 2, rows, exif));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->exif_orientation, 8);
  EXPECT_EQ(d->image.pixels, ApplyExifOrientation(image, 8).pixels);
}

// ---- limits -----------------------------------------------------------------------

// ---- reduced-scale JPEG decode ------------------------------------------------

// A photo-like picture: smooth gradients and low-frequency waves.
RgbImage SmoothPhoto(int width, int height) {
  RgbImage image;
  image.width = width;
  image.height = height;
  image.pixels.resize(static_cast<size_t>(width) * height * 3);
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      uint8_t* p = &image.pixels[(static_cast<size_t>(y) * width + x) * 3];
      p[0] = static_cast<uint8_t>(x * 255 / width);
      p[1] = static_cast<uint8_t>(128 + 100 * std::sin(x * 0.02) * std::cos(y * 0.015));
      p[2] = static_cast<uint8_t>(y * 255 / height);
    }
  }
  return image;
}

TEST(ScaledJpegDecodeTest, PicksTheSmallestScaleGivingTheSizeAskedFor) {
  const std::string jpeg = Jpeg(SmoothPhoto(1600, 1200));
  struct Case {
    int64_t min_w, min_h;
    int scale;
    int width, height;
  };
  for (const Case& c : {Case{400, 300, 2, 400, 300}, Case{401, 300, 3, 600, 450},
                        Case{100, 1, 1, 200, 150}, Case{1600, 1200, 8, 1600, 1200},
                        Case{5000, 5000, 8, 1600, 1200}}) {
    int64_t asked_w = 0, asked_h = 0;
    absl::StatusOr<DecodedImage> d =
        DecodeImage(jpeg, DecodeLimits(), [&](int64_t w, int64_t h) -> std::pair<int64_t, int64_t> {
          asked_w = w;
          asked_h = h;
          return {c.min_w, c.min_h};
        });
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(asked_w, 1600);
    EXPECT_EQ(asked_h, 1200);
    EXPECT_EQ(d->scale_num, c.scale) << c.min_w << "x" << c.min_h;
    EXPECT_EQ(d->image.width, c.width);
    EXPECT_EQ(d->image.height, c.height);
    EXPECT_EQ(d->image.pixels.size(), static_cast<size_t>(c.width) * c.height * 3);
    EXPECT_EQ(d->source_width, 1600);
    EXPECT_EQ(d->source_height, 1200);
  }
  // Other formats ignore the hint; their source size is the image's.
  absl::StatusOr<DecodedImage> png = DecodeImage(
      RgbPng(SmoothPhoto(64, 48)), DecodeLimits(),
      [](int64_t, int64_t) { return std::pair<int64_t, int64_t>{8, 8}; });
  ASSERT_TRUE(png.ok()) << png.status();
  EXPECT_EQ(png->image.width, 64);
  EXPECT_EQ(png->source_width, 64);
  EXPECT_EQ(png->scale_num, 8);
}

TEST(ScaledJpegDecodeTest, ExifRotationAsksAndAnswersInDisplayOrientation) {
  const std::string jpeg = WithApp1(Jpeg(SmoothPhoto(1600, 800)), ExifWithOrientation(6));
  absl::StatusOr<DecodedImage> d =
      DecodeImage(jpeg, DecodeLimits(), [](int64_t w, int64_t h) -> std::pair<int64_t, int64_t> {
        EXPECT_EQ(w, 800);  // displayed upright: 800 wide, 1600 high
        EXPECT_EQ(h, 1600);
        return {200, 400};
      });
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->scale_num, 2);
  EXPECT_EQ(d->image.width, 200);
  EXPECT_EQ(d->image.height, 400);
  EXPECT_EQ(d->source_width, 800);
  EXPECT_EQ(d->source_height, 1600);
}

// The served path (decode at >= 2x the resized size, then the usual bicubic
// resize) against the reference path (full decode, then resize): the same
// grid, and pixels within a few levels.
TEST(ScaledJpegDecodeTest, ResizedPixelsMatchTheFullDecodeClosely) {
  const std::string jpeg = Jpeg(SmoothPhoto(2000, 1500));
  PreprocessOptions options;
  options.max_pixels = 131072;
  absl::StatusOr<DecodedImage> full = DecodeImage(jpeg);
  ASSERT_TRUE(full.ok()) << full.status();
  absl::StatusOr<PreprocessResult> want = PreprocessImage(full->image, options);
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<DecodedImage> scaled = DecodeImage(
      jpeg, DecodeLimits(), [&](int64_t, int64_t) -> std::pair<int64_t, int64_t> {
        return {2 * want->resized_size.width, 2 * want->resized_size.height};
      });
  ASSERT_TRUE(scaled.ok()) << scaled.status();
  ASSERT_LT(scaled->scale_num, 8);
  absl::StatusOr<PreprocessResult> got =
      PreprocessImage(scaled->image, options, scaled->source_width, scaled->source_height);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->resized_size, want->resized_size);
  EXPECT_EQ(got->patches.grid_h, want->patches.grid_h);
  EXPECT_EQ(got->patches.grid_w, want->patches.grid_w);
  ASSERT_EQ(got->resized.pixels.size(), want->resized.pixels.size());
  double sum = 0;
  int worst = 0;
  for (size_t i = 0; i < got->resized.pixels.size(); ++i) {
    const int d = std::abs(int{got->resized.pixels[i]} - int{want->resized.pixels[i]});
    sum += d;
    worst = std::max(worst, d);
  }
  const double mean = sum / static_cast<double>(got->resized.pixels.size());
  RecordProperty("mean_abs_diff", std::to_string(mean));
  EXPECT_LT(mean, 1.5) << "worst " << worst;
  EXPECT_LE(worst, 24);
}

TEST(DecodeLimitsTest, HugePngHeaderIsRefusedBeforeDecoding) {
  // A 30000x30000 header with a few bytes of IDAT: decoding would fail on the
  // data; the limit must fire first, from the header alone.
  const std::string png = PngSignature() + Ihdr(30000, 30000, 8, 2) +
                          PngChunk("IDAT", Deflate(std::string(100, '\0'))) + PngChunk("IEND", "");
  absl::StatusOr<DecodedImage> d = DecodeImage(png);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(d.status().message(),
            "image is 30000x30000 = 900000000 pixels; max_decoded_pixels is 100000000");
}

TEST(DecodeLimitsTest, PixelLimitAppliesToEveryFormat) {
  DecodeLimits limits;
  limits.max_decoded_pixels = 1000;
  const RgbImage image = Pattern(50, 40, 6);
  const std::string want = "image is 50x40 = 2000 pixels; max_decoded_pixels is 1000";
  for (const std::string& bytes : {RgbPng(image), Jpeg(image), LosslessWebp(image)}) {
    absl::StatusOr<DecodedImage> d = DecodeImage(bytes, limits);
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().message(), want);
  }
  limits.max_decoded_pixels = 2000;
  EXPECT_TRUE(DecodeImage(RgbPng(image), limits).ok());
}

TEST(DecodeLimitsTest, EncodedSizeLimit) {
  DecodeLimits limits;
  const std::string png = RgbPng(Pattern(20, 20, 7));
  limits.max_encoded_bytes = static_cast<int64_t>(png.size()) - 1;
  ExpectInvalid(DecodeImage(png, limits),
                "image is " + std::to_string(png.size()) + " bytes; max_encoded_bytes is " +
                    std::to_string(png.size() - 1));
  limits.max_encoded_bytes = static_cast<int64_t>(png.size());
  EXPECT_TRUE(DecodeImage(png, limits).ok());
}

TEST(DecodeLimitsTest, AspectRatioPastTwoHundredIsRefused) {
  const std::string wide_header = PngSignature() + Ihdr(2010, 10, 8, 2) +
                                  PngChunk("IDAT", Deflate(std::string(10, '\0')));
  ExpectInvalid(DecodeImage(wide_header),
                "image is 2010x10, aspect ratio 201; the maximum aspect ratio is 200");
  const std::string tall_header = PngSignature() + Ihdr(10, 2010, 8, 2) +
                                  PngChunk("IDAT", Deflate(std::string(10, '\0')));
  ExpectInvalid(DecodeImage(tall_header), "aspect ratio 201");
  EXPECT_TRUE(DecodeImage(RgbPng(Pattern(2000, 10, 8))).ok());  // exactly 200 passes
  EXPECT_TRUE(DecodeImage(RgbPng(Pattern(10, 2000, 9))).ok());
}

// ---- bad input ---------------------------------------------------------------------

TEST(BadInputTest, EmptyInput) { ExpectInvalid(DecodeImage(""), "image is empty (0 bytes)"); }

TEST(BadInputTest, RandomBytes) {
  std::mt19937 rng(11);
  std::string bytes(4096, '\0');
  for (char& c : bytes) c = static_cast<char>(rng());
  bytes[0] = 0x42;  // not a magic number we know
  bytes[1] = 0x00;
  ExpectInvalid(DecodeImage(bytes), "unrecognised image format (first bytes 42 00");
}

TEST(BadInputTest, UnsupportedFormatsAreNamed) {
  ExpectInvalid(DecodeImage(std::string("GIF89a\x01\x00\x01\x00", 10)),
                "unsupported image format GIF; supported formats are JPEG, PNG and WebP");
  ExpectInvalid(DecodeImage(std::string("BM\x3a\0\0\0\0\0", 8)), "unsupported image format BMP");
  ExpectInvalid(DecodeImage(std::string("II*\0\x08\0\0\0", 8)), "unsupported image format TIFF");
}

TEST(BadInputTest, TruncatedFiles) {
  const RgbImage image = Pattern(64, 48, 12);
  const std::string jpeg = Jpeg(image);
  for (size_t keep : {size_t{3}, size_t{100}, jpeg.size() / 2, jpeg.size() - 40}) {
    SCOPED_TRACE(keep);
    ExpectInvalid(DecodeImage(jpeg.substr(0, keep)), "JPEG");
  }
  const std::string png = RgbPng(image);
  for (size_t keep : {size_t{8}, size_t{20}, size_t{40}, png.size() / 2, png.size() - 20}) {
    SCOPED_TRACE(keep);
    ExpectInvalid(DecodeImage(png.substr(0, keep)), "PNG");
  }
  const std::string webp = LosslessWebp(image);
  for (size_t keep : {size_t{12}, size_t{30}, webp.size() / 2, webp.size() - 1}) {
    SCOPED_TRACE(keep);
    ExpectInvalid(DecodeImage(webp.substr(0, keep)), "WebP");
  }
}

TEST(BadInputTest, ValidHeaderThenGarbage) {
  std::mt19937 rng(13);
  auto garbage = [&](size_t n) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    return s;
  };
  // JPEG: everything up to the end of the SOS header, then random entropy data.
  const std::string jpeg = Jpeg(Pattern(64, 48, 14));
  const size_t sos = jpeg.find("\xFF\xDA");
  ASSERT_NE(sos, std::string::npos);
  const size_t sos_len = (static_cast<uint8_t>(jpeg[sos + 2]) << 8) | static_cast<uint8_t>(jpeg[sos + 3]);
  const std::string jpeg_head = jpeg.substr(0, sos + 2 + sos_len);
  ExpectInvalid(DecodeImage(jpeg_head + garbage(3000)), "invalid JPEG data");
  ExpectInvalid(DecodeImage(jpeg_head + garbage(3000) + "\xFF\xD9"), "invalid JPEG data");

  // PNG: a valid IHDR, then an IDAT of random bytes (correct CRC).
  const std::string png_head = PngSignature() + Ihdr(64, 48, 8, 2);
  ExpectInvalid(DecodeImage(png_head + PngChunk("IDAT", garbage(2000)) + PngChunk("IEND", "")),
                "invalid PNG data");
  // ... or plain random bytes after the IHDR.
  ExpectInvalid(DecodeImage(png_head + garbage(2000)), "PNG");

  // WebP: a valid RIFF/VP8L header and random bitstream.
  const std::string webp = LosslessWebp(Pattern(64, 48, 15));
  std::string bad_webp = webp.substr(0, 25) + garbage(webp.size() - 25);
  absl::StatusOr<DecodedImage> d = DecodeImage(bad_webp);
  ExpectInvalid(d, "WebP");
}

TEST(BadInputTest, RandomCorruptionNeverCrashes) {
  // Mutated and truncated copies of valid files: each either decodes or is an
  // INVALID_ARGUMENT; nothing else (no crash, no other code).
  const RgbImage image = Pattern(40, 32, 16);
  const std::vector<std::string> files = {Jpeg(image), Jpeg(image, true), RgbPng(image),
                                          LosslessWebp(image)};
  std::mt19937 rng(17);
  int ok = 0, invalid = 0;
  for (const std::string& file : files) {
    for (int i = 0; i < 300; ++i) {
      std::string bytes = file;
      const int edits = 1 + static_cast<int>(rng() % 8);
      for (int e = 0; e < edits; ++e) bytes[rng() % bytes.size()] = static_cast<char>(rng());
      if (i % 3 == 0) bytes.resize(rng() % bytes.size() + 1);
      absl::StatusOr<DecodedImage> d = DecodeImage(bytes);
      if (d.ok()) {
        ++ok;
        ASSERT_EQ(d->image.pixels.size(), static_cast<size_t>(d->image.width) * d->image.height * 3);
      } else {
        ++invalid;
        ASSERT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
        ASSERT_FALSE(d.status().message().empty());
      }
    }
  }
  EXPECT_GT(invalid, 0);
  std::printf("corrupted files: %d decoded, %d refused\n", ok, invalid);
}

// ---- hashing view ---------------------------------------------------------------

TEST(RgbImageTest, SamePictureInAnotherContainerHasSameBytes) {
  const RgbImage image = Pattern(23, 17, 18);
  absl::StatusOr<DecodedImage> png = DecodeImage(RgbPng(image));
  absl::StatusOr<DecodedImage> webp = DecodeImage(LosslessWebp(image));
  ASSERT_TRUE(png.ok());
  ASSERT_TRUE(webp.ok());
  EXPECT_EQ(png->image.bytes(), webp->image.bytes());
  EXPECT_EQ(png->image.HashHeader(), "rgb8 23x17\n");
  EXPECT_EQ(png->image.bytes().size(), 23u * 17u * 3u);
}

TEST(SniffTest, MagicNumbers) {
  EXPECT_EQ(SniffImageFormat("\xFF\xD8\xFF\xE0"), ImageFormat::kJpeg);
  EXPECT_EQ(SniffImageFormat(PngSignature()), ImageFormat::kPng);
  EXPECT_EQ(SniffImageFormat(std::string("RIFF\0\0\0\0WEBPVP8 ", 16)), ImageFormat::kWebp);
  EXPECT_EQ(SniffImageFormat("RIFF"), ImageFormat::kUnknown);
  EXPECT_EQ(SniffImageFormat("GIF87a"), ImageFormat::kGif);
}

}  // namespace
}  // namespace vlm::vision
