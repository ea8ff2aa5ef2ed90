// Qwen3-VL projector (spec §4.6): per merger,
//   main:      LayerNorm(hidden) per patch -> 2x2 concat -> fc1 -> GELU(erf) -> fc2
//   deepstack: 2x2 concat -> LayerNorm(4·hidden) -> fc1 -> GELU(erf) -> fc2
#include "services/language/model/projector.h"

#include <algorithm>
#include <utility>

#include <ATen/ATen.h>
#include <prometheus/gauge.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/nn.h"
#include "common/torch_util.h"
#include "services/language/model/layer_store.h"

namespace vlm::language {
namespace {

constexpr double kLayerNormEps = 1e-6;  // hard-coded in the reference (§1)
// Merged tokens per projector pass: bounds the fc1 activation ([rows, 4·hidden]).
constexpr int64_t kRowsPerPass = 4096;

}  // namespace

// model.visual.merger / model.visual.deepstack_merger_list.<j>
struct Projector::Merger {
  bool postshuffle_norm = false;
  at::Tensor norm_weight, norm_bias;  // [hidden] (main) or [unit·hidden] (deepstack)
  at::Tensor fc1_weight, fc1_bias;    // [unit·hidden, unit·hidden]
  at::Tensor fc2_weight, fc2_bias;    // [out_hidden, unit·hidden]

  // x: [n, hidden] (n a multiple of unit) -> [n / unit, out_hidden]
  at::Tensor Forward(const at::Tensor& x, int64_t unit) const {
    const int64_t n = x.size(0), hidden = x.size(1);
    at::Tensor y = postshuffle_norm
                       ? nn::LayerNorm(x.reshape({n / unit, unit * hidden}), norm_weight,
                                       norm_bias, kLayerNormEps)
                       : nn::LayerNorm(x, norm_weight, norm_bias, kLayerNormEps)
                             .reshape({n / unit, unit * hidden});
    y = nn::GeluErf(nn::Linear(y, fc1_weight, fc1_bias));
    return nn::Linear(y, fc2_weight, fc2_bias);
  }
};

Projector::~Projector() = default;

absl::StatusOr<std::unique_ptr<Projector>> Projector::Load(const SafetensorsCheckpoint& checkpoint,
                                                           const ModelConfig& config,
                                                           const ProjectorOptions& options) {
  const VisionConfig& v = config.vision;
  if (v.hidden_size <= 0 || v.spatial_merge_size <= 0 || v.out_hidden_size <= 0) {
    return absl::InvalidArgumentError(
        "vision_config: hidden_size, spatial_merge_size and out_hidden_size must be > 0");
  }
  if (v.out_hidden_size != config.text.hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat("vision_config.out_hidden_size ",
                                                   v.out_hidden_size, " != text hidden_size ",
                                                   config.text.hidden_size));
  }
  absl::StatusOr<std::string> prefix = VisualPrefix(checkpoint);
  if (!prefix.ok()) return prefix.status();

  std::unique_ptr<Projector> p(new Projector());
  std::string warning;
  p->compute_dtype_ = ChooseComputeDType(options.compute_dtype, &warning);
  p->vision_hidden_ = v.hidden_size;
  p->out_hidden_ = v.out_hidden_size;
  p->merge_size_ = v.spatial_merge_size;
  const at::ScalarType dtype = ScalarTypeOf(p->compute_dtype_);
  const int64_t unit = v.spatial_merge_size * v.spatial_merge_size;
  const int64_t wide = unit * v.hidden_size;

  auto load = [&](const std::string& name, bool postshuffle)
      -> absl::StatusOr<std::unique_ptr<const Merger>> {
    auto m = std::make_unique<Merger>();
    m->postshuffle_norm = postshuffle;
    const int64_t norm = postshuffle ? wide : v.hidden_size;
    struct Field {
      const char* suffix;
      std::vector<int64_t> shape;
      at::Tensor* out;
    } fields[] = {{"norm.weight", {norm}, &m->norm_weight},
                  {"norm.bias", {norm}, &m->norm_bias},
                  {"linear_fc1.weight", {wide, wide}, &m->fc1_weight},
                  {"linear_fc1.bias", {wide}, &m->fc1_bias},
                  {"linear_fc2.weight", {v.out_hidden_size, wide}, &m->fc2_weight},
                  {"linear_fc2.bias", {v.out_hidden_size}, &m->fc2_bias}};
    for (Field& f : fields) {
      const std::string full = *prefix + name + f.suffix;
      absl::StatusOr<const TensorInfo*> info = CheckTensor(checkpoint, full, f.shape);
      if (!info.ok()) return info.status();
      bool borrowed = false;
      absl::StatusOr<at::Tensor> t = FetchTensor(checkpoint, full, dtype, &borrowed);
      if (!t.ok()) return t.status();
      if (borrowed) {
        absl::Status s = checkpoint.Touch(full);  // materialized now, not at the first image
        if (!s.ok()) return s;
        p->borrowed_bytes_ += t->nbytes();
      } else {
        p->converted_bytes_ += t->nbytes();
      }
      *f.out = *std::move(t);
    }
    return std::unique_ptr<const Merger>(std::move(m));
  };

