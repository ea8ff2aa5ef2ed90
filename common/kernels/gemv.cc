#include "common/kernels/gemv.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include "absl/strings/str_cat.h"
#include "common/cpu_features.h"
#include "common/kernels/thread_pool.h"
#include "common/kernels/path_override.h"
#include "common/kernels/simd.h"

namespace vlm {
namespace {

using kernels::simd::Bf16ToF32;

// ---------------------------------------------------------------------------
// The problem every kernel sees: one input (x, prepared for the path) and a
// list of weight matrices with their outputs.

struct Input {
  int64_t batch = 0;
  int64_t in = 0;
  const uint16_t* xb = nullptr;  // bf16 [batch][in]        (avx512bf16)
  const float* xf = nullptr;     // f32 [batch][in], layout per path (others)
};

struct Matrix {
  const uint16_t* w = nullptr;  // [rows][in], row stride ld
  int64_t rows = 0;
  int64_t ld = 0;
  void* y = nullptr;  // [batch][rows]
  bool y_bf16 = false;
  bool accumulate = false;
};

// Writes res[b][r] (b < nb, r < nr) to rows r0.. of batch rows b0.. of m.y.
void StoreTile(const Matrix& m, int64_t b0, int nb, int64_t r0, int nr, const float* res) {
  for (int b = 0; b < nb; ++b) {
    for (int r = 0; r < nr; ++r) {
      const float v = res[b * nr + r];
      const int64_t i = (b0 + b) * m.rows + r0 + r;
      if (m.y_bf16) {
        auto* p = static_cast<c10::BFloat16*>(m.y) + i;
        *p = c10::BFloat16(m.accumulate ? static_cast<float>(*p) + v : v);
      } else {
        float* p = static_cast<float*>(m.y) + i;
        *p = m.accumulate ? *p + v : v;
      }
    }
  }
}

// Kernels compute rows [r0, r1) of one matrix for the whole batch. Rows are
// the outer loop and batch groups the inner one, so a tile of weight rows is
// read from memory once and reused from L1 for every group.
using RowsKernel = void (*)(const Input&, const Matrix&, int64_t r0, int64_t r1);

constexpr int kRowTile = 4;

// Each load of a weight row is paired with a prefetch of the same column one
// tile (kRowTile rows) further on: the hardware prefetchers alone leave about
// 20% of the read bandwidth unused here (measured with vlm-bench-gemv).

// ---------------------------------------------------------------------------
// AVX-512 BF16: 32 bf16 per load; VDPBF16PS multiplies pairs exactly and adds
// them to 16 f32 lanes. The tail (in % 32) uses masked loads (zeros).

template <int R, int NB>
VLM_TARGET_AVX512_BF16 inline void TileAvx512Bf16(const uint16_t* w, int64_t ld, const uint16_t* x,
                                           int64_t in, float* res) {
  __m512 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  const int64_t pf = R * ld;
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) {
    __m512i xv[NB];
    for (int b = 0; b < NB; ++b) xv[b] = _mm512_loadu_si512(x + b * in + k);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * ld + k + pf), _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512(w + r * ld + k);
      for (int b = 0; b < NB; ++b)
        acc[b][r] = _mm512_dpbf16_ps(acc[b][r], (__m512bh)wv, (__m512bh)xv[b]);
    }
  }
  if (k < in) {
    const __mmask32 mask = _cvtu32_mask32((1u << (in - k)) - 1u);
    __m512i xv[NB];
    for (int b = 0; b < NB; ++b) xv[b] = _mm512_maskz_loadu_epi16(mask, x + b * in + k);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, w + r * ld + k);
      for (int b = 0; b < NB; ++b)
        acc[b][r] = _mm512_dpbf16_ps(acc[b][r], (__m512bh)wv, (__m512bh)xv[b]);
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) res[b * R + r] = _mm512_reduce_add_ps(acc[b][r]);
}

