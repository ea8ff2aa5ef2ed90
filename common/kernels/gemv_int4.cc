#include "common/kernels/gemv_int4.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "absl/strings/str_cat.h"
#include "common/cpu_features.h"
#include "common/kernels/path_override.h"
#include "common/kernels/quantize.h"
#include "common/kernels/simd.h"
#include "common/kernels/thread_pool.h"

namespace vlm::kernels {
namespace {

constexpr int64_t kGroup = kInt4Group;
constexpr int64_t kBlock = kInt4Block;
static_assert(kInt4Group == kInt8Group && kInt4Block == kInt8Block,
              "activations use the int8 weights' stored order (quantize.h StoredIndex)");
// Activations in int8: |xq| ≤ 127, VPDPBUSD's signed operand.
constexpr float kXLimit = 127.0f;

// Storage for T that only grows, 64-byte aligned; contents unspecified after resize.
template <typename T>
class AlignedBuffer {
 public:
  void resize(int64_t n) {
    if (n <= capacity_) return;
    const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
    T* p = static_cast<T*>(std::aligned_alloc(64, bytes));
    if (p == nullptr) throw std::bad_alloc();
    data_.reset(p);
    capacity_ = n;
  }
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  int64_t capacity_ = 0;
};

// x quantized per group of 32: q [B][k_padded] natural order (zero past K),
// d [B][groups], sums [B][groups] = Σ_group q; x8 [B][k_padded] the same q
// in the int8 weights' stored order (StoredIndex: chunk 2c of a block pairs
// with the low nibbles of the int4 chunk c, chunk 2c + 1 with the high ones;
// tail groups natural).
struct QuantizedX {
  int64_t batch = 0, k_padded = 0, groups = 0;
  AlignedBuffer<int8_t> q;
  AlignedBuffer<float> d;
  AlignedBuffer<int32_t> sums;
  AlignedBuffer<int8_t> x8;

  void Resize(int64_t b, int64_t kp) {
    batch = b;
    k_padded = kp;
    groups = kp / kGroup;
    q.resize(b * kp);
    d.resize(b * groups);
    sums.resize(b * groups);
    x8.resize(b * kp);
  }
};

using simd::ToF32;

// Helpers the vector kernels call per row are inlined into them (compiled
// for their target): a call into generic SSE code from AVX-512 code with
// zmm16-31 in use runs it with a dirty upper state, many times slower.
[[gnu::always_inline]] inline float HalfToFloat(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// d = max|x| / 127, q = round-to-nearest-even(x·(1/d)) clamped to ±127,
// also written to its stored position, and the sums.
template <typename T>
void QuantizeRowScalar(const T* src, int64_t k, int64_t kp, int8_t* q, float* d, int32_t* sums,
                       int8_t* x8) {
  for (int64_t g = 0; g < kp / kGroup; ++g) {
    const int64_t k0 = g * kGroup, k1 = std::min(k, k0 + kGroup);
    float amax = 0;
    for (int64_t i = k0; i < k1; ++i) amax = std::max(amax, std::fabs(ToF32(src[i])));
    const float scale = amax / kXLimit;
    const float inv = scale > 0 ? 1.0f / scale : 0.0f;
    int32_t sum = 0;
    for (int64_t i = k0; i < k0 + kGroup; ++i) {
      const int8_t v =
          i < k1 ? static_cast<int8_t>(
                       std::clamp(std::nearbyint(ToF32(src[i]) * inv), -kXLimit, kXLimit))
                 : int8_t{0};
      q[i] = v;
      sum += v;
      x8[StoredIndex(i, kp)] = v;
    }
    d[g] = scale;
    sums[g] = sum;
  }
}

// Elements [i0, i0 + 16) of a row of k, zero past k.
template <typename T>
VLM_TARGET_AVX512_VNNI inline __m512 Load16(const T* src, int64_t i0, int64_t k) {
  return simd::Load16(src + i0, simd::Mask16(k - i0));
}

// round(v·inv) clamped to ±127 as int8 (VCVTPS2DQ rounds to nearest even,
// as std::nearbyint does in the default mode).
VLM_TARGET_AVX512_VNNI inline __m128i Quantize16(__m512 v, __m512 inv) {
  const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
  return _mm512_cvtepi32_epi8(
      _mm512_max_epi32(_mm512_min_epi32(r, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127)));
}

// QuantizeRowScalar with AVX-512: the same f32 operations, the same bytes.
template <typename T>
VLM_TARGET_AVX512_VNNI void QuantizeRowVnni(const T* src, int64_t k, int64_t kp, int8_t* q, float* d,
                                     int32_t* sums, int8_t* x8) {
  const __m256i quad_slots = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
  const int64_t full_groups = kp / kBlock * kBlock / kGroup;
  for (int64_t g = 0; g < kp / kGroup; ++g) {
    const int64_t k0 = g * kGroup;
    const __m512 vlo = Load16(src, k0, k), vhi = Load16(src, k0 + 16, k);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(vlo), _mm512_abs_ps(vhi)));
    const float scale = amax / kXLimit;
    const __m512 inv = _mm512_set1_ps(scale > 0 ? 1.0f / scale : 0.0f);
    const __m256i xq = _mm256_inserti128_si256(_mm256_castsi128_si256(Quantize16(vlo, inv)),
                                               Quantize16(vhi, inv), 1);  // 32 int8
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0), xq);
    d[g] = scale;
    sums[g] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(xq))) +
              _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(xq, 1)));
    if (g < full_groups) {
      _mm256_i32scatter_epi32(x8 + g / 16 * kBlock + 4 * (g % 16), quad_slots, xq, 4);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x8 + k0), xq);
    }
  }
}

