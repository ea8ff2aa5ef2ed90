// Gemm dispatch, weight packing and the work split; the ISA kernels live in
// gemm_avx512bf16.cc, gemm_amx.cc and gemm_avx2.cc.
#include "common/kernels/gemm.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cpu_features.h"
#include "common/kernels/gemm_internal.h"
#include "common/kernels/path_override.h"
#include "common/kernels/thread_pool.h"

namespace vlm::kernels {

using internal::kPanelCols;

struct PackedWeight::Impl {
  GemmPath path = GemmPath::kAvx512Bf16;
  int64_t n = 0, k = 0;
  bool gate_up = false;
  // blocked family
  uint16_t* panels = nullptr;  // 64-byte aligned, owned unless `owner` is set
  std::shared_ptr<const void> owner;  // holds borrowed panels (FromPanels)
  int64_t kpairs = 0, count = 0;
  std::vector<float> bias;  // [n] or empty
  // torch family
  at::Tensor weight, up_weight;  // bf16 [n, k]
  at::Tensor bias_tensor;        // f32 [n] or undefined
  uint64_t bytes = 0;

  ~Impl() {
    if (owner == nullptr) ::operator delete(panels, std::align_val_t(64));
  }
  internal::Panels view() const { return {panels, k, kpairs, count}; }
};

namespace {

bool IsBlocked(GemmPath p) { return p != GemmPath::kTorch; }

GemmPath ReadDefaultPath() {
  return internal::PathFromEnvironment("VLM_GEMM_PATH", AutoGemmPath(), ParseGemmPath,
                                       [](GemmPath p, std::string* missing) {
                                         return GemmPathSupported(p, missing);
                                       });
}

absl::Status CheckWeight(const at::Tensor& w, const char* what) {
  if (!w.defined() || w.device().type() != at::kCPU || w.dim() != 2 ||
      (w.scalar_type() != at::kBFloat16 && w.scalar_type() != at::kFloat)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be a 2-D bf16 or f32 CPU tensor [N, K]; got ",
                     w.defined() ? w.toString() : std::string("undefined")));
  }
  if (w.size(0) == 0 || w.size(1) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is empty: [", w.size(0), ", ",
                                                   w.size(1), "]"));
  }
  return absl::OkStatus();
}

// bf16 contiguous copy or view of w.
at::Tensor AsBf16(const at::Tensor& w) {
  return w.to(at::kBFloat16).contiguous();
}

absl::StatusOr<GemmPath> ResolvePath(std::optional<GemmPath> path) {
  const GemmPath p = path.value_or(DefaultGemmPath());
  std::string missing;
  if (!GemmPathSupported(p, &missing)) {
    return absl::FailedPreconditionError(
        absl::StrCat("gemm path ", GemmPathName(p), " is not usable here: ", missing));
  }
  return p;
}

