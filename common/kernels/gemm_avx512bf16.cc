// avx512bf16 block kernel and the fused epilogue (shared with the AMX path).
//
// Micro-kernel: R (≤ 12) rows x 32 columns of f32 sums live in 2R zmm
// registers; per k-pair one broadcast of (x[r,2p], x[r,2p+1]) per row and two
// 64-byte panel loads feed 2R VDPBF16PS. Each sum runs over the pairs in
// order, whatever R is, which is what makes rows batch-invariant.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/kernels/gemm_internal.h"
#include "common/kernels/simd_math.h"
#include "common/kernels/simd.h"

#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace vlm::kernels::internal {
namespace {

VLM_TARGET_AVX512_BF16 inline __m512i BroadcastPair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// R rows x P panels (32·P columns): 2·R·P accumulators. Small R takes several
// panels at once so that enough independent sums are in flight to hide the
// VDPBF16PS latency; each sum still runs over the pairs in order.
// out: P tiles of [kMicroRows][32] floats, tile q at out + q·kMicroRows·32.
// accumulate: start from the sums already in out (a previous K block) instead
// of zero; continuing an f32 sum from its stored value is the same arithmetic,
// so blocking K changes no bit.
// With R <= kStreamRows (decode rows) the weights are the whole cost: each of
// the P panels is its own DRAM stream, and every pair also prefetches each
// panel kStreamAheadPairs pairs (2 KiB) ahead into L2 (T1), as GemvInt8 does.
// A prefetch changes no value. Decode of the 2B in bf16 on an Intel Xeon
// (AVX-512 BF16, 2 threads; old and new servers interleaved, three rounds of
// vlm-bench-language): 158.4 -> 145.3 ms per token (median), each round
// 8-11% faster; the hardware prefetchers alone lose ground at the 4 KiB page
// boundaries of six streams per thread.
constexpr int kStreamRows = 2;
constexpr int64_t kStreamAheadPairs = 16;
template <int R, int P>
VLM_TARGET_AVX512_BF16 inline void Micro(const uint16_t* x, int64_t ld_x, int64_t k, const uint16_t* panel,
                             int64_t panel_stride, float* out, bool accumulate) {
  __m512 acc[P][2][R];
#pragma GCC unroll 8
  for (int q = 0; q < P; ++q)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if (accumulate) {
        acc[q][0][r] = _mm512_load_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols);
        acc[q][1][r] = _mm512_load_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols + 16);
      } else {
        acc[q][0][r] = acc[q][1][r] = _mm512_setzero_ps();
      }
    }
  const int64_t pairs = k / 2;
  const uint16_t* b = panel;
  for (int64_t p = 0; p < pairs; ++p, b += 2 * kPanelCols) {
    if constexpr (R <= kStreamRows) {
#pragma GCC unroll 8
      for (int q = 0; q < P; ++q) {
        const char* ahead = reinterpret_cast<const char*>(b + q * panel_stride +
                                                          kStreamAheadPairs * 2 * kPanelCols);
        _mm_prefetch(ahead, _MM_HINT_T1);  // (prefetches never fault)
        _mm_prefetch(ahead + 64, _MM_HINT_T1);
      }
    }
    __m512bh bv[P][2];
#pragma GCC unroll 8
    for (int q = 0; q < P; ++q) {
      bv[q][0] = (__m512bh)_mm512_load_si512(b + q * panel_stride);
      bv[q][1] = (__m512bh)_mm512_load_si512(b + q * panel_stride + kPanelCols);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)BroadcastPair(x + r * ld_x + 2 * p);
#pragma GCC unroll 8
      for (int q = 0; q < P; ++q) {
        acc[q][0][r] = _mm512_dpbf16_ps(acc[q][0][r], a, bv[q][0]);
        acc[q][1][r] = _mm512_dpbf16_ps(acc[q][1][r], a, bv[q][1]);
      }
    }
  }
  if (k & 1) {  // last pair is (x[k-1], 0); the panel holds (w[n, k-1], 0)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(x[r * ld_x + k - 1]);
#pragma GCC unroll 8
      for (int q = 0; q < P; ++q) {
        acc[q][0][r] = _mm512_dpbf16_ps(acc[q][0][r], a,
                                        (__m512bh)_mm512_load_si512(b + q * panel_stride));
        acc[q][1][r] = _mm512_dpbf16_ps(
            acc[q][1][r], a, (__m512bh)_mm512_load_si512(b + q * panel_stride + kPanelCols));
      }
    }
  }