template <int R>
VLM_TARGET_AVX512_BF16 void TileGroupsAvx512Bf16(const Input& in, const Matrix& m, int64_t r0) {
  const uint16_t* w = m.w + r0 * m.ld;
  float res[4 * R];
  for (int64_t b0 = 0; b0 < in.batch; b0 += 4) {
    const int nb = static_cast<int>(std::min<int64_t>(4, in.batch - b0));
    const uint16_t* x = in.xb + b0 * in.in;
    switch (nb) {
      case 1: TileAvx512Bf16<R, 1>(w, m.ld, x, in.in, res); break;
      case 2: TileAvx512Bf16<R, 2>(w, m.ld, x, in.in, res); break;
      case 3: TileAvx512Bf16<R, 3>(w, m.ld, x, in.in, res); break;
      default: TileAvx512Bf16<R, 4>(w, m.ld, x, in.in, res); break;
    }
    StoreTile(m, b0, nb, r0, R, res);
  }
}

VLM_TARGET_AVX512_BF16 void RowsAvx512Bf16(const Input& in, const Matrix& m, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + kRowTile <= r1; r += kRowTile) TileGroupsAvx512Bf16<kRowTile>(in, m, r);
  for (; r < r1; ++r) TileGroupsAvx512Bf16<1>(in, m, r);
  // Leave the upper vector state clean: callers run SSE code next, which
  // pays a state transition per instruction otherwise (the sampler's pass over
  // a 151936-wide row took ~25x longer).
  _mm256_zeroupper();
}

// ---------------------------------------------------------------------------
// AVX-512F without BF16 dot products. A dword of weights holds the bf16 pair
// (w[2i], w[2i+1]); shifting left by 16 gives w[2i] as f32 and masking the low
// half gives w[2i+1]. x is laid out to match: per 32-element chunk its 16 even
// elements, then its 16 odd ones; the tail (in % 32) stays in order and is
// summed in scalar code.

template <int R, int NB>
VLM_TARGET_AVX512 inline void TileAvx512(const uint16_t* w, int64_t ld, const float* x, int64_t in,
                                         float* res) {
  __m512 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t pf = R * ld;
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) {
    __m512 xe[NB], xo[NB];
    for (int b = 0; b < NB; ++b) {
      xe[b] = _mm512_loadu_ps(x + b * in + k);
      xo[b] = _mm512_loadu_ps(x + b * in + k + 16);
    }
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * ld + k + pf), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(w + r * ld + k);
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      for (int b = 0; b < NB; ++b) {
        acc[b][r] = _mm512_fmadd_ps(we, xe[b], acc[b][r]);
        acc[b][r] = _mm512_fmadd_ps(wo, xo[b], acc[b][r]);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    for (int r = 0; r < R; ++r) {
      float s = _mm512_reduce_add_ps(acc[b][r]);
      for (int64_t t = k; t < in; ++t) s += Bf16ToF32(w[r * ld + t]) * x[b * in + t];
      res[b * R + r] = s;
    }
  }
}

template <int R>
VLM_TARGET_AVX512 void TileGroupsAvx512(const Input& in, const Matrix& m, int64_t r0) {
  const uint16_t* w = m.w + r0 * m.ld;
  float res[4 * R];
  for (int64_t b0 = 0; b0 < in.batch; b0 += 4) {
    const int nb = static_cast<int>(std::min<int64_t>(4, in.batch - b0));
    const float* x = in.xf + b0 * in.in;
    switch (nb) {
      case 1: TileAvx512<R, 1>(w, m.ld, x, in.in, res); break;
      case 2: TileAvx512<R, 2>(w, m.ld, x, in.in, res); break;
      case 3: TileAvx512<R, 3>(w, m.ld, x, in.in, res); break;
      default: TileAvx512<R, 4>(w, m.ld, x, in.in, res); break;
    }
    StoreTile(m, b0, nb, r0, R, res);
  }
}