absl::StatusOr<PackedWeight> PackImpl(const at::Tensor& w, const at::Tensor& up,
                                      const at::Tensor& bias, std::optional<GemmPath> path,
                                      std::shared_ptr<PackedWeight::Impl>* out) {
  absl::StatusOr<GemmPath> p = ResolvePath(path);
  if (!p.ok()) return p.status();
  auto impl = std::make_shared<PackedWeight::Impl>();
  impl->path = *p;
  impl->n = w.size(0);
  impl->k = w.size(1);
  impl->gate_up = up.defined();
  if (bias.defined()) {
    if (bias.dim() != 1 || bias.size(0) != impl->n || !bias.is_floating_point()) {
      return absl::InvalidArgumentError(absl::StrCat("bias must be a floating-point [", impl->n,
                                                     "] tensor; got ", bias.toString(), " ",
                                                     bias.dim(), "-D"));
    }
  }
  try {
    if (!IsBlocked(*p)) {
      const at::Tensor wb = AsBf16(w);
      if (wb.data_ptr() != w.data_ptr()) impl->bytes += wb.nbytes();
      impl->weight = wb;
      if (up.defined()) {
        impl->up_weight = AsBf16(up);
        if (impl->up_weight.data_ptr() != up.data_ptr()) impl->bytes += impl->up_weight.nbytes();
      }
      if (bias.defined()) {
        impl->bias_tensor = bias.to(at::kFloat).contiguous();
        impl->bytes += impl->bias_tensor.nbytes();
      }
    } else {
      const at::Tensor wb = AsBf16(w);
      const at::Tensor ub = up.defined() ? AsBf16(up) : at::Tensor();
      impl->kpairs = (impl->k + 31) / 32 * 16;
      const int64_t cols_per_panel = impl->gate_up ? 16 : kPanelCols;
      impl->count = (impl->n + cols_per_panel - 1) / cols_per_panel;
      const size_t elems = static_cast<size_t>(impl->count * impl->kpairs * 2 * kPanelCols);
      impl->panels = static_cast<uint16_t*>(
          ::operator new(elems * sizeof(uint16_t), std::align_val_t(64)));
      impl->bytes += elems * sizeof(uint16_t);
      internal::PackPanels(reinterpret_cast<const uint16_t*>(wb.data_ptr()), wb.stride(0),
                           ub.defined() ? reinterpret_cast<const uint16_t*>(ub.data_ptr()) : nullptr,
                           ub.defined() ? ub.stride(0) : 0, impl->n, impl->k, impl->gate_up,
                           impl->panels, impl->kpairs, impl->count);
      if (bias.defined()) {
        const at::Tensor bf = bias.to(at::kFloat).contiguous();
        impl->bias.assign(bf.data_ptr<float>(), bf.data_ptr<float>() + impl->n);
        impl->bytes += impl->n * sizeof(float);
      }
    }
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("gemm: out of memory packing a weight");
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("gemm pack: ", e.what_without_backtrace()));
  }
  *out = std::move(impl);
  return PackedWeight();
}

}  // namespace

namespace internal {

void PackPanels(const uint16_t* w, int64_t ld, const uint16_t* up, int64_t ld_up, int64_t n,
                int64_t k, bool gate_up, uint16_t* out, int64_t kpairs, int64_t count) {
  const int64_t panel_elems = kpairs * 2 * kPanelCols;
  ParallelFor(count, 0, 4, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      uint16_t* dst = out + j * panel_elems;
      std::memset(dst, 0, panel_elems * sizeof(uint16_t));
      for (int c = 0; c < kPanelCols; ++c) {
        const uint16_t* src;
        int64_t row;
        if (gate_up) {
          row = j * 16 + (c % 16);
          src = c < 16 ? w + row * ld : up + row * ld_up;
        } else {
          row = j * kPanelCols + c;
          src = w + row * ld;
        }
        if (row >= n) continue;
        for (int64_t kk = 0; kk < k; ++kk) {
          dst[(kk / 2) * 2 * kPanelCols + 2 * c + (kk & 1)] = src[kk];
        }
      }
    }
  });
}

}  // namespace internal

// ---------------------------------------------------------------------------
// Paths

const char* GemmPathName(GemmPath path) {
  switch (path) {
    case GemmPath::kAmx: return "amx";
    case GemmPath::kAvx512Bf16: return "avx512bf16";
    case GemmPath::kTorch: return "torch";
    case GemmPath::kAvx2: return "avx2";
  }
  return "?";
}

