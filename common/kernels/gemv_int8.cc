#include "common/kernels/gemv_int8.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/cpu_features.h"
#include "common/kernels/thread_pool.h"
#include "common/kernels/path_override.h"
#include "common/kernels/simd.h"

namespace vlm::kernels {
namespace {

constexpr int64_t kGroup = kInt8Group;  // elements per scale (weights and activations)
constexpr int64_t kBlock = kInt8Block;  // interleaved block: 16 groups, one per VPDPBUSD lane
// |xq| ≤ 32639 = 127·256 + 127, so xq = 256·hi + lo with hi, lo both int8.
constexpr float kXLimit = 32639.0f;

// x quantized to int16 per group of 32, in buffers reused by the calling
// thread from call to call: q [B][k_padded] natural order (zero past K),
// d [B][groups] f32; for the VNNI path xq = 256·hi + lo split into int8 hi and
// lo (lo = the low byte as signed) [B][k_padded] in the weights' stored order
// (quantize.h StoredIndex), and bias [B][groups] = -128·Σ_group xq, which
// cancels the +128 of the stored weights.
// Storage for T that only grows, 64-byte aligned: with k_padded a multiple
// of 64 every 64-byte load of an x row stays within one cache line (a
// std::vector is 16-byte aligned). On Zen 4 this did not measurably change
// prefill GFLOP/s (loads are not its limit), but costs nothing. Contents
// are unspecified after resize.
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
  T& operator[](int64_t i) { return data_.get()[i]; }
  const T& operator[](int64_t i) const { return data_.get()[i]; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  int64_t capacity_ = 0;
};

struct QuantizedX {
  int64_t batch = 0, k_padded = 0, groups = 0;
  AlignedBuffer<int16_t> q;
  AlignedBuffer<float> d;
  AlignedBuffer<int8_t> hi, lo;
  AlignedBuffer<int32_t> bias;

  void Resize(int64_t b, int64_t kp, bool vnni) {
    batch = b;
    k_padded = kp;
    groups = kp / kGroup;
    q.resize(b * kp);
    d.resize(b * groups);
    if (vnni) {
      hi.resize(b * kp);
      lo.resize(b * kp);
      bias.resize(b * groups);
    }
  }
};

using simd::ToF32;

float HalfToFloat(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Groups of one row: d = max|x| / 32639, q = round-to-nearest-even(x·(1/d)),
// clamped to ±32639, in natural order. The VNNI path's vector version below
// computes the same f32 operations, so both paths see identical q and d.
template <typename T>
void QuantizeRowScalar(const T* src, int64_t k, int64_t kp, int16_t* q, float* d) {
  for (int64_t g = 0; g < kp / kGroup; ++g) {
    const int64_t k0 = g * kGroup, k1 = std::min(k, k0 + kGroup);
    float amax = 0;
    for (int64_t i = k0; i < k1; ++i) amax = std::max(amax, std::fabs(ToF32(src[i])));
    const float scale = amax / kXLimit;
    const float inv = scale > 0 ? 1.0f / scale : 0.0f;
    for (int64_t i = k0; i < k0 + kGroup; ++i) {
      q[i] = i < k1 ? static_cast<int16_t>(
                          std::clamp(std::nearbyint(ToF32(src[i]) * inv), -kXLimit, kXLimit))
                    : 0;
    }
    d[g] = scale;
  }
}

// 16 elements i0.. of a row as f32; lanes at or past k are zero.
template <typename T>
VLM_TARGET_AVX512_VNNI inline __m512 Load16(const T* src, int64_t i0, int64_t k) {
  return simd::Load16(src + i0, simd::Mask16(k - i0));
}

// round(v·inv) clamped to ±32639 as int16; VCVTPS2DQ rounds to nearest even
// (the default MXCSR mode), as std::nearbyint does.
VLM_TARGET_AVX512_VNNI inline __m256i Quantize16(__m512 v, __m512 inv, __m512i lim, __m512i neg_lim) {
  const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
  return _mm512_cvtepi32_epi16(_mm512_max_epi32(_mm512_min_epi32(r, lim), neg_lim));
}

// The same q and d as QuantizeRowScalar (natural order), and for the kernel
// hi, lo written straight to their stored positions (group l of a full block:
// its quad j to quad slot 16·j + l; tail groups in order) and bias per group.
template <typename T>
VLM_TARGET_AVX512_VNNI void QuantizeRowVnni(const T* src, int64_t k, int64_t kp, int16_t* q, float* d,
                                     int8_t* hi, int8_t* lo, int32_t* bias) {
  const __m512i lim = _mm512_set1_epi32(32639), neg_lim = _mm512_set1_epi32(-32639);
  const __m512i ones = _mm512_set1_epi16(1);
  const __m256i quad_slots = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
  const int64_t full_groups = kp / kBlock * kBlock / kGroup;
  for (int64_t g = 0; g < kp / kGroup; ++g) {
    const int64_t k0 = g * kGroup;
    const __m512 vlo = Load16(src, k0, k), vhi = Load16(src, k0 + 16, k);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(vlo), _mm512_abs_ps(vhi)));
    const float scale = amax / kXLimit;
    const __m512 inv = _mm512_set1_ps(scale > 0 ? 1.0f / scale : 0.0f);
    const __m512i xq = _mm512_inserti64x4(
        _mm512_castsi256_si512(Quantize16(vlo, inv, lim, neg_lim)), Quantize16(vhi, inv, lim, neg_lim),
        1);  // 32 int16
    _mm512_storeu_si512(q + k0, xq);
    d[g] = scale;
    // lo = the low byte as signed, hi = (xq - lo) / 256.
    const __m512i lo16 = _mm512_srai_epi16(_mm512_slli_epi16(xq, 8), 8);
    const __m256i lo8 = _mm512_cvtepi16_epi8(lo16);
    const __m256i hi8 = _mm512_cvtepi16_epi8(_mm512_srai_epi16(_mm512_sub_epi16(xq, lo16), 8));
    bias[g] = -128 * _mm512_reduce_add_epi32(_mm512_madd_epi16(xq, ones));
    if (g < full_groups) {
      const int64_t base = g / 16 * kBlock + 4 * (g % 16);  // quad 0 of group g % 16
      _mm256_i32scatter_epi32(lo + base, quad_slots, lo8, 4);
      _mm256_i32scatter_epi32(hi + base, quad_slots, hi8, 4);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + k0), lo8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + k0), hi8);
    }
  }
}

