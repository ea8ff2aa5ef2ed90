#include "common/kernels/gemm_f32.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cpu_features.h"
#include "common/kernels/thread_pool.h"
#include "common/kernels/path_override.h"
#include "common/kernels/simd.h"

namespace vlm::kernels {
namespace {

// The lanes of the summation order (gemm_f32.h).
constexpr int64_t kLanes = 16;

// Cache blocking (results never depend on it): a task is one block of rows
// times one chunk of output columns, each about kBlockBytes of x rows and of
// w rows, so both stay in L2 while the task's register tiles walk them (the x
// rows of a tile from L1 across the chunk's columns, the chunk's w rows from
// L2 across the block's row tiles). Tasks are numbered row block first: a
// thread's contiguous share keeps its x block while the w chunks stream past.
constexpr int64_t kBlockBytes = 256 * 1024;

struct Problem {
  const float* x;
  int64_t ld_x;
  const float* w;
  int64_t ld_w;
  float* y;
  int64_t ld_y;
  int64_t m, n, k;
};

// Register tile: y[m0 .. m0+R, n0 .. n0+C].
using TileFn = void (*)(const Problem& p, int64_t m0, int64_t n0);

// ---------------------------------------------------------------------------
// Portable path: the 16 lanes as an array, one output at a time.

void TileScalar(const Problem& p, int64_t m0, int64_t n0) {
  const float* x = p.x + m0 * p.ld_x;
  const float* w = p.w + n0 * p.ld_w;
  float a[kLanes] = {};
  for (int64_t k = 0; k < p.k; k += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      // Lanes past K take fma(0, 0, a), as the vector paths' masked loads do.
      const bool in = k + j < p.k;
      a[j] = std::fma(in ? x[k + j] : 0.0f, in ? w[k + j] : 0.0f, a[j]);
    }
  }
  float b[8], c[4];
  for (int j = 0; j < 8; ++j) b[j] = a[j] + a[j + 8];
  for (int j = 0; j < 4; ++j) c[j] = b[j] + b[j + 4];
  const float d0 = c[0] + c[2], d1 = c[1] + c[3];
  p.y[m0 * p.ld_y + n0] = d0 + d1;
}

// ---------------------------------------------------------------------------
// AVX-512F path: one zmm per output holds its 16 lanes.

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

constexpr int kAvx512Rows = 4, kAvx512Cols = 4;

// b_j = a_j + a_{j+8}, then the 8-lane tree (shared with AVX2).
VLM_TARGET_AVX2 inline float Reduce8(__m256 b) {
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));                   // d0 = c0+c2, d1 = c1+c3
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));          // d0 + d1
}

VLM_TARGET_AVX512 inline float Reduce16(__m512 a) {
  const __m256 lo = _mm512_castps512_ps256(a);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  const __m256 b = _mm256_add_ps(lo, hi);
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}

template <int R, int C>
VLM_TARGET_AVX512 void TileAvx512(const Problem& p, int64_t m0, int64_t n0) {
  const float* x = p.x + m0 * p.ld_x;
  const float* w = p.w + n0 * p.ld_w;
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  int64_t k = 0;
  for (; k + kLanes <= p.k; k += kLanes) {
    __m512 xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * p.ld_x + k);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 wv = _mm512_loadu_ps(w + c * p.ld_w + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  if (k < p.k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (p.k - k)) - 1u);
    __m512 xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_ps(mask, x + r * p.ld_x + k);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w + c * p.ld_w + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) p.y[(m0 + r) * p.ld_y + n0 + c] = Reduce16(acc[r][c]);
  }
}

// ---------------------------------------------------------------------------
// AVX2 + FMA path: lanes 0-7 and 8-15 of an output in two ymm.

constexpr int kAvx2Rows = 2, kAvx2Cols = 2;

