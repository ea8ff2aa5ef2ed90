#include "common/kernels/quantize_int4.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "absl/strings/str_cat.h"
#include "common/cpu_features.h"
#include "common/kernels/simd.h"
#include "common/kernels/thread_pool.h"

namespace vlm::kernels {
namespace {

using simd::ToF32;

float HalfToFloat(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Round to nearest, ties to even, as std::nearbyint in the default mode but
// without a libm call per element (baseline x86-64 has no ROUNDSS): adding
// 1.5·2^23 leaves no fraction bits, so the addition rounds; |v| ≥ 2^22 is
// already an integer. (VRNDSCALEPS / VROUNDPS in the vector paths: the same
// value, up to the sign of a zero, which the clamp removes.)
inline float RoundEven(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5·2^23
  if (!(std::fabs(v) < 4194304.0f)) return v;
  const float m = std::copysign(kMagic, v);  // branch-free: the sign is random
  return (v + m) - m;
}

// Clamp to [0, 15] as MAXPS(v, 0) then MINPS(·, 15) do: NaN -> 0.
inline float Clamp15(float v) {
  v = v > 0.0f ? v : 0.0f;
  return v < 15.0f ? v : 15.0f;
}

// Per-row working arrays, one set per task.
struct RowScratch {
  std::vector<uint8_t> u;  // natural order [k_padded] (scalar path)
  std::vector<float> lo, step, inv, z;  // [groups]
  void Resize(int64_t kp) {
    const int64_t groups = kp / kInt4Group;
    u.resize(kp);
    lo.resize(groups);
    step.resize(groups);
    inv.resize(groups);
    z.resize(groups);
  }
};

// One row (quantize_int4.h): u in natural order into `u` [k_padded], ratios
// and zeros [groups], *row_scale. False if the row holds a non-finite value.
template <typename T>
bool QuantizeRowScalar(const T* row, int64_t k, int64_t kp, uint8_t* u, float* row_scale,
                       uint16_t* ratios, uint8_t* zeros, RowScratch& s) {
  const int64_t groups = kp / kInt4Group;
  float row_step = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t i0 = g * kInt4Group, i1 = std::min(k, i0 + kInt4Group);
    float lo = 0, hi = 0;
    for (int64_t i = i0; i < i1; ++i) {
      const float v = ToF32(row[i]);
      if (!std::isfinite(v)) return false;
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    s.lo[g] = lo;
    s.step[g] = (hi - lo) / 15.0f;
    row_step = std::max(row_step, s.step[g]);
  }
  *row_scale = row_step;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t i0 = g * kInt4Group, i1 = std::min(k, i0 + kInt4Group);
    const uint16_t ratio = row_step > 0 ? c10::Half(s.step[g] / row_step).x : uint16_t{0};
    ratios[g] = ratio;
    const float scale = row_step * HalfToFloat(ratio);
    const float inv = scale > 0 ? 1.0f / scale : 0.0f;
    const float z = Clamp15(RoundEven(-s.lo[g] * inv));
    zeros[g] = static_cast<uint8_t>(z);
    for (int64_t i = i0; i < i0 + kInt4Group; ++i) {
      const float q = i < i1 ? RoundEven(ToF32(row[i]) * inv) + z : z;
      u[i] = static_cast<uint8_t>(Clamp15(q));
    }
  }
  return true;
}

// Natural-order u [k_padded] -> the row's packed bytes (layout in the header;
// Int4StoredPosition element by element, unrolled).
void PackRow(const uint8_t* u, int64_t kp, uint8_t* dst) {
  const int64_t full = kp / kInt4Block * kInt4Block;
  for (int64_t s = 0; s < full; s += kInt4Block) {
    uint8_t* block = dst + s / 2;
    for (int l = 0; l < 16; ++l) {
      const uint8_t* g = u + s + kInt4Group * l;
      for (int c = 0; c < 4; ++c) {
        for (int e = 0; e < 4; ++e) {
          block[64 * c + 4 * l + e] = static_cast<uint8_t>(g[8 * c + e] | g[8 * c + 4 + e] << 4);
        }
      }
    }
  }
  for (int64_t g0 = full; g0 < kp; g0 += kInt4Group) {
    uint8_t* out = dst + g0 / 2;
    for (int i = 0; i < 16; ++i) out[i] = static_cast<uint8_t>(u[g0 + i] | u[g0 + 16 + i] << 4);
  }
}

// Group g's u (ulo: elements 0-15, uhi: 16-31, one byte each) into the row's
// packed bytes: in a full block, chunk c's dword of lane g % 16 takes
// elements 8c..8c+3 (low nibbles) and 8c+4..8c+7 (high); in the tail,
// byte i takes elements i and i + 16.
// Baseline SSE2, always inlined: it runs inside the AVX2 and AVX-512 kernels.
[[gnu::always_inline]] inline void StoreGroup(__m128i ulo, __m128i uhi, int64_t g, int64_t full_groups,
                                uint8_t* dst) {
  if (g >= full_groups) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + g * (kInt4Group / 2)),
                     _mm_or_si128(ulo, _mm_slli_epi16(uhi, 4)));
    return;
  }
  // Per qword (8 elements, each < 16): low dword | high dword << 4 in the low dword.
  const __m128i plo = _mm_or_si128(ulo, _mm_srli_epi64(ulo, 28));
  const __m128i phi = _mm_or_si128(uhi, _mm_srli_epi64(uhi, 28));
  const __m128i c = _mm_castps_si128(
      _mm_shuffle_ps(_mm_castsi128_ps(plo), _mm_castsi128_ps(phi), _MM_SHUFFLE(2, 0, 2, 0)));
  uint8_t* lane = dst + g / 16 * (kInt4Block / 2) + 4 * (g % 16);
  const uint32_t d0 = static_cast<uint32_t>(_mm_cvtsi128_si32(c));
  const uint32_t d1 = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_shuffle_epi32(c, 1)));
  const uint32_t d2 = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_shuffle_epi32(c, 2)));
  const uint32_t d3 = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_shuffle_epi32(c, 3)));
  std::memcpy(lane, &d0, 4);
  std::memcpy(lane + 64, &d1, 4);
  std::memcpy(lane + 128, &d2, 4);
  std::memcpy(lane + 192, &d3, 4);
}

