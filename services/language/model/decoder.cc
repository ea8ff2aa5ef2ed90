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
#include <utility>

#include <ATen/ATen.h>
#include <prometheus/gauge.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/kernels/gemm.h"
#include "common/kernels/gemv_int4.h"
#include "common/kernels/gemv_int8.h"
#include "common/kernels/gemv.h"
#include "common/kernels/paged_attention.h"
#include "common/kernels/row_ops.h"
#include "common/torch_util.h"

namespace vlm::language {
namespace {

constexpr int64_t kGemvRows = 8;  // Gemv is meant for <= 8 input rows

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

// The same over int4 weights (GemvInt4).
at::Tensor Int8Rows(const at::Tensor& x, const kernels::Int4Weight& w,
                    at::ScalarType dtype = at::kBFloat16) {
  at::Tensor y = at::empty({x.size(0), w.n()}, x.options().dtype(dtype));
  Check(kernels::GemvInt4(x, w, &y));
  return y;
}

// The decode GEMV and the prefill GEMM of each quantized form.
void QuantizedGemv(const at::Tensor& x, const kernels::QuantizedWeight& w, at::Tensor* y) {
  Check(kernels::GemvInt8(x, w, y));
}
void QuantizedGemv(const at::Tensor& x, const kernels::Int4Weight& w, at::Tensor* y) {
  Check(kernels::GemvInt4(x, w, y));
}
void QuantizedGemm(const at::Tensor& x, const kernels::QuantizedWeight& w, at::Tensor* y,
                   const kernels::GemmOptions& o = {}) {
  Check(kernels::GemmInt8(x, w, y, o));
}
void QuantizedGemm(const at::Tensor& x, const kernels::Int4Weight& w, at::Tensor* y,
                   const kernels::GemmOptions& o = {}) {
  Check(kernels::GemmInt4(x, w, y, o));
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
  return dtype == WeightDType::kInt8 ? "int8" : dtype == WeightDType::kInt4 ? "int4" : "bf16";
}

absl::StatusOr<WeightDType> ParseWeightDType(std::string_view value) {
  if (value == "bf16" || value == "bfloat16") return WeightDType::kBFloat16;
  if (value == "int8") return WeightDType::kInt8;
  if (value == "int4") return WeightDType::kInt4;
  return absl::InvalidArgumentError(
      absl::StrCat("weight_dtype \"", std::string(value), "\": expected bf16, int8 or int4"));
}

Decoder::~Decoder() = default;

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------

namespace {

// The text config fields the decoder relies on, checked before any tensor.
absl::Status CheckTextConfig(const ModelConfig& config) {
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
  if (config.vision.deepstack_visual_indexes.size() > static_cast<size_t>(c.num_hidden_layers)) {
    return absl::InvalidArgumentError("more deepstack levels than decoder layers");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Decoder>> Decoder::Load(
    std::shared_ptr<const SafetensorsCheckpoint> checkpoint, const ModelConfig& config,
    const DecoderOptions& options) {
  if (absl::Status s = CheckTextConfig(config); !s.ok()) return s;
  absl::StatusOr<std::string> prefix = LanguagePrefix(*checkpoint);
  if (!prefix.ok()) return prefix.status();

  std::unique_ptr<Decoder> d(new Decoder());
  d->config_ = config;
  d->options_ = options;
  d->checkpoint_ = checkpoint;
  std::string warning;
  d->compute_dtype_ = ChooseComputeDType(options.compute_dtype, &warning);
  std::string tie_rule, embed_source;
  if (absl::Status s = d->LoadEmbeddingAndNorm(*prefix, &tie_rule, &embed_source); !s.ok()) {
    return s;
  }
  std::string matmul_note;
  absl::StatusOr<LayerStoreOptions> layer_options = d->ChooseProjectionForm(warning, &matmul_note);
  if (!layer_options.ok()) return layer_options.status();
  const at::ScalarType dtype = ScalarTypeOf(d->compute_dtype_);
  if (layer_options->form != ProjectionForm::kDense) {
    // The converted layers (and LM head) from the packed-weight file, built
    // first if needed; null: converted in memory.
    const ProjectionForm form = layer_options->form;
    layer_options->packed_file = OpenOrBuildPackedFile(
        *checkpoint, config.text, *prefix, dtype, *layer_options, options.packed_dir,
        [&](PackedFileWriter& w) { return d->WriteHead(form, w); }, &d->packed_outcome_);
  }
  absl::StatusOr<std::unique_ptr<LayerStore>> store =
      LayerStore::Create(checkpoint, config.text, *prefix, dtype, *layer_options);
  if (!store.ok()) return store.status();
  d->layers_ = *std::move(store);
  d->use_gemv_ = options.use_gemv && dtype == at::kBFloat16;
  std::string head_note;
  if (absl::Status s = d->PrepareHead(layer_options->form, embed_source, &head_note); !s.ok()) {
    return s;
  }
  const TextConfig& c = config.text;
  d->load_summary_ = absl::StrCat(
      "decoder: ", c.num_hidden_layers, " layers, compute ", ComputeDTypeName(d->compute_dtype_),
      ", layers ",
      layer_options->form != ProjectionForm::kDense
          ? (layer_options->packed_file != nullptr
                 ? absl::StrCat("mapped from the packed file ", d->packed_outcome_.path, " (",
                                d->packed_outcome_.state, ")")
                 : std::string("converted on materialization (dense projection pages released)"))
          : d->layers_->in_place() ? "in place (zero copy)" : "converted on materialization",
      ", ", tie_rule, ", ", matmul_note,
      layer_options->form == ProjectionForm::kDense
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

// The head rule (spec §2: tied -> embed_tokens, else lm_head, for both roles;
// untied -> both required), the embedding, the (untied) head and the final norm.
absl::Status Decoder::LoadEmbeddingAndNorm(const std::string& prefix, std::string* tie_rule_out,
                                           std::string* embed_source_out) {
  const TextConfig& c = config_.text;
  const ModelConfig& config = config_;
  const DecoderOptions& options = options_;
  const at::ScalarType dtype = ScalarTypeOf(compute_dtype_);
  const SafetensorsCheckpoint& ckpt = *checkpoint_;
  const std::vector<int64_t> table = {c.vocab_size, c.hidden_size};
  // Head rule (spec §2): tied -> embed_tokens (else lm_head) for both roles;
  // untied -> both required.
  const std::string embed_name = prefix + "embed_tokens.weight";
  const std::string head_name = "lm_head.weight";
  const bool has_embed = ckpt.Has(embed_name), has_head = ckpt.Has(head_name);
  tied_ = config.tie_word_embeddings;
  std::string tie_rule;
  std::string embed_source = embed_name;
  if (tied_) {
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
    embed_tokens_ = *std::move(embed);
    if (borrowed) {
      absl::Status s = options.touch_embedding || options.layers.eager_load
                           ? ckpt.Touch(embed_source)
                           : ckpt.Prefetch(embed_source);
      if (!s.ok()) return s;
    }
    embedding_bytes_ = embed_tokens_.nbytes();
    if (tied_) {
      lm_head_ = embed_tokens_;
    } else {
      info = CheckTensor(ckpt, head_name, table);
      if (!info.ok()) return info.status();
      absl::StatusOr<at::Tensor> head = FetchTensor(ckpt, head_name, dtype, &borrowed);
      if (!head.ok()) return head.status();
      lm_head_ = *std::move(head);
      if (borrowed) {
        absl::Status s = options.touch_embedding || options.layers.eager_load
                             ? ckpt.Touch(head_name)
                             : ckpt.Prefetch(head_name);
        if (!s.ok()) return s;
      }
      embedding_bytes_ += lm_head_.nbytes();
    }
    const std::string norm_name = prefix + "norm.weight";
    info = CheckTensor(ckpt, norm_name, {c.hidden_size});
    if (!info.ok()) return info.status();
    absl::StatusOr<at::Tensor> norm = FetchTensor(ckpt, norm_name, dtype);
    if (!norm.ok()) return norm.status();
    final_norm_ = *std::move(norm);
    embedding_bytes_ += final_norm_.nbytes();
    WeightBytesResidentGauge("embedding").Set(static_cast<double>(embedding_bytes_));

    rotary_ = std::make_unique<MultimodalRotary>(c);
  } catch (const c10::Error& e) {
    return StatusFromException("decoder load", e);
  }

  *tie_rule_out = tie_rule;
  *embed_source_out = embed_source;
  return absl::OkStatus();
}

// The layers' projection form from weight_dtype and matmul (and what the CPU
// runs), with a note for the load summary.
absl::StatusOr<LayerStoreOptions> Decoder::ChooseProjectionForm(const std::string& warning,
                                                                std::string* matmul_note_out) {
  const DecoderOptions& options = options_;
  const at::ScalarType dtype = ScalarTypeOf(compute_dtype_);
  LayerStoreOptions layer_options = options.layers;
  layer_options.form = ProjectionForm::kDense;
  std::string matmul_note;
  if (options.weight_dtype == WeightDType::kInt4) {
    if (dtype != at::kBFloat16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weight_dtype int4 needs compute dtype bf16 (compute is ",
          ComputeDTypeName(compute_dtype_), warning.empty() ? "" : absl::StrCat(": ", warning),
          "); float32 is the unquantized fidelity reference"));
    }
    if (options.int4_int8_layers < kAutoInt4Int8Layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "int4_int8_layers must be >= 0 (or -1: one layer in seven), not ",
          options.int4_int8_layers));
    }
    layer_options.form = ProjectionForm::kInt4;
    layer_options.int8_layers =
        Int4Int8Layers(options.int4_int8_layers, config_.text.num_hidden_layers);
    if (layer_options.int8_layers > 0) {
      std::string missing;
      if (!kernels::GemvInt8PathSupported(kernels::DefaultGemvInt8Path(), &missing)) {
        return absl::FailedPreconditionError(
            absl::StrCat("weight_dtype int4 with int8 layers: ", missing));
      }
    }
    const kernels::GemmPath gemm = kernels::DefaultGemmPath();
    quantized_gemm_ = gemm != kernels::GemmPath::kTorch;
    matmul_note = absl::StrCat(
        "int4 projections (decode rows gemv_int4/",
        kernels::GemvInt4PathName(kernels::DefaultGemvInt4Path()), ", prefill rows ",
        quantized_gemm_ ? absl::StrCat("gemm_int4/", kernels::GemmPathName(gemm))
                        : std::string("gemv_int4"),
        layer_options.int8_layers > 0
            ? absl::StrCat("; layers 0-", layer_options.int8_layers - 1, " int8")
            : std::string(),
        ")");
  } else if (options.weight_dtype == WeightDType::kInt8) {
    if (dtype != at::kBFloat16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weight_dtype int8 needs compute dtype bf16 (compute is ",
          ComputeDTypeName(compute_dtype_),
          warning.empty() ? "" : absl::StrCat(": ", warning),
          "); float32 is the unquantized fidelity reference"));
    }
    std::string missing;
    if (!kernels::GemvInt8PathSupported(kernels::DefaultGemvInt8Path(), &missing)) {
      return absl::FailedPreconditionError(absl::StrCat("weight_dtype int8: ", missing));
    }
    layer_options.form = ProjectionForm::kInt8;
    const kernels::GemmPath gemm = kernels::DefaultGemmPath();
    quantized_gemm_ = options.int8_prefill_gemm && gemm != kernels::GemmPath::kTorch;
    matmul_note = absl::StrCat(
        "int8 projections (decode rows gemv_int8/",
        kernels::GemvInt8PathName(kernels::DefaultGemvInt8Path()), ", prefill rows ",
        quantized_gemm_ ? absl::StrCat("gemm_int8/", kernels::GemmPathName(gemm))
                      : std::string("gemv_int8"),
        ")");
  } else if (options.matmul != MatmulPath::kTorch) {
    const kernels::GemmPath gemm = kernels::DefaultGemmPath();
    const bool blocked = gemm != kernels::GemmPath::kTorch;
    if (options.matmul == MatmulPath::kKernels && dtype != at::kBFloat16) {
      return absl::InvalidArgumentError(absl::StrCat(
          "matmul kernels computes in bf16 but compute is ", ComputeDTypeName(compute_dtype_),
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
  *matmul_note_out = matmul_note;
  return layer_options;
}

absl::Status Decoder::PrepareHead(ProjectionForm form, const std::string& embed_source,
                                  std::string* head_note_out) {
  const SafetensorsCheckpoint& ckpt = *checkpoint_;
  const std::string head_name = "lm_head.weight";
  // The LM head: int8 with int8 layers (int8_lm_head), else on the packed
  // GEMM with the layers (packed or int8 forms). Either way lookups read
  // single embedding rows from the mapping from now on; the head's dense
  // pages are no longer needed in memory.
  std::string head_note =
      use_gemv_ ? absl::StrCat("gemv/", GemvPathName(DefaultGemvPath())) : "at::linear";
  const HeadForm head_form = ChooseHeadForm(form);
  if (head_form != HeadForm::kDense) {
    try {
      uint64_t head_bytes = 0;
      const PackedFile* file = layers_->packed_file().get();
      const int64_t vocab = config_.text.vocab_size, hidden = config_.text.hidden_size;
      if (file != nullptr && file->HasGroup(kPackedHeadGroup) &&
          file->VerifyGroup(kPackedHeadGroup).ok()) {
        // Mapped from the packed file: nothing converted.
        if (head_form == HeadForm::kInt8) {
          absl::StatusOr<kernels::QuantizedWeight> head =
              Int8FromFile(*file, kPackedHeadGroup, "head", vocab, hidden);
          if (head.ok()) lm_head8_ = *std::move(head);
        } else if (head_form == HeadForm::kPacked) {
          absl::StatusOr<kernels::PackedWeight> head =
              PackedFromFile(*file, kPackedHeadGroup, "head", vocab, hidden, false);
          if (head.ok()) packed_head_ = *std::move(head);
        } else if (head_form == HeadForm::kInt4) {
          absl::StatusOr<kernels::Int4Weight> head =
              Int4FromFile(*file, kPackedHeadGroup, "head", vocab, hidden);
          if (head.ok()) lm_head4_ = *std::move(head);
        }
      }
      if (!lm_head4_.empty()) {
        head_bytes = lm_head4_.bytes();
        head_note = absl::StrCat("int4 (gemv_int4/",
                                 kernels::GemvInt4PathName(kernels::DefaultGemvInt4Path()),
                                 ", mapped)");
      } else if (!lm_head8_.empty()) {
        head_bytes = lm_head8_.bytes();
        head_note = absl::StrCat("int8 (gemv_int8/",
                                 kernels::GemvInt8PathName(kernels::DefaultGemvInt8Path()),
                                 ", mapped)");
      } else if (!packed_head_.empty()) {
        head_bytes = packed_head_.bytes();
        head_note = absl::StrCat("gemm/", kernels::GemmPathName(packed_head_.path()), " (mapped)");
      } else if (head_form == HeadForm::kInt4) {
        ++head_conversions_;
        absl::StatusOr<kernels::Int4Weight> head = kernels::QuantizeInt4(lm_head_);
        if (!head.ok()) return head.status();
        lm_head4_ = *std::move(head);
        head_bytes = lm_head4_.bytes();
        head_note = absl::StrCat("int4 (gemv_int4/",
                                 kernels::GemvInt4PathName(kernels::DefaultGemvInt4Path()), ")");
      } else if (head_form == HeadForm::kInt8) {
        ++head_conversions_;
        absl::StatusOr<kernels::QuantizedWeight> head = kernels::QuantizeInt8(lm_head_);
        if (!head.ok()) return head.status();
        lm_head8_ = *std::move(head);
        head_bytes = lm_head8_.bytes();
        head_note = absl::StrCat("int8 (gemv_int8/",
                                 kernels::GemvInt8PathName(kernels::DefaultGemvInt8Path()), ")");
      } else {
        ++head_conversions_;
        absl::StatusOr<kernels::PackedWeight> head = kernels::PackedWeight::Pack(lm_head_);
        if (!head.ok()) return head.status();
        packed_head_ = *std::move(head);
        head_bytes = packed_head_.bytes();
        head_note = absl::StrCat("gemm/", kernels::GemmPathName(packed_head_.path()));
      }
      if (tied_) {
        embedding_bytes_ += head_bytes;
        (void)ckpt.Evict(embed_source);  // view or converted: drops the mapped pages
      } else {
        embedding_bytes_ += head_bytes - lm_head_.nbytes();
        (void)ckpt.Evict(head_name);
        lm_head_ = at::Tensor();
      }
      WeightBytesResidentGauge("embedding").Set(static_cast<double>(embedding_bytes_));
    } catch (const c10::Error& e) {
      return StatusFromException("LM head packing", e);
    }
  }
  *head_note_out = head_note;
  return absl::OkStatus();
}

Decoder::HeadForm Decoder::ChooseHeadForm(ProjectionForm form) const {
  if (form == ProjectionForm::kInt4 && options_.int4_lm_head) return HeadForm::kInt4;
  if ((form == ProjectionForm::kInt8 || form == ProjectionForm::kInt4) && options_.int8_lm_head) {
    return HeadForm::kInt8;
  }
  if (options_.packed_head && form != ProjectionForm::kDense &&
      kernels::DefaultGemmPath() != kernels::GemmPath::kTorch) {
    return HeadForm::kPacked;
  }
  return HeadForm::kDense;
}

// The LM head in its converted form as group kPackedHeadGroup of a packed file
// being built (nothing for a dense head).
absl::Status Decoder::WriteHead(ProjectionForm form, PackedFileWriter& writer) const {
  std::vector<NamedBytes> sections;
  kernels::QuantizedWeight q;
  kernels::Int4Weight q4;
  kernels::PackedWeight p;
  try {
    switch (ChooseHeadForm(form)) {
      case HeadForm::kDense:
        return absl::OkStatus();
      case HeadForm::kInt4: {
        absl::StatusOr<kernels::Int4Weight> head = kernels::QuantizeInt4(lm_head_);
        if (!head.ok()) return head.status();
        q4 = *std::move(head);
        AppendInt4Sections("head", q4, &sections);
        break;
      }
      case HeadForm::kInt8: {
        absl::StatusOr<kernels::QuantizedWeight> head = kernels::QuantizeInt8(lm_head_);
        if (!head.ok()) return head.status();
        q = *std::move(head);
        AppendInt8Sections("head", q, &sections);
        break;
      }
      case HeadForm::kPacked: {
        absl::StatusOr<kernels::PackedWeight> head = kernels::PackedWeight::Pack(lm_head_);
        if (!head.ok()) return head.status();
        p = *std::move(head);
        AppendPackedSections("head", p, &sections);
        break;
      }
    }
  } catch (const c10::Error& e) {
    return StatusFromException("LM head packing", e);
  }
  for (const NamedBytes& b : sections) {
    if (absl::Status s = writer.Add(kPackedHeadGroup, b.name, b.data, b.size); !s.ok()) return s;
  }
  return absl::OkStatus();
}

uint64_t Decoder::decode_weight_bytes() const {
  const uint64_t head = !lm_head4_.empty()     ? lm_head4_.bytes()
                        : !lm_head8_.empty()     ? lm_head8_.bytes()
                        : !packed_head_.empty() ? packed_head_.bytes()
                                                : lm_head_.nbytes();
  return layers_->total_bytes() + head + final_norm_.nbytes();
}

// ---------------------------------------------------------------------------
// LM head
// ---------------------------------------------------------------------------

at::Tensor Decoder::Head(const at::Tensor& hidden) const {
  // hidden: [R, hidden] (after the final norm) -> [R, vocab] float32. Every
  // form gives per-row results (GemvInt8, packed Gemm, Gemv, RowLinear).
  if (!lm_head4_.empty()) return Int8Rows(hidden, lm_head4_, at::kFloat);
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
  return RowLinear(hidden, lm_head_).to(at::kFloat);
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
  const at::ScalarType dtype = ScalarTypeOf(compute_dtype_);
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

// The KV storage has this decoder's geometry and dtype (what NewKvStorage makes).
absl::Status Decoder::ValidateKvStorage(const KvStorage& kv) const {
  const TextConfig& c = config_.text;
  const at::ScalarType dtype = ScalarTypeOf(compute_dtype_);
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
  return absl::OkStatus();
}

absl::Status Decoder::ValidateChunks(const KvStorage& kv,
                                     absl::Span<const SequenceChunk> chunks) const {
  if (absl::Status s = ValidateKvStorage(kv); !s.ok()) return s;
  const TextConfig& c = config_.text;
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
      // A decode token is embedded as is (a generated image pad takes no
      // image row).
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

// Int8 / int4 weights: prefill rows [0, np) through GemmInt8 / GemmInt4
// when quantized_gemm_ (multiply-bound: the bf16 micro-kernel on panels
// converted per call), decode rows [np, np + nd) through GemvInt8 / GemvInt4
// (bandwidth-bound: the quantized bytes). A row's kernel depends only on its
// kind, never on the batch it is in.
template <typename W>
at::Tensor Decoder::QuantizedProject(int64_t np, int64_t nd, const at::Tensor& h,
                                     const W& w) const {
  const int64_t gemm_rows = QuantizedGemmRows(np);
  if (gemm_rows == 0) return Int8Rows(h, w);
  at::Tensor y = at::empty({np + nd, w.n()}, h.options());
  at::Tensor yp = y.narrow(0, 0, gemm_rows);
  QuantizedGemm(h.narrow(0, 0, gemm_rows), w, &yp);
  if (nd > 0) {
    at::Tensor yd = y.narrow(0, gemm_rows, nd);
    QuantizedGemv(h.narrow(0, gemm_rows, nd), w, &yd);
  }
  return y;
}

// x += h·wᵀ by row kind as QuantizedProject; the GEMM rows add in its
// epilogue (x = round(x + f32 sum), in place), the GEMV rows round the
// product first.
template <typename W>
void Decoder::QuantizedAddInPlace(int64_t np, int64_t nd, const at::Tensor& h, const W& w,
                                  at::Tensor& x) const {
  const int64_t gemm_rows = QuantizedGemmRows(np);
  if (gemm_rows > 0) {
    at::Tensor xp = x.narrow(0, 0, gemm_rows);
    kernels::GemmOptions go;
    go.residual = xp;
    QuantizedGemm(h.narrow(0, 0, gemm_rows), w, &xp, go);
  }
  if (gemm_rows < np + nd) {
    const int64_t rows = np + nd - gemm_rows;
    RowAddInPlace(x.narrow(0, gemm_rows, rows), Int8Rows(h.narrow(0, gemm_rows, rows), w));
  }
}

template <typename W>
void Decoder::QuantizedMlp(int64_t np, int64_t nd, const W& gate_up, const W& down,
                           const at::Tensor& n, at::Tensor& x) const {
  const int64_t inter = config_.text.intermediate_size;
  const int64_t gemm_rows = QuantizedGemmRows(np);
  // silu(gate)·up of the GEMV rows [gemm_rows, R), from their [rows, 2·intermediate].
  auto gemv_silu_mul = [&](int64_t rows) {
    const at::Tensor gu = Int8Rows(n.narrow(0, gemm_rows, rows), gate_up);
    return RowSiluMul(gu.narrow(1, 0, inter).contiguous(), gu.narrow(1, inter, inter).contiguous());
  };
  at::Tensor a;  // silu(gate)·up [R, intermediate]
  if (gemm_rows == 0) {
    a = gemv_silu_mul(np + nd);  // decode-only passes: no extra buffer or copy
  } else {
    a = at::empty({np + nd, inter}, n.options());
    at::Tensor ap = a.narrow(0, 0, gemm_rows);
    kernels::GemmOptions act;
    act.activation = kernels::Activation::kSiluMul;
    QuantizedGemm(n.narrow(0, 0, gemm_rows), gate_up, &ap, act);
    if (nd > 0) a.narrow(0, gemm_rows, nd).copy_(gemv_silu_mul(nd));
  }
  QuantizedAddInPlace(np, nd, a, down, x);
}

void Decoder::ProjectQkv(int64_t np, int64_t nd, const DecoderLayerWeights& w,
                         const at::Tensor& h, at::Tensor* q, at::Tensor* k, at::Tensor* v) const {
  const TextConfig& c = config_.text;
  const int64_t nq = c.num_attention_heads * c.head_dim, nkv = c.num_key_value_heads * c.head_dim;
  at::Tensor y;  // [R, nq + 2·nkv]
  switch (w.form) {
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
      y = QuantizedProject(np, nd, h, w.qkv8);
      break;
    case ProjectionForm::kInt4:
      y = QuantizedProject(np, nd, h, w.qkv4);
      break;
  }
  *q = y.narrow(1, 0, nq).contiguous();
  *k = y.narrow(1, nq, nkv).contiguous();
  *v = y.narrow(1, nq + nkv, nkv).contiguous();
}

void Decoder::AddAttentionOut(int64_t np, int64_t nd, const DecoderLayerWeights& w,
                              const at::Tensor& o, at::Tensor& x) const {
  switch (w.form) {
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
      QuantizedAddInPlace(np, nd, o, w.o8, x);
      return;
    case ProjectionForm::kInt4:
      QuantizedAddInPlace(np, nd, o, w.o4, x);
      return;
  }
}

void Decoder::AddMlp(int64_t np, int64_t nd, const DecoderLayerWeights& w, const at::Tensor& n,
                     at::Tensor& x) const {
  switch (w.form) {
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
    case ProjectionForm::kInt8:
      QuantizedMlp(np, nd, w.gate_up8, w.down8, n, x);
      return;
    case ProjectionForm::kInt4:
      QuantizedMlp(np, nd, w.gate_up4, w.down4, n, x);
      return;
  }
}

// Writes the pass's K and V rows into their blocks: V [blocks, Hkv,
// block_size, D], K [blocks, Hkv, D, block_size]; row i goes to its block's slot.
void Decoder::WriteKv(KvStorage& kv, int layer, const at::Tensor& k, const at::Tensor& v,
                      const Batch& b) const {
  const int64_t hkv = config_.text.num_key_value_heads, d = config_.text.head_dim;
  const int64_t bs = kv.block_size, r = b.rows();
  const size_t elem = v.element_size();
  char* vc = static_cast<char*>(kv.v[layer].data_ptr());
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
    ScatterKeys<uint16_t>(k, kv.k[layer], b.cache_index, b.table, bs);
  } else {
    ScatterKeys<uint32_t>(k, kv.k[layer], b.cache_index, b.table, bs);
  }
}

absl::StatusOr<at::Tensor> Decoder::Forward(KvStorage& kv,
                                            absl::Span<const SequenceChunk> chunks) const {
  if (absl::Status s = ValidateChunks(kv, chunks); !s.ok()) return s;
  if (chunks.empty()) return at::Tensor();
  const TextConfig& c = config_.text;
  const int64_t hq = c.num_attention_heads, hkv = c.num_key_value_heads, d = c.head_dim;
  const double eps = c.rms_norm_eps;
  try {
    const at::ScalarType dtype = ScalarTypeOf(compute_dtype_);
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
      WriteKv(kv, l, k, v, b);
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
    return Head(hidden);
  } catch (const c10::Error& e) {
    return StatusFromException("forward", e);
  }
}

}  // namespace vlm::language
