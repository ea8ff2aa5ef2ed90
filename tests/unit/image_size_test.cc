// The gateway's header-size reader (JPEG SOF, PNG IHDR, WebP VP8/VP8L/VP8X) on
// real encoder output, every truncation and random corruption (an error that
// names the problem, never a crash or a read past the bytes), and the image
// cost estimate built on it (budget, tokens, the early deadline refusal).
#include "services/gateway/image_size.h"

#include <turbojpeg.h>
#include <webp/encode.h>

#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/gateway/validation.h"

namespace vlm::gateway {
namespace {

using ::testing::HasSubstr;

std::vector<uint8_t> Pixels(int w, int h, int channels) {
  std::vector<uint8_t> p(static_cast<size_t>(w) * h * channels);
  for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<uint8_t>(i * 7 + i / 13);
  return p;
}

std::string Jpeg(int w, int h, bool progressive = false) {
  tjhandle tj = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  std::vector<uint8_t> src = Pixels(w, h, 3);
  const int rc = tjCompress2(tj, src.data(), w, 0, h, TJPF_RGB, &buf, &size, TJSAMP_420, 80,
                             progressive ? TJFLAG_PROGRESSIVE : 0);
  EXPECT_EQ(rc, 0) << tjGetErrorStr2(tj);
  std::string out(reinterpret_cast<const char*>(buf), size);
  tjFree(buf);
  tjDestroy(tj);
  return out;
}

// A JPEG with an APP1 (EXIF-like) segment and fill bytes before the frame header.
std::string JpegWithApp1(int w, int h) {
  const std::string plain = Jpeg(w, h);
  std::string app1 = "\xFF\xE1";
  const std::string payload = "Exif\0\0" + std::string(300, 'x');
  const size_t length = payload.size() + 2;
  app1 += static_cast<char>(length >> 8);
  app1 += static_cast<char>(length & 0xFF);
  app1 += payload;
  app1 += "\xFF";  // a fill byte before the next marker
  return plain.substr(0, 2) + app1 + plain.substr(2);
}

std::string Webp(int w, int h, bool lossless, bool alpha) {
  uint8_t* out = nullptr;
  size_t size = 0;
  std::vector<uint8_t> src = Pixels(w, h, alpha ? 4 : 3);
  if (lossless) {
    size = alpha ? WebPEncodeLosslessRGBA(src.data(), w, h, w * 4, &out)
                 : WebPEncodeLosslessRGB(src.data(), w, h, w * 3, &out);
  } else {
    size = alpha ? WebPEncodeRGBA(src.data(), w, h, w * 4, 75, &out)
                 : WebPEncodeRGB(src.data(), w, h, w * 3, 75, &out);
  }
  std::string s(reinterpret_cast<const char*>(out), size);
  WebPFree(out);
  return s;
}

std::string Be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

// Signature and IHDR (the CRC and the rest do not matter to the size reader).
std::string PngHeader(uint32_t w, uint32_t h) {
  return std::string("\x89PNG\r\n\x1a\n", 8) + Be32(13) + "IHDR" + Be32(w) + Be32(h) +
         std::string("\x08\x02\x00\x00\x00", 5) + Be32(0);
}

// An extended WebP (VP8X) canvas header of the given size, as a camera app writes.
std::string Vp8xHeader(uint32_t w, uint32_t h) {
  std::string s = "RIFF" + std::string(4, '\0') + "WEBP" + "VP8X" + std::string("\x0a\0\0\0", 4);
  s += std::string("\x10\0\0\0", 4);
  for (uint32_t v : {w - 1, h - 1}) {
    s += static_cast<char>(v & 0xFF);
    s += static_cast<char>((v >> 8) & 0xFF);
    s += static_cast<char>((v >> 16) & 0xFF);
  }
  return s;
}

void ExpectSize(const std::string& bytes, int64_t w, int64_t h, const char* format) {
  absl::StatusOr<ImageDimensions> d = ReadImageDimensions(bytes);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->width, w);
  EXPECT_EQ(d->height, h);
  EXPECT_STREQ(d->format, format);
}

TEST(ImageSizeTest, ReadsEncoderOutput) {
  ExpectSize(Jpeg(123, 45), 123, 45, "jpeg");
  ExpectSize(Jpeg(45, 123, /*progressive=*/true), 45, 123, "jpeg");
  ExpectSize(JpegWithApp1(640, 480), 640, 480, "jpeg");
  ExpectSize(PngHeader(4000, 3000), 4000, 3000, "png");
  ExpectSize(PngHeader(1, 5000), 1, 5000, "png");
  ExpectSize(Webp(77, 33, /*lossless=*/false, /*alpha=*/false), 77, 33, "webp");   // VP8
  ExpectSize(Webp(77, 33, /*lossless=*/true, /*alpha=*/false), 77, 33, "webp");    // VP8L
  ExpectSize(Webp(77, 33, /*lossless=*/false, /*alpha=*/true), 77, 33, "webp");    // VP8X
  ExpectSize(Vp8xHeader(12000, 9000), 12000, 9000, "webp");
}

TEST(ImageSizeTest, EveryTruncationIsAClearErrorOrTheRightSize) {
  struct Case {
    std::string bytes;
    int64_t w, h;
  };
  const std::vector<Case> cases = {{Jpeg(64, 48), 64, 48},
                                   {JpegWithApp1(64, 48), 64, 48},
                                   {PngHeader(64, 48), 64, 48},
                                   {Webp(64, 48, false, false), 64, 48},
                                   {Webp(64, 48, true, false), 64, 48},
                                   {Webp(64, 48, false, true), 64, 48}};
  for (const Case& c : cases) {
    for (size_t n = 0; n < std::min<size_t>(c.bytes.size(), 1024); ++n) {
      // A copy of exactly n bytes: a read past the end shows under the sanitizers.
      const std::string prefix = c.bytes.substr(0, n);
      absl::StatusOr<ImageDimensions> d = ReadImageDimensions(prefix);
      if (d.ok()) {
        EXPECT_EQ(d->width, c.w) << n;
        EXPECT_EQ(d->height, c.h) << n;
      } else {
        EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_FALSE(d.status().message().empty());
      }
    }
  }
  EXPECT_THAT(std::string(ReadImageDimensions(Jpeg(64, 48).substr(0, 10)).status().message()),
              HasSubstr("JPEG header"));
  EXPECT_THAT(std::string(ReadImageDimensions(PngHeader(3, 3).substr(0, 20)).status().message()),
              HasSubstr("PNG header: truncated"));
}

TEST(ImageSizeTest, CorruptHeadersAreErrorsNeverCrashes) {
  EXPECT_THAT(std::string(ReadImageDimensions("").status().message()),
              HasSubstr("not a JPEG, PNG or WebP"));
  EXPECT_THAT(std::string(ReadImageDimensions("GIF89a....").status().message()),
              HasSubstr("unrecognised signature"));
  std::string zero = PngHeader(0, 10);
  EXPECT_THAT(std::string(ReadImageDimensions(zero).status().message()), HasSubstr("IHDR size"));
  std::string not_ihdr = PngHeader(5, 5);
  not_ihdr[12] = 'X';
  EXPECT_THAT(std::string(ReadImageDimensions(not_ihdr).status().message()),
              HasSubstr("not IHDR"));
  // A JPEG whose scan starts before any frame header.
  EXPECT_THAT(std::string(ReadImageDimensions(std::string("\xFF\xD8\xFF\xDA\x00\x02", 6))
                              .status()
                              .message()),
              HasSubstr("no frame header"));
  // A segment length below 2 would loop forever if trusted.
  EXPECT_THAT(std::string(ReadImageDimensions(std::string("\xFF\xD8\xFF\xE0\x00\x01", 6))
                              .status()
                              .message()),
              HasSubstr("segment length"));
  std::string bad_vp8 = Webp(16, 16, false, false);
  bad_vp8[23] = 0;  // start code
  EXPECT_THAT(std::string(ReadImageDimensions(bad_vp8).status().message()),
              HasSubstr("start code"));

  // Random corruption of real headers: any answer, never a crash.
  std::mt19937 rng(7);
  for (const std::string& base : {Jpeg(40, 30), JpegWithApp1(40, 30), Webp(40, 30, false, true),
                                  Webp(40, 30, true, false), PngHeader(40, 30)}) {
    for (int i = 0; i < 2000; ++i) {
      std::string bytes = base.substr(0, std::min<size_t>(base.size(), 64 + rng() % 512));
      for (int k = 0; k < 4; ++k) bytes[3 + rng() % (bytes.size() - 3)] = static_cast<char>(rng());
      absl::StatusOr<ImageDimensions> d = ReadImageDimensions(bytes);
      if (d.ok()) {
        EXPECT_GT(d->width, 0);
        EXPECT_GT(d->height, 0);
        EXPECT_LE(d->width, int64_t{1} << 31);
      }
    }
  }
}

// ---- the cost estimate -------------------------------------------------------

v1::ChatRequest RequestWith(const std::vector<std::string>& images) {
  v1::ChatRequest request;
  v1::ChatMessage* m = request.add_messages();
  m->set_role("user");
  for (const std::string& image : images) m->add_content()->mutable_image()->set_data(image);
  m->add_content()->set_text("what is this?");
  return request;
}

TEST(ImageCostTest, EstimatesThePhotoAtTheDefaultBudget) {
  ImageCostModel model;  // default budget 524288
  const std::vector<ImageEstimate> e = EstimateImages(RequestWith({PngHeader(4000, 3000)}), model);
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].max_pixels, 524288);
  // smart_resize(3000, 4000, 32, 65536, 524288): beta = sqrt(12e6 / 524288) = 4.784,
  // floor(3000 / 4.784 / 32) * 32 = 608, floor(4000 / 4.784 / 32) * 32 = 832:
  // 38 x 52 patches, 494 tokens.
  EXPECT_EQ(e[0].resized_height, 608);
  EXPECT_EQ(e[0].resized_width, 832);
  EXPECT_EQ(e[0].patches, 38 * 52);
  EXPECT_EQ(e[0].tokens, 494);
  EXPECT_LE(e[0].resized_height * e[0].resized_width, 524288);
}