// Rows [b0, b1) of x into out (already sized).
template <typename T>
void QuantizeXTyped(const T* src, int64_t ld, int64_t k, bool vnni, int64_t b0, int64_t b1,
                    QuantizedX* out) {
  const int64_t kp = out->k_padded;
  for (int64_t b = b0; b < b1; ++b) {
    float* d = out->d.data() + b * out->groups;
    int16_t* q = out->q.data() + b * kp;
    if (vnni) {
      QuantizeRowVnni(src + b * ld, k, kp, q, d, out->hi.data() + b * kp,
                      out->lo.data() + b * kp, out->bias.data() + b * out->groups);
    } else {
      QuantizeRowScalar(src + b * ld, k, kp, q, d);
    }
  }
}

// Batches up to this size are decode steps: quantized on the calling thread
// and multiplied row tile by row tile (RowsVnni); larger ones are prefill
// chunks (PrefillRowsVnni). Each batch row's result is the same either way.
constexpr int64_t kDecodeBatch = 8;

// Every row of x, quantized once per call. Prefill-sized batches split their
// rows over the threads (each row's quantization is independent of the split).
void QuantizeX(const at::Tensor& x, int64_t k_padded, bool vnni, int threads, QuantizedX* out) {
  out->Resize(x.size(0), k_padded, vnni);
  const int64_t ld = x.size(0) > 1 ? x.stride(0) : x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* src = x.data_ptr();
  const int64_t k = x.size(1);
  auto rows = [&](int64_t b0, int64_t b1) {
    if (bf16) {
      QuantizeXTyped(static_cast<const c10::BFloat16*>(src), ld, k, vnni, b0, b1, out);
    } else {
      QuantizeXTyped(static_cast<const float*>(src), ld, k, vnni, b0, b1, out);
    }
  };
  if (out->batch <= kDecodeBatch) {
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
  void Store(int64_t b, int64_t row, float v) const {
    if (bf16) static_cast<c10::BFloat16*>(y)[b * n + row] = c10::BFloat16(v);
    else static_cast<float*>(y)[b * n + row] = v;
  }
};

// --- scalar ------------------------------------------------------------------
// Per group: the exact integer sum, times scale ratio·d; groups summed in
// order; times the row scale.
void RowsScalar(const QuantizedX& x, const QuantizedWeight& w, const Output& out, int64_t r0,
                int64_t r1) {
  const int64_t kp = x.k_padded;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wr = w.row(r);
    const uint16_t* ratios = w.ratios() + r * x.groups;
    for (int64_t b = 0; b < x.batch; ++b) {
      const int16_t* xr = x.q.data() + b * kp;
      float sum = 0;
      for (int64_t g = 0; g < x.groups; ++g) {
        int32_t isum = 0;
        for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) {
          isum += int32_t{xr[i]} * (int32_t{wr[StoredIndex(i, kp)]} - 128);
        }
        sum += HalfToFloat(ratios[g]) * x.d[b * x.groups + g] * static_cast<float>(isum);
      }
      out.Store(b, r, w.row_scales()[r] * sum);
    }
  }
}