// --- AVX-512: QuantizeRowScalar's f32 operations, 16 lanes; ratios, scales,
// inverses and zero points 16 groups at a time.

// round-even(w·inv) + z where the lane is in the row (m), else z; clamped;
// as bytes.
VLM_INLINE_AVX512 __m128i Quantize16(__m512 w, __mmask16 m, __m512 inv, __m512 z) {
  const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(w, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 q = _mm512_mask_add_ps(z, m, r, z);
  q = _mm512_min_ps(_mm512_max_ps(q, _mm512_setzero_ps()), _mm512_set1_ps(15.0f));
  return _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q));
}

template <typename T>
VLM_TARGET_AVX512 bool QuantizeRowAvx512(const T* row, int64_t k, int64_t kp, uint8_t* dst,
                                         float* row_scale, uint16_t* ratios, uint8_t* zeros,
                                         RowScratch& s) {
  const int64_t groups = kp / kInt4Group, full_groups = kp / kInt4Block * (kInt4Block / kInt4Group);
  const __m512 zero = _mm512_setzero_ps();
  __mmask16 bad = 0;
  float row_step = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t i0 = g * kInt4Group;
    const __m512 a = simd::Load16(row + i0, simd::Mask16(k - i0));
    const __m512 b = simd::Load16(row + i0 + 16, simd::Mask16(k - i0 - 16));
    bad |= _mm512_fpclass_ps_mask(a, 0x99) | _mm512_fpclass_ps_mask(b, 0x99);  // NaN, ±inf
    const float lo = _mm512_reduce_min_ps(_mm512_min_ps(_mm512_min_ps(a, b), zero));
    const float hi = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a, b), zero));
    s.lo[g] = lo;
    s.step[g] = (hi - lo) / 15.0f;
    row_step = std::max(row_step, s.step[g]);
  }
  if (bad != 0) return false;
  *row_scale = row_step;
  const __m512 rs = _mm512_set1_ps(row_step);
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const __mmask16 m = simd::Mask16(groups - g0);
    __m256i ratio = _mm256_setzero_si256();
    if (row_step > 0) {
      ratio = _mm512_cvtps_ph(_mm512_div_ps(_mm512_maskz_loadu_ps(m, s.step.data() + g0), rs),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_mask_storeu_epi16(ratios + g0, m, ratio);
    const __m512 scale = _mm512_mul_ps(rs, _mm512_cvtph_ps(ratio));
    const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(scale, zero, _CMP_GT_OQ),
                                           _mm512_set1_ps(1.0f), scale);
    const __m512 neg_lo = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_maskz_loadu_ps(m, s.lo.data() + g0)), _mm512_set1_epi32(INT32_MIN)));
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(neg_lo, inv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 z = _mm512_min_ps(_mm512_max_ps(r, zero), _mm512_set1_ps(15.0f));
    _mm512_mask_storeu_ps(s.inv.data() + g0, m, inv);
    _mm512_mask_storeu_ps(s.z.data() + g0, m, z);
    _mm512_mask_cvtepi32_storeu_epi8(zeros + g0, m, _mm512_cvttps_epi32(z));
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t i0 = g * kInt4Group;
    const __mmask16 ma = simd::Mask16(k - i0), mb = simd::Mask16(k - i0 - 16);
    const __m512 inv = _mm512_set1_ps(s.inv[g]), z = _mm512_set1_ps(s.z[g]);
    const __m128i ulo = Quantize16(simd::Load16(row + i0, ma), ma, inv, z);
    const __m128i uhi = Quantize16(simd::Load16(row + i0 + 16, mb), mb, inv, z);
    StoreGroup(ulo, uhi, g, full_groups, dst);
  }
  return true;
}

