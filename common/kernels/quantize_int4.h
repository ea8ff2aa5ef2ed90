// 4-bit weights with one scale and one zero point per group of 32 along K:
// w[n, k] ≈ scale(n, g)·(u[n, k] - z(n, g)), g = k / 32, u and z in [0, 15].
// Made once (at load or pack time) from bf16/f32 checkpoint weights; a decode
// step streams 0.59 bytes per weight (bf16: 2, int8: 1.09).
//
// Why this variant (scripts/bench/int4_fidelity.py, 1024 x 2048, y = W·x
// against the exact product with outlier activation channels): asymmetric
// groups of 32 give y cosine 0.99684 on gaussian weights and 0.99527 on
// heavy-tailed ones (Student t3 with outlier columns); symmetric q in
// [-8, 7] groups of 32: 0.99642 / 0.99220; symmetric [-7, 7]: 0.99544 /
// 0.98983; groups of 64: asymmetric 0.99606 / 0.99185, of 128: 0.99518 /
// 0.98478. The zero point costs 1 byte per 32 weights (+5.6% bytes) and
// buys the most on heavy tails, where symmetric ranges waste half their levels
// on the side without the outlier. f16 and bf16 scales measure the same
// (within 0.00003); f16 relative to an f32 row scale (as the int8 weights,
// quantize.h) keeps small rows away from f16's subnormals.
//
// Quantization per group: lo = min(min w, 0), hi = max(max w, 0),
// s = (hi - lo) / 15 (f32); row_scale = max over the row's groups of s;
// ratio = f16(s / row_scale) in [0, 1]; scale = row_scale·ratio (f32);
// z = clamp(round(-lo·(1/scale)), 0, 15), u = clamp(round(w·(1/scale)) + z, 0, 15)
// (round-to-nearest-even; the clamp sends NaN, from a scale so small that
// 1/scale overflows, to 0); an all-zero group has scale 0, z = 0, u = 0.
//
// Layout: three flat arrays, which a packed-weight file can store and map
// as they are (Int4Weight::View):
//   packed  [N, k_padded / 2] bytes, k_padded = round_up(K, 32), padding u = z.
//           Within a row each full block of 512 elements (16 groups, 256 bytes)
//           is four 64-byte chunks; in chunk c, byte 4·l + e holds in its low
//           nibble element 32·l + 8·c + e of the block (group l) and in its
//           high nibble element 32·l + 8·c + 4 + e: the 16 dword lanes of a
//           64-byte load each belong to one group, so a VPDPBUSD lane sums one
//           group, and low and high nibbles line up with the int8 weights'
//           stored order (quantize.h StoredIndex) of chunks 2c and 2c + 1.
//           Groups after the last full block: 16 bytes each, byte i holding
//           element i of the group (low nibble) and element i + 16 (high).
//   scales  row_scales [N] f32, then ratios [N, groups] f16 bit patterns.
//   zeros   [N, groups] bytes, z in [0, 15].
// Immutable after creation; copies share the data; thread-safe to read.
#pragma once

#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace vlm::kernels {

inline constexpr int64_t kInt4Group = 32;                 // elements per scale and zero point
inline constexpr int64_t kInt4Block = 16 * kInt4Group;    // 512: one group per dword lane

// Where element k (natural order) of a row of k_padded elements is stored:
// the byte offset in the row's packed bytes and whether it is the high nibble.
inline void Int4StoredPosition(int64_t k, int64_t k_padded, int64_t* byte, bool* high) {
  const int64_t full = k_padded / kInt4Block * kInt4Block;
  if (k >= full) {
    const int64_t g = (k - full) / kInt4Group, i = (k - full) % kInt4Group;
    *byte = full / 2 + g * (kInt4Group / 2) + i % 16;
    *high = i >= 16;
    return;
  }
  const int64_t s = k / kInt4Block, l = (k % kInt4Block) / kInt4Group, w = k % kInt4Group;
  const int64_t quad = w / 4;  // 0..7: chunk quad / 2, nibble quad % 2
  *byte = s * (kInt4Block / 2) + (quad / 2) * 64 + 4 * l + w % 4;
  *high = quad % 2 == 1;
}

// How a row is quantized: every path gives the same bytes (the f32 steps
// above, in the same order, on every path).
enum class QuantizeInt4Path { kAvx512, kAvx2, kScalar };

