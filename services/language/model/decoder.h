// The Qwen3 text decoder of Qwen3-VL (docs/qwen3-vl-model.md §5, §6):
// embedding with the image splice, decoder layers (RMSNorm, q/k per-head
// RMSNorm, interleaved MRoPE, grouped-query causal attention over a KV cache,
// SwiGLU), deepstack injection after the first layers, final norm and the LM
// head (tied to embed_tokens per the §2 rule).
//
// Weights: read-only views of the checkpoint mapping when stored in the
// compute dtype (zero copy), else converted (per layer, when the layer is
// materialized; embedding/head at Load). Layers are materialized lazily by a
// LayerStore (see layer_store.h). Compute is bf16 by default (falls back to
// f32 on CPUs without fast bf16 matmuls), f32 on request; norms, softmax and
// rotary run in f32 as in the reference.
//
// Logits are float32 and cover the model's whole vocabulary (151936 for the
// 2B): ids at or above the tokenizer's size (151669) are untrained padding and
// NOT masked here; the sampler should mask them (spec §10.22).
//
// Thread-safety: a Load'ed Decoder is immutable; Forward may run
// concurrently on different KvStorages (never on the same one).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/cpu_features.h"
#include "common/kernels/gemm.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "services/language/model/layer_store.h"
#include "services/language/model/mrope.h"

