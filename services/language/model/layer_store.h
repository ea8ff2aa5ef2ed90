// Lazy, bounded residency of the decoder layers' weights (architecture.md,
// "Loading and readiness").
//
// At Create only tensor headers are read. A layer is materialized on first
// Acquire: its pages are touched when the stored dtype is the compute dtype
// (the weights are read-only views of the mapping, zero copy), else its
// tensors are converted into owned copies (and the stored pages released).
// After each Acquire a background thread prefetches the next layers (cyclic:
// after the last layer comes layer 0, the next token's first). With
// `resident_layers` N > 0 at most N layers stay resident: the least recently
// used unpinned layer is dropped (MADV_DONTNEED of its pages, or its converted
// copies freed). Values never change with residency, only where they are read
// from, so outputs are identical with and without a bound. With
// options.form packed, int8 or int4 the projections are converted after the page-in
// and their dense pages released, so a dropped layer is converted again on its
// next use.
//
// Metrics: vlm_language_layers_resident, vlm_language_weight_bytes_resident
// {part="layers"} (and "embedding"/"projector" set by their owners),
// vlm_language_layer_materialization_seconds.
//
// Thread-safe. Handles pin a layer (it cannot be dropped while a handle
// lives) and must not outlive the store.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/kernels/gemm.h"
#include "common/kernels/quantize.h"
#include "common/kernels/quantize_int4.h"
#include "common/model_config.h"
#include "common/safetensors.h"

namespace prometheus {
class Gauge;
}

namespace vlm::language {

// ---------------------------------------------------------------------------
// Checkpoint names
// ---------------------------------------------------------------------------

// "model.visual." or "visual." (whichever holds merger.linear_fc1.weight).
absl::StatusOr<std::string> VisualPrefix(const SafetensorsCheckpoint& checkpoint);
// "model.language_model.", "language_model." or the Qwen2-VL-era "model."
// (whichever holds norm.weight), spec §2 "Prefix variants".
absl::StatusOr<std::string> LanguagePrefix(const SafetensorsCheckpoint& checkpoint);

// Looks a tensor up with its expected shape: NOT_FOUND / INVALID_ARGUMENT
// naming it when absent, misshapen or not floating point. Header only.
absl::StatusOr<const TensorInfo*> CheckTensor(const SafetensorsCheckpoint& checkpoint,
                                              const std::string& name,
                                              const std::vector<int64_t>& shape);
// The tensor in `dtype`: a read-only view of the mapping when stored in it
// (*borrowed = true; no page is touched), else a converted copy (the stored
// pages are read, then released with MADV_DONTNEED).
absl::StatusOr<at::Tensor> FetchTensor(const SafetensorsCheckpoint& checkpoint,
                                       const std::string& name, at::ScalarType dtype,
                                       bool* borrowed = nullptr);

// vlm_language_weight_bytes_resident{part=...}: "layers", "embedding", "projector".
prometheus::Gauge& WeightBytesResidentGauge(const std::string& part);

// ---------------------------------------------------------------------------
// Decoder layers
// ---------------------------------------------------------------------------

// The form a layer's seven projections (q, k, v, o, gate, up, down) take once
// materialized; norms always stay dense in the compute dtype.
enum class ProjectionForm {
  // Dense [out, in] tensors in the compute dtype (at::linear / vlm::Gemv).
  kDense,
  // bf16 compute only: packed for kernels::Gemm (qkv, o, gate_up, down below).
  // The dense tensors are released after packing (mapped pages MADV_DONTNEED,
  // converted copies freed) and left undefined: one copy of every weight.
  kPacked,
  // bf16 compute only: int8 per output channel (quantize.h) for
  // kernels::GemvInt8 (qkv8, o8, gate_up8, down8 below); dense tensors
  // released as for kPacked.
  kInt8,
  // bf16 compute only: 4-bit groups of 32 with zero points (quantize_int4.h)
  // for kernels::GemvInt4 / GemmInt4 (qkv4, o4, gate_up4, down4 below); dense
  // tensors released as for kPacked.
  kInt4,
};
const char* ProjectionFormName(ProjectionForm form);  // "dense", "packed", "int8", "int4"

// One Qwen3 decoder layer (spec §2 names, [out, in] layouts).
struct DecoderLayerWeights {
  at::Tensor input_layernorm;           // [hidden]
  at::Tensor q_proj;                    // [heads·head_dim, hidden]
  at::Tensor k_proj;                    // [kv_heads·head_dim, hidden]
  at::Tensor v_proj;                    // [kv_heads·head_dim, hidden]
  at::Tensor o_proj;                    // [hidden, heads·head_dim]
  at::Tensor q_norm;                    // [head_dim]
  at::Tensor k_norm;                    // [head_dim]
  at::Tensor post_attention_layernorm;  // [hidden]
  at::Tensor gate_proj;                 // [intermediate, hidden]
  at::Tensor up_proj;                   // [intermediate, hidden]
  at::Tensor down_proj;                 // [hidden, intermediate]
  // ProjectionForm::kPacked: q|k|v as one weight [heads·D + 2·kv_heads·D, hidden]
  // (one GEMM, columns split after), o, gate/up (PackGateUp: SiLU·up epilogue), down.
  kernels::PackedWeight qkv, o, gate_up, down;
  // ProjectionForm::kInt8: q|k|v and gate|up concatenated along the output
  // (per-channel scales make that identical to separate weights).
  kernels::QuantizedWeight qkv8, o8, gate_up8, down8;
  // ProjectionForm::kInt4: concatenated as for kInt8 (scales are per row and group).
  kernels::Int4Weight qkv4, o4, gate_up4, down4;
};

struct LayerStoreOptions {
  // Materialize every layer at Create (with a bound: the first N).
  bool eager_load = false;
  // Most layers resident at once; 0 = no bound. Pinned layers may exceed it
  // briefly.
  int resident_layers = 0;
  // Layers the background thread prepares ahead of the one acquired; 0 turns
  // the thread off.
  int prefetch_layers = 1;
  // What materialization makes of the projections (kPacked / kInt8 / kInt4 need a
  // bf16 compute dtype: Create rejects them otherwise).
  ProjectionForm form = ProjectionForm::kDense;
};

class LayerStore {
 public:
  // Pins one resident layer.
  class Handle {
   public:
    Handle() = default;
    Handle(Handle&& other) noexcept;
    Handle& operator=(Handle&& other) noexcept;
    Handle(const Handle&) = delete;
    Handle& operator=(const Handle&) = delete;
    ~Handle();
    const DecoderLayerWeights& operator*() const { return *weights_; }
    const DecoderLayerWeights* operator->() const { return weights_.get(); }
    int layer() const { return layer_; }