  absl::StatusOr<std::unique_ptr<const Merger>> merger = load("merger.", false);
  if (!merger.ok()) return merger.status();
  p->merger_ = *std::move(merger);
  for (size_t j = 0; j < v.deepstack_visual_indexes.size(); ++j) {
    absl::StatusOr<std::unique_ptr<const Merger>> ds =
        load(absl::StrCat("deepstack_merger_list.", j, "."), true);
    if (!ds.ok()) return ds.status();
    p->deepstack_mergers_.push_back(*std::move(ds));
  }
  WeightBytesResidentGauge("projector").Set(
      static_cast<double>(p->borrowed_bytes_ + p->converted_bytes_));
  p->load_summary_ = absl::StrCat("projector: ", 1 + p->deepstack_mergers_.size(),
                                  " mergers, compute ", ComputeDTypeName(p->compute_dtype_),
                                  ", ", p->borrowed_bytes_, " bytes in place, ",
                                  p->converted_bytes_, " bytes converted");
  if (!warning.empty()) absl::StrAppend(&p->load_summary_, " (", warning, ")");
  return p;
}

int64_t Projector::num_deepstack() const { return static_cast<int64_t>(deepstack_mergers_.size()); }

absl::StatusOr<ProjectedImages> Projector::Forward(const at::Tensor& last_hidden,
                                                   absl::Span<const at::Tensor> deepstack,
                                                   absl::Span<const GridThw> grids) const {
  const int64_t m = merge_size_, unit = m * m;
  int64_t patches = 0;
  for (size_t k = 0; k < grids.size(); ++k) {
    const GridThw& g = grids[k];
    if (g[0] <= 0 || g[1] <= 0 || g[2] <= 0 || g[1] % m != 0 || g[2] % m != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "grid of image ", k, " is (", g[0], ", ", g[1], ", ", g[2],
          "); t, h, w must be positive and h, w multiples of ", m));
    }
    patches += g[0] * g[1] * g[2];
  }
  auto check = [&](const at::Tensor& t, const std::string& what) -> absl::Status {
    if (!t.defined()) return absl::InvalidArgumentError(what + ": missing");
    if (t.scalar_type() != at::kBFloat16 && t.scalar_type() != at::kFloat) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": dtype ",
                                                     c10::toString(t.scalar_type()),
                                                     ", expected bfloat16 or float32"));
    }
    if (t.dim() != 2 || t.size(0) != patches || t.size(1) != vision_hidden_) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": shape [", absl::StrJoin(t.sizes().vec(), ", "), "], the grids need [",
          patches, ", ", vision_hidden_, "] (Σ t·h·w patches x vision hidden size)"));
    }
    return absl::OkStatus();
  };
  absl::Status s = check(last_hidden, "features");
  if (!s.ok()) return s;
  if (static_cast<int64_t>(deepstack.size()) != num_deepstack()) {
    return absl::InvalidArgumentError(absl::StrCat("deepstack features: ", deepstack.size(),
                                                   " tensors, the model has ", num_deepstack(),
                                                   " deepstack mergers"));
  }
  for (size_t j = 0; j < deepstack.size(); ++j) {
    s = check(deepstack[j], absl::StrCat("deepstack features ", j));
    if (!s.ok()) return s;
  }
  try {
    const at::ScalarType dtype = ScalarTypeOf(compute_dtype_);
    const int64_t merged = patches / unit;
    ProjectedImages out;
    auto run = [&](const Merger& merger, const at::Tensor& x) {
      // x: [N, vision_hidden] -> [N/unit, out_hidden], in passes of kRowsPerPass tokens
      at::Tensor y = at::empty({merged, out_hidden_}, at::TensorOptions().dtype(dtype));
      for (int64_t r = 0; r < merged; r += kRowsPerPass) {
        const int64_t rows = std::min(kRowsPerPass, merged - r);
        y.narrow(0, r, rows).copy_(merger.Forward(x.narrow(0, r * unit, rows * unit).to(dtype), unit));
      }
      return y;
    };
    out.image_embeds = run(*merger_, last_hidden);
    for (size_t j = 0; j < deepstack.size(); ++j) {
      out.deepstack.push_back(run(*deepstack_mergers_[j], deepstack[j]));
    }
    return out;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("projector: ", e.what_without_backtrace()));
  }
}

absl::Status Projector::WarmUp() const {
  try {
    const at::ScalarType dtype = ScalarTypeOf(compute_dtype_);
    const GridThw grid = {1, merge_size_, merge_size_};
    at::Tensor zeros = at::zeros({merge_size_ * merge_size_, vision_hidden_},
                                 at::TensorOptions().dtype(dtype));
    std::vector<at::Tensor> ds(deepstack_mergers_.size(), zeros);
    absl::StatusOr<ProjectedImages> out = Forward(zeros, ds, absl::MakeConstSpan(&grid, 1));
    if (!out.ok()) return out.status();
    bool finite = at::isfinite(out->image_embeds).all().item<bool>();
    for (const at::Tensor& t : out->deepstack) finite = finite && at::isfinite(t).all().item<bool>();
    if (!finite) return absl::InternalError("projector warm-up produced non-finite values");
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("projector warm-up: ", e.what_without_backtrace()));
  }
}

}  // namespace vlm::language