template <typename T>
void QuantizeRows(const T* src, int64_t ld, int64_t k, bool vnni, int64_t b0, int64_t b1,
                  QuantizedX* out) {
  const int64_t kp = out->k_padded, groups = out->groups;
  for (int64_t b = b0; b < b1; ++b) {
    if (vnni) {
      QuantizeRowVnni(src + b * ld, k, kp, out->q.data() + b * kp, out->d.data() + b * groups,
                      out->sums.data() + b * groups, out->x8.data() + b * kp);
    } else {
      QuantizeRowScalar(src + b * ld, k, kp, out->q.data() + b * kp, out->d.data() + b * groups,
                        out->sums.data() + b * groups, out->x8.data() + b * kp);
    }
  }
}

constexpr int64_t kSmallBatch = 8;  // quantized on the calling thread

void QuantizeX(const at::Tensor& x, int64_t kp, bool vnni, int threads, QuantizedX* out) {
  out->Resize(x.size(0), kp);
  const int64_t ld = x.size(0) > 1 ? x.stride(0) : x.size(1);
  const int64_t k = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* src = x.data_ptr();
  auto rows = [&](int64_t b0, int64_t b1) {
    if (bf16) QuantizeRows(static_cast<const c10::BFloat16*>(src), ld, k, vnni, b0, b1, out);
    else QuantizeRows(static_cast<const float*>(src), ld, k, vnni, b0, b1, out);
  };
  if (out->batch <= kSmallBatch) {
    rows(0, out->batch);
  } else {
    const auto* fn = &rows;
    ParallelFor(out->batch, threads, 8, [fn](int64_t b0, int64_t b1) { (*fn)(b0, b1); });
  }
}

struct Output {
  void* y = nullptr;
  bool bf16 = false;
  int64_t n = 0;
  [[gnu::always_inline]] void Store(int64_t b, int64_t row, float v) const {
    if (bf16) static_cast<uint16_t*>(y)[b * n + row] = simd::F32ToBf16(v);
    else static_cast<float*>(y)[b * n + row] = v;
  }
};

// Exact Σ (u - z)·q over group g of row r (natural order, for tail groups
// and the scalar path).
[[gnu::always_inline]] inline int32_t GroupSum(const Int4Weight& w, int64_t r, int64_t g, const int8_t* xq) {
  const int z = w.zero(r, g);
  int32_t isum = 0;
  for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) {
    isum += int32_t{xq[i]} * (w.stored(r, i) - z);
  }
  return isum;
}

// The 16 lane sums of the full blocks by a fixed tree: lane i + lane i + 8,
// then + 4, + 2, + 1 (the vector paths do the same adds on register halves).
[[gnu::always_inline]] inline float ReduceLanes(const float lanes[16]) {
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) t[i] += t[i + 4];
  for (int i = 0; i < 2; ++i) t[i] += t[i + 2];
  return t[0] + t[1];
}

