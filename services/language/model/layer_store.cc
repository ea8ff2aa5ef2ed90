#include "services/language/model/layer_store.h"

#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <utility>

#include <ATen/ATen.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/model_fingerprint.h"
#include "common/sha256.h"

namespace vlm::language {

// ---------------------------------------------------------------------------
// Checkpoint names
// ---------------------------------------------------------------------------

absl::StatusOr<std::string> VisualPrefix(const SafetensorsCheckpoint& checkpoint) {
  for (const char* prefix : {"model.visual.", "visual."}) {
    if (checkpoint.Has(std::string(prefix) + "merger.linear_fc1.weight")) return std::string(prefix);
  }
  return absl::NotFoundError(
      "checkpoint has no projector: neither model.visual.merger.linear_fc1.weight nor "
      "visual.merger.linear_fc1.weight");
}

absl::StatusOr<std::string> LanguagePrefix(const SafetensorsCheckpoint& checkpoint) {
  for (const char* prefix : {"model.language_model.", "language_model.", "model."}) {
    if (checkpoint.Has(std::string(prefix) + "norm.weight")) return std::string(prefix);
  }
  return absl::NotFoundError(
      "checkpoint has no language model: no model.language_model.norm.weight "
      "(nor language_model.norm.weight, model.norm.weight)");
}

absl::StatusOr<const TensorInfo*> CheckTensor(const SafetensorsCheckpoint& checkpoint,
                                              const std::string& name,
                                              const std::vector<int64_t>& shape) {
  absl::StatusOr<const TensorInfo*> info = checkpoint.Info(name);
  if (!info.ok()) return info.status();
  if ((*info)->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": shape [",
                                                   absl::StrJoin((*info)->shape, ", "),
                                                   "], config expects [",
                                                   absl::StrJoin(shape, ", "), "]"));
  }
  const StDType d = (*info)->dtype;
  if (d != StDType::kBF16 && d != StDType::kF16 && d != StDType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": dtype ", StDTypeName(d),
                                                   " is not BF16, F16 or F32"));
  }
  return info;
}

absl::StatusOr<at::Tensor> FetchTensor(const SafetensorsCheckpoint& checkpoint,
                                       const std::string& name, at::ScalarType dtype,
                                       bool* borrowed) {
  absl::StatusOr<at::Tensor> stored = checkpoint.Tensor(name);
  if (!stored.ok()) return stored.status();
  if (stored->scalar_type() == dtype) {
    if (borrowed) *borrowed = true;
    return *stored;
  }
  if (borrowed) *borrowed = false;
  try {
    at::Tensor converted = stored->to(dtype).contiguous();
    stored->reset();
    checkpoint.Evict(name).IgnoreError();  // the stored copy is no longer needed in memory
    return converted;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(name, ": conversion failed: ", e.what_without_backtrace()));
  }
}