// --- avx512vnni ----------------------------------------------------------------
// A tile of R weight rows × NB batch rows (NB ≤ 4; larger batches in groups
// of 4 while the tile's rows stay in L1), the rows read front to back. Per 64
// stored weights (q + 128, u8) and batch row: VPDPBUSD with the int8 hi and
// with the int8 lo parts of xq. In a full block lane l sums group l of the
// block (the interleaved layout), so the integer sums stay in int32 for 8
// instructions, and the block costs (hi << 8) + lo + bias, one convert, one
// scale product (16 f16 ratios · 16 d) and one FMA per (row, batch row).
// Integer sums are exact (per lane |Σ (q+128)·xq| ≤ 32·255·32639 < 2^31), so
// splitting them over A accumulators (latency hiding for small tiles) changes
// nothing: every (row, batch row) gets the same f32 operations whatever the
// tile and batch, which keeps decode rows batch-invariant bit for bit. Tail
// groups (after the last full block) are summed in scalar integers.
// Software prefetch into L2 (T1), 2 KiB ahead of the furthest row of the
// tile: distance (R - 1)·k_padded + 2048 along each row. The rows of a task
// are contiguous, so a tile of R rows reads R lines k_padded apart; prefetching
// each of them 2 KiB past the tile's last row keeps every prefetch ahead of
// what the tile reads (a fixed 2 KiB lands inside the tile for R = 2 at
// K = 2048: the row below, already being read). Into L2 rather than L1: an
// L1 prefetch holds one of the core's few L1 miss buffers for a whole DRAM
// round trip, so L1 prefetches throttle the stream below what the L2
// prefetchers reach without them (vlm-bench-gemv-int8 on Zen 4: closer to the
// read-bandwidth bound at every batch size; leads of 512 B to 16 KiB, T2
// instead of T1 and no prefetch at all were level or worse).
constexpr int64_t kPrefetchLead = 2048;

