// Block-diagonal attention for the ViT, flash-attention style: per (image
// segment, head, block of 48 queries) the scores of 128 keys at a time
// (QKᵀ on the bf16 GEMM micro-kernel), an online softmax in f32 (running
// max and sum, earlier output rescaled), and P·V accumulated in f32; the
// score matrix never exists beyond one 48x128 tile. Keys and values of each
// (segment, head) are packed once into the GEMM's blocked layout.
//
// Numerics: softmax(q·kᵀ·scale)·v with scores and softmax in f32; the
// unnormalised probabilities are rounded to bf16 for the P·V product (as the
// reference rounds the normalised ones), the output is divided by the row sum
// in f32 and rounded once to bf16. Runs on AVX-512 BF16 or, without it, on
// AVX2 + FMA (bf16 widened to f32 in registers; FlashAttentionSupported).
// Thread-safe; work is split over common/kernels/thread_pool.h.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace vlm::kernels {

// True when this CPU runs the kernel (AVX-512 BF16, or AVX2 + FMA).
bool FlashAttentionSupported();

// q, k, v: [N, H, D] bf16, unit stride along D (any strides on N and H, e.g.
// views into a fused qkv tensor). Rows cu_seqlens[i]..cu_seqlens[i+1] attend
// only to each other (bidirectional); cu_seqlens runs from 0 to N and never
// decreases. Returns [N, H, D] bf16. INVALID_ARGUMENT names a bad shape,
// dtype or segment list; FAILED_PRECONDITION when !FlashAttentionSupported().
absl::StatusOr<at::Tensor> SegmentedFlashAttention(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v,
                                                   absl::Span<const int64_t> cu_seqlens,
                                                   double scale, int threads = 0);

}  // namespace vlm::kernels
