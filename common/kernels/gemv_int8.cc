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

constexpr int64_t kBlock = 32;  // activation quantization block
constexpr int64_t kChunk = 64;  // bytes of a weight row per VPDPBUSD (two blocks)

// x quantized, in buffers reused by the calling thread from call to call:
// q [B][k_padded] int8 (zero past K), d [B][k_padded / 32] f32, and for the
// VNNI path, per 64-wide chunk and VPDPBUSD lane (4 consecutive k): the
// scales [B][k_padded/64][16] (lanes 0-7 block 2c, lanes 8-15 block 2c+1)
// and the start values -128·Σ of the lane's 4 xq [B][k_padded/64][16], which
// cancel the +128 of the stored weights.
struct QuantizedX {
  int64_t batch = 0, k_padded = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> d_lanes;
  std::vector<int32_t> bias_lanes;

  void Resize(int64_t b, int64_t kp) {
    batch = b;
    k_padded = kp;
    q.resize(b * kp);
    d.resize(b * kp / kBlock);
    d_lanes.resize(b * kp / kChunk * 16);
    bias_lanes.resize(b * kp / kChunk * 16);
  }
};

float ToF32(const float* p, int64_t i) { return p[i]; }
float ToF32(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

// Blocks of one row: d = max|x| / 127, q = round-to-nearest-even(x / d) (as
// x·(1/d)), clamped to ±127. The VNNI path's vector version below computes
// the same f32 operations, so both paths see identical q and d.
template <typename T>
void QuantizeRowScalar(const T* src, int64_t k, int64_t kp, int8_t* q, float* d) {
  for (int64_t blk = 0; blk < kp / kBlock; ++blk) {
    const int64_t k0 = blk * kBlock, k1 = std::min(k, k0 + kBlock);
    float amax = 0;
    for (int64_t i = k0; i < k1; ++i) amax = std::max(amax, std::fabs(ToF32(src, i)));
    const float scale = amax / 127.0f;
    const float inv = scale > 0 ? 1.0f / scale : 0.0f;
    for (int64_t i = k0; i < k0 + kBlock; ++i) {
      q[i] = i < k1 ? static_cast<int8_t>(
                          std::clamp(std::nearbyint(ToF32(src, i) * inv), -127.0f, 127.0f))
                    : 0;
    }
    d[blk] = scale;
  }
}

void LanesScalar(const int8_t* q, const float* d, int64_t kp, float* d_lanes, int32_t* bias) {
  for (int64_t c = 0; c < kp / kChunk; ++c) {
    for (int l = 0; l < 16; ++l) {
      d_lanes[c * 16 + l] = d[2 * c + l / 8];
      int32_t sum = 0;
      for (int j = 0; j < 4; ++j) sum += q[c * kChunk + 4 * l + j];
      bias[c * 16 + l] = -128 * sum;
    }
  }
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

// round(v·inv) clamped to ±127 as int8; VCVTPS2DQ rounds to nearest even
// (the default MXCSR mode), as std::nearbyint does.
VLM_TARGET_VNNI inline __m128i Quantize16(__m512 v, __m512 inv, __m512i lim, __m512i neg_lim) {
  const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
  return _mm512_cvtepi32_epi8(_mm512_max_epi32(_mm512_min_epi32(r, lim), neg_lim));
}

template <typename T>
VLM_TARGET_VNNI void QuantizeRowVnni(const T* src, int64_t k, int64_t kp, int8_t* q, float* d,
                                     float* d_lanes, int32_t* bias) {
  const __m512i lim = _mm512_set1_epi32(127), neg_lim = _mm512_set1_epi32(-127);
  for (int64_t blk = 0; blk < kp / kBlock; ++blk) {
    const int64_t k0 = blk * kBlock;
    const __m512 lo = Load16(src, k0, k), hi = Load16(src, k0 + 16, k);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float scale = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(scale > 0 ? 1.0f / scale : 0.0f);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0), Quantize16(lo, inv, lim, neg_lim));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16), Quantize16(hi, inv, lim, neg_lim));
    d[blk] = scale;
  }
  const __m512i u128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t c = 0; c < kp / kChunk; ++c) {
    const __m512i xq = _mm512_loadu_si512(q + c * kChunk);
    const __m512i sum128 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u128, xq);  // 128·Σ4 xq
    _mm512_storeu_si512(bias + c * 16, _mm512_sub_epi32(_mm512_setzero_si512(), sum128));
    _mm512_storeu_ps(d_lanes + c * 16,
                     _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d[2 * c]),
                                          _mm512_set1_ps(d[2 * c + 1])));
  }
}