// kPrefill: the weight tile comes from L2 (no prefetch along the row) and
// each x vector is loaded once into a register for all R rows (GCC would
// otherwise fold it into every VPDPBUSD as a memory operand: R loads).
// The arithmetic is the same either way.
template <int R, int NB, bool kPrefill = false>
VLM_TARGET_AVX512_VNNI void TileVnni(const QuantizedX& x, int64_t b0, const QuantizedWeight& w,
                              int64_t r0, const Output& out) {
  constexpr int A = R * NB >= 2 ? 1 : 2;  // partial sums per (row, batch row) and part
  const int64_t kp = x.k_padded, full = kp / kBlock * kBlock, groups = x.groups;
  const int64_t ahead = (R - 1) * kp + kPrefetchLead;
  const int8_t* xh = x.hi.data() + b0 * kp;
  const int8_t* xl = x.lo.data() + b0 * kp;
  const int32_t* bias = x.bias.data() + b0 * groups;
  const float* d = x.d.data() + b0 * groups;
  __m512 facc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) facc[r][b] = _mm512_setzero_ps();
  for (int64_t s = 0; s < full; s += kBlock) {
    __m512i ah[R][NB][A], al[R][NB][A];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b)
        for (int a = 0; a < A; ++a) ah[r][b][a] = al[r][b][a] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i wv[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const uint8_t* wp = w.row(r0 + r) + s + j * 64;
        if (!kPrefill) {
          _mm_prefetch(reinterpret_cast<const char*>(wp + ahead), _MM_HINT_T1);
        }
        wv[r] = _mm512_loadu_si512(wp);  // rows are 32-byte aligned only
      }
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        __m512i hv = _mm512_loadu_si512(xh + b * kp + s + j * 64);
        __m512i lv = _mm512_loadu_si512(xl + b * kp + s + j * 64);
        if (kPrefill) __asm__("" : "+v"(hv), "+v"(lv));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          ah[r][b][j % A] = _mm512_dpbusd_epi32(ah[r][b][j % A], wv[r], hv);
          al[r][b][j % A] = _mm512_dpbusd_epi32(al[r][b][j % A], wv[r], lv);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 ratio = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(w.ratios() + (r0 + r) * groups + s / kGroup)));
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        __m512i h = ah[r][b][0], l = al[r][b][0];
        for (int a = 1; a < A; ++a) {
          h = _mm512_add_epi32(h, ah[r][b][a]);
          l = _mm512_add_epi32(l, al[r][b][a]);
        }
        const __m512i isum = _mm512_add_epi32(
            _mm512_add_epi32(_mm512_slli_epi32(h, 8), l),
            _mm512_loadu_si512(bias + b * groups + s / kGroup));
        const __m512 scale = _mm512_mul_ps(ratio, _mm512_loadu_ps(d + b * groups + s / kGroup));
        facc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, facc[r][b]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const uint8_t* wr = w.row(r0 + r);
    for (int b = 0; b < NB; ++b) {
      const int16_t* xr = x.q.data() + (b0 + b) * kp;
      float tail = 0;
      for (int64_t g = full / kGroup; g < groups; ++g) {  // natural-order tail groups
        int32_t isum = 0;
        for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) {
          isum += int32_t{xr[i]} * (int32_t{wr[i]} - 128);
        }
        tail += HalfToFloat(w.ratios()[(r0 + r) * groups + g]) * d[b * groups + g] *
                static_cast<float>(isum);
      }
      out.Store(b0 + b, r0 + r,
                w.row_scales()[r0 + r] * (_mm512_reduce_add_ps(facc[r][b]) + tail));
    }
  }
}

// Rows [r0, r0 + R) for every batch row, in groups of up to 4 batch rows.
template <int R>
VLM_TARGET_AVX512_VNNI void RowTileVnni(const QuantizedX& x, const QuantizedWeight& w, int64_t r0,
                                 const Output& out) {
  for (int64_t b0 = 0; b0 < x.batch; b0 += 4) {
    switch (std::min<int64_t>(4, x.batch - b0)) {
      case 1: TileVnni<R, 1>(x, b0, w, r0, out); break;
      case 2: TileVnni<R, 2>(x, b0, w, r0, out); break;
      case 3: TileVnni<R, 3>(x, b0, w, r0, out); break;
      default: TileVnni<R, 4>(x, b0, w, r0, out); break;
    }
  }
}

constexpr int64_t kRowsPerTask = 64;

template <int R>
VLM_TARGET_AVX512_VNNI void TileVnniAnyNB(const QuantizedX& x, int64_t b0, int64_t nb,
                                   const QuantizedWeight& w, int64_t r0, const Output& out);