namespace vlm::language {

// How the decoder layers' projections are computed in bf16 (f32 compute
// always uses dense projections on kernels::GemmF32: the fidelity reference).
//   kernels  weights packed once at layer materialization (q|k|v as one
//            weight, gate/up with the SiLU·up epilogue, residual adds fused)
//            and every row, prefill and decode, through kernels::Gemm
//            (row-invariant): one weight copy, the dense pages released.
//            Needs a blocked GEMM path (AVX-512 BF16 or AMX).
//   torch    dense checkpoint views; prefill rows through a padded at::linear
//            (RowLinear), decode rows through vlm::Gemv (use_gemv).
//   auto     kernels when kernels::DefaultGemmPath() is blocked, else torch.
enum class MatmulPath { kAuto, kKernels, kTorch };
const char* MatmulPathName(MatmulPath path);  // "auto", "kernels", "torch"
// "auto", "kernels", "torch"; INVALID_ARGUMENT names the accepted values.
absl::StatusOr<MatmulPath> ParseMatmulPath(std::string_view value);

// Storage of the decoder layers' seven projections (norms and embeddings stay
// in the compute dtype whatever this says).
//   bf16  as the compute dtype says (and --matmul decides the form).
//   int8  symmetric, one scale per group of 32 along K (kernels/quantize.h),
//         quantized at layer materialization (dense pages released after);
//         decode rows through kernels::GemvInt8 (int16 activations), prefill
//         rows through kernels::GemmInt8 (bf16 panels converted per call;
//         DecoderOptions::int8_prefill_gemm), each row's result independent
//         of its batch, whatever MatmulPath says. The LM head
//         too when DecoderOptions::int8_lm_head (an int8 copy made at Load;
//         the bf16 table stays for embedding lookups, which touch few pages).
//         Needs the bf16 compute dtype (Load rejects f32: the f32 path is the
//         fidelity reference and stays unquantized).
//   int4  asymmetric 4-bit, one scale and zero point per group of 32 along K
//         (kernels/quantize_int4.h), made at layer materialization like int8;
//         decode rows through kernels::GemvInt4, prefill rows through
//         kernels::GemmInt4 where a blocked GEMM path exists (else GemvInt4),
//         rows independent of their batch. The LM head in int4 as well
//         (int4_lm_head; false: int8), the first layers in int8
//         (int4_int8_layers, kAutoInt4Int8Layers below). bf16 compute only,
//         as int8. Logits cosine against bf16 (vlm-bench-decoder --fidelity,
//         64 prompt tokens + 16 greedy steps) on the synthetic 2B checkpoint:
//         0.974 mean with the default 4 int8 layers, 0.913 with none (int8
//         everywhere: 0.9993); its random layers amplify the 4-bit rounding's
//         8% weight error. Against bf16 on the dequantized weights 0.9999
//         (decoder_int4_test): the kernels add next to nothing.
enum class WeightDType { kBFloat16, kInt8, kInt4 };
// int4 weights keep their first layers in int8 (DecoderOptions::
// int4_int8_layers, default kAutoInt4Int8Layers: one layer in seven, rounded
// up; 4 of the 2B's 28). Measured per layer on the synthetic 2B checkpoint
// (scripts/bench/int4_layer_sensitivity.py), 4-bit rounding of layer 0 alone
// costs 0.036 of logits cosine, layer 1 0.013, layer 2 0.007, layer 3 0.005,
// a middle layer 0.0007 and the last 0.0003: an early layer's error grows
// through every later one. vlm-bench-decoder --fidelity on the 2B: every
// layer int4 0.916 mean cosine, 1.171 GB per decode step; the first 2 int8
// 0.962 / 1.218 GB; 4: 0.977 / 1.265 GB; 8: 0.987 / 1.359 GB; 12: 0.991 /
// 1.454 GB (int8 everywhere 0.9993 / 1.831 GB). Four buys 73% of the loss
// back for 8% more bytes; each later layer buys less.
inline constexpr int kAutoInt4Int8Layers = -1;
// The int8 layer count kAutoInt4Int8Layers means for a model of `layers`.
inline int AutoInt4Int8Layers(int64_t layers) { return static_cast<int>((layers + 6) / 7); }
// The int8 layers an int4 model of `layers` gets for int4_int8_layers
// `requested` (kAutoInt4Int8Layers or a count, capped at `layers`).
inline int Int4Int8Layers(int requested, int64_t layers) {
  const int64_t n = requested == kAutoInt4Int8Layers ? AutoInt4Int8Layers(layers) : requested;
  return static_cast<int>(n < layers ? n : layers);
}
const char* WeightDTypeName(WeightDType dtype);  // "bf16", "int8", "int4"
// "bf16" (or "bfloat16"), "int8", "int4"; INVALID_ARGUMENT names the accepted values.
absl::StatusOr<WeightDType> ParseWeightDType(std::string_view value);

struct DecoderOptions {
  // bfloat16 falls back to float32 (with a warning in load_summary) on CPUs
  // without fast bf16 matmuls.
  ComputeDType compute_dtype = ComputeDType::kBFloat16;
  // The LM head and, with dense projections (matmul torch), decode-row
  // projections through vlm::Gemv (bf16 compute only); false: at::linear.
  bool use_gemv = true;
  // The LM head packed for kernels::Gemm when the layers are packed or int8
  // and a blocked GEMM path exists (false: as use_gemv says).
  bool packed_head = true;
  // Read embed_tokens' pages at Load (eager_load also does); otherwise they
  // are only madvise(WILLNEED)-ed and fault in at the first request.
  bool touch_embedding = false;
  MatmulPath matmul = MatmulPath::kAuto;
  WeightDType weight_dtype = WeightDType::kBFloat16;
  // With weight_dtype int8: the LM head in int8 as well (halves its 622 MB
  // read per decode step on the 2B model; logits cosine 0.99998 against the
  // bf16 head on the synthetic 2B checkpoint, scripts/bench/int8_fidelity.py).
  // With weight_dtype int4 and int4_lm_head false: the LM head in int8.
  bool int8_lm_head = true;
  // With weight_dtype int4: the LM head in int4. vlm-bench-decoder --fidelity
  // on the 2B (4 int8 layers): int4 head 0.9741 mean logits cosine and 1.119
  // GB per decode step, int8 head 0.9771 and 1.265 GB. The int8 head buys
  // 0.003 for 0.146 GB, the four int8 layers 0.061 for 0.094 GB: bytes buy
  // fidelity in the early layers, not in the head (the tiny model: 0.9707 vs
  // 0.9737).
  bool int4_lm_head = true;
  // With weight_dtype int4: how many leading layers are int8 instead
  // (LayerStoreOptions::int8_layers); kAutoInt4Int8Layers above says why.
  int int4_int8_layers = kAutoInt4Int8Layers;
  // With weight_dtype int8: prefill rows through kernels::GemmInt8 (int8
  // panels converted to bf16 per call, the bf16 GEMM's micro-kernel) where a
  // blocked GEMM path exists; false: through GemvInt8 like decode rows.
  bool int8_prefill_gemm = true;
  // Directory of packed-weight files (packed_file.h): with packed or int8
  // projections the converted layers and LM head are mapped from the file for
  // this checkpoint and form, which Load first builds there when it is
  // missing or rejected. Empty, or not writable: converted in memory.
  std::string packed_dir;
  // layers.form and layers.packed_file are set by Load from matmul,
  // weight_dtype and packed_dir.
  LayerStoreOptions layers;
};

// ---------------------------------------------------------------------------
// The forward pass: batched, over a paged KV cache. The only way to run the
// decoder (the serving engine's model runner, tests, benchmarks).
// ---------------------------------------------------------------------------

// The paged KV cache's storage: per layer, K as [num_blocks, kv_heads,
// head_dim, block_size] (keys dimension-major within a block, as
// PagedAttention reads them) and V as [num_blocks, kv_heads, block_size,
// head_dim], in the compute dtype. Which
// block belongs to which sequence is the caller's business (block tables);
// the decoder only reads and writes the blocks a chunk's table names.
struct KvStorage {
  int64_t num_blocks = 0;
  int64_t block_size = 0;  // tokens per block
  std::vector<at::Tensor> k, v;  // one per decoder layer
  uint64_t bytes() const;        // K and V of every layer
};

// The tokens one sequence contributes to one forward pass: a prompt chunk or
// one decode token, at cache indices [start, start + n).
struct SequenceChunk {
  absl::Span<const int32_t> token_ids;  // n >= 1
  int64_t start = 0;  // cache index of token_ids[0]; indices < start are already in the KV
  // Blocks holding cache indices [0, start + n): entry i holds indices
  // [i*block_size, (i+1)*block_size). At least ceil((start+n)/block_size) entries.
  absl::Span<const int32_t> block_table;
  at::Tensor positions;  // [3, n] int64 MRoPE positions (t, h, w) of the n tokens
  // Projector rows for the image-pad tokens among token_ids, in order:
  // [V, hidden] (bf16 or f32; undefined when V = 0), and one [V, hidden] per
  // deepstack level (added after decoder layer `level` at those tokens).
  at::Tensor image_embeds;
  std::vector<at::Tensor> deepstack;
  // true: one generated token (n == 1); it takes the decode path (Gemv
  // projections in bf16) and is embedded as is (an image-pad id the model
  // generated takes no image row). false: prompt rows (prefill path).
  bool decode = false;
  bool logits = false;  // return float32 logits of the chunk's last token
};

// Contract of Decoder::Forward (what the engine relies on):
// - Writes the K/V of every chunk's tokens into its blocks and returns the
//   float32 logits [R, vocab] of the chunks with logits = true, in order
//   (R = their count; an undefined tensor when R = 0).
// - Batch invariance: a chunk's K/V and logits are bit-identical whatever
//   other chunks share the pass, and a prompt's K/V and last-token logits do
//   not depend on how it was cut into chunks (prefill rows always take the
//   same row-invariant path, decode rows always theirs). This is what makes a
//   prefix-cache hit and a batched run give the same tokens as a lone cold run.
// - Chunks of one pass must belong to different sequences (disjoint blocks,
//   except read-only shared prefix blocks below every chunk's start).
// - INVALID_ARGUMENT (naming the chunk and field) for bad ids, shapes,
//   positions or block tables; on error nothing is guaranteed about the
//   blocks the pass would have written (the caller drops those sequences).
//   Validation runs before anything is written: a rejected pass leaves the
//   storage untouched. Also rejected: a block written by two chunks of the
//   pass, a KV storage of another geometry or dtype.
// How (decoder.cc, row_ops.h, paged_attention.h): with packed projections
// (MatmulPath kernels) every row of the pass, prefill and decode, goes through
// one kernels::Gemm per weight (row-invariant by construction, no padding), so
// a token's K/V and logits are the same whether it ran as a decode row or a
// prefill row; with int8 projections every row goes through
// kernels::GemvInt8 in groups of 8 (rows independent), likewise. With dense
// projections (MatmulPath torch, and f32) prefill rows of all chunks share one
// RowLinear per weight (f32: kernels::GemmF32, a fixed summation order; bf16:
// at::linear padded so oneDNN stays on row-invariant kernels); decode rows go
// through Gemv in bf16 with use_gemv (else RowLinear too); norms, rotary,
// SwiGLU and residual adds are per-row loops; attention is PagedAttention (keys
// block by block from 0, online f32 softmax). So in f32 (and bf16 without Gemv)
// a token's K/V and logits are also the same whether it ran as a decode row or
// a prefill row; in bf16 with Gemv the two kinds differ by bf16 rounding, so
// blocks written by decode rows and reused as a prefix match a cold prefill of
// the same tokens only to that rounding.
// Positions: [3, n] int64 (int32 accepted). Any block_size >= 1 works;
// kv_bytes_per_token() x block_size is one block's size over all layers.

class Decoder {
 public:
  // Checks every decoder tensor (presence, shape, tied-head rule of spec §2),
  // keeps the checkpoint (shared: the layer store reads it later) and
  // touches only the final norm (and the embedding if asked). INVALID_ARGUMENT
  // / NOT_FOUND name the tensor or config field.
  static absl::StatusOr<std::unique_ptr<Decoder>> Load(
      std::shared_ptr<const SafetensorsCheckpoint> checkpoint, const ModelConfig& config,
      const DecoderOptions& options = {});
  ~Decoder();