namespace {

struct StoreMetrics {
  prometheus::Family<prometheus::Gauge>* bytes;
  prometheus::Gauge* layers;
  prometheus::Histogram* materialize_seconds;
};

const StoreMetrics& Metrics() {
  static const StoreMetrics metrics = [] {
    StoreMetrics m;
    m.bytes = &prometheus::BuildGauge()
                   .Name("vlm_language_weight_bytes_resident")
                   .Help("Bytes of language-model weights resident in memory, by part")
                   .Register(MetricsRegistry());
    m.layers = &prometheus::BuildGauge()
                    .Name("vlm_language_layers_resident")
                    .Help("Decoder layers currently materialized")
                    .Register(MetricsRegistry())
                    .Add({});
    m.materialize_seconds =
        &prometheus::BuildHistogram()
             .Name("vlm_language_layer_materialization_seconds")
             .Help("Time to materialize one decoder layer (page-in or dtype conversion)")
             .Register(MetricsRegistry())
             .Add({}, prometheus::Histogram::BucketBoundaries{0.0005, 0.001, 0.002, 0.005, 0.01,
                                                              0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5});
    return m;
  }();
  return metrics;
}

// Field names of one layer, in DecoderLayerWeights order.
constexpr const char* kLayerFields[] = {
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
    "self_attn.k_norm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "mlp.down_proj.weight"};
constexpr int kNumLayerFields = sizeof(kLayerFields) / sizeof(kLayerFields[0]);

std::shared_ptr<DecoderLayerWeights> FromTensors(std::vector<at::Tensor> t) {
  auto w = std::make_shared<DecoderLayerWeights>();
  w->input_layernorm = std::move(t[0]);
  w->q_proj = std::move(t[1]);
  w->k_proj = std::move(t[2]);
  w->v_proj = std::move(t[3]);
  w->o_proj = std::move(t[4]);
  w->q_norm = std::move(t[5]);
  w->k_norm = std::move(t[6]);
  w->post_attention_layernorm = std::move(t[7]);
  w->gate_proj = std::move(t[8]);
  w->up_proj = std::move(t[9]);
  w->down_proj = std::move(t[10]);
  return w;
}

// Bytes of one [n, k] projection in `form` (packed panels and int8 rows as
// gemm.cc / quantize.h lay them out); `gate_up`: n is each of gate and up.
uint64_t ProjectionBytes(ProjectionForm form, int64_t n, int64_t k, bool gate_up,
                         size_t dense_element) {
  const uint64_t outs = static_cast<uint64_t>(gate_up ? 2 * n : n);
  switch (form) {
    case ProjectionForm::kDense:
      return outs * k * dense_element;
    case ProjectionForm::kPacked: {
      const uint64_t kpairs = static_cast<uint64_t>((k + 31) / 32 * 16);
      const uint64_t panels = static_cast<uint64_t>(gate_up ? (n + 15) / 16 : (n + 31) / 32);
      return panels * kpairs * 2 * 32 * 2;
    }
    case ProjectionForm::kInt8:
      return outs * static_cast<uint64_t>((k + 63) / 64 * 64) + outs * sizeof(float);
    case ProjectionForm::kInt4: {  // nibbles, f32 row scale, f16 ratio + u8 zero per group
      const uint64_t groups = static_cast<uint64_t>((k + kernels::kInt4Group - 1) / kernels::kInt4Group);
      return outs * (groups * (kernels::kInt4Group / 2 + 3) + sizeof(float));
    }
  }
  return 0;
}

// What a materialized layer holds, by the same rule as ProjectionBytes.
uint64_t HeldBytes(const DecoderLayerWeights& w) {
  uint64_t total = 0;
  for (const at::Tensor* t :
       {&w.input_layernorm, &w.q_proj, &w.k_proj, &w.v_proj, &w.o_proj, &w.q_norm, &w.k_norm,
        &w.post_attention_layernorm, &w.gate_proj, &w.up_proj, &w.down_proj}) {
    if (t->defined()) total += t->nbytes();
  }
  for (const kernels::PackedWeight* p : {&w.qkv, &w.o, &w.gate_up, &w.down}) total += p->bytes();
  for (const kernels::QuantizedWeight* q : {&w.qkv8, &w.o8, &w.gate_up8, &w.down8}) {
    if (!q->empty()) total += q->bytes();
  }
  for (const kernels::Int4Weight* q : {&w.qkv4, &w.o4, &w.gate_up4, &w.down4}) {
    if (!q->empty()) total += q->bytes();
  }
  return total;
}

// Packs or quantizes a layer's dense projections into `form` and releases the
// dense tensors (views of the mapping or converted copies).
absl::Status ConvertProjections(ProjectionForm form, int layer, DecoderLayerWeights& w) {
  const std::string where = absl::StrCat("layer ", layer, ": ");
  try {
    const at::Tensor qkv = at::cat({w.q_proj, w.k_proj, w.v_proj}, 0);  // [q + 2kv, hidden]
    if (form == ProjectionForm::kPacked) {
      absl::StatusOr<kernels::PackedWeight> p = kernels::PackedWeight::Pack(qkv);
      if (!p.ok()) return absl::Status(p.status().code(), where + p.status().message().data());
      w.qkv = *std::move(p);
      p = kernels::PackedWeight::Pack(w.o_proj);
      if (!p.ok()) return absl::Status(p.status().code(), where + p.status().message().data());
      w.o = *std::move(p);
      p = kernels::PackedWeight::PackGateUp(w.gate_proj, w.up_proj);
      if (!p.ok()) return absl::Status(p.status().code(), where + p.status().message().data());
      w.gate_up = *std::move(p);
      p = kernels::PackedWeight::Pack(w.down_proj);
      if (!p.ok()) return absl::Status(p.status().code(), where + p.status().message().data());
      w.down = *std::move(p);
    } else if (form == ProjectionForm::kInt4) {
      kernels::Int4Weight* dst[] = {&w.qkv4, &w.o4, &w.gate_up4, &w.down4};
      const at::Tensor src[] = {qkv, w.o_proj, at::cat({w.gate_proj, w.up_proj}, 0), w.down_proj};
      for (int i = 0; i < 4; ++i) {
        absl::StatusOr<kernels::Int4Weight> q = kernels::QuantizeInt4(src[i]);
        if (!q.ok()) return absl::Status(q.status().code(), where + q.status().message().data());
        *dst[i] = *std::move(q);
      }
    } else {
      absl::StatusOr<kernels::QuantizedWeight> q = kernels::QuantizeInt8(qkv);
      if (!q.ok()) return absl::Status(q.status().code(), where + q.status().message().data());
      w.qkv8 = *std::move(q);
      q = kernels::QuantizeInt8(w.o_proj);
      if (!q.ok()) return absl::Status(q.status().code(), where + q.status().message().data());
      w.o8 = *std::move(q);
      q = kernels::QuantizeInt8(at::cat({w.gate_proj, w.up_proj}, 0));
      if (!q.ok()) return absl::Status(q.status().code(), where + q.status().message().data());
      w.gate_up8 = *std::move(q);
      q = kernels::QuantizeInt8(w.down_proj);
      if (!q.ok()) return absl::Status(q.status().code(), where + q.status().message().data());
      w.down8 = *std::move(q);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(where + e.what_without_backtrace());
  }
  w.form = form;
  // One copy of every weight: release the dense projections (mapped pages
  // back to the page cache, converted copies freed with the tensors).
  for (at::Tensor* t : {&w.q_proj, &w.k_proj, &w.v_proj, &w.o_proj, &w.gate_proj, &w.up_proj,
                        &w.down_proj}) {
    t->reset();
  }
  return absl::OkStatus();
}

}  // namespace

const char* ProjectionFormName(ProjectionForm form) {
  switch (form) {
    case ProjectionForm::kDense:
      return "dense";
    case ProjectionForm::kPacked:
      return "packed";
    case ProjectionForm::kInt8:
      return "int8";
    case ProjectionForm::kInt4:
      return "int4";
  }
  return "?";
}

// ---------------------------------------------------------------------------
// Packed-weight file of the layers
// ---------------------------------------------------------------------------

std::string PackedFormName(ProjectionForm form, int int8_layers) {
  switch (form) {
    case ProjectionForm::kDense:
      return "";
    case ProjectionForm::kPacked:
      return "packed/bf16-panels32";
    case ProjectionForm::kInt8:
      return absl::StrCat("int8/g", kernels::kInt8Group, "-i", kernels::kInt8Block);
    case ProjectionForm::kInt4:
      return absl::StrCat("int4/g", kernels::kInt4Group, "-i", kernels::kInt4Block, "-asym",
                          int8_layers > 0 ? absl::StrCat("+int8x", int8_layers) : "");
  }
  return "";
}

std::string PackedCheckpointId(const SafetensorsCheckpoint& checkpoint) {
  Sha256Hasher h;
  h.Update("vlm-packed-checkpoint-v1\n");
  h.Update(ModelFingerprint("", checkpoint));
  for (const std::string& file : checkpoint.files()) {
    struct stat st {};
    const bool ok = ::stat(file.c_str(), &st) == 0;
    h.Update(absl::StrCat("\n", std::filesystem::path(file).filename().string(), " ",
                          ok ? static_cast<int64_t>(st.st_size) : -1, " ",
                          ok ? static_cast<int64_t>(st.st_mtim.tv_sec) : 0, ".",
                          ok ? static_cast<int64_t>(st.st_mtim.tv_nsec) : 0));
  }
  return h.FinishHex();
}

std::string PackedFileStem(const SafetensorsCheckpoint& checkpoint) {
  std::error_code ec;
  const std::string file = checkpoint.files().empty() ? "" : checkpoint.files()[0];
  std::filesystem::path dir = std::filesystem::absolute(file, ec).parent_path();
  if (ec) dir = std::filesystem::path(file).parent_path();
  return Sha256Hex(dir.lexically_normal().string()).substr(0, 16);
}

void AppendPackedSections(const std::string& name, const kernels::PackedWeight& w,
                          std::vector<NamedBytes>* out) {
  out->push_back({name + ".panels", w.panel_data(), w.panel_bytes()});
}

void AppendInt8Sections(const std::string& name, const kernels::QuantizedWeight& w,
                        std::vector<NamedBytes>* out) {
  out->push_back({name + ".rows", w.row(0), w.data_bytes()});
  out->push_back({name + ".row_scales", w.row_scales(), w.row_scale_bytes()});
  out->push_back({name + ".ratios", w.ratios(), w.ratio_bytes()});
}

void AppendInt4Sections(const std::string& name, const kernels::Int4Weight& w,
                        std::vector<NamedBytes>* out) {
  out->push_back({name + ".nibbles", w.packed(), w.packed_bytes()});
  out->push_back({name + ".row_scales", w.row_scales(), w.row_scale_bytes()});
  out->push_back({name + ".ratios", w.ratios(), w.ratio_bytes()});
  out->push_back({name + ".zeros", w.zeros(), w.zero_bytes()});
}

namespace {

absl::StatusOr<const PackedFile::Section*> FindSection(const PackedFile& file, int32_t group,
                                                       const std::string& name, uint64_t size) {
  const PackedFile::Section* s = file.Find(group, name);
  if (s == nullptr) {
    return absl::NotFoundError(absl::StrCat(file.path(), ": no section ", group, "/", name));
  }
  if (s->size != size) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": section ", group, "/", name,
                                                   " holds ", s->size, " bytes, expected ", size));
  }
  return s;
}

}  // namespace

