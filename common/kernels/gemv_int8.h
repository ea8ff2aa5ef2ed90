// Matrix products over int8 weights (quantize.h), decode steps and prefill chunks:
// y[b, n] = row_scale[n] · Σ_groups ratio[n, g]·d[b, g] · Σ_{k in g} xq[b, k]·q[n, k].
//
// Activations are quantized to int16 per group of 32 (the weights' groups):
// d = max|x_g| / 32639, xq = round(x·(1/d)) (32639 = 127·256 + 127: xq splits
// into two int8 parts, xq = 256·hi + lo). 16 bits rather than 8 because
// 8-bit activations (like llama.cpp's Q8_0 dot products) cost as much
// fidelity as the weights' own rounding (logits cosine 0.9994 against bf16 on
// the synthetic 2B checkpoint with exact weights; 16 bits: 0.9998, the bf16
// noise floor; scripts/bench/int8_fidelity.py). Per-group rather than
// per-row scales because a decoder's hidden state has outlier channels.
//
// Paths: avx512vnni (VPDPBUSD of the stored q + 128 with hi and with lo, the
// +128 cancelled by -128·Σxq: exact int32 sums per group, scaled and summed in
// f32; two VPDPBUSD per 64 weights, no widening of the weights) and scalar
// (the same integer sums, scaled and summed in order); they agree to f32
// rounding. VLM_GEMV_INT8_PATH=avx512vnni|scalar|auto forces one for the process.
// Each batch row's result is independent of the other rows in the call and of
// the batch size (bit for bit on each path): a prefill chunk's rows equal
// what 1-row decode calls give.
// Batches of up to 8 rows (decode) stream each weight row once per call with
// software prefetch into L2; larger ones (prefill) quantize all rows once and walk
// the weights in blocks of 64 rows that stay in L2, each block serving every
// batch row, so the weights also come from DRAM once per call. (The decoder
// prefills int8 layers on GemmInt8, gemm.h, unless told otherwise: from about
// 30 rows on, the bf16 micro-kernel on converted panels is faster.)
// Threads: output rows split over common/kernels/thread_pool.h (prefill also
// splits the quantization of x by rows).
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

// x: [B, K] bf16 or f32, any B, unit stride along K. y: [B, N] f32 or bf16, unit stride along N; allocated as f32 when
// undefined. INVALID_ARGUMENT names a mismatch.
absl::Status GemvInt8(const at::Tensor& x, const QuantizedWeight& w, at::Tensor* y,
                      const GemvInt8Options& options = {});

}  // namespace vlm::kernels
