// avx2 block kernel and its fused epilogue: the blocked GEMM on CPUs with
// AVX2 + FMA but no AVX-512 (most laptops, many cloud VMs), over the same
// packed panels as avx512bf16 and amx, so weights stay bf16 in memory.
//
// A panel dword holds the bf16 pair (w[n, 2p], w[n, 2p+1]); shifting it left
// by 16 gives w[n, 2p] as f32 and masking the low half gives w[n, 2p+1], so
// widening costs two integer ops per 8 columns and pair. x is widened to f32
// once per K block into a per-thread buffer (its values are bf16, so exactly).
//
// Micro-kernel: R (3 or 4) rows x 16 columns (half a panel) of f32 sums in 2R
// ymm registers; per k-pair two 32-byte panel loads, four widenings, two
// broadcasts of x per row and 4R FMAs. One or two rows take the whole panel
// width at once (MicroFull). Every output element's sum is
// acc = fma(w[2p], x[2p], acc); acc = fma(w[2p+1], x[2p+1], acc) over the
// pairs in order, whatever R, the K blocking, the row's position or the
// thread split, so rows are batch-invariant as on the other blocked paths
// (the order differs from VDPBF16PS, so avx2 and avx512bf16 results are not
// bit-identical to each other).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/kernels/gemm_internal.h"
#include "common/kernels/simd_math.h"
#include "common/kernels/simd.h"

namespace vlm::kernels::internal {
namespace {

constexpr int kRows = 4;  // rows per register tile

// acc[r][16 cols] (row stride 32 floats in `out`) += x[r, pairs) · half-panel.
// x: widened f32 rows (row stride ldx), even length; panel: the first pair's
// 32 dwords, offset to the half's first column.
template <int R>
VLM_TARGET_AVX2 inline void Micro(const float* x, int64_t ldx, int64_t pairs, const uint16_t* panel,
                             float* out, bool accumulate) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    if (accumulate) {
      acc[r][0] = _mm256_loadu_ps(out + r * kPanelCols);
      acc[r][1] = _mm256_loadu_ps(out + r * kPanelCols + 8);
    } else {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
  }
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const uint16_t* b = panel;
  for (int64_t p = 0; p < pairs; ++p, b += 2 * kPanelCols) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __m256 we0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
    const __m256 wo0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high));
    const __m256 we1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
    const __m256 wo1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xe = _mm256_broadcast_ss(x + r * ldx + 2 * p);
      const __m256 xo = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
      acc[r][0] = _mm256_fmadd_ps(we0, xe, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(we1, xe, acc[r][1]);
      acc[r][0] = _mm256_fmadd_ps(wo0, xo, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(wo1, xo, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kPanelCols, acc[r][0]);
    _mm256_storeu_ps(out + r * kPanelCols + 8, acc[r][1]);
  }
}

// acc[r][32 cols] += x[r, pairs) · panel for R ≤ 2 rows in one pass over the
// panel: 4R independent sums (the FMA latency, not the two chains of a half
// panel, bounds one row) and each panel line read once, as decode's few rows
// need. The same FMA sequence per output element as Micro.
template <int R>
VLM_TARGET_AVX2 inline void MicroFull(const float* x, int64_t ldx, int64_t pairs, const uint16_t* panel,
                                 float* out, bool accumulate) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c)
      acc[r][c] = accumulate ? _mm256_loadu_ps(out + r * kPanelCols + 8 * c) : _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const uint16_t* b = panel;
  for (int64_t p = 0; p < pairs; ++p, b += 2 * kPanelCols) {
    __m256 xe[R], xo[R];
    for (int r = 0; r < R; ++r) {
      xe[r] = _mm256_broadcast_ss(x + r * ldx + 2 * p);
      xo[r] = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 * c));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      for (int r = 0; r < R; ++r) {
        acc[r][c] = _mm256_fmadd_ps(we, xe[r], acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(wo, xo[r], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + r * kPanelCols + 8 * c, acc[r][c]);
}

// One panel for `rows` (≤ kRows) rows.
VLM_TARGET_AVX2 void MicroPanel(const float* x, int64_t ldx, int rows, int64_t pairs,
                           const uint16_t* panel, float* out, bool accumulate) {
  if (rows == 1) return MicroFull<1>(x, ldx, pairs, panel, out, accumulate);
  if (rows == 2) return MicroFull<2>(x, ldx, pairs, panel, out, accumulate);
  for (int h = 0; h < 2; ++h) {
    const uint16_t* half = panel + h * kPanelCols;  // 16 dwords = 32 uint16 further
    float* o = out + h * 16;
    switch (rows) {
      case 1: Micro<1>(x, ldx, pairs, half, o, accumulate); break;
      case 2: Micro<2>(x, ldx, pairs, half, o, accumulate); break;
      case 3: Micro<3>(x, ldx, pairs, half, o, accumulate); break;
      default: Micro<4>(x, ldx, pairs, half, o, accumulate); break;
    }
  }
}

// bf16 bits -> f32 rows: dst[r][0, kc) = x[r][k0, k0 + kc), zero-padded to
// an even length (the panel's padding pairs are zero too).
VLM_TARGET_AVX2 void WidenRows(const uint16_t* x, int64_t ld_x, int64_t rows, int64_t k0, int64_t kc,
                          float* dst, int64_t ld_dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* src = x + r * ld_x + k0;
    float* d = dst + r * ld_dst;
    int64_t i = 0;
    for (; i + 8 <= kc; i += 8) _mm256_storeu_ps(d + i, simd::Load8(src + i));
    for (; i < kc; ++i) d[i] = simd::Bf16ToF32(src[i]);
    if (kc & 1) d[kc] = 0.0f;
  }
}

