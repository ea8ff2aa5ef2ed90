// Matrix products over 4-bit weights (quantize_int4.h).
//
// GemvInt4 (decode steps, 1-8 rows; any number works):
// y[b, n] = row_scale[n] · Σ_groups ratio[n, g]·d[b, g] · Σ_{k in g} xq[b, k]·(u[n, k] - z[n, g]).
// Activations are quantized to int8 per group of 32: d = max|x_g| / 127,
// xq = round(x / d). GemvInt8 keeps 16 bits (its weights' rounding is small
// enough for 8-bit activations to matter); here the weights' 4-bit rounding is
// about 20x the activations' in magnitude (relative RMS 8% against 0.2%), so
// 8 bits cost nothing measurable (vlm-bench-decoder --fidelity: int4 vs bf16
// on the dequantized weights, cosine 0.9999 either way on tiny) and halve the
// dot products: one VPDPBUSD per 64 weights, the same work per byte as
// GemvInt8, so decode stays bound by memory rather than by the multiplies.
// Per group the integer sum Σ u·xq - z·Σ xq is exact on every path.
//
// Paths: avx512vnni (one 64-byte load holds 128 weights of 16 groups, one per
// dword lane: nibbles unpacked in registers by a shift and two ANDs, two
// VPDPBUSD per load), avx2 (the same lanes in two halves of 8 groups, VPMADDUBSW
// + VPMADDWD) and scalar (the reference). All three give the same bits: the
// integer sums are exact, and the f32 part is the same operations in the same
// order on each path -- per lane l of a block of 16 groups one FMA
// acc[l] += f32(isum)·(ratio·d), then a fixed tree over the 16 lanes, then
// the groups after the last full block, then the row scale. So every batch
// row's result is also independent of the batch and of the threads.
// VLM_GEMV_INT4_PATH=avx512vnni|avx2|scalar|auto forces one for the process
// (VLM_ISA caps the CPU features it may use, as for the other kernels).
// Output rows split over common/kernels/thread_pool.h in tasks of 64.
//
// GemmInt4 (prefill chunks): the blocked bf16 GEMM (gemm.h) on panels made
// per task from the 4-bit weights (as GemmInt8 does): each weight becomes
// bf16(scale·(u - z)), so the result equals Gemm on the dequantized weight
// (DequantizeInt4 rounded to bf16) bit for bit on the same path.
// Thread-safe; x and w are only read.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/kernels/gemm.h"
#include "common/kernels/quantize_int4.h"

namespace vlm::kernels {

enum class GemvInt4Path { kAvx512Vnni, kAvx2, kScalar };

const char* GemvInt4PathName(GemvInt4Path path);  // "avx512vnni", "avx2", "scalar"
// Inverse of GemvInt4PathName; "auto" gives the best supported path.
absl::StatusOr<GemvInt4Path> ParseGemvInt4Path(std::string_view name);
bool GemvInt4PathSupported(GemvInt4Path path, std::string* missing = nullptr);
// VLM_GEMV_INT4_PATH when set and supported, else the best supported path.
GemvInt4Path DefaultGemvInt4Path();

struct GemvInt4Options {
  std::optional<GemvInt4Path> path;  // overrides the default; must be supported
  int threads = 0;                   // 0: DefaultThreads()
};

// x: [B, K] bf16 or f32, unit stride along K. y: [B, N] f32 or bf16,
// contiguous; allocated as f32 when undefined. INVALID_ARGUMENT names a mismatch.
absl::Status GemvInt4(const at::Tensor& x, const Int4Weight& w, at::Tensor* y,
                      const GemvInt4Options& options = {});

// y = act(x·wᵀ + bias) + residual with the options of Gemm (gemm.h);
// Activation::kSiluMul takes w as gate rows [0, I) and up rows [I, 2I) and
// gives [M, I]. Paths amx, avx512bf16 and avx2 (the panels made without
// AVX-512 on avx2); torch is FAILED_PRECONDITION.
absl::Status GemmInt4(const at::Tensor& x, const Int4Weight& w, at::Tensor* y,
                      const GemmOptions& options = {});

}  // namespace vlm::kernels
