// The pixel budget of a request (defaults, the operator's limits, OpenAI's
// detail budgets) and the resize decision for every image size a phone or a
// scanner produces: 1x1 to 12000x9000 and thin strips. Each size either gets a
// resized grid inside the budget whose features fit the message limit, or a
// clear INVALID_ARGUMENT naming the model's own limit (aspect ratio over 200)
// -- never a refusal for size alone.
#include <cmath>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/vision/preprocess.h"

namespace vlm::vision {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kFactor = 32;  // patch 16 x merge 2
constexpr int64_t kPatch = 16;
// Qwen3-VL-2B: hidden 1024, last hidden state + 3 deepstack taps, BF16 on the wire.
constexpr int64_t kBytesPerPatch = 1024 * 2 * 4;
constexpr int64_t kMessageBytes = int64_t{128} << 20;  // --max_message_mb default
constexpr int64_t kEnvelope = 64 << 10;
constexpr int64_t kFittingPatches = (kMessageBytes - kEnvelope) / kBytesPerPatch;

PreprocessOptions ServerDefaults() {
  PreprocessOptions o;  // checkpoint values: min 65536, max 16777216
  o.max_pixels = 786432;
  return o;
}

TEST(PixelBudgetTest, RequestsWithoutABudgetGetTheServerDefault) {
  absl::StatusOr<PreprocessOptions> o = ResolvePixelBudget(ServerDefaults(), 1024, 4194304, 0, 0);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->max_pixels, 786432);
  EXPECT_EQ(o->min_pixels, 65536);
}

TEST(PixelBudgetTest, LargerRequestsAreCappedByTheLimitNotRefused) {
  absl::StatusOr<PreprocessOptions> o =
      ResolvePixelBudget(ServerDefaults(), 1024, 4194304, 0, int64_t{1} << 40);  // detail high
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->max_pixels, 4194304);
  o = ResolvePixelBudget(ServerDefaults(), 1024, 4194304, 5000000, 6000000);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->min_pixels, 4194304);
  EXPECT_EQ(o->max_pixels, 4194304);
}

TEST(PixelBudgetTest, SmallBudgetLowersTheDefaultMinimum) {
  // detail "low": 512x512.
  absl::StatusOr<PreprocessOptions> o = ResolvePixelBudget(ServerDefaults(), 1024, 4194304, 0, 262144);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->max_pixels, 262144);
  EXPECT_EQ(o->min_pixels, 65536);
  o = ResolvePixelBudget(ServerDefaults(), 1024, 4194304, 0, 2048);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->max_pixels, 2048);
  EXPECT_EQ(o->min_pixels, 2048);
}

TEST(PixelBudgetTest, BadRequestsNameTheLimit) {
  struct Case {
    int64_t min, max;
    const char* names;
  };
  for (const Case& c : {Case{-1, 0, "negative"}, Case{0, -5, "negative"},
                        Case{100, 0, "min_pixels_limit 1024"}, Case{0, 512, "min_pixels_limit"},
                        Case{4096, 2048, "min_pixels 4096 exceeds max_pixels 2048"},
                        Case{1000000, 0, "exceeds max_pixels 786432 (the server default"}}) {
    absl::StatusOr<PreprocessOptions> o =
        ResolvePixelBudget(ServerDefaults(), 1024, 4194304, c.min, c.max);
    ASSERT_FALSE(o.ok()) << c.min << " " << c.max;
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(o.status().message()), HasSubstr(c.names));
  }
}

