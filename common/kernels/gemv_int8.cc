#include "common/kernels/gemv_int8.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/cpu_features.h"
#include "common/kernels/thread_pool.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

namespace vlm::kernels {
namespace {

constexpr int64_t kGroup = kInt8Group;  // elements per scale (weights and activations)
constexpr int64_t kBlock = kInt8Block;  // interleaved block: 16 groups, one per VPDPWSSD lane
constexpr float kXLimit = 32767.0f;

// x quantized to int16 per group of 32, in buffers reused by the calling
// thread from call to call: q [B][k_padded] in the weights' stored order
// (quantize.h StoredIndex; zero past K), d [B][groups] f32.
struct QuantizedX {
  int64_t batch = 0, k_padded = 0, groups = 0;
  std::vector<int16_t> q;
  std::vector<float> d;
  std::vector<int16_t> natural;  // one group-quantized row before interleaving

  void Resize(int64_t b, int64_t kp) {
    batch = b;
    k_padded = kp;
    groups = kp / kGroup;
    q.resize(b * kp);
    d.resize(b * groups);
    natural.resize(kp);
  }
};

float ToF32(const float* p, int64_t i) { return p[i]; }
float ToF32(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

float HalfToFloat(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Groups of one row: d = max|x| / 32767, q = round-to-nearest-even(x·(1/d)),
// clamped to ±32767, in natural order. The VNNI path's vector version below
// computes the same f32 operations, so both paths see identical q and d.
template <typename T>
void QuantizeRowScalar(const T* src, int64_t k, int64_t kp, int16_t* q, float* d) {
  for (int64_t g = 0; g < kp / kGroup; ++g) {
    const int64_t k0 = g * kGroup, k1 = std::min(k, k0 + kGroup);
    float amax = 0;
    for (int64_t i = k0; i < k1; ++i) amax = std::max(amax, std::fabs(ToF32(src, i)));
    const float scale = amax / kXLimit;
    const float inv = scale > 0 ? 1.0f / scale : 0.0f;
    for (int64_t i = k0; i < k0 + kGroup; ++i) {
      q[i] = i < k1 ? static_cast<int16_t>(
                          std::clamp(std::nearbyint(ToF32(src, i) * inv), -kXLimit, kXLimit))
                    : 0;
    }
    d[g] = scale;
  }
}

// Natural order -> stored order (quantize.h): within each full block of 512 a
// transpose of the 16×16 matrix of element pairs; the tail is copied as is.
void Interleave(const int16_t* natural, int64_t kp, int16_t* stored) {
  const int64_t full = kp / kBlock * kBlock;
  for (int64_t s = 0; s < full; s += kBlock) {
    const int32_t* src = reinterpret_cast<const int32_t*>(natural + s);
    int32_t* dst = reinterpret_cast<int32_t*>(stored + s);
    for (int l = 0; l < 16; ++l)
      for (int j = 0; j < 16; ++j) dst[16 * j + l] = src[16 * l + j];
  }
  std::memcpy(stored + full, natural + full, (kp - full) * sizeof(int16_t));
}

#define VLM_TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// 16 elements i0.. of a row as f32; lanes at or past k are zero.
VLM_TARGET_VNNI inline __m512 Load16(const float* src, int64_t i0, int64_t k) {
  if (i0 + 16 <= k) return _mm512_loadu_ps(src + i0);
  if (i0 >= k) return _mm512_setzero_ps();
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (k - i0)) - 1), src + i0);
}
VLM_TARGET_VNNI inline __m512 Load16(const c10::BFloat16* src, int64_t i0, int64_t k) {
  __m256i h;
  if (i0 + 16 <= k) h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i0));
  else if (i0 >= k) h = _mm256_setzero_si256();
  else h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << (k - i0)) - 1), src + i0);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// round(v·inv) clamped to ±32767 as int16; VCVTPS2DQ rounds to nearest even
// (the default MXCSR mode), as std::nearbyint does.
VLM_TARGET_VNNI inline __m256i Quantize16(__m512 v, __m512 inv, __m512i lim, __m512i neg_lim) {
  const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
  return _mm512_cvtepi32_epi16(_mm512_max_epi32(_mm512_min_epi32(r, lim), neg_lim));
}