// B = 1: one row at a time (one sequential stream per thread, the hardware
// prefetchers' best case; x is small and stays in L1). B >= 2: tiles of 2
// rows, which halve the loads of x (it no longer fits L1 at B = 8, K = 6144).
// B = 5..8: the task's rows (64: 128-384 KiB of weights, inside L2) serve
// batch rows 0-3 from DRAM with the prefetch, then rows 4.. from L2, so the
// hi/lo parts of one group of 4 batch rows stay in L1 through each pass
// instead of all 8 cycling through it for every row pair. Same tiles, same
// results.
VLM_TARGET_AVX512_VNNI void RowsVnni(const QuantizedX& x, const QuantizedWeight& w, const Output& out,
                              int64_t r0, int64_t r1) {
  int64_t r = r0;
  if (x.batch > 4) {
    for (; r + 2 <= r1; r += 2) TileVnni<2, 4>(x, 0, w, r, out);
    for (; r < r1; ++r) TileVnni<1, 4>(x, 0, w, r, out);
    for (int64_t b0 = 4; b0 < x.batch; b0 += 4) {
      const int64_t nb = std::min<int64_t>(4, x.batch - b0);
      for (r = r0; r + 2 <= r1; r += 2) TileVnniAnyNB<2>(x, b0, nb, w, r, out);
      for (; r < r1; ++r) TileVnniAnyNB<1>(x, b0, nb, w, r, out);
    }
    _mm256_zeroupper();
    return;
  }
  if (x.batch >= 2) {
    for (; r + 2 <= r1; r += 2) RowTileVnni<2>(x, w, r, out);
  }
  for (; r < r1; ++r) RowTileVnni<1>(x, w, r, out);
  _mm256_zeroupper();
}

// Prefill (batch > kDecodeBatch): the weight rows are split over the threads
// in blocks of kPrefillRows, small enough to stay in L2 (64 rows x K = 2048:
// 128 KiB), so each weight byte comes from DRAM once per call. Each block
// serves every batch row, in groups of kPrefillNB (a group's hi and lo parts,
// 16 KiB at K = 2048, stay in L1) through tiles of kPrefillR weight rows: the
// same TileVnni as decode, so every (row, batch row) gets the same
// instructions. 2 x 4 measured best of 2x1..4x3 on Zen 4 (larger tiles spill).
constexpr int64_t kPrefillRows = 64;
constexpr int kPrefillR = 2, kPrefillNB = 4;

template <int R>
VLM_TARGET_AVX512_VNNI void TileVnniAnyNB(const QuantizedX& x, int64_t b0, int64_t nb,
                                   const QuantizedWeight& w, int64_t r0, const Output& out) {
  static_assert(kPrefillNB == 4);
  switch (nb) {
    case 1: TileVnni<R, 1, true>(x, b0, w, r0, out); break;
    case 2: TileVnni<R, 2, true>(x, b0, w, r0, out); break;
    case 3: TileVnni<R, 3, true>(x, b0, w, r0, out); break;
    default: TileVnni<R, 4, true>(x, b0, w, r0, out); break;
  }
}

VLM_TARGET_AVX512_VNNI void PrefillRowsVnni(const QuantizedX& x, const QuantizedWeight& w,
                                     const Output& out, int64_t r0, int64_t r1) {
  for (int64_t b0 = 0; b0 < x.batch; b0 += kPrefillNB) {
    const int64_t nb = std::min<int64_t>(kPrefillNB, x.batch - b0);
    int64_t r = r0;
    for (; r + kPrefillR <= r1; r += kPrefillR) TileVnniAnyNB<kPrefillR>(x, b0, nb, w, r, out);
    for (; r < r1; ++r) TileVnniAnyNB<1>(x, b0, nb, w, r, out);
  }
  _mm256_zeroupper();
}

GemvInt8Path BestPath() {
  return GemvInt8PathSupported(GemvInt8Path::kAvx512Vnni) ? GemvInt8Path::kAvx512Vnni
                                                          : GemvInt8Path::kScalar;
}

}  // namespace

const char* GemvInt8PathName(GemvInt8Path path) {
  return path == GemvInt8Path::kAvx512Vnni ? "avx512vnni" : "scalar";
}

absl::StatusOr<GemvInt8Path> ParseGemvInt8Path(std::string_view name) {
  if (name == "auto") return BestPath();
  if (name == "avx512vnni") return GemvInt8Path::kAvx512Vnni;
  if (name == "scalar") return GemvInt8Path::kScalar;
  return absl::InvalidArgumentError(absl::StrCat("unknown int8 gemv path '", std::string(name),
                                                 "'; expected avx512vnni, scalar or auto"));
}

