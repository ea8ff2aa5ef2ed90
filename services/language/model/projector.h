// The Qwen3-VL projector (docs/qwen3-vl-model.md §4.6): the patch merger and
// the deepstack mergers that turn the vision service's pre-projector features
// into decoder-width image embeddings. It lives in the language service
// because the features arrive over the wire before it.
//
// Weights are borrowed from the checkpoint's mapping when their stored dtype is
// the compute dtype (zero copy), else converted once at Load; Load touches
// every page (the projector is materialized at startup, spec'd in
// architecture.md "Loading and readiness"). Forward and WarmUp are const and
// thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/cpu_features.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "services/language/model/mrope.h"

namespace vlm::language {

struct ProjectorOptions {
  // bfloat16 falls back to float32 (with a warning in load_summary) on CPUs
  // without fast bf16 matmuls.
  ComputeDType compute_dtype = ComputeDType::kBFloat16;
};

// Decoder-width features of a batch of images, rows in merged raster order,
// images concatenated; dtype = the compute dtype.
struct ProjectedImages {
  at::Tensor image_embeds;            // [M, text_hidden], M = N / spatial_merge_size²
  std::vector<at::Tensor> deepstack;  // [M, text_hidden] each, deepstack_visual_indexes order
  int64_t num_tokens() const { return image_embeds.defined() ? image_embeds.size(0) : 0; }
};

class Projector {
 public:
  // Validates the presence and shape of every merger tensor ("model.visual."
  // or "visual." prefix), borrows or converts them and touches their pages.
  static absl::StatusOr<std::unique_ptr<Projector>> Load(const SafetensorsCheckpoint& checkpoint,
                                                         const ModelConfig& config,
                                                         const ProjectorOptions& options = {});
  ~Projector();

  // last_hidden: [N, vision_hidden], deepstack: one [N, vision_hidden] per
  // deepstack merger, bfloat16 or float32 (cast to the compute dtype); grids:
  // one (t, h, w) per image with Σ t·h·w = N, h and w multiples of the merge
  // size. INVALID_ARGUMENT names the offending input.
  absl::StatusOr<ProjectedImages> Forward(const at::Tensor& last_hidden,
                                          absl::Span<const at::Tensor> deepstack,
                                          absl::Span<const GridThw> grids) const;

  // One forward on a zero image of one merged token: proves the weights and
  // kernels work (the service is SERVING only after it).
  absl::Status WarmUp() const;

  ComputeDType compute_dtype() const { return compute_dtype_; }
  int64_t num_deepstack() const;
  int64_t vision_hidden() const { return vision_hidden_; }
  int64_t out_hidden() const { return out_hidden_; }
  // Bytes of weights used in place from the mapping / converted at Load.
  uint64_t borrowed_weight_bytes() const { return borrowed_bytes_; }
  uint64_t converted_weight_bytes() const { return converted_bytes_; }
  const std::string& load_summary() const { return load_summary_; }

 private:
  struct Merger;
  Projector() = default;

  ComputeDType compute_dtype_ = ComputeDType::kFloat32;
  int64_t vision_hidden_ = 0;
  int64_t out_hidden_ = 0;
  int64_t merge_size_ = 0;
  std::unique_ptr<const Merger> merger_;
  std::vector<std::unique_ptr<const Merger>> deepstack_mergers_;
  uint64_t borrowed_bytes_ = 0;
  uint64_t converted_bytes_ = 0;
  std::string load_summary_;
};

}  // namespace vlm::language