// ---------------------------------------------------------------------------
// Epilogue math in f32, 8 lanes (same formulas as the avx512bf16 epilogue).

VLM_TARGET_AVX2 inline __m256 GeluTanh(__m256 v) {
  const __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
  const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                 _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), v3, v));
  const __m256 e = Exp8(_mm256_mul_ps(u, _mm256_set1_ps(-2.0f)));
  return _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

VLM_TARGET_AVX2 inline __m256 Erf(__m256 z) {
  z = _mm256_min_ps(_mm256_max_ps(z, _mm256_set1_ps(-4.0f)), _mm256_set1_ps(4.0f));
  const __m256 z2 = _mm256_mul_ps(z, z);
  __m256 p = _mm256_set1_ps(-2.72614225801306e-10f);
  p = _mm256_fmadd_ps(p, z2, _mm256_set1_ps(2.77068142495902e-08f));
  p = _mm256_fmadd_ps(p, z2, _mm256_set1_ps(-2.10102402082508e-06f));
  p = _mm256_fmadd_ps(p, z2, _mm256_set1_ps(-5.69250639462346e-05f));
  p = _mm256_fmadd_ps(p, z2, _mm256_set1_ps(-7.34990630326855e-04f));
  p = _mm256_fmadd_ps(p, z2, _mm256_set1_ps(-2.95459980854025e-03f));
  p = _mm256_fmadd_ps(p, z2, _mm256_set1_ps(-1.60960333262415e-02f));
  p = _mm256_mul_ps(p, z);
  __m256 q = _mm256_set1_ps(-1.45660718464996e-05f);
  q = _mm256_fmadd_ps(q, z2, _mm256_set1_ps(-2.13374055278905e-04f));
  q = _mm256_fmadd_ps(q, z2, _mm256_set1_ps(-1.68282697438203e-03f));
  q = _mm256_fmadd_ps(q, z2, _mm256_set1_ps(-7.37332916720468e-03f));
  q = _mm256_fmadd_ps(q, z2, _mm256_set1_ps(-1.42647390514189e-02f));
  return _mm256_div_ps(p, q);
}

VLM_TARGET_AVX2 inline __m256 GeluErf(__m256 v) {
  const __m256 e = Erf(_mm256_mul_ps(v, _mm256_set1_ps(0.7071067811865476f)));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), v),
                       _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

