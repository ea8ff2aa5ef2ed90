// Qwen3-VL text decoder, in the order data flows through it (spec §5):
//   ids -> embed_tokens (+ image splice, §5.1) -> layers (§5.2, MRoPE §6,
//   deepstack §5.3) -> final RMSNorm -> LM head (§5.4)
#include "services/language/model/decoder.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <tuple>
#include <utility>

#include <ATen/ATen.h>
#include <prometheus/gauge.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/kernels/gemm.h"
#include "common/kernels/gemv_int8.h"
#include "common/nn.h"
#include "services/language/model/decode_attention.h"
#include "common/kernels/gemv.h"
#include "common/kernels/paged_attention.h"
#include "common/kernels/row_ops.h"

namespace vlm::language {
namespace {

constexpr int64_t kGemvRows = 8;  // Gemv is meant for <= 8 input rows

at::ScalarType ToScalarType(ComputeDType dtype) {
  return dtype == ComputeDType::kBFloat16 ? at::kBFloat16 : at::kFloat;
}

absl::Status Internal(const char* where, const c10::Error& e) {
  return absl::InternalError(absl::StrCat(where, ": ", e.what_without_backtrace()));
}

// Turns a failed kernel status into an exception so the forward code stays
// linear; caught at the API boundary like LibTorch's own errors.
void Check(const absl::Status& s) { TORCH_CHECK(s.ok(), "kernel: ", s.ToString()); }

// y = x·wᵀ over int8 weights in one call for all R rows: prefill chunks read
// the weights once (GemvInt8 blocks its rows in L2), and each row's result is
// the same as in a decode call. x: [R, K] bf16 or f32, y: [R, N] of `dtype`.
at::Tensor Int8Rows(const at::Tensor& x, const kernels::QuantizedWeight& w,
                    at::ScalarType dtype = at::kBFloat16) {
  at::Tensor y = at::empty({x.size(0), w.n()}, x.options().dtype(dtype));
  Check(kernels::GemvInt8(x, w, &y));
  return y;
}

}  // namespace

const char* MatmulPathName(MatmulPath path) {
  switch (path) {
    case MatmulPath::kAuto:
      return "auto";
    case MatmulPath::kKernels:
      return "kernels";
    case MatmulPath::kTorch:
      return "torch";
  }
  return "?";
}

absl::StatusOr<MatmulPath> ParseMatmulPath(std::string_view value) {
  for (MatmulPath p : {MatmulPath::kAuto, MatmulPath::kKernels, MatmulPath::kTorch}) {
    if (value == MatmulPathName(p)) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("matmul \"", std::string(value), "\": expected kernels, torch or auto"));
}

const char* WeightDTypeName(WeightDType dtype) {
  return dtype == WeightDType::kInt8 ? "int8" : "bf16";
}

absl::StatusOr<WeightDType> ParseWeightDType(std::string_view value) {
  if (value == "bf16" || value == "bfloat16") return WeightDType::kBFloat16;
  if (value == "int8") return WeightDType::kInt8;
  return absl::InvalidArgumentError(
      absl::StrCat("weight_dtype \"", std::string(value), "\": expected bf16 or int8"));
}

// What one pass over a run of tokens needs besides the hidden states.
struct Decoder::Pass {
  int64_t start = 0;     // cache index of the first token
  at::Tensor cos, sin;   // [S, head_dim] float32
  bool decode = false;   // one token: Gemv projections when enabled
  at::Tensor visual;     // [V] int64 rows of the pass holding image tokens (V may be 0)
  std::vector<at::Tensor> deepstack;  // [V, hidden] per level, compute dtype
};

uint64_t Sequence::kv_bytes() const {
  uint64_t total = 0;
  for (const at::Tensor& t : k_cache_) total += t.nbytes();
  for (const at::Tensor& t : v_cache_) total += t.nbytes();
  return total;
}

Decoder::~Decoder() = default;

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Decoder>> Decoder::Load(
    std::shared_ptr<const SafetensorsCheckpoint> checkpoint, const ModelConfig& config,
    const DecoderOptions& options) {
  const TextConfig& c = config.text;
  if (c.vocab_size <= 0 || c.hidden_size <= 0 || c.num_hidden_layers <= 0 ||
      c.num_attention_heads <= 0 || c.num_key_value_heads <= 0 || c.head_dim <= 0 ||
      c.intermediate_size <= 0 || c.max_position_embeddings <= 0) {
    return absl::InvalidArgumentError("text_config: sizes must be > 0");
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "text_config: num_attention_heads ", c.num_attention_heads,
        " is not a multiple of num_key_value_heads ", c.num_key_value_heads));
  }
  if (c.head_dim % 2 != 0 ||
      c.mrope_section[0] + c.mrope_section[1] + c.mrope_section[2] != c.head_dim / 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "text_config: rope_scaling.mrope_section [", absl::StrJoin(c.mrope_section, ", "),
        "] must sum to head_dim/2 = ", c.head_dim / 2));
  }
  if (c.hidden_act != "silu") {
    return absl::InvalidArgumentError(
        absl::StrCat("text_config.hidden_act \"", c.hidden_act, "\" is not supported (silu)"));
  }
  if (c.attention_bias) {
    return absl::InvalidArgumentError("text_config.attention_bias true is not supported");
  }
  if (options.prefill_chunk_tokens < 0 || options.attention_query_tile < 0) {
    return absl::InvalidArgumentError("prefill_chunk_tokens and attention_query_tile must be >= 0");
  }
  if (config.vision.deepstack_visual_indexes.size() > static_cast<size_t>(c.num_hidden_layers)) {
    return absl::InvalidArgumentError("more deepstack levels than decoder layers");
  }
  absl::StatusOr<std::string> prefix = LanguagePrefix(*checkpoint);
  if (!prefix.ok()) return prefix.status();

  std::unique_ptr<Decoder> d(new Decoder());
  d->config_ = config;
  d->options_ = options;
  d->checkpoint_ = checkpoint;
  std::string warning;
  d->compute_dtype_ = ChooseComputeDType(options.compute_dtype, &warning);
  const at::ScalarType dtype = ToScalarType(d->compute_dtype_);
  const SafetensorsCheckpoint& ckpt = *checkpoint;
  const std::vector<int64_t> table = {c.vocab_size, c.hidden_size};

  // Head rule (spec §2): tied -> embed_tokens (else lm_head) for both roles;
  // untied -> both required.
  const std::string embed_name = *prefix + "embed_tokens.weight";
  const std::string head_name = "lm_head.weight";
  const bool has_embed = ckpt.Has(embed_name), has_head = ckpt.Has(head_name);
  d->tied_ = config.tie_word_embeddings;
  std::string tie_rule;
  std::string embed_source = embed_name;
  if (d->tied_) {
    if (!has_embed && !has_head) {
      return absl::NotFoundError(absl::StrCat("tied head: neither ", embed_name, " nor ",
                                              head_name, " is in the checkpoint"));
    }
    if (!has_embed) embed_source = head_name;
    tie_rule = absl::StrCat("tied head from ", embed_source,
                            has_embed && has_head ? " (lm_head.weight present, ignored)" : "");
  } else {
    if (!has_embed || !has_head) {
      return absl::NotFoundError(absl::StrCat("untied head: needs both ", embed_name, " and ",
                                              head_name, "; missing ",
                                              has_embed ? head_name : embed_name));
    }
    tie_rule = "untied head (lm_head.weight)";
  }
  if (!config.tie_warning.empty()) absl::StrAppend(&tie_rule, "; ", config.tie_warning);

  try {
    absl::StatusOr<const TensorInfo*> info = CheckTensor(ckpt, embed_source, table);
    if (!info.ok()) return info.status();
    bool borrowed = false;
    absl::StatusOr<at::Tensor> embed = FetchTensor(ckpt, embed_source, dtype, &borrowed);
    if (!embed.ok()) return embed.status();
    d->embed_tokens_ = *std::move(embed);
    if (borrowed) {
      absl::Status s = options.touch_embedding || options.layers.eager_load
                           ? ckpt.Touch(embed_source)
                           : ckpt.Prefetch(embed_source);
      if (!s.ok()) return s;
    }
    d->embedding_bytes_ = d->embed_tokens_.nbytes();
    if (d->tied_) {
      d->lm_head_ = d->embed_tokens_;
    } else {
      info = CheckTensor(ckpt, head_name, table);
      if (!info.ok()) return info.status();
      absl::StatusOr<at::Tensor> head = FetchTensor(ckpt, head_name, dtype, &borrowed);
      if (!head.ok()) return head.status();
      d->lm_head_ = *std::move(head);
      if (borrowed) {
        absl::Status s = options.touch_embedding || options.layers.eager_load
                             ? ckpt.Touch(head_name)
                             : ckpt.Prefetch(head_name);
        if (!s.ok()) return s;
      }
      d->embedding_bytes_ += d->lm_head_.nbytes();
    }
    const std::string norm_name = *prefix + "norm.weight";
    info = CheckTensor(ckpt, norm_name, {c.hidden_size});
    if (!info.ok()) return info.status();
    absl::StatusOr<at::Tensor> norm = FetchTensor(ckpt, norm_name, dtype);
    if (!norm.ok()) return norm.status();
    d->final_norm_ = *std::move(norm);
    d->embedding_bytes_ += d->final_norm_.nbytes();
    WeightBytesResidentGauge("embedding").Set(static_cast<double>(d->embedding_bytes_));

    d->rotary_ = std::make_unique<MultimodalRotary>(c);
  } catch (const c10::Error& e) {
    return Internal("decoder load", e);
  }

  // Projection form (MatmulPath, WeightDType above).
  LayerStoreOptions layer_options = options.layers;
  layer_options.form = ProjectionForm::kDense;
  std::string matmul_note;
  if (options.weight_dtype == WeightDType::kInt8) {
    if (dtype != at::kBFloat16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weight_dtype int8 needs compute dtype bf16 (compute is ",
          ComputeDTypeName(d->compute_dtype_),
          warning.empty() ? "" : absl::StrCat(": ", warning),
          "); float32 is the unquantized fidelity reference"));
    }
    std::string missing;
    if (!kernels::GemvInt8PathSupported(kernels::DefaultGemvInt8Path(), &missing)) {
      return absl::FailedPreconditionError(absl::StrCat("weight_dtype int8: ", missing));
    }
    layer_options.form = ProjectionForm::kInt8;
    const kernels::GemmPath gemm = kernels::DefaultGemmPath();
    d->int8_gemm_ = options.int8_prefill_gemm && gemm != kernels::GemmPath::kTorch;
    matmul_note = absl::StrCat(
        "int8 projections (decode rows gemv_int8/",
        kernels::GemvInt8PathName(kernels::DefaultGemvInt8Path()), ", prefill rows ",
        d->int8_gemm_ ? absl::StrCat("gemm_int8/", kernels::GemmPathName(gemm))
                      : std::string("gemv_int8"),
        ")");
  } else if (options.matmul != MatmulPath::kTorch) {
    const kernels::GemmPath gemm = kernels::DefaultGemmPath();
    const bool blocked = gemm != kernels::GemmPath::kTorch;
    if (options.matmul == MatmulPath::kKernels && dtype != at::kBFloat16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "matmul kernels computes in bf16 but compute is ", ComputeDTypeName(d->compute_dtype_),
          warning.empty() ? "" : absl::StrCat(" (", warning, ")"),
          "; float32 runs on at::linear (matmul torch or auto)"));
    }
    if (options.matmul == MatmulPath::kKernels && !blocked) {
      std::string missing;
      kernels::GemmPathSupported(kernels::GemmPath::kAvx512Bf16, &missing);
      return absl::FailedPreconditionError(absl::StrCat(
          "matmul kernels needs the packed GEMM (avx512bf16 or amx); the GEMM path is torch",
          missing.empty() ? "" : absl::StrCat(": ", missing)));
    }
    if (dtype == at::kBFloat16 && blocked) {
      layer_options.form = ProjectionForm::kPacked;
      matmul_note = absl::StrCat("packed projections (gemm/", kernels::GemmPathName(gemm), ")");
    }
  }
  if (matmul_note.empty()) matmul_note = "dense projections (at::linear)";
  absl::StatusOr<std::unique_ptr<LayerStore>> store =
      LayerStore::Create(checkpoint, c, *prefix, dtype, layer_options);
  if (!store.ok()) return store.status();
  d->layers_ = *std::move(store);

  d->use_gemv_ = options.use_gemv && dtype == at::kBFloat16;

  // The LM head: int8 with int8 layers (int8_lm_head), else on the packed
  // GEMM with the layers (packed or int8 forms). Either way lookups read
  // single embedding rows from the mapping from now on; the head's dense
  // pages are no longer needed in memory.
  std::string head_note =
      d->use_gemv_ ? absl::StrCat("gemv/", GemvPathName(DefaultGemvPath())) : "at::linear";
  const bool int8_head = layer_options.form == ProjectionForm::kInt8 && options.int8_lm_head;
  if (int8_head || (options.packed_head && layer_options.form != ProjectionForm::kDense &&
                    kernels::DefaultGemmPath() != kernels::GemmPath::kTorch)) {
    try {
      uint64_t head_bytes = 0;
      if (int8_head) {
        absl::StatusOr<kernels::QuantizedWeight> head = kernels::QuantizeInt8(d->lm_head_);
        if (!head.ok()) return head.status();
        d->lm_head8_ = *std::move(head);
        head_bytes = d->lm_head8_.bytes();
        head_note = absl::StrCat("int8 (gemv_int8/",
                                 kernels::GemvInt8PathName(kernels::DefaultGemvInt8Path()), ")");
      } else {
        absl::StatusOr<kernels::PackedWeight> head = kernels::PackedWeight::Pack(d->lm_head_);
        if (!head.ok()) return head.status();
        d->packed_head_ = *std::move(head);
        head_bytes = d->packed_head_.bytes();
        head_note = absl::StrCat("gemm/", kernels::GemmPathName(d->packed_head_.path()));
      }
      if (d->tied_) {
        d->embedding_bytes_ += head_bytes;
        (void)ckpt.Evict(embed_source);  // view or converted: drops the mapped pages
      } else {
        d->embedding_bytes_ += head_bytes - d->lm_head_.nbytes();
        (void)ckpt.Evict(head_name);
        d->lm_head_ = at::Tensor();
      }
      WeightBytesResidentGauge("embedding").Set(static_cast<double>(d->embedding_bytes_));
    } catch (const c10::Error& e) {
      return Internal("LM head packing", e);
    }
  }
  d->load_summary_ = absl::StrCat(
      "decoder: ", c.num_hidden_layers, " layers, compute ", ComputeDTypeName(d->compute_dtype_),
      ", layers ",
      layer_options.form != ProjectionForm::kDense
          ? "converted on materialization (dense projection pages released)"
          : d->layers_->in_place() ? "in place (zero copy)" : "converted on materialization",
      ", ", tie_rule, ", ", matmul_note,
      layer_options.form == ProjectionForm::kDense
          ? absl::StrCat(", decode projections ",
                         d->use_gemv_ ? absl::StrCat("gemv/", GemvPathName(DefaultGemvPath()))
                                      : "at::linear")
          : "",
      ", LM head ", head_note,
      options.layers.eager_load ? ", eager" : ", lazy",
      options.layers.resident_layers > 0
          ? absl::StrCat(", at most ", options.layers.resident_layers, " layers resident")
          : "");
  if (!warning.empty()) absl::StrAppend(&d->load_summary_, " (", warning, ")");
  return d;
}