template <int R, int C>
VLM_TARGET_AVX2 void TileAvx2(const Problem& p, int64_t m0, int64_t n0) {
  const float* x = p.x + m0 * p.ld_x;
  const float* w = p.w + n0 * p.ld_w;
  __m256 lo[R][C], hi[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) lo[r][c] = hi[r][c] = _mm256_setzero_ps();
  }
  int64_t k = 0;
  for (; k + kLanes <= p.k; k += kLanes) {
    __m256 xl[R], xh[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      xl[r] = _mm256_loadu_ps(x + r * p.ld_x + k);
      xh[r] = _mm256_loadu_ps(x + r * p.ld_x + k + 8);
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 wl = _mm256_loadu_ps(w + c * p.ld_w + k);
      const __m256 wh = _mm256_loadu_ps(w + c * p.ld_w + k + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        lo[r][c] = _mm256_fmadd_ps(xl[r], wl, lo[r][c]);
        hi[r][c] = _mm256_fmadd_ps(xh[r], wh, hi[r][c]);
      }
    }
  }
  if (k < p.k) {
    // Lanes past K load as 0 (maskload never touches them).
    const __m256i left = _mm256_set1_epi32(static_cast<int>(p.k - k));
    const __m256i ml = _mm256_cmpgt_epi32(left, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i mh = _mm256_cmpgt_epi32(left, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15));
    __m256 xl[R], xh[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      xl[r] = _mm256_maskload_ps(x + r * p.ld_x + k, ml);
      xh[r] = _mm256_maskload_ps(x + r * p.ld_x + k + 8, mh);
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 wl = _mm256_maskload_ps(w + c * p.ld_w + k, ml);
      const __m256 wh = _mm256_maskload_ps(w + c * p.ld_w + k + 8, mh);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        lo[r][c] = _mm256_fmadd_ps(xl[r], wl, lo[r][c]);
        hi[r][c] = _mm256_fmadd_ps(xh[r], wh, hi[r][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      p.y[(m0 + r) * p.ld_y + n0 + c] = Reduce8(_mm256_add_ps(lo[r][c], hi[r][c]));
    }
  }
}
#pragma GCC diagnostic pop

// ---------------------------------------------------------------------------
// Tiles of every size up to a path's register block, and the loops over them.

constexpr int kMaxRows = std::max(kAvx512Rows, kAvx2Rows);
constexpr int kMaxCols = std::max(kAvx512Cols, kAvx2Cols);

struct Kernel {
  int rows = 1, cols = 1;
  // tiles[r - 1][c - 1]: an r x c tile.
  TileFn tiles[kMaxRows][kMaxCols] = {};
};

// Every tile up to R x MaxC of a path.
template <int R, int C, int MaxC, template <int, int> class Tile>
void Fill(Kernel* k) {
  k->tiles[R - 1][C - 1] = &Tile<R, C>::Run;
  if constexpr (C > 1) {
    Fill<R, C - 1, MaxC, Tile>(k);
  } else if constexpr (R > 1) {
    Fill<R - 1, MaxC, MaxC, Tile>(k);
  }
}

template <int R, int C>
struct Avx512Tile {
  static void Run(const Problem& p, int64_t m0, int64_t n0) { TileAvx512<R, C>(p, m0, n0); }
};
template <int R, int C>
struct Avx2Tile {
  static void Run(const Problem& p, int64_t m0, int64_t n0) { TileAvx2<R, C>(p, m0, n0); }
};

const Kernel& KernelFor(GemmF32Path path) {
  static const Kernel avx512 = [] {
    Kernel k;
    k.rows = kAvx512Rows;
    k.cols = kAvx512Cols;
    Fill<kAvx512Rows, kAvx512Cols, kAvx512Cols, Avx512Tile>(&k);
    return k;
  }();
  static const Kernel avx2 = [] {
    Kernel k;
    k.rows = kAvx2Rows;
    k.cols = kAvx2Cols;
    Fill<kAvx2Rows, kAvx2Cols, kAvx2Cols, Avx2Tile>(&k);
    return k;
  }();
  static const Kernel scalar = [] {
    Kernel k;
    k.tiles[0][0] = &TileScalar;
    return k;
  }();
  switch (path) {
    case GemmF32Path::kAvx512: return avx512;
    case GemmF32Path::kAvx2: return avx2;
    case GemmF32Path::kScalar: break;
  }
  return scalar;
}

// Rows [m0, m1) x columns [n0, n1) in register tiles, row tiles outer.
void Block(const Kernel& kernel, const Problem& p, int64_t m0, int64_t m1, int64_t n0,
           int64_t n1) {
  for (int64_t r = m0; r < m1; r += kernel.rows) {
    const int64_t rows = std::min<int64_t>(kernel.rows, m1 - r);
    for (int64_t c = n0; c < n1; c += kernel.cols) {
      const int64_t cols = std::min<int64_t>(kernel.cols, n1 - c);
      kernel.tiles[rows - 1][cols - 1](p, r, c);
    }
  }
}

GemmF32Path BestPath() {
  if (GemmF32PathSupported(GemmF32Path::kAvx512)) return GemmF32Path::kAvx512;
  if (GemmF32PathSupported(GemmF32Path::kAvx2)) return GemmF32Path::kAvx2;
  return GemmF32Path::kScalar;
}

}  // namespace

