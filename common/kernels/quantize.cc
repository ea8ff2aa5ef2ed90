#include "common/kernels/quantize.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/kernels/thread_pool.h"

namespace vlm::kernels {
namespace {

float ToF32(const float* p, int64_t i) { return p[i]; }
float ToF32(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

float HalfToFloat(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One row (quantize.h): returns false if it holds a non-finite value.
// amax per group, the row's amax, ratio = f16(group amax / row amax),
// scale = row_scale·ratio, q = clamp(round-to-nearest-even(w·(1/scale)), ±127)
// stored at StoredIndex; padding 0.
template <typename T>
bool QuantizeRow(const T* row, int64_t k, int64_t kp, int8_t* dst, float* row_scale,
                 uint16_t* ratios) {
  const int64_t groups = kp / kInt8Group;
  float amax_row = 0;
  bool finite = true;
  for (int64_t i = 0; i < k; ++i) {
    const float v = ToF32(row, i);
    finite &= std::isfinite(v);
    amax_row = std::max(amax_row, std::fabs(v));
  }
  if (!finite) return false;
  float buf[kInt8Group];
  *row_scale = amax_row / 127.0f;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t i0 = g * kInt8Group, i1 = std::min(k, i0 + kInt8Group);
    float amax = 0;
    for (int64_t i = i0; i < i1; ++i) {
      buf[i - i0] = ToF32(row, i);
      amax = std::max(amax, std::fabs(buf[i - i0]));
    }
    const uint16_t ratio =
        amax_row > 0 ? c10::Half(amax / amax_row).x : uint16_t{0};
    ratios[g] = ratio;
    const float scale = *row_scale * HalfToFloat(ratio);
    const float inv = scale > 0 ? 1.0f / scale : 0.0f;
    for (int64_t i = i0; i < i0 + kInt8Group; ++i) {
      const float v = i < i1 ? std::clamp(std::nearbyint(buf[i - i0] * inv), -127.0f, 127.0f) : 0;
      dst[StoredIndex(i, kp)] = static_cast<int8_t>(v);
    }
  }
  return true;
}

template <typename T>
int64_t QuantizeRows(const T* src, int64_t ld, QuantizedWeight* q, int8_t* data, float* scales,
                     uint16_t* ratios) {
  const int64_t n = q->n(), k = q->k(), kp = q->k_padded(), groups = q->groups();
  std::atomic<int64_t> bad_row{-1};
  ParallelFor(n, 0, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (!QuantizeRow(src + r * ld, k, kp, data + r * kp, scales + r, ratios + r * groups)) {
        bad_row.store(r);
      }
    }
  });
  return bad_row.load();
}

}  // namespace

float QuantizedWeight::scale(int64_t r, int64_t g) const {
  return row_scales_.get()[r] * HalfToFloat(ratios_.get()[r * groups() + g]);
}

absl::StatusOr<QuantizedWeight> QuantizeInt8(const at::Tensor& w) {
  if (!w.defined() || w.device().type() != at::kCPU || w.dim() != 2 ||
      (w.scalar_type() != at::kBFloat16 && w.scalar_type() != at::kFloat)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quantize: weight must be a 2-D bf16 or f32 CPU tensor [N, K]; got ",
        w.defined() ? w.toString() + " " + std::to_string(w.dim()) + "-D" : std::string("undefined")));
  }
  try {
    // Rows are read in place when they have unit stride (no f32 copy of the
    // whole matrix: the LM head's would be 1.2 GB).
    const at::Tensor wc = (w.size(1) <= 1 || w.stride(1) == 1) ? w : w.contiguous();
    QuantizedWeight q;
    q.n_ = wc.size(0);
    q.k_ = wc.size(1);
    q.k_padded_ = (q.k_ + kInt8Group - 1) / kInt8Group * kInt8Group;
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(64, q.n_ * q.k_padded_));
    q.data_ = std::shared_ptr<int8_t>(
        static_cast<int8_t*>(::operator new(bytes, std::align_val_t(64))),
        [](int8_t* p) { ::operator delete(p, std::align_val_t(64)); });
    q.row_scales_ = std::shared_ptr<float>(new float[std::max<int64_t>(1, q.n_)],
                                           std::default_delete<float[]>());
    q.ratios_ = std::shared_ptr<uint16_t>(
        new uint16_t[std::max<int64_t>(1, q.n_ * q.groups())], std::default_delete<uint16_t[]>());
    const int64_t ld = q.n_ > 1 ? wc.stride(0) : q.k_;
    const int64_t bad_row =
        wc.scalar_type() == at::kBFloat16
            ? QuantizeRows(wc.data_ptr<c10::BFloat16>(), ld, &q, q.data_.get(),
                           q.row_scales_.get(), q.ratios_.get())
            : QuantizeRows(wc.data_ptr<float>(), ld, &q, q.data_.get(), q.row_scales_.get(),
                           q.ratios_.get());
    if (bad_row >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("quantize: row ", bad_row, " has a non-finite value"));
    }
    return q;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("quantize: out of memory");
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("quantize: ", e.what_without_backtrace()));
  }
}

at::Tensor DequantizeInt8(const QuantizedWeight& w) {
  at::Tensor out = at::empty({w.n(), w.k()}, at::kFloat);
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < w.n(); ++r) {
    for (int64_t i = 0; i < w.k(); ++i) {
      dst[r * w.k() + i] = w.scale(r, i / kInt8Group) * static_cast<float>(w.value(r, i));
    }
  }
  return out;
}

}  // namespace vlm::kernels
