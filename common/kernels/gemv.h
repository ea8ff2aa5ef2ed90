// Decode-time matrix-vector products over bf16 weights: y = x·wᵀ for a few
// input rows, the step that bounds decode speed (every weight byte is read once
// per token). The instruction set is chosen at run time; weights are only read,
// so read-only mmap views are fine.
//
// Paths, best first: AVX-512 BF16 (VDPBF16PS), AVX-512 (bf16 -> f32 by shift,
// FMA), AVX2 (same, 256-bit), portable scalar. All accumulate in f32 over x
// rounded to bf16 (as LibTorch's bf16 linear does), so they agree with
// at::matmul in f32 on the same bf16 values up to f32 summation order.
// VLM_GEMV_PATH=avx512bf16|avx512|avx2|scalar|auto forces a path for the process;
// VLM_ISA (common/cpu_features.h) caps which paths count as supported.
//
// Threads: the output rows are split over at::get_num_threads() threads of
// the kernels' process-wide pool (common/kernels/thread_pool.h): the caller
// plus workers that spin for about 1 ms after a call (a decode step makes
// ~200 calls back to back) and then sleep. A call never waits for a worker
// that has not started on it, so a descheduled worker costs its share of
// time, not a stall. Thread-safe; concurrent calls from several threads run
// one at a time on the workers, the others alone.
// x86-64 only (the scalar path is portable code, but the file includes
// <immintrin.h>). AVX-512 BF16 treats denormal bf16 inputs as zero.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace at {
class Tensor;
}

namespace vlm {

enum class GemvPath { kAvx512Bf16, kAvx512, kAvx2, kScalar };

// "avx512bf16", "avx512", "avx2", "scalar".
const char* GemvPathName(GemvPath path);
// Inverse of GemvPathName; "auto" gives the best path this CPU supports.
absl::StatusOr<GemvPath> ParseGemvPath(std::string_view name);
// Whether this CPU (and OS) can run `path`; if not, `missing` names the lacking feature.
bool GemvPathSupported(GemvPath path, std::string* missing = nullptr);
// The path Gemv uses by default: VLM_GEMV_PATH at first use (an unsupported or
// unknown value is reported on stderr and ignored), else the best supported.
GemvPath DefaultGemvPath();

struct GemvOptions {
  // y += x·wᵀ (bf16 y: rounded once after adding the f32 sum) instead of y = x·wᵀ.
  bool accumulate = false;
  // Overrides DefaultGemvPath() for this call; must be supported.
  std::optional<GemvPath> path;
};

// y = x·wᵀ.
//   x: [B, in] bf16 or f32 (f32 is rounded to bf16 first); meant for B <= 8.
//   w: [out, in] bf16, unit stride along `in` (any row stride); never written.
//   y: [B, out] f32 or bf16, contiguous, not overlapping x or w; when undefined
//      (and not accumulating) it is allocated with x's dtype.
absl::Status Gemv(const at::Tensor& x, const at::Tensor& w, at::Tensor* y,
                  const GemvOptions& options = {});

// Several weights sharing one input in a single parallel pass (q/k/v,
// gate/up): ys[i] = x·ws[i]ᵀ, each as in Gemv.
absl::Status GemvMulti(const at::Tensor& x, absl::Span<const at::Tensor> ws,
                       absl::Span<at::Tensor* const> ys, const GemvOptions& options = {});

}  // namespace vlm