absl::StatusOr<GemmPath> ParseGemmPath(std::string_view name) {
  if (name == "auto") return AutoGemmPath();
  for (GemmPath p : {GemmPath::kAmx, GemmPath::kAvx512Bf16, GemmPath::kAvx2, GemmPath::kTorch}) {
    if (name == GemmPathName(p)) return p;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown gemm path '", std::string(name), "'; expected amx, avx512bf16, avx2, torch or auto"));
}

bool GemmPathSupported(GemmPath path, std::string* missing) {
  const CpuFeatures& f = GetCpuFeatures();
  std::string why;
  switch (path) {
    case GemmPath::kTorch:
      return true;
    case GemmPath::kAvx512Bf16:
      if (!(f.fast_bf16_matmul() && f.avx512bf16)) why = "AVX-512 BF16 (with F/BW/VL/DQ)";
      break;
    case GemmPath::kAmx:
      if (!(f.fast_bf16_matmul() && f.avx512bf16)) {
        why = "AVX-512 BF16 (the AMX path's epilogue uses it)";
      } else if (internal::AmxBlockOverride() == nullptr && !RequestAmxPermission(&why)) {
        // why already says it
      }
      break;
    case GemmPath::kAvx2:
      if (!f.avx2_fma()) why = "AVX2 and FMA";
      break;
  }
  if (!why.empty() && !f.isa_cap.empty()) absl::StrAppend(&why, " (VLM_ISA=", f.isa_cap, ")");
  if (!why.empty() && missing != nullptr) *missing = why;
  return why.empty();
}

// --- AMX selection ----------------------------------------------------------
// AMX is never part of AutoGemmPath: it becomes the default only through
// SetDefaultGemmPath, which the services' start-up check (kernel_path.h) calls
// after the AMX path has agreed with avx512bf16 and beaten it on this machine.

GemmPath AutoGemmPath() {
  if (GemmPathSupported(GemmPath::kAvx512Bf16)) return GemmPath::kAvx512Bf16;
  // AVX-512 without BF16 keeps oneDNN's AVX-512 bf16 matmul; below that the
  // AVX2 kernels (oneDNN's bf16 there is ~50x slower than f32).
  if (!GetCpuFeatures().fast_bf16_matmul() && GemmPathSupported(GemmPath::kAvx2)) {
    return GemmPath::kAvx2;
  }
  return GemmPath::kTorch;
}

namespace {

// -1: not yet read from VLM_GEMM_PATH / AutoGemmPath().
std::atomic<int> default_path{-1};
std::atomic<internal::BlockKernel> amx_block_override{nullptr};

}  // namespace

GemmPath DefaultGemmPath() {
  int p = default_path.load(std::memory_order_acquire);
  if (p < 0) {
    static const GemmPath first = ReadDefaultPath();
    int expected = -1;
    default_path.compare_exchange_strong(expected, static_cast<int>(first),
                                         std::memory_order_acq_rel);
    p = default_path.load(std::memory_order_acquire);
  }
  return static_cast<GemmPath>(p);
}

absl::Status SetDefaultGemmPath(GemmPath path) {
  std::string missing;
  if (!GemmPathSupported(path, &missing)) {
    return absl::FailedPreconditionError(
        absl::StrCat("gemm path ", GemmPathName(path), " is not usable here: ", missing));
  }
  default_path.store(static_cast<int>(path), std::memory_order_release);
  return absl::OkStatus();
}

namespace internal {

void SetAmxBlockKernel(BlockKernel kernel) {
  amx_block_override.store(kernel, std::memory_order_release);
}

BlockKernel AmxBlockOverride() { return amx_block_override.load(std::memory_order_acquire); }

}  // namespace internal
// --- end of AMX selection ---------------------------------------------------

// ---------------------------------------------------------------------------
// PackedWeight

absl::StatusOr<PackedWeight> PackedWeight::Pack(const at::Tensor& w, const at::Tensor& bias,
                                                std::optional<GemmPath> path) {
  if (absl::Status s = CheckWeight(w, "weight"); !s.ok()) return s;
  std::shared_ptr<Impl> impl;
  absl::StatusOr<PackedWeight> r = PackImpl(w, at::Tensor(), bias, path, &impl);
  if (!r.ok()) return r.status();
  r->impl_ = std::move(impl);
  return r;
}

absl::StatusOr<PackedWeight> PackedWeight::PackGateUp(const at::Tensor& gate, const at::Tensor& up,
                                                      std::optional<GemmPath> path) {
  if (absl::Status s = CheckWeight(gate, "gate weight"); !s.ok()) return s;
  if (absl::Status s = CheckWeight(up, "up weight"); !s.ok()) return s;
  if (gate.sizes() != up.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat("gate ", gate.toString(), " [", gate.size(0),
                                                   ", ", gate.size(1), "] and up [", up.size(0),
                                                   ", ", up.size(1), "] differ in shape"));
  }
  std::shared_ptr<Impl> impl;
  absl::StatusOr<PackedWeight> r = PackImpl(gate, up, at::Tensor(), path, &impl);
  if (!r.ok()) return r.status();
  r->impl_ = std::move(impl);
  return r;
}

