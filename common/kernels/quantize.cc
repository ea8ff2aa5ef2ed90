#include "common/kernels/quantize.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <new>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/kernels/thread_pool.h"

namespace vlm::kernels {

absl::StatusOr<QuantizedWeight> QuantizeInt8(const at::Tensor& w) {
  if (!w.defined() || w.device().type() != at::kCPU || w.dim() != 2 ||
      (w.scalar_type() != at::kBFloat16 && w.scalar_type() != at::kFloat)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quantize: weight must be a 2-D bf16 or f32 CPU tensor [N, K]; got ",
        w.defined() ? w.toString() + " " + std::to_string(w.dim()) + "-D" : std::string("undefined")));
  }
  try {
    const at::Tensor wf = w.to(at::kFloat).contiguous();
    QuantizedWeight q;
    q.n_ = wf.size(0);
    q.k_ = wf.size(1);
    q.k_padded_ = (q.k_ + 63) / 64 * 64;
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(1, q.n_ * q.k_padded_));
    q.data_ = std::shared_ptr<uint8_t>(
        static_cast<uint8_t*>(::operator new(bytes, std::align_val_t(64))),
        [](uint8_t* p) { ::operator delete(p, std::align_val_t(64)); });
    q.scales_ = std::shared_ptr<float>(new float[std::max<int64_t>(1, q.n_)],
                                       std::default_delete<float[]>());
    const float* src = wf.data_ptr<float>();
    std::atomic<int64_t> bad_row{-1};
    ParallelFor(q.n_, 0, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float* row = src + r * q.k_;
        float amax = 0;
        bool finite = true;
        for (int64_t i = 0; i < q.k_; ++i) {
          finite &= std::isfinite(row[i]);
          amax = std::max(amax, std::fabs(row[i]));
        }
        if (!finite) bad_row.store(r);
        const float scale = amax / 127.0f;
        const float inv = scale > 0 ? 1.0f / scale : 0.0f;
        uint8_t* dst = q.data_.get() + r * q.k_padded_;
        for (int64_t i = 0; i < q.k_; ++i) {
          const float v = std::clamp(std::nearbyint(row[i] * inv), -127.0f, 127.0f);
          dst[i] = static_cast<uint8_t>(static_cast<int>(v) + 128);
        }
        std::memset(dst + q.k_, 128, q.k_padded_ - q.k_);
        q.scales_.get()[r] = scale;
      }
    });
    if (bad_row.load() >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("quantize: row ", bad_row.load(), " has a non-finite value"));
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
    for (int64_t i = 0; i < w.k(); ++i) dst[r * w.k() + i] = w.scales()[r] * w.value(r, i);
  }
  return out;
}

}  // namespace vlm::kernels