bool GemvInt8PathSupported(GemvInt8Path path, std::string* missing) {
  if (path == GemvInt8Path::kScalar) return true;
  const CpuFeatures& f = GetCpuFeatures();
  if (f.fast_bf16_matmul() && f.avx512vnni) return true;
  if (missing != nullptr) *missing = "AVX-512 VNNI (with F/BW/VL)";
  return false;
}

GemvInt8Path DefaultGemvInt8Path() {
  static const GemvInt8Path path = internal::PathFromEnvironment(
      "VLM_GEMV_INT8_PATH", BestPath(), ParseGemvInt8Path,
      [](GemvInt8Path p, std::string* missing) { return GemvInt8PathSupported(p, missing); });
  return path;
}

absl::Status GemvInt8(const at::Tensor& x, const QuantizedWeight& w, at::Tensor* y,
                      const GemvInt8Options& options) {
  try {
    if (w.empty()) return absl::InvalidArgumentError("int8 gemv: weight is empty");
    if (!x.defined() || x.device().type() != at::kCPU || x.dim() != 2 ||
        (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "int8 gemv: x must be a 2-D bf16 or f32 CPU tensor [B, K]; got ",
          x.defined() ? x.toString() + " " + std::to_string(x.dim()) + "-D" : std::string("undefined")));
    }
    if (x.size(1) != w.k()) {
      return absl::InvalidArgumentError(
          absl::StrCat("int8 gemv: x has K = ", x.size(1), " but the weight has K = ", w.k()));
    }
    if (y == nullptr) return absl::InvalidArgumentError("int8 gemv: output pointer is null");
    const int64_t batch = x.size(0), n = w.n();
    if (!y->defined()) *y = at::empty({batch, n}, at::kFloat);
    if (y->dim() != 2 || y->size(0) != batch || y->size(1) != n || !y->is_contiguous() ||
        (y->scalar_type() != at::kFloat && y->scalar_type() != at::kBFloat16)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "int8 gemv: y must be a contiguous f32 or bf16 [", batch, ", ", n, "] tensor"));
    }
    const GemvInt8Path path = options.path.value_or(DefaultGemvInt8Path());
    std::string missing;
    if (!GemvInt8PathSupported(path, &missing)) {
      return absl::FailedPreconditionError(
          absl::StrCat("int8 gemv path ", GemvInt8PathName(path), " needs ", missing));
    }
    if (batch == 0 || n == 0) return absl::OkStatus();
    // The caller's buffer: a thread_local named inside the lambda would be
    // each worker's own instance.
    thread_local QuantizedX x_scratch;
    QuantizedX& qx = x_scratch;
    const bool vnni = path == GemvInt8Path::kAvx512Vnni;
    if (x.size(1) > 1 && x.stride(1) != 1) {
      QuantizeX(x.contiguous(), w.k_padded(), vnni, options.threads, &qx);
    } else {
      QuantizeX(x, w.k_padded(), vnni, options.threads, &qx);
    }
    Output out{y->data_ptr(), y->scalar_type() == at::kBFloat16, n};
    // Blocks of rows_per_task rows (a multiple of 32: threads never share an
    // output cache line).
    const bool prefill = batch > kDecodeBatch;
    const int64_t rows_per_task = prefill ? kPrefillRows : kRowsPerTask;
    const int64_t tasks = (n + rows_per_task - 1) / rows_per_task;
    struct Work {
      const QuantizedX* x;
      const QuantizedWeight* w;
      const Output* out;
      bool vnni, prefill;
      int64_t rows_per_task;
    } work{&qx, &w, &out, vnni, prefill, rows_per_task};
    // One captured pointer: fits std::function's inline storage (no allocation per call).
    ParallelFor(tasks, options.threads, 1, [k = &work](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r0 = t * k->rows_per_task;
        const int64_t r1 = std::min(k->out->n, r0 + k->rows_per_task);
        if (!k->vnni) RowsScalar(*k->x, *k->w, *k->out, r0, r1);
        else if (k->prefill) PrefillRowsVnni(*k->x, *k->w, *k->out, r0, r1);
        else RowsVnni(*k->x, *k->w, *k->out, r0, r1);
      }
    });
    return absl::OkStatus();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("int8 gemv: out of memory");
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("int8 gemv: ", e.what_without_backtrace()));
  }
}

}  // namespace vlm::kernels