int64_t PackedWeight::n() const { return impl_ ? impl_->n : 0; }
int64_t PackedWeight::k() const { return impl_ ? impl_->k : 0; }
GemmPath PackedWeight::path() const { return impl_ ? impl_->path : GemmPath::kTorch; }
bool PackedWeight::gate_up() const { return impl_ && impl_->gate_up; }
bool PackedWeight::has_bias() const {
  return impl_ && (!impl_->bias.empty() || impl_->bias_tensor.defined());
}
uint64_t PackedWeight::bytes() const { return impl_ ? impl_->bytes : 0; }

const void* PackedWeight::panel_data() const {
  return impl_ != nullptr && impl_->bias.empty() ? impl_->panels : nullptr;
}

uint64_t PackedWeight::panel_bytes() const {
  if (panel_data() == nullptr) return 0;
  return static_cast<uint64_t>(impl_->count * impl_->kpairs * 2 * kPanelCols) * sizeof(uint16_t);
}

uint64_t PackedWeight::PanelBytes(int64_t n, int64_t k, bool gate_up) {
  const int64_t kpairs = (k + 31) / 32 * 16;
  const int64_t count = (n + (gate_up ? 16 : kPanelCols) - 1) / (gate_up ? 16 : kPanelCols);
  return static_cast<uint64_t>(count * kpairs * 2 * kPanelCols) * sizeof(uint16_t);
}

absl::StatusOr<PackedWeight> PackedWeight::FromPanels(int64_t n, int64_t k, bool gate_up,
                                                      GemmPath path, const void* panels,
                                                      uint64_t size,
                                                      std::shared_ptr<const void> owner) {
  if (!IsBlocked(path)) {
    return absl::InvalidArgumentError("gemm: panels need a blocked path, not torch");
  }
  absl::StatusOr<GemmPath> p = ResolvePath(path);
  if (!p.ok()) return p.status();
  if (n < 1 || k < 1 || size != PanelBytes(n, k, gate_up) ||
      reinterpret_cast<uintptr_t>(panels) % 64 != 0 || owner == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gemm: panels of [", n, ", ", k, "]", gate_up ? " gate/up" : "", " need ",
        PanelBytes(n, k, gate_up), " bytes, 64-byte aligned, with an owner; got ", size));
  }
  auto impl = std::make_shared<Impl>();
  impl->path = *p;
  impl->n = n;
  impl->k = k;
  impl->gate_up = gate_up;
  impl->kpairs = (k + 31) / 32 * 16;
  impl->count = (n + (gate_up ? 16 : kPanelCols) - 1) / (gate_up ? 16 : kPanelCols);
  impl->panels = static_cast<uint16_t*>(const_cast<void*>(panels));
  impl->owner = std::move(owner);
  impl->bytes = size;
  PackedWeight w;
  w.impl_ = std::move(impl);
  return w;
}

// ---------------------------------------------------------------------------
// Gemm