// The f32 part shared by every path after the lanes' tree (`sum`): the tail
// groups (one FMA each, in order), then the row scale.
[[gnu::always_inline]] inline float Finish(const Int4Weight& w, int64_t r, const QuantizedX& x, int64_t b, float sum) {
  const int64_t full_groups = x.k_padded / kBlock * kBlock / kGroup;
  const int8_t* xq = x.q.data() + b * x.k_padded;
  for (int64_t g = full_groups; g < x.groups; ++g) {
    const float scale = HalfToFloat(w.ratios()[r * x.groups + g]) * x.d.data()[b * x.groups + g];
    sum = std::fma(static_cast<float>(GroupSum(w, r, g, xq)), scale, sum);
  }
  return w.row_scales()[r] * sum;
}

// ReduceLanes after its first step, on a register of t[0..8).
VLM_INLINE_AVX2 float ReduceLanes256(__m256 t8) {
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));           // t0 + t2, t1 + t3
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));          // + t1
}

// 8 finite f16 bit patterns -> f32, exact (subnormals included) without
// F16C: exponent and mantissa moved into f32 position, then scaled by
// 2^(127 - 15); the sign copied.
VLM_INLINE_AVX2 __m256 HalfToF32x8(__m128i h) {
  const __m256i v = _mm256_cvtepu16_epi32(h);
  const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7FFF)), 13);
  const __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_castsi256_ps(_mm256_set1_epi32(0x77800000)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x8000)), 16);
  return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}

// --- scalar --------------------------------------------------------------------
void RowsScalar(const QuantizedX& x, const Int4Weight& w, const Output& out, int64_t r0,
                int64_t r1) {
  const int64_t full_groups = x.k_padded / kBlock * kBlock / kGroup;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < x.batch; ++b) {
      const int8_t* xq = x.q.data() + b * x.k_padded;
      float lanes[16] = {};
      for (int64_t g = 0; g < full_groups; ++g) {
        const float scale = HalfToFloat(w.ratios()[r * x.groups + g]) * x.d.data()[b * x.groups + g];
        lanes[g % 16] = std::fma(static_cast<float>(GroupSum(w, r, g, xq)), scale, lanes[g % 16]);
      }
      out.Store(b, r, Finish(w, r, x, b, ReduceLanes(lanes)));
    }
  }
}

// --- avx512vnni ------------------------------------------------------------------
// ReduceLanes on a register: the same adds in the same order.
VLM_TARGET_AVX512_VNNI [[gnu::always_inline]] inline float ReduceLanes512(__m512 v) {
  const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}

// Software prefetch into L2, this far past the furthest row of a tile (as GemvInt8).
constexpr int64_t kPrefetchLead = 2048;

