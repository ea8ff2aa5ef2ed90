#include "common/kernels/quantize.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/cpu_features.h"
#include "common/kernels/thread_pool.h"
#include "common/kernels/simd.h"

namespace vlm::kernels {
namespace {

using simd::ToF32;

float HalfToFloat(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Natural order -> stored order (quantize.h): within each full block of 512 a
// transpose of the 16 groups × 8 quads of 4 bytes; the tail is copied as is.
void Interleave(const uint8_t* natural, int64_t kp, uint8_t* stored) {
  const int64_t full = kp / kInt8Block * kInt8Block;
  for (int64_t s = 0; s < full; s += kInt8Block) {
    for (int l = 0; l < 16; ++l)
      for (int j = 0; j < 8; ++j) std::memcpy(stored + s + 64 * j + 4 * l, natural + s + 32 * l + 4 * j, 4);
  }
  std::memcpy(stored + full, natural + full, kp - full);
}

// One row (quantize.h) in natural order: returns false if it holds a
// non-finite value. The row's amax, per group ratio = f16(group amax / row
// amax), scale = row_scale·ratio, q = clamp(round-to-nearest-even(w·(1/scale)),
// ±127), stored as q + 128; padding 128. The AVX-512 version does the same f32 operations (F16C
// rounds to nearest even as c10::Half does), so both give identical bytes.
template <typename T>
bool QuantizeRowScalar(const T* row, int64_t k, int64_t kp, uint8_t* dst, float* row_scale,
                       uint16_t* ratios) {
  float amax_row = 0;
  bool finite = true;
  for (int64_t i = 0; i < k; ++i) {
    const float v = ToF32(row[i]);
    finite &= std::isfinite(v);
    amax_row = std::max(amax_row, std::fabs(v));
  }
  if (!finite) return false;
  *row_scale = amax_row / 127.0f;
  for (int64_t g = 0; g < kp / kInt8Group; ++g) {
    const int64_t i0 = g * kInt8Group, i1 = std::min(k, i0 + kInt8Group);
    float amax = 0;
    for (int64_t i = i0; i < i1; ++i) amax = std::max(amax, std::fabs(ToF32(row[i])));
    const uint16_t ratio = amax_row > 0 ? c10::Half(amax / amax_row).x : uint16_t{0};
    ratios[g] = ratio;
    const float scale = *row_scale * HalfToFloat(ratio);
    const float inv = scale > 0 ? 1.0f / scale : 0.0f;
    for (int64_t i = i0; i < i0 + kInt8Group; ++i) {
      const float q =
          i < i1 ? std::clamp(std::nearbyint(ToF32(row[i]) * inv), -127.0f, 127.0f) : 0.0f;
      dst[i] = static_cast<uint8_t>(static_cast<int>(q) + 128);
    }
  }
  return true;
}

// 16 elements i.. of a row as f32; lanes at or past k are zero.
template <typename T>
VLM_TARGET_AVX512_F16C inline __m512 Load16(const T* row, int64_t i, int64_t k) {
  return simd::Load16(row + i, simd::Mask16(k - i));
}

VLM_TARGET_AVX512_F16C inline __m128i Round16(__m512 v, __m512 inv) {
  const __m512i lim = _mm512_set1_epi32(127), neg_lim = _mm512_set1_epi32(-127);
  // VCVTPS2DQ rounds to nearest even (the default mode), as nearbyint does.
  const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
  return _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_max_epi32(_mm512_min_epi32(r, lim), neg_lim),
                                               _mm512_set1_epi32(128)));
}

template <typename T>
VLM_TARGET_AVX512_F16C bool QuantizeRowAvx512(const T* row, int64_t k, int64_t kp, uint8_t* dst,
                                           float* row_scale, uint16_t* ratios) {
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 amax_v = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t i = 0; i < k; i += 16) {
    const __m512 a = _mm512_abs_ps(Load16(row, i, k));
    bad |= _mm512_cmp_ps_mask(a, inf, _CMP_NLT_UQ);  // |v| >= inf or NaN
    amax_v = _mm512_max_ps(amax_v, a);
  }
  if (bad != 0) return false;
  const float amax_row = _mm512_reduce_max_ps(amax_v);
  *row_scale = amax_row / 127.0f;
  for (int64_t g = 0; g < kp / kInt8Group; ++g) {
    const int64_t i0 = g * kInt8Group;
    const __m512 lo = Load16(row, i0, k), hi = Load16(row, i0 + 16, k);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const uint16_t ratio =
        amax_row > 0 ? static_cast<uint16_t>(_cvtss_sh(amax / amax_row, _MM_FROUND_TO_NEAREST_INT))
                     : uint16_t{0};
    ratios[g] = ratio;
    const float scale = *row_scale * _cvtsh_ss(ratio);
    const __m512 inv = _mm512_set1_ps(scale > 0 ? 1.0f / scale : 0.0f);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i0), Round16(lo, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i0 + 16), Round16(hi, inv));
  }
  return true;
}