  // Paged KV storage for `num_blocks` blocks of `block_size` tokens, reading
  // as zeros until written; memory is reserved as address space now and
  // committed page by page as blocks are first written. INVALID_ARGUMENT for
  // sizes < 1, RESOURCE_EXHAUSTED when it cannot be mapped.
  absl::StatusOr<KvStorage> NewKvStorage(int64_t num_blocks, int64_t block_size) const;
  // KV bytes one token occupies (all layers, K and V), for sizing a budget.
  uint64_t kv_bytes_per_token() const;
  // One forward pass over chunks of several sequences (see the contract above).
  absl::StatusOr<at::Tensor> Forward(KvStorage& kv, absl::Span<const SequenceChunk> chunks) const;

  const ModelConfig& config() const { return config_; }
  ComputeDType compute_dtype() const { return compute_dtype_; }
  int64_t vocab_size() const { return config_.text.vocab_size; }
  int64_t max_context() const { return config_.text.max_position_embeddings; }
  LayerStore& layers() const { return *layers_; }
  bool tied_head() const { return tied_; }
  bool using_gemv() const { return use_gemv_; }
  // What Load resolved: dense (torch), packed (kernels), int8 or int4 projections.
  ProjectionForm projection_form() const { return layers_->options().form; }
  // Bytes of the embedding, final norm and (untied) head in the compute dtype.
  uint64_t embedding_bytes() const { return embedding_bytes_; }
  // Weight bytes one decode step reads (all layers + norm + head).
  uint64_t decode_weight_bytes() const;
  // What Load decided (dtype, in place or converted, tie rule, gemv path).
  const std::string& load_summary() const { return load_summary_; }
  // What became of the packed-weight file (state "mapped", "built" or
  // "unavailable" with the reason); empty state for dense projections.
  const PackedFileOutcome& packed_file_outcome() const { return packed_outcome_; }
  // LM heads converted in memory at Load (0 when mapped from the packed file or dense).
  int head_conversions() const { return head_conversions_; }