// A tile of R weight rows × NB batch rows (NB ≤ 4). Per 64-byte chunk of a
// row (128 weights): the low nibbles (AND 0x0F) and the high nibbles in
// place (AND 0xF0, i.e. 16·u), each a u8 vector whose lane l holds 4 weights
// of group l, one VPDPBUSD each with the int8 activations; the high sums,
// multiples of 16, are shifted back once per block. Integer sums exact
// (|Σ 16·u·xq| ≤ 16·16·15·127 per lane), so the split over the nibble
// accumulators and the shift change nothing. z·Σxq by VPMADDWD (z ≤ 15 and
// |Σxq| ≤ 32·127 fit the low 16 bits; the high halves give 0·(±1)).
// Pointers advance per block: the loop holds no index arithmetic. `tiles`
// consecutive tiles of R rows from r0, one after the other (the set-up once).
template <int R, int NB>
VLM_TARGET_AVX512_VNNI void TileVnni(const QuantizedX& x, int64_t b0, const Int4Weight& w,
                                     int64_t first_row, int64_t tiles, const Output& out) {
  const int64_t kp = x.k_padded, full = kp / kBlock * kBlock, groups = x.groups;
  const int64_t rb = w.row_bytes();
  const int64_t ahead = (R - 1) * rb + kPrefetchLead;
  const __m512i lo_mask = _mm512_set1_epi8(0x0F);
  for (int64_t r0 = first_row; r0 < first_row + tiles * R; r0 += R) {
  const uint8_t* wp[R];
  const uint16_t* ratio_p[R];
  const uint8_t* zero_p[R];
  for (int r = 0; r < R; ++r) {
    wp[r] = w.row(r0 + r);
    ratio_p[r] = w.ratios() + (r0 + r) * groups;
    zero_p[r] = w.zeros() + (r0 + r) * groups;
  }
  const int8_t* xp = x.x8.data() + b0 * kp;
  const int32_t* sums_p = x.sums.data() + b0 * groups;
  const float* d_p = x.d.data() + b0 * groups;
  __m512 facc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) facc[r][b] = _mm512_setzero_ps();
  for (int64_t s = 0; s < full; s += kBlock) {
    // Four chains per (row, batch row): the nibble halves of even and odd chunks.
    __m512i acc[R][NB][4];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b)
        for (int a = 0; a < 4; ++a) acc[r][b][a] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512i wl[R], wh[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(wp[r] + 64 * c + ahead), _MM_HINT_T1);
        const __m512i v = _mm512_loadu_si512(wp[r] + 64 * c);
        wl[r] = _mm512_and_si512(v, lo_mask);
        wh[r] = _mm512_andnot_si512(lo_mask, v);
      }
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        const __m512i x0 = _mm512_loadu_si512(xp + b * kp + 128 * c);
        const __m512i x1 = _mm512_loadu_si512(xp + b * kp + 128 * c + 64);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          acc[r][b][c % 2] = _mm512_dpbusd_epi32(acc[r][b][c % 2], wl[r], x0);
          acc[r][b][2 + c % 2] = _mm512_dpbusd_epi32(acc[r][b][2 + c % 2], wh[r], x1);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 ratio =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ratio_p[r])));
      const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zero_p[r])));
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        const __m512i zs = _mm512_madd_epi16(z, _mm512_loadu_si512(sums_p + b * groups));
        const __m512i lo = _mm512_add_epi32(acc[r][b][0], acc[r][b][1]);
        const __m512i hi16 = _mm512_add_epi32(acc[r][b][2], acc[r][b][3]);
        const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(lo, _mm512_srai_epi32(hi16, 4)), zs);
        const __m512 scale = _mm512_mul_ps(ratio, _mm512_loadu_ps(d_p + b * groups));
        facc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, facc[r][b]);
      }
      wp[r] += kBlock / 2;
      ratio_p[r] += kBlock / kGroup;
      zero_p[r] += kBlock / kGroup;
    }
    xp += kBlock;
    sums_p += kBlock / kGroup;
    d_p += kBlock / kGroup;
  }
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < NB; ++b) {
      out.Store(b0 + b, r0 + r, Finish(w, r0 + r, x, b0 + b, ReduceLanes512(facc[r][b])));
    }
  }
  }
}

// `tiles` tiles of R rows from r0. Up to 4 batch rows: one call over every
// tile. More: per tile, every batch tile, so the tile's weights are read
// from memory once and then from L1/L2.
template <int R>
VLM_TARGET_AVX512_VNNI void RowTilesVnni(const QuantizedX& x, const Int4Weight& w, int64_t r0,
                                         int64_t tiles, const Output& out) {
  auto run = [&](int64_t b0, int64_t first, int64_t count) {
    switch (std::min<int64_t>(4, x.batch - b0)) {
      case 1: TileVnni<R, 1>(x, b0, w, first, count, out); break;
      case 2: TileVnni<R, 2>(x, b0, w, first, count, out); break;
      case 3: TileVnni<R, 3>(x, b0, w, first, count, out); break;
      default: TileVnni<R, 4>(x, b0, w, first, count, out); break;
    }
  };
  if (x.batch <= 4) return run(0, r0, tiles);
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t b0 = 0; b0 < x.batch; b0 += 4) run(b0, r0 + t * R, 1);
  }
}

// B = 1: one row at a time (one sequential stream per thread); B ≥ 2: pairs
// of rows, which halve the loads of x.
VLM_TARGET_AVX512_VNNI void RowsVnni(const QuantizedX& x, const Int4Weight& w, const Output& out,
                                     int64_t r0, int64_t r1) {
  int64_t r = r0;
  if (x.batch >= 2) {
    RowTilesVnni<2>(x, w, r, (r1 - r) / 2, out);
    r += (r1 - r) / 2 * 2;
  }
  RowTilesVnni<1>(x, w, r, r1 - r, out);
  _mm256_zeroupper();
}