// --- AVX2: the same, 8 lanes; the f16 ratios in scalar code (no F16C needed).

// Elements [i0, i0 + 8) of a row of k, zero past k.
template <typename T>
VLM_INLINE_AVX2 __m256 Load8(const T* row, int64_t i0, int64_t k) {
  if (i0 >= k) return _mm256_setzero_ps();
  const int valid = static_cast<int>(std::min<int64_t>(8, k - i0));
  if constexpr (std::is_same_v<T, float>) return simd::Load8(row + i0, valid);
  else return simd::Load8(reinterpret_cast<const uint16_t*>(row + i0), valid);
}

VLM_INLINE_AVX2 float ReduceMin8(__m256 v) {
  __m128 t = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_min_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_min_ss(t, _mm_movehdup_ps(t)));
}
VLM_INLINE_AVX2 float ReduceMax8(__m256 v) {
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// Quantize16's 8 lanes (as int32): lanes at or past `valid` take z.
VLM_INLINE_AVX2 __m256i Quantize8(__m256 w, int64_t valid, __m256 inv, __m256 z) {
  const __m256 r = _mm256_round_ps(_mm256_mul_ps(w, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 in_row = _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(valid, 0, 8))), lane));
  __m256 q = _mm256_blendv_ps(z, _mm256_add_ps(r, z), in_row);
  q = _mm256_min_ps(_mm256_max_ps(q, _mm256_setzero_ps()), _mm256_set1_ps(15.0f));
  return _mm256_cvttps_epi32(q);
}