 private:
  struct Batch;
  Decoder() = default;
  absl::Status ValidateChunks(const KvStorage& kv, absl::Span<const SequenceChunk> chunks) const;
  absl::Status ValidateKvStorage(const KvStorage& kv) const;
  void WriteKv(KvStorage& kv, int layer, const at::Tensor& k, const at::Tensor& v,
               const Batch& b) const;
  // ys[i] = h·ws[i]ᵀ over a Forward pass's rows, prefill and decode rows apart.
  // np prefill rows first, then nd decode rows. Dense weights only.
  std::vector<at::Tensor> Project(int64_t np, int64_t nd, const at::Tensor& h,
                                  std::initializer_list<at::Tensor> weights) const;
  // A layer's projections in whatever form it holds (dense, packed, int8),
  // over np prefill rows then nd decode rows:
  //   q, k, v = h·Wqᵀ, h·Wkᵀ, h·Wvᵀ (contiguous [R, heads·D], [R, kv_heads·D] x2)
  void ProjectQkv(int64_t np, int64_t nd, const DecoderLayerWeights& w, const at::Tensor& h,
                  at::Tensor* q, at::Tensor* k, at::Tensor* v) const;
  //   x += o·Woᵀ, in place (x: [R, hidden], o: [R, heads·D])
  void AddAttentionOut(int64_t np, int64_t nd, const DecoderLayerWeights& w, const at::Tensor& o,
                       at::Tensor& x) const;
  //   x += (silu(n·Wgᵀ)·(n·Wuᵀ))·Wdᵀ, in place
  void AddMlp(int64_t np, int64_t nd, const DecoderLayerWeights& w, const at::Tensor& n,
              at::Tensor& x) const;
  // Int8 or int4 layers (W: kernels::QuantizedWeight or Int4Weight), np
  // prefill rows then nd decode rows: y = h·wᵀ [R, N]; x += h·wᵀ in place;
  // x += (silu(n·Wgᵀ)·(n·Wuᵀ))·Wdᵀ in place.
  template <typename W>
  at::Tensor QuantizedProject(int64_t np, int64_t nd, const at::Tensor& h, const W& w) const;
  template <typename W>
  void QuantizedAddInPlace(int64_t np, int64_t nd, const at::Tensor& h, const W& w,
                           at::Tensor& x) const;
  template <typename W>
  void QuantizedMlp(int64_t np, int64_t nd, const W& gate_up, const W& down, const at::Tensor& n,
                    at::Tensor& x) const;
  // Rows [0, result) of an int8 / int4 pass go through GemmInt8 / GemmInt4:
  // the prefill rows when quantized_gemm_, else none.
  int64_t QuantizedGemmRows(int64_t np) const { return quantized_gemm_ ? np : 0; }
  // Load's steps: the embedding, head and final norm by the tie rule; the
  // layers' projection form; the LM head in the form the layers use.
  absl::Status LoadEmbeddingAndNorm(const std::string& prefix, std::string* tie_rule,
                                    std::string* embed_source);
  absl::StatusOr<LayerStoreOptions> ChooseProjectionForm(const std::string& warning,
                                                         std::string* matmul_note);
  absl::Status PrepareHead(ProjectionForm form, const std::string& embed_source,
                           std::string* head_note);
  enum class HeadForm { kDense, kPacked, kInt8, kInt4 };
  HeadForm ChooseHeadForm(ProjectionForm form) const;
  absl::Status WriteHead(ProjectionForm form, PackedFileWriter& writer) const;
  at::Tensor Head(const at::Tensor& hidden) const;  // [R, hidden] -> [R, vocab] f32