uint64_t Decoder::decode_weight_bytes() const {
  const uint64_t head = !lm_head8_.empty()     ? lm_head8_.bytes()
                        : !packed_head_.empty() ? packed_head_.bytes()
                                                : lm_head_.nbytes();
  return layers_->total_bytes() + head + final_norm_.nbytes();
}

absl::StatusOr<std::unique_ptr<Sequence>> Decoder::NewSequence(int64_t capacity) const {
  if (capacity < 1 || capacity > max_context()) {
    return absl::InvalidArgumentError(absl::StrCat("sequence capacity ", capacity,
                                                   " must be in 1..", max_context(),
                                                   " (max_position_embeddings)"));
  }
  const TextConfig& c = config_.text;
  std::unique_ptr<Sequence> seq(new Sequence());
  seq->capacity_ = capacity;
  try {
    const auto opts = at::TensorOptions().dtype(ToScalarType(compute_dtype_));
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      seq->k_cache_.push_back(at::empty({c.num_key_value_heads, capacity, c.head_dim}, opts));
      seq->v_cache_.push_back(at::empty({c.num_key_value_heads, capacity, c.head_dim}, opts));
    }
  } catch (const c10::Error& e) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache for ", capacity, " tokens: ",
                                                     e.what_without_backtrace()));
  }
  return seq;
}

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------