absl::StatusOr<kernels::PackedWeight> PackedFromFile(const PackedFile& file, int32_t group,
                                                     const std::string& name, int64_t n,
                                                     int64_t k, bool gate_up) {
  absl::StatusOr<const PackedFile::Section*> s =
      FindSection(file, group, name + ".panels", kernels::PackedWeight::PanelBytes(n, k, gate_up));
  if (!s.ok()) return s.status();
  return kernels::PackedWeight::FromPanels(n, k, gate_up, kernels::DefaultGemmPath(),
                                           file.data(**s), (*s)->size, file.owner());
}

absl::StatusOr<kernels::QuantizedWeight> Int8FromFile(const PackedFile& file, int32_t group,
                                                      const std::string& name, int64_t n,
                                                      int64_t k) {
  const int64_t kp = (k + kernels::kInt8Group - 1) / kernels::kInt8Group * kernels::kInt8Group;
  const uint64_t un = static_cast<uint64_t>(n);
  absl::StatusOr<const PackedFile::Section*> rows =
      FindSection(file, group, name + ".rows", un * kp);
  if (!rows.ok()) return rows.status();
  absl::StatusOr<const PackedFile::Section*> scales =
      FindSection(file, group, name + ".row_scales", un * sizeof(float));
  if (!scales.ok()) return scales.status();
  absl::StatusOr<const PackedFile::Section*> ratios = FindSection(
      file, group, name + ".ratios", un * (kp / kernels::kInt8Group) * sizeof(uint16_t));
  if (!ratios.ok()) return ratios.status();
  return kernels::QuantizedWeight::FromParts(
      n, k, file.data(**rows), reinterpret_cast<const float*>(file.data(**scales)),
      reinterpret_cast<const uint16_t*>(file.data(**ratios)), file.owner());
}

absl::StatusOr<kernels::Int4Weight> Int4FromFile(const PackedFile& file, int32_t group,
                                                 const std::string& name, int64_t n, int64_t k) {
  const int64_t kp = (k + kernels::kInt4Group - 1) / kernels::kInt4Group * kernels::kInt4Group;
  const uint64_t un = static_cast<uint64_t>(n), groups = static_cast<uint64_t>(kp / kernels::kInt4Group);
  absl::StatusOr<const PackedFile::Section*> nibbles =
      FindSection(file, group, name + ".nibbles", un * static_cast<uint64_t>(kp / 2));
  if (!nibbles.ok()) return nibbles.status();
  absl::StatusOr<const PackedFile::Section*> scales =
      FindSection(file, group, name + ".row_scales", un * sizeof(float));
  if (!scales.ok()) return scales.status();
  absl::StatusOr<const PackedFile::Section*> ratios =
      FindSection(file, group, name + ".ratios", un * groups * sizeof(uint16_t));
  if (!ratios.ok()) return ratios.status();
  absl::StatusOr<const PackedFile::Section*> zeros =
      FindSection(file, group, name + ".zeros", un * groups);
  if (!zeros.ok()) return zeros.status();
  return kernels::Int4Weight::View(n, k, file.data(**nibbles),
                                   reinterpret_cast<const float*>(file.data(**scales)),
                                   reinterpret_cast<const uint16_t*>(file.data(**ratios)),
                                   file.data(**zeros), file.owner());
}