const char* GemmF32PathName(GemmF32Path path) {
  switch (path) {
    case GemmF32Path::kAvx512: return "avx512";
    case GemmF32Path::kAvx2: return "avx2";
    case GemmF32Path::kScalar: return "scalar";
  }
  return "?";
}

absl::StatusOr<GemmF32Path> ParseGemmF32Path(std::string_view name) {
  if (name == "auto") return BestPath();
  for (GemmF32Path p : {GemmF32Path::kAvx512, GemmF32Path::kAvx2, GemmF32Path::kScalar}) {
    if (name == GemmF32PathName(p)) return p;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown f32 gemm path '", std::string(name),
                                                 "'; expected avx512, avx2, scalar or auto"));
}

bool GemmF32PathSupported(GemmF32Path path, std::string* missing) {
  const CpuFeatures& f = GetCpuFeatures();
  switch (path) {
    case GemmF32Path::kScalar: return true;
    case GemmF32Path::kAvx512:
      if (f.fast_bf16_matmul()) return true;
      if (missing != nullptr) *missing = "AVX-512 F/BW/VL/DQ";
      return false;
    case GemmF32Path::kAvx2:
      if (f.avx2_fma()) return true;
      if (missing != nullptr) *missing = "AVX2 + FMA";
      return false;
  }
  return false;
}

GemmF32Path DefaultGemmF32Path() {
  static const GemmF32Path path = internal::PathFromEnvironment(
      "VLM_GEMM_F32_PATH", BestPath(), ParseGemmF32Path,
      [](GemmF32Path p, std::string* missing) { return GemmF32PathSupported(p, missing); });
  return path;
}