class Int4Weight {
 public:
  Int4Weight() = default;

  // A weight over arrays it does not own (a mapped packed-weight file): the
  // layout above, `packed` 64-byte aligned for the fastest loads (any
  // alignment works). `keep_alive` holds whatever owns the memory (the
  // mapping) for as long as any copy of the weight lives. No check of the
  // values: the file's checksum vouches for them.
  static Int4Weight View(int64_t n, int64_t k, const uint8_t* packed, const float* row_scales,
                         const uint16_t* ratios, const uint8_t* zeros,
                         std::shared_ptr<const void> keep_alive);

  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  int64_t k_padded() const { return k_padded_; }
  int64_t groups() const { return k_padded_ / kInt4Group; }
  int64_t row_bytes() const { return k_padded_ / 2; }
  bool empty() const { return packed_ == nullptr; }

  const uint8_t* packed() const { return packed_.get(); }       // [N, row_bytes()]
  const uint8_t* row(int64_t i) const { return packed_.get() + i * row_bytes(); }
  const float* row_scales() const { return row_scales_.get(); }  // [N]
  const uint16_t* ratios() const { return ratios_.get(); }       // [N, groups()] f16 bits
  const uint8_t* zeros() const { return zeros_.get(); }          // [N, groups()]

  // Sizes of the arrays, for a file that stores them.
  uint64_t packed_bytes() const { return static_cast<uint64_t>(n_) * row_bytes(); }
  uint64_t row_scale_bytes() const { return static_cast<uint64_t>(n_) * sizeof(float); }
  uint64_t ratio_bytes() const { return static_cast<uint64_t>(n_) * groups() * sizeof(uint16_t); }
  uint64_t zero_bytes() const { return static_cast<uint64_t>(n_) * groups(); }
  // Everything a product reads once: what a decode step streams.
  uint64_t bytes() const { return packed_bytes() + row_scale_bytes() + ratio_bytes() + zero_bytes(); }

  // u[r, i] in [0, 15], i in natural order (i < k_padded).
  int stored(int64_t r, int64_t i) const {
    int64_t byte = 0;
    bool high = false;
    Int4StoredPosition(i, k_padded_, &byte, &high);
    const uint8_t b = row(r)[byte];
    return high ? b >> 4 : b & 15;
  }
  int zero(int64_t r, int64_t g) const { return zeros_.get()[r * groups() + g]; }
  // u - z in [-15, 15].
  int value(int64_t r, int64_t i) const { return stored(r, i) - zero(r, i / kInt4Group); }
  // scale(r, g) = row_scales()[r]·ratio(r, g), in f32.
  float scale(int64_t r, int64_t g) const;

 private:
  friend absl::StatusOr<Int4Weight> QuantizeInt4(const at::Tensor& w, QuantizeInt4Path path,
                                                 int threads);
  std::shared_ptr<const uint8_t> packed_;
  std::shared_ptr<const float> row_scales_;
  std::shared_ptr<const uint16_t> ratios_;
  std::shared_ptr<const uint8_t> zeros_;
  int64_t n_ = 0, k_ = 0, k_padded_ = 0;
};

const char* QuantizeInt4PathName(QuantizeInt4Path path);
// Whether the CPU (capped by VLM_ISA, cpu_features.h) runs `path`.
bool QuantizeInt4PathSupported(QuantizeInt4Path path);
// The fastest supported path.
QuantizeInt4Path BestQuantizeInt4Path();

// w: [N, K] bf16 or f32 CPU tensor, any strides. INVALID_ARGUMENT for other
// shapes/dtypes or non-finite values (named by row). Rows in parallel
// (common/kernels/thread_pool.h) on `threads` threads (0: the pool's default),
// on `path` (default the fastest; FAILED_PRECONDITION if the CPU cannot run it).
absl::StatusOr<Int4Weight> QuantizeInt4(const at::Tensor& w);
absl::StatusOr<Int4Weight> QuantizeInt4(const at::Tensor& w, QuantizeInt4Path path,
                                        int threads = 0);

// scale(n, k / 32)·(u[n, k] - z(n, k / 32)) as an f32 [N, K] tensor (tests and
// references; the GEMM's panels hold these values rounded to bf16).
at::Tensor DequantizeInt4(const Int4Weight& w);

}  // namespace vlm::kernels