#pragma GCC unroll 8
  for (int q = 0; q < P; ++q) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols, acc[q][0][r]);
      _mm512_store_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols + 16, acc[q][1][r]);
    }
  }
}

// K elements per block (even, so pairs never straddle blocks): a panel's
// slice is kKBlock·64 bytes = 32 KiB, Zen 4's L1D; the row tiles after the
// first find it in L1 or L2. 512 measured no slower than 256 and halves the
// round trips of the sums through memory.
constexpr int64_t kKBlock = 512;
// With at most kFewTiles full tiles (M < 48) a panel slice serves too few
// tiles for the longer block to pay: K blocks of 256 measured 3-6% faster
// there on Zen 4 (2048->6144, M = 24..36), and no faster from 4 tiles on.
// (The K block never changes a sum: see Micro.)
constexpr int64_t kFewTiles = 3;
constexpr int64_t kFewTilesKBlock = 256;
// Row stride of the copied x slice, in elements: 1088 bytes = 17 cache lines,
// so the 12 rows of a tile start in 12 different L1 sets.
constexpr int64_t kXStride = kKBlock + 32;

// Micro<R, P> on a copied x slice (row stride kXStride, and an even length:
// an odd kc has a zero after its last element, matching the panel's zero
// padding, so the last pair is (x[k-1], 0) as in Micro). Same sums in the same
// order as Micro. kPrefetch: also pull the 128·pairs bytes at `prefetch` (the
// next panel slice) into L2, two lines per pair.
template <int R, int P, bool kPrefetch = false>
VLM_TARGET_AVX512_BF16 inline void MicroPacked(const uint16_t* x, int64_t k, const uint16_t* panel,
                                   int64_t panel_stride, float* out, bool accumulate,
                                   const uint16_t* prefetch = nullptr) {
  __m512 acc[P][2][R];
#pragma GCC unroll 8
  for (int q = 0; q < P; ++q)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if (accumulate) {
        acc[q][0][r] = _mm512_load_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols);
        acc[q][1][r] = _mm512_load_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols + 16);
      } else {
        acc[q][0][r] = acc[q][1][r] = _mm512_setzero_ps();
      }
    }
  const int64_t pairs = (k + 1) / 2;
  const uint16_t* b = panel;
  for (int64_t p = 0; p < pairs; ++p, b += 2 * kPanelCols) {
    if constexpr (kPrefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * 2 * kPanelCols), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * 2 * kPanelCols + kPanelCols),
                   _MM_HINT_T1);
    }
    __m512bh bv[P][2];
#pragma GCC unroll 8
    for (int q = 0; q < P; ++q) {
      bv[q][0] = (__m512bh)_mm512_load_si512(b + q * panel_stride);
      bv[q][1] = (__m512bh)_mm512_load_si512(b + q * panel_stride + kPanelCols);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)BroadcastPair(x + r * kXStride + 2 * p);
#pragma GCC unroll 8
      for (int q = 0; q < P; ++q) {
        acc[q][0][r] = _mm512_dpbf16_ps(acc[q][0][r], a, bv[q][0]);
        acc[q][1][r] = _mm512_dpbf16_ps(acc[q][1][r], a, bv[q][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int q = 0; q < P; ++q) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols, acc[q][0][r]);
      _mm512_store_ps(out + q * kMicroRows * kPanelCols + r * kPanelCols + 16, acc[q][1][r]);
    }
  }
}

// dst[0, n) = src[0, n) (bf16 elements); dst 64-byte aligned. 256 bytes of
// loads in flight before their stores; measured on Zen 4 about 2.5% less
// GEMM time than memcpy, which GCC expands here into rep movsq.
VLM_TARGET_AVX512_BF16 inline void CopyRow(uint16_t* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    const __m512i a = _mm512_loadu_si512(src + i), b = _mm512_loadu_si512(src + i + 32),
                  c = _mm512_loadu_si512(src + i + 64), d = _mm512_loadu_si512(src + i + 96);
    _mm512_store_si512(dst + i, a);
    _mm512_store_si512(dst + i + 32, b);
    _mm512_store_si512(dst + i + 64, c);
    _mm512_store_si512(dst + i + 96, d);
  }
  for (; i < n; i += 32) {
    const __mmask32 mask = n - i >= 32 ? ~__mmask32{0} : (__mmask32{1} << (n - i)) - 1;
    _mm512_mask_storeu_epi16(dst + i, mask, _mm512_maskz_loadu_epi16(mask, src + i));
  }
}

