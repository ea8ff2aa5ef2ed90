// The Qwen3-VL vision tower (docs/qwen3-vl-model.md §4.1-§4.5): patch
// embedding, interpolated learned position embedding, 2-D rotary, the ViT
// blocks with per-image attention, and the deepstack taps. It stops before the
// patch mergers: the language service owns the projector.
//
// Weights are borrowed from the checkpoint's mapping when their stored dtype is
// the compute dtype (zero copy, never written), else converted once at Load.
// Thread-safety: Forward is const and may run concurrently.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/cpu_features.h"
#include "common/model_config.h"
#include "common/safetensors.h"

namespace vlm {

// bf16 compute runs through the project's kernels (common/kernels: prepacked
// GEMM with fused bias/GELU/residual, flash attention over each image) where
// the CPU runs them and the process's GEMM path (kernels::DefaultGemmPath) is
// not torch; on AMX CPUs only when that path is amx (oneDNN's AMX is faster
// than AVX-512 BF16). Otherwise, and for float32, every step runs on LibTorch.
struct VisionModelOptions {
  // bfloat16 falls back to float32 (with a warning) on CPUs without AVX-512.
  ComputeDType compute_dtype = ComputeDType::kBFloat16;
  // Queries per attention tile: scores never exceed [heads, tile, patches of the image].
  int64_t attention_query_tile = 1024;
};

// (t, h, w) of one image in patches, as preprocessing reports it (grid_thw).
using GridThw = std::array<int64_t, 3>;

// Pre-projector features for a batch of images, rows in merge order, images
// concatenated; dtype = the compute dtype.
struct VisionFeatures {
  at::Tensor last_hidden;             // [N, hidden]: output of the last block
  std::vector<at::Tensor> deepstack;  // [N, hidden] each: outputs of blocks
                                      // deepstack_visual_indexes, in that order
};

class VisionModel {
 public:
  // Validates every tensor's presence and shape against `config.vision`.
  // Accepts the "model.visual." and "visual." name prefixes. The checkpoint
  // only needs to outlive Load: borrowed tensors keep its mapping alive.
  static absl::StatusOr<std::unique_ptr<VisionModel>> Load(const SafetensorsCheckpoint& checkpoint,
                                                           const ModelConfig& config,
                                                           const VisionModelOptions& options);
  ~VisionModel();

  // pixel_values: [N, in_channels·temporal_patch·patch²] float32 (rows in merge
  // order, §3.6); grids: one (t, h, w) per image with Σ t·h·w = N and h, w
  // multiples of spatial_merge_size. INVALID_ARGUMENT names a mismatch.
  absl::StatusOr<VisionFeatures> Forward(const at::Tensor& pixel_values,
                                         absl::Span<const GridThw> grids) const;

  ComputeDType compute_dtype() const { return compute_dtype_; }
  const VisionConfig& config() const { return config_; }
  int64_t patch_dim() const;  // 1536 for the 2B
  // Bytes of weights used in place from the mapping / converted into memory at Load.
  uint64_t borrowed_weight_bytes() const { return borrowed_bytes_; }
  uint64_t converted_weight_bytes() const { return converted_bytes_; }
  // Bytes of linear weights repacked for the kernels at Load (0 on the LibTorch path).
  uint64_t packed_weight_bytes() const { return packed_bytes_; }
  // Whether Forward runs through common/kernels (see VisionModelOptions).
  bool uses_kernels() const { return uses_kernels_; }
  // What Load decided and why (CPU path, dtype fallback), for the startup log.
  const std::string& load_summary() const { return load_summary_; }

 private:
  struct Weights;
  VisionModel() = default;
  absl::StatusOr<VisionFeatures> ForwardKernels(const at::Tensor& pixel_values,
                                                absl::Span<const GridThw> grids,
                                                absl::Span<const int64_t> cu_seqlens) const;

  VisionConfig config_;
  ComputeDType compute_dtype_ = ComputeDType::kFloat32;
  int64_t attention_query_tile_ = 1024;
  std::unique_ptr<const Weights> weights_;
  uint64_t borrowed_bytes_ = 0;
  uint64_t converted_bytes_ = 0;
  uint64_t packed_bytes_ = 0;
  bool uses_kernels_ = false;
  std::string load_summary_;
};

}  // namespace vlm
