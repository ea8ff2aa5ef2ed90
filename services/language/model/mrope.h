// Multimodal rotary positions of the Qwen3-VL decoder (docs/qwen3-vl-model.md
// §6): the 3-D (t, h, w) position of every prompt token exactly as HF's
// get_rope_index computes it, the rope delta that places generated tokens, and
// the interleaved-MRoPE cos/sin tables.
//
// Stateless functions and an immutable class: thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model_config.h"

namespace vlm::language {

// (t, h, w) of one image in patches (image_grid_thw, spec §3.7).
using GridThw = std::array<int64_t, 3>;

// Prompt token count of one image: t·h·w / spatial_merge_size².
int64_t ImageTokenCount(const GridThw& grid, int64_t spatial_merge_size);

struct RopeIndex {
  // positions[a][i]: axis a (0 = T, 1 = H, 2 = W) of prompt token i.
  std::array<std::vector<int64_t>, 3> positions;
  // max(positions) + 1 - S (0 for text, usually negative with images). The
  // token at cache index s >= S (generated) sits at s + rope_delta on all axes.
  int64_t rope_delta = 0;
  int64_t size() const { return static_cast<int64_t>(positions[0].size()); }
  // [3, S] int64.
  at::Tensor ToTensor() const;
};

// get_rope_index (spec §6.1) for one sequence. Images are the runs of
// `image_token_id` in `ids`, in order; grids[k] belongs to the k-th run.
// INVALID_ARGUMENT (the message names the token index or image) when: a grid
// is not positive or its h, w are not multiples of spatial_merge_size; the
// number of image pad tokens differs from Σ ImageTokenCount(grids); a run's
// length differs from its image's count; a run does not directly follow
// `vision_start_token_id`; the prompt holds a video pad (video is not
// supported).
absl::StatusOr<RopeIndex> GetRopeIndex(absl::Span<const int32_t> ids,
                                       absl::Span<const GridThw> grids,
                                       const ModelConfig& config);

// The interleaved MRoPE frequencies (spec §6.2): inv[j] = 1 / theta^(2j/D) in
// float32, and frequency j follows axis H if j % 3 == 1 and j < 3·section[1],
// W if j % 3 == 2 and j < 3·section[2], else T.
class MultimodalRotary {
 public:
  explicit MultimodalRotary(const TextConfig& config);

  // positions: [3, S] int64 (or int32) -> (cos, sin), each [S, head_dim]
  // float32, emb = [f, f] with f[j] = positions[axis(j)]·inv[j].
  std::pair<at::Tensor, at::Tensor> CosSin(const at::Tensor& positions) const;
  // The same for S tokens at position p, p+1, ... on all three axes (text and
  // decode steps).
  std::pair<at::Tensor, at::Tensor> CosSinText(int64_t first_position, int64_t count) const;

  // Axis (0 = T, 1 = H, 2 = W) of each of the head_dim/2 frequencies.
  const std::vector<int>& frequency_axes() const { return axes_; }
  const at::Tensor& inv_freq() const { return inv_freq_; }  // [head_dim/2] float32

 private:
  int64_t head_dim_ = 0;
  std::vector<int> axes_;
  at::Tensor inv_freq_;    // [D/2] float32
  at::Tensor axis_index_;  // [1, 1, D/2] int64 (gather index into [3, S, D/2])
};

}  // namespace vlm::language
