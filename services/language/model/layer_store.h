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
// With a packed-weight file (options.packed_file, packed_file.h) a layer is
// built from views of the file's mapping instead: its sections' checksums
// are verified at its first materialization in the process (the read that
// pages it in), nothing is converted, and a dropped layer's pages are
// MADV_DONTNEED-ed like the checkpoint's. A layer whose sections fail the
// check is converted from the checkpoint (and the file discarded for the
// next start to rebuild).
//
// Metrics: vlm_language_layers_resident, vlm_language_weight_bytes_resident
// {part="layers"} (and "embedding"/"projector" set by their owners),
// vlm_language_layer_materialization_seconds.
//
// Thread-safe. Handles pin a layer (it cannot be dropped while a handle
// lives) and must not outlive the store.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
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
#include "services/language/model/packed_file.h"

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
  // Which of the members below hold the projections: kDense the tensors,
  // kPacked qkv/o/gate_up/down, kInt8 the *8 members, kInt4 the *4 members.
  // Set where the layer is made (LayerStoreOptions::LayerForm): one store can
  // hold int8 and int4 layers.
  ProjectionForm form = ProjectionForm::kDense;
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
  // With form kInt4: layers [0, int8_layers) are int8 instead. An early
  // layer's rounding error grows through every later layer (vlm-bench-decoder
  // --fidelity, scripts/bench/int4_layer_sensitivity.py), so a few int8
  // layers at the start buy most of the fidelity 4 bits lose, for a few
  // percent more bytes.
  int int8_layers = 0;
  // The form layer `layer` is made in (form, or kInt8 for the first
  // int8_layers of an int4 store).
  ProjectionForm LayerForm(int layer) const {
    return form == ProjectionForm::kInt4 && layer < int8_layers ? ProjectionForm::kInt8 : form;
  }
  // The layers in `form`, mapped (OpenOrBuildPackedFile checked its
  // sections); null: converted from the checkpoint on materialization.
  std::shared_ptr<const PackedFile> packed_file;
  // With a converting form or a packed file: the background thread
  // materializes every layer (the first resident_layers under a bound), in
  // layer order, right after Create, so that the first request waits only for
  // the layers it reaches before the thread has them. Off: only on use and
  // prefetch.
  bool background_materialize = false;
};

// ---------------------------------------------------------------------------
// Packed-weight file of the layers (packed_file.h)
// ---------------------------------------------------------------------------

// The file's form string for `form`: the projection form and its byte layout
// ("packed/bf16-panels32", "int8/g32-i512"); empty for kDense (the checkpoint
// is already the kernels' layout). A form's sections are listed in
// layer_store.cc (LayerSections / LayerFromFile), one case per form.
// With int8_layers (kInt4 only) the name says how many leading layers are
// int8 ("int4/g32-i512-asym+int8x4"), so a file made with another count is
// foreign.
std::string PackedFormName(ProjectionForm form, int int8_layers = 0);
// Identifies the checkpoint for the packed file's key: SHA-256 of its model
// fingerprint (tensor headers and metadata, common/model_fingerprint.h) and
// each file's name, size and modification time (the fingerprint does not
// hash tensor values: rewritten weights with the same headers change mtime).
std::string PackedCheckpointId(const SafetensorsCheckpoint& checkpoint);
// 16 hex digits of SHA-256 of the checkpoint's absolute directory: the packed
// file's name (PackedFileKey::stem).
std::string PackedFileStem(const SafetensorsCheckpoint& checkpoint);

// One flat byte array of a packed-file group (views of memory held elsewhere).
struct NamedBytes {
  std::string name;
  const void* data = nullptr;
  uint64_t size = 0;
};
// A projection's arrays under `name` ("<name>.panels" / "<name>.rows",
// ".row_scales", ".ratios"; int4 "<name>.nibbles", ".row_scales", ".ratios",
// ".zeros"), and the weight back from a file's group.
void AppendPackedSections(const std::string& name, const kernels::PackedWeight& w,
                          std::vector<NamedBytes>* out);