at::Tensor Decoder::Embed(absl::Span<const int32_t> ids) const {
  at::Tensor index = at::empty({static_cast<int64_t>(ids.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(ids.begin(), ids.end(), index.data_ptr<int64_t>());
  return at::index_select(embed_tokens_, 0, index);  // [S, hidden]
}

at::Tensor Decoder::RunLayers(Sequence& seq, at::Tensor x, const Pass& pass) const {
  const TextConfig& c = config_.text;
  const int64_t s = x.size(0), hq = c.num_attention_heads, hkv = c.num_key_value_heads,
                d = c.head_dim;
  const double eps = c.rms_norm_eps, scale = 1.0 / std::sqrt(static_cast<double>(d));
  const int64_t end = pass.start + s;  // keys visible to the last token
  const bool gemv = pass.decode && use_gemv_;

  for (int l = 0; l < layers_->num_layers(); ++l) {
    absl::StatusOr<LayerStore::Handle> handle = layers_->Acquire(l);
    TORCH_CHECK(handle.ok(), "layer ", l, ": ", handle.status().ToString());
    const DecoderLayerWeights& w = **handle;

    // --- self-attention --------------------------------------------------
    // x: [S, hidden]
    at::Tensor h = nn::RmsNorm(x, w.input_layernorm, eps);
    at::Tensor q, k, v;  // [S, heads·D], [S, kv_heads·D] x2
    const bool dense = projection_form() == ProjectionForm::kDense;
    const int64_t np = pass.decode ? 0 : s, nd = pass.decode ? s : 0;
    if (!dense) {
      ProjectQkv(np, nd, w, h, &q, &k, &v);
    } else if (gemv) {
      at::Tensor* ys[] = {&q, &k, &v};
      const at::Tensor ws[] = {w.q_proj, w.k_proj, w.v_proj};
      Check(GemvMulti(h, ws, ys));
    } else {
      q = nn::Linear(h, w.q_proj);
      k = nn::Linear(h, w.k_proj);
      v = nn::Linear(h, w.v_proj);
    }
    q = nn::RmsNorm(q.view({s, hq, d}), w.q_norm, eps);  // per head, before RoPE
    k = nn::RmsNorm(k.view({s, hkv, d}), w.k_norm, eps);
    q = nn::ApplyRotary(q, pass.cos, pass.sin);  // [S, heads, D]
    k = nn::ApplyRotary(k, pass.cos, pass.sin);  // [S, kv_heads, D]
    // Cache: [kv_heads, capacity, D]; this pass's keys at start..end-1.
    at::Tensor& k_cache = seq.k_cache_[l];
    at::Tensor& v_cache = seq.v_cache_[l];
    k_cache.narrow(1, pass.start, s).copy_(k.transpose(0, 1));
    v_cache.narrow(1, pass.start, s).copy_(v.view({s, hkv, d}).transpose(0, 1));
    at::Tensor o;  // [S, heads·D]
    if (s == 1) {
      // One query per head over the cache in place (decode_attention.h).
      o = DecodeAttention(q.view({hq, d}), k_cache, v_cache, end, scale).view({1, hq * d});
    } else {
      nn::AttentionOptions ao;
      ao.scale = scale;
      ao.causal = true;
      ao.q_offset = pass.start;
      if (options_.attention_query_tile > 0) ao.query_tile = options_.attention_query_tile;
      o = nn::AttentionHeadMajor(q.transpose(0, 1), k_cache.narrow(1, 0, end),
                                 v_cache.narrow(1, 0, end), ao)  // [heads, S, D]
              .transpose(0, 1)
              .reshape({s, hq * d});
    }
    if (!dense) {
      o = o.contiguous();
      AddAttentionOut(np, nd, w, o, x);
      at::Tensor n = nn::RmsNorm(x, w.post_attention_layernorm, eps);
      AddMlp(np, nd, w, n, x);
      if (l < static_cast<int>(pass.deepstack.size()) && pass.visual.numel() > 0) {
        x.index_put_({pass.visual}, x.index({pass.visual}) + pass.deepstack[l]);
      }
      continue;
    }
    at::Tensor attn_out;
    if (gemv) {
      Check(Gemv(o, w.o_proj, &attn_out));
    } else {
      attn_out = nn::Linear(o, w.o_proj);
    }
    x = x + attn_out;

    // --- MLP ----------------------------------------------------------------
    at::Tensor n = nn::RmsNorm(x, w.post_attention_layernorm, eps);
    at::Tensor mlp;
    if (gemv) {
      at::Tensor gate, up;
      at::Tensor* ys[] = {&gate, &up};
      const at::Tensor ws[] = {w.gate_proj, w.up_proj};
      Check(GemvMulti(n, ws, ys));
      Check(Gemv(at::silu(gate).mul_(up), w.down_proj, &mlp));
    } else {
      mlp = nn::SwiGlu(n, w.gate_proj, w.up_proj, w.down_proj);
    }
    x = x + mlp;

    // --- deepstack (§5.3): after layer l, at the image positions ------------
    if (l < static_cast<int>(pass.deepstack.size()) && pass.visual.numel() > 0) {
      x.index_put_({pass.visual}, x.index({pass.visual}) + pass.deepstack[l]);
    }
  }
  return x;
}

at::Tensor Decoder::Head(const at::Tensor& hidden) const {
  // hidden: [R, hidden] (after the final norm) -> [R, vocab] float32
  if (!lm_head8_.empty()) return Int8Rows(hidden, lm_head8_, at::kFloat);
  if (!packed_head_.empty()) {
    kernels::GemmOptions options;
    options.out_dtype = at::kFloat;
    absl::StatusOr<at::Tensor> logits = kernels::Gemm(hidden, packed_head_, options);
    Check(logits.status());
    return *std::move(logits);
  }
  if (use_gemv_) {
    const int64_t r = hidden.size(0);
    at::Tensor logits = at::empty({r, vocab_size()}, at::TensorOptions().dtype(at::kFloat));
    for (int64_t i = 0; i < r; i += kGemvRows) {
      const int64_t rows = std::min(kGemvRows, r - i);
      at::Tensor y = logits.narrow(0, i, rows);
      Check(Gemv(hidden.narrow(0, i, rows), lm_head_, &y));
    }
    return logits;
  }
  return nn::Linear(hidden, lm_head_).to(at::kFloat);
}

absl::StatusOr<at::Tensor> Decoder::Prefill(Sequence& seq, const PrefillInput& in) const {
  const TextConfig& c = config_.text;
  const int64_t s = static_cast<int64_t>(in.token_ids.size());
  const int32_t image_pad = static_cast<int32_t>(config_.image_token_id);
  const int32_t video_pad = static_cast<int32_t>(config_.video_token_id);
  if (s == 0) return absl::InvalidArgumentError("prompt: no tokens");
  if (s > seq.capacity() - seq.length()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt: ", s, " tokens do not fit the context: the sequence holds ", seq.capacity(),
        " tokens", seq.length() > 0 ? absl::StrCat(" and has ", seq.length(), " already") : ""));
  }
  std::vector<int64_t> pad_rows;  // prompt indices of the image pads
  for (int64_t i = 0; i < s; ++i) {
    const int32_t id = in.token_ids[i];
    if (id < 0 || id >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt: token ", i, " has id ", id,
                                                     ", outside the vocabulary 0..",
                                                     c.vocab_size - 1));
    }
    if (id == video_pad) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt: token ", i, " is <|video_pad|>: video input is not supported"));
    }
    if (id == image_pad) pad_rows.push_back(i);
  }
  const int64_t p = static_cast<int64_t>(pad_rows.size());
  auto check_rows = [&](const at::Tensor& t, const std::string& what) -> absl::Status {
    if (!t.defined() || t.dim() != 2 || t.size(0) != p || t.size(1) != c.hidden_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": shape [", t.defined() ? absl::StrJoin(t.sizes().vec(), ", ") : "undefined",
          "], the prompt's ", p, " image pad tokens need [", p, ", ", c.hidden_size, "]"));
    }
    if (t.scalar_type() != at::kBFloat16 && t.scalar_type() != at::kFloat) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": dtype ",
                                                     c10::toString(t.scalar_type()),
                                                     ", expected bfloat16 or float32"));
    }
    return absl::OkStatus();
  };
  const size_t levels = config_.vision.deepstack_visual_indexes.size();
  if (p > 0 || in.image_embeds.defined()) {
    absl::Status st = check_rows(in.image_embeds, "image_embeds");
    if (!st.ok()) return st;
    if (in.deepstack.size() != levels) {
      return absl::InvalidArgumentError(absl::StrCat("deepstack: ", in.deepstack.size(),
                                                     " tensors, the model injects ", levels));
    }
    for (size_t j = 0; j < in.deepstack.size(); ++j) {
      st = check_rows(in.deepstack[j], absl::StrCat("deepstack ", j));
      if (!st.ok()) return st;
    }
    if (p > 0 && in.positions == nullptr) {
      return absl::InvalidArgumentError(
          "positions: a prompt with image tokens needs MRoPE positions (GetRopeIndex)");
    }
  } else if (!in.deepstack.empty()) {
    return absl::InvalidArgumentError("deepstack: given for a prompt without image tokens");
  }
  if (in.positions != nullptr && in.positions->size() != s) {
    return absl::InvalidArgumentError(absl::StrCat("positions: ", in.positions->size(),
                                                   " entries for ", s, " prompt tokens"));
  }

  const int64_t start_length = seq.length_, start_delta = seq.rope_delta_;
  try {
    const at::ScalarType dtype = ToScalarType(compute_dtype_);
    at::Tensor positions;  // [3, S]
    if (in.positions != nullptr) {
      positions = in.positions->ToTensor();
    } else {
      positions = at::arange(start_length + start_delta, start_length + start_delta + s,
                             at::TensorOptions().dtype(at::kLong))
                      .unsqueeze(0)
                      .expand({3, s});
    }
    at::Tensor image_embeds = p > 0 ? in.image_embeds.to(dtype) : at::Tensor();
    std::vector<at::Tensor> deepstack;
    if (p > 0) {
      for (const at::Tensor& t : in.deepstack) deepstack.push_back(t.to(dtype));
    }
    const int64_t chunk = options_.prefill_chunk_tokens > 0 ? options_.prefill_chunk_tokens : s;
    std::vector<at::Tensor> logits;  // per chunk when all_logits
    at::Tensor last;
    size_t pad_cursor = 0;  // first pad not yet consumed
    for (int64_t c0 = 0; c0 < s; c0 += chunk) {
      const int64_t n = std::min(chunk, s - c0);
      // Image pads of this chunk: local rows and the matching embedding rows.
      const size_t pad_begin = pad_cursor;
      while (pad_cursor < pad_rows.size() && pad_rows[pad_cursor] < c0 + n) ++pad_cursor;
      const int64_t v = static_cast<int64_t>(pad_cursor - pad_begin);
      Pass pass;
      pass.start = seq.length_;
      std::tie(pass.cos, pass.sin) = rotary_->CosSin(positions.narrow(1, c0, n));
      pass.visual = at::empty({v}, at::TensorOptions().dtype(at::kLong));
      for (int64_t i = 0; i < v; ++i) pass.visual.data_ptr<int64_t>()[i] = pad_rows[pad_begin + i] - c0;

      // §5.1: x = embed_tokens[ids]; the k-th image pad gets image_embeds row k.
      at::Tensor x = Embed(in.token_ids.subspan(c0, n));  // [n, hidden]
      if (v > 0) {
        x.index_put_({pass.visual}, image_embeds.narrow(0, pad_begin, v));
        for (const at::Tensor& t : deepstack) pass.deepstack.push_back(t.narrow(0, pad_begin, v));
      }
      x = RunLayers(seq, std::move(x), pass);
      seq.length_ += n;
      if (in.all_logits) {
        logits.push_back(Head(nn::RmsNorm(x, final_norm_, c.rms_norm_eps)));
      } else if (c0 + n == s) {
        last = Head(nn::RmsNorm(x.narrow(0, n - 1, 1), final_norm_, c.rms_norm_eps))[0];
      }
    }
    if (in.positions != nullptr) seq.rope_delta_ = in.positions->rope_delta;
    return in.all_logits ? at::cat(logits, 0) : last;
  } catch (const c10::Error& e) {
    seq.length_ = start_length;
    seq.rope_delta_ = start_delta;
    return Internal("prefill", e);
  }
}

