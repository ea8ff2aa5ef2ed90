#include "services/vision/preprocess.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_format.h"

namespace vlm::vision {
namespace {

// Pillow's Resample.c, 8-bit path: 32 - 8 - 2 bits of fraction.
constexpr int kPrecisionBits = 22;
constexpr double kBicubicSupport = 2.0;

// Keys' cubic convolution with a = -0.5, written as Pillow writes it (the
// float rounding of the coefficients depends on the form).
double BicubicFilter(double x) {
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

// The taps of one resampling pass: output index i reads `count[i]` inputs
// from `first[i]` with fixed-point weights `weights[i * ksize ...]`.
struct AxisCoefficients {
  int ksize = 0;
  std::vector<int> first;
  std::vector<int> count;
  std::vector<int32_t> weights;
};

// Pillow's precompute_coeffs + normalize_coeffs_8bpc for box (0, in_size).
AxisCoefficients PrecomputeCoefficients(int in_size, int out_size) {
  AxisCoefficients c;
  // Pillow passes the box as floats: (double)(in1 - in0) / outSize.
  const double scale = static_cast<double>(static_cast<float>(in_size) - 0.0f) / out_size;
  const double filterscale = scale < 1.0 ? 1.0 : scale;
  const double support = kBicubicSupport * filterscale;
  c.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.first.resize(out_size);
  c.count.resize(out_size);
  c.weights.assign(static_cast<size_t>(out_size) * c.ksize, 0);
  std::vector<double> k(c.ksize);
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = 0.0 + (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      const double w = BicubicFilter((x + xmin - center + 0.5) * ss);
      k[x] = w;
      ww += w;
    }
    int32_t* out = &c.weights[static_cast<size_t>(xx) * c.ksize];
    for (int x = 0; x < xmax; ++x) {
      const double w = ww != 0.0 ? k[x] / ww : k[x];
      out[x] = w < 0 ? static_cast<int32_t>(-0.5 + w * (1 << kPrecisionBits))
                     : static_cast<int32_t>(0.5 + w * (1 << kPrecisionBits));
    }
    c.first[xx] = xmin;
    c.count[xx] = xmax;
  }
  return c;
}

inline uint8_t Clip8(int32_t acc) {
  const int32_t v = acc >> kPrecisionBits;  // arithmetic shift, as Pillow
  return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

// The passes are plain integer loops written for the auto-vectoriser; with
// AVX2 (chosen at run time) they run 8 int32 lanes at a time. Integer sums of
// exact products do not depend on the order, so any vectorisation is exact.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VLM_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VLM_VECTOR_CLONES
#endif

// Horizontal pass over rows [row_begin, row_end) of `in` into `out`
// (out row 0 = in row row_begin). Rows are processed in strips of kStripRows:
// the strip is first interleaved column-major ([x][row][channel, pad]) so
// that one output pixel of all the strip's rows is a 32-lane multiply-add per
// tap.
constexpr int kStripRows = 8;
constexpr int kStripLanes = kStripRows * 4;

VLM_VECTOR_CLONES
void ResampleHorizontal(const uint8_t* in, int in_width, int row_begin, int row_end,
                        const AxisCoefficients& c, uint8_t* out, int out_width) {
  const size_t in_stride = static_cast<size_t>(in_width) * 3;
  const size_t out_stride = static_cast<size_t>(out_width) * 3;
  std::vector<uint8_t> strip(static_cast<size_t>(in_width) * kStripLanes, 0);
  for (int y0 = row_begin; y0 < row_end; y0 += kStripRows) {
    const int rows = std::min(kStripRows, row_end - y0);
    for (int r = 0; r < rows; ++r) {
      const uint8_t* src = in + static_cast<size_t>(y0 + r) * in_stride;
      for (int x = 0; x < in_width; ++x) {
        uint8_t* d = &strip[static_cast<size_t>(x) * kStripLanes + r * 4];
        d[0] = src[3 * x];
        d[1] = src[3 * x + 1];
        d[2] = src[3 * x + 2];
      }
    }
    for (int xx = 0; xx < out_width; ++xx) {
      const int32_t* k = &c.weights[static_cast<size_t>(xx) * c.ksize];
      const uint8_t* col = &strip[static_cast<size_t>(c.first[xx]) * kStripLanes];
      const int n = c.count[xx];
      int32_t acc[kStripLanes];
      for (int i = 0; i < kStripLanes; ++i) acc[i] = 1 << (kPrecisionBits - 1);
      for (int x = 0; x < n; ++x) {
        const int32_t w = k[x];
        const uint8_t* v = col + x * kStripLanes;
        for (int i = 0; i < kStripLanes; ++i) acc[i] += v[i] * w;
      }
      for (int r = 0; r < rows; ++r) {
        uint8_t* dst = out + static_cast<size_t>(y0 + r - row_begin) * out_stride + xx * 3;
        dst[0] = Clip8(acc[r * 4]);
        dst[1] = Clip8(acc[r * 4 + 1]);
        dst[2] = Clip8(acc[r * 4 + 2]);
      }
    }
  }
}

// Vertical pass: output row yy = sum over taps of input rows
// (first[yy] - row_offset + y), a whole row per tap.
VLM_VECTOR_CLONES
void ResampleVertical(const uint8_t* in, int width, int row_offset, const AxisCoefficients& c,
                      uint8_t* out, int out_height) {
  const size_t row_len = static_cast<size_t>(width) * 3;
  std::vector<int32_t> acc(row_len);
  for (int yy = 0; yy < out_height; ++yy) {
    int32_t* a = acc.data();
    for (size_t i = 0; i < row_len; ++i) a[i] = 1 << (kPrecisionBits - 1);
    const int32_t* k = &c.weights[static_cast<size_t>(yy) * c.ksize];
    const int first = c.first[yy] - row_offset;
    for (int y = 0; y < c.count[yy]; ++y) {
      const uint8_t* src = in + static_cast<size_t>(first + y) * row_len;
      const int32_t w = k[y];
      for (size_t i = 0; i < row_len; ++i) a[i] += src[i] * w;
    }
    uint8_t* dst = out + static_cast<size_t>(yy) * row_len;
    for (size_t i = 0; i < row_len; ++i) dst[i] = Clip8(a[i]);
  }
}

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

}  // namespace

absl::Status ValidatePreprocessOptions(const PreprocessOptions& o) {
  if (o.min_pixels <= 0) return Invalid(absl::StrFormat("min_pixels must be positive (got %d)", o.min_pixels));
  if (o.max_pixels <= 0) return Invalid(absl::StrFormat("max_pixels must be positive (got %d)", o.max_pixels));
  if (o.min_pixels > o.max_pixels) {
    return Invalid(absl::StrFormat("min_pixels (%d) must not exceed max_pixels (%d)",
                                   o.min_pixels, o.max_pixels));
  }
  if (o.patch_size <= 0 || o.merge_size <= 0 || o.temporal_patch_size <= 0) {
    return Invalid(absl::StrFormat(
        "patch_size (%d), merge_size (%d) and temporal_patch_size (%d) must be positive",
        o.patch_size, o.merge_size, o.temporal_patch_size));
  }
  for (int c = 0; c < 3; ++c) {
    if (!(o.image_std[c] != 0.0f) || !std::isfinite(o.image_std[c]) ||
        !std::isfinite(o.image_mean[c])) {
      return Invalid(absl::StrFormat("image_mean/image_std[%d] must be finite, std non-zero", c));
    }
  }
  if (!(o.rescale_factor > 0.0) || !std::isfinite(o.rescale_factor)) {
    return Invalid("rescale_factor must be positive and finite");
  }
  return absl::OkStatus();
}

absl::StatusOr<ImageSize> SmartResize(int64_t height, int64_t width, int64_t factor,
                                      int64_t min_pixels, int64_t max_pixels) {
  if (height <= 0 || width <= 0) {
    return Invalid(absl::StrFormat("image size %dx%d is not positive", width, height));
  }
  if (factor <= 0) return Invalid(absl::StrFormat("factor must be positive (got %d)", factor));
  // Bounds far above any real image that keep every product below 2^63 and
  // every double -> int64 conversion in range (a request can choose the budget).
  if (height > kSmartResizeMaxSide || width > kSmartResizeMaxSide) {
    return Invalid(absl::StrFormat("image size %dx%d is larger than %d pixels per side", width,
                                   height, kSmartResizeMaxSide));
  }
  if (factor > kSmartResizeMaxFactor) {
    return Invalid(absl::StrFormat("factor %d is larger than %d", factor, kSmartResizeMaxFactor));
  }
  if (max_pixels < 1 || max_pixels > kSmartResizeMaxPixels || min_pixels > kSmartResizeMaxPixels) {
    return Invalid(absl::StrFormat("min_pixels %d / max_pixels %d: max_pixels must be in [1, %d] "
                                   "and min_pixels at most %d",
                                   min_pixels, max_pixels, kSmartResizeMaxPixels,
                                   kSmartResizeMaxPixels));
  }
  const double h = static_cast<double>(height);
  const double w = static_cast<double>(width);
  const double ratio = static_cast<double>(std::max(height, width)) /
                       static_cast<double>(std::min(height, width));
  if (ratio > 200.0) {
    return Invalid(absl::StrFormat(
        "image is %dx%d, aspect ratio %.6g; the maximum aspect ratio is 200", width, height,
        ratio));
  }
  const double f = static_cast<double>(factor);
  // Python's round() is half-to-even: nearbyint in the default rounding mode.
  int64_t h_bar = static_cast<int64_t>(std::nearbyint(h / f)) * factor;
  int64_t w_bar = static_cast<int64_t>(std::nearbyint(w / f)) * factor;
  const double area = static_cast<double>(height * width);  // exact integer product
  if (h_bar * w_bar > max_pixels) {
    const double beta = std::sqrt(area / static_cast<double>(max_pixels));
    h_bar = std::max<int64_t>(factor, static_cast<int64_t>(std::floor(h / beta / f)) * factor);
    w_bar = std::max<int64_t>(factor, static_cast<int64_t>(std::floor(w / beta / f)) * factor);
  } else if (h_bar * w_bar < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / area);
    h_bar = static_cast<int64_t>(std::ceil(h * beta / f)) * factor;
    w_bar = static_cast<int64_t>(std::ceil(w * beta / f)) * factor;
  }
  return ImageSize{h_bar, w_bar};
}

int64_t LargestResizedArea(int64_t factor, int64_t min_pixels, int64_t max_pixels) {
  constexpr double kMaxRatio = 200.0;  // SmartResize's aspect-ratio bound
  const double f = static_cast<double>(factor);
  const double big = static_cast<double>(std::max<int64_t>(max_pixels, 1));
  const double small = static_cast<double>(std::max<int64_t>(min_pixels, 0));
  // Rounded sides within the budget: at most max_pixels.
  double bound = big;
  // Scaled down: each side is floor(side / beta / f) * f <= side / beta, or f
  // when that floors to zero; the long side / beta is at most sqrt(200 * max).
  bound = std::max(bound, f * std::sqrt(kMaxRatio * big));
  bound = std::max(bound, f * f);
  // Scaled up to min_pixels: each side is ceil(side * beta / f) * f < side * beta + f.
  bound = std::max(bound, small + f * (std::sqrt(small / kMaxRatio) + std::sqrt(small * kMaxRatio)) +
                              f * f);
  return static_cast<int64_t>(std::ceil(bound));
}

bool BudgetFitsPatches(int64_t factor, int64_t patch_size, int64_t min_pixels, int64_t max_pixels,
                       int64_t max_patches) {
  if (max_pixels < 1 || patch_size < 1) return false;
  return LargestResizedArea(factor, std::min(min_pixels, max_pixels), max_pixels) /
             (patch_size * patch_size) <=
         max_patches;
}

int64_t LargestFittingBudget(int64_t factor, int64_t patch_size, int64_t min_pixels,
                             int64_t wanted, int64_t max_patches) {
  if (BudgetFitsPatches(factor, patch_size, min_pixels, wanted, max_patches)) return wanted;
  const int64_t step = factor * factor;
  // Start at the area max_patches covers and walk down (a few steps at most:
  // the bound exceeds max_pixels only for budgets near factor^2 * 200).
  int64_t budget = std::min(wanted, max_patches * patch_size * patch_size) / step * step;
  while (budget >= step &&
         !BudgetFitsPatches(factor, patch_size, min_pixels, budget, max_patches)) {
    budget -= step;
  }
  return budget >= step ? budget : 0;
}

absl::StatusOr<PreprocessOptions> ResolvePixelBudget(const PreprocessOptions& defaults,
                                                     int64_t min_pixels_limit,
                                                     int64_t max_pixels_limit,
                                                     int64_t requested_min,
                                                     int64_t requested_max) {
  auto check = [&](const char* name, int64_t value) -> absl::Status {
    if (value < 0) {
      return Invalid(absl::StrFormat("options.%s %d is negative (0 means the server default)",
                                     name, value));
    }
    if (value != 0 && value < min_pixels_limit) {
      return Invalid(absl::StrFormat("options.%s %d is below the server limit min_pixels_limit %d",
                                     name, value, min_pixels_limit));
    }
    return absl::OkStatus();
  };
  if (absl::Status s = check("min_pixels", requested_min); !s.ok()) return s;
  if (absl::Status s = check("max_pixels", requested_max); !s.ok()) return s;
  PreprocessOptions options = defaults;
  if (requested_max > 0) {
    options.max_pixels = std::min(requested_max, max_pixels_limit);
    if (requested_min == 0) options.min_pixels = std::min(options.min_pixels, options.max_pixels);
  }
  if (requested_min > 0) options.min_pixels = std::min(requested_min, max_pixels_limit);
  if (options.min_pixels > options.max_pixels) {
    return Invalid(absl::StrFormat(
        "min_pixels %d exceeds max_pixels %d%s", options.min_pixels, options.max_pixels,
        requested_max == 0 ? " (the server default max_pixels; ask for a larger max_pixels)"
                           : ""));
  }
  return options;
}

RgbImage ResizeBicubic(const RgbImage& image, int width, int height) {
  const bool need_horizontal = width != image.width;
  const bool need_vertical = height != image.height;
  if (!need_horizontal && !need_vertical) return image;

  RgbImage out;
  out.width = width;
  out.height = height;
  out.pixels.resize(static_cast<size_t>(width) * height * 3);

  const AxisCoefficients vertical = PrecomputeCoefficients(image.height, height);
  if (!need_vertical) {
    const AxisCoefficients horizontal = PrecomputeCoefficients(image.width, width);
    ResampleHorizontal(image.pixels.data(), image.width, 0, image.height, horizontal,
                       out.pixels.data(), width);
    return out;
  }
  if (!need_horizontal) {
    ResampleVertical(image.pixels.data(), image.width, 0, vertical, out.pixels.data(), height);
    return out;
  }
  // Like Pillow, the horizontal pass only produces the rows the vertical
  // pass reads.
  const int row_first = vertical.first[0];
  const int row_last = vertical.first[height - 1] + vertical.count[height - 1];
  const AxisCoefficients horizontal = PrecomputeCoefficients(image.width, width);
  std::vector<uint8_t> temp(static_cast<size_t>(width) * (row_last - row_first) * 3);
  ResampleHorizontal(image.pixels.data(), image.width, row_first, row_last, horizontal,
                     temp.data(), width);
  ResampleVertical(temp.data(), width, row_first, vertical, out.pixels.data(), height);
  return out;
}

std::array<float, 256> NormalizationTable(double rescale_factor, float mean, float std) {
  std::array<float, 256> table;
  for (int u = 0; u < 256; ++u) {
    const float x = static_cast<float>(static_cast<double>(u) * rescale_factor);
    table[u] = (x - mean) / std;
  }
  return table;
}

PreprocessedImage Patchify(const RgbImage& resized, const PreprocessOptions& o) {
  const int p = o.patch_size;
  const int m = o.merge_size;
  const int t_frames = o.temporal_patch_size;
  PreprocessedImage out;
  out.grid_t = 1;
  out.grid_h = resized.height / p;
  out.grid_w = resized.width / p;
  out.patch_dim = 3 * static_cast<int64_t>(t_frames) * p * p;
  out.pixel_values.resize(static_cast<size_t>(out.num_patches()) * out.patch_dim);

  std::array<std::array<float, 256>, 3> table;
  for (int c = 0; c < 3; ++c) {
    table[c] = NormalizationTable(o.rescale_factor, o.image_mean[c], o.image_std[c]);
  }
  const int64_t blocks_h = out.grid_h / m;
  const int64_t blocks_w = out.grid_w / m;
  const size_t stride = static_cast<size_t>(resized.width) * 3;
  float* dst = out.pixel_values.data();
  // Rows in merge order (t, bh, bw, ih, iw); columns (c, f, py, px). Every
  // temporal frame is the same image (one image = one temporal patch).
  for (int64_t bh = 0; bh < blocks_h; ++bh) {
    for (int64_t bw = 0; bw < blocks_w; ++bw) {
      for (int ih = 0; ih < m; ++ih) {
        for (int iw = 0; iw < m; ++iw) {
          const int64_t y0 = (bh * m + ih) * p;
          const int64_t x0 = (bw * m + iw) * p;
          for (int c = 0; c < 3; ++c) {
            const float* lut = table[c].data();
            float* frame0 = dst;
            for (int py = 0; py < p; ++py) {
              const uint8_t* src = resized.pixels.data() + (y0 + py) * stride + x0 * 3 + c;
              for (int px = 0; px < p; ++px) dst[py * p + px] = lut[src[3 * px]];
            }
            dst += p * p;
            for (int f = 1; f < t_frames; ++f) {
              std::memcpy(dst, frame0, sizeof(float) * p * p);
              dst += p * p;
            }
          }
        }
      }
    }
  }
  return out;
}

absl::StatusOr<PreprocessResult> PreprocessImage(const RgbImage& image,
                                                 const PreprocessOptions& options) {
  return PreprocessImage(image, options, image.width, image.height);
}

absl::StatusOr<PreprocessResult> PreprocessImage(const RgbImage& image,
                                                 const PreprocessOptions& options,
                                                 int64_t source_width, int64_t source_height) {
  if (absl::Status s = ValidatePreprocessOptions(options); !s.ok()) return s;
  if (image.width <= 0 || image.height <= 0 ||
      image.pixels.size() != static_cast<size_t>(image.width) * image.height * 3) {
    return Invalid(absl::StrFormat("RGB image %dx%d has %d bytes", image.width, image.height,
                                   image.pixels.size()));
  }
  const int64_t factor = static_cast<int64_t>(options.patch_size) * options.merge_size;
  absl::StatusOr<ImageSize> size =
      SmartResize(source_height, source_width, factor, options.min_pixels, options.max_pixels);
  if (!size.ok()) return size.status();
  if (size->height > (1 << 30) / size->width) {
    return Invalid(absl::StrFormat("resized image %dx%d is too large", size->width, size->height));
  }
  PreprocessResult result;
  result.resized_size = *size;
  result.resized =
      ResizeBicubic(image, static_cast<int>(size->width), static_cast<int>(size->height));
  result.patches = Patchify(result.resized, options);
  return result;
}

}  // namespace vlm::vision