void AppendInt8Sections(const std::string& name, const kernels::QuantizedWeight& w,
                        std::vector<NamedBytes>* out);
void AppendInt4Sections(const std::string& name, const kernels::Int4Weight& w,
                        std::vector<NamedBytes>* out);
absl::StatusOr<kernels::PackedWeight> PackedFromFile(const PackedFile& file, int32_t group,
                                                     const std::string& name, int64_t n,
                                                     int64_t k, bool gate_up);
absl::StatusOr<kernels::QuantizedWeight> Int8FromFile(const PackedFile& file, int32_t group,
                                                      const std::string& name, int64_t n,
                                                      int64_t k);
absl::StatusOr<kernels::Int4Weight> Int4FromFile(const PackedFile& file, int32_t group,
                                                 const std::string& name, int64_t n, int64_t k);
// Group of the LM head in a packed file (layers are groups 0..L-1).
inline constexpr int32_t kPackedHeadGroup = -1;

struct PackedFileOutcome {
  std::string path;
  std::string state;   // "mapped", "built", or "unavailable" (packing in memory)
  std::string reason;  // why an existing file was rejected / why none was written
  double seconds = 0;  // mapping or building
};
// Maps `dir`/<key>.vlmpack for (checkpoint, form); when it is missing or
// rejected (logged with the reason, counted), builds it: every layer
// converted (in parallel within a layer, one layer in memory at a time),
// `extra` adding further groups (the LM head), written atomically, then
// mapped. Null (state "unavailable", logged) when `dir` is empty or not
// writable or the disk is full: the caller packs in memory. Records
// vlm_model_load_seconds{phase="language_packed_map"|"language_packed_build"}.
std::shared_ptr<const PackedFile> OpenOrBuildPackedFile(
    const SafetensorsCheckpoint& checkpoint, const TextConfig& config, const std::string& prefix,
    at::ScalarType compute_dtype, const LayerStoreOptions& layers, const std::string& dir,
    const std::function<absl::Status(PackedFileWriter&)>& extra, PackedFileOutcome* outcome);

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
  int64_t conversions() const;       // of which converted from the checkpoint (not mapped)
  const std::shared_ptr<const PackedFile>& packed_file() const { return options_.packed_file; }
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
    bool from_file = false;          // resident weights are views of the packed file
    bool file_failed = false;        // its sections failed their checksum: convert instead
  };

  LayerStore() = default;
  // Reads the layer's pages or converts it; no lock held.
  // *from_file: the weights are views of the packed file.
  absl::StatusOr<std::shared_ptr<const DecoderLayerWeights>> Materialize(int layer,
                                                                          bool* from_file);
  // Packs or quantizes the projections of a materialized layer (options_.form)
  // and releases the dense ones; no lock held.
  absl::Status Convert(int layer, DecoderLayerWeights& w) const;
  // Marks a loaded layer resident and updates metrics; lock held.
  void MarkResident(int layer, std::shared_ptr<const DecoderLayerWeights> weights, double seconds,
                    bool from_file);
  void BackgroundDone(int layer);  // lock held
  void Drop(int layer);  // lock held; the slot is resident and unpinned
  void EnforceBound();   // lock held
  bool HasEvictableLayer() const;  // lock held
  void Unpin(int layer);
  void SchedulePrefetch(int after);  // lock held
  void PrefetchLoop();

  std::shared_ptr<const SafetensorsCheckpoint> checkpoint_;
  at::ScalarType dtype_;
  TextConfig config_;
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
  int64_t conversions_ = 0;
  int background_left_ = 0;  // layers of the background pass not yet resident
  std::vector<char> background_;  // layer is part of the background pass
  std::chrono::steady_clock::time_point created_;
  std::deque<int> queue_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace vlm::language