VLM_TARGET_AVX512 void RowsAvx512(const Input& in, const Matrix& m, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + kRowTile <= r1; r += kRowTile) TileGroupsAvx512<kRowTile>(in, m, r);
  for (; r < r1; ++r) TileGroupsAvx512<1>(in, m, r);
  _mm256_zeroupper();  // as in RowsAvx512Bf16
}

// ---------------------------------------------------------------------------
// AVX2 + FMA: as AVX-512F with 16-element chunks (8 even, then 8 odd) and at
// most 2 batch rows per group (16 ymm registers).

VLM_TARGET_AVX2 inline float ReduceAdd256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int R, int NB>
VLM_TARGET_AVX2 inline void TileAvx2(const uint16_t* w, int64_t ld, const float* x, int64_t in,
                                     float* res) {
  __m256 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t pf = R * ld;
  int64_t k = 0;
  for (; k + 16 <= in; k += 16) {
    __m256 xe[NB], xo[NB];
    for (int b = 0; b < NB; ++b) {
      xe[b] = _mm256_loadu_ps(x + b * in + k);
      xo[b] = _mm256_loadu_ps(x + b * in + k + 8);
    }
    for (int r = 0; r < R; ++r) {
      if ((k & 31) == 0)  // one prefetch per 64-byte line
        _mm_prefetch(reinterpret_cast<const char*>(w + r * ld + k + pf), _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * ld + k));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      for (int b = 0; b < NB; ++b) {
        acc[b][r] = _mm256_fmadd_ps(we, xe[b], acc[b][r]);
        acc[b][r] = _mm256_fmadd_ps(wo, xo[b], acc[b][r]);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    for (int r = 0; r < R; ++r) {
      float s = ReduceAdd256(acc[b][r]);
      for (int64_t t = k; t < in; ++t) s += Bf16ToF32(w[r * ld + t]) * x[b * in + t];
      res[b * R + r] = s;
    }
  }
}

template <int R>
VLM_TARGET_AVX2 void TileGroupsAvx2(const Input& in, const Matrix& m, int64_t r0) {
  const uint16_t* w = m.w + r0 * m.ld;
  float res[2 * R];
  for (int64_t b0 = 0; b0 < in.batch; b0 += 2) {
    const float* x = in.xf + b0 * in.in;
    if (in.batch - b0 >= 2) {
      TileAvx2<R, 2>(w, m.ld, x, in.in, res);
      StoreTile(m, b0, 2, r0, R, res);
    } else {
      TileAvx2<R, 1>(w, m.ld, x, in.in, res);
      StoreTile(m, b0, 1, r0, R, res);
    }
  }
}

VLM_TARGET_AVX2 void RowsAvx2(const Input& in, const Matrix& m, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + kRowTile <= r1; r += kRowTile) TileGroupsAvx2<kRowTile>(in, m, r);
  for (; r < r1; ++r) TileGroupsAvx2<1>(in, m, r);
  _mm256_zeroupper();  // as in RowsAvx512Bf16
}

// ---------------------------------------------------------------------------
// Portable scalar code, x in order; four partial sums per dot product.

void RowsScalar(const Input& in, const Matrix& m, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* w = m.w + r * m.ld;
    for (int64_t b = 0; b < in.batch; ++b) {
      const float* x = in.xf + b * in.in;
      float s[4] = {0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 4 <= in.in; k += 4)
        for (int j = 0; j < 4; ++j) s[j] += Bf16ToF32(w[k + j]) * x[k + j];
      for (; k < in.in; ++k) s[0] += Bf16ToF32(w[k]) * x[k];
      const float v = (s[0] + s[1]) + (s[2] + s[3]);
      StoreTile(m, b, 1, r, 1, &v);
    }
  }
}

// ---------------------------------------------------------------------------
// Path selection.

