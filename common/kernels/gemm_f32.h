// f32 matrix product y = x·wᵀ whose every output element is summed in one
// fixed order that depends only on K: never on the row count M, a row's place
// in x, the thread split or the instruction set. So a row of y is
// bit-identical whatever batch it is computed in, and identical on every path
// of this file. The f32 decoder's projections run on it (services/language/
// row_ops.h RowLinear): f32 is the fidelity path, and its batch invariance
// must not depend on which kernels OpenBLAS picks (OPENBLAS_CORETYPE=Haswell
// gives f32 GEMM rows that change with M; at::linear makes no promise).
//
// The order ("16 lanes, then a fixed tree"): for y[m, n] = Σ_k x[m, k]·w[n, k],
//   a_j = fma(x[m, k], w[n, k], a_j) for k = j, j + 16, j + 32, ... < K, in
//         increasing k, from a_j = +0 (j = 0..15; a K not a multiple of 16
//         ends with one step over zero-padded lanes, fma(0, 0, a_j));
//   b_j = a_j + a_{j+8} (j < 8), c_j = b_j + b_{j+4} (j < 4),
//   d_j = c_j + c_{j+2} (j < 2), y = d_0 + d_1.
// Each fma and add is one IEEE f32 operation rounded to nearest, so every path
// that follows the order gives the same bits (with the default MXCSR: no
// flush-to-zero).
//
// Why dot products along K rather than a packed, column-broadcast GEMM: w is
// used as it is stored ([N, K] rows, e.g. read-only checkpoint views), with no
// per-call packing, so decode rows (M of 1..8, bound by reading w once) cost
// no more than reading w, and prefill rows reuse each w row for a register
// block of rows.
//
// Paths (GemmF32Path), chosen at run time:
//   avx512  AVX-512: one zmm accumulator (the 16 lanes) per output, register
//           blocks of 4 rows x 4 columns.
//   avx2    AVX2 + FMA: two ymm accumulators per output (lanes 0-7 and 8-15),
//           blocks of 2 rows x 3 columns.
//   scalar  portable: the 16 lanes in an array, std::fma (slow without FMA
//           hardware; the reference the tests compare the others against).
// VLM_GEMM_F32_PATH=avx512|avx2|scalar|auto forces the process default (read
// once; an unusable value is reported on stderr and ignored).
//
// Threads: output columns split over common/kernels/thread_pool.h (an output
// is computed whole by one task, so the split never changes a result).
// Thread-safe; x and w are only read.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vlm::kernels {

enum class GemmF32Path { kAvx512, kAvx2, kScalar };

const char* GemmF32PathName(GemmF32Path path);  // "avx512", "avx2", "scalar"
// Inverse of GemmF32PathName; "auto" gives the best supported path.
absl::StatusOr<GemmF32Path> ParseGemmF32Path(std::string_view name);
// Whether this CPU can run `path`; if not, `missing` names what it lacks.
bool GemmF32PathSupported(GemmF32Path path, std::string* missing = nullptr);
// VLM_GEMM_F32_PATH at first use when set and supported, else the best supported path.
GemmF32Path DefaultGemmF32Path();

struct GemmF32Options {
  std::optional<GemmF32Path> path;  // overrides the default; must be supported
  int threads = 0;                  // threads (the caller included); 0: DefaultThreads()
};

// The product on raw memory: y[m·ld_y + n] = Σ_k x[m·ld_x + k]·w[n·ld_w + k]
// for m < M, n < N, summed in the order above. y must not overlap x or w.
// `path` must be supported.
void GemmF32Raw(const float* x, int64_t ld_x, const float* w, int64_t ld_w, float* y,
                int64_t ld_y, int64_t m, int64_t n, int64_t k, GemmF32Path path, int threads);

// y = x·wᵀ. x: [M, K] f32, w: [N, K] f32, both with unit stride along K (any
// row stride); y: [M, N] f32 with unit stride along N, not overlapping x or w,
// allocated when undefined. INVALID_ARGUMENT names a shape, dtype or stride
// mismatch; FAILED_PRECONDITION an unsupported path.
absl::Status GemmF32(const at::Tensor& x, const at::Tensor& w, at::Tensor* y,
                     const GemmF32Options& options = {});
absl::StatusOr<at::Tensor> GemmF32(const at::Tensor& x, const at::Tensor& w,
                                   const GemmF32Options& options = {});

}  // namespace vlm::kernels