TEST(PixelBudgetTest, DefaultLimitIsTheLargestBudgetWhoseFeaturesFitAMessage) {
  // The 2B checkpoint's 16.7 MP maximum does not fit 128 MiB (65536 patches at 8 KiB).
  EXPECT_FALSE(BudgetFitsPatches(kFactor, kPatch, 65536, 16777216, kFittingPatches));
  const int64_t limit = LargestFittingBudget(kFactor, kPatch, 65536, 16777216, kFittingPatches);
  EXPECT_GT(limit, 4000000);  // about 4.2 MP
  EXPECT_EQ(limit % (kFactor * kFactor), 0);
  EXPECT_TRUE(BudgetFitsPatches(kFactor, kPatch, 65536, limit, kFittingPatches));
  EXPECT_FALSE(
      BudgetFitsPatches(kFactor, kPatch, 65536, limit + kFactor * kFactor, kFittingPatches));
  // A budget that fits is kept as it is.
  EXPECT_EQ(LargestFittingBudget(kFactor, kPatch, 65536, 786432, kFittingPatches), 786432);
  // Nothing fits a message of 10 patches.
  EXPECT_EQ(LargestFittingBudget(kFactor, kPatch, 65536, 786432, 0), 0);
}

TEST(PixelBudgetTest, LargestResizedAreaBoundsEverySmartResize) {
  // Budgets from tiny to large, images from thin strips to huge photos.
  std::vector<int64_t> sides = {1, 2, 3, 15, 16, 31, 32, 33, 47, 100, 255, 511, 1000, 1023,
                                2999, 3000, 4000, 6000, 9000, 12000, 20000, 200000};
  for (int64_t max_pixels : {int64_t{1024}, int64_t{4096}, int64_t{65536}, int64_t{204800},
                             int64_t{262144}, int64_t{786432}, int64_t{4194304}}) {
    for (int64_t min_pixels : {int64_t{1024}, int64_t{65536}, max_pixels}) {
      const int64_t lo = std::min(min_pixels, max_pixels);
      const int64_t bound = LargestResizedArea(kFactor, lo, max_pixels);
      for (int64_t h : sides) {
        for (int64_t w : sides) {
          absl::StatusOr<ImageSize> s = SmartResize(h, w, kFactor, lo, max_pixels);
          if (!s.ok()) continue;
          EXPECT_LE(s->height * s->width, bound) << w << "x" << h << " " << lo << " " << max_pixels;
        }
      }
    }
  }
}

// Every image size under the defaults, detail "low" and detail "high".
TEST(PixelBudgetTest, EveryImageSizeAnswersOrNamesTheModelLimit) {
  std::vector<int64_t> sides;
  for (double s = 1; s <= 12000; s *= 1.37) sides.push_back(static_cast<int64_t>(s));
  for (int64_t s : {2, 16, 31, 32, 33, 64, 255, 256, 480, 640, 720, 1080, 1920, 2048, 3000, 3024,
                    4000, 4032, 5000, 6000, 8000, 9000, 12000}) {
    sides.push_back(s);
  }
  const int64_t limit = LargestFittingBudget(kFactor, kPatch, 65536, 16777216, kFittingPatches);
  int answered = 0, refused = 0;
  for (int64_t requested : {int64_t{0}, int64_t{262144}, int64_t{1} << 40}) {
    absl::StatusOr<PreprocessOptions> budget =
        ResolvePixelBudget(ServerDefaults(), 1024, limit, 0, requested);
    ASSERT_TRUE(budget.ok()) << budget.status();
    const int64_t lo = budget->min_pixels, hi = budget->max_pixels;
    for (int64_t h : sides) {
      for (int64_t w : sides) {
        absl::StatusOr<ImageSize> s = SmartResize(h, w, kFactor, lo, hi);
        const double ratio = static_cast<double>(std::max(h, w)) / std::min(h, w);
        if (!s.ok()) {
          ++refused;
          EXPECT_GT(ratio, 200.0) << w << "x" << h;
          EXPECT_THAT(std::string(s.status().message()), HasSubstr("maximum aspect ratio is 200"));
          continue;
        }
        ++answered;
        EXPECT_LE(ratio, 200.0);
        EXPECT_EQ(s->height % kFactor, 0);
        EXPECT_EQ(s->width % kFactor, 0);
        const int64_t area = s->height * s->width;
        EXPECT_LE(area / (kPatch * kPatch), kFittingPatches) << w << "x" << h;
        // An image above the budget is brought down to it (not refused) ...
        if (h * w > hi && ratio <= 100) {
          EXPECT_LE(area, hi) << w << "x" << h;
        }
        // ... and keeps its aspect ratio within one factor step per side.
        if (std::min(h, w) >= 64 && ratio <= 10) {  // aspect kept
          const double got = static_cast<double>(s->width) / s->height;
          const double want = static_cast<double>(w) / h;
          EXPECT_NEAR(got / want, 1.0, 0.35) << w << "x" << h;
        }
      }
    }
    // The photos of the task: a 12 MP phone picture and a 108 MP camera one.
    for (auto [w, h] : {std::pair<int64_t, int64_t>{4000, 3000}, {12000, 9000}}) {
      absl::StatusOr<ImageSize> s = SmartResize(h, w, kFactor, lo, hi);
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_LE(s->height * s->width, hi);
      EXPECT_NEAR(static_cast<double>(s->width) / s->height, 4.0 / 3.0, 0.1)  // within a factor step
          << s->width << "x" << s->height;
      EXPECT_GE(s->height * s->width, hi * 3 / 4) << "the budget is used, not wasted";
    }
  }
  EXPECT_GT(answered, 0);
  EXPECT_GT(refused, 0);  // the 1x5000-like strips
  // Extreme strips name the model's aspect-ratio limit; a 200:1 strip is served.
  for (auto [w, h] : {std::pair<int64_t, int64_t>{1, 5000}, {5000, 1}, {201, 1}}) {
    absl::StatusOr<ImageSize> s = SmartResize(h, w, kFactor, 65536, 786432);
    ASSERT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.status().message()), HasSubstr("aspect ratio"));
  }
  absl::StatusOr<ImageSize> strip = SmartResize(25, 5000, kFactor, 65536, 786432);
  ASSERT_TRUE(strip.ok()) << strip.status();
  EXPECT_LE(strip->height * strip->width, LargestResizedArea(kFactor, 65536, 786432));
}

