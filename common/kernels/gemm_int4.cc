// GemmInt4: the blocked Gemm over 4-bit weights, their panels made per task
// (gemm_internal.h PanelSource), as GemmInt8 does for int8. The conversion
// reads the weights in their stored order (quantize_int4.h): dword lane l of
// a 64-byte chunk holds 8 elements of group l, so a 16 x 16 dword transpose
// of 16 rows' chunks puts one row per lane, next to that row's group scale
// and zero point.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include "absl/strings/str_cat.h"
#include "common/kernels/gemm.h"
#include "common/kernels/gemm_internal.h"
#include "common/kernels/gemv_int4.h"
#include "common/kernels/quantize_int4.h"
#include "common/kernels/simd.h"

namespace vlm::kernels {
namespace {

using internal::kPanelCols;

// Prefetch distance along each of the 16 rows a half panel reads: one block.
constexpr int64_t kAhead = kInt4Block / 2;

// Rows 0..15 of `r` transposed in place: afterwards r[c] lane i = old r[i] lane c.
VLM_TARGET_AVX512_BF16 inline void Transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int a = 0; a < 16; a += 4) {
    u[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
    u[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
    u[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
    u[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
  }
  for (int b = 0; b < 4; ++b) {
    const __m512i v = _mm512_shuffle_i32x4(u[b], u[4 + b], 0x88);
    const __m512i w = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0x88);
    const __m512i v2 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0xdd);
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0xdd);
    r[b] = _mm512_shuffle_i32x4(v, w, 0x88);
    r[8 + b] = _mm512_shuffle_i32x4(v, w, 0xdd);
    r[4 + b] = _mm512_shuffle_i32x4(v2, w2, 0x88);
    r[12 + b] = _mm512_shuffle_i32x4(v2, w2, 0xdd);
  }
}

// bf16(scale(r, k / 32)·(u - z)) of element k of row r (the AVX-512 fill's
// tail groups; the AVX2 fill computes the same products 8 at a time).
uint16_t Element(const Int4Weight& w, int64_t r, int64_t k) {
  if (r < 0 || k >= w.k_padded()) return 0;
  return simd::F32ToBf16(w.scale(r, k / kInt4Group) * static_cast<float>(w.value(r, k)));
}

// One k-pair of 16 panel columns: (even[i], odd[i]) as bf16 pairs.
VLM_TARGET_AVX512_BF16 inline void StorePairs(uint16_t* p, __m512i interleave, __m512 even, __m512 odd) {
  _mm512_store_si512(p, _mm512_permutexvar_epi16(
                            interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even))));
}

