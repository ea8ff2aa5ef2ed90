#include "common/kernels/quantize_int4.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <new>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "absl/strings/str_cat.h"
#include "common/kernels/thread_pool.h"

namespace vlm::kernels {
namespace {

float ToF32(const float* p, int64_t i) { return p[i]; }
float ToF32(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

float HalfToFloat(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Round to nearest, ties to even, as std::nearbyint in the default mode but
// without a libm call per element (baseline x86-64 has no ROUNDSS): adding
// 1.5·2^23 leaves no fraction bits, so the addition rounds; |v| ≥ 2^22 is
// already an integer.
inline float RoundEven(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5·2^23
  if (!(std::fabs(v) < 4194304.0f)) return v;
  const float m = std::copysign(kMagic, v);  // branch-free: the sign is random
  return (v + m) - m;
}

// One row (quantize_int4.h): u in natural order into `u` [k_padded], ratios
// and zeros [groups], *row_scale. False if the row holds a non-finite value.
template <typename T>
bool QuantizeRow(const T* row, int64_t k, int64_t kp, uint8_t* u, float* row_scale,
                 uint16_t* ratios, uint8_t* zeros, std::vector<float>& steps) {
  const int64_t groups = kp / kInt4Group;
  steps.resize(groups);
  float row_step = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t i0 = g * kInt4Group, i1 = std::min(k, i0 + kInt4Group);
    float lo = 0, hi = 0;
    for (int64_t i = i0; i < i1; ++i) {
      const float v = ToF32(row, i);
      if (!std::isfinite(v)) return false;
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    steps[g] = (hi - lo) / 15.0f;
    row_step = std::max(row_step, steps[g]);
  }
  *row_scale = row_step;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t i0 = g * kInt4Group, i1 = std::min(k, i0 + kInt4Group);
    const uint16_t ratio = row_step > 0 ? c10::Half(steps[g] / row_step).x : uint16_t{0};
    ratios[g] = ratio;
    const float scale = row_step * HalfToFloat(ratio);
    const float inv = scale > 0 ? 1.0f / scale : 0.0f;
    float lo = 0;
    for (int64_t i = i0; i < i1; ++i) lo = std::min(lo, ToF32(row, i));
    const int z = static_cast<int>(std::clamp(RoundEven(-lo * inv), 0.0f, 15.0f));
    zeros[g] = static_cast<uint8_t>(z);
    for (int64_t i = i0; i < i0 + kInt4Group; ++i) {
      const float q = i < i1 ? RoundEven(ToF32(row, i) * inv) + static_cast<float>(z)
                             : static_cast<float>(z);
      u[i] = static_cast<uint8_t>(std::clamp(q, 0.0f, 15.0f));
    }
  }
  return true;
}

// Natural-order u [k_padded] -> the row's packed bytes (layout in the header;
// Int4StoredPosition element by element, unrolled).
void PackRow(const uint8_t* u, int64_t kp, uint8_t* dst) {
  const int64_t full = kp / kInt4Block * kInt4Block;
  for (int64_t s = 0; s < full; s += kInt4Block) {
    uint8_t* block = dst + s / 2;
    for (int l = 0; l < 16; ++l) {
      const uint8_t* g = u + s + kInt4Group * l;
      for (int c = 0; c < 4; ++c) {
        for (int e = 0; e < 4; ++e) {
          block[64 * c + 4 * l + e] = static_cast<uint8_t>(g[8 * c + e] | g[8 * c + 4 + e] << 4);
        }
      }
    }
  }
  for (int64_t g0 = full; g0 < kp; g0 += kInt4Group) {
    uint8_t* out = dst + g0 / 2;
    for (int i = 0; i < 16; ++i) out[i] = static_cast<uint8_t>(u[g0 + i] | u[g0 + 16 + i] << 4);
  }
}

template <typename T>
int64_t QuantizeRows(const T* src, int64_t ld, int64_t n, int64_t k, int64_t kp, uint8_t* packed,
                     float* row_scales, uint16_t* ratios, uint8_t* zeros) {
  const int64_t groups = kp / kInt4Group;
  std::atomic<int64_t> bad_row{-1};
  ParallelFor(n, 0, 64, [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> u(kp);
    std::vector<float> steps;
    for (int64_t r = r0; r < r1; ++r) {
      if (!QuantizeRow(src + r * ld, k, kp, u.data(), row_scales + r, ratios + r * groups,
                       zeros + r * groups, steps)) {
        bad_row.store(r);
        continue;
      }
      PackRow(u.data(), kp, packed + r * (kp / 2));
    }
  });
  return bad_row.load();
}

template <typename T>
std::shared_ptr<T> Allocate(int64_t count) {
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(1, count)) * sizeof(T) + 63) / 64 * 64;
  return std::shared_ptr<T>(static_cast<T*>(::operator new(bytes, std::align_val_t(64))),
                            [](T* p) { ::operator delete(p, std::align_val_t(64)); });
}

}  // namespace