void GemmF32Raw(const float* x, int64_t ld_x, const float* w, int64_t ld_w, float* y,
                int64_t ld_y, int64_t m, int64_t n, int64_t k, GemmF32Path path, int threads) {
  if (m <= 0 || n <= 0) return;
  const Problem p{x, ld_x, w, ld_w, y, ld_y, m, n, k};
  const Kernel& kernel = KernelFor(path);
  if (threads <= 0) threads = DefaultThreads();
  const int64_t row_bytes = std::max<int64_t>(1, k) * static_cast<int64_t>(sizeof(float));
  // Rows per block and columns per chunk: multiples of the register tile.
  auto round_to = [](int64_t v, int64_t unit) { return std::max(unit, v / unit * unit); };
  const int64_t block_rows = std::min(round_to(kBlockBytes / row_bytes, kernel.rows), m);
  const int64_t row_blocks = (m + block_rows - 1) / block_rows;
  int64_t chunk = round_to(kBlockBytes / row_bytes, kernel.cols);
  // Enough tasks for every thread (a few each, so a descheduled thread's share
  // is picked up), unless the product is too small to be worth a split.
  const bool split = threads > 1 && m * n * k >= (int64_t{1} << 20);
  while (split && chunk > kernel.cols && row_blocks * ((n + chunk - 1) / chunk) < 4 * threads) {
    chunk = round_to(chunk / 2, kernel.cols);
  }
  chunk = std::min(chunk, n);
  const int64_t chunks = (n + chunk - 1) / chunk;
  auto run = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / chunks, c = t % chunks;
      Block(kernel, p, b * block_rows, std::min(m, (b + 1) * block_rows), c * chunk,
            std::min(n, (c + 1) * chunk));
    }
  };
  if (!split || row_blocks * chunks == 1) {
    run(0, row_blocks * chunks);
    return;
  }
  ParallelFor(row_blocks * chunks, threads, 1, run);
}

absl::Status GemmF32(const at::Tensor& x, const at::Tensor& w, at::Tensor* y,
                     const GemmF32Options& options) {
  try {
    auto describe = [](const at::Tensor& t) {
      return t.defined() ? absl::StrCat(t.toString(), " [", absl::StrJoin(t.sizes(), ", "), "]")
                         : std::string("undefined");
    };
    for (const at::Tensor* t : {&x, &w}) {
      if (!t->defined() || t->device().type() != at::kCPU || t->dim() != 2 ||
          t->scalar_type() != at::kFloat) {
        return absl::InvalidArgumentError(
            absl::StrCat("f32 gemm: ", t == &x ? "x" : "w", " must be a 2-D float32 CPU tensor (",
                         t == &x ? "[M, K]" : "[N, K]", "); got ", describe(*t)));
      }
    }
    if (x.size(1) != w.size(1)) {
      return absl::InvalidArgumentError(absl::StrCat("f32 gemm: x has K = ", x.size(1),
                                                     " but w has K = ", w.size(1)));
    }
    if (y == nullptr) return absl::InvalidArgumentError("f32 gemm: output pointer is null");
    const GemmF32Path path = options.path.value_or(DefaultGemmF32Path());
    std::string missing;
    if (!GemmF32PathSupported(path, &missing)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "f32 gemm: path ", GemmF32PathName(path), " needs ", missing, ", which this CPU lacks"));
    }
    const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
    if (!y->defined()) *y = at::empty({m, n}, x.options());
    if (y->device().type() != at::kCPU || y->dim() != 2 || y->size(0) != m || y->size(1) != n ||
        y->scalar_type() != at::kFloat || (n > 1 && y->stride(1) != 1)) {
      return absl::InvalidArgumentError(absl::StrCat("f32 gemm: y must be a float32 [", m, ", ", n,
                                                     "] tensor with unit column stride; got ",
                                                     describe(*y)));
    }
    // Rows with unit stride along K (the order does not depend on the copy).
    auto rows = [k](const at::Tensor& t) {
      return (k > 1 && t.stride(1) != 1) || (t.size(0) > 1 && t.stride(0) < k) ? t.contiguous() : t;
    };
    const at::Tensor xc = rows(x), wc = rows(w);
    GemmF32Raw(xc.data_ptr<float>(), m > 1 ? xc.stride(0) : k, wc.data_ptr<float>(),
               n > 1 ? wc.stride(0) : k, y->data_ptr<float>(), m > 1 ? y->stride(0) : n, m, n, k,
               path, options.threads);
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("f32 gemm: ", e.what_without_backtrace()));
  }
}

absl::StatusOr<at::Tensor> GemmF32(const at::Tensor& x, const at::Tensor& w,
                                   const GemmF32Options& options) {
  at::Tensor y;
  if (absl::Status s = GemmF32(x, w, &y, options); !s.ok()) return s;
  return y;
}

}  // namespace vlm::kernels