namespace {

constexpr const char* kNormSections[] = {"input_layernorm", "q_norm", "k_norm",
                                         "post_attention_layernorm"};

// A layer's sections in `form`: the four norms (compute dtype) and the
// projections as the form holds them. One case per form.
std::vector<NamedBytes> LayerSections(const DecoderLayerWeights& w, ProjectionForm form) {
  std::vector<NamedBytes> out;
  const at::Tensor* norms[] = {&w.input_layernorm, &w.q_norm, &w.k_norm,
                               &w.post_attention_layernorm};
  for (int i = 0; i < 4; ++i) {
    out.push_back({kNormSections[i], norms[i]->data_ptr(), norms[i]->nbytes()});
  }
  switch (form) {
    case ProjectionForm::kDense:
      break;
    case ProjectionForm::kPacked:
      AppendPackedSections("qkv", w.qkv, &out);
      AppendPackedSections("o", w.o, &out);
      AppendPackedSections("gate_up", w.gate_up, &out);
      AppendPackedSections("down", w.down, &out);
      break;
    case ProjectionForm::kInt8:
      AppendInt8Sections("qkv", w.qkv8, &out);
      AppendInt8Sections("o", w.o8, &out);
      AppendInt8Sections("gate_up", w.gate_up8, &out);
      AppendInt8Sections("down", w.down8, &out);
      break;
    case ProjectionForm::kInt4:
      AppendInt4Sections("qkv", w.qkv4, &out);
      AppendInt4Sections("o", w.o4, &out);
      AppendInt4Sections("gate_up", w.gate_up4, &out);
      AppendInt4Sections("down", w.down4, &out);
      break;
  }
  return out;
}

// A layer from its group in `file`: views of the mapping, nothing copied.
absl::StatusOr<std::shared_ptr<DecoderLayerWeights>> LayerFromFile(const PackedFile& file,
                                                                   int layer, ProjectionForm form,
                                                                   const TextConfig& c,
                                                                   at::ScalarType dtype) {
  auto w = std::make_shared<DecoderLayerWeights>();
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim, inter = c.intermediate_size;
  const int64_t norm_sizes[] = {h, c.head_dim, c.head_dim, h};
  at::Tensor* norms[] = {&w->input_layernorm, &w->q_norm, &w->k_norm,
                         &w->post_attention_layernorm};
  const size_t e = at::elementSize(dtype);
  try {
    for (int i = 0; i < 4; ++i) {
      absl::StatusOr<const PackedFile::Section*> s =
          FindSection(file, layer, kNormSections[i], norm_sizes[i] * e);
      if (!s.ok()) return s.status();
      std::shared_ptr<const void> owner = file.owner();
      *norms[i] = at::from_blob(const_cast<uint8_t*>(file.data(**s)), {norm_sizes[i]},
                                [owner](void*) {}, at::TensorOptions().dtype(dtype));
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("layer ", layer, ": ", e.what_without_backtrace()));
  }
  switch (form) {
    case ProjectionForm::kDense:
      return absl::InvalidArgumentError("dense layers have no packed file");
    case ProjectionForm::kInt4: {
      struct P { kernels::Int4Weight* w; const char* name; int64_t n, k; };
      for (const P& p : {P{&w->qkv4, "qkv", q + 2 * kv, h}, P{&w->o4, "o", h, q},
                         P{&w->gate_up4, "gate_up", 2 * inter, h},
                         P{&w->down4, "down", h, inter}}) {
        absl::StatusOr<kernels::Int4Weight> qw = Int4FromFile(file, layer, p.name, p.n, p.k);
        if (!qw.ok()) return qw.status();
        *p.w = *std::move(qw);
      }
      break;
    }
    case ProjectionForm::kPacked: {
      struct P { kernels::PackedWeight* w; const char* name; int64_t n, k; bool gate_up; };
      for (const P& p : {P{&w->qkv, "qkv", q + 2 * kv, h, false}, P{&w->o, "o", h, q, false},
                         P{&w->gate_up, "gate_up", inter, h, true},
                         P{&w->down, "down", h, inter, false}}) {
        absl::StatusOr<kernels::PackedWeight> pw = PackedFromFile(file, layer, p.name, p.n, p.k,
                                                                  p.gate_up);
        if (!pw.ok()) return pw.status();
        *p.w = *std::move(pw);
      }
      break;
    }
    case ProjectionForm::kInt8: {
      struct P { kernels::QuantizedWeight* w; const char* name; int64_t n, k; };
      for (const P& p : {P{&w->qkv8, "qkv", q + 2 * kv, h}, P{&w->o8, "o", h, q},
                         P{&w->gate_up8, "gate_up", 2 * inter, h},
                         P{&w->down8, "down", h, inter}}) {
        absl::StatusOr<kernels::QuantizedWeight> qw = Int8FromFile(file, layer, p.name, p.n, p.k);
        if (!qw.ok()) return qw.status();
        *p.w = *std::move(qw);
      }
      break;
    }
  }
  w->form = form;
  return w;
}

struct PackedFileMetrics {
  prometheus::Family<prometheus::Counter>* unwritten;
  prometheus::Family<prometheus::Gauge>* state;
};

const PackedFileMetrics& FileMetrics() {
  static const PackedFileMetrics metrics = [] {
    PackedFileMetrics m;
    m.unwritten = &prometheus::BuildCounter()
                       .Name("vlm_language_packed_file_write_failures_total")
                       .Help("Packed-weight files that could not be written, by reason "
                             "(unwritable, disk_full, io_error); the layers pack in memory")
                       .Register(MetricsRegistry());
    m.state = &prometheus::BuildGauge()
                   .Name("vlm_language_packed_file")
                   .Help("1 for how this process got its converted layers: state=mapped (an "
                         "existing packed file), built (written at this start), unavailable "
                         "(packed in memory)")
                   .Register(MetricsRegistry());
    return m;
  }();
  return metrics;
}

void SetFileState(const std::string& state) {
  for (const char* s : {"mapped", "built", "unavailable"}) {
    FileMetrics().state->Add({{"state", s}}).Set(state == s ? 1 : 0);
  }
}

const char* WriteFailureReason(const absl::Status& s) {
  if (absl::IsResourceExhausted(s)) return "disk_full";
  if (absl::IsPermissionDenied(s) || absl::IsFailedPrecondition(s) || absl::IsNotFound(s)) {
    return "unwritable";
  }
  return "io_error";
}

// Every layer's sections present with the sizes its form needs (table only).
absl::Status CheckLayerSections(const PackedFile& file, const LayerStoreOptions& layers,
                                const TextConfig& c, at::ScalarType dtype) {
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    absl::StatusOr<std::shared_ptr<DecoderLayerWeights>> w =
        LayerFromFile(file, l, layers.LayerForm(l), c, dtype);
    if (!w.ok()) return w.status();
  }
  return absl::OkStatus();
}

}  // namespace

