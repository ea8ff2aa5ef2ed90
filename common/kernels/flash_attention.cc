#include "common/kernels/flash_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/kernels/gemm.h"
#include "common/kernels/gemm_internal.h"
#include "common/kernels/simd.h"
#include "common/kernels/simd_math.h"
#include "common/kernels/thread_pool.h"

namespace vlm::kernels {
namespace {

using internal::kMicroRows;
using internal::kPanelCols;

constexpr int64_t kQueryBlock = 4 * kMicroRows;    // 48 queries per task
constexpr int64_t kKeyBlock = 4 * kPanelCols;      // 128 keys per score tile
constexpr int64_t kKeyPanels = kKeyBlock / kPanelCols;


// Keys and values of one (segment, head) in the blocked layout.
//   keys:   panels over keys (32 keys each), pairs over D; kpairs_k pairs.
//   values: panels over D (32 dims each), pairs over keys; kpairs_v pairs
//           (keys padded to a multiple of kKeyBlock with zeros).
struct PackedKv {
  uint16_t* keys = nullptr;
  uint16_t* values = nullptr;
  int64_t key_panels = 0;  // multiple of kKeyPanels
  int64_t value_panels = 0;
};

// V [len, D] (row stride ld) -> panels over D with pairs over keys.
void PackValues(const uint16_t* v, int64_t ld, int64_t len, int64_t d, uint16_t* out,
                int64_t kpairs, int64_t panels) {
  const int64_t panel_elems = kpairs * 2 * kPanelCols;
  std::memset(out, 0, panels * panel_elems * sizeof(uint16_t));
  for (int64_t key = 0; key < len; ++key) {
    const uint16_t* row = v + key * ld;
    for (int64_t c = 0; c < d; ++c) {
      uint16_t* panel = out + (c / kPanelCols) * panel_elems;
      panel[(key / 2) * 2 * kPanelCols + 2 * (c % kPanelCols) + (key & 1)] = row[c];
    }
  }
}

struct Scratch {
  std::vector<float> scores;  // [kQueryBlock][kKeyBlock]
  std::vector<uint16_t> probs;  // bf16 [kQueryBlock][kKeyBlock]
  std::vector<float> out;       // [kQueryBlock][dpad]
  std::vector<float> row_max, row_sum;
  alignas(64) float acc[kMicroRows * kPanelCols];
};

// One task: queries [q0, q0 + rows) of a segment starting at row `base`, head h.
VLM_TARGET_AVX512_BF16 void AttendBlock(const uint16_t* q, int64_t q_ld, const PackedKv& kv, int64_t len,
                            int64_t d, int64_t kpairs_k, int64_t kpairs_v, float scale,
                            int64_t rows, uint16_t* out, int64_t out_ld, Scratch& s) {
  const int64_t dpad = kv.value_panels * kPanelCols;
  s.scores.resize(kQueryBlock * kKeyBlock);
  s.probs.resize(kQueryBlock * kKeyBlock);
  s.out.assign(kQueryBlock * dpad, 0.0f);
  s.row_max.assign(kQueryBlock, -std::numeric_limits<float>::infinity());
  s.row_sum.assign(kQueryBlock, 0.0f);
  const int64_t key_panel_elems = kpairs_k * 2 * kPanelCols;
  const int64_t value_panel_elems = kpairs_v * 2 * kPanelCols;
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t k0 = 0; k0 < len; k0 += kKeyBlock) {
    const int64_t valid = std::min(kKeyBlock, len - k0);
    // scores[r][c] = q_r · k_(k0+c)
    for (int64_t r0 = 0; r0 < rows; r0 += kMicroRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kMicroRows, rows - r0));
      for (int64_t j = 0; j < kKeyPanels; ++j) {
        if (j * kPanelCols >= valid) break;
        const uint16_t* panel = kv.keys + (k0 / kPanelCols + j) * key_panel_elems;
        internal::MicroTileAvx512Bf16(q + r0 * q_ld, q_ld, mr, d, panel, s.acc);
        for (int r = 0; r < mr; ++r) {
          std::memcpy(&s.scores[(r0 + r) * kKeyBlock + j * kPanelCols], s.acc + r * kPanelCols,
                      kPanelCols * sizeof(float));
        }
      }
    }
    // online softmax per row; probabilities of keys >= valid are 0
    for (int64_t r = 0; r < rows; ++r) {
      float* srow = &s.scores[r * kKeyBlock];
      __m512 vmax = neg_inf;
      for (int64_t c = 0; c < kKeyBlock; c += 16) {
        const __mmask16 live = static_cast<__mmask16>(
            valid - c >= 16 ? 0xFFFF : (valid > c ? (1u << (valid - c)) - 1u : 0u));
        __m512 v = _mm512_mask_mul_ps(neg_inf, live, _mm512_loadu_ps(srow + c), vscale);
        _mm512_storeu_ps(srow + c, v);
        vmax = _mm512_max_ps(vmax, v);
      }
      const float old_max = s.row_max[r];
      const float new_max = std::max(old_max, _mm512_reduce_max_ps(vmax));
      const float alpha = std::exp(old_max - new_max);  // 0 on the first block
      const __m512 m = _mm512_set1_ps(new_max);
      __m512 vsum = _mm512_setzero_ps();
      uint16_t* prow = &s.probs[r * kKeyBlock];
      for (int64_t c = 0; c < kKeyBlock; c += 16) {
        const __mmask16 live = simd::Mask16(valid - c);
        const __m512 e = _mm512_maskz_mov_ps(live, internal::Exp(_mm512_sub_ps(_mm512_loadu_ps(srow + c), m)));
        // the sum counts the bf16-rounded probabilities P·V will use
        const __m256i pb = simd::Bf16x16Native(e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + c), pb);
        vsum = _mm512_add_ps(vsum, simd::WidenBf16x16(pb));
      }
      s.row_max[r] = new_max;
      s.row_sum[r] = s.row_sum[r] * alpha + _mm512_reduce_add_ps(vsum);
      if (alpha != 1.0f) {
        float* orow = &s.out[r * dpad];
        const __m512 va = _mm512_set1_ps(alpha);
        for (int64_t c = 0; c < dpad; c += 16) {
          _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_loadu_ps(orow + c), va));
        }
      }
    }
    // out += P · V over this key block (padded keys have P = 0 and V = 0)
    const int64_t pair0 = k0 / 2;
    for (int64_t r0 = 0; r0 < rows; r0 += kMicroRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kMicroRows, rows - r0));
      for (int64_t j = 0; j < kv.value_panels; ++j) {
        const uint16_t* panel = kv.values + j * value_panel_elems + pair0 * 2 * kPanelCols;
        internal::MicroTileAvx512Bf16(&s.probs[r0 * kKeyBlock], kKeyBlock, mr, kKeyBlock, panel,
                                      s.acc);
        for (int r = 0; r < mr; ++r) {
          float* orow = &s.out[(r0 + r) * dpad + j * kPanelCols];
          const float* a = s.acc + r * kPanelCols;
          for (int c = 0; c < kPanelCols; c += 16) {
            _mm512_storeu_ps(orow + c, _mm512_add_ps(_mm512_loadu_ps(orow + c), _mm512_load_ps(a + c)));
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / s.row_sum[r];
    const float* orow = &s.out[r * dpad];
    uint16_t* dst = out + r * out_ld;
    for (int64_t c = 0; c < d; ++c) dst[c] = simd::F32ToBf16(orow[c] * inv);
  }
  _mm256_zeroupper();
}

// ---------------------------------------------------------------------------
// AVX2 + FMA: the same algorithm on 8-lane vectors, with the avx2 GEMM
// micro-kernel (bf16 widened to f32 in registers) for QKᵀ and PV.


VLM_TARGET_AVX2 inline float ReduceMax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

VLM_TARGET_AVX2 inline float ReduceAdd8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

// Lanes [0, valid - c) of 8 set (all ones), the rest clear.
VLM_TARGET_AVX2 inline __m256 LiveMask(int64_t valid, int64_t c) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t n = std::clamp<int64_t>(valid - c, 0, 8);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx));
}

