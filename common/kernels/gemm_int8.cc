// GemmInt8: the blocked Gemm over int8 weights, their panels made per task
// (gemm.h). The conversion reads the weights in their stored order (quantize.h):
// one 64-byte chunk of a full block holds, in dword lane l, four consecutive
// elements of group l, so a row's 16 group scales line up with the lanes and
// a 16 x 16 dword transpose turns 16 rows' lanes into the panel's k-pairs.
#include <algorithm>
#include <cstdint>
#include <new>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "absl/strings/str_cat.h"
#include "common/kernels/gemm.h"
#include "common/kernels/gemm_internal.h"
#include "common/kernels/quantize.h"
#include "common/kernels/simd.h"

namespace vlm::kernels {
namespace {

using internal::kPanelCols;

// Prefetch distance along each of the 16 rows a half panel reads: one
// 512-element block. On Zen 4 (one thread, 2048 x 2048) it nearly halves the
// conversion's cost beyond the bf16 Gemm's time at M = 1 against no prefetch;
// 1 and 2 KiB measured no better.
constexpr int64_t kAhead = 512;

// Rows 0..15 of `r` transposed in place: afterwards r[c] lane i = old r[i] lane c.
VLM_TARGET_AVX512_BF16 inline void Transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4a + b], per 128-bit lane q: column 4q + b of rows 4a..4a+3.
  for (int a = 0; a < 16; a += 4) {
    u[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
    u[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
    u[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
    u[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
  }
  for (int b = 0; b < 4; ++b) {
    // 0x88 takes 128-bit lanes (0, 2) of each operand, 0xdd lanes (1, 3).
    const __m512i v = _mm512_shuffle_i32x4(u[b], u[4 + b], 0x88);   // cols b, 8+b; rows 0-7
    const __m512i w = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0x88);  // rows 8-15
    const __m512i v2 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0xdd);  // cols 4+b, 12+b
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0xdd);
    r[b] = _mm512_shuffle_i32x4(v, w, 0x88);
    r[8 + b] = _mm512_shuffle_i32x4(v, w, 0xdd);
    r[4 + b] = _mm512_shuffle_i32x4(v2, w2, 0x88);
    r[12 + b] = _mm512_shuffle_i32x4(v2, w2, 0xdd);
  }
}

// The panel columns [16h, 16h + 16) of one panel (dst: its first k-pair)
// from the int8 rows rows[0..16) (-1: a column past the weight, zero).
// Element k of row r becomes bf16(scale(r, k / 32)·q[r, k]) at k-pair k / 2.
VLM_TARGET_AVX512_BF16 void FillHalfPanel(const QuantizedWeight& w, const int64_t rows[16], int h,
                              int64_t kpairs, uint16_t* dst) {
  const int64_t kp = w.k_padded(), groups = w.groups();
  const int64_t full = kp / kInt8Block * kInt8Block;
  // Word 2l of a pair vector: the even element of lane l, 2l + 1 the odd one.
  alignas(64) static const uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const __m512i flip = _mm512_set1_epi32(static_cast<int>(0x80808080u));  // q + 128 -> q
  for (int64_t s = 0; s < full; s += kInt8Block) {
    // scale[l] lane i: the scale of group l of the block in row i.
    __m512i scale[16];
    for (int i = 0; i < 16; ++i) {
      if (rows[i] < 0) {
        scale[i] = _mm512_setzero_si512();
        continue;
      }
      const __m512 ratio = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(w.ratios() + rows[i] * groups + s / kInt8Group)));
      scale[i] = _mm512_castps_si512(_mm512_mul_ps(_mm512_set1_ps(w.row_scales()[rows[i]]), ratio));
    }
    Transpose16(scale);
    for (int j = 0; j < 8; ++j) {
      // Chunk j of row i, lane l: elements s + 32l + 4j + e (e = 0..3) of
      // group l. Transposed, q[l] lane i holds them for row i: the 16
      // columns of k-pairs (s + 32l + 4j) / 2 (e = 0, 1) and the next (e = 2, 3).
      __m512i q[16];
      for (int i = 0; i < 16; ++i) {
        if (rows[i] < 0) {
          q[i] = flip;  // q = 0 after the flip
          continue;
        }
        const uint8_t* src = w.row(rows[i]) + s + 64 * j;
        // 16 rows are 16 streams, more than the hardware prefetchers
        // follow: fetch each a block ahead into L2 (prefetches never fault).
        _mm_prefetch(reinterpret_cast<const char*>(src) + kAhead, _MM_HINT_T1);
        q[i] = _mm512_loadu_si512(src);
      }
      Transpose16(q);
      for (int l = 0; l < 16; ++l) {
        const __m512i v = _mm512_xor_si512(q[l], flip);  // signed q in each byte
        const __m512 sc = _mm512_castsi512_ps(scale[l]);
        // Byte e of each dword, sign-extended: shifted to the top, then down.
        const __m512 v0 = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24)), sc);
        const __m512 v1 = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24)), sc);
        const __m512 v2 = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24)), sc);
        const __m512 v3 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24)), sc);
        const int64_t pair = (s + 32 * l + 4 * j) / 2;
        uint16_t* out = dst + (pair * kPanelCols + 16 * h) * 2;
        _mm512_store_si512(out, _mm512_permutexvar_epi16(
                                    interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0))));
        _mm512_store_si512(out + 2 * kPanelCols,
                           _mm512_permutexvar_epi16(
                               interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v3, v2))));
      }
    }
  }
  // Groups after the last full block: natural order.
  for (int64_t pair = full / 2; pair < kpairs; ++pair) {
    for (int i = 0; i < 16; ++i) {
      for (int e = 0; e < 2; ++e) {
        const int64_t k = 2 * pair + e;
        float v = 0;
        if (rows[i] >= 0) {
          v = w.scale(rows[i], k / kInt8Group) * static_cast<float>(int{w.row(rows[i])[k]} - 128);
        }
        dst[(pair * kPanelCols + 16 * h + i) * 2 + e] = c10::BFloat16(v).x;
      }
    }
  }
}