template <typename T>
VLM_TARGET_VNNI void QuantizeRowVnni(const T* src, int64_t k, int64_t kp, int16_t* q, float* d) {
  const __m512i lim = _mm512_set1_epi32(32767), neg_lim = _mm512_set1_epi32(-32767);
  for (int64_t g = 0; g < kp / kGroup; ++g) {
    const int64_t k0 = g * kGroup;
    const __m512 lo = Load16(src, k0, k), hi = Load16(src, k0 + 16, k);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float scale = amax / kXLimit;
    const __m512 inv = _mm512_set1_ps(scale > 0 ? 1.0f / scale : 0.0f);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0), Quantize16(lo, inv, lim, neg_lim));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0 + 16),
                        Quantize16(hi, inv, lim, neg_lim));
    d[g] = scale;
  }
}

template <typename T>
void QuantizeXTyped(const T* src, int64_t ld, int64_t k, bool vnni, QuantizedX* out) {
  const int64_t kp = out->k_padded;
  for (int64_t b = 0; b < out->batch; ++b) {
    float* d = out->d.data() + b * out->groups;
    if (vnni) QuantizeRowVnni(src + b * ld, k, kp, out->natural.data(), d);
    else QuantizeRowScalar(src + b * ld, k, kp, out->natural.data(), d);
    Interleave(out->natural.data(), kp, out->q.data() + b * kp);
  }
}

void QuantizeX(const at::Tensor& x, int64_t k_padded, bool vnni, QuantizedX* out) {
  out->Resize(x.size(0), k_padded);
  const int64_t ld = x.size(0) > 1 ? x.stride(0) : x.size(1);
  if (x.scalar_type() == at::kBFloat16) {
    QuantizeXTyped(x.data_ptr<c10::BFloat16>(), ld, x.size(1), vnni, out);
  } else {
    QuantizeXTyped(x.data_ptr<float>(), ld, x.size(1), vnni, out);
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
    const int8_t* wr = w.row(r);
    const uint16_t* ratios = w.ratios() + r * x.groups;
    for (int64_t b = 0; b < x.batch; ++b) {
      const int16_t* xr = x.q.data() + b * kp;
      float sum = 0;
      for (int64_t g = 0; g < x.groups; ++g) {
        int32_t isum = 0;
        for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) {
          const int64_t at = StoredIndex(i, kp);
          isum += int32_t{xr[at]} * int32_t{wr[at]};
        }
        sum += HalfToFloat(ratios[g]) * x.d[b * x.groups + g] * static_cast<float>(isum);
      }
      out.Store(b, r, w.row_scales()[r] * sum);
    }
  }
}

// --- avx512vnni ----------------------------------------------------------------
// One weight row at a time, front to back (one sequential stream per thread,
// the hardware prefetchers' best case), for up to 8 batch rows. Per 32 weights:
// one VPMOVSXBW to int16, then per batch row one VPDPWSSD with the row's int16
// x. In a full block lane l sums group l of the block (the interleaved
// layout), so the integer sums stay in int32 for 16 instructions and the block
// costs one convert, one scale product (16 f16 ratios · 16 d) and one FMA per
// batch row. Integer sums are exact (|Σ| ≤ 32·32767·127 < 2^31 per lane), so
// splitting them over A accumulators (latency hiding for small batches)
// changes nothing: every batch row gets the same f32 operations whatever the
// batch, which keeps decode rows batch-invariant bit for bit.
constexpr int64_t kSeqPrefetch = 512;