std::shared_ptr<const PackedFile> OpenOrBuildPackedFile(
    const SafetensorsCheckpoint& ckpt, const TextConfig& c, const std::string& prefix,
    at::ScalarType dtype, const LayerStoreOptions& layers, const std::string& dir,
    const std::function<absl::Status(PackedFileWriter&)>& extra, PackedFileOutcome* outcome) {
  const ProjectionForm form = layers.form;
  *outcome = PackedFileOutcome();
  outcome->state = "unavailable";
  if (form == ProjectionForm::kDense) {
    outcome->reason = "dense layers are the checkpoint's own layout";
    return nullptr;
  }
  if (PackedFormName(form).empty()) {
    outcome->reason = absl::StrCat(ProjectionFormName(form), " has no packed-file layout yet");
    LogInfo("language", "packed weights: none, layers convert in memory",
            {{"reason", outcome->reason}});
    SetFileState("unavailable");
    return nullptr;
  }
  if (dir.empty()) {
    outcome->reason = "no packed-weight directory (--packed_cache_dir is empty)";
    LogInfo("language", "packed weights: none, layers pack in memory",
            {{"reason", outcome->reason}});
    SetFileState("unavailable");
    return nullptr;
  }
  PackedFileKey key;
  key.checkpoint = PackedCheckpointId(ckpt);
  key.form = PackedFormName(form, layers.int8_layers);
  key.stem = PackedFileStem(ckpt);
  outcome->path = (std::filesystem::path(dir) / key.FileName()).string();
  {
    LoadPhaseTimer timer("language_packed_map");
    std::string reason;
    absl::StatusOr<std::shared_ptr<PackedFile>> file = PackedFile::Open(outcome->path, key, &reason);
    if (file.ok()) {
      absl::Status sections = CheckLayerSections(**file, layers, c, dtype);
      if (sections.ok()) {
        outcome->state = "mapped";
        outcome->seconds = timer.Stop();
        LogInfo("language", "packed weights mapped",
                {{"path", outcome->path},
                 {"bytes", static_cast<long long>((*file)->size())},
                 {"form", key.form},
                 {"seconds", outcome->seconds}});
        SetFileState("mapped");
        return *std::move(file);
      }
      reason = "corrupt";
      file = sections;
    }
    if (reason != "missing") {
      outcome->reason = absl::StrCat(reason, ": ", file.status().message());
      LogWarning("language", "packed weights rejected, rebuilding",
                 {{"path", outcome->path}, {"reason", reason},
                  {"error", std::string(file.status().message())}});
      CountPackedFileRejection(reason);
    }
  }
  LoadPhaseTimer timer("language_packed_build");
  const auto unwritten = [&](const absl::Status& s) -> std::shared_ptr<const PackedFile> {
    const char* why = WriteFailureReason(s);
    FileMetrics().unwritten->Add({{"reason", why}}).Increment();
    outcome->state = "unavailable";
    outcome->reason = absl::StrCat(why, ": ", s.message());
    LogWarning("language", "packed weights not written, layers pack in memory",
               {{"path", outcome->path}, {"reason", why}, {"error", std::string(s.message())}});
    SetFileState("unavailable");
    return nullptr;
  };
  absl::StatusOr<std::unique_ptr<PackedFileWriter>> writer = PackedFileWriter::Create(dir, key);
  if (!writer.ok()) return unwritten(writer.status());
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    std::vector<at::Tensor> tensors;
    std::vector<std::string> names;
    for (int f = 0; f < kNumLayerFields; ++f) {
      names.push_back(absl::StrCat(prefix, "layers.", l, ".", kLayerFields[f]));
      absl::StatusOr<at::Tensor> t = FetchTensor(ckpt, names.back(), dtype);
      if (!t.ok()) return unwritten(t.status());
      tensors.push_back(*std::move(t));
    }
    std::shared_ptr<DecoderLayerWeights> w = FromTensors(std::move(tensors));
    if (absl::Status s = ConvertProjections(layers.LayerForm(l), l, *w); !s.ok()) {
      return unwritten(s);
    }
    for (const NamedBytes& b : LayerSections(*w, w->form)) {
      if (absl::Status s = (*writer)->Add(l, b.name, b.data, b.size); !s.ok()) {
        return unwritten(s);
      }
    }
    w.reset();
    for (const std::string& name : names) ckpt.Evict(name).IgnoreError();
  }
  if (extra) {
    if (absl::Status s = extra(**writer); !s.ok()) return unwritten(s);
  }
  const uint64_t bytes = (*writer)->bytes_written();
  if (absl::Status s = (*writer)->Commit(); !s.ok()) return unwritten(s);
  std::string reason;
  absl::StatusOr<std::shared_ptr<PackedFile>> file = PackedFile::Open(outcome->path, key, &reason);
  if (!file.ok()) return unwritten(file.status());
  outcome->state = "built";
  outcome->seconds = timer.Stop();
  LogInfo("language", "packed weights built",
          {{"path", outcome->path},
           {"bytes", static_cast<long long>(bytes)},
           {"form", key.form},
           {"seconds", outcome->seconds},
           {"replaced", outcome->reason.empty() ? "none" : outcome->reason}});
  SetFileState("built");
  return *std::move(file);
}