// Panels computed together for a tile of `rows` rows.
constexpr int PanelsFor(int rows) { return rows == 1 ? 6 : rows == 2 ? 3 : rows <= 5 ? 2 : 1; }
constexpr int kMaxPanels = 6;

// Micro<R, panels> for panels ≤ PanelsFor(R).
template <int R, int P = PanelsFor(R)>
VLM_TARGET_AVX512_BF16 void MicroRows(const uint16_t* x, int64_t ld_x, int64_t k, const uint16_t* panel,
                          int64_t panel_stride, int panels, float* out, bool accumulate) {
  if constexpr (P > 1) {
    if (panels < P) {
      return MicroRows<R, P - 1>(x, ld_x, k, panel, panel_stride, panels, out, accumulate);
    }
  }
  Micro<R, P>(x, ld_x, k, panel, panel_stride, out, accumulate);
}

// `panels` (≤ PanelsFor(rows)) consecutive panels for `rows` rows.
VLM_TARGET_AVX512_BF16 void MicroDispatch(const uint16_t* x, int64_t ld_x, int rows, int64_t k,
                              const uint16_t* panel, int64_t panel_stride, int panels,
                              float* acc, bool accumulate = false) {
  switch (rows) {
    case 1: return MicroRows<1>(x, ld_x, k, panel, panel_stride, panels, acc, accumulate);
    case 2: return MicroRows<2>(x, ld_x, k, panel, panel_stride, panels, acc, accumulate);
    case 3: return MicroRows<3>(x, ld_x, k, panel, panel_stride, panels, acc, accumulate);
    case 4: return MicroRows<4>(x, ld_x, k, panel, panel_stride, panels, acc, accumulate);
    case 5: return MicroRows<5>(x, ld_x, k, panel, panel_stride, panels, acc, accumulate);
    case 6: return MicroRows<6>(x, ld_x, k, panel, panel_stride, panels, acc, accumulate);
    case 7: return MicroRows<7>(x, ld_x, k, panel, panel_stride, panels, acc, accumulate);
    case 8: return MicroRows<8>(x, ld_x, k, panel, panel_stride, panels, acc, accumulate);
    case 9: return MicroRows<9>(x, ld_x, k, panel, panel_stride, panels, acc, accumulate);
    case 10: return MicroRows<10>(x, ld_x, k, panel, panel_stride, panels, acc, accumulate);
    case 11: return MicroRows<11>(x, ld_x, k, panel, panel_stride, panels, acc, accumulate);
    default: return MicroRows<12>(x, ld_x, k, panel, panel_stride, panels, acc, accumulate);
  }
}

// ---------------------------------------------------------------------------
// Epilogue math in f32.

// v·sigmoid(s·v'): 0.5·v·(1 + tanh(u)) = v / (1 + exp(-2u)), no cancellation.
VLM_TARGET_AVX512_BF16 inline __m512 GeluTanh(__m512 v) {
  const __m512 v3 = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
  const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                 _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), v3, v));
  const __m512 e = Exp(_mm512_mul_ps(u, _mm512_set1_ps(-2.0f)));
  return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// erf(z): rational approximation on [-4, 4] (odd degree-13 over even degree-8
// polynomial, |error| ~1e-7), ±1 beyond.
VLM_TARGET_AVX512_BF16 inline __m512 Erf(__m512 z) {
  z = _mm512_min_ps(_mm512_max_ps(z, _mm512_set1_ps(-4.0f)), _mm512_set1_ps(4.0f));
  const __m512 z2 = _mm512_mul_ps(z, z);
  __m512 p = _mm512_set1_ps(-2.72614225801306e-10f);
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(2.77068142495902e-08f));
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(-2.10102402082508e-06f));
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(-5.69250639462346e-05f));
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(-7.34990630326855e-04f));
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(-2.95459980854025e-03f));
  p = _mm512_fmadd_ps(p, z2, _mm512_set1_ps(-1.60960333262415e-02f));
  p = _mm512_mul_ps(p, z);
  __m512 q = _mm512_set1_ps(-1.45660718464996e-05f);
  q = _mm512_fmadd_ps(q, z2, _mm512_set1_ps(-2.13374055278905e-04f));
  q = _mm512_fmadd_ps(q, z2, _mm512_set1_ps(-1.68282697438203e-03f));
  q = _mm512_fmadd_ps(q, z2, _mm512_set1_ps(-7.37332916720468e-03f));
  q = _mm512_fmadd_ps(q, z2, _mm512_set1_ps(-1.42647390514189e-02f));
  return _mm512_div_ps(p, q);
}