TEST(ImageCostTest, BudgetFollowsTheRequestOptionsUpToTheLimit) {
  ImageCostModel model;
  v1::ChatRequest low = RequestWith({PngHeader(4000, 3000)});
  low.mutable_messages(0)->mutable_content(0)->mutable_image()->mutable_options()->set_max_pixels(
      262144);
  std::vector<ImageEstimate> e = EstimateImages(low, model);
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].max_pixels, 262144);
  EXPECT_LE(e[0].resized_height * e[0].resized_width, 262144);
  // "high": lowered to the vision service's limit (here 786432, above its default).
  v1::ChatRequest high = RequestWith({PngHeader(4000, 3000)});
  high.mutable_image_options()->set_max_pixels(int64_t{1} << 40);
  e = EstimateImages(high, model);
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].max_pixels, 786432);
  model.max_pixels_limit = 4194304;
  e = EstimateImages(high, model);
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].max_pixels, 4194304);
  EXPECT_GT(e[0].patches, 3 * 3072);
  // Unreadable headers and aspect ratios above 200 are left to the vision service.
  EXPECT_TRUE(EstimateImages(RequestWith({"garbage", PngHeader(1, 5000)}), model).empty());
}

TEST(ImageCostTest, ImpossibleDeadlineIsRefusedEarlyNamingTheEstimate) {
  ImageCostModel model;
  model.min_ms_per_patch = 1.0;
  const v1::ChatRequest request = RequestWith({PngHeader(64, 64), PngHeader(4000, 3000)});
  absl::Status s = CheckImageCost(request, model, absl::Milliseconds(100));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(s.message()), HasSubstr("image 2 (4000x3000, resized to 832x608: 1976"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("at least 1976 ms"));
  EXPECT_TRUE(CheckImageCost(request, model, absl::Seconds(10)).ok());
  EXPECT_TRUE(CheckImageCost(request, model, absl::InfiniteDuration()).ok());
  model.min_ms_per_patch = 0;  // disabled
  EXPECT_TRUE(CheckImageCost(request, model, absl::Milliseconds(1)).ok());
}