prometheus::Gauge& WeightBytesResidentGauge(const std::string& part) {
  return Metrics().bytes->Add({{"part", part}});
}

// ---------------------------------------------------------------------------
// Handle
// ---------------------------------------------------------------------------

LayerStore::Handle::Handle(Handle&& other) noexcept
    : store_(other.store_), layer_(other.layer_), weights_(std::move(other.weights_)) {
  other.store_ = nullptr;
}

LayerStore::Handle& LayerStore::Handle::operator=(Handle&& other) noexcept {
  if (this != &other) {
    Release();
    store_ = other.store_;
    layer_ = other.layer_;
    weights_ = std::move(other.weights_);
    other.store_ = nullptr;
  }
  return *this;
}

LayerStore::Handle::~Handle() { Release(); }

void LayerStore::Handle::Release() {
  if (store_ != nullptr) store_->Unpin(layer_);
  store_ = nullptr;
  weights_.reset();
}

// ---------------------------------------------------------------------------
// Store
// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<LayerStore>> LayerStore::Create(
    std::shared_ptr<const SafetensorsCheckpoint> checkpoint, const TextConfig& c,
    const std::string& prefix, at::ScalarType compute_dtype, const LayerStoreOptions& options) {
  if (options.resident_layers < 0 || options.prefetch_layers < 0) {
    return absl::InvalidArgumentError("resident_layers and prefetch_layers must be >= 0");
  }
  if (options.form != ProjectionForm::kDense && compute_dtype != at::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(
        ProjectionFormName(options.form), " projections need the bf16 compute dtype"));
  }
  std::unique_ptr<LayerStore> store(new LayerStore());
  store->checkpoint_ = std::move(checkpoint);
  store->dtype_ = compute_dtype;
  store->options_ = options;
  store->config_ = c;
  const SafetensorsCheckpoint& ckpt = *store->checkpoint_;
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim, inter = c.intermediate_size;
  const std::vector<int64_t> shapes[kNumLayerFields] = {
      {h}, {q, h}, {kv, h}, {kv, h}, {h, q}, {c.head_dim}, {c.head_dim}, {h}, {inter, h},
      {inter, h}, {h, inter}};
  store->slots_.resize(c.num_hidden_layers);
  bool all_in_place = true;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    Slot& slot = store->slots_[l];
    for (int f = 0; f < kNumLayerFields; ++f) {
      std::string name = absl::StrCat(prefix, "layers.", l, ".", kLayerFields[f]);
      absl::StatusOr<const TensorInfo*> info = CheckTensor(ckpt, name, shapes[f]);
      if (!info.ok()) return info.status();
      const bool same = ((*info)->dtype == StDType::kBF16 && compute_dtype == at::kBFloat16) ||
                        ((*info)->dtype == StDType::kF32 && compute_dtype == at::kFloat);
      all_in_place = all_in_place && same;
      slot.names.push_back(std::move(name));
    }
    // Norms (fields 0, 5, 6, 7) stay dense; projections take options.LayerForm(l).
    const size_t e = at::elementSize(compute_dtype);
    const ProjectionForm f = options.LayerForm(l);
    slot.bytes = static_cast<uint64_t>(2 * h + 2 * c.head_dim) * e;
    if (f == ProjectionForm::kDense) {
      slot.bytes += ProjectionBytes(f, q, h, false, e) + 2 * ProjectionBytes(f, kv, h, false, e) +
                    ProjectionBytes(f, h, q, false, e) + ProjectionBytes(f, inter, h, true, e) +
                    ProjectionBytes(f, h, inter, false, e);
    } else {
      slot.bytes += ProjectionBytes(f, q + 2 * kv, h, false, e) + ProjectionBytes(f, h, q, false, e) +
                    ProjectionBytes(f, inter, h, true, e) + ProjectionBytes(f, h, inter, false, e);
    }
  }
  store->in_place_ = all_in_place;
  if (options.packed_file != nullptr && options.form == ProjectionForm::kDense) {
    return absl::InvalidArgumentError("a packed-weight file needs a converting projection form");
  }
  if (all_in_place) {
    // Views cost nothing and touch no page: make them once.
    for (Slot& slot : store->slots_) {
      std::vector<at::Tensor> views;
      for (const std::string& name : slot.names) {
        absl::StatusOr<at::Tensor> t = ckpt.Tensor(name);
        if (!t.ok()) return t.status();
        views.push_back(*std::move(t));
      }
      slot.views = FromTensors(std::move(views));
    }
  }
  const StoreMetrics& m = Metrics();
  store->layers_gauge_ = m.layers;
  store->bytes_gauge_ = &WeightBytesResidentGauge("layers");
  store->created_ = std::chrono::steady_clock::now();
  store->background_.assign(c.num_hidden_layers, 0);
  if (options.eager_load) {
    const int n = options.resident_layers > 0
                      ? std::min<int>(options.resident_layers, c.num_hidden_layers)
                      : static_cast<int>(c.num_hidden_layers);
    for (int l = 0; l < n; ++l) {
      absl::StatusOr<Handle> handle = store->Acquire(l);
      if (!handle.ok()) return handle.status();
    }
  }
  const bool background = options.background_materialize &&
                          (options.form != ProjectionForm::kDense || options.packed_file != nullptr);
  if (background) {
    const int n = options.resident_layers > 0
                      ? std::min<int>(options.resident_layers, c.num_hidden_layers)
                      : static_cast<int>(c.num_hidden_layers);
    std::lock_guard<std::mutex> lock(store->mu_);
    for (int l = 0; l < n; ++l) {
      Slot& slot = store->slots_[l];
      if (slot.state != State::kCold || slot.queued) continue;
      slot.queued = true;
      store->queue_.push_back(l);
      store->background_[l] = 1;
      ++store->background_left_;
    }
  }
  if (options.prefetch_layers > 0 || background) {
    store->worker_ = std::thread([s = store.get()] { s->PrefetchLoop(); });
  }
  return store;
}