RowsKernel KernelFor(GemvPath path) {
  switch (path) {
    case GemvPath::kAvx512Bf16: return RowsAvx512Bf16;
    case GemvPath::kAvx512: return RowsAvx512;
    case GemvPath::kAvx2: return RowsAvx2;
    case GemvPath::kScalar: return RowsScalar;
  }
  return RowsScalar;
}

// Elements per chunk whose even/odd halves are separated in the f32 x layout
// (0: x in order).
int ChunkFor(GemvPath path) {
  switch (path) {
    case GemvPath::kAvx512: return 32;
    case GemvPath::kAvx2: return 16;
    default: return 0;
  }
}

GemvPath BestPath() {
  for (GemvPath p : {GemvPath::kAvx512Bf16, GemvPath::kAvx512, GemvPath::kAvx2}) {
    if (GemvPathSupported(p)) return p;
  }
  return GemvPath::kScalar;
}

// ---------------------------------------------------------------------------
// Preparing x (once per call, on the calling thread).

// x as bf16 bits in order, [batch][in]: the tensor itself when it is
// contiguous bf16, else a conversion into `scratch` (round to nearest even).
const uint16_t* XAsBf16(const at::Tensor& x, std::vector<uint16_t>* scratch) {
  if (x.scalar_type() == at::kBFloat16 && x.is_contiguous()) {
    return reinterpret_cast<const uint16_t*>(x.data_ptr());
  }
  const at::Tensor xc = x.contiguous();
  const size_t n = static_cast<size_t>(xc.numel());
  scratch->resize(n);
  if (xc.scalar_type() == at::kBFloat16) {
    std::memcpy(scratch->data(), xc.data_ptr(), n * sizeof(uint16_t));
  } else {
    const float* src = xc.data_ptr<float>();
    for (size_t i = 0; i < n; ++i) (*scratch)[i] = c10::BFloat16(src[i]).x;
  }
  return scratch->data();
}

// x as bf16-rounded f32, [batch][in], chunks of `chunk` elements stored even
// elements first, then odd ones (chunk 0: in order).
void XAsF32(const uint16_t* xb, int64_t batch, int64_t in, int chunk, std::vector<float>* out) {
  out->resize(static_cast<size_t>(batch * in));
  for (int64_t b = 0; b < batch; ++b) {
    const uint16_t* src = xb + b * in;
    float* dst = out->data() + b * in;
    int64_t k = 0;
    if (chunk > 0) {
      const int half = chunk / 2;
      for (; k + chunk <= in; k += chunk) {
        for (int i = 0; i < half; ++i) {
          dst[k + i] = Bf16ToF32(src[k + 2 * i]);
          dst[k + half + i] = Bf16ToF32(src[k + 2 * i + 1]);
        }
      }
    }
    for (; k < in; ++k) dst[k] = Bf16ToF32(src[k]);
  }
}

// ---------------------------------------------------------------------------
// Threads. Output rows of all matrices form one sequence, cut into blocks of
// kBlockRows (block edges at multiples of 32 rows keep threads off each
// other's output cache lines).

constexpr int64_t kBlockRows = 64;

void RunRows(RowsKernel kernel, const Input& in, const std::vector<Matrix>& mats, int64_t begin,
             int64_t end) {
  // [begin, end) in the concatenated row sequence.
  int64_t base = 0;
  for (const Matrix& m : mats) {
    const int64_t lo = std::max(begin, base), hi = std::min(end, base + m.rows);
    if (lo < hi) kernel(in, m, lo - base, hi - base);
    base += m.rows;
    if (base >= end) break;
  }
}