VLM_TARGET_AVX2 inline __m256 Silu(__m256 g) {
  const __m256 e = Exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// `valid` (1..8) elements at base[index..] as f32 (the rest zero), and the
// store back, for an epilogue operand of either type.
VLM_TARGET_AVX2 inline __m256 Load8(const void* base, bool bf16, int64_t index, int valid) {
  return bf16 ? simd::Load8(static_cast<const uint16_t*>(base) + index, valid)
              : simd::Load8(static_cast<const float*>(base) + index, valid);
}
VLM_TARGET_AVX2 inline void Store8(void* base, bool bf16, int64_t index, int valid, __m256 v) {
  if (bf16) return simd::Store8(static_cast<uint16_t*>(base) + index, v, valid);
  simd::Store8(static_cast<float*>(base) + index, v, valid);
}

// acc [rows][32] (row stride 32 floats): the f32 sums of panel `panel` for
// output rows m0.., stored through the epilogue.
VLM_TARGET_AVX2 void StoreTileAvx2(const Epilogue& e, int64_t m0, int rows, int64_t panel,
                              const float* acc) {
  const int64_t col0 = e.gate_up ? panel * 16 : panel * kPanelCols;
  const int vecs = e.gate_up ? 2 : 4;
  for (int r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    const float* a = acc + r * kPanelCols;
    for (int h = 0; h < vecs; ++h) {
      const int64_t c = col0 + 8 * h;
      const int64_t left = e.n - c;
      if (left <= 0) break;
      const int valid = left >= 8 ? 8 : static_cast<int>(left);
      __m256 v = _mm256_loadu_ps(a + 8 * h);
      if (e.gate_up) {
        v = _mm256_mul_ps(Silu(v), _mm256_loadu_ps(a + 16 + 8 * h));
      } else {
        if (e.bias != nullptr) v = _mm256_add_ps(v, Load8(e.bias, false, c, valid));
        if (e.activation == Activation::kGeluTanh) v = GeluTanh(v);
        else if (e.activation == Activation::kGeluErf) v = GeluErf(v);
      }
      if (e.residual != nullptr) {
        v = _mm256_add_ps(v, Load8(e.residual, e.residual_bf16, m * e.ld_residual + c, valid));
      }
      Store8(e.y, e.y_bf16, m * e.ld_y + c, valid, v);
    }
  }
}

// K elements per block with several row tiles: a panel slice is 256·64 =
// 16 KiB and stays in L1 while every row tile of the task passes over it.
constexpr int64_t kKBlock = 256;

}  // namespace

VLM_TARGET_AVX2 void MicroTileAvx2(const uint16_t* x, int64_t ld_x, int rows, int64_t k,
                              const uint16_t* panel, float* acc) {
  thread_local std::vector<float> xf;
  const int64_t ldx = (k + 1) / 2 * 2;
  xf.resize(static_cast<size_t>(std::max<int64_t>(1, rows * ldx)));
  WidenRows(x, ld_x, rows, 0, k, xf.data(), ldx);
  for (int r0 = 0; r0 < rows; r0 += kRows) {
    const int n = std::min(kRows, rows - r0);
    MicroPanel(xf.data() + r0 * ldx, ldx, n, ldx / 2, panel, acc + r0 * kPanelCols, false);
  }
  _mm256_zeroupper();
}

VLM_TARGET_AVX2 void Avx2Block(const Problem& p, int64_t m0, int64_t m1, int64_t j0, int64_t j1) {
  const int64_t rows = m1 - m0;
  const int64_t k = p.w.k;
  const int64_t panels = j1 - j0;
  // One row tile (decode, short chunks): the whole K at once, so each panel
  // is walked front to back (few long streams for the hardware prefetcher).
  // Otherwise K blocks that keep a panel slice in L1 across the row tiles.
  const int64_t kb = rows <= kRows ? (k + 1) / 2 * 2 : kKBlock;
  const int64_t ldx = kb + 8;  // floats; keeps rows off each other's cache sets
  thread_local std::vector<float> x_buf, sums_buf;
  x_buf.resize(static_cast<size_t>(rows * ldx + 8));
  sums_buf.resize(static_cast<size_t>(panels * rows * kPanelCols + 8));
  float* xf = x_buf.data();
  float* sums = sums_buf.data();
  // Sums of (panel j, row r) at ((j - j0)·rows + r)·32: a tile's rows of one
  // panel are consecutive [rows][32] blocks, as StoreTileAvx2 reads them.
  for (int64_t k0 = 0; k0 < k; k0 += kb) {
    const int64_t kc = std::min(kb, k - k0);
    const int64_t pairs = (kc + 1) / 2;
    WidenRows(p.x + m0 * p.ld_x, p.ld_x, rows, k0, kc, xf, ldx);
    for (int64_t j = j0; j < j1; ++j) {
      const uint16_t* w = p.w.panel(j) + k0 * kPanelCols;
      float* s = sums + (j - j0) * rows * kPanelCols;
      for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
        const int n = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
        MicroPanel(xf + r0 * ldx, ldx, n, pairs, w, s + r0 * kPanelCols, k0 > 0);
      }
    }
  }
  for (int64_t j = j0; j < j1; ++j) {
    StoreTileAvx2(p.epilogue, m0, static_cast<int>(rows), j,
                  sums + (j - j0) * rows * kPanelCols);
  }
  _mm256_zeroupper();
}

}  // namespace vlm::kernels::internal