namespace {

// Panels per work chunk (256 columns). The block kernel copies a task's rows
// of x once per K block and reuses the copy for every panel of the chunk, so
// a chunk should be several panels; the panels themselves stream from L3
// through L2 and L1 slice by slice (measured on Zen 4, one thread: 8 panels
// beat chunks sized to ~384 KiB, which give 1 panel at K = 4096).
constexpr int64_t kPanelsPerChunk = 8;
// Calls of at most kFewRows rows (decode) stream every weight once and are
// bandwidth-bound: chunks of 2 panels end a call with less imbalance between
// the threads (and walk at most 2 panel streams at once at M = 1). Measured
// in vlm-bench-gemv (chunks of 2 vs 8 panels, one decode step of the 2B, 2
// threads, AMD Zen 4, four runs): 1.04-1.19x faster at M = 1, 0.97-1.03x at
// M = 2 and 4 (noise); at M <= 4 the per-chunk copy of x is at most 6% of the
// chunk's weight bytes. From 5 rows on, 8 panels (M = 8: 2 panels 0.95-1.04x).
constexpr int64_t kFewRows = 4;
constexpr int64_t kFewRowsPanelsPerChunk = 2;
constexpr int64_t kRowsPerTask = 96;  // amx: a multiple of its 32-row blocks
// avx512bf16: at most this many 12-row tiles per task, the M rows cut into
// row blocks of equal tile counts. Each task streams its chunk's panels once
// per row block, and each panel slice is cold in L1 only for a block's first
// tile, so taller blocks waste less (measured on Zen 4 against 8-tile blocks:
// 3-8% less time at M = 1024, the same at M = 256). 24 tiles x 8 panels keep
// a task's f32 sums at 288 KiB and its x slices at 306 KiB, inside a 1 MiB L2.
constexpr int64_t kMaxTilesPerTask = 24;

// Rows per task for `m` rows on `path`: avx512bf16 tiles split evenly over
// the fewest row blocks of at most kMaxTilesPerTask tiles (a block boundary
// never changes what a row computes).
int64_t RowsPerTask(GemmPath path, int64_t m) {
  if (path == GemmPath::kAmx || path == GemmPath::kAvx2) return kRowsPerTask;
  const int64_t tiles = (m + internal::kMicroRows - 1) / internal::kMicroRows;
  const int64_t blocks = (tiles + kMaxTilesPerTask - 1) / kMaxTilesPerTask;
  return (tiles + blocks - 1) / blocks * internal::kMicroRows;
}

absl::Status RunTorch(const at::Tensor& x, const PackedWeight::Impl& w, const at::Tensor& y,
                      const GemmOptions& o) {
  const at::Tensor xb = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16);
  at::Tensor v;
  if (w.gate_up) {
    v = at::silu(at::linear(xb, w.weight).to(at::kFloat)) * at::linear(xb, w.up_weight).to(at::kFloat);
  } else {
    v = at::linear(xb, w.weight).to(at::kFloat);
    if (w.bias_tensor.defined()) v.add_(w.bias_tensor);
    if (o.activation == Activation::kGeluTanh) v = at::gelu(v, "tanh");
    else if (o.activation == Activation::kGeluErf) v = at::gelu(v);
  }
  if (o.residual.defined()) v.add_(o.residual.to(at::kFloat));
  y.copy_(v);
  return absl::OkStatus();
}

}  // namespace

