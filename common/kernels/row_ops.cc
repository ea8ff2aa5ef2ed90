#include "common/kernels/row_ops.h"

#include <cmath>
#include <functional>
#include <cstring>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include "common/cpu_features.h"
#include "common/kernels/simd_math.h"
#include "common/kernels/gemm_f32.h"
#include "common/kernels/thread_pool.h"
#include "common/kernels/simd.h"

namespace vlm {
namespace {

using Bf16 = c10::BFloat16;

bool UseAvx512() {
  static const bool avx512 = GetCpuFeatures().fast_bf16_matmul();  // F, BW, VL, DQ
  return avx512;
}

// Rows per parallel task (any split gives the same results: each row is
// computed by exactly one thread): about 256K elements, so a decode pass's
// few rows run inline instead of opening an OpenMP region whose barrier
// waits out a descheduled thread on a busy machine.
int64_t Grain(int64_t n) { return std::max<int64_t>(1, 262144 / std::max<int64_t>(n, 1)); }

// fn over [0, rows) on the kernels' pool (the projections' threads: no second
// set of OpenMP threads competing for the cores between GEMMs), in ranges of at
// least min_rows rows: inline when rows <= min_rows.
void ParallelRows(int64_t rows, int64_t min_rows, const std::function<void(int64_t, int64_t)>& fn) {
  const int threads = kernels::DefaultThreads();
  const int64_t range = std::max(min_rows, (rows + threads - 1) / threads);
  kernels::ParallelFor(rows, threads, range, fn);
}

void CheckRows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              what, ": a contiguous [R, n] float32 or bfloat16 tensor expected, got ",
              x.toString(), " ", x.sizes());
}

using kernels::simd::ToF32;
// Rounds through T (identity for float, round-to-nearest-even for bf16).
template <typename T>
inline float Round(float v) {
  return static_cast<float>(T(v));
}

// ---------------------------------------------------------------------------
// AVX-512F kernels. Every element, tail included, goes through the same
// vector code (masked loads/stores), so its value never depends on its lane.

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

using kernels::simd::Load16;
using kernels::simd::Mask16;
using kernels::simd::Store16;

VLM_TARGET_AVX512 inline __m512 RoundTo(float*, __m512 v) { return v; }
VLM_TARGET_AVX512 inline __m512 RoundTo(Bf16*, __m512 v) {
  return kernels::simd::RoundBf16(v);
}

template <typename T>
VLM_TARGET_AVX512 void RmsNormRowAvx512(const T* x, const T* w, int64_t n, float eps, T* out) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 16) {
    const __m512 v = Load16(x + k, Mask16(n - k));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float mean = _mm512_reduce_add_ps(acc) / static_cast<float>(n);
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 m = Mask16(n - k);
    const __m512 y = RoundTo(static_cast<T*>(nullptr), _mm512_mul_ps(Load16(x + k, m), inv));
    Store16(out + k, _mm512_mul_ps(Load16(w + k, m), y), m);
  }
  _mm256_zeroupper();
}

template <typename T>
VLM_TARGET_AVX512 void AddRowAvx512(T* x, const T* y, int64_t n) {
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 m = Mask16(n - k);
    Store16(x + k, _mm512_add_ps(Load16(x + k, m), Load16(y + k, m)), m);
  }
  _mm256_zeroupper();
}

template <typename T>
VLM_TARGET_AVX512 void SiluMulRowAvx512(const T* gate, const T* up, int64_t n, T* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 m = Mask16(n - k);
    const __m512 g = Load16(gate + k, m);
    const __m512 e = kernels::internal::Exp(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = RoundTo(static_cast<T*>(nullptr), _mm512_div_ps(g, _mm512_add_ps(one, e)));
    Store16(out + k, _mm512_mul_ps(s, Load16(up + k, m)), m);
  }
  _mm256_zeroupper();
}
#pragma GCC diagnostic pop

// ---------------------------------------------------------------------------
// Portable rows (sequential sums).

template <typename T>
void RmsNormRowScalar(const T* x, const T* w, int64_t n, float eps, T* out) {
  float ss = 0;
  for (int64_t k = 0; k < n; ++k) ss += ToF32(x[k]) * ToF32(x[k]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t k = 0; k < n; ++k) out[k] = T(ToF32(w[k]) * Round<T>(ToF32(x[k]) * inv));
}

template <typename T>
void AddRowScalar(T* x, const T* y, int64_t n) {
  for (int64_t k = 0; k < n; ++k) x[k] = T(ToF32(x[k]) + ToF32(y[k]));
}

template <typename T>
void SiluMulRowScalar(const T* gate, const T* up, int64_t n, T* out) {
  for (int64_t k = 0; k < n; ++k) {
    const float g = ToF32(gate[k]);
    out[k] = T(Round<T>(g / (1.0f + std::exp(-g))) * ToF32(up[k]));
  }
}

template <typename T>
void RmsNormRows(const at::Tensor& x, const at::Tensor& weight, float eps, const at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const bool avx = UseAvx512();
  ParallelRows(rows, Grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (avx) {
        RmsNormRowAvx512(xp + r * n, wp, n, eps, op + r * n);
      } else {
        RmsNormRowScalar(xp + r * n, wp, n, eps, op + r * n);
      }
    }
  });
}

template <typename T>
void AddRows(const at::Tensor& x, const at::Tensor& y) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* yp = y.data_ptr<T>();
  const bool avx = UseAvx512();
  ParallelRows(rows, Grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (avx) {
        AddRowAvx512(xp + r * n, yp + r * n, n);
      } else {
        AddRowScalar(xp + r * n, yp + r * n, n);
      }
    }
  });
}