Int4Weight Int4Weight::View(int64_t n, int64_t k, const uint8_t* packed, const float* row_scales,
                            const uint16_t* ratios, const uint8_t* zeros,
                            std::shared_ptr<const void> keep_alive) {
  Int4Weight w;
  w.n_ = n;
  w.k_ = k;
  w.k_padded_ = (k + kInt4Group - 1) / kInt4Group * kInt4Group;
  // Aliasing constructors: each array shares ownership of keep_alive.
  w.packed_ = std::shared_ptr<const uint8_t>(keep_alive, packed);
  w.row_scales_ = std::shared_ptr<const float>(keep_alive, row_scales);
  w.ratios_ = std::shared_ptr<const uint16_t>(keep_alive, ratios);
  w.zeros_ = std::shared_ptr<const uint8_t>(std::move(keep_alive), zeros);
  return w;
}

float Int4Weight::scale(int64_t r, int64_t g) const {
  return row_scales_.get()[r] * HalfToFloat(ratios_.get()[r * groups() + g]);
}

absl::StatusOr<Int4Weight> QuantizeInt4(const at::Tensor& w) {
  if (!w.defined() || w.device().type() != at::kCPU || w.dim() != 2 ||
      (w.scalar_type() != at::kBFloat16 && w.scalar_type() != at::kFloat)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quantize int4: weight must be a 2-D bf16 or f32 CPU tensor [N, K]; got ",
        w.defined() ? w.toString() + " " + std::to_string(w.dim()) + "-D" : std::string("undefined")));
  }
  try {
    const at::Tensor wc = (w.size(1) <= 1 || w.stride(1) == 1) ? w : w.contiguous();
    Int4Weight q;
    q.n_ = wc.size(0);
    q.k_ = wc.size(1);
    q.k_padded_ = (q.k_ + kInt4Group - 1) / kInt4Group * kInt4Group;
    std::shared_ptr<uint8_t> packed = Allocate<uint8_t>(q.n_ * q.row_bytes());
    std::shared_ptr<float> row_scales = Allocate<float>(q.n_);
    std::shared_ptr<uint16_t> ratios = Allocate<uint16_t>(q.n_ * q.groups());
    std::shared_ptr<uint8_t> zeros = Allocate<uint8_t>(q.n_ * q.groups());
    const int64_t ld = q.n_ > 1 ? wc.stride(0) : q.k_;
    const int64_t bad_row =
        wc.scalar_type() == at::kBFloat16
            ? QuantizeRows(wc.data_ptr<c10::BFloat16>(), ld, q.n_, q.k_, q.k_padded_, packed.get(),
                           row_scales.get(), ratios.get(), zeros.get())
            : QuantizeRows(wc.data_ptr<float>(), ld, q.n_, q.k_, q.k_padded_, packed.get(),
                           row_scales.get(), ratios.get(), zeros.get());
    if (bad_row >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("quantize int4: row ", bad_row, " has a non-finite value"));
    }
    q.packed_ = std::move(packed);
    q.row_scales_ = std::move(row_scales);
    q.ratios_ = std::move(ratios);
    q.zeros_ = std::move(zeros);
    return q;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("quantize int4: out of memory");
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("quantize int4: ", e.what_without_backtrace()));
  }
}

at::Tensor DequantizeInt4(const Int4Weight& w) {
  at::Tensor out = at::empty({w.n(), w.k()}, at::kFloat);
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < w.n(); ++r) {
    for (int64_t i = 0; i < w.k(); ++i) {
      dst[r * w.k() + i] = w.scale(r, i / kInt4Group) * static_cast<float>(w.value(r, i));
    }
  }
  return out;
}

}  // namespace vlm::kernels