   private:
    friend class LayerStore;
    void Release();
    LayerStore* store_ = nullptr;
    int layer_ = -1;
    std::shared_ptr<const DecoderLayerWeights> weights_;
  };

  // Checks every layer tensor's presence and shape (`prefix` from
  // LanguagePrefix); touches no weight page unless options.eager_load.
  static absl::StatusOr<std::unique_ptr<LayerStore>> Create(
      std::shared_ptr<const SafetensorsCheckpoint> checkpoint, const TextConfig& config,
      const std::string& prefix, at::ScalarType compute_dtype, const LayerStoreOptions& options);
  ~LayerStore();  // stops the prefetch thread; no Handle may be alive

  // The layer's weights, materialized on first use (in the calling thread, or
  // waiting for the prefetch thread if it is already on it); schedules the
  // prefetch of the following layers.
  absl::StatusOr<Handle> Acquire(int layer);

  int num_layers() const { return static_cast<int>(slots_.size()); }
  bool in_place() const { return in_place_; }  // weights are views of the mapping
  at::ScalarType compute_dtype() const { return dtype_; }
  const LayerStoreOptions& options() const { return options_; }
  // Bytes a layer holds while resident in options().form (dense tensors, or
  // packed panels / int8 rows + scales, plus the norms); what
  // vlm_language_weight_bytes_resident{part="layers"} counts.
  uint64_t layer_bytes(int layer) const;
  uint64_t total_bytes() const;  // all layers

  // Snapshot counters (tests, logs).
  bool IsResident(int layer) const;
  int resident_layers() const;
  uint64_t resident_bytes() const;
  int64_t materializations() const;  // layer loads since Create
  int64_t evictions() const;         // layers dropped by the bound

 private:
  enum class State { kCold, kLoading, kResident };
  struct Slot {
    State state = State::kCold;
    int pins = 0;
    uint64_t last_use = 0;
    bool queued = false;  // waiting in the prefetch queue
    std::vector<std::string> names;  // checkpoint tensors of the layer, field order
    uint64_t bytes = 0;              // resident size in options_.form
    std::shared_ptr<const DecoderLayerWeights> views;    // in place: set at Create
    std::shared_ptr<const DecoderLayerWeights> weights;  // while resident
  };

  LayerStore() = default;
  // Reads the layer's pages or converts it; no lock held.
  absl::StatusOr<std::shared_ptr<const DecoderLayerWeights>> Materialize(int layer) const;
  // Packs or quantizes the projections of a materialized layer (options_.form)
  // and releases the dense ones; no lock held.
  absl::Status Convert(int layer, DecoderLayerWeights& w) const;
  // Marks a loaded layer resident and updates metrics; lock held.
  void MarkResident(int layer, std::shared_ptr<const DecoderLayerWeights> weights, double seconds);
  void Drop(int layer);  // lock held; the slot is resident and unpinned
  void EnforceBound();   // lock held
  bool HasEvictableLayer() const;  // lock held
  void Unpin(int layer);
  void SchedulePrefetch(int after);  // lock held
  void PrefetchLoop();

  std::shared_ptr<const SafetensorsCheckpoint> checkpoint_;
  at::ScalarType dtype_;
  bool in_place_ = true;
  LayerStoreOptions options_;
  prometheus::Gauge* layers_gauge_ = nullptr;
  prometheus::Gauge* bytes_gauge_ = nullptr;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> slots_;
  uint64_t tick_ = 0;
  int resident_count_ = 0;
  uint64_t resident_bytes_ = 0;
  int64_t materializations_ = 0;
  int64_t evictions_ = 0;
  std::deque<int> queue_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace vlm::language
