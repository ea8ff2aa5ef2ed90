// Qwen3-VL vision tower, in the order data flows through it:
//   pixel_values -> patch embed (§4.1) -> + position embedding (§4.2)
//   -> blocks (§4.4, 2-D rotary §4.3, per-image attention) -> deepstack taps (§4.5)
#include "services/vision/vision_model.h"

#include <cmath>
#include <new>
#include <utility>

#include <ATen/ATen.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/torch_util.h"
#include "common/kernels/flash_attention.h"
#include "common/kernels/gemm.h"
#include "common/log.h"
#include "common/nn.h"

namespace vlm {
namespace {

constexpr double kLayerNormEps = 1e-6;     // hard-coded in the reference (§1)
constexpr double kRotaryTheta = 10000.0;   // vision rotary base (§4.3)
constexpr int64_t kMaxGridSide = 1 << 16;  // patches per axis; keeps t·h·w far from overflow

}  // namespace

// Tensor names follow the checkpoint: model.visual.<field path>.
struct VisionModel::Weights {
  struct Block {
    at::Tensor norm1_weight, norm1_bias;          // [hidden]
    at::Tensor qkv_weight, qkv_bias;              // [3·hidden, hidden], [3·hidden]
    at::Tensor proj_weight, proj_bias;            // [hidden, hidden], [hidden]
    at::Tensor norm2_weight, norm2_bias;          // [hidden]
    at::Tensor fc1_weight, fc1_bias;              // [intermediate, hidden], [intermediate]
    at::Tensor fc2_weight, fc2_bias;              // [hidden, intermediate], [hidden]
    // The same linears repacked for common/kernels (bias included), when used.
    kernels::PackedWeight qkv, proj, fc1, fc2;
  };
  at::Tensor patch_embed_weight;  // [hidden, patch_dim] (the Conv3d kernel flattened)
  at::Tensor patch_embed_bias;    // [hidden]
  at::Tensor pos_embed;           // [grid², hidden], row = r·grid + c
  std::vector<Block> blocks;
  kernels::PackedWeight patch_embed;  // packed patch_embed_weight + bias, when used
  bool mlp_gelu_tanh = true;      // "gelu_pytorch_tanh"; false: exact GELU ("gelu")
};

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------
namespace {

// Fetches tensors by name, checks shapes, and borrows or converts them.
class WeightReader {
 public:
  WeightReader(const SafetensorsCheckpoint& checkpoint, std::string prefix, at::ScalarType dtype)
      : checkpoint_(checkpoint), prefix_(std::move(prefix)), dtype_(dtype) {}

  absl::StatusOr<at::Tensor> Get(const std::string& field, std::vector<int64_t> shape) {
    const std::string name = prefix_ + field;
    absl::StatusOr<at::Tensor> tensor = checkpoint_.Tensor(name);
    if (!tensor.ok()) return tensor.status();
    if (tensor->sizes().vec() != shape) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": shape [",
                                                     absl::StrJoin(tensor->sizes().vec(), ", "),
                                                     "], config expects [",
                                                     absl::StrJoin(shape, ", "), "]"));
    }
    if (!tensor->is_floating_point()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": not a floating-point tensor"));
    }
    const uint64_t bytes = tensor->numel() * at::elementSize(dtype_);
    if (tensor->scalar_type() == dtype_) {
      borrowed_bytes_ += bytes;
      return *tensor;  // zero copy: a read-only view of the mapping
    }
    converted_bytes_ += bytes;
    return tensor->to(dtype_);
  }

  uint64_t borrowed_bytes() const { return borrowed_bytes_; }
  uint64_t converted_bytes() const { return converted_bytes_; }

 private:
  const SafetensorsCheckpoint& checkpoint_;
  std::string prefix_;
  at::ScalarType dtype_;
  uint64_t borrowed_bytes_ = 0;
  uint64_t converted_bytes_ = 0;
};