// The extreme shapes at every budget a request can get (default, detail low,
// detail high = the message-size limit): 1x40000 and 40000x1 and 201:1 name
// the aspect-ratio limit; exactly 200:1 is served, its features fit.
TEST(PixelBudgetTest, ExtremeAspectRatiosAnswerOrNameTheRatioLimit) {
  const int64_t limit = LargestFittingBudget(kFactor, kPatch, 65536, 16777216, kFittingPatches);
  for (int64_t requested : {int64_t{0}, int64_t{262144}, int64_t{1} << 40}) {
    absl::StatusOr<PreprocessOptions> budget =
        ResolvePixelBudget(ServerDefaults(), 1024, limit, 0, requested);
    ASSERT_TRUE(budget.ok()) << budget.status();
    const int64_t lo = budget->min_pixels, hi = budget->max_pixels;
    for (auto [w, h] : {std::pair<int64_t, int64_t>{1, 40000}, {40000, 1}, {201, 1}, {1, 201},
                        {40200, 200}, {201000, 1000}}) {
      absl::StatusOr<ImageSize> s = SmartResize(h, w, kFactor, lo, hi);
      ASSERT_FALSE(s.ok()) << w << "x" << h;
      EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(s.status().message()), HasSubstr("the maximum aspect ratio is 200"));
    }
    for (auto [w, h] : {std::pair<int64_t, int64_t>{200, 1}, {1, 200}, {40000, 200}, {200, 40000},
                        {12000, 60}, {2, 400}}) {
      absl::StatusOr<ImageSize> s = SmartResize(h, w, kFactor, lo, hi);
      ASSERT_TRUE(s.ok()) << w << "x" << h << ": " << s.status();
      EXPECT_EQ(s->height % kFactor, 0);
      EXPECT_EQ(s->width % kFactor, 0);
      EXPECT_GE(s->height * s->width, std::min(lo, hi)) << w << "x" << h;
      EXPECT_LE(s->height * s->width, LargestResizedArea(kFactor, lo, hi)) << w << "x" << h;
      EXPECT_LE(s->height * s->width / (kPatch * kPatch), kFittingPatches) << w << "x" << h;
      // the long side stays the long side
      EXPECT_EQ(w > h, s->width > s->height) << w << "x" << h;
    }
  }
}

}  // namespace
}  // namespace vlm::vision