template <typename T>
VLM_TARGET_AVX2 bool QuantizeRowAvx2(const T* row, int64_t k, int64_t kp, uint8_t* dst,
                                     float* row_scale, uint16_t* ratios, uint8_t* zeros,
                                     RowScratch& s) {
  const int64_t groups = kp / kInt4Group, full_groups = kp / kInt4Block * (kInt4Block / kInt4Group);
  const __m256 zero = _mm256_setzero_ps();
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 bad = zero;
  float row_step = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t i0 = g * kInt4Group;
    __m256 lo = zero, hi = zero;
    for (int j = 0; j < 4; ++j) {
      const __m256 v = Load8(row, i0 + 8 * j, k);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(v, abs_mask), inf, _CMP_NLT_UQ));
      lo = _mm256_min_ps(lo, v);
      hi = _mm256_max_ps(hi, v);
    }
    const float glo = ReduceMin8(lo);
    s.lo[g] = glo;
    s.step[g] = (ReduceMax8(hi) - glo) / 15.0f;
    row_step = std::max(row_step, s.step[g]);
  }
  if (_mm256_movemask_ps(bad) != 0) return false;
  *row_scale = row_step;
  for (int64_t g = 0; g < groups; ++g) {
    const uint16_t ratio = row_step > 0 ? c10::Half(s.step[g] / row_step).x : uint16_t{0};
    ratios[g] = ratio;
    const float scale = row_step * HalfToFloat(ratio);
    s.inv[g] = scale > 0 ? 1.0f / scale : 0.0f;
    s.z[g] = Clamp15(RoundEven(-s.lo[g] * s.inv[g]));
    zeros[g] = static_cast<uint8_t>(s.z[g]);
  }
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t i0 = g * kInt4Group;
    const __m256 inv = _mm256_set1_ps(s.inv[g]), z = _mm256_set1_ps(s.z[g]);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = Quantize8(Load8(row, i0 + 8 * j, k), k - i0 - 8 * j, inv, z);
    // 4 x 8 int32 -> 32 bytes: the packs interleave per 128-bit lane, the permute restores order.
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packus_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
    StoreGroup(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1), g, full_groups, dst);
  }
  return true;
}

template <typename T>
int64_t QuantizeRows(const T* src, int64_t ld, int64_t n, int64_t k, int64_t kp, uint8_t* packed,
                     float* row_scales, uint16_t* ratios, uint8_t* zeros, QuantizeInt4Path path,
                     int threads) {
  const int64_t groups = kp / kInt4Group;
  std::atomic<int64_t> bad_row{-1};
  ParallelFor(n, threads, 64, [&](int64_t r0, int64_t r1) {
    RowScratch scratch;
    scratch.Resize(kp);
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = src + r * ld;
      uint8_t* dst = packed + r * (kp / 2);
      bool ok = false;
      switch (path) {
        case QuantizeInt4Path::kAvx512:
          ok = QuantizeRowAvx512(row, k, kp, dst, row_scales + r, ratios + r * groups,
                                 zeros + r * groups, scratch);
          break;
        case QuantizeInt4Path::kAvx2:
          ok = QuantizeRowAvx2(row, k, kp, dst, row_scales + r, ratios + r * groups,
                               zeros + r * groups, scratch);
          break;
        case QuantizeInt4Path::kScalar:
          ok = QuantizeRowScalar(row, k, kp, scratch.u.data(), row_scales + r,
                                 ratios + r * groups, zeros + r * groups, scratch);
          if (ok) PackRow(scratch.u.data(), kp, dst);
          break;
      }
      if (!ok) bad_row.store(r);
    }
  });
  return bad_row.load();
}

template <typename T>
std::shared_ptr<T> Allocate(int64_t count) {
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(1, count)) * sizeof(T) + 63) / 64 * 64;
  return std::shared_ptr<T>(static_cast<T*>(::operator new(bytes, std::align_val_t(64))),
                            [](T* p) { ::operator delete(p, std::align_val_t(64)); });
}

}  // namespace

Int4Weight Int4Weight::View(int64_t n, int64_t k, const uint8_t* packed, const float* row_scales,
                            const uint16_t* ratios, const uint8_t* zeros,
                            std::shared_ptr<const void> keep_alive) {
  Int4Weight w;
  w.n_ = n;
  w.k_ = k;
  w.k_padded_ = (k + kInt4Group - 1) / kInt4Group * kInt4Group;
  // Aliasing constructors: each array shares ownership of keep_alive.
  w.packed_ = std::shared_ptr<const uint8_t>(keep_alive, packed);
  w.row_scales_ = std::shared_ptr<const float>(keep_alive, row_scales);
  w.ratios_ = std::shared_ptr<const uint16_t>(keep_alive, ratios);
  w.zeros_ = std::shared_ptr<const uint8_t>(std::move(keep_alive), zeros);
  return w;
}

float Int4Weight::scale(int64_t r, int64_t g) const {
  return row_scales_.get()[r] * HalfToFloat(ratios_.get()[r * groups() + g]);
}