// --- avx2 ------------------------------------------------------------------------
// One weight row × NB batch rows (NB ≤ 2), each block in two halves of 8
// groups (a 32-byte load: lanes 8h..8h+7 of TileVnni's chunk). Per half:
// VPMADDUBSW (u·x pairs, |2·15·127| fits int16) and VPMADDWD with ones give
// one int32 per group; the f32 accumulation per lane is TileVnni's.
VLM_TARGET_AVX2 inline __m256i Load32(const int8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

template <int NB>
VLM_TARGET_AVX2 void TileAvx2(const QuantizedX& x, int64_t b0, const Int4Weight& w, int64_t row,
                              const Output& out) {
  const int64_t kp = x.k_padded, full = kp / kBlock * kBlock, groups = x.groups;
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* wr = w.row(row);
  __m256 facc[NB][2];
  for (int b = 0; b < NB; ++b) facc[b][0] = facc[b][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < full; s += kBlock) {
    const int64_t g0 = s / kGroup;
    for (int h = 0; h < 2; ++h) {
      __m256i acc[NB];
      for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const uint8_t* wp = wr + s / 2 + 64 * c + 32 * h;
        _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchLead), _MM_HINT_T1);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
        const __m256i wl = _mm256_and_si256(v, mask);
        const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        for (int b = 0; b < NB; ++b) {
          const int64_t off = (b0 + b) * kp + s + 128 * c + 32 * h;
          const __m256i x0 = Load32(x.x8.data() + off), x1 = Load32(x.x8.data() + off + 64);
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(wl, x0),
                                                 _mm256_maddubs_epi16(wh, x1));  // |·| ≤ 7620
          acc[b] = _mm256_add_epi32(acc[b], _mm256_madd_epi16(pairs, ones));
        }
      }
      const int64_t gh = g0 + 8 * h;
      const __m256 ratio = HalfToF32x8(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.ratios() + row * groups + gh)));
      const __m256i z = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.zeros() + row * groups + gh)));
      for (int b = 0; b < NB; ++b) {
        const int64_t xb = (b0 + b) * groups + gh;
        // z·Σxq as in TileVnni (VPMADDWD: both fit 16 bits).
        const __m256i zs = _mm256_madd_epi16(
            z, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums.data() + xb)));
        const __m256i isum = _mm256_sub_epi32(acc[b], zs);
        const __m256 scale = _mm256_mul_ps(ratio, _mm256_loadu_ps(x.d.data() + xb));
        facc[b][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, facc[b][h]);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const float sum = ReduceLanes256(_mm256_add_ps(facc[b][0], facc[b][1]));
    out.Store(b0 + b, row, Finish(w, row, x, b0 + b, sum));
  }
}

VLM_TARGET_AVX2 void RowsAvx2(const QuantizedX& x, const Int4Weight& w, const Output& out,
                              int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    int64_t b0 = 0;
    for (; b0 + 2 <= x.batch; b0 += 2) TileAvx2<2>(x, b0, w, r, out);
    if (b0 < x.batch) TileAvx2<1>(x, b0, w, r, out);
  }
  _mm256_zeroupper();
}

GemvInt4Path BestPath() {
  if (GemvInt4PathSupported(GemvInt4Path::kAvx512Vnni)) return GemvInt4Path::kAvx512Vnni;
  if (GemvInt4PathSupported(GemvInt4Path::kAvx2)) return GemvInt4Path::kAvx2;
  return GemvInt4Path::kScalar;
}

constexpr int64_t kRowsPerTask = 64;

}  // namespace

const char* GemvInt4PathName(GemvInt4Path path) {
  switch (path) {
    case GemvInt4Path::kAvx512Vnni:
      return "avx512vnni";
    case GemvInt4Path::kAvx2:
      return "avx2";
    case GemvInt4Path::kScalar:
      return "scalar";
  }
  return "?";
}

absl::StatusOr<GemvInt4Path> ParseGemvInt4Path(std::string_view name) {
  if (name == "auto") return BestPath();
  for (GemvInt4Path p : {GemvInt4Path::kAvx512Vnni, GemvInt4Path::kAvx2, GemvInt4Path::kScalar}) {
    if (name == GemvInt4PathName(p)) return p;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown int4 gemv path '", std::string(name),
                                                 "'; expected avx512vnni, avx2, scalar or auto"));
}