LayerStore::~LayerStore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  std::lock_guard<std::mutex> lock(mu_);
  if (layers_gauge_ != nullptr) layers_gauge_->Decrement(resident_count_);
  if (bytes_gauge_ != nullptr) bytes_gauge_->Decrement(static_cast<double>(resident_bytes_));
}

absl::StatusOr<std::shared_ptr<const DecoderLayerWeights>> LayerStore::Materialize(
    int layer, bool* from_file) {
  const Slot& slot = slots_[layer];  // names and views are immutable after Create
  const SafetensorsCheckpoint& ckpt = *checkpoint_;
  *from_file = false;
  const PackedFile* file = options_.packed_file.get();
  bool file_failed = false;
  if (file != nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    file_failed = slot.file_failed;
  }
  if (file != nullptr && !file_failed) {
    file->PrefetchGroup(layer);
    // The first materialization in this process hashes the sections (which
    // pages them in); later ones only fault the pages back.
    absl::Status verified = file->VerifyGroup(layer);
    if (verified.ok()) {
      file->TouchGroup(layer);
      absl::StatusOr<std::shared_ptr<DecoderLayerWeights>> w =
          LayerFromFile(*file, layer, options_.LayerForm(layer), config_, dtype_);
      if (w.ok()) {
        *from_file = true;
        return std::shared_ptr<const DecoderLayerWeights>(*std::move(w));
      }
      verified = w.status();
    }
    LogWarning("language", "packed weights rejected for a layer, converting it from the checkpoint",
               {{"layer", layer}, {"path", file->path()}, {"reason", "section_checksum"},
                {"error", verified.ToString()}});
    CountPackedFileRejection("section_checksum");
    file->EvictGroup(layer);
    file->Discard();  // the next start rebuilds it
    std::lock_guard<std::mutex> lock(mu_);
    slots_[layer].file_failed = true;
  }
  if (options_.form != ProjectionForm::kDense || !in_place_) {
    std::lock_guard<std::mutex> lock(mu_);
    ++conversions_;
  }
  if (in_place_) {
    for (const std::string& name : slot.names) {
      absl::Status s = ckpt.Prefetch(name);
      if (!s.ok()) return s;
    }
    for (const std::string& name : slot.names) {
      absl::Status s = ckpt.Touch(name);
      if (!s.ok()) return s;
    }
    if (options_.form == ProjectionForm::kDense) return slot.views;
    auto w = std::make_shared<DecoderLayerWeights>(*slot.views);
    absl::Status s = Convert(layer, *w);
    if (!s.ok()) return s;
    return std::shared_ptr<const DecoderLayerWeights>(std::move(w));
  }
  std::vector<at::Tensor> tensors;
  for (const std::string& name : slot.names) {
    absl::StatusOr<at::Tensor> t = FetchTensor(ckpt, name, dtype_);
    if (!t.ok()) return t.status();
    tensors.push_back(*std::move(t));
  }
  std::shared_ptr<DecoderLayerWeights> w = FromTensors(std::move(tensors));
  if (options_.form != ProjectionForm::kDense) {
    absl::Status s = Convert(layer, *w);
    if (!s.ok()) return s;
  }
  return std::shared_ptr<const DecoderLayerWeights>(std::move(w));
}

absl::Status LayerStore::Convert(int layer, DecoderLayerWeights& w) const {
  if (absl::Status s = ConvertProjections(options_.LayerForm(layer), layer, w); !s.ok()) return s;
  if (in_place_) {
    const Slot& slot = slots_[layer];
    for (int f : {1, 2, 3, 4, 8, 9, 10}) checkpoint_->Evict(slot.names[f]).IgnoreError();
  }
  return absl::OkStatus();
}

void LayerStore::MarkResident(int layer, std::shared_ptr<const DecoderLayerWeights> weights,
                              double seconds, bool from_file) {
  Slot& slot = slots_[layer];
  slot.state = State::kResident;
  slot.from_file = from_file;
  slot.bytes = HeldBytes(*weights);  // the estimate from Create, made exact
  slot.weights = std::move(weights);
  slot.last_use = ++tick_;
  ++resident_count_;
  resident_bytes_ += slot.bytes;
  ++materializations_;
  layers_gauge_->Increment();
  bytes_gauge_->Increment(static_cast<double>(slot.bytes));
  Metrics().materialize_seconds->Observe(seconds);
  BackgroundDone(layer);
}

