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
constexpr int kRowTile = 4;

// x quantized: xq [B][k_padded] int8, d [B][k_padded / 32] f32, and for the
// VNNI path, per 64-wide chunk and VPDPBUSD lane (4 consecutive k): the scales
// [B][k_padded/64][16] (lanes 0-7 block 2c, lanes 8-15 block 2c+1) and the
// start values -128·Σ of the lane's 4 xq [B][k_padded/64][16], which cancel
// the +128 of the stored weights.
struct QuantizedX {
  int64_t batch = 0, k_padded = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> d_lanes;
  std::vector<int32_t> bias_lanes;
};

void QuantizeX(const at::Tensor& x, int64_t k_padded, QuantizedX* out) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t batch = xf.size(0), k = xf.size(1);
  const int64_t blocks = k_padded / kBlock;
  out->batch = batch;
  out->k_padded = k_padded;
  out->q.assign(batch * k_padded, 0);
  out->d.assign(batch * blocks, 0.0f);
  out->d_lanes.resize(batch * (k_padded / 64) * 16);
  out->bias_lanes.resize(batch * (k_padded / 64) * 16);
  const float* src = xf.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t k0 = blk * kBlock, k1 = std::min(k, k0 + kBlock);
      float amax = 0;
      for (int64_t i = k0; i < k1; ++i) amax = std::max(amax, std::fabs(src[b * k + i]));
      const float d = amax / 127.0f;
      const float inv = d > 0 ? 1.0f / d : 0.0f;
      for (int64_t i = k0; i < k1; ++i) {
        out->q[b * k_padded + i] =
            static_cast<int8_t>(std::clamp(std::nearbyint(src[b * k + i] * inv), -127.0f, 127.0f));
      }
      out->d[b * blocks + blk] = d;
    }
    for (int64_t c = 0; c < k_padded / 64; ++c) {
      for (int l = 0; l < 16; ++l) {
        out->d_lanes[(b * (k_padded / 64) + c) * 16 + l] = out->d[b * blocks + 2 * c + l / 8];
        int32_t sum = 0;
        for (int j = 0; j < 4; ++j) sum += out->q[b * k_padded + c * 64 + 4 * l + j];
        out->bias_lanes[(b * (k_padded / 64) + c) * 16 + l] = -128 * sum;
      }
    }
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
#define VLM_TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

template <int R, int NB>
VLM_TARGET_VNNI inline void TileVnni(const QuantizedX& x, int64_t b0, const QuantizedWeight& w,
                                     int64_t r0, const Output& out) {
  __m512 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  const int64_t kp = x.k_padded, chunks = kp / 64;
  const uint8_t* wrow[R];
  for (int r = 0; r < R; ++r) wrow[r] = w.row(r0 + r);
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i xv[NB], bias[NB];
    __m512 dv[NB];
    for (int b = 0; b < NB; ++b) {
      xv[b] = _mm512_loadu_si512(x.q.data() + (b0 + b) * kp + c * 64);
      dv[b] = _mm512_loadu_ps(x.d_lanes.data() + ((b0 + b) * chunks + c) * 16);
      bias[b] = _mm512_loadu_si512(x.bias_lanes.data() + ((b0 + b) * chunks + c) * 16);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(wrow[r] + c * 64 + R * kp), _MM_HINT_T0);
      const __m512i wv = _mm512_load_si512(wrow[r] + c * 64);
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) {
        const __m512i dot = _mm512_dpbusd_epi32(bias[b], wv, xv[b]);  // exact Σ q·xq per lane
        acc[b][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dv[b], acc[b][r]);
      }
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r)
      out.Store(b0 + b, r0 + r, w.scales()[r0 + r] * _mm512_reduce_add_ps(acc[b][r]));
}

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

VLM_TARGET_VNNI void RowsVnni(const QuantizedX& x, const QuantizedWeight& w, const Output& out,
                              int64_t r0, int64_t r1) {
  int64_t r = r0;
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
    QuantizeX(x, w.k_padded(), &qx);
    Output out{y->data_ptr(), y->scalar_type() == at::kBFloat16, n};
    const int64_t tiles = (n + kRowTile - 1) / kRowTile;
    ParallelFor(tiles, options.threads, 16, [&qx, &w, &out, n, path](int64_t t0, int64_t t1) {
      const int64_t r0 = t0 * kRowTile, r1 = std::min(n, t1 * kRowTile);
      if (path == GemvInt8Path::kAvx512Vnni) RowsVnni(qx, w, out, r0, r1);
      else RowsScalar(qx, w, out, r0, r1);
    });
    return absl::OkStatus();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("int8 gemv: out of memory");
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("int8 gemv: ", e.what_without_backtrace()));
  }
}

}  // namespace vlm::kernels
