#include "services/language/model/mrope.h"

#include <algorithm>
#include <string>

#include <ATen/ATen.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace vlm::language {

int64_t ImageTokenCount(const GridThw& grid, int64_t spatial_merge_size) {
  return grid[0] * grid[1] * grid[2] / (spatial_merge_size * spatial_merge_size);
}

at::Tensor RopeIndex::ToTensor() const {
  const int64_t s = size();
  at::Tensor out = at::empty({3, s}, at::TensorOptions().dtype(at::kLong));
  for (int a = 0; a < 3; ++a) {
    std::copy(positions[a].begin(), positions[a].end(), out[a].data_ptr<int64_t>());
  }
  return out;
}

namespace {

std::string GridText(const GridThw& g) { return absl::StrCat("(", g[0], ", ", g[1], ", ", g[2], ")"); }

}  // namespace

absl::StatusOr<RopeIndex> GetRopeIndex(absl::Span<const int32_t> ids,
                                       absl::Span<const GridThw> grids,
                                       const ModelConfig& config) {
  const int64_t m = config.vision.spatial_merge_size;
  if (m <= 0) return absl::InvalidArgumentError("config: vision spatial_merge_size must be > 0");
  const int32_t image_pad = static_cast<int32_t>(config.image_token_id);
  const int32_t video_pad = static_cast<int32_t>(config.video_token_id);
  const int32_t vision_start = static_cast<int32_t>(config.vision_start_token_id);
  const int64_t s = static_cast<int64_t>(ids.size());

  int64_t needed = 0;
  for (size_t k = 0; k < grids.size(); ++k) {
    const GridThw& g = grids[k];
    if (g[0] <= 0 || g[1] <= 0 || g[2] <= 0 || g[1] % m != 0 || g[2] % m != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "image ", k, ": grid (t, h, w) = ", GridText(g),
          " must be positive with h and w multiples of spatial_merge_size ", m));
    }
    needed += ImageTokenCount(g, m);
  }
  int64_t pads = 0;
  for (int64_t i = 0; i < s; ++i) {
    if (ids[i] == image_pad) ++pads;
    if (ids[i] == video_pad) {
      return absl::InvalidArgumentError(
          absl::StrCat("token ", i, " is <|video_pad|> (", video_pad, "): video input is not supported"));
    }
  }
  if (pads != needed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the prompt holds ", pads, " image pad tokens but the ", grids.size(),
        " image grid(s) need ", needed, " (Σ t·h·w/", m * m, ")"));
  }

  RopeIndex out;
  for (auto& axis : out.positions) axis.resize(s);
  int64_t st = 0;    // first token not yet placed
  int64_t next = 0;  // previous max position + 1
  auto place_text = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (auto& axis : out.positions) axis[i] = next + (i - begin);
    }
    if (end > begin) next += end - begin;
  };
  for (size_t k = 0; k < grids.size(); ++k) {
    int64_t ed = st;
    while (ed < s && ids[ed] != image_pad) ++ed;  // exists: the pad count matched
    if (ed == 0 || ids[ed - 1] != vision_start) {
      return absl::InvalidArgumentError(absl::StrCat(
          "image ", k, ": its image pad run at token ", ed,
          " does not directly follow <|vision_start|> (", vision_start, ")"));
    }
    const int64_t t = grids[k][0], hm = grids[k][1] / m, wm = grids[k][2] / m;
    const int64_t count = t * hm * wm;
    int64_t run = 0;
    while (ed + run < s && ids[ed + run] == image_pad) ++run;
    if (run != count) {
      return absl::InvalidArgumentError(absl::StrCat(
          "image ", k, ": the image pad run at token ", ed, " has ", run, " tokens, its grid ",
          GridText(grids[k]), " needs ", count));
    }
    place_text(st, ed);
    const int64_t base = next;
    int64_t i = ed;
    for (int64_t ti = 0; ti < t; ++ti) {
      for (int64_t r = 0; r < hm; ++r) {
        for (int64_t c = 0; c < wm; ++c, ++i) {
          out.positions[0][i] = base + ti;
          out.positions[1][i] = base + r;
          out.positions[2][i] = base + c;
        }
      }
    }
    next = base + std::max({t, hm, wm});  // max over the image's positions + 1
    st = ed + count;
  }
  place_text(st, s);
  out.rope_delta = next - s;  // next = max position + 1 (0 for an empty prompt)
  return out;
}

MultimodalRotary::MultimodalRotary(const TextConfig& config) : head_dim_(config.head_dim) {
  const int64_t half = head_dim_ / 2;
  // HF: 1.0 / (base ** (arange(0, dim, 2, int64).float() / dim)), in float32.
  inv_freq_ = at::pow(config.rope_theta,
                      at::arange(0, head_dim_, 2, at::TensorOptions().dtype(at::kLong))
                              .to(at::kFloat)
                              .div(static_cast<double>(head_dim_)))
                  .reciprocal();
  inv_freq_ = inv_freq_.to(at::kFloat).contiguous();
  axes_.assign(half, 0);
  for (int64_t j = 0; j < half; ++j) {
    if (j % 3 == 1 && j < 3 * config.mrope_section[1]) axes_[j] = 1;
    if (j % 3 == 2 && j < 3 * config.mrope_section[2]) axes_[j] = 2;
  }
  axis_index_ = at::empty({1, 1, half}, at::TensorOptions().dtype(at::kLong));
  for (int64_t j = 0; j < half; ++j) axis_index_.data_ptr<int64_t>()[j] = axes_[j];
}

std::pair<at::Tensor, at::Tensor> MultimodalRotary::CosSin(const at::Tensor& positions) const {
  TORCH_CHECK(positions.dim() == 2 && positions.size(0) == 3,
              "MRoPE positions must be [3, S], got ", positions.sizes());
  const int64_t s = positions.size(1), half = head_dim_ / 2;
  // F[a, i, j] = (float)p[a, i] · inv[j]: one float32 product.
  at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq_;  // [3, S, D/2]
  at::Tensor f = at::gather(freqs, 0, axis_index_.expand({1, s, half})).squeeze(0);  // [S, D/2]
  at::Tensor emb = at::cat({f, f}, -1);                                          // [S, D]
  return {emb.cos(), emb.sin()};
}

std::pair<at::Tensor, at::Tensor> MultimodalRotary::CosSinText(int64_t first_position,
                                                               int64_t count) const {
  at::Tensor p = at::arange(first_position, first_position + count,
                            at::TensorOptions().dtype(at::kLong));
  return CosSin(p.unsqueeze(0).expand({3, count}));
}

}  // namespace vlm::language