VLM_TARGET_AVX2 void AttendBlockAvx2(const uint16_t* q, int64_t q_ld, const PackedKv& kv,
                                     int64_t len, int64_t d, float scale, int64_t rows,
                                     uint16_t* out, int64_t out_ld, Scratch& s) {
  const int64_t dpad = kv.value_panels * kPanelCols;
  s.scores.resize(kQueryBlock * kKeyBlock);
  s.probs.resize(kQueryBlock * kKeyBlock);
  s.out.assign(kQueryBlock * dpad, 0.0f);
  s.row_max.assign(kQueryBlock, -std::numeric_limits<float>::infinity());
  s.row_sum.assign(kQueryBlock, 0.0f);
  const int64_t kpairs_k = (d + 31) / 32 * 16;
  const int64_t kpairs_v = (len + kKeyBlock - 1) / kKeyBlock * kKeyBlock / 2;
  const int64_t key_panel_elems = kpairs_k * 2 * kPanelCols;
  const int64_t value_panel_elems = kpairs_v * 2 * kPanelCols;
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t k0 = 0; k0 < len; k0 += kKeyBlock) {
    const int64_t valid = std::min(kKeyBlock, len - k0);
    for (int64_t r0 = 0; r0 < rows; r0 += kMicroRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kMicroRows, rows - r0));
      for (int64_t j = 0; j < kKeyPanels; ++j) {
        if (j * kPanelCols >= valid) break;
        const uint16_t* panel = kv.keys + (k0 / kPanelCols + j) * key_panel_elems;
        internal::MicroTileAvx2(q + r0 * q_ld, q_ld, mr, d, panel, s.acc);
        for (int r = 0; r < mr; ++r) {
          std::memcpy(&s.scores[(r0 + r) * kKeyBlock + j * kPanelCols], s.acc + r * kPanelCols,
                      kPanelCols * sizeof(float));
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* srow = &s.scores[r * kKeyBlock];
      __m256 vmax = neg_inf;
      for (int64_t c = 0; c < kKeyBlock; c += 8) {
        const __m256 v = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(_mm256_loadu_ps(srow + c), vscale),
                                          LiveMask(valid, c));
        _mm256_storeu_ps(srow + c, v);
        vmax = _mm256_max_ps(vmax, v);
      }
      const float old_max = s.row_max[r];
      const float new_max = std::max(old_max, ReduceMax8(vmax));
      const float alpha = std::exp(old_max - new_max);  // 0 on the first block
      const __m256 m = _mm256_set1_ps(new_max);
      __m256 vsum = _mm256_setzero_ps();
      uint16_t* prow = &s.probs[r * kKeyBlock];
      for (int64_t c = 0; c < kKeyBlock; c += 8) {
        const __m256 e = _mm256_and_ps(LiveMask(valid, c),
                                       internal::Exp8(_mm256_sub_ps(_mm256_loadu_ps(srow + c), m)));
        // round to bf16; the sum counts the rounded probabilities P·V will use
        const __m128i pb = simd::Bf16x8(e);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(prow + c), pb);
        vsum = _mm256_add_ps(vsum, simd::WidenBf16x8(pb));
      }
      s.row_max[r] = new_max;
      s.row_sum[r] = s.row_sum[r] * alpha + ReduceAdd8(vsum);
      if (alpha != 1.0f) {
        float* orow = &s.out[r * dpad];
        const __m256 va = _mm256_set1_ps(alpha);
        for (int64_t c = 0; c < dpad; c += 8) {
          _mm256_storeu_ps(orow + c, _mm256_mul_ps(_mm256_loadu_ps(orow + c), va));
        }
      }
    }
    const int64_t pair0 = k0 / 2;
    for (int64_t r0 = 0; r0 < rows; r0 += kMicroRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kMicroRows, rows - r0));
      for (int64_t j = 0; j < kv.value_panels; ++j) {
        const uint16_t* panel = kv.values + j * value_panel_elems + pair0 * 2 * kPanelCols;
        internal::MicroTileAvx2(&s.probs[r0 * kKeyBlock], kKeyBlock, mr, kKeyBlock, panel, s.acc);
        for (int r = 0; r < mr; ++r) {
          float* orow = &s.out[(r0 + r) * dpad + j * kPanelCols];
          const float* a = s.acc + r * kPanelCols;
          for (int c = 0; c < kPanelCols; c += 8) {
            _mm256_storeu_ps(orow + c, _mm256_add_ps(_mm256_loadu_ps(orow + c), _mm256_loadu_ps(a + c)));
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / s.row_sum[r];
    const float* orow = &s.out[r * dpad];
    uint16_t* dst = out + r * out_ld;
    for (int64_t c = 0; c < d; ++c) dst[c] = simd::F32ToBf16(orow[c] * inv);
  }
  _mm256_zeroupper();
}

absl::Status Check(const at::Tensor& t, const char* name, const at::Tensor& q) {
  if (!t.defined() || t.device().type() != at::kCPU || t.dim() != 3 ||
      t.scalar_type() != at::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "flash attention: ", name, " must be a 3-D bf16 CPU tensor [N, H, D]; got ",
        t.defined() ? t.toString() + " " + std::to_string(t.dim()) + "-D" : std::string("undefined")));
  }
  if (t.sizes() != q.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat("flash attention: ", name, " [",
                                                   t.size(0), ", ", t.size(1), ", ", t.size(2),
                                                   "] differs from q [", q.size(0), ", ",
                                                   q.size(1), ", ", q.size(2), "]"));
  }
  if (t.size(2) > 1 && t.stride(2) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("flash attention: ", name, " needs unit stride along D"));
  }
  return absl::OkStatus();
}