void LayerStore::BackgroundDone(int layer) {
  if (background_[layer] == 0) return;
  background_[layer] = 0;
  if (--background_left_ > 0) return;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - created_).count();
  RecordLoadPhase("language_layers_background", seconds);
  LogInfo("language", "layers materialized in the background",
          {{"form", ProjectionFormName(options_.form)},
           {"source", options_.packed_file != nullptr ? "packed file" : "checkpoint"},
           {"layers", resident_count_},
           {"seconds", seconds}});
}

void LayerStore::Drop(int layer) {
  Slot& slot = slots_[layer];
  if (slot.from_file) {
    options_.packed_file->EvictGroup(layer);
  } else if (in_place_) {
    for (const std::string& name : slot.names) checkpoint_->Evict(name).IgnoreError();
  }
  slot.weights.reset();  // converted copies are freed here (no handle holds them)
  slot.state = State::kCold;
  --resident_count_;
  resident_bytes_ -= slot.bytes;
  ++evictions_;
  layers_gauge_->Decrement();
  bytes_gauge_->Decrement(static_cast<double>(slot.bytes));
}

bool LayerStore::HasEvictableLayer() const {
  for (const Slot& slot : slots_) {
    if (slot.state == State::kResident && slot.pins == 0) return true;
  }
  return false;
}

void LayerStore::EnforceBound() {
  if (options_.resident_layers <= 0) return;
  while (resident_count_ > options_.resident_layers) {
    int victim = -1;
    for (int l = 0; l < num_layers(); ++l) {
      const Slot& s = slots_[l];
      if (s.state == State::kResident && s.pins == 0 &&
          (victim < 0 || s.last_use < slots_[victim].last_use)) {
        victim = l;
      }
    }
    if (victim < 0) return;  // everything resident is pinned: over budget until released
    Drop(victim);
  }
}

absl::StatusOr<LayerStore::Handle> LayerStore::Acquire(int layer) {
  if (layer < 0 || layer >= num_layers()) {
    return absl::OutOfRangeError(absl::StrCat("layer ", layer, " outside 0..", num_layers() - 1));
  }
  std::unique_lock<std::mutex> lock(mu_);
  Slot& slot = slots_[layer];
  while (slot.state != State::kResident) {
    if (slot.state == State::kLoading) {
      cv_.wait(lock);
      continue;
    }
    slot.state = State::kLoading;
    lock.unlock();
    const auto start = std::chrono::steady_clock::now();
    bool from_file = false;
    absl::StatusOr<std::shared_ptr<const DecoderLayerWeights>> weights =
        Materialize(layer, &from_file);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    lock.lock();
    if (!weights.ok()) {
      slot.state = State::kCold;
      cv_.notify_all();
      return weights.status();
    }
    MarkResident(layer, *std::move(weights), seconds, from_file);
    cv_.notify_all();
  }
  ++slot.pins;
  slot.last_use = ++tick_;
  Handle handle;
  handle.store_ = this;
  handle.layer_ = layer;
  handle.weights_ = slot.weights;
  EnforceBound();
  SchedulePrefetch(layer);
  return handle;
}

void LayerStore::Unpin(int layer) {
  std::lock_guard<std::mutex> lock(mu_);
  --slots_[layer].pins;
  EnforceBound();
}

void LayerStore::SchedulePrefetch(int after) {
  if (options_.prefetch_layers <= 0 || stop_) return;
  const int n = num_layers();
  const int ahead = std::min(options_.prefetch_layers, n - 1);
  bool added = false;
  for (int i = 1; i <= ahead; ++i) {
    const int l = (after + i) % n;
    Slot& s = slots_[l];
    if (s.state == State::kCold && !s.queued) {
      s.queued = true;
      queue_.push_back(l);
      added = true;
    }
  }
  if (added) cv_.notify_all();
}

void LayerStore::PrefetchLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const int layer = queue_.front();
    queue_.pop_front();
    Slot& slot = slots_[layer];
    slot.queued = false;
    if (slot.state != State::kCold) continue;
    // Under a bound, prefetching must make room by dropping an unpinned layer;
    // if every resident layer is pinned, the layer is loaded on demand instead.
    if (options_.resident_layers > 0 && resident_count_ >= options_.resident_layers &&
        !HasEvictableLayer()) {
      BackgroundDone(layer);
      continue;
    }
    slot.state = State::kLoading;
    lock.unlock();
    const auto start = std::chrono::steady_clock::now();
    bool from_file = false;
    absl::StatusOr<std::shared_ptr<const DecoderLayerWeights>> weights =
        Materialize(layer, &from_file);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    lock.lock();
    if (!weights.ok()) {
      slot.state = State::kCold;  // Acquire retries and reports the error
      LogWarning("language", "layer prefetch failed",
                 {{"layer", layer}, {"error", weights.status().ToString()}});
    } else {
      MarkResident(layer, *std::move(weights), seconds, from_file);
      EnforceBound();
    }
    cv_.notify_all();
  }
}

uint64_t LayerStore::layer_bytes(int layer) const { return slots_.at(layer).bytes; }

uint64_t LayerStore::total_bytes() const {
  uint64_t total = 0;
  for (const Slot& s : slots_) total += s.bytes;
  return total;
}

bool LayerStore::IsResident(int layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return slots_.at(layer).state == State::kResident;
}

int LayerStore::resident_layers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return resident_count_;
}

uint64_t LayerStore::resident_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return resident_bytes_;
}

int64_t LayerStore::materializations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return materializations_;
}

int64_t LayerStore::conversions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return conversions_;
}

int64_t LayerStore::evictions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return evictions_;
}

}  // namespace vlm::language