template <typename T>
void QuantizeXTyped(const T* src, int64_t ld, int64_t k, bool vnni, QuantizedX* out) {
  const int64_t kp = out->k_padded, chunks = kp / kChunk;
  for (int64_t b = 0; b < out->batch; ++b) {
    int8_t* q = out->q.data() + b * kp;
    float* d = out->d.data() + b * (kp / kBlock);
    float* dl = out->d_lanes.data() + b * chunks * 16;
    int32_t* bias = out->bias_lanes.data() + b * chunks * 16;
    if (vnni) {
      QuantizeRowVnni(src + b * ld, k, kp, q, d, dl, bias);
    } else {
      QuantizeRowScalar(src + b * ld, k, kp, q, d);
      LanesScalar(q, d, kp, dl, bias);
    }
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
void RowsScalar(const QuantizedX& x, const QuantizedWeight& w, const Output& out, int64_t r0,
                int64_t r1) {
  const int64_t blocks = x.k_padded / kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wr = w.row(r);
    for (int64_t b = 0; b < x.batch; ++b) {
      const int8_t* xr = x.q.data() + b * x.k_padded;
      float sum = 0;
      for (int64_t blk = 0; blk < blocks; ++blk) {
        int32_t isum = 0;
        for (int64_t i = blk * kBlock; i < (blk + 1) * kBlock; ++i) {
          isum += int32_t{xr[i]} * (int32_t{wr[i]} - 128);
        }
        sum += x.d[b * blocks + blk] * static_cast<float>(isum);
      }
      out.Store(b, r, w.scales()[r] * sum);
    }
  }
}

// --- avx512vnni ----------------------------------------------------------------
// B >= 3: a tile is R weight rows × NB batch rows. Per 64-byte chunk the R weight
// vectors are loaded once and each batch row's quantized x, scales and start
// values once, then R·NB independent VPDPBUSD → convert → FMA chains run
// (R·NB + R + 4 vector registers). Each weight load is paired with a prefetch
// of the same column kPrefetchTiles tiles further on.
constexpr int kPrefetchTiles = 2;

template <int R, int NB>
VLM_TARGET_VNNI inline void TileVnni(const QuantizedX& x, int64_t b0, const QuantizedWeight& w,
                                     int64_t r0, const Output& out) {
  __m512 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  const int64_t kp = x.k_padded, chunks = kp / kChunk;
  const uint8_t* wp = w.row(r0);  // rows are k_padded apart
  const int64_t pf = kPrefetchTiles * R * kp;
  const int8_t* xq = x.q.data() + b0 * kp;
  const float* dl = x.d_lanes.data() + b0 * chunks * 16;
  const int32_t* bl = x.bias_lanes.data() + b0 * chunks * 16;
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + r * kp + c * kChunk + pf), _MM_HINT_T0);
      wv[r] = _mm512_load_si512(wp + r * kp + c * kChunk);
    }
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const __m512i xv = _mm512_loadu_si512(xq + b * kp + c * kChunk);
      const __m512 dv = _mm512_loadu_ps(dl + (b * chunks + c) * 16);
      const __m512i bias = _mm512_loadu_si512(bl + (b * chunks + c) * 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(bias, wv[r], xv);  // exact Σ q·xq per lane
        acc[b][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dv, acc[b][r]);
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r)
      out.Store(b0 + b, r0 + r, w.scales()[r0 + r] * _mm512_reduce_add_ps(acc[b][r]));
}