VLM_TARGET_AVX512_BF16 inline __m512 GeluErf(__m512 v) {
  const __m512 e = Erf(_mm512_mul_ps(v, _mm512_set1_ps(0.7071067811865476f)));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), v),
                       _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

VLM_TARGET_AVX512_BF16 inline __m512 Silu(__m512 g) {
  const __m512 e = Exp(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// The lanes of `mask` at base[index..] as f32 (the rest zero), and the store
// back (bf16 through VCVTNEPS2BF16), for an epilogue operand of either type.
VLM_TARGET_AVX512_BF16 inline __m512 LoadMasked(const void* base, bool bf16, int64_t index,
                                                __mmask16 mask) {
  return bf16 ? simd::Load16(static_cast<const uint16_t*>(base) + index, mask)
              : simd::Load16(static_cast<const float*>(base) + index, mask);
}
VLM_TARGET_AVX512_BF16 inline void StoreMasked(void* base, bool bf16, int64_t index,
                                               __mmask16 mask, __m512 v) {
  if (bf16) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(base) + index, mask, simd::Bf16x16Native(v));
  } else {
    simd::Store16(static_cast<float*>(base) + index, v, mask);
  }
}

}  // namespace

VLM_TARGET_AVX512_BF16 void StoreTile(const Epilogue& e, int64_t m0, int rows, int64_t panel,
                          const float* acc) {
  const int64_t col0 = e.gate_up ? panel * 16 : panel * kPanelCols;
  const int vecs = e.gate_up ? 1 : 2;
  for (int r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    const float* a = acc + r * kPanelCols;
    for (int h = 0; h < vecs; ++h) {
      const int64_t c = col0 + 16 * h;
      const __mmask16 mask = simd::Mask16(e.n - c);
      if (mask == 0) break;
      __m512 v = _mm512_load_ps(a + 16 * h);
      if (e.gate_up) {
        v = _mm512_mul_ps(Silu(v), _mm512_load_ps(a + 16));
      } else {
        if (e.bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, e.bias + c));
        if (e.activation == Activation::kGeluTanh) v = GeluTanh(v);
        else if (e.activation == Activation::kGeluErf) v = GeluErf(v);
      }
      if (e.residual != nullptr) {
        v = _mm512_add_ps(v, LoadMasked(e.residual, e.residual_bf16, m * e.ld_residual + c, mask));
      }
      StoreMasked(e.y, e.y_bf16, m * e.ld_y + c, mask, v);
    }
  }
}

VLM_TARGET_AVX512_BF16 void MicroTileAvx512Bf16(const uint16_t* x, int64_t ld_x, int rows, int64_t k,
                                    const uint16_t* panel, float* acc) {
  MicroDispatch(x, ld_x, rows, k, panel, 0, 1, acc, false);
  _mm256_zeroupper();
}

