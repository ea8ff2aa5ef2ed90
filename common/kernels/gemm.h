// Matrix multiply for prefill and the ViT: y = epilogue(x·wᵀ) with bf16
// activations, weights prepacked once into the kernels' blocked layout, f32
// accumulation, and the elementwise work that follows a linear layer fused
// into the store (bias, GELU, SiLU·up, residual add).
//
// Paths, chosen at run time (GemmPath):
//   avx512bf16  VDPBF16PS micro-kernel, 12 rows x 32 columns in registers; every
//               CPU with AVX-512 BF16 (AMD Zen 4/5, Intel Cooper Lake and later).
//               K runs in blocks of 512: per block x's rows are copied once
//               (a row stride that keeps a tile's rows in distinct L1 sets) and
//               each 16 KiB panel slice serves every row tile from L1; calls of
//               fewer than 12 rows walk each panel over the whole K instead.
//   amx         AMX-BF16 tiles (TDPBF16PS, 32x32 output blocks); Sapphire Rapids and
//               later, after the kernel grants tile state (arch_prctl). Shares the
//               blocked layout with avx512bf16. Not in AutoGemmPath(): a service
//               makes it the default only after its start-up check (kernel_path.h)
//               found it agreeing with avx512bf16 and faster; VLM_GEMM_PATH=amx or
//               --kernel_path=amx forces it. Tests run it on any AVX-512 BF16 CPU
//               through the AMX emulation (amx_emulation.h).
//   avx2        AVX2 + FMA micro-kernel (gemm_avx2.cc) over the same panels: bf16
//               widened to f32 in registers (a 16-bit shift), 4 rows x 16 columns
//               of f32 FMAs; for CPUs without AVX-512 (chosen automatically when
//               AVX-512 BW/VL/DQ is absent), so bf16 weights stay bf16 there.
//   torch       at::linear in bf16 (oneDNN) plus ATen ops for the epilogue; the last
//               resort (AVX-512 without BF16, or no AVX2).
// VLM_GEMM_PATH=amx|avx512bf16|avx2|torch|auto overrides the choice for the process
// (read once; an unusable value is reported on stderr and ignored). VLM_ISA
// (common/cpu_features.h) caps what counts as supported.
//
// Row invariance (avx512bf16, amx and avx2): an output element's K-summation order
// depends only on K, never on M, on the row's position in x, or on the thread
// split, so a row of y is bit-identical whatever batch it is computed in. The
// torch path makes no such promise.
//
// Denormal bf16 inputs count as zero (VDPBF16PS and TDPBF16PS flush them).
// Thread-safety: PackedWeight is immutable after Pack; Gemm may run
// concurrently on the same weight. Threads: common/kernels/thread_pool.h.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vlm::kernels {

enum class GemmPath { kAmx, kAvx512Bf16, kTorch, kAvx2 };

// "amx", "avx512bf16", "torch", "avx2".
const char* GemmPathName(GemmPath path);
// Inverse of GemmPathName; "auto" gives AutoGemmPath().
absl::StatusOr<GemmPath> ParseGemmPath(std::string_view name);
// Whether this CPU and OS can run `path` (amx: also asks the kernel for tile
// state, once per process); if not, `missing` says what is lacking.
bool GemmPathSupported(GemmPath path, std::string* missing = nullptr);
// The best supported path that needs no check at run time: avx512bf16, else
// torch (amx only through SetDefaultGemmPath).
GemmPath AutoGemmPath();
// The process's default: what SetDefaultGemmPath set, else VLM_GEMM_PATH when
// set and supported, else AutoGemmPath(). Read by Pack and GemmInt8 when no
// path is given.
GemmPath DefaultGemmPath();
// Replaces the process's default path (the services' start-up choice,
// kernel_path.h). Weights packed earlier keep their path. FAILED_PRECONDITION
// when `path` is not supported here.
absl::Status SetDefaultGemmPath(GemmPath path);

enum class Activation {
  kNone,
  kGeluTanh,  // 0.5·v·(1 + tanh(√(2/π)·(v + 0.044715·v³)))  ("gelu_pytorch_tanh")
  kGeluErf,   // 0.5·v·(1 + erf(v/√2))                         ("gelu")
  kSiluMul,   // silu(x·gateᵀ)·(x·upᵀ); only for weights from PackGateUp
};

// A weight [N, K] in the layout of one path family: blocked panels for
// avx512bf16/amx (32 columns x K, k-pairs interleaved as VDPBF16PS and the AMX
// B tile read them; K padded to a multiple of 32 with zeros), or the bf16
// tensor itself for torch. Owns its memory; copies share it (immutable).
class PackedWeight {
 public:
  // w: [N, K] bf16 or f32 (f32 is rounded to bf16), any strides; bias:
  // undefined or [N] floating point (kept in f32). path: DefaultGemmPath()
  // when unset; must be supported.
  static absl::StatusOr<PackedWeight> Pack(const at::Tensor& w, const at::Tensor& bias = {},
                                           std::optional<GemmPath> path = std::nullopt);
  // gate, up: [I, K] each. Gemm with Activation::kSiluMul then gives
  // silu(x·gateᵀ)·(x·upᵀ) [M, I] in one pass over x.
  static absl::StatusOr<PackedWeight> PackGateUp(const at::Tensor& gate, const at::Tensor& up,
                                                 std::optional<GemmPath> path = std::nullopt);