// FillHalfPanel in portable code (the avx2 path: no AVX-512 to transpose
// with): the same bf16 values, element by element in natural order.
void FillHalfPanelScalar(const QuantizedWeight& w, const int64_t rows[16], int h,
                         int64_t kpairs, uint16_t* dst) {
  const int64_t kp = w.k_padded();
  for (int i = 0; i < 16; ++i) {
    for (int64_t pair = 0; pair < kpairs; ++pair) {
      for (int e = 0; e < 2; ++e) {
        const int64_t k = 2 * pair + e;
        float v = 0;
        if (rows[i] >= 0 && k < kp) {
          v = static_cast<float>(w.value(rows[i], k)) * w.scale(rows[i], k / kInt8Group);
        }
        dst[(pair * kPanelCols + 16 * h + i) * 2 + e] = c10::BFloat16(v).x;
      }
    }
  }
}

class Int8Panels : public internal::PanelSource {
 public:
  // n: output columns (gate_up: I, the weight holding 2I rows). portable:
  // make the panels without AVX-512 (the avx2 path).
  Int8Panels(const QuantizedWeight& w, bool gate_up, int64_t n, int64_t kpairs, bool portable)
      : w_(w), gate_up_(gate_up), portable_(portable), n_(n), kpairs_(kpairs) {}

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
        if (portable_) FillHalfPanelScalar(w_, rows, h, kpairs_, dst);
        else FillHalfPanel(w_, rows, h, kpairs_, dst);
      }
    }
  }

 private:
  const QuantizedWeight& w_;
  const bool gate_up_, portable_;
  const int64_t n_, kpairs_;
};

}  // namespace

absl::Status GemmInt8(const at::Tensor& x, const QuantizedWeight& w, at::Tensor* y,
                      const GemmOptions& o) {
  try {
    if (w.empty()) return absl::InvalidArgumentError("gemm int8: weight is empty");
    const bool gate_up = o.activation == Activation::kSiluMul;
    if (gate_up && w.n() % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gemm int8: a gate/up weight holds 2·I rows; got ", w.n()));
    }
    const int64_t n = gate_up ? w.n() / 2 : w.n();
    if (absl::Status s = internal::CheckOperands(x, w.k(), n, y, o); !s.ok()) return s;
    const GemmPath path = o.path.value_or(DefaultGemmPath());
    if (path == GemmPath::kTorch) {
      return absl::FailedPreconditionError(
          "gemm int8: needs the amx, avx512bf16 or avx2 path, not torch");
    }
    std::string missing;
    if (!GemmPathSupported(path, &missing)) {
      return absl::FailedPreconditionError(absl::StrCat("gemm int8: path ", GemmPathName(path),
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
    const Int8Panels source(w, gate_up, n, kpairs, path == GemmPath::kAvx2);
    internal::RunBlocked(p, m, path, o, &source);
    return absl::OkStatus();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("gemm int8: out of memory");
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("gemm int8: ", e.what_without_backtrace()));
  }
}

}  // namespace vlm::kernels