namespace internal {

absl::Status CheckOperands(const at::Tensor& x, int64_t k, int64_t n, at::Tensor* y,
                           const GemmOptions& o) {
  if (!x.defined() || x.device().type() != at::kCPU || x.dim() != 2 ||
      (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gemm: x must be a 2-D bf16 or f32 CPU tensor [M, K]; got ",
        x.defined() ? x.toString() + " " + std::to_string(x.dim()) + "-D" : std::string("undefined")));
  }
  if (x.size(1) != k) {
    return absl::InvalidArgumentError(
        absl::StrCat("gemm: x has K = ", x.size(1), " but the weight has K = ", k));
  }
  const int64_t m = x.size(0);
  if (y == nullptr) return absl::InvalidArgumentError("gemm: output pointer is null");
  if (!y->defined()) {
    if (o.out_dtype != at::kBFloat16 && o.out_dtype != at::kFloat) {
      return absl::InvalidArgumentError("gemm: out_dtype must be bf16 or f32");
    }
    *y = at::empty({m, n}, x.options().dtype(o.out_dtype));
  }
  if (y->device().type() != at::kCPU || y->dim() != 2 || y->size(0) != m || y->size(1) != n ||
      (y->scalar_type() != at::kBFloat16 && y->scalar_type() != at::kFloat) ||
      (n > 1 && y->stride(1) != 1)) {
    return absl::InvalidArgumentError(absl::StrCat("gemm: y must be a bf16 or f32 [", m, ", ", n,
                                                   "] tensor with unit column stride; got ",
                                                   y->toString(), " [", absl::StrJoin(y->sizes(), ", "), "]"));
  }
  if (o.residual.defined()) {
    const at::Tensor& r = o.residual;
    if (r.device().type() != at::kCPU || r.dim() != 2 || r.size(0) != m || r.size(1) != n ||
        (r.scalar_type() != at::kBFloat16 && r.scalar_type() != at::kFloat) ||
        (n > 1 && r.stride(1) != 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gemm: residual must be a bf16 or f32 [", m, ", ", n, "] tensor with unit column stride"));
    }
  }
  return absl::OkStatus();
}

at::Tensor FillProblem(const at::Tensor& x, const at::Tensor& y, const GemmOptions& o,
                       Problem* p) {
  const int64_t m = x.size(0), n = y.size(1);
  // x as contiguous-along-K bf16 rows.
  at::Tensor xb = x;
  if (xb.scalar_type() != at::kBFloat16) xb = xb.to(at::kBFloat16);
  if (xb.stride(1) != 1 || (m > 1 && xb.stride(0) < x.size(1))) xb = xb.contiguous();
  p->x = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  p->ld_x = m > 1 ? xb.stride(0) : x.size(1);
  Epilogue& e = p->epilogue;
  e.activation = o.activation;
  if (o.residual.defined()) {
    e.residual = o.residual.data_ptr();
    e.residual_bf16 = o.residual.scalar_type() == at::kBFloat16;
    e.ld_residual = m > 1 ? o.residual.stride(0) : n;
  }
  e.y = y.data_ptr();
  e.y_bf16 = y.scalar_type() == at::kBFloat16;
  e.ld_y = m > 1 ? y.stride(0) : n;
  e.n = n;
  return xb;
}

void RunBlocked(const Problem& p, int64_t m, GemmPath path, const GemmOptions& o,
                const PanelSource* source) {
  const int64_t count = p.w.count;
  const int64_t chunk = o.panels_per_chunk > 0 ? o.panels_per_chunk
                       : m <= kFewRows       ? kFewRowsPanelsPerChunk
                                             : kPanelsPerChunk;
  const int64_t chunks = (count + chunk - 1) / chunk;
  const int64_t rows_per_task = RowsPerTask(path, m);
  const int64_t row_blocks = (m + rows_per_task - 1) / rows_per_task;
  BlockKernel block = Avx512Bf16Block;
  if (path == GemmPath::kAmx) {
    block = AmxBlockOverride() != nullptr ? AmxBlockOverride() : AmxBlock;
  } else if (path == GemmPath::kAvx2) {
    block = Avx2Block;
  }
  if (source == nullptr) {
    // Task t: row block t / chunks, panel chunk t % chunks. A thread's
    // contiguous share is whole row blocks (its rows of x stay in its L2
    // while the panels stream past), as splitting the rows across threads
    // measured faster than splitting the panels (vlm-bench-gemm, 2 threads);
    // with one row block the chunks are split.
    ParallelFor(chunks * row_blocks, o.threads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / chunks, c = t % chunks;
        block(p, b * rows_per_task, std::min(m, (b + 1) * rows_per_task), c * chunk,
              std::min(count, (c + 1) * chunk));
      }
    });
    return;
  }
  // Made panels: task c makes chunk c once and runs every row block on it
  // (made per row block instead, the conversion cost grows with M).
  ParallelFor(chunks, o.threads, 1, [&](int64_t c0, int64_t c1) {
    thread_local std::vector<uint16_t> panels_buf;
    const int64_t panel_elems = p.w.kpairs * 2 * kPanelCols;
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t j0 = c * chunk, j1 = std::min(count, (c + 1) * chunk);
      panels_buf.resize(static_cast<size_t>((j1 - j0) * panel_elems + 32));
      uint16_t* panels = reinterpret_cast<uint16_t*>(
          (reinterpret_cast<uintptr_t>(panels_buf.data()) + 63) & ~uintptr_t{63});
      source->Fill(j0, j1, panels);
      // The problem seen from the chunk's first output column.
      Problem local = p;
      local.w.data = panels;
      local.w.count = j1 - j0;
      Epilogue& e = local.epilogue;
      const int64_t col0 = j0 * (e.gate_up ? 16 : kPanelCols);
      e.y = static_cast<char*>(e.y) + col0 * (e.y_bf16 ? 2 : 4);
      if (e.residual != nullptr) {
        e.residual = static_cast<const char*>(e.residual) + col0 * (e.residual_bf16 ? 2 : 4);
      }
      if (e.bias != nullptr) e.bias += col0;
      e.n -= col0;
      for (int64_t b = 0; b < row_blocks; ++b) {
        block(local, b * rows_per_task, std::min(m, (b + 1) * rows_per_task), 0, j1 - j0);
      }
    }
  });
}

}  // namespace internal

