// Attention of one new token over a sequence's KV cache (the decode step's
// attention, spec §5.2): softmax(q·kᵀ·scale)·v per head, grouped-query (query
// head i reads kv head i / (Hq / Hkv)), no mask (the token sees every cached
// key, itself included).
//
// The arithmetic follows nn::Attention step by step, so a decode step and a
// one-token prefill agree: q·scale rounded to q's dtype, scores rounded to
// q's dtype then a float32 softmax, probabilities rounded to q's dtype, sums
// in float32, the output rounded once. For bf16 on AVX-512 CPUs a dedicated
// kernel reads the cache in place (LibTorch's bf16 batched matmul over these
// shapes is ~20x slower than the memory they read); other cases use ATen.
//
// Thread-safe; heads are split over at::get_num_threads() threads.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace vlm::language {

// q: [Hq, D]; k_cache, v_cache: [Hkv, capacity, D] with unit stride along D
// (any capacity); the first `length` positions are used. Returns [Hq, D] in
// q's dtype. Throws c10::Error on shape mismatch.
at::Tensor DecodeAttention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, int64_t length, double scale);

// The ATen formulation of the same computation (the fallback; exposed for tests).
at::Tensor DecodeAttentionReference(const at::Tensor& q, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache, int64_t length, double scale);

// Whether DecodeAttention uses the AVX-512 kernel for this dtype and head_dim.
bool DecodeAttentionHasKernel(at::ScalarType dtype, int64_t head_dim);

}  // namespace vlm::language