// Row blocks go to the kernels' process-wide pool (common/kernels/thread_pool.h):
// one contiguous part per participant, each drained front to back, then
// helping with the others', so a descheduled worker costs its share of time,
// not a stall.
void RunParallel(RowsKernel kernel, const Input& in, const std::vector<Matrix>& mats) {
  int64_t total = 0;
  for (const Matrix& m : mats) total += m.rows;
  const int64_t blocks = (total + kBlockRows - 1) / kBlockRows;
  struct Work {
    RowsKernel kernel;
    const Input* in;
    const std::vector<Matrix>* mats;
    int64_t total;
  } work{kernel, &in, &mats, total};
  // One captured pointer: fits std::function's inline storage (no allocation per call).
  kernels::ParallelFor(blocks, kernels::DefaultThreads(), 1, [w = &work](int64_t b0, int64_t b1) {
    RunRows(w->kernel, *w->in, *w->mats, b0 * kBlockRows, std::min(w->total, b1 * kBlockRows));
  });
}

absl::Status CheckWeight(const at::Tensor& w, int64_t in, size_t index) {
  const std::string name = absl::StrCat("weight ", index);
  if (!w.defined()) return absl::InvalidArgumentError(absl::StrCat(name, " is undefined"));
  if (w.device().type() != at::kCPU || w.dim() != 2 || w.scalar_type() != at::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be a 2-D bf16 CPU tensor [out, in]; got ", w.toString(), " ",
                     w.dim(), "-D"));
  }
  if (w.size(1) != in) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " has in = ", w.size(1), " but x has ", in, " columns"));
  }
  if (w.size(0) > 1 && w.size(1) > 1 && (w.stride(1) != 1 || w.stride(0) < in)) {
    return absl::InvalidArgumentError(absl::StrCat(name, " needs unit stride along in; strides ",
                                                   w.stride(0), ", ", w.stride(1)));
  }
  return absl::OkStatus();
}

absl::Status CheckOutput(at::Tensor* y, const at::Tensor& x, int64_t out, bool accumulate,
                         size_t index) {
  const std::string name = absl::StrCat("output ", index);
  if (y == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " is null"));
  if (!y->defined()) {
    if (accumulate) {
      return absl::InvalidArgumentError(absl::StrCat(name, " is undefined but accumulate is set"));
    }
    *y = at::empty({x.size(0), out}, x.options());
    return absl::OkStatus();
  }
  if (y->device().type() != at::kCPU || y->dim() != 2 ||
      (y->scalar_type() != at::kFloat && y->scalar_type() != at::kBFloat16)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be a 2-D f32 or bf16 CPU tensor; got ", y->toString()));
  }
  if (y->size(0) != x.size(0) || y->size(1) != out) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is [", y->size(0), ", ", y->size(1),
                                                   "], expected [", x.size(0), ", ", out, "]"));
  }
  if (!y->is_contiguous()) return absl::InvalidArgumentError(absl::StrCat(name, " is not contiguous"));
  return absl::OkStatus();
}

absl::Status GemvImpl(const at::Tensor& x, absl::Span<const at::Tensor> ws,
                      absl::Span<at::Tensor* const> ys, const GemvOptions& options) {
  if (ws.size() != ys.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(ws.size(), " weights but ", ys.size(), " outputs"));
  }
  if (!x.defined() || x.device().type() != at::kCPU || x.dim() != 2 ||
      (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kFloat)) {
    return absl::InvalidArgumentError(
        absl::StrCat("x must be a 2-D bf16 or f32 CPU tensor [B, in]; got ",
                     x.defined() ? x.toString() : "undefined"));
  }
  const GemvPath path = options.path.value_or(DefaultGemvPath());
  std::string missing;
  if (!GemvPathSupported(path, &missing)) {
    return absl::FailedPreconditionError(
        absl::StrCat("gemv path ", GemvPathName(path), " needs ", missing));
  }
  const int64_t in = x.size(1);
  std::vector<Matrix> mats;
  mats.reserve(ws.size());
  for (size_t i = 0; i < ws.size(); ++i) {
    if (absl::Status s = CheckWeight(ws[i], in, i); !s.ok()) return s;
    if (absl::Status s = CheckOutput(ys[i], x, ws[i].size(0), options.accumulate, i); !s.ok())
      return s;
    Matrix m;
    m.w = reinterpret_cast<const uint16_t*>(ws[i].data_ptr());
    m.rows = ws[i].size(0);
    m.ld = m.rows > 1 ? ws[i].stride(0) : in;
    m.y = ys[i]->data_ptr();
    m.y_bf16 = ys[i]->scalar_type() == at::kBFloat16;
    m.accumulate = options.accumulate;
    if (x.size(0) == 0 || m.rows == 0) continue;  // nothing to compute
    if (in == 0) {                                  // empty sums
      if (!m.accumulate) ys[i]->zero_();
      continue;
    }
    mats.push_back(m);
  }
  if (mats.empty()) return absl::OkStatus();

  thread_local std::vector<uint16_t> xb_scratch;
  thread_local std::vector<float> xf_scratch;
  Input input;
  input.batch = x.size(0);
  input.in = in;
  input.xb = XAsBf16(x, &xb_scratch);
  if (path != GemvPath::kAvx512Bf16) {
    XAsF32(input.xb, input.batch, in, ChunkFor(path), &xf_scratch);
    input.xf = xf_scratch.data();
  }
  RunParallel(KernelFor(path), input, mats);
  return absl::OkStatus();
}

}  // namespace