// The AVX-512 BF16 kernel where it can run, else the AVX2 one (VLM_ISA caps
// both through GetCpuFeatures).
bool UseAvx512() { return GemmPathSupported(GemmPath::kAvx512Bf16); }

}  // namespace

bool FlashAttentionSupported() { return UseAvx512() || GemmPathSupported(GemmPath::kAvx2); }

absl::StatusOr<at::Tensor> SegmentedFlashAttention(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v,
                                                   absl::Span<const int64_t> cu_seqlens,
                                                   double scale, int threads) {
  if (absl::Status s = Check(q, "q", q); !s.ok()) return s;
  if (absl::Status s = Check(k, "k", q); !s.ok()) return s;
  if (absl::Status s = Check(v, "v", q); !s.ok()) return s;
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  if (cu_seqlens.size() < 2 || cu_seqlens.front() != 0 || cu_seqlens.back() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("flash attention: cu_seqlens must run from 0 to ", n));
  }
  for (size_t i = 1; i < cu_seqlens.size(); ++i) {
    if (cu_seqlens[i] < cu_seqlens[i - 1]) {
      return absl::InvalidArgumentError("flash attention: cu_seqlens must not decrease");
    }
  }
  if (!FlashAttentionSupported()) {
    return absl::FailedPreconditionError("flash attention needs AVX-512 BF16 or AVX2 + FMA");
  }
  try {
    at::Tensor out = at::empty({n, heads, d}, q.options());
    if (n == 0 || heads == 0 || d == 0) return out;
    const int64_t kpairs_k = (d + 31) / 32 * 16;
    const int64_t value_panels = (d + kPanelCols - 1) / kPanelCols;
    // Per (segment, head): packed keys and values, in one buffer.
    struct Item {
      int64_t begin, len, head;
      int64_t kpairs_v;
      size_t key_offset, value_offset;
      PackedKv kv;
    };
    std::vector<Item> items;
    size_t total = 0;
    for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
      const int64_t len = cu_seqlens[s + 1] - cu_seqlens[s];
      if (len == 0) continue;
      const int64_t key_panels = (len + kKeyBlock - 1) / kKeyBlock * kKeyPanels;
      const int64_t kpairs_v = (len + kKeyBlock - 1) / kKeyBlock * kKeyBlock / 2;
      for (int64_t h = 0; h < heads; ++h) {
        Item it{cu_seqlens[s], len, h, kpairs_v, total, 0, {}};
        total += key_panels * kpairs_k * 2 * kPanelCols;
        it.value_offset = total;
        total += value_panels * kpairs_v * 2 * kPanelCols;
        it.kv.key_panels = key_panels;
        it.kv.value_panels = value_panels;
        items.push_back(it);
      }
    }
    std::unique_ptr<uint16_t, void (*)(uint16_t*)> buffer(
        static_cast<uint16_t*>(::operator new(total * sizeof(uint16_t), std::align_val_t(64))),
        [](uint16_t* p) { ::operator delete(p, std::align_val_t(64)); });
    const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr());
    const auto* kd = reinterpret_cast<const uint16_t*>(k.data_ptr());
    const auto* vd = reinterpret_cast<const uint16_t*>(v.data_ptr());
    ParallelFor(static_cast<int64_t>(items.size()), threads, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        Item& it = items[i];
        it.kv.keys = buffer.get() + it.key_offset;
        it.kv.values = buffer.get() + it.value_offset;
        internal::PackPanels(kd + it.begin * k.stride(0) + it.head * k.stride(1), k.stride(0),
                             nullptr, 0, it.len, d, false, it.kv.keys, kpairs_k,
                             it.kv.key_panels);
        PackValues(vd + it.begin * v.stride(0) + it.head * v.stride(1), v.stride(0), it.len, d,
                   it.kv.values, it.kpairs_v, it.kv.value_panels);
      }
    });
    // Tasks: (item, query block).
    std::vector<std::pair<int32_t, int64_t>> tasks;
    for (size_t i = 0; i < items.size(); ++i) {
      for (int64_t q0 = 0; q0 < items[i].len; q0 += kQueryBlock) {
        tasks.emplace_back(static_cast<int32_t>(i), q0);
      }
    }
    auto* od = reinterpret_cast<uint16_t*>(out.data_ptr());
    const float fscale = static_cast<float>(scale);
    const bool avx512 = UseAvx512();
    ParallelFor(static_cast<int64_t>(tasks.size()), threads, 1, [&](int64_t t0, int64_t t1) {
      thread_local Scratch scratch;
      for (int64_t t = t0; t < t1; ++t) {
        const Item& it = items[tasks[t].first];
        const int64_t q0 = tasks[t].second;
        const int64_t rows = std::min(kQueryBlock, it.len - q0);
        const int64_t row = it.begin + q0;
        const uint16_t* qp = qd + row * q.stride(0) + it.head * q.stride(1);
        uint16_t* op = od + row * out.stride(0) + it.head * out.stride(1);
        if (avx512) {
          AttendBlock(qp, q.stride(0), it.kv, it.len, d, kpairs_k, it.kpairs_v, fscale, rows, op,
                      out.stride(0), scratch);
        } else {
          AttendBlockAvx2(qp, q.stride(0), it.kv, it.len, d, fscale, rows, op, out.stride(0),
                          scratch);
        }
      }
    });
    return out;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("flash attention: out of memory");
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("flash attention: ", e.what_without_backtrace()));
  }
}

}  // namespace vlm::kernels