absl::StatusOr<at::Tensor> Decoder::DecodeStep(Sequence& seq, int32_t token_id) const {
  if (token_id < 0 || token_id >= vocab_size()) {
    return absl::InvalidArgumentError(absl::StrCat("token id ", token_id,
                                                   " outside the vocabulary 0..", vocab_size() - 1));
  }
  if (seq.length_ >= seq.capacity_) {
    return absl::OutOfRangeError(absl::StrCat("sequence is full: ", seq.capacity_, " tokens"));
  }
  try {
    Pass pass;
    pass.start = seq.length_;
    pass.decode = true;
    std::tie(pass.cos, pass.sin) = rotary_->CosSinText(seq.length_ + seq.rope_delta_, 1);
    pass.visual = at::empty({0}, at::TensorOptions().dtype(at::kLong));
    const int32_t ids[] = {token_id};
    at::Tensor x = RunLayers(seq, Embed(ids), pass);  // [1, hidden]
    seq.length_ += 1;
    return Head(nn::RmsNorm(x, final_norm_, config_.text.rms_norm_eps))[0];
  } catch (const c10::Error& e) {
    return Internal("decode step", e);
  }
}

// ---------------------------------------------------------------------------
// Paged, batched forward
// ---------------------------------------------------------------------------
//
// Rows of a pass: the prefill chunks' tokens (in chunk order), then the decode
// chunks' tokens. Every step is row-invariant: row ops from row_ops.h,
// projections by row kind (prefill rows: one padded at::linear over all of
// them; decode rows: Gemv, or the padded at::linear without Gemv), attention
// through PagedAttention (fixed block order per query). So a chunk's result
// depends only on its own rows and the KV it reads.

