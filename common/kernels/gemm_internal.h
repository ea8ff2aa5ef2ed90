// Internal to common/kernels: the blocked weight layout and the per-ISA
// block kernels behind Gemm (and the ViT flash attention, which runs its
// QKᵀ and PV products through the same micro-kernel).
//
// Blocked layout: panel j holds output columns 32j..32j+31; for k-pair p
// (K elements 2p, 2p+1) it stores 32 dwords (w[n, 2p], w[n, 2p+1]), columns in
// order: 128 bytes per pair, panel = kpairs·128 bytes, 64-byte aligned.
// kpairs = round_up(K, 32) / 2, the padding zero. For gate/up weights the
// first 16 columns of panel j are gate rows 16j.., the last 16 up rows 16j...
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"

#include "common/kernels/gemm.h"

namespace vlm::kernels::internal {

constexpr int kPanelCols = 32;
constexpr int kMicroRows = 12;  // avx512bf16 rows per register tile

struct Panels {
  const uint16_t* data = nullptr;
  int64_t k = 0;       // logical K
  int64_t kpairs = 0;  // padded pairs per panel (multiple of 16)
  int64_t count = 0;   // number of panels
  const uint16_t* panel(int64_t j) const { return data + j * kpairs * 2 * kPanelCols; }
};

// Where and how a finished f32 tile is stored.
struct Epilogue {
  const float* bias = nullptr;  // [n] or null
  Activation activation = Activation::kNone;
  const void* residual = nullptr;  // [M, n] or null
  bool residual_bf16 = false;
  int64_t ld_residual = 0;
  void* y = nullptr;  // [M, n]
  bool y_bf16 = false;
  int64_t ld_y = 0;
  int64_t n = 0;  // output columns
  bool gate_up = false;
};

// The problem a block kernel sees: x rows (bf16, row stride ld_x elements),
// the panels and the epilogue.
struct Problem {
  const uint16_t* x = nullptr;
  int64_t ld_x = 0;
  Panels w;
  Epilogue epilogue;
};

// Stores acc [rows][32] (row stride 32 floats), the f32 sums of panel `panel`
// for output rows m0.., through the epilogue. Needs AVX-512 BF16.
void StoreTile(const Epilogue& e, int64_t m0, int rows, int64_t panel, const float* acc);

// Rows [m0, m1) x panels [j0, j1) of the problem. avx512bf16: needs AVX-512 BF16.
void Avx512Bf16Block(const Problem& p, int64_t m0, int64_t m1, int64_t j0, int64_t j1);
// The same on AMX tiles; needs AMX-BF16 with tile state granted.
void AmxBlock(const Problem& p, int64_t m0, int64_t m1, int64_t j0, int64_t j1);
// AmxBlock's source compiled against the AMX emulation (amx_emulation.h):
// runs on any CPU with AVX-512 BF16 (for StoreTile). Defined only in the
// test library vlm_amx_emulation.
void EmulatedAmxBlock(const Problem& p, int64_t m0, int64_t m1, int64_t j0, int64_t j1);

// AMX selection. The block kernel behind GemmPath::kAmx is AmxBlock unless
// replaced: tests install EmulatedAmxBlock so the AMX path runs on CPUs
// without AMX; GemmPathSupported(kAmx) then asks only for AVX-512 BF16.
// nullptr restores AmxBlock. Set before any Gemm on the AMX path runs.
using BlockKernel = void (*)(const Problem& p, int64_t m0, int64_t m1, int64_t j0, int64_t j1);
void SetAmxBlockKernel(BlockKernel kernel);
// The replacement installed by SetAmxBlockKernel, or nullptr.
BlockKernel AmxBlockOverride();
// The same with AVX2 + FMA (gemm_avx2.cc; its own epilogue).
void Avx2Block(const Problem& p, int64_t m0, int64_t m1, int64_t j0, int64_t j1);

// acc[rows][32] = x[rows, 0..k) · panel (k ≤ 2·kpairs of the panel), the
// avx512bf16 micro-kernel with the same summation order as Avx512Bf16Block.
void MicroTileAvx512Bf16(const uint16_t* x, int64_t ld_x, int rows, int64_t k,
                         const uint16_t* panel, float* acc);
// The same with AVX2 + FMA and Avx2Block's summation order.
void MicroTileAvx2(const uint16_t* x, int64_t ld_x, int rows, int64_t k, const uint16_t* panel,
                   float* acc);

// Packs w [n_rows, K] (bf16 bits, row stride ld) into panels (gate_up: gate
// and up interleaved by 16). `out` has count·kpairs·64 uint16 slots.
void PackPanels(const uint16_t* w, int64_t ld, const uint16_t* up, int64_t ld_up, int64_t n,
                int64_t k, bool gate_up, uint16_t* out, int64_t kpairs, int64_t count);

// Panels made on demand rather than stored (int8 weights): Fill writes panels
// [j0, j1) of the problem's layout (kpairs per panel, as Panels) to `out`,
// (j1 - j0) panels back to back. Called concurrently from the pool's threads.
class PanelSource {
 public:
  virtual ~PanelSource() = default;
  virtual void Fill(int64_t j0, int64_t j1, uint16_t* out) const = 0;
};

// Checks x [M, K], y [M, N] (allocated when undefined) and o.residual for a
// product with a [N, K] weight; INVALID_ARGUMENT names the mismatch.
absl::Status CheckOperands(const at::Tensor& x, int64_t k, int64_t n, at::Tensor* y,
                           const GemmOptions& o);
// Fills p's x (bf16 rows, unit stride along K) and its epilogue from checked
// operands, all but bias and gate_up. Returns the tensor p.x points into
// (x itself or a bf16 copy), which must outlive the run.
at::Tensor FillProblem(const at::Tensor& x, const at::Tensor& y, const GemmOptions& o,
                       Problem* p);
// Gemm's work split over the pool: tasks of (row block, chunk of panels) of
// the m rows and p.w.count panels, each through path's block kernel (amx or
// avx512bf16). With a source, p.w.data is not read: each task first fills its
// chunk's panels into a buffer of its thread and runs on them, so the
// result is the same as with those panels stored.
void RunBlocked(const Problem& p, int64_t m, GemmPath path, const GemmOptions& o,
                const PanelSource* source = nullptr);

}  // namespace vlm::kernels::internal