template <typename T>
void SiluMulRows(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out) {
  const int64_t rows = gate.size(0), n = gate.size(1);
  const T* gp = gate.data_ptr<T>();
  const T* up_ = up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const bool avx = UseAvx512();
  ParallelRows(rows, Grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (avx) {
        SiluMulRowAvx512(gp + r * n, up_ + r * n, n, op + r * n);
      } else {
        SiluMulRowScalar(gp + r * n, up_ + r * n, n, op + r * n);
      }
    }
  });
}

template <typename T>
void RotaryRows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  T* xp = x.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  ParallelRows(rows, Grain(heads * d), [&](int64_t begin, int64_t end) {
    std::vector<float> f(d);
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * d;
      const float* s = sp + r * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = xp + (r * heads + h) * d;
        for (int64_t j = 0; j < d; ++j) f[j] = ToF32(row[j]);
        for (int64_t j = 0; j < half; ++j) row[j] = T(f[j] * c[j] - f[j + half] * s[j]);
        for (int64_t j = half; j < d; ++j) row[j] = T(f[j] * c[j] + f[j - half] * s[j]);
      }
    }
  });
}

}  // namespace

at::Tensor RowRmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  CheckRows(x, "RowRmsNorm x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "RowRmsNorm: weight must be a contiguous [", x.size(1), "] ", x.scalar_type(),
              " tensor, got ", weight.toString(), " ", weight.sizes());
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    RmsNormRows<float>(x, weight, static_cast<float>(eps), out);
  } else {
    RmsNormRows<Bf16>(x, weight, static_cast<float>(eps), out);
  }
  return out;
}

void RowAddInPlace(const at::Tensor& x, const at::Tensor& y) {
  CheckRows(x, "RowAddInPlace x");
  CheckRows(y, "RowAddInPlace y");
  TORCH_CHECK(x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type(),
              "RowAddInPlace: shapes/dtypes differ: ", x.sizes(), " ", y.sizes());
  if (x.scalar_type() == at::kFloat) {
    AddRows<float>(x, y);
  } else {
    AddRows<Bf16>(x, y);
  }
}

at::Tensor RowSiluMul(const at::Tensor& gate, const at::Tensor& up) {
  CheckRows(gate, "RowSiluMul gate");
  CheckRows(up, "RowSiluMul up");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
              "RowSiluMul: shapes/dtypes differ: ", gate.sizes(), " ", up.sizes());
  at::Tensor out = at::empty_like(gate);
  if (gate.scalar_type() == at::kFloat) {
    SiluMulRows<float>(gate, up, out);
  } else {
    SiluMulRows<Bf16>(gate, up, out);
  }
  return out;
}

void RowCosSin(const at::Tensor& positions, const at::Tensor& inv_freq, const int* axes,
               at::Tensor* cos, at::Tensor* sin) {
  TORCH_CHECK(positions.dim() == 2 && positions.size(0) == 3 &&
                  positions.scalar_type() == at::kLong,
              "RowCosSin: positions must be [3, R] int64, got ", positions.sizes());
  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.scalar_type() == at::kFloat &&
                  inv_freq.is_contiguous(),
              "RowCosSin: inv_freq must be a contiguous [D/2] float32 tensor");
  const int64_t rows = positions.size(1), half = inv_freq.size(0), d = 2 * half;
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* inv = inv_freq.data_ptr<float>();
  *cos = at::empty({rows, d}, at::TensorOptions().dtype(at::kFloat));
  *sin = at::empty({rows, d}, at::TensorOptions().dtype(at::kFloat));
  float* cp = cos->data_ptr<float>();
  float* sp = sin->data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < half; ++j) {
      // One float32 product as the reference; cos/sin correctly rounded.
      const float f = static_cast<float>(pp[axes[j] * rows + r]) * inv[j];
      const float c = static_cast<float>(std::cos(static_cast<double>(f)));
      const float s = static_cast<float>(std::sin(static_cast<double>(f)));
      cp[r * d + j] = cp[r * d + half + j] = c;
      sp[r * d + j] = sp[r * d + half + j] = s;
    }
  }
}

int64_t RowLinearMinRows(const at::Tensor& w) {
  constexpr int64_t kMinRows = 8, kMinProduct = int64_t{1} << 18;
  const int64_t per_row = std::max<int64_t>(1, w.size(0) * w.size(1));
  return std::max(kMinRows, (kMinProduct + per_row - 1) / per_row);
}

at::Tensor RowLinear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) &&
                  x.scalar_type() == w.scalar_type(),
              "RowLinear: x [N, in] and w [out, in] of one dtype expected, got ", x.sizes(), " ",
              x.scalar_type(), " and ", w.sizes(), " ", w.scalar_type());
  if (x.scalar_type() == at::kFloat) {
    absl::StatusOr<at::Tensor> y = kernels::GemmF32(x, w);
    TORCH_CHECK(y.ok(), "RowLinear: ", y.status().ToString());
    return *std::move(y);
  }
  const int64_t n = x.size(0), min_rows = RowLinearMinRows(w);
  if (n >= min_rows) return at::linear(x.contiguous(), w);
  at::Tensor padded = at::zeros({min_rows, x.size(1)}, x.options());
  padded.narrow(0, 0, n).copy_(x);
  return at::linear(padded, w).narrow(0, 0, n);
}

void RowRotaryInPlace(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.size(2) % 2 == 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "RowRotaryInPlace: x must be a contiguous [R, H, D] float32/bf16 tensor, got ",
              x.sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                  sin.sizes() == cos.sizes() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "RowRotaryInPlace: cos/sin must be contiguous [", x.size(0), ", ", x.size(2),
              "] float32, got ", cos.sizes());
  if (x.scalar_type() == at::kFloat) {
    RotaryRows<float>(x, cos, sin);
  } else {
    RotaryRows<Bf16>(x, cos, sin);
  }
}

}  // namespace vlm