template <typename T>
int64_t QuantizeRows(const T* src, int64_t ld, QuantizedWeight* q, uint8_t* data, float* scales,
                     uint16_t* ratios) {
  const int64_t n = q->n(), k = q->k(), kp = q->k_padded(), groups = q->groups();
  std::atomic<int64_t> bad_row{-1};
  const CpuFeatures& f = GetCpuFeatures();
  const bool avx512 = f.fast_bf16_matmul() && f.f16c;
  ParallelFor(n, 0, 64, [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> natural(kp);
    for (int64_t r = r0; r < r1; ++r) {
      const bool ok =
          avx512 ? QuantizeRowAvx512(src + r * ld, k, kp, natural.data(), scales + r,
                                     ratios + r * groups)
                 : QuantizeRowScalar(src + r * ld, k, kp, natural.data(), scales + r,
                                     ratios + r * groups);
      if (!ok) bad_row.store(r);
      else Interleave(natural.data(), kp, data + r * kp);
    }
  });
  return bad_row.load();
}

}  // namespace

float QuantizedWeight::scale(int64_t r, int64_t g) const {
  return row_scales_.get()[r] * HalfToFloat(ratios_.get()[r * groups() + g]);
}

QuantizedWeight QuantizedWeight::FromParts(int64_t n, int64_t k, const uint8_t* data,
                                           const float* row_scales, const uint16_t* ratios,
                                           std::shared_ptr<const void> owner) {
  QuantizedWeight q;
  q.n_ = n;
  q.k_ = k;
  q.k_padded_ = (k + kInt8Group - 1) / kInt8Group * kInt8Group;
  // Aliasing pointers: each shares `owner`'s lifetime; the kernels only read.
  q.data_ = std::shared_ptr<uint8_t>(owner, const_cast<uint8_t*>(data));
  q.row_scales_ = std::shared_ptr<float>(owner, const_cast<float*>(row_scales));
  q.ratios_ = std::shared_ptr<uint16_t>(owner, const_cast<uint16_t*>(ratios));
  return q;
}

absl::StatusOr<QuantizedWeight> QuantizeInt8(const at::Tensor& w) {
  if (!w.defined() || w.device().type() != at::kCPU || w.dim() != 2 ||
      (w.scalar_type() != at::kBFloat16 && w.scalar_type() != at::kFloat)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quantize: weight must be a 2-D bf16 or f32 CPU tensor [N, K]; got ",
        w.defined() ? w.toString() + " " + std::to_string(w.dim()) + "-D" : std::string("undefined")));
  }
  try {
    // Rows are read in place when they have unit stride (no f32 copy of the
    // whole matrix: the LM head's would be 1.2 GB).
    const at::Tensor wc = (w.size(1) <= 1 || w.stride(1) == 1) ? w : w.contiguous();
    QuantizedWeight q;
    q.n_ = wc.size(0);
    q.k_ = wc.size(1);
    q.k_padded_ = (q.k_ + kInt8Group - 1) / kInt8Group * kInt8Group;
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(64, q.n_ * q.k_padded_));
    q.data_ = std::shared_ptr<uint8_t>(
        static_cast<uint8_t*>(::operator new(bytes, std::align_val_t(64))),
        [](uint8_t* p) { ::operator delete(p, std::align_val_t(64)); });
    q.row_scales_ = std::shared_ptr<float>(new float[std::max<int64_t>(1, q.n_)],
                                           std::default_delete<float[]>());
    q.ratios_ = std::shared_ptr<uint16_t>(
        new uint16_t[std::max<int64_t>(1, q.n_ * q.groups())], std::default_delete<uint16_t[]>());
    const int64_t ld = q.n_ > 1 ? wc.stride(0) : q.k_;
    const int64_t bad_row =
        wc.scalar_type() == at::kBFloat16
            ? QuantizeRows(wc.data_ptr<c10::BFloat16>(), ld, &q, q.data_.get(),
                           q.row_scales_.get(), q.ratios_.get())
            : QuantizeRows(wc.data_ptr<float>(), ld, &q, q.data_.get(), q.row_scales_.get(),
                           q.ratios_.get());
    if (bad_row >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("quantize: row ", bad_row, " has a non-finite value"));
    }
    return q;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("quantize: out of memory");
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("quantize: ", e.what_without_backtrace()));
  }
}

at::Tensor DequantizeInt8(const QuantizedWeight& w) {
  at::Tensor out = at::empty({w.n(), w.k()}, at::kFloat);
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < w.n(); ++r) {
    for (int64_t i = 0; i < w.k(); ++i) {
      dst[r * w.k() + i] = w.scale(r, i / kInt8Group) * static_cast<float>(w.value(r, i));
    }
  }
  return out;
}

}  // namespace vlm::kernels