const char* QuantizeInt4PathName(QuantizeInt4Path path) {
  switch (path) {
    case QuantizeInt4Path::kAvx512:
      return "avx512";
    case QuantizeInt4Path::kAvx2:
      return "avx2";
    case QuantizeInt4Path::kScalar:
      return "scalar";
  }
  return "?";
}

bool QuantizeInt4PathSupported(QuantizeInt4Path path) {
  const CpuFeatures& f = GetCpuFeatures();
  switch (path) {
    case QuantizeInt4Path::kAvx512:
      return f.fast_bf16_matmul();
    case QuantizeInt4Path::kAvx2:
      return f.avx2_fma();
    case QuantizeInt4Path::kScalar:
      return true;
  }
  return false;
}

QuantizeInt4Path BestQuantizeInt4Path() {
  if (QuantizeInt4PathSupported(QuantizeInt4Path::kAvx512)) return QuantizeInt4Path::kAvx512;
  if (QuantizeInt4PathSupported(QuantizeInt4Path::kAvx2)) return QuantizeInt4Path::kAvx2;
  return QuantizeInt4Path::kScalar;
}

absl::StatusOr<Int4Weight> QuantizeInt4(const at::Tensor& w) {
  return QuantizeInt4(w, BestQuantizeInt4Path());
}

absl::StatusOr<Int4Weight> QuantizeInt4(const at::Tensor& w, QuantizeInt4Path path, int threads) {
  if (!QuantizeInt4PathSupported(path)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "quantize int4: path ", QuantizeInt4PathName(path), " is not supported by this CPU"));
  }
  if (!w.defined() || w.device().type() != at::kCPU || w.dim() != 2 ||
      (w.scalar_type() != at::kBFloat16 && w.scalar_type() != at::kFloat)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quantize int4: weight must be a 2-D bf16 or f32 CPU tensor [N, K]; got ",
        w.defined() ? w.toString() + " " + std::to_string(w.dim()) + "-D" : std::string("undefined")));
  }
  try {
    const at::Tensor wc = (w.size(1) <= 1 || w.stride(1) == 1) ? w : w.contiguous();
    Int4Weight q;
    q.n_ = wc.size(0);
    q.k_ = wc.size(1);
    q.k_padded_ = (q.k_ + kInt4Group - 1) / kInt4Group * kInt4Group;
    std::shared_ptr<uint8_t> packed = Allocate<uint8_t>(q.n_ * q.row_bytes());
    std::shared_ptr<float> row_scales = Allocate<float>(q.n_);
    std::shared_ptr<uint16_t> ratios = Allocate<uint16_t>(q.n_ * q.groups());
    std::shared_ptr<uint8_t> zeros = Allocate<uint8_t>(q.n_ * q.groups());
    const int64_t ld = q.n_ > 1 ? wc.stride(0) : q.k_;
    const int64_t bad_row =
        wc.scalar_type() == at::kBFloat16
            ? QuantizeRows(wc.data_ptr<c10::BFloat16>(), ld, q.n_, q.k_, q.k_padded_, packed.get(),
                           row_scales.get(), ratios.get(), zeros.get(), path, threads)
            : QuantizeRows(wc.data_ptr<float>(), ld, q.n_, q.k_, q.k_padded_, packed.get(),
                           row_scales.get(), ratios.get(), zeros.get(), path, threads);
    if (bad_row >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("quantize int4: row ", bad_row, " has a non-finite value"));
    }
    q.packed_ = std::move(packed);
    q.row_scales_ = std::move(row_scales);
    q.ratios_ = std::move(ratios);
    q.zeros_ = std::move(zeros);
    return q;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("quantize int4: out of memory");
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("quantize int4: ", e.what_without_backtrace()));
  }
}

at::Tensor DequantizeInt4(const Int4Weight& w) {
  at::Tensor out = at::empty({w.n(), w.k()}, at::kFloat);
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < w.n(); ++r) {
    for (int64_t i = 0; i < w.k(); ++i) {
      dst[r * w.k() + i] = w.scale(r, i / kInt4Group) * static_cast<float>(w.value(r, i));
    }
  }
  return out;
}

}  // namespace vlm::kernels