// B = 1, 2: one row at a time, front to back, so each thread reads its rows
// as a single sequential stream (the hardware prefetchers' best case;
// interleaving 4 rows of 2 KB measured about 25% slower per byte at B = 1 on
// AMD Zen 5, and at B = 2 too), with 4 accumulator chains over consecutive
// chunks (4 / B per batch row) to hide the FMA latency and a
// prefetch kSeqPrefetch bytes ahead in the stream (which runs on into the
// next row).
constexpr int64_t kSeqPrefetch = 512;

// acc + d_lanes · Σ q·xq over chunk c of one weight row and one batch row.
VLM_TARGET_VNNI inline __m512 ChunkVnni(const uint8_t* w, const int8_t* xq, const float* d_lanes,
                                        const int32_t* bias, int64_t c, __m512 acc) {
  const __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(bias + c * 16),
                                          _mm512_load_si512(w + c * kChunk),
                                          _mm512_loadu_si512(xq + c * kChunk));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(d_lanes + c * 16), acc);
}

template <int NB>
VLM_TARGET_VNNI void RowSequentialVnni(const QuantizedX& x, const QuantizedWeight& w, int64_t r,
                                       const Output& out) {
  constexpr int A = 4 / NB;  // accumulators per batch row: 4 chains in all
  __m512 acc[NB][A];
  for (int b = 0; b < NB; ++b)
    for (int a = 0; a < A; ++a) acc[b][a] = _mm512_setzero_ps();
  const int64_t kp = x.k_padded, chunks = kp / kChunk;
  const uint8_t* wp = w.row(r);
  int64_t c = 0;
  for (; c + A <= chunks; c += A) {
#pragma GCC unroll 4
    for (int a = 0; a < A; ++a) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + (c + a) * kChunk + kSeqPrefetch),
                   _MM_HINT_T0);
#pragma GCC unroll 2
      for (int b = 0; b < NB; ++b) {
        acc[b][a] = ChunkVnni(wp, x.q.data() + b * kp, x.d_lanes.data() + b * chunks * 16,
                              x.bias_lanes.data() + b * chunks * 16, c + a, acc[b][a]);
      }
    }
  }
  for (; c < chunks; ++c) {
    for (int b = 0; b < NB; ++b) {
      acc[b][0] = ChunkVnni(wp, x.q.data() + b * kp, x.d_lanes.data() + b * chunks * 16,
                            x.bias_lanes.data() + b * chunks * 16, c, acc[b][0]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    __m512 s = acc[b][0];
    for (int a = 1; a < A; ++a) s = _mm512_add_ps(s, acc[b][a]);
    out.Store(b, r, w.scales()[r] * _mm512_reduce_add_ps(s));
  }
}

// Rows [r0, r1) for every batch row: tiles of R rows (1 for the tail), batch
// rows in groups of up to 4; a tile's weights stay in L1 across groups.
template <int R>
VLM_TARGET_VNNI void RowTileVnni(const QuantizedX& x, const QuantizedWeight& w, int64_t r0,
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

constexpr int kRowTile = 4;
constexpr int64_t kRowsPerTask = 64;

VLM_TARGET_VNNI void RowsVnni(const QuantizedX& x, const QuantizedWeight& w, const Output& out,
                              int64_t r0, int64_t r1) {
  int64_t r = r0;
  if (x.batch == 1) {
    for (; r < r1; ++r) RowSequentialVnni<1>(x, w, r, out);
  } else if (x.batch == 2) {
    for (; r < r1; ++r) RowSequentialVnni<2>(x, w, r, out);
  }
  for (; r + kRowTile <= r1; r += kRowTile) RowTileVnni<kRowTile>(x, w, r, out);
  for (; r < r1; ++r) RowTileVnni<1>(x, w, r, out);
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