// Panel columns [16h, 16h + 16) of one panel (dst: its first k-pair) from the
// rows rows[0..16) (-1: past the weight, zero).
VLM_TARGET_AVX512_BF16 void FillHalfPanel(const Int4Weight& w, const int64_t rows[16], int h, int64_t kpairs,
                              uint16_t* dst) {
  const int64_t kp = w.k_padded(), groups = w.groups();
  const int64_t full = kp / kInt4Block * kInt4Block;
  alignas(64) static const uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const __m512i nibble = _mm512_set1_epi32(15);
  for (int64_t s = 0; s < full; s += kInt4Block) {
    const int64_t g0 = s / kInt4Group;
    // scale[l] / zero[l] lane i: group l of the block in row i.
    __m512i scale[16], zero[16];
    for (int i = 0; i < 16; ++i) {
      if (rows[i] < 0) {
        scale[i] = zero[i] = _mm512_setzero_si512();
        continue;
      }
      const __m512 ratio = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(w.ratios() + rows[i] * groups + g0)));
      scale[i] = _mm512_castps_si512(_mm512_mul_ps(_mm512_set1_ps(w.row_scales()[rows[i]]), ratio));
      zero[i] = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.zeros() + rows[i] * groups + g0)))));
    }
    Transpose16(scale);
    Transpose16(zero);
    for (int c = 0; c < 4; ++c) {
      __m512i q[16];
      for (int i = 0; i < 16; ++i) {
        if (rows[i] < 0) {
          q[i] = _mm512_setzero_si512();  // u = 0, z = 0, scale = 0
          continue;
        }
        const uint8_t* src = w.row(rows[i]) + s / 2 + 64 * c;
        _mm_prefetch(reinterpret_cast<const char*>(src) + kAhead, _MM_HINT_T1);
        q[i] = _mm512_loadu_si512(src);
      }
      Transpose16(q);
      for (int l = 0; l < 16; ++l) {
        const __m512 sc = _mm512_castsi512_ps(scale[l]);
        const __m512 z = _mm512_castsi512_ps(zero[l]);
        // Nibble t of the dword: byte t / 2, low (t even) or high half.
        __m512 v[8];
        for (int t = 0; t < 8; ++t) {
          const __m512i u = _mm512_and_si512(_mm512_srli_epi32(q[l], 4 * t), nibble);
          v[t] = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(u), z), sc);
        }
        // Low nibbles (t = 0, 2, 4, 6): elements 8c + e; high: 8c + 4 + e.
        const int64_t k0 = s + 32 * l + 8 * c;
        const __m512 lo01 = v[0], lo11 = v[2], lo2 = v[4], lo3 = v[6];
        const __m512 hi0 = v[1], hi1 = v[3], hi2 = v[5], hi3 = v[7];
        uint16_t* out = dst + ((k0 / 2) * kPanelCols + 16 * h) * 2;
        StorePairs(out, interleave, lo01, lo11);                 // pair k0 / 2: elements k0, k0 + 1
        StorePairs(out + 2 * kPanelCols, interleave, lo2, lo3);  // k0 + 2, k0 + 3
        StorePairs(out + 4 * kPanelCols, interleave, hi0, hi1);  // k0 + 4, k0 + 5
        StorePairs(out + 6 * kPanelCols, interleave, hi2, hi3);  // k0 + 6, k0 + 7
      }
    }
  }
  for (int64_t pair = full / 2; pair < kpairs; ++pair) {
    for (int i = 0; i < 16; ++i) {
      for (int e = 0; e < 2; ++e) {
        dst[(pair * kPanelCols + 16 * h + i) * 2 + e] = Element(w, rows[i], 2 * pair + e);
      }
    }
  }
}

// Row r's bf16 values scale(r, g)·(u - z), k_padded of them in natural order
// (Element's products, 8 at a time).
VLM_TARGET_AVX2 void DecodeRowAvx2(const Int4Weight& w, int64_t r, uint16_t* out) {
  const int64_t kp = w.k_padded(), full = kp / kInt4Block * kInt4Block;
  const uint8_t* row = w.row(r);
  const __m128i nibble = _mm_set1_epi8(15);
  for (int64_t g = 0; g < kp / kInt4Group; ++g) {
    const int64_t k0 = g * kInt4Group;
    __m128i lo, hi;  // u of elements 0-15 and 16-31 of the group, one byte each
    if (k0 < full) {
      // Chunk c's dword of lane g % 16: elements 8c..8c+3 low, 8c+4..8c+7 high.
      const uint8_t* lane = row + k0 / kInt4Block * (kInt4Block / 2) + 4 * (g % 16);
      uint32_t d[4];
      for (int c = 0; c < 4; ++c) std::memcpy(&d[c], lane + 64 * c, 4);
      const __m128i v = _mm_setr_epi32(static_cast<int>(d[0]), static_cast<int>(d[1]),
                                       static_cast<int>(d[2]), static_cast<int>(d[3]));
      const __m128i l = _mm_and_si128(v, nibble), h = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);
      lo = _mm_unpacklo_epi32(l, h);
      hi = _mm_unpackhi_epi32(l, h);
    } else {
      // Tail group: byte i holds element i (low) and i + 16 (high).
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 / 2));
      lo = _mm_and_si128(v, nibble);
      hi = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);
    }
    const __m256 scale = _mm256_set1_ps(w.scale(r, g));
    const __m256i z = _mm256_set1_epi32(w.zero(r, g));
    const __m128i eights[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int j = 0; j < 4; ++j) {
      const __m256i value = _mm256_sub_epi32(_mm256_cvtepu8_epi32(eights[j]), z);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k0 + 8 * j),
                       simd::Bf16x8(_mm256_mul_ps(_mm256_cvtepi32_ps(value), scale)));
    }
  }
}