TEST(ImageCostTest, ImageTokensCountAgainstTheRequestLimit) {
  ImageCostModel model;
  model.max_image_tokens = 800;  // one photo at the default budget is 494 tokens
  absl::Status s = CheckImageCost(RequestWith({PngHeader(4000, 3000), PngHeader(4000, 3000)}),
                                  model, absl::InfiniteDuration());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("at least 988 tokens"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("max_image_tokens is 800"));
  EXPECT_TRUE(CheckImageCost(RequestWith({PngHeader(4000, 3000)}), model, absl::InfiniteDuration())
                  .ok());
}

// The budget the vision service reports (GetImageBudget) replaces the model's
// numbers; one that cannot be right is refused (the gateway then makes no
// estimate rather than a wrong one).
TEST(ImageCostTest, TheVisionServiceBudgetDrivesTheEstimate) {
  v1::ImageBudget budget;
  budget.set_default_min_pixels(4096);
  budget.set_default_max_pixels(262144);
  budget.set_min_pixels_limit(1024);
  budget.set_max_pixels_limit(1048576);
  budget.set_patch_size(14);
  budget.set_merge_size(2);
  budget.set_temporal_patch_size(2);
  budget.set_max_aspect_ratio(200);
  ImageCostModel model;
  ASSERT_TRUE(ApplyImageBudget(budget, &model).ok());
  EXPECT_EQ(model.default_max_pixels, 262144);
  EXPECT_EQ(model.max_pixels_limit, 1048576);
  EXPECT_EQ(model.min_pixels, 4096);
  EXPECT_EQ(model.patch_size, 14);
  std::vector<ImageEstimate> e = EstimateImages(RequestWith({PngHeader(4000, 3000)}), model);
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].max_pixels, 262144);
  EXPECT_EQ(e[0].resized_height % 28, 0);
  EXPECT_EQ(e[0].resized_width % 28, 0);
  EXPECT_LE(e[0].resized_height * e[0].resized_width, 262144);
  EXPECT_EQ(e[0].patches, (e[0].resized_height / 14) * (e[0].resized_width / 14));
  for (int which = 0; which < 3; ++which) {
    v1::ImageBudget broken = budget;
    if (which == 0) broken.set_patch_size(0);
    if (which == 1) broken.set_default_max_pixels(2048);  // below the default minimum
    if (which == 2) broken.set_max_pixels_limit(1000);    // below the default maximum
    ImageCostModel untouched;
    EXPECT_EQ(ApplyImageBudget(broken, &untouched).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(untouched.default_max_pixels, ImageCostModel().default_max_pixels);
  }
}

}  // namespace
}  // namespace vlm::gateway
