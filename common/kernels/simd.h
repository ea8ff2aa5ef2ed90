// Internal to common/kernels (and common/nn.cc): the instruction-set targets
// kernel code is compiled for, and the bf16 <-> f32 conversions (scalar,
// AVX2, AVX-512; masked and unmasked loads and stores) every kernel shares.
//
// One target macro per dispatch level. Code compiled for a level runs only
// where the dispatch found the CpuFeatures (cpu_features.h) on the right:
//   VLM_TARGET_AVX2         avx2, fma                         avx2_fma()
//   VLM_TARGET_AVX512       avx512 f, bw, vl, dq              fast_bf16_matmul()
//   VLM_TARGET_AVX512_BF16  VLM_TARGET_AVX512 + avx512bf16    ... && avx512bf16
//   VLM_TARGET_AVX512_VNNI  VLM_TARGET_AVX512 + avx512vnni    ... && avx512vnni
//   VLM_TARGET_AVX512_F16C  VLM_TARGET_AVX512 + f16c          ... && f16c
//                           (code converting c10::Half inside)
// The helpers below are always_inline and compiled for the lowest level they
// need, so they inline into any kernel of that level or one above it.
//
// Rounding f32 -> bf16: to nearest even, NaN -> the quiet NaN 0x7FC0,
// denormals kept: c10::BFloat16's rule, bit for bit. The AVX-512 BF16
// instruction (Bf16x16Native) rounds to nearest even too but flushes denormal
// inputs to zero and keeps NaN payloads; only the kernels that always used it
// call it. bf16 -> f32 is exact.
#pragma once

#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

// GCC 12's AVX-512 headers build "undefined" vectors by self-initialization
// and then warn about them where they are inlined; silence only that header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#define VLM_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define VLM_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define VLM_TARGET_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define VLM_TARGET_AVX512_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define VLM_TARGET_AVX512_F16C __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))

#define VLM_INLINE_AVX2 __attribute__((target("avx2,fma"), always_inline)) inline
#define VLM_INLINE_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), always_inline)) inline
#define VLM_INLINE_AVX512_BF16                                                              \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"), always_inline)) \
  inline

namespace vlm::kernels::simd {

// ---------------------------------------------------------------------------
// Scalar.

inline float Bf16ToF32(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float ToF32(float v) { return v; }
inline float ToF32(c10::BFloat16 v) { return static_cast<float>(v); }

// ---------------------------------------------------------------------------
// AVX2: 8 lanes. `valid` (1..8) is how many lanes are read or written; the
// others load as zero.

VLM_INLINE_AVX2 __m256 WidenBf16x8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// f32 -> bf16 bits (8 words, in order).
VLM_INLINE_AVX2 __m128i Bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // 8 dwords (each < 2^16) -> 8 words in order.
  const __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane: w0-3 w0-3 | w4-7 w4-7
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xD8));
}

VLM_INLINE_AVX2 __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
VLM_INLINE_AVX2 __m256 Load8(const uint16_t* p) {
  return WidenBf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
VLM_INLINE_AVX2 __m256 Load8(const float* p, int valid) {
  if (valid == 8) return _mm256_loadu_ps(p);
  alignas(32) float tmp[8] = {};
  std::memcpy(tmp, p, valid * sizeof(float));
  return _mm256_load_ps(tmp);
}
VLM_INLINE_AVX2 __m256 Load8(const uint16_t* p, int valid) {
  if (valid == 8) return Load8(p);
  alignas(16) uint16_t tmp[8] = {};
  std::memcpy(tmp, p, valid * sizeof(uint16_t));
  return WidenBf16x8(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
}

VLM_INLINE_AVX2 void Store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
VLM_INLINE_AVX2 void Store8(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), Bf16x8(v));
}
VLM_INLINE_AVX2 void Store8(float* p, __m256 v, int valid) {
  if (valid == 8) return _mm256_storeu_ps(p, v);
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  std::memcpy(p, tmp, valid * sizeof(float));
}
VLM_INLINE_AVX2 void Store8(uint16_t* p, __m256 v, int valid) {
  if (valid == 8) return Store8(p, v);
  alignas(16) uint16_t tmp[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), Bf16x8(v));
  std::memcpy(p, tmp, valid * sizeof(uint16_t));
}

// ---------------------------------------------------------------------------
// AVX-512: 16 lanes. Masked forms read and write only the lanes in the mask;
// the others load as zero.

// The first `valid` lanes (none for valid <= 0, all for valid >= 16).
VLM_INLINE_AVX512 __mmask16 Mask16(int64_t valid) {
  return valid >= 16 ? static_cast<__mmask16>(0xFFFF)
                     : static_cast<__mmask16>((1u << (valid > 0 ? valid : 0)) - 1u);
}

VLM_INLINE_AVX512 __m512 WidenBf16x16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// f32 -> bf16 bits (16 words, in order).
VLM_INLINE_AVX512 __m256i Bf16x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// v rounded to bf16 and widened back: what a bf16 store then load gives.
VLM_INLINE_AVX512 __m512 RoundBf16(__m512 v) { return WidenBf16x16(Bf16x16(v)); }

VLM_INLINE_AVX512 __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
VLM_INLINE_AVX512 __m512 Load16(const uint16_t* p) {
  return WidenBf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
VLM_INLINE_AVX512 __m512 Load16(const c10::BFloat16* p) {
  return Load16(reinterpret_cast<const uint16_t*>(p));
}
VLM_INLINE_AVX512 __m512 Load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
VLM_INLINE_AVX512 __m512 Load16(const uint16_t* p, __mmask16 m) {
  return WidenBf16x16(_mm256_maskz_loadu_epi16(m, p));
}
VLM_INLINE_AVX512 __m512 Load16(const c10::BFloat16* p, __mmask16 m) {
  return Load16(reinterpret_cast<const uint16_t*>(p), m);
}

VLM_INLINE_AVX512 void Store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
VLM_INLINE_AVX512 void Store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), Bf16x16(v));
}
VLM_INLINE_AVX512 void Store16(c10::BFloat16* p, __m512 v) {
  Store16(reinterpret_cast<uint16_t*>(p), v);
}
VLM_INLINE_AVX512 void Store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
VLM_INLINE_AVX512 void Store16(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, Bf16x16(v));
}
VLM_INLINE_AVX512 void Store16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  Store16(reinterpret_cast<uint16_t*>(p), v, m);
}

// VCVTNEPS2BF16: nearest even, denormal inputs flushed to zero, NaN payloads
// kept (see the top of this file).
VLM_INLINE_AVX512_BF16 __m256i Bf16x16Native(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

}  // namespace vlm::kernels::simd
