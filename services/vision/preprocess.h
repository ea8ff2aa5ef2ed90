// Qwen3-VL image preprocessing (qwen3-vl-model.md §3 steps 2-7), the PIL path
// bit-exactly: smart_resize, Pillow's antialiased bicubic resize on uint8,
// rescale + normalise through a 256-entry float32 table, temporal duplication
// and patchify into merge order. Plain buffers, no LibTorch. Thread-safe: no
// shared mutable state.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/vision/image_decoder.h"

namespace vlm::vision {

// The preprocessor of the checkpoint (preprocessor_config.json) plus the
// per-request pixel budget. Defaults are the Qwen3-VL-2B values.
struct PreprocessOptions {
  int64_t min_pixels = 65536;     // size.shortest_edge (an area)
  int64_t max_pixels = 16777216;  // size.longest_edge (an area)
  int patch_size = 16;
  int merge_size = 2;
  int temporal_patch_size = 2;
  double rescale_factor = 1.0 / 255.0;
  std::array<float, 3> image_mean = {0.5f, 0.5f, 0.5f};
  std::array<float, 3> image_std = {0.5f, 0.5f, 0.5f};
};

// INVALID_ARGUMENT unless sizes are positive, min_pixels <= max_pixels and
// std is non-zero; the message names the field.
absl::Status ValidatePreprocessOptions(const PreprocessOptions& options);

struct ImageSize {
  int64_t height = 0;
  int64_t width = 0;
  bool operator==(const ImageSize& o) const { return height == o.height && width == o.width; }
};

// HF's smart_resize: double precision, banker's rounding, exactly the
// reference's operation order. INVALID_ARGUMENT for non-positive sizes, for
// max(h,w)/min(h,w) > 200, and outside the bounds below (which keep the
// arithmetic exact and free of overflow whatever a request asks for).
inline constexpr int64_t kSmartResizeMaxSide = int64_t{1} << 24;    // height, width
inline constexpr int64_t kSmartResizeMaxFactor = int64_t{1} << 16;  // patch * merge
inline constexpr int64_t kSmartResizeMaxPixels = int64_t{1} << 40;  // min/max_pixels; max >= 1
absl::StatusOr<ImageSize> SmartResize(int64_t height, int64_t width, int64_t factor,
                                      int64_t min_pixels, int64_t max_pixels);

// An upper bound on the area (pixels) SmartResize returns for any image it
// accepts (aspect ratio <= 200) with these bounds. Usually max_pixels; larger
// when max_pixels is so small that a thin image keeps a factor-wide short
// side, or when the upscale to min_pixels rounds both sides up. Used to size
// message limits so that the features of every accepted image fit.
int64_t LargestResizedArea(int64_t factor, int64_t min_pixels, int64_t max_pixels);

// Whether every image resized with (min(min_pixels, max_pixels), max_pixels)
// has at most `max_patches` patches of patch_size^2 pixels.
bool BudgetFitsPatches(int64_t factor, int64_t patch_size, int64_t min_pixels, int64_t max_pixels,
                       int64_t max_patches);
// The largest max_pixels <= `wanted` for which BudgetFitsPatches holds
// (`wanted` itself if it fits, else a multiple of factor^2); 0 if none does.
int64_t LargestFittingBudget(int64_t factor, int64_t patch_size, int64_t min_pixels,
                             int64_t wanted, int64_t max_patches);

// A request's pixel budget: `requested_min` / `requested_max` (0 = the server
// default from `defaults`) resolved against the server's limits.
//   - negative values, and non-zero values below min_pixels_limit, are
//     INVALID_ARGUMENT naming the limit;
//   - values above max_pixels_limit are lowered to it (the limit caps what a
//     request may ask for; the budget used is reported back);
//   - a requested max_pixels below the default min_pixels lowers min_pixels
//     to it (asking only for a small budget is never an error); an explicit
//     min_pixels above the resolved max_pixels is INVALID_ARGUMENT.
// Images larger than the budget are resized down by SmartResize, never refused.
absl::StatusOr<PreprocessOptions> ResolvePixelBudget(const PreprocessOptions& defaults,
                                                     int64_t min_pixels_limit,
                                                     int64_t max_pixels_limit,
                                                     int64_t requested_min,
                                                     int64_t requested_max);

// Pillow's Image.resize((width, height), BICUBIC) on an RGB uint8 image:
// separable, horizontal pass first, uint8 intermediate, 22-bit fixed-point
// coefficients, a pass whose size does not change is skipped. Sizes must be
// positive.
RgbImage ResizeBicubic(const RgbImage& image, int width, int height);

// value[u8] = ((float)(u8 * rescale_factor) - mean) / std, all float32 after
// the rescale (HF's slow rescale + normalize).
std::array<float, 256> NormalizationTable(double rescale_factor, float mean, float std);

struct PreprocessedImage {
  // [grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size^2],
  // row-major; rows in merge order (t, bh, bw, ih, iw), columns (c, f, py, px).
  std::vector<float> pixel_values;
  int64_t grid_t = 0;
  int64_t grid_h = 0;  // patches
  int64_t grid_w = 0;
  int64_t patch_dim = 0;  // columns of pixel_values
  int64_t num_patches() const { return grid_t * grid_h * grid_w; }
};

// Patchifies an image already resized to multiples of patch_size * merge_size,
// duplicating it over the temporal patch (one image = one temporal patch).
PreprocessedImage Patchify(const RgbImage& resized, const PreprocessOptions& options);

struct PreprocessResult {
  ImageSize resized_size;
  RgbImage resized;  // the uint8 image after step 3 (kept for tests and debugging)
  PreprocessedImage patches;
};

// Steps 2-7 for one decoded image. Validates the options first.
absl::StatusOr<PreprocessResult> PreprocessImage(const RgbImage& image,
                                                 const PreprocessOptions& options);
// The same for an image decoded at a reduced scale (DecodedImage::scale_num <
// 8): smart_resize is decided on the stored size (source_width x
// source_height), so the grid is the one the full-size image gets, and
// `image` is resized to it.
absl::StatusOr<PreprocessResult> PreprocessImage(const RgbImage& image,
                                                 const PreprocessOptions& options,
                                                 int64_t source_width, int64_t source_height);

}  // namespace vlm::vision