uint64_t KvStorage::bytes() const {
  uint64_t total = 0;
  for (const at::Tensor& t : k) total += t.nbytes();
  for (const at::Tensor& t : v) total += t.nbytes();
  return total;
}

uint64_t Decoder::kv_bytes_per_token() const {
  const TextConfig& c = config_.text;
  const uint64_t elem = compute_dtype_ == ComputeDType::kBFloat16 ? 2 : 4;
  return 2ull * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * elem;
}

absl::StatusOr<KvStorage> Decoder::NewKvStorage(int64_t num_blocks, int64_t block_size) const {
  if (num_blocks < 1 || block_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("KV storage: num_blocks ", num_blocks,
                                                   " and block_size ", block_size,
                                                   " must be >= 1"));
  }
  const TextConfig& c = config_.text;
  KvStorage kv;
  kv.num_blocks = num_blocks;
  kv.block_size = block_size;
  const auto failed = [&](const std::string& why) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV storage of ", num_blocks, " blocks x ", block_size, " tokens (",
        static_cast<uint64_t>(num_blocks) * block_size * kv_bytes_per_token(), " bytes): ", why));
  };
  // Anonymous private mappings instead of zero-filled tensors: the kernel
  // commits a page at its first write and reads an untouched page as zeros,
  // so the budget costs memory only as blocks come into use (the block pool
  // hands out low ids first and reuses released blocks before new ones);
  // MAP_NORESERVE reserves no swap for the untouched rest. Slots of a block
  // past a sequence's length may hold zeros or an earlier owner's K/V, as
  // before: attention reads only keys below each query's index (lanes past
  // them are computed and discarded, never summed).
  const at::ScalarType dtype = ToScalarType(compute_dtype_);
  const auto opts = at::TensorOptions().dtype(dtype);
  const auto lazy = [&](std::vector<int64_t> shape) -> absl::StatusOr<at::Tensor> {
    size_t bytes = c10::elementSize(dtype);
    for (int64_t n : shape) bytes *= static_cast<size_t>(n);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return failed(absl::StrCat("mmap: ", std::strerror(errno)));
    return at::from_blob(p, shape, [bytes](void* q) { munmap(q, bytes); }, opts);
  };
  try {
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      absl::StatusOr<at::Tensor> k =
          lazy({num_blocks, c.num_key_value_heads, c.head_dim, block_size});
      if (!k.ok()) return k.status();
      kv.k.push_back(*std::move(k));
      absl::StatusOr<at::Tensor> v =
          lazy({num_blocks, c.num_key_value_heads, block_size, c.head_dim});
      if (!v.ok()) return v.status();
      kv.v.push_back(*std::move(v));
    }
  } catch (const c10::Error& e) {
    return failed(e.what_without_backtrace());
  }
  return kv;
}

// Everything one pass needs besides the hidden states and weights.
struct Decoder::Batch {
  int64_t prefill_rows = 0, decode_rows = 0;
  int64_t rows() const { return prefill_rows + decode_rows; }
  std::vector<int64_t> ids;          // [R] token ids (int64 for index_select)
  std::vector<int64_t> cache_index;  // [R]
  std::vector<const int32_t*> table;  // [R] the row's block table
  at::Tensor cos, sin;               // [R, head_dim] float32
  std::vector<PagedQueryRun> runs;   // one per chunk
  at::Tensor image_rows;             // [V] int64 batch rows holding image pads
  at::Tensor image_embeds;           // [V, hidden] compute dtype
  std::vector<at::Tensor> deepstack; // per level [V, hidden] compute dtype
  at::Tensor logit_rows;             // [L] int64, in chunk order
};

namespace {

// Row i of k ([R, Hkv, D], E-byte elements) into slot cache_index[i] % bs of
// its block in the key cache [blocks, Hkv, D, bs]: element c at stride bs.
template <typename E>
void ScatterKeys(const at::Tensor& k, const at::Tensor& cache,
                 const std::vector<int64_t>& cache_index,
                 const std::vector<const int32_t*>& table, int64_t bs) {
  const int64_t r = k.size(0), hkv = k.size(1), d = k.size(2);
  const E* src = static_cast<const E*>(k.data_ptr());
  E* dst = static_cast<E*>(cache.data_ptr());
  for (int64_t i = 0; i < r; ++i) {
    const int64_t p = cache_index[i];
    const int64_t block = table[i][p / bs];
    for (int64_t g = 0; g < hkv; ++g) {
      const E* from = src + (i * hkv + g) * d;
      E* to = dst + (block * hkv + g) * d * bs + p % bs;
      for (int64_t c = 0; c < d; ++c) to[c * bs] = from[c];
    }
  }
}

}  // namespace