  PackedWeight() = default;
  bool empty() const { return impl_ == nullptr; }
  int64_t n() const;  // output columns (I for gate/up)
  int64_t k() const;
  GemmPath path() const;
  bool gate_up() const;
  bool has_bias() const;
  // Bytes this weight holds in memory (panels, bias, any converted copy), for
  // the callers' weight accounting. A borrowed bf16 tensor (torch path) is not counted.
  uint64_t bytes() const;

  // The blocked layout's panels as one flat array (empty for the torch path
  // and for weights with a bias), for writing them to a file; FromPanels
  // makes a weight over such panels held elsewhere (a read-only file mapping
  // that `owner` keeps alive), on `path` (a blocked path, supported).
  // INVALID_ARGUMENT when `size` is not PanelBytes(n, k, gate_up) or `panels`
  // is not 64-byte aligned. Never written through.
  const void* panel_data() const;
  uint64_t panel_bytes() const;
  static uint64_t PanelBytes(int64_t n, int64_t k, bool gate_up);
  static absl::StatusOr<PackedWeight> FromPanels(int64_t n, int64_t k, bool gate_up,
                                                 GemmPath path, const void* panels,
                                                 uint64_t size, std::shared_ptr<const void> owner);

  struct Impl;
  const Impl& impl() const { return *impl_; }

 private:
  std::shared_ptr<const Impl> impl_;
};

struct GemmOptions {
  Activation activation = Activation::kNone;
  // Optional [M, N] f32 or bf16 (unit stride along N): y = act(x·wᵀ + bias) + residual.
  // May be the same tensor as *y (in-place residual update).
  at::Tensor residual;
  // dtype of y when *y is undefined: bf16 or f32.
  at::ScalarType out_dtype = at::kBFloat16;
  // Run on another path of the weight's layout family (amx <-> avx512bf16);
  // must be supported.
  std::optional<GemmPath> path;
  // Threads (the caller included); 0: DefaultThreads().
  int threads = 0;
  // Panels (32 output columns each) per work chunk; 0: automatic (2 for at
  // most 4 rows, else 8). For side-by-side benchmarks; never changes a result.
  int panels_per_chunk = 0;
};

// y = act(x·wᵀ + bias) + residual, summed in f32, rounded once to y's dtype.
//   x: [M, K] bf16 or f32 (f32 rounded to bf16 first), unit stride along K.
//   y: [M, N] f32 or bf16, unit stride along N, not overlapping x; allocated
//      (options.out_dtype) when undefined.
// INVALID_ARGUMENT names a shape, dtype or option mismatch; FAILED_PRECONDITION
// an unsupported path.
absl::Status Gemm(const at::Tensor& x, const PackedWeight& w, at::Tensor* y,
                  const GemmOptions& options = {});
absl::StatusOr<at::Tensor> Gemm(const at::Tensor& x, const PackedWeight& w,
                                const GemmOptions& options = {});

class QuantizedWeight;  // quantize.h

// The same product over int8 weights (quantize.h), for prefill rows: the
// weight is ŵ = bf16(scale·q), made panel by panel as the tasks need it
// (each task converts its chunk of panels into a buffer of its thread; the
// int8 weight stays the only copy in memory) and multiplied by the blocked
// path's micro-kernel. The result is bit-identical to Gemm on
// PackedWeight::Pack(DequantizeInt8(w)) (and PackGateUp of its two halves
// for kSiluMul). Why: prefill is bound by multiply throughput, not bytes, and
// the bf16 micro-kernel does 32 multiply-adds per instruction where int8
// weights with int16 activations (GemvInt8) need two VPDPBUSD per 64 weights
// and a scale epilogue per group: the same count, at a lower measured share
// of the peak. Conversion costs about 0.5 instructions per weight per row
// block, small next to M·K·N/16 multiply instructions from a dozen rows on.
//   kSiluMul: w holds the gate rows [0, I) then the up rows [I, 2I), y is
//   [M, I]. No bias. options.path (default: DefaultGemmPath()) must be a
//   blocked path (amx or avx512bf16) and supported: FAILED_PRECONDITION
//   otherwise (callers fall back to GemvInt8).
absl::Status GemmInt8(const at::Tensor& x, const QuantizedWeight& w, at::Tensor* y,
                      const GemmOptions& options = {});

}  // namespace vlm::kernels