absl::Status ValidateConfig(const VisionConfig& c) {
  auto bad = [](const std::string& what) {
    return absl::InvalidArgumentError("vision_config: " + what);
  };
  if (c.depth <= 0 || c.hidden_size <= 0 || c.num_heads <= 0 || c.intermediate_size <= 0 ||
      c.in_channels <= 0 || c.patch_size <= 0 || c.temporal_patch_size <= 0 ||
      c.spatial_merge_size <= 0 || c.num_position_embeddings <= 0) {
    return bad("depth, hidden_size, num_heads, intermediate_size, in_channels, patch_size, "
               "temporal_patch_size, spatial_merge_size and num_position_embeddings must be > 0");
  }
  if (c.hidden_size % c.num_heads != 0) {
    return bad(absl::StrCat("hidden_size ", c.hidden_size, " is not a multiple of num_heads ",
                            c.num_heads));
  }
  if (c.head_dim() % 4 != 0) {
    return bad(absl::StrCat("head_dim ", c.head_dim(),
                            " must be a multiple of 4 (2-D rotary over half of it)"));
  }
  const int64_t g = static_cast<int64_t>(std::llround(std::sqrt(double(c.num_position_embeddings))));
  if (g * g != c.num_position_embeddings) {
    return bad(absl::StrCat("num_position_embeddings ", c.num_position_embeddings,
                            " is not a perfect square"));
  }
  for (int64_t index : c.deepstack_visual_indexes) {
    if (index < 0 || index >= c.depth) {
      return bad(absl::StrCat("deepstack_visual_indexes entry ", index, " is outside 0..",
                              c.depth - 1));
    }
  }
  if (c.hidden_act != "gelu_pytorch_tanh" && c.hidden_act != "gelu_new" &&
      c.hidden_act != "gelu") {
    return bad("hidden_act \"" + c.hidden_act +
               "\" is not supported (gelu_pytorch_tanh, gelu_new, gelu)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> FindPrefix(const SafetensorsCheckpoint& checkpoint) {
  for (const char* prefix : {"model.visual.", "visual."}) {
    if (checkpoint.Has(std::string(prefix) + "patch_embed.proj.weight")) return prefix;
  }
  return absl::NotFoundError(
      "checkpoint has no vision tower: neither model.visual.patch_embed.proj.weight nor "
      "visual.patch_embed.proj.weight is present");
}

}  // namespace

absl::StatusOr<std::unique_ptr<VisionModel>> VisionModel::Load(
    const SafetensorsCheckpoint& checkpoint, const ModelConfig& config,
    const VisionModelOptions& options) {
  const VisionConfig& c = config.vision;
  if (absl::Status status = ValidateConfig(c); !status.ok()) return status;
  if (options.attention_query_tile <= 0) {
    return absl::InvalidArgumentError("attention_query_tile must be > 0");
  }
  absl::StatusOr<std::string> prefix = FindPrefix(checkpoint);
  if (!prefix.ok()) return prefix.status();

  std::unique_ptr<VisionModel> model(new VisionModel());
  model->config_ = c;
  model->attention_query_tile_ = options.attention_query_tile;
  std::string warnings;
  model->compute_dtype_ = ChooseComputeDType(options.compute_dtype, &warnings);
  if (model->compute_dtype_ == ComputeDType::kFloat32) {
    if (std::string blas = OpenBlasWarning(); !blas.empty()) {
      warnings += (warnings.empty() ? "" : "; ") + blas;
    }
  }
  if (!warnings.empty()) LogWarning("vision", "vision model: " + warnings);

  const int64_t hidden = c.hidden_size, inter = c.intermediate_size;
  auto weights = std::make_unique<Weights>();
  weights->mlp_gelu_tanh = c.hidden_act != "gelu";
  WeightReader reader(checkpoint, *prefix, ScalarTypeOf(model->compute_dtype_));
  try {
#define VLM_GET(dst, field, ...)                                        \
  do {                                                                  \
    absl::StatusOr<at::Tensor> t_ = reader.Get(field, {__VA_ARGS__});   \
    if (!t_.ok()) return t_.status();                                   \
    dst = std::move(*t_);                                               \
  } while (0)
    VLM_GET(weights->patch_embed_weight, "patch_embed.proj.weight", hidden, c.in_channels,
            c.temporal_patch_size, c.patch_size, c.patch_size);
    weights->patch_embed_weight = weights->patch_embed_weight.view({hidden, -1});
    VLM_GET(weights->patch_embed_bias, "patch_embed.proj.bias", hidden);
    VLM_GET(weights->pos_embed, "pos_embed.weight", c.num_position_embeddings, hidden);
    weights->blocks.resize(c.depth);
    for (int64_t i = 0; i < c.depth; ++i) {
      Weights::Block& b = weights->blocks[i];
      const std::string p = absl::StrCat("blocks.", i, ".");
      VLM_GET(b.norm1_weight, p + "norm1.weight", hidden);
      VLM_GET(b.norm1_bias, p + "norm1.bias", hidden);
      VLM_GET(b.qkv_weight, p + "attn.qkv.weight", 3 * hidden, hidden);
      VLM_GET(b.qkv_bias, p + "attn.qkv.bias", 3 * hidden);
      VLM_GET(b.proj_weight, p + "attn.proj.weight", hidden, hidden);
      VLM_GET(b.proj_bias, p + "attn.proj.bias", hidden);
      VLM_GET(b.norm2_weight, p + "norm2.weight", hidden);
      VLM_GET(b.norm2_bias, p + "norm2.bias", hidden);
      VLM_GET(b.fc1_weight, p + "mlp.linear_fc1.weight", inter, hidden);
      VLM_GET(b.fc1_bias, p + "mlp.linear_fc1.bias", inter);
      VLM_GET(b.fc2_weight, p + "mlp.linear_fc2.weight", hidden, inter);
      VLM_GET(b.fc2_bias, p + "mlp.linear_fc2.bias", hidden);
    }
#undef VLM_GET
  } catch (const std::exception& e) {
    return StatusFromException("vision model load", e);
  }
  // bf16 through the project's kernels: pack every linear once. The packed
  // copies replace the originals, which are dropped (a borrowed mapping can
  // then be released by the checkpoint's owner).
  std::string kernel_note = "LibTorch";
  if (model->compute_dtype_ == ComputeDType::kBFloat16) {
    const kernels::GemmPath path = kernels::DefaultGemmPath();
    if (path == kernels::GemmPath::kTorch) {
      kernel_note = "LibTorch (the GEMM path is torch: chosen, or no AVX-512 BF16 / AVX2 here)";
    } else if (!kernels::FlashAttentionSupported()) {
      kernel_note = "LibTorch (this CPU has no AVX-512 BF16 or AVX2 for the project's kernels)";
    } else if (GetCpuFeatures().amx_bf16 && path != kernels::GemmPath::kAmx) {
      // oneDNN runs AMX here (~3x the AVX-512 BF16 rate) while the project's
      // AMX path was not chosen at start-up (kernel_path.h; --kernel_path=amx forces it).
      kernel_note = "LibTorch (oneDNN uses AMX on this CPU; the project's AMX path was not chosen)";
    } else {
      auto pack = [&](at::Tensor* w, at::Tensor* b, kernels::PackedWeight* out) -> absl::Status {
        absl::StatusOr<kernels::PackedWeight> p = kernels::PackedWeight::Pack(*w, *b, path);
        if (!p.ok()) return p.status();
        *out = *std::move(p);
        model->packed_bytes_ += out->bytes();
        *w = at::Tensor();
        *b = at::Tensor();
        return absl::OkStatus();
      };
      absl::Status s = pack(&weights->patch_embed_weight, &weights->patch_embed_bias,
                            &weights->patch_embed);
      for (Weights::Block& b : weights->blocks) {
        if (s.ok()) s = pack(&b.qkv_weight, &b.qkv_bias, &b.qkv);
        if (s.ok()) s = pack(&b.proj_weight, &b.proj_bias, &b.proj);
        if (s.ok()) s = pack(&b.fc1_weight, &b.fc1_bias, &b.fc1);
        if (s.ok()) s = pack(&b.fc2_weight, &b.fc2_bias, &b.fc2);
      }
      if (!s.ok()) return s;
      model->uses_kernels_ = true;
      kernel_note = absl::StrCat("kernels (gemm ", kernels::GemmPathName(path),
                                 ", flash attention), ", model->packed_bytes_ >> 10,
                                 " KiB packed");
    }
  }
  model->weights_ = std::move(weights);
  model->borrowed_bytes_ = reader.borrowed_bytes();
  model->converted_bytes_ = reader.converted_bytes();
  model->load_summary_ = absl::StrCat(
      "vision tower: ", c.depth, " blocks, hidden ", hidden, ", compute ",
      ComputeDTypeName(model->compute_dtype_), ", weights ", model->borrowed_bytes_ >> 10,
      " KiB in place + ", model->converted_bytes_ >> 10, " KiB converted; compute: ",
      kernel_note, "; cpu: ",
      GetCpuFeatures().Describe(), warnings.empty() ? "" : "; " + warnings);
  return model;
}

VisionModel::~VisionModel() = default;

int64_t VisionModel::patch_dim() const {
  return config_.in_channels * config_.temporal_patch_size * config_.patch_size *
         config_.patch_size;
}

// ---------------------------------------------------------------------------
// Forward steps
// ---------------------------------------------------------------------------
namespace {

// §4.2: bilinear, corner-aligned interpolation of the learned [G·G, hidden]
// table at an h×w grid, repeated t times and permuted into merge order.
// Computed in float32. Returns [t·h·w, hidden].
at::Tensor PositionEmbedding(const at::Tensor& table, int64_t grid, const GridThw& thw,
                             int64_t merge) {
  const int64_t t = thw[0], h = thw[1], w = thw[2], hidden = table.size(1);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  // Sample points on the table's axes: linspace(0, G-1, n), floor, ceil clamped to G-1.
  at::Tensor hs = at::linspace(0, grid - 1, h, f32);
  at::Tensor ws = at::linspace(0, grid - 1, w, f32);
  at::Tensor h0 = hs.to(at::kLong), w0 = ws.to(at::kLong);  // truncation == floor (>= 0)
  at::Tensor h1 = at::clamp_max(h0 + 1, grid - 1), w1 = at::clamp_max(w0 + 1, grid - 1);
  at::Tensor dh = (hs - h0.to(at::kFloat)).unsqueeze(1);  // [h, 1]
  at::Tensor dw = (ws - w0.to(at::kFloat)).unsqueeze(0);  // [1, w]
  auto rows = [&](const at::Tensor& hi, const at::Tensor& wi) {  // [h·w] table rows
    return (hi.unsqueeze(1) * grid + wi.unsqueeze(0)).reshape({-1});
  };
  auto term = [&](const at::Tensor& index, const at::Tensor& weight) {  // P[index] · weight
    return table.index_select(0, index).to(at::kFloat) * weight.reshape({-1, 1});
  };
  at::Tensor e = term(rows(h0, w0), (1 - dh) * (1 - dw)) + term(rows(h0, w1), (1 - dh) * dw) +
                 term(rows(h1, w0), dh * (1 - dw)) + term(rows(h1, w1), dh * dw);  // [h·w, hidden]
  // Raster (t, r, c) -> merge order (t, bh, bw, ih, iw).
  return e.repeat({t, 1})
      .view({t, h / merge, merge, w / merge, merge, hidden})
      .permute({0, 1, 3, 2, 4, 5})
      .reshape({t * h * w, hidden});
}

// §4.3: cos and sin [t·h·w, head_dim] (float32) of the 2-D rotary for one
// image: rotary dim head_dim/2 = row frequencies then column frequencies,
// duplicated to head_dim.
std::pair<at::Tensor, at::Tensor> RotaryCosSin(const GridThw& thw, int64_t head_dim,
                                               int64_t merge) {
  const int64_t t = thw[0], h = thw[1], w = thw[2];
  const int64_t rotary_dim = head_dim / 2;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  at::Tensor inv_freq =
      at::pow(kRotaryTheta, at::arange(0, rotary_dim, 2, f32) / double(rotary_dim)).reciprocal();
  // Row and column of each patch in merge order (bh, bw, ih, iw), repeated t times.
  const int64_t bh = h / merge, bw = w / merge;
  at::Tensor r = at::arange(h, i64).view({bh, 1, merge, 1}).expand({bh, bw, merge, merge});
  at::Tensor c = at::arange(w, i64).view({1, bw, 1, merge}).expand({bh, bw, merge, merge});
  r = r.reshape({-1}).repeat({t}).to(at::kFloat);
  c = c.reshape({-1}).repeat({t}).to(at::kFloat);
  at::Tensor freqs = at::cat({at::outer(r, inv_freq), at::outer(c, inv_freq)}, 1);
  at::Tensor emb = at::cat({freqs, freqs}, 1);  // [n, head_dim]
  return {emb.cos(), emb.sin()};
}

}  // namespace

absl::StatusOr<VisionFeatures> VisionModel::Forward(const at::Tensor& pixel_values,
                                                    absl::Span<const GridThw> grids) const {
  const VisionConfig& c = config_;
  const int64_t merge = c.spatial_merge_size;
  // --- validate the batch -------------------------------------------------
  if (grids.empty()) return absl::InvalidArgumentError("vision forward: no images (empty grids)");
  int64_t total = 0;
  std::vector<int64_t> cu_seqlens = {0};  // one attention segment per image and frame
  for (size_t i = 0; i < grids.size(); ++i) {
    const auto [t, h, w] = grids[i];
    if (t < 1 || h < 1 || w < 1 || t > kMaxGridSide || h > kMaxGridSide || w > kMaxGridSide) {
      return absl::InvalidArgumentError(absl::StrCat("vision forward: image ", i, " grid (", t,
                                                     ", ", h, ", ", w, ") must be in 1..",
                                                     kMaxGridSide, " per axis"));
    }
    if (h % merge != 0 || w % merge != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("vision forward: image ", i, " grid (", t, ", ", h, ", ", w,
                       "): h and w must be multiples of spatial_merge_size ", merge));
    }
    for (int64_t f = 0; f < t; ++f) cu_seqlens.push_back(cu_seqlens.back() + h * w);
    total += t * h * w;
  }
  if (!pixel_values.defined() || pixel_values.dim() != 2 ||
      pixel_values.size(1) != patch_dim() || !pixel_values.is_floating_point() ||
      !pixel_values.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vision forward: pixel_values must be a CPU floating-point [N, ", patch_dim(),
        "] tensor, got ",
        pixel_values.defined() ? absl::StrCat("[", absl::StrJoin(pixel_values.sizes().vec(), ", "),
                                              "] ", std::string(pixel_values.dtype().name()))
                               : "an undefined tensor"));
  }
  if (pixel_values.size(0) != total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vision forward: pixel_values has ", pixel_values.size(0), " rows but the grids of ",
        grids.size(), " image(s) sum to ", total, " patches"));
  }

  if (uses_kernels_) return ForwardKernels(pixel_values, grids, cu_seqlens);
  try {
    const Weights& wt = *weights_;
    const at::ScalarType dtype = ScalarTypeOf(compute_dtype_);
    const int64_t n = total, heads = c.num_heads, head_dim = c.head_dim();

    // §4.1 patch embedding: x [N, hidden] = pixel_values · Wpeᵀ + b
    at::Tensor x = nn::Linear(pixel_values, wt.patch_embed_weight, wt.patch_embed_bias);

    // §4.2 + position embedding; §4.3 rotary tables, per image, in merge order
    std::vector<at::Tensor> pos, cos, sin;
    for (const GridThw& thw : grids) {
      pos.push_back(PositionEmbedding(wt.pos_embed, c.pos_grid(), thw, merge));
      auto [cs, sn] = RotaryCosSin(thw, head_dim, merge);
      cos.push_back(std::move(cs));
      sin.push_back(std::move(sn));
    }
    x = x + at::cat(pos, 0).to(dtype);
    pos.clear();
    const at::Tensor rot_cos = at::cat(cos, 0), rot_sin = at::cat(sin, 0);  // [N, head_dim] f32

    nn::AttentionOptions attention;
    attention.scale = 1.0 / std::sqrt(double(head_dim));
    attention.query_tile = attention_query_tile_;

    // §4.4 blocks; §4.5 taps are block outputs
    VisionFeatures out;
    out.deepstack.resize(c.deepstack_visual_indexes.size());
    for (int64_t i = 0; i < c.depth; ++i) {
      const Weights::Block& b = wt.blocks[i];
      // attention: qkv [N, 3, heads, head_dim]
      at::Tensor h = nn::LayerNorm(x, b.norm1_weight, b.norm1_bias, kLayerNormEps);
      at::Tensor qkv = nn::Linear(h, b.qkv_weight, b.qkv_bias).view({n, 3, heads, head_dim});
      at::Tensor q = nn::ApplyRotary(qkv.select(1, 0), rot_cos, rot_sin);
      at::Tensor k = nn::ApplyRotary(qkv.select(1, 1), rot_cos, rot_sin);
      at::Tensor o = nn::SegmentedAttention(q, k, qkv.select(1, 2), cu_seqlens, attention);
      x = x + nn::Linear(o.view({n, c.hidden_size}), b.proj_weight, b.proj_bias);
      // MLP: fc2(gelu(fc1(norm2(x))))
      h = nn::LayerNorm(x, b.norm2_weight, b.norm2_bias, kLayerNormEps);
      h = nn::Linear(h, b.fc1_weight, b.fc1_bias);
      h = wt.mlp_gelu_tanh ? nn::GeluTanh(h) : nn::GeluErf(h);
      x = x + nn::Linear(h, b.fc2_weight, b.fc2_bias);
      for (size_t j = 0; j < c.deepstack_visual_indexes.size(); ++j) {
        if (c.deepstack_visual_indexes[j] == i) out.deepstack[j] = x;
      }
    }
    out.last_hidden = x;
    return out;
  } catch (const std::exception& e) {
    return StatusFromException("vision forward", e);
  }
}