// FillHalfPanel for AVX2 CPUs: each row decoded once, then its k-pairs
// written down its panel column. The same bf16 values as Element.
VLM_TARGET_AVX2 void FillHalfPanelAvx2(const Int4Weight& w, const int64_t rows[16], int h,
                                       int64_t kpairs, uint16_t* dst) {
  thread_local std::vector<uint16_t> values;  // one row's, natural order
  const int64_t row_pairs = std::min(kpairs, w.k_padded() / 2);
  values.resize(w.k_padded());
  for (int i = 0; i < 16; ++i) {
    uint16_t* out = dst + (16 * h + i) * 2;
    int64_t pair = 0;
    if (rows[i] >= 0) {
      DecodeRowAvx2(w, rows[i], values.data());
      for (; pair < row_pairs; ++pair) std::memcpy(out + pair * kPanelCols * 2, &values[2 * pair], 4);
    }
    for (; pair < kpairs; ++pair) std::memset(out + pair * kPanelCols * 2, 0, 4);
  }
  _mm256_zeroupper();
}

class Int4Panels : public internal::PanelSource {
 public:
  Int4Panels(const Int4Weight& w, bool gate_up, int64_t n, int64_t kpairs, bool avx2)
      : w_(w), gate_up_(gate_up), avx2_(avx2), n_(n), kpairs_(kpairs) {}

  void Fill(int64_t j0, int64_t j1, uint16_t* out) const override {
    for (int64_t j = j0; j < j1; ++j) {
      uint16_t* dst = out + (j - j0) * kpairs_ * 2 * kPanelCols;
      for (int h = 0; h < 2; ++h) {
        int64_t rows[16];
        for (int i = 0; i < 16; ++i) {
          // gate_up: gate rows 16j.. in columns 0-15, up rows I + 16j.. in 16-31.
          const int64_t col = gate_up_ ? 16 * j + i : kPanelCols * j + 16 * h + i;
          rows[i] = col >= n_ ? -1 : gate_up_ && h == 1 ? n_ + col : col;
        }
        if (avx2_) FillHalfPanelAvx2(w_, rows, h, kpairs_, dst);
        else FillHalfPanel(w_, rows, h, kpairs_, dst);
      }
    }
  }

 private:
  const Int4Weight& w_;
  const bool gate_up_, avx2_;
  const int64_t n_, kpairs_;
};

}  // namespace

absl::Status GemmInt4(const at::Tensor& x, const Int4Weight& w, at::Tensor* y,
                      const GemmOptions& o) {
  try {
    if (w.empty()) return absl::InvalidArgumentError("gemm int4: weight is empty");
    const bool gate_up = o.activation == Activation::kSiluMul;
    if (gate_up && w.n() % 2 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("gemm int4: a gate/up weight holds 2·I rows; got ", w.n()));
    }
    const int64_t n = gate_up ? w.n() / 2 : w.n();
    if (absl::Status s = internal::CheckOperands(x, w.k(), n, y, o); !s.ok()) return s;
    const GemmPath path = o.path.value_or(DefaultGemmPath());
    if (path == GemmPath::kTorch) {
      return absl::FailedPreconditionError(
          "gemm int4: needs the amx, avx512bf16 or avx2 path, not torch");
    }
    std::string missing;
    if (!GemmPathSupported(path, &missing)) {
      return absl::FailedPreconditionError(absl::StrCat("gemm int4: path ", GemmPathName(path),
                                                        " is not usable here: ", missing));
    }
    const int64_t m = x.size(0);
    if (m == 0) return absl::OkStatus();
    internal::Problem p;
    const at::Tensor xb = internal::FillProblem(x, *y, o, &p);
    const int64_t kpairs = w.k_padded() / 2;
    const int64_t cols = gate_up ? 16 : kPanelCols;
    p.w = {nullptr, w.k(), kpairs, (n + cols - 1) / cols};
    p.epilogue.gate_up = gate_up;
    const Int4Panels source(w, gate_up, n, kpairs, path == GemmPath::kAvx2);
    internal::RunBlocked(p, m, path, o, &source);
    return absl::OkStatus();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("gemm int4: out of memory");
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("gemm int4: ", e.what_without_backtrace()));
  }
}

}  // namespace vlm::kernels
