#include "services/language/model/decode_attention.h"

// GCC 12 flags the undefined upper halves inside its own AVX-512 reduction
// intrinsics as "may be used uninitialized": a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstring>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/cpu_features.h"

namespace vlm::language {
namespace {

// Round-to-nearest-even to bf16, kept as a float (what at::kBFloat16 stores).
inline float RoundBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return f;  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float Bf16ToF32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#define VLM_TARGET_AVX512 __attribute__((target("avx512f")))

// 16 bf16 -> 16 f32 (exact: a bf16 is the top half of an f32).
VLM_TARGET_AVX512 inline __m512 LoadBf16x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// scores[g, t] = bf16(q[g]·k[t]) for one kv head. q: [group, 16·NV] f32;
// k: `length` rows of 16·NV bf16, `ld` elements apart; scores: [group, length].
template <int NV>
VLM_TARGET_AVX512 void ScoresKernel(const float* q, int64_t group, const uint16_t* k, int64_t ld,
                                    int64_t length, float* scores) {
  for (int64_t t = 0; t < length; ++t) {
    __m512 kv[NV];
    for (int i = 0; i < NV; ++i) kv[i] = LoadBf16x16(k + t * ld + 16 * i);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * 16 * NV;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
      for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * i), kv[i], acc);
      scores[g * length + t] = RoundBf16(_mm512_reduce_add_ps(acc));
    }
  }
}

// acc[g] += Σ_t p[g, t]·v[t] for one kv head. p: [group, length] bf16;
// v: rows of 16·NV bf16, `ld` apart; acc: [group, 16·NV] f32.
template <int NV>
VLM_TARGET_AVX512 void ValuesKernel(const uint16_t* p, int64_t group, const uint16_t* v, int64_t ld,
                                    int64_t length, float* acc) {
  for (int64_t t = 0; t < length; ++t) {
    __m512 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = LoadBf16x16(v + t * ld + 16 * i);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 pg = _mm512_set1_ps(Bf16ToF32(p[g * length + t]));
      float* a = acc + g * 16 * NV;
      for (int i = 0; i < NV; ++i) {
        _mm512_storeu_ps(a + 16 * i, _mm512_fmadd_ps(pg, vv[i], _mm512_loadu_ps(a + 16 * i)));
      }
    }
  }
}

using ScoresFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, int64_t, float*);
using ValuesFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*);

bool Kernels(int64_t head_dim, ScoresFn* scores, ValuesFn* values) {
  switch (head_dim) {
    case 32: *scores = ScoresKernel<2>; *values = ValuesKernel<2>; return true;
    case 64: *scores = ScoresKernel<4>; *values = ValuesKernel<4>; return true;
    case 128: *scores = ScoresKernel<8>; *values = ValuesKernel<8>; return true;
    case 256: *scores = ScoresKernel<16>; *values = ValuesKernel<16>; return true;
    default: return false;
  }
}

void CheckShapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t length) {
  TORCH_CHECK(q.dim() == 2 && k.dim() == 3 && v.dim() == 3, "decode attention: q [Hq, D], caches "
              "[Hkv, capacity, D] expected, got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == q.size(1), "decode attention: shapes ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes(), " do not match");
  TORCH_CHECK(k.size(0) > 0 && q.size(0) % k.size(0) == 0, "decode attention: ", q.size(0),
              " query heads are not a multiple of ", k.size(0), " kv heads");
  TORCH_CHECK(length >= 1 && length <= k.size(1), "decode attention: length ", length,
              " outside 1..", k.size(1));
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "decode attention: dtypes differ");
}

}  // namespace

bool DecodeAttentionHasKernel(at::ScalarType dtype, int64_t head_dim) {
  ScoresFn s;
  ValuesFn v;
  return dtype == at::kBFloat16 && GetCpuFeatures().avx512f && Kernels(head_dim, &s, &v);
}

at::Tensor DecodeAttentionReference(const at::Tensor& q, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache, int64_t length, double scale) {
  CheckShapes(q, k_cache, v_cache, length);
  const int64_t hq = q.size(0), d = q.size(1), hkv = k_cache.size(0);
  at::Tensor keys = k_cache.narrow(1, 0, length), values = v_cache.narrow(1, 0, length);
  at::Tensor qg = q.reshape({hkv, hq / hkv, d}).mul(scale);           // [Hkv, group, D]
  at::Tensor scores = at::matmul(qg, keys.transpose(1, 2));           // [Hkv, group, L]
  at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(probs, values).reshape({hq, d});
}

at::Tensor DecodeAttention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, int64_t length, double scale) {
  CheckShapes(q, k_cache, v_cache, length);
  const int64_t hq = q.size(0), d = q.size(1), hkv = k_cache.size(0), group = hq / hkv;
  ScoresFn scores_fn;
  ValuesFn values_fn;
  if (!DecodeAttentionHasKernel(q.scalar_type(), d) || k_cache.stride(2) != 1 ||
      v_cache.stride(2) != 1 || !Kernels(d, &scores_fn, &values_fn)) {
    return DecodeAttentionReference(q, k_cache, v_cache, length, scale);
  }
  // q·scale rounded to bf16 (as the reference path's bf16 mul), then f32.
  const at::Tensor qs = q.mul(scale).to(at::kFloat).contiguous();  // [Hq, D]
  at::Tensor scores = at::empty({hq, length}, at::TensorOptions().dtype(at::kFloat));
  const float* qp = qs.data_ptr<float>();
  float* sp = scores.data_ptr<float>();
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const int64_t k_head = k_cache.stride(0), k_row = k_cache.stride(1);
  const int64_t v_head = v_cache.stride(0), v_row = v_cache.stride(1);
  at::parallel_for(0, hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      scores_fn(qp + h * group * d, group, kp + h * k_head, k_row, length,
                sp + h * group * length);
    }
  });
  // softmax in float32, probabilities rounded to bf16: [Hq, L]
  const at::Tensor probs = at::softmax(scores, -1).to(at::kBFloat16).contiguous();
  const auto* pp = reinterpret_cast<const uint16_t*>(probs.data_ptr());
  at::Tensor acc = at::zeros({hq, d}, at::TensorOptions().dtype(at::kFloat));
  float* ap = acc.data_ptr<float>();
  at::parallel_for(0, hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      values_fn(pp + h * group * length, group, vp + h * v_head, v_row, length,
                ap + h * group * d);
    }
  });
  return acc.to(q.scalar_type());
}

}  // namespace vlm::language
