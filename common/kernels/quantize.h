// Symmetric int8 weights with one scale per group of 32 along K (like
// llama.cpp's Q8_0): w[n, k] ≈ scale(n, g)·q[n, k], g = k / 32, q in
// [-127, 127]. Quantized once at load from bf16/f32 checkpoint weights; halves
// the bytes a decode step streams compared with bf16.
//
// Why groups: on the synthetic 2B checkpoint one scale per output channel
// alone (exact activations) gives logits cosine 0.9988 against bf16, groups of
// 128 / 64 / 32 give 0.9992 / 0.9992 / 0.9993 (scripts/bench/int8_fidelity.py).
//
// Scales: scale(n, g) = row_scale[n]·ratio[n, g], row_scale = max_k |w[n, :]| / 127
// (f32), ratio = f16(max |w[n, group g]| / max |w[n, :]|) in [0, 1] (f16: 2 bytes
// per 32 weights; relative to the row so small rows never reach f16's
// subnormals). q = clamp(round-to-nearest-even(w·(1/scale)), ±127), 0 where the
// group is all zero.
//
// Layout (the order kernels::GemvInt8 reads): row-major [N, k_padded] bytes
// holding q + 128 (unsigned: VPDPBUSD's unsigned operand; the GEMV corrects
// with the activations' sums), k_padded = round_up(K, 32), padding q = 0, rows
// 32-byte aligned. Within a row, each full block of 512 (16 groups) is
// interleaved so that the 16 lanes of a VPDPBUSD each sum one group: the
// element k = 512·s + 32·l + 4·j + e (group l of the block, quad j, e in 0..3)
// is stored at 512·s + 64·j + 4·l + e (see StoredIndex). Groups after the last
// full block stay in natural order.
// Immutable after creation; copies share the data; thread-safe to read.
#pragma once

#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace vlm::kernels {

inline constexpr int64_t kInt8Group = 32;                    // elements per scale
inline constexpr int64_t kInt8Block = 16 * kInt8Group;       // interleaved block of 16 groups

// Where element k of a row (natural order) is stored, for a row of k_padded.
inline int64_t StoredIndex(int64_t k, int64_t k_padded) {
  const int64_t full = k_padded / kInt8Block * kInt8Block;
  if (k >= full) return k;
  const int64_t s = k / kInt8Block, l = (k % kInt8Block) / kInt8Group, w = k % kInt8Group;
  return s * kInt8Block + (w / 4) * 64 + 4 * l + (w % 4);
}

class QuantizedWeight {
 public:
  QuantizedWeight() = default;
  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  int64_t k_padded() const { return k_padded_; }
  int64_t groups() const { return k_padded_ / kInt8Group; }
  // Row i as stored (layout above): q + 128.
  const uint8_t* row(int64_t i) const { return data_.get() + i * k_padded_; }
  // q[r, i] in [-127, 127], i in natural order.
  int value(int64_t r, int64_t i) const {
    return int{row(r)[StoredIndex(i, k_padded_)]} - 128;
  }
  const float* row_scales() const { return row_scales_.get(); }  // [N]
  // f16 bit patterns [N, groups()]: ratio of group g of row r at r·groups() + g.
  const uint16_t* ratios() const { return ratios_.get(); }
  // scale(r, g) = row_scales()[r]·ratio(r, g), in f32.
  float scale(int64_t r, int64_t g) const;
  bool empty() const { return data_ == nullptr; }
  // The three arrays as stored (rows, f32 row scales, f16 group ratios), for
  // writing them to a file; FromParts makes a weight over such arrays held
  // elsewhere (a read-only file mapping that `owner` keeps alive; `data` 64-byte
  // aligned). Never written through.
  uint64_t data_bytes() const { return static_cast<uint64_t>(n_) * k_padded_; }
  uint64_t row_scale_bytes() const { return static_cast<uint64_t>(n_) * sizeof(float); }
  uint64_t ratio_bytes() const { return static_cast<uint64_t>(n_) * groups() * sizeof(uint16_t); }
  static QuantizedWeight FromParts(int64_t n, int64_t k, const uint8_t* data,
                                   const float* row_scales, const uint16_t* ratios,
                                   std::shared_ptr<const void> owner);
  // Bytes held: int8 rows (with padding) + f32 row scales + f16 group ratios.
  uint64_t bytes() const {
    return static_cast<uint64_t>(n_) * k_padded_ + static_cast<uint64_t>(n_) * sizeof(float) +
           static_cast<uint64_t>(n_) * groups() * sizeof(uint16_t);
  }

 private:
  friend absl::StatusOr<QuantizedWeight> QuantizeInt8(const at::Tensor& w);
  std::shared_ptr<uint8_t> data_;
  std::shared_ptr<float> row_scales_;
  std::shared_ptr<uint16_t> ratios_;
  int64_t n_ = 0, k_ = 0, k_padded_ = 0;
};

// w: [N, K] bf16 or f32 CPU tensor, any strides. INVALID_ARGUMENT for other
// shapes/dtypes or non-finite values (named by row).
absl::StatusOr<QuantizedWeight> QuantizeInt8(const at::Tensor& w);

// scale(n, k / 32)·q[n, k] as an f32 [N, K] tensor (tests and references).
at::Tensor DequantizeInt8(const QuantizedWeight& w);

}  // namespace vlm::kernels