VLM_TARGET_VNNI inline __m512i Widen(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int NB>
VLM_TARGET_VNNI void RowVnni(const QuantizedX& x, int64_t b0, const QuantizedWeight& w,
                             int64_t r, const Output& out) {
  constexpr int A = NB >= 4 ? 1 : (4 + NB - 1) / NB;  // int32 partial sums per batch row
  const int64_t kp = x.k_padded, full = kp / kBlock * kBlock;
  const int8_t* wp = w.row(r);
  const uint16_t* ratios = w.ratios() + r * x.groups;
  const int16_t* xq = x.q.data() + b0 * kp;
  const float* d = x.d.data() + b0 * x.groups;
  __m512 facc[NB];
  for (int b = 0; b < NB; ++b) facc[b] = _mm512_setzero_ps();
  for (int64_t s = 0; s < full; s += kBlock) {
    __m512i acc[NB][A];
    for (int b = 0; b < NB; ++b)
      for (int a = 0; a < A; ++a) acc[b][a] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      if (j % 2 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(wp + s + j * kGroup + kSeqPrefetch),
                     _MM_HINT_T0);
      }
      const __m512i wv = Widen(wp + s + j * kGroup);
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) {
        acc[b][j % A] = _mm512_dpwssd_epi32(
            acc[b][j % A], _mm512_loadu_si512(xq + b * kp + s + j * kGroup), wv);
      }
    }
    const __m512 ratio = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ratios + s / kGroup)));
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      __m512i isum = acc[b][0];
      for (int a = 1; a < A; ++a) isum = _mm512_add_epi32(isum, acc[b][a]);
      const __m512 scale = _mm512_mul_ps(ratio, _mm512_loadu_ps(d + b * x.groups + s / kGroup));
      facc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, facc[b]);
    }
  }
  for (int64_t g = full / kGroup; g < x.groups; ++g) {  // natural-order tail groups
    const __m512i wv = Widen(wp + g * kGroup);
    const float ratio = HalfToFloat(ratios[g]);
    for (int b = 0; b < NB; ++b) {
      const __m512i isum = _mm512_dpwssd_epi32(
          _mm512_setzero_si512(), _mm512_loadu_si512(xq + b * kp + g * kGroup), wv);
      facc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum),
                                _mm512_set1_ps(ratio * d[b * x.groups + g]), facc[b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    out.Store(b0 + b, r, w.row_scales()[r] * _mm512_reduce_add_ps(facc[b]));
  }
}

constexpr int64_t kRowsPerTask = 64;

VLM_TARGET_VNNI void RowsVnni(const QuantizedX& x, const QuantizedWeight& w, const Output& out,
                              int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b0 = 0; b0 < x.batch; b0 += 8) {  // a row's weights stay in L1 across groups
      switch (std::min<int64_t>(8, x.batch - b0)) {
        case 1: RowVnni<1>(x, b0, w, r, out); break;
        case 2: RowVnni<2>(x, b0, w, r, out); break;
        case 3: RowVnni<3>(x, b0, w, r, out); break;
        case 4: RowVnni<4>(x, b0, w, r, out); break;
        case 5: RowVnni<5>(x, b0, w, r, out); break;
        case 6: RowVnni<6>(x, b0, w, r, out); break;
        case 7: RowVnni<7>(x, b0, w, r, out); break;
        default: RowVnni<8>(x, b0, w, r, out); break;
      }
    }
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
  if (f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni) return true;
  if (missing != nullptr) *missing = "AVX-512 VNNI (with F/BW/VL)";
  return false;
}

GemvInt8Path DefaultGemvInt8Path() {
  static const GemvInt8Path path = [] {
    const char* env = std::getenv("VLM_GEMV_INT8_PATH");
    if (env == nullptr || *env == '\0') return BestPath();
    absl::StatusOr<GemvInt8Path> p = ParseGemvInt8Path(env);
    std::string missing;
    if (!p.ok()) {
      std::fprintf(stderr, "VLM_GEMV_INT8_PATH ignored: %s\n",
                   std::string(p.status().message()).c_str());
      return BestPath();
    }
    if (!GemvInt8PathSupported(*p, &missing)) {
      std::fprintf(stderr, "VLM_GEMV_INT8_PATH=%s ignored: this CPU lacks %s\n", env,
                   missing.c_str());
      return BestPath();
    }
    return *p;
  }();
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
      QuantizeX(x.contiguous(), w.k_padded(), vnni, &qx);
    } else {
      QuantizeX(x, w.k_padded(), vnni, &qx);
    }
    Output out{y->data_ptr(), y->scalar_type() == at::kBFloat16, n};
    // Blocks of kRowsPerTask rows (a multiple of 32: threads never share an
    // output cache line).
    const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
    struct Work {
      const QuantizedX* x;
      const QuantizedWeight* w;
      const Output* out;
      bool vnni;
    } work{&qx, &w, &out, vnni};
    // One captured pointer: fits std::function's inline storage (no allocation per call).
    ParallelFor(tasks, options.threads, 1, [k = &work](int64_t t0, int64_t t1) {
      const int64_t r0 = t0 * kRowsPerTask, r1 = std::min(k->out->n, t1 * kRowsPerTask);
      if (k->vnni) RowsVnni(*k->x, *k->w, *k->out, r0, r1);
      else RowsScalar(*k->x, *k->w, *k->out, r0, r1);
    });
    return absl::OkStatus();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("int8 gemv: out of memory");
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("int8 gemv: ", e.what_without_backtrace()));
  }
}

}  // namespace vlm::kernels
