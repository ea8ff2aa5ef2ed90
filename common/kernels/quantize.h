// Symmetric per-output-channel int8 weights: w[n, k] ≈ scale[n]·q[n, k] with
// q in [-127, 127] and scale[n] = max_k |w[n, k]| / 127 (f32; 0 for a zero
// row). Quantized once at load from bf16/f32 checkpoint weights; halves the
// bytes a decode step streams compared with bf16.
//
// Layout: row-major [N, k_padded] bytes holding q + 128 (unsigned: the VNNI
// GEMV feeds them to VPDPBUSD's unsigned operand and corrects with the
// activations' sums), k_padded = round_up(K, 64), padding q = 0, 64-byte
// aligned rows. Immutable after creation; copies share the data; thread-safe
// to read.
#pragma once

#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace vlm::kernels {

class QuantizedWeight {
 public:
  QuantizedWeight() = default;
  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  int64_t k_padded() const { return k_padded_; }
  // Row i as stored: q + 128 per element.
  const uint8_t* row(int64_t i) const { return data_.get() + i * k_padded_; }
  // q[r, i] in [-127, 127].
  int value(int64_t r, int64_t i) const { return int{row(r)[i]} - 128; }
  const float* scales() const { return scales_.get(); }
  bool empty() const { return data_ == nullptr; }
  // Bytes held: int8 rows (with padding) + f32 scales.
  uint64_t bytes() const {
    return static_cast<uint64_t>(n_) * k_padded_ + static_cast<uint64_t>(n_) * sizeof(float);
  }

 private:
  friend absl::StatusOr<QuantizedWeight> QuantizeInt8(const at::Tensor& w);
  std::shared_ptr<uint8_t> data_;
  std::shared_ptr<float> scales_;
  int64_t n_ = 0, k_ = 0, k_padded_ = 0;
};

// w: [N, K] bf16 or f32 CPU tensor, any strides. INVALID_ARGUMENT for other
// shapes/dtypes or non-finite values (named by row).
absl::StatusOr<QuantizedWeight> QuantizeInt8(const at::Tensor& w);

// scale[n]·q[n, k] as an f32 [N, K] tensor (tests and references).
at::Tensor DequantizeInt8(const QuantizedWeight& w);

}  // namespace vlm::kernels