absl::Status Decoder::ValidateChunks(const KvStorage& kv,
                                     absl::Span<const SequenceChunk> chunks) const {
  const TextConfig& c = config_.text;
  const at::ScalarType dtype = ToScalarType(compute_dtype_);
  const int64_t layers = c.num_hidden_layers;
  if (kv.block_size < 1 || kv.num_blocks < 1 || static_cast<int64_t>(kv.k.size()) != layers ||
      static_cast<int64_t>(kv.v.size()) != layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV storage: ", kv.k.size(), "/", kv.v.size(), " K/V tensors for ", layers,
        " layers, block_size ", kv.block_size, ", num_blocks ", kv.num_blocks,
        " (use Decoder::NewKvStorage)"));
  }
  const std::vector<int64_t> v_shape = {kv.num_blocks, c.num_key_value_heads, kv.block_size,
                                        c.head_dim};
  const std::vector<int64_t> k_shape = {kv.num_blocks, c.num_key_value_heads, c.head_dim,
                                        kv.block_size};
  for (int64_t l = 0; l < layers; ++l) {
    for (const at::Tensor* t : {&kv.k[l], &kv.v[l]}) {
      const std::vector<int64_t>& shape = t == &kv.k[l] ? k_shape : v_shape;
      if (!t->defined() || t->sizes().vec() != shape || t->scalar_type() != dtype ||
          !t->is_contiguous()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "KV storage: layer ", l, " ", t == &kv.k[l] ? "K" : "V", " must be a contiguous [",
            absl::StrJoin(shape, ", "), "] ", c10::toString(dtype),
            " tensor (use Decoder::NewKvStorage)"));
      }
    }
  }
  const int32_t image_pad = static_cast<int32_t>(config_.image_token_id);
  const int32_t video_pad = static_cast<int32_t>(config_.video_token_id);
  const size_t levels = config_.vision.deepstack_visual_indexes.size();
  const int64_t bs = kv.block_size;
  // Blocks each chunk writes (its table entries from start / bs on): no two
  // chunks may touch them.
  std::vector<int> writer(kv.num_blocks, -1);
  for (size_t i = 0; i < chunks.size(); ++i) {
    const SequenceChunk& ch = chunks[i];
    const std::string name = absl::StrCat("chunk ", i, ": ");
    const int64_t n = static_cast<int64_t>(ch.token_ids.size());
    if (n == 0) return absl::InvalidArgumentError(absl::StrCat(name, "token_ids is empty"));
    if (ch.decode && n != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "token_ids has ", n, " tokens; a decode chunk has exactly 1"));
    }
    if (ch.start < 0 || ch.start + n > max_context()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, "start ", ch.start, " + ", n, " tokens is outside the context 0..",
          max_context(), " (max_position_embeddings)"));
    }
    int64_t pads = 0;
    for (int64_t t = 0; t < n; ++t) {
      const int32_t id = ch.token_ids[t];
      if (id < 0 || id >= c.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(name, "token_ids[", t, "] = ", id,
                                                       " is outside the vocabulary 0..",
                                                       c.vocab_size - 1));
      }
      if (id == video_pad) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, "token_ids[", t, "] is <|video_pad|>: video input is not supported"));
      }
      // A decode token is embedded as is, as DecodeStep does (a generated
      // image pad takes no image row).
      pads += id == image_pad && !ch.decode;
    }
    const int64_t needed = (ch.start + n + bs - 1) / bs;
    if (static_cast<int64_t>(ch.block_table.size()) < needed) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, "block_table has ", ch.block_table.size(), " entries; cache indices [0, ",
          ch.start + n, ") need ", needed, " blocks of ", bs));
    }
    for (int64_t b = 0; b < needed; ++b) {
      const int32_t id = ch.block_table[b];
      if (id < 0 || id >= kv.num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat(name, "block_table[", b, "] = ", id,
                                                       " is outside the KV storage's blocks 0..",
                                                       kv.num_blocks - 1));
      }
    }
    for (int64_t b = ch.start / bs; b < needed; ++b) {
      int& w = writer[ch.block_table[b]];
      if (w >= 0 && w != static_cast<int>(i)) {
        return absl::InvalidArgumentError(absl::StrCat(name, "block_table[", b, "] = ",
                                                       ch.block_table[b],
                                                       " is also written by chunk ", w));
      }
      w = static_cast<int>(i);
    }
    const at::Tensor& pos = ch.positions;
    if (!pos.defined() || pos.dim() != 2 || pos.size(0) != 3 || pos.size(1) != n ||
        (pos.scalar_type() != at::kLong && pos.scalar_type() != at::kInt)) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, "positions must be a [3, ", n, "] int64 tensor, got ",
          pos.defined() ? absl::StrCat("[", absl::StrJoin(pos.sizes().vec(), ", "), "] ",
                                       c10::toString(pos.scalar_type()))
                        : "undefined"));
    }
    auto check_rows = [&](const at::Tensor& t, const std::string& what) -> absl::Status {
      if (pads == 0 && (!t.defined() || (t.dim() == 2 && t.size(0) == 0))) {
        return absl::OkStatus();
      }
      if (!t.defined() || t.dim() != 2 || t.size(0) != pads || t.size(1) != c.hidden_size ||
          (t.scalar_type() != at::kBFloat16 && t.scalar_type() != at::kFloat)) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, what, " must be [", pads, ", ", c.hidden_size,
            "] bf16 or f32 (one row per image pad token of the chunk), got ",
            t.defined() ? absl::StrCat("[", absl::StrJoin(t.sizes().vec(), ", "), "] ",
                                       c10::toString(t.scalar_type()))
                        : "undefined"));
      }
      return absl::OkStatus();
    };
    if (absl::Status s = check_rows(ch.image_embeds, "image_embeds"); !s.ok()) return s;
    if (pads > 0 && ch.deepstack.size() != levels) {
      return absl::InvalidArgumentError(absl::StrCat(name, "deepstack has ", ch.deepstack.size(),
                                                     " tensors; the model injects ", levels,
                                                     " levels"));
    }
    if (ch.deepstack.size() > levels) {
      return absl::InvalidArgumentError(absl::StrCat(name, "deepstack has ", ch.deepstack.size(),
                                                     " tensors; the model injects ", levels));
    }
    for (size_t j = 0; j < ch.deepstack.size(); ++j) {
      if (absl::Status s = check_rows(ch.deepstack[j], absl::StrCat("deepstack[", j, "]"));
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

// ys[i] = h·ws[i]ᵀ for all rows of the pass, by row kind (never mixing them).
std::vector<at::Tensor> Decoder::Project(int64_t np, int64_t nd, const at::Tensor& h,
                                         std::initializer_list<at::Tensor> weights) const {
  const std::vector<at::Tensor> ws(weights);
  std::vector<at::Tensor> ys;
  if (nd == 0) {
    for (const at::Tensor& w : ws) ys.push_back(RowLinear(h, w));
    return ys;
  }
  for (const at::Tensor& w : ws) ys.push_back(at::empty({np + nd, w.size(0)}, h.options()));
  if (np > 0) {
    const at::Tensor hp = h.narrow(0, 0, np);
    for (size_t i = 0; i < ws.size(); ++i) ys[i].narrow(0, 0, np).copy_(RowLinear(hp, ws[i]));
  }
  if (use_gemv_) {
    for (int64_t r0 = np; r0 < np + nd; r0 += kGemvRows) {
      const int64_t rows = std::min(kGemvRows, np + nd - r0);
      std::vector<at::Tensor> outs;
      for (const at::Tensor& y : ys) outs.push_back(y.narrow(0, r0, rows));
      std::vector<at::Tensor*> ptrs;
      for (at::Tensor& y : outs) ptrs.push_back(&y);
      Check(GemvMulti(h.narrow(0, r0, rows), ws, ptrs));
    }
  } else {
    const at::Tensor hd = h.narrow(0, np, nd);
    for (size_t i = 0; i < ws.size(); ++i) ys[i].narrow(0, np, nd).copy_(RowLinear(hd, ws[i]));
  }
  return ys;
}

// Int8 weights: prefill rows [0, np) through GemmInt8 when int8_gemm_
// (multiply-bound: the bf16 micro-kernel on panels converted per call),
// decode rows [np, np + nd) through GemvInt8 (bandwidth-bound: int8 bytes).
// A row's kernel depends only on its kind, never on the batch it is in.
at::Tensor Decoder::Int8Project(int64_t np, int64_t nd, const at::Tensor& h,
                                const kernels::QuantizedWeight& w) const {
  const int64_t gemm_rows = Int8GemmRows(np);
  if (gemm_rows == 0) return Int8Rows(h, w);
  at::Tensor y = at::empty({np + nd, w.n()}, h.options());
  at::Tensor yp = y.narrow(0, 0, gemm_rows);
  Check(kernels::GemmInt8(h.narrow(0, 0, gemm_rows), w, &yp));
  if (nd > 0) {
    at::Tensor yd = y.narrow(0, gemm_rows, nd);
    Check(kernels::GemvInt8(h.narrow(0, gemm_rows, nd), w, &yd));
  }
  return y;
}

// x += h·wᵀ by row kind as Int8Project; the GEMM rows add in its epilogue
// (x = round(x + f32 sum), in place), the GEMV rows round the product first.
void Decoder::Int8AddInPlace(int64_t np, int64_t nd, const at::Tensor& h,
                             const kernels::QuantizedWeight& w, at::Tensor& x) const {
  const int64_t gemm_rows = Int8GemmRows(np);
  if (gemm_rows > 0) {
    at::Tensor xp = x.narrow(0, 0, gemm_rows);
    kernels::GemmOptions go;
    go.residual = xp;
    Check(kernels::GemmInt8(h.narrow(0, 0, gemm_rows), w, &xp, go));
  }
  if (gemm_rows < np + nd) {
    const int64_t rows = np + nd - gemm_rows;
    RowAddInPlace(x.narrow(0, gemm_rows, rows), Int8Rows(h.narrow(0, gemm_rows, rows), w));
  }
}

void Decoder::ProjectQkv(int64_t np, int64_t nd, const DecoderLayerWeights& w,
                         const at::Tensor& h, at::Tensor* q, at::Tensor* k, at::Tensor* v) const {
  const TextConfig& c = config_.text;
  const int64_t nq = c.num_attention_heads * c.head_dim, nkv = c.num_key_value_heads * c.head_dim;
  at::Tensor y;  // [R, nq + 2·nkv]
  switch (projection_form()) {
    case ProjectionForm::kDense: {
      std::vector<at::Tensor> ys = Project(np, nd, h, {w.q_proj, w.k_proj, w.v_proj});
      *q = ys[0].contiguous();
      *k = ys[1].contiguous();
      *v = ys[2].contiguous();
      return;
    }
    case ProjectionForm::kPacked: {
      // Prefill and decode rows in one call: Gemm's rows are invariant.
      absl::StatusOr<at::Tensor> r = kernels::Gemm(h, w.qkv);
      Check(r.status());
      y = *std::move(r);
      break;
    }
    case ProjectionForm::kInt8:
      y = Int8Project(np, nd, h, w.qkv8);
      break;
  }
  *q = y.narrow(1, 0, nq).contiguous();
  *k = y.narrow(1, nq, nkv).contiguous();
  *v = y.narrow(1, nq + nkv, nkv).contiguous();
}

void Decoder::AddAttentionOut(int64_t np, int64_t nd, const DecoderLayerWeights& w,
                              const at::Tensor& o, at::Tensor& x) const {
  switch (projection_form()) {
    case ProjectionForm::kDense:
      RowAddInPlace(x, Project(np, nd, o, {w.o_proj})[0]);
      return;
    case ProjectionForm::kPacked: {
      // Residual-add epilogue: x = round(x + o·Woᵀ), in place.
      kernels::GemmOptions go;
      go.residual = x;
      Check(kernels::Gemm(o, w.o, &x, go));
      return;
    }
    case ProjectionForm::kInt8:
      Int8AddInPlace(np, nd, o, w.o8, x);
      return;
  }
}

void Decoder::AddMlp(int64_t np, int64_t nd, const DecoderLayerWeights& w, const at::Tensor& n,
                     at::Tensor& x) const {
  switch (projection_form()) {
    case ProjectionForm::kDense: {
      std::vector<at::Tensor> gate_up = Project(np, nd, n, {w.gate_proj, w.up_proj});
      RowAddInPlace(x, Project(np, nd, RowSiluMul(gate_up[0], gate_up[1]), {w.down_proj})[0]);
      return;
    }
    case ProjectionForm::kPacked: {
      kernels::GemmOptions act;
      act.activation = kernels::Activation::kSiluMul;
      absl::StatusOr<at::Tensor> a = kernels::Gemm(n, w.gate_up, act);  // [R, intermediate]
      Check(a.status());
      kernels::GemmOptions go;
      go.residual = x;
      Check(kernels::Gemm(*a, w.down, &x, go));
      return;
    }
    case ProjectionForm::kInt8: {
      const int64_t inter = config_.text.intermediate_size;
      const int64_t gemm_rows = Int8GemmRows(np);
      // silu(gate)·up of the GEMV rows [gemm_rows, R), from their [rows, 2·intermediate].
      auto gemv_silu_mul = [&](int64_t rows) {
        const at::Tensor gu = Int8Rows(n.narrow(0, gemm_rows, rows), w.gate_up8);
        return RowSiluMul(gu.narrow(1, 0, inter).contiguous(),
                          gu.narrow(1, inter, inter).contiguous());
      };
      at::Tensor a;  // silu(gate)·up [R, intermediate]
      if (gemm_rows == 0) {
        a = gemv_silu_mul(np + nd);  // decode-only passes: no extra buffer or copy
      } else {
        a = at::empty({np + nd, inter}, n.options());
        at::Tensor ap = a.narrow(0, 0, gemm_rows);
        kernels::GemmOptions act;
        act.activation = kernels::Activation::kSiluMul;
        Check(kernels::GemmInt8(n.narrow(0, 0, gemm_rows), w.gate_up8, &ap, act));
        if (nd > 0) a.narrow(0, gemm_rows, nd).copy_(gemv_silu_mul(nd));
      }
      Int8AddInPlace(np, nd, a, w.down8, x);
      return;
    }
  }
}

absl::StatusOr<at::Tensor> Decoder::Forward(KvStorage& kv,
                                            absl::Span<const SequenceChunk> chunks) const {
  if (absl::Status s = ValidateChunks(kv, chunks); !s.ok()) return s;
  if (chunks.empty()) return at::Tensor();
  const TextConfig& c = config_.text;
  const int64_t hq = c.num_attention_heads, hkv = c.num_key_value_heads, d = c.head_dim;
  const double eps = c.rms_norm_eps;
  const int64_t bs = kv.block_size;
  try {
    const at::ScalarType dtype = ToScalarType(compute_dtype_);
    const auto long_opts = at::TensorOptions().dtype(at::kLong);
    // --- the pass's rows: prefill chunks, then decode chunks ------------------
    Batch b;
    std::vector<size_t> order;
    for (size_t i = 0; i < chunks.size(); ++i) if (!chunks[i].decode) order.push_back(i);
    for (size_t i = 0; i < chunks.size(); ++i) if (chunks[i].decode) order.push_back(i);
    std::vector<int64_t> first_row(chunks.size());
    std::vector<at::Tensor> positions, images;
    std::vector<std::vector<at::Tensor>> deep(config_.vision.deepstack_visual_indexes.size());
    std::vector<int64_t> image_rows;
    for (size_t i : order) {
      const SequenceChunk& ch = chunks[i];
      const int64_t n = static_cast<int64_t>(ch.token_ids.size());
      const int64_t row0 = static_cast<int64_t>(b.ids.size());
      first_row[i] = row0;
      (ch.decode ? b.decode_rows : b.prefill_rows) += n;
      int64_t pads = 0;
      for (int64_t t = 0; t < n; ++t) {
        b.ids.push_back(ch.token_ids[t]);
        b.cache_index.push_back(ch.start + t);
        b.table.push_back(ch.block_table.data());
        if (ch.token_ids[t] == config_.image_token_id && !ch.decode) {
          image_rows.push_back(row0 + t);
          ++pads;
        }
      }
      if (pads > 0) {
        images.push_back(ch.image_embeds.to(dtype));
        for (size_t j = 0; j < deep.size(); ++j) deep[j].push_back(ch.deepstack[j].to(dtype));
      }
      positions.push_back(ch.positions.to(at::kLong));
      b.runs.push_back({row0, n, ch.start, ch.block_table});
    }
    const int64_t r = b.rows();
    RowCosSin(at::cat(positions, 1), rotary_->inv_freq(), rotary_->frequency_axes().data(), &b.cos,
              &b.sin);
    if (!image_rows.empty()) {
      b.image_rows = at::tensor(image_rows, long_opts);
      b.image_embeds = at::cat(images, 0);
      for (auto& level : deep) b.deepstack.push_back(at::cat(level, 0));
    }
    std::vector<int64_t> logit_rows;
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (chunks[i].logits) {
        logit_rows.push_back(first_row[i] + static_cast<int64_t>(chunks[i].token_ids.size()) - 1);
      }
    }

    // --- §5.1 embedding with the image splice -----------------------------
    // x: [R, hidden]
    at::Tensor x = at::index_select(embed_tokens_, 0, at::tensor(b.ids, long_opts));
    if (b.image_rows.defined()) x.index_copy_(0, b.image_rows, b.image_embeds);

    PagedAttentionOptions attention;
    attention.scale = 1.0 / std::sqrt(static_cast<double>(d));
    const size_t elem = x.element_size();
    for (int l = 0; l < layers_->num_layers(); ++l) {
      absl::StatusOr<LayerStore::Handle> handle = layers_->Acquire(l);
      TORCH_CHECK(handle.ok(), "layer ", l, ": ", handle.status().ToString());
      const DecoderLayerWeights& w = **handle;

      // --- self-attention ------------------------------------------------
      at::Tensor h = RowRmsNorm(x, w.input_layernorm, eps);
      at::Tensor qp, kp, v;
      ProjectQkv(b.prefill_rows, b.decode_rows, w, h, &qp, &kp, &v);
      // q: [R, Hq, D], k, v: [R, Hkv, D]; q/k norm per head, before RoPE.
      at::Tensor q = RowRmsNorm(qp.view({r * hq, d}), w.q_norm, eps).view({r, hq, d});
      at::Tensor k = RowRmsNorm(kp.view({r * hkv, d}), w.k_norm, eps).view({r, hkv, d});
      RowRotaryInPlace(q, b.cos, b.sin);
      RowRotaryInPlace(k, b.cos, b.sin);
      // Cache: V [blocks, Hkv, block_size, D], K [blocks, Hkv, D, block_size];
      // row i goes to its block's slot.
      char* vc = static_cast<char*>(kv.v[l].data_ptr());
      const char* vs = static_cast<const char*>(v.data_ptr());
      for (int64_t i = 0; i < r; ++i) {
        const int64_t p = b.cache_index[i];
        const int64_t block = b.table[i][p / bs];
        for (int64_t g = 0; g < hkv; ++g) {
          const size_t dst = static_cast<size_t>(((block * hkv + g) * bs + p % bs) * d) * elem;
          const size_t src = static_cast<size_t>((i * hkv + g) * d) * elem;
          std::memcpy(vc + dst, vs + src, d * elem);
        }
      }
      if (elem == 2) {
        ScatterKeys<uint16_t>(k, kv.k[l], b.cache_index, b.table, bs);
      } else {
        ScatterKeys<uint32_t>(k, kv.k[l], b.cache_index, b.table, bs);
      }
      at::Tensor o = PagedAttention(q, kv.k[l], kv.v[l], b.runs, attention).view({r, hq * d});
      AddAttentionOut(b.prefill_rows, b.decode_rows, w, o, x);

      // --- MLP --------------------------------------------------------------
      at::Tensor n = RowRmsNorm(x, w.post_attention_layernorm, eps);
      AddMlp(b.prefill_rows, b.decode_rows, w, n, x);

      // --- deepstack (§5.3): after layer l, at the image rows ---------------
      if (l < static_cast<int>(b.deepstack.size()) && b.image_rows.defined()) {
        at::Tensor rows = x.index_select(0, b.image_rows);
        RowAddInPlace(rows, b.deepstack[l]);
        x.index_copy_(0, b.image_rows, rows);
      }
    }
    if (logit_rows.empty()) return at::Tensor();

    // --- final norm and LM head (§5.4) for the rows that want logits --------
    at::Tensor hidden =
        RowRmsNorm(x.index_select(0, at::tensor(logit_rows, long_opts)), final_norm_, eps);
    // GemvInt8, packed Gemm or Gemv: per-row results (row-invariant).
    if (use_gemv_ || !packed_head_.empty() || !lm_head8_.empty()) return Head(hidden);
    return RowLinear(hidden, lm_head_).to(at::kFloat);
  } catch (const c10::Error& e) {
    return Internal("forward", e);
  }
}

}  // namespace vlm::language