VLM_TARGET_AVX512_BF16 void Avx512Bf16Block(const Problem& p, int64_t m0, int64_t m1, int64_t j0,
                                int64_t j1) {
  const int64_t stride = p.w.kpairs * 2 * kPanelCols;
  const int64_t k = p.w.k;
  const int64_t panels = j1 - j0;
  const int64_t full_tiles = (m1 - m0) / kMicroRows;
  const int tail_rows = static_cast<int>((m1 - m0) % kMicroRows);
  constexpr int64_t kTile = kMicroRows * kPanelCols;  // floats per [12][32] tile

  // Per thread: x rows copied at a row stride that puts the rows of a tile in
  // different L1 sets (rows of the 2B's K = 2048 or 4096 are 4 or 8 KiB
  // apart, so read in place all 12 fall in one 8-way set and evict each other
  // on every pair); and the f32 sums of every (tile, panel) between K blocks.
  thread_local std::vector<uint16_t> x_buf;
  thread_local std::vector<float> sums_buf;
  // Short-chunk rows: one cache line longer than K rounded up, so row r
  // starts r sets further on.
  const int64_t ld_tail = (k + 31) / 32 * 32 + 32;
  x_buf.resize(static_cast<size_t>(
      std::max((m1 - m0) * kXStride, tail_rows * ld_tail) + 32));
  uint16_t* xs = reinterpret_cast<uint16_t*>(
      (reinterpret_cast<uintptr_t>(x_buf.data()) + 63) & ~uintptr_t{63});

  // With full tiles: K in blocks of kKBlock (kFewTilesKBlock for few tiles).
  // Per block all rows' x slices are copied once, then each panel slice is
  // read from L1 by every tile after the first, and the first tile prefetches
  // the next slice; the partial tile follows while the block's slices are
  // still in L2.
  if (full_tiles > 0) {
    const int64_t tiles = full_tiles + (tail_rows > 0 ? 1 : 0);
    sums_buf.resize(static_cast<size_t>((tiles * panels + kMaxPanels) * kTile + 16));
    float* sums = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(sums_buf.data()) + 63) & ~uintptr_t{63});
    // Sums of (full tile t, panel j) at ((j - j0)·full_tiles + t)·kTile, in
    // the order the tiles run; the partial tile's after them, its panels
    // kTile apart as MicroDispatch writes them.
    auto sums_at = [&](int64_t t, int64_t j) {
      return t < full_tiles ? sums + ((j - j0) * full_tiles + t) * kTile
                            : sums + (full_tiles * panels + (j - j0)) * kTile;
    };
    const int group = tail_rows > 0 ? PanelsFor(tail_rows) : 1;
    const int64_t kb = full_tiles <= kFewTiles ? kFewTilesKBlock : kKBlock;
    for (int64_t k0 = 0; k0 < k; k0 += kb) {
      const int64_t kc = k - k0 < kb ? k - k0 : kb;
      const bool accumulate = k0 > 0;
      for (int64_t r = 0; r < m1 - m0; ++r) {
        uint16_t* dst = xs + r * kXStride;
        CopyRow(dst, p.x + (m0 + r) * p.ld_x + k0, kc);
        if (kc & 1) dst[kc] = 0;  // the last pair is (x[k-1], 0)
      }
      for (int64_t j = j0; j < j1; ++j) {
        const uint16_t* w = p.w.panel(j) + k0 * kPanelCols;
        const uint16_t* next =
            j + 1 < j1 ? w + stride : p.w.panel(j0) + (k0 + kb) * kPanelCols;
        const bool prefetch = j + 1 < j1 || k0 + kb < k;  // (prefetches never fault)
        for (int64_t t = 0; t < full_tiles; ++t) {
          const uint16_t* xt = xs + t * kMicroRows * kXStride;
          if (t == 0 && prefetch) {
            MicroPacked<kMicroRows, 1, true>(xt, kc, w, stride, sums_at(t, j), accumulate, next);
          } else {
            MicroPacked<kMicroRows, 1>(xt, kc, w, stride, sums_at(t, j), accumulate);
          }
        }
      }
      if (tail_rows > 0) {
        for (int64_t j = j0; j < j1; j += group) {
          const int n = static_cast<int>(j1 - j < group ? j1 - j : group);
          // MicroDispatch writes n tiles kTile apart: one tile's consecutive panels.
          MicroDispatch(xs + full_tiles * kMicroRows * kXStride, kXStride, tail_rows, kc,
                        p.w.panel(j) + k0 * kPanelCols, stride, n, sums_at(full_tiles, j),
                        accumulate);
        }
      }
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const int rows = t < full_tiles ? kMicroRows : tail_rows;
      for (int64_t j = j0; j < j1; ++j) {
        StoreTile(p.epilogue, m0 + t * kMicroRows, rows, j, sums_at(t, j));
      }
    }
  } else {
    // Fewer than 12 rows (a short prefill chunk): PanelsFor(rows) panels at a
    // time over the whole K, sums in registers. The weights' bandwidth is the
    // limit here, and walking each panel front to back keeps the hardware
    // prefetcher on a few long streams (K blocks measured 1.5-3x slower).
    for (int r = 0; r < tail_rows; ++r) {
      std::memcpy(xs + r * ld_tail, p.x + (m0 + r) * p.ld_x, k * sizeof(uint16_t));
    }
    const int group = PanelsFor(tail_rows);
    alignas(64) float acc[kMaxPanels * kTile];
    for (int64_t j = j0; j < j1; j += group) {
      const int n = static_cast<int>(j1 - j < group ? j1 - j : group);
      MicroDispatch(xs, ld_tail, tail_rows, k, p.w.panel(j), stride, n, acc);
      for (int q = 0; q < n; ++q) StoreTile(p.epilogue, m0, tail_rows, j + q, acc + q * kTile);
    }
  }
  // Callers run SSE code next: leave the upper vector state clean.
  _mm256_zeroupper();
}

}  // namespace vlm::kernels::internal
