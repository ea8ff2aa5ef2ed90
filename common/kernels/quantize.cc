#include "common/kernels/quantize.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>

#include <ATen/ATen.h>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include "absl/strings/str_cat.h"
#include "common/cpu_features.h"
#include "common/kernels/thread_pool.h"

namespace vlm::kernels {
namespace {

// One row: returns false if it holds a non-finite value. scale = max|w| / 127,
// q = clamp(round-to-nearest-even(w·(1/scale)), ±127), stored as q + 128,
// padding 128. The AVX-512 version does the same f32 operations, so both
// give identical bytes.
float ToF32(const float* p, int64_t i) { return p[i]; }
float ToF32(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

template <typename T>
bool QuantizeRowScalar(const T* row, int64_t k, int64_t kp, uint8_t* dst, float* scale_out) {
  float amax = 0;
  bool finite = true;
  for (int64_t i = 0; i < k; ++i) {
    const float v = ToF32(row, i);
    finite &= std::isfinite(v);
    amax = std::max(amax, std::fabs(v));
  }
  const float scale = amax / 127.0f;
  const float inv = scale > 0 ? 1.0f / scale : 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    const float v = std::clamp(std::nearbyint(ToF32(row, i) * inv), -127.0f, 127.0f);
    dst[i] = static_cast<uint8_t>(static_cast<int>(v) + 128);
  }
  std::memset(dst + k, 128, kp - k);
  *scale_out = scale;
  return finite;
}

#define VLM_TARGET_AVX512BW __attribute__((target("avx512f,avx512bw,avx512vl")))

// 16 elements i.. of a row as f32 and the mask of those below k.
VLM_TARGET_AVX512BW inline __m512 Load16(const float* row, int64_t i, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, row + i);
}
VLM_TARGET_AVX512BW inline __m512 Load16(const c10::BFloat16* row, int64_t i, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, row + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename T>
VLM_TARGET_AVX512BW bool QuantizeRowAvx512(const T* row, int64_t k, int64_t kp, uint8_t* dst,
                                           float* scale_out) {
  auto mask = [k](int64_t i) {
    return static_cast<__mmask16>(i + 16 <= k ? 0xFFFF : (1u << (k - i)) - 1);
  };
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 amax = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t i = 0; i < k; i += 16) {
    const __m512 a = _mm512_abs_ps(Load16(row, i, mask(i)));
    bad |= _mm512_cmp_ps_mask(a, inf, _CMP_NLT_UQ);  // |v| >= inf or NaN
    amax = _mm512_max_ps(amax, a);
  }
  if (bad != 0) return false;
  const float scale = _mm512_reduce_max_ps(amax) / 127.0f;
  const __m512 inv = _mm512_set1_ps(scale > 0 ? 1.0f / scale : 0.0f);
  const __m512i lim = _mm512_set1_epi32(127), neg_lim = _mm512_set1_epi32(-127);
  const __m512i offset = _mm512_set1_epi32(128);
  for (int64_t i = 0; i < kp; i += 16) {
    const __m512 v = i < k ? Load16(row, i, mask(i)) : _mm512_setzero_ps();
    // VCVTPS2DQ rounds to nearest even (the default mode), as nearbyint does.
    __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
    r = _mm512_add_epi32(_mm512_max_epi32(_mm512_min_epi32(r, lim), neg_lim), offset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtepi32_epi8(r));
  }
  *scale_out = scale;
  return true;
}

template <typename T>
int64_t QuantizeRows(const T* src, int64_t ld, bool avx512, uint8_t* data, float* scales,
                     int64_t n, int64_t k, int64_t kp) {
  std::atomic<int64_t> bad_row{-1};
  ParallelFor(n, 0, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const bool ok = avx512 ? QuantizeRowAvx512(src + r * ld, k, kp, data + r * kp, scales + r)
                             : QuantizeRowScalar(src + r * ld, k, kp, data + r * kp, scales + r);
      if (!ok) bad_row.store(r);
    }
  });
  return bad_row.load();
}

}  // namespace

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
    q.k_padded_ = (q.k_ + 63) / 64 * 64;
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(1, q.n_ * q.k_padded_));
    q.data_ = std::shared_ptr<uint8_t>(
        static_cast<uint8_t*>(::operator new(bytes, std::align_val_t(64))),
        [](uint8_t* p) { ::operator delete(p, std::align_val_t(64)); });
    q.scales_ = std::shared_ptr<float>(new float[std::max<int64_t>(1, q.n_)],
                                       std::default_delete<float[]>());
    const CpuFeatures& f = GetCpuFeatures();
    const bool avx512 = f.avx512f && f.avx512bw && f.avx512vl;
    const int64_t ld = q.n_ > 1 ? wc.stride(0) : q.k_;
    const int64_t bad_row =
        wc.scalar_type() == at::kBFloat16
            ? QuantizeRows(wc.data_ptr<c10::BFloat16>(), ld, avx512, q.data_.get(),
                           q.scales_.get(), q.n_, q.k_, q.k_padded_)
            : QuantizeRows(wc.data_ptr<float>(), ld, avx512, q.data_.get(), q.scales_.get(), q.n_,
                           q.k_, q.k_padded_);
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
    for (int64_t i = 0; i < w.k(); ++i) dst[r * w.k() + i] = w.scales()[r] * w.value(r, i);
  }
  return out;
}

}  // namespace vlm::kernels
