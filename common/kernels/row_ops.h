// Row-invariant elementwise and per-row operations of the decoder's batched
// forward (decoder.h, "Batched forward over a paged KV cache"): RMSNorm, the
// MRoPE cos/sin tables and rotation, residual add and SiLU·up.
//
// Contract: every output row is computed by one thread, in a fixed order, from
// its own input row (and the weights) only; tails use the same vector code as
// the body (masked lanes). So a row's result is bit-identical whatever the
// number of rows, its place among them and at::get_num_threads(): the
// property ATen's ops do not give (a reduction over few rows is split across
// threads; elementwise kernels run a scalar tail at each thread's end).
//
// Arithmetic follows nn:: (common/nn.h) step by step in float32 with the same
// roundings to the compute dtype; sums may be ordered differently, so results
// agree with nn:: to float32 summation order, not bitwise. AVX-512 kernels
// when the CPU has them, portable loops otherwise (fixed per process).
//
// Tensors: contiguous CPU float32 or bfloat16 (x and its output share a
// dtype); shapes in each comment. Bad shapes throw c10::Error. Thread-safe.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace vlm {

// x: [R, n], weight: [n] (x's dtype) -> [R, n]:
// weight · to_dtype(x · rsqrt(mean(x²) + eps)), mean and rsqrt in float32.
at::Tensor RowRmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// x += y, rounded to x's dtype. x, y: [R, n] (same dtype).
void RowAddInPlace(const at::Tensor& x, const at::Tensor& y);

// to_dtype(silu(gate)) · up rounded to the dtype. gate, up: [R, n] -> [R, n].
at::Tensor RowSiluMul(const at::Tensor& gate, const at::Tensor& up);

// MRoPE cos/sin: positions [3, R] int64; inv_freq [D/2] float32; axes[j] the
// axis (0..2) of frequency j -> cos, sin [R, D] float32 with
// emb[r] = [f, f], f[j] = float(positions[axes[j], r]) · inv_freq[j].
void RowCosSin(const at::Tensor& positions, const at::Tensor& inv_freq, const int* axes,
               at::Tensor* cos, at::Tensor* sin);

// y = x·wᵀ, each row's result independent of how many rows share the call.
// x: [N, in], w: [out, in], same dtype -> [N, out] in that dtype. The
// decoder's dense projections (f32 compute, and bf16 with --matmul=torch).
//   f32: kernels::GemmF32 (common/kernels/gemm_f32.h), which sums every
//        output in one fixed order that depends only on `in`: invariant by
//        construction on every CPU, whatever OpenBLAS would pick
//        (OPENBLAS_CORETYPE=Haswell gives f32 rows that change with N).
//   bf16: at::linear (oneDNN) with at least RowLinearMinRows(w) rows (zero
//        rows appended below when x has fewer; they are dropped from y): bf16
//        rows were measured invariant at every row count with LibTorch 1.13.1
//        once small calls are padded to M >= 8 and M·out·in >= 2^18.
// decoder_forward_test checks N = 1..300 on the tiny and the 2B layer shapes,
// 1 and 2 threads, f32 and bf16 (and CI again with OPENBLAS_CORETYPE=Haswell).
int64_t RowLinearMinRows(const at::Tensor& w);
at::Tensor RowLinear(const at::Tensor& x, const at::Tensor& w);

// In place: x[r, h] = to_dtype(x·cos[r] + rotate_half(x)·sin[r]) in float32.
// x: [R, H, D]; cos, sin: [R, D] float32.
void RowRotaryInPlace(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace vlm