bool GemvInt4PathSupported(GemvInt4Path path, std::string* missing) {
  const CpuFeatures& f = GetCpuFeatures();
  switch (path) {
    case GemvInt4Path::kScalar:
      return true;
    case GemvInt4Path::kAvx2:
      if (f.avx2 && f.fma) return true;
      if (missing != nullptr) *missing = "AVX2 with FMA";
      return false;
    case GemvInt4Path::kAvx512Vnni:
      if (f.fast_bf16_matmul() && f.avx512vnni) return true;
      if (missing != nullptr) *missing = "AVX-512 VNNI (with F/BW/VL/DQ)";
      return false;
  }
  return false;
}

GemvInt4Path DefaultGemvInt4Path() {
  static const GemvInt4Path path = internal::PathFromEnvironment(
      "VLM_GEMV_INT4_PATH", BestPath(), ParseGemvInt4Path,
      [](GemvInt4Path p, std::string* missing) { return GemvInt4PathSupported(p, missing); });
  return path;
}

absl::Status GemvInt4(const at::Tensor& x, const Int4Weight& w, at::Tensor* y,
                      const GemvInt4Options& options) {
  try {
    if (w.empty()) return absl::InvalidArgumentError("int4 gemv: weight is empty");
    if (!x.defined() || x.device().type() != at::kCPU || x.dim() != 2 ||
        (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "int4 gemv: x must be a 2-D bf16 or f32 CPU tensor [B, K]; got ",
          x.defined() ? x.toString() + " " + std::to_string(x.dim()) + "-D" : std::string("undefined")));
    }
    if (x.size(1) != w.k()) {
      return absl::InvalidArgumentError(
          absl::StrCat("int4 gemv: x has K = ", x.size(1), " but the weight has K = ", w.k()));
    }
    if (y == nullptr) return absl::InvalidArgumentError("int4 gemv: output pointer is null");
    const int64_t batch = x.size(0), n = w.n();
    if (!y->defined()) *y = at::empty({batch, n}, at::kFloat);
    if (y->dim() != 2 || y->size(0) != batch || y->size(1) != n || !y->is_contiguous() ||
        (y->scalar_type() != at::kFloat && y->scalar_type() != at::kBFloat16)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "int4 gemv: y must be a contiguous f32 or bf16 [", batch, ", ", n, "] tensor"));
    }
    const GemvInt4Path path = options.path.value_or(DefaultGemvInt4Path());
    std::string missing;
    if (!GemvInt4PathSupported(path, &missing)) {
      return absl::FailedPreconditionError(
          absl::StrCat("int4 gemv path ", GemvInt4PathName(path), " needs ", missing));
    }
    if (batch == 0 || n == 0) return absl::OkStatus();
    thread_local QuantizedX x_scratch;
    QuantizedX& qx = x_scratch;
    const bool vnni = path == GemvInt4Path::kAvx512Vnni;
    if (x.size(1) > 1 && x.stride(1) != 1) {
      QuantizeX(x.contiguous(), w.k_padded(), vnni, options.threads, &qx);
    } else {
      QuantizeX(x, w.k_padded(), vnni, options.threads, &qx);
    }
    Output out{y->data_ptr(), y->scalar_type() == at::kBFloat16, n};
    const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
    struct Work {
      const QuantizedX* x;
      const Int4Weight* w;
      const Output* out;
      GemvInt4Path path;
    } work{&qx, &w, &out, path};
    ParallelFor(tasks, options.threads, 1, [k = &work](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r0 = t * kRowsPerTask;
        const int64_t r1 = std::min(k->out->n, r0 + kRowsPerTask);
        switch (k->path) {
          case GemvInt4Path::kAvx512Vnni: RowsVnni(*k->x, *k->w, *k->out, r0, r1); break;
          case GemvInt4Path::kAvx2: RowsAvx2(*k->x, *k->w, *k->out, r0, r1); break;
          case GemvInt4Path::kScalar: RowsScalar(*k->x, *k->w, *k->out, r0, r1); break;
        }
      }
    });
    return absl::OkStatus();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("int4 gemv: out of memory");
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("int4 gemv: ", e.what_without_backtrace()));
  }
}

}  // namespace vlm::kernels