namespace {

absl::Status GemmImpl(const at::Tensor& x, const PackedWeight& pw, at::Tensor* y,
                      const GemmOptions& o) {
  if (pw.empty()) return absl::InvalidArgumentError("gemm: weight is empty (not packed)");
  const PackedWeight::Impl& w = pw.impl();
  if (w.gate_up != (o.activation == Activation::kSiluMul)) {
    return absl::InvalidArgumentError(
        w.gate_up ? "gemm: a gate/up weight needs Activation::kSiluMul"
                  : "gemm: Activation::kSiluMul needs a weight from PackGateUp");
  }
  if (absl::Status s = internal::CheckOperands(x, w.k, w.n, y, o); !s.ok()) return s;
  if (x.size(0) == 0) return absl::OkStatus();

  GemmPath path = w.path;
  if (o.path.has_value() && *o.path != path) {
    if (IsBlocked(*o.path) != IsBlocked(path)) {
      return absl::InvalidArgumentError(absl::StrCat("gemm: the weight is packed for ",
                                                     GemmPathName(path), ", not for ",
                                                     GemmPathName(*o.path)));
    }
    std::string missing;
    if (!GemmPathSupported(*o.path, &missing)) {
      return absl::FailedPreconditionError(absl::StrCat("gemm path ", GemmPathName(*o.path),
                                                        " is not usable here: ", missing));
    }
    path = *o.path;
  }
  if (!IsBlocked(path)) return RunTorch(x, w, *y, o);

  internal::Problem p;
  const at::Tensor xb = internal::FillProblem(x, *y, o, &p);
  p.w = w.view();
  p.epilogue.bias = w.bias.empty() ? nullptr : w.bias.data();
  p.epilogue.gate_up = w.gate_up;
  internal::RunBlocked(p, x.size(0), path, o);
  return absl::OkStatus();
}

}  // namespace

absl::Status Gemm(const at::Tensor& x, const PackedWeight& w, at::Tensor* y,
                  const GemmOptions& options) {
  try {
    return GemmImpl(x, w, y, options);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("gemm: out of memory");
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("gemm: ", e.what_without_backtrace()));
  }
}

absl::StatusOr<at::Tensor> Gemm(const at::Tensor& x, const PackedWeight& w,
                                const GemmOptions& options) {
  at::Tensor y;
  if (absl::Status s = Gemm(x, w, &y, options); !s.ok()) return s;
  return y;
}

}  // namespace vlm::kernels
