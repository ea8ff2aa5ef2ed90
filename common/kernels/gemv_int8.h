// Decode-time matrix-vector products over int8 weights (quantize.h):
// y[b, n] = scale[n] · Σ_blocks d[b, blk] · Σ_{k in blk} xq[b, k]·q[n, k].
//
// Activations are quantized per block of 32 (like llama.cpp's Q8_0):
// d = max|x_blk| / 127, xq = round(x·(1/d)) (both paths compute it alike,
// vectorized on the VNNI path). Per-block rather than per-row
// scales because a decoder's hidden state has a few outlier channels (tens of
// times the rest); one scale per row would spend the 8 bits on them and round
// every other channel of the row coarsely (gemv_int8_test measures both).
//
// Paths: avx512vnni (VPDPBUSD on the stored q + 128 as u8 times xq as s8,
// started from -128·Σxq of each 4-group so the int32 sums are exactly Σ q·xq;
// f32 accumulation of the block-scaled sums) and scalar (the same integer
// sums, summed in order); they agree to f32 rounding.
// VLM_GEMV_INT8_PATH=avx512vnni|scalar|auto forces one for the process.
// Threads: output rows split over common/kernels/thread_pool.h.
// Thread-safe; x and w are only read.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/kernels/quantize.h"

namespace vlm::kernels {

enum class GemvInt8Path { kAvx512Vnni, kScalar };

const char* GemvInt8PathName(GemvInt8Path path);  // "avx512vnni", "scalar"
// Inverse of GemvInt8PathName; "auto" gives the best supported path.
absl::StatusOr<GemvInt8Path> ParseGemvInt8Path(std::string_view name);
bool GemvInt8PathSupported(GemvInt8Path path, std::string* missing = nullptr);
// VLM_GEMV_INT8_PATH when set and supported, else the best supported path.
GemvInt8Path DefaultGemvInt8Path();

struct GemvInt8Options {
  std::optional<GemvInt8Path> path;  // overrides the default; must be supported
  int threads = 0;                   // 0: DefaultThreads()
};

// x: [B, K] bf16 or f32 (B = 1..8 is what it is for; any B works), unit stride
// along K. y: [B, N] f32 or bf16, unit stride along N; allocated as f32 when
// undefined. INVALID_ARGUMENT names a mismatch.
absl::Status GemvInt8(const at::Tensor& x, const QuantizedWeight& w, at::Tensor* y,
                      const GemvInt8Options& options = {});

}  // namespace vlm::kernels