const char* GemvPathName(GemvPath path) {
  switch (path) {
    case GemvPath::kAvx512Bf16: return "avx512bf16";
    case GemvPath::kAvx512: return "avx512";
    case GemvPath::kAvx2: return "avx2";
    case GemvPath::kScalar: return "scalar";
  }
  return "?";
}

absl::StatusOr<GemvPath> ParseGemvPath(std::string_view name) {
  if (name == "auto") return BestPath();
  for (GemvPath p : {GemvPath::kAvx512Bf16, GemvPath::kAvx512, GemvPath::kAvx2, GemvPath::kScalar}) {
    if (name == GemvPathName(p)) return p;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown gemv path '", std::string(name), "'; expected avx512bf16, avx512, avx2, scalar or auto"));
}

bool GemvPathSupported(GemvPath path, std::string* missing) {
  const CpuFeatures& f = GetCpuFeatures();  // capped by VLM_ISA
  const char* need = nullptr;
  switch (path) {
    case GemvPath::kAvx512Bf16:
      if (!f.fast_bf16_matmul()) need = "avx512f, avx512bw, avx512vl and avx512dq";
      else if (!f.avx512bf16) need = "avx512bf16";
      break;
    case GemvPath::kAvx512:
      if (!f.fast_bf16_matmul()) need = "avx512f, avx512bw, avx512vl and avx512dq";
      break;
    case GemvPath::kAvx2:
      if (!f.avx2) need = "avx2";
      else if (!f.fma) need = "fma";
      break;
    case GemvPath::kScalar:
      break;
  }
  if (need != nullptr && missing != nullptr) {
    *missing = f.isa_cap.empty() ? need : absl::StrCat(need, " (VLM_ISA=", f.isa_cap, ")");
  }
  return need == nullptr;
}

GemvPath DefaultGemvPath() {
  static const GemvPath path = kernels::internal::PathFromEnvironment(
      "VLM_GEMV_PATH", BestPath(), ParseGemvPath,
      [](GemvPath p, std::string* missing) { return GemvPathSupported(p, missing); });
  return path;
}

absl::Status Gemv(const at::Tensor& x, const at::Tensor& w, at::Tensor* y,
                  const GemvOptions& options) {
  try {
    return GemvImpl(x, absl::MakeConstSpan(&w, 1), absl::MakeConstSpan(&y, 1), options);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("gemv: ", e.what_without_backtrace()));
  }
}

absl::Status GemvMulti(const at::Tensor& x, absl::Span<const at::Tensor> ws,
                       absl::Span<at::Tensor* const> ys, const GemvOptions& options) {
  try {
    return GemvImpl(x, ws, ys, options);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("gemv: ", e.what_without_backtrace()));
  }
}

}  // namespace vlm