// The same steps through common/kernels (bf16): every linear is one packed
// GEMM with its bias, GELU or residual add fused into the store, attention
// is the flash kernel over each image's rows. Inputs are validated by Forward.
absl::StatusOr<VisionFeatures> VisionModel::ForwardKernels(
    const at::Tensor& pixel_values, absl::Span<const GridThw> grids,
    absl::Span<const int64_t> cu_seqlens) const {
  const VisionConfig& c = config_;
  const int64_t merge = c.spatial_merge_size;
  try {
    const Weights& wt = *weights_;
    const int64_t n = pixel_values.size(0), heads = c.num_heads, head_dim = c.head_dim();
    auto gemm = [](const at::Tensor& in, const kernels::PackedWeight& w,
                   kernels::Activation act, const at::Tensor& residual) -> absl::StatusOr<at::Tensor> {
      kernels::GemmOptions o;
      o.activation = act;
      o.residual = residual;
      o.out_dtype = at::kBFloat16;
      return kernels::Gemm(in, w, o);
    };
#define VLM_TRY(dst, expr)                          \
  do {                                              \
    absl::StatusOr<at::Tensor> r_ = (expr);         \
    if (!r_.ok()) return r_.status();               \
    dst = *std::move(r_);                           \
  } while (0)
    const kernels::Activation none = kernels::Activation::kNone;

    // §4.1 patch embedding: x [N, hidden] = pixel_values · Wpeᵀ + b (x rounded to bf16 first)
    at::Tensor x;
    VLM_TRY(x, gemm(pixel_values, wt.patch_embed, none, at::Tensor()));

    // §4.2 + position embedding; §4.3 rotary tables, per image, in merge order
    std::vector<at::Tensor> pos, cos, sin;
    for (const GridThw& thw : grids) {
      pos.push_back(PositionEmbedding(wt.pos_embed, c.pos_grid(), thw, merge));
      auto [cs, sn] = RotaryCosSin(thw, head_dim, merge);
      cos.push_back(std::move(cs));
      sin.push_back(std::move(sn));
    }
    x = x + at::cat(pos, 0).to(at::kBFloat16);
    pos.clear();
    const at::Tensor rot_cos = at::cat(cos, 0), rot_sin = at::cat(sin, 0);  // [N, head_dim] f32
    const double scale = 1.0 / std::sqrt(double(head_dim));
    const kernels::Activation gelu =
        wt.mlp_gelu_tanh ? kernels::Activation::kGeluTanh : kernels::Activation::kGeluErf;

    // §4.4 blocks; §4.5 taps are block outputs
    VisionFeatures out;
    out.deepstack.resize(c.deepstack_visual_indexes.size());
    for (int64_t i = 0; i < c.depth; ++i) {
      const Weights::Block& b = wt.blocks[i];
      // attention: qkv [N, 3, heads, head_dim]
      at::Tensor h = nn::LayerNorm(x, b.norm1_weight, b.norm1_bias, kLayerNormEps);
      at::Tensor qkv;
      VLM_TRY(qkv, gemm(h, b.qkv, none, at::Tensor()));
      qkv = qkv.view({n, 3, heads, head_dim});
      const at::Tensor q = nn::ApplyRotary(qkv.select(1, 0), rot_cos, rot_sin);
      const at::Tensor k = nn::ApplyRotary(qkv.select(1, 1), rot_cos, rot_sin);
      at::Tensor o;
      VLM_TRY(o, kernels::SegmentedFlashAttention(q, k, qkv.select(1, 2), cu_seqlens, scale));
      VLM_TRY(x, gemm(o.view({n, c.hidden_size}), b.proj, none, x));  // x + proj(o)
      // MLP: x + fc2(gelu(fc1(norm2(x))))
      h = nn::LayerNorm(x, b.norm2_weight, b.norm2_bias, kLayerNormEps);
      VLM_TRY(h, gemm(h, b.fc1, gelu, at::Tensor()));
      VLM_TRY(x, gemm(h, b.fc2, none, x));
      for (size_t j = 0; j < c.deepstack_visual_indexes.size(); ++j) {
        if (c.deepstack_visual_indexes[j] == i) out.deepstack[j] = x;
      }
    }
#undef VLM_TRY
    out.last_hidden = x;
    return out;
  } catch (const std::exception& e) {
    return StatusFromException("vision forward", e);
  }
}

}  // namespace vlm
