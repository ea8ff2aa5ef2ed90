// Neural-network building blocks shared by the vision tower and the Qwen3
// decoder: norms, linear, activations, rotary embedding and attention. Each
// function computes exactly what the HF reference computes (see
// docs/qwen3-vl-model.md §4-§6); where the reference rounds to the compute
// dtype in between, so do these. Stateless and thread-safe; inputs are never
// modified (weights may be read-only mmap views). Bad shapes throw c10::Error,
// which model code turns into an absl::Status at its boundary.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "absl/types/span.h"

namespace vlm::nn {

// LayerNorm over the last dim with weight and bias: x, weight and bias share a dtype.
at::Tensor LayerNorm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                     double eps);

// Qwen3 RMSNorm over the last dim: mean(x²) and rsqrt in float32, the
// normalised value cast back to x's dtype, then multiplied by `weight`.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// y = x·weightᵀ + bias (bias optional), weight [out, in] in the compute dtype
// (possibly bf16, possibly a read-only view). x is cast to weight's dtype
// first, as HF casts inputs to the weight dtype; y has weight's dtype.
at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight,
                  const at::Tensor& bias = at::Tensor());

// 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715x³))) ("gelu_pytorch_tanh").
at::Tensor GeluTanh(const at::Tensor& x);
// 0.5·x·(1 + erf(x/√2)) (exact GELU).
at::Tensor GeluErf(const at::Tensor& x);
// down(silu(gate(x)) · up(x)), weights [inter, hidden], [inter, hidden], [hidden, inter].
at::Tensor SwiGlu(const at::Tensor& x, const at::Tensor& gate_weight, const at::Tensor& up_weight,
                  const at::Tensor& down_weight);

// [-x[..., D/2:], x[..., :D/2]] (NeoX half split, not interleaved pairs).
at::Tensor RotateHalf(const at::Tensor& x);
// x·cos + RotateHalf(x)·sin computed in float32 and cast back to x's dtype.
// x: [S, heads, D] (token-major); cos, sin: [S, D] float32.
at::Tensor ApplyRotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

struct AttentionOptions {
  double scale = 1.0;  // multiplies q·kᵀ (head_dim^-0.5)
  // Causal: query i sits at absolute position q_offset + i and sees keys
  // 0..q_offset+i (keys are positions 0..Sk-1). Bidirectional when false.
  bool causal = false;
  int64_t q_offset = 0;
  // Queries per tile. The score buffer is at most [heads, query_tile, Sk] in
  // the compute dtype (reused across tiles), so memory is bounded for any Sq.
  int64_t query_tile = 256;
  // Heads are batched into one step while their scores fit this budget
  // (at least one kv head per step): small enough to stay in cache.
  int64_t score_block_bytes = 4 << 20;
};

// Softmax over the last dim of a contiguous float32 or bf16 tensor, in place,
// computed in float32 (for bf16: softmax(x.float()).to(bf16), as HF does with
// softmax(..., dtype=float32); ATen's own bf16 softmax rounds in between).
void SoftmaxInPlace(const at::Tensor& x);

// softmax(q·kᵀ·scale [+ causal mask]) · v per head, softmax in float32, the
// probabilities rounded to the compute dtype before the second matmul (as HF's
// eager attention does). Grouped-query: q head h uses kv head h / (Hq / Hkv).
//   head-major:  q [Hq, Sq, D], k, v [Hkv, Sk, D]  ->  [Hq, Sq, D]
at::Tensor AttentionHeadMajor(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const AttentionOptions& options);
//   token-major: q [Sq, Hq, D], k, v [Sk, Hkv, D]  ->  [Sq, Hq, D]
at::Tensor Attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionOptions& options);
// Block-diagonal attention: rows cu_seqlens[i]..cu_seqlens[i+1] of q, k, v
// (token-major, Sq == Sk == cu_seqlens.back()) attend only to each other.
at::Tensor SegmentedAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              absl::Span<const int64_t> cu_seqlens,
                              const AttentionOptions& options);

// Tests only: use the portable ATen softmax even where the AVX-512 kernel runs.
void ForcePortableSoftmaxForTesting(bool force);

}  // namespace vlm::nn