  ModelConfig config_;
  ComputeDType compute_dtype_ = ComputeDType::kFloat32;
  DecoderOptions options_;
  std::shared_ptr<const SafetensorsCheckpoint> checkpoint_;
  std::unique_ptr<LayerStore> layers_;
  std::unique_ptr<MultimodalRotary> rotary_;
  at::Tensor embed_tokens_;  // [vocab, hidden] compute dtype
  at::Tensor lm_head_;       // [vocab, hidden]: embed_tokens_ itself when tied
  kernels::QuantizedWeight lm_head8_;  // int8 copy of lm_head_ (int8_lm_head), else empty
  kernels::Int4Weight lm_head4_;       // int4 copy of lm_head_ (int4_lm_head), else empty
  // The LM head packed for kernels::Gemm when the layers are packed or int8
  // and a blocked GEMM path exists (packed at Load; the dense head's mapped
  // pages are released): Gemm reads each head weight once for every row of a
  // pass, where vlm::Gemv rereads it per 4 rows. Empty otherwise (and with
  // the int8 head).
  kernels::PackedWeight packed_head_;
  at::Tensor final_norm_;    // [hidden]
  bool tied_ = true;
  bool use_gemv_ = false;
  bool quantized_gemm_ = false;  // int8 / int4 prefill rows through GemmInt8 / GemmInt4
  uint64_t embedding_bytes_ = 0;
  std::string load_summary_;
  PackedFileOutcome packed_outcome_;
  int head_conversions_ = 0;
};

}  // namespace vlm::language
