#include "common/nn.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>

#include "common/cpu_features.h"
#include "common/kernels/simd.h"
#include "common/kernels/simd_math.h"

namespace vlm::nn {

at::Tensor LayerNorm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                     double eps) {
  return at::layer_norm(x, {x.size(-1)}, weight, bias, eps);
}

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor inv_rms = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true).add_(eps));
  return weight * (xf * inv_rms).to(x.scalar_type());
}

at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  at::Tensor xc = x.scalar_type() == weight.scalar_type() ? x : x.to(weight.scalar_type());
  return at::linear(xc, weight, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
}

at::Tensor GeluTanh(const at::Tensor& x) { return at::gelu(x, "tanh"); }

at::Tensor GeluErf(const at::Tensor& x) { return at::gelu(x); }

at::Tensor SwiGlu(const at::Tensor& x, const at::Tensor& gate_weight, const at::Tensor& up_weight,
                  const at::Tensor& down_weight) {
  at::Tensor gate = at::silu(Linear(x, gate_weight));
  return Linear(gate.mul_(Linear(x, up_weight)), down_weight);
}

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, x.size(-1) - half), x.narrow(-1, 0, half)}, -1);
}

at::Tensor ApplyRotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3, "ApplyRotary: x must be [S, heads, D], got ", x.sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                  sin.sizes() == cos.sizes(),
              "ApplyRotary: cos/sin must be [S, D] = [", x.size(0), ", ", x.size(2), "], got ",
              cos.sizes(), " and ", sin.sizes());
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor c = cos.to(at::kFloat).unsqueeze(1);  // [S, 1, D]
  at::Tensor s = sin.to(at::kFloat).unsqueeze(1);
  at::Tensor y = xf * c + RotateHalf(xf) * s;
  return y.to(x.scalar_type());
}

namespace {

// ---------------------------------------------------------------------------
// Row softmax with float32 math over float32 or bf16 rows, in place. Row r
// uses its first valid(r) entries; the rest become 0 (causal masking without a
// mask tensor). With AVX-512 one fused pass per row keeps the float copy of the
// row in cache (bf16 in, bf16 out); elsewhere ATen ops do the same maths.
// ---------------------------------------------------------------------------

bool g_force_portable_softmax = false;

struct RowLengths {
  int64_t cols = 0;
  // causal: valid(r) = min(cols, base + r % period + 1); else cols.
  bool causal = false;
  int64_t base = 0;
  int64_t period = 1;
  int64_t valid(int64_t r) const {
    return causal ? std::min(cols, base + r % period + 1) : cols;
  }
};

#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsic headers trip -Wuninitialized when inlined into
// target-attributed functions (their _mm512_undefined_* idiom).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

using kernels::simd::Load16;
using kernels::simd::Store16;

// One row: x[0..cols) in place, first `valid` entries live. `buf` holds at
// least round_up(cols, 16) floats.
template <typename T>
VLM_TARGET_AVX512 void SoftmaxRowAvx512(T* x, int64_t cols, int64_t valid, float* buf) {
  const int64_t padded = (valid + 15) / 16 * 16;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  __m512 vmax = _mm512_set1_ps(neg_inf);
  for (; j + 16 <= valid; j += 16) {
    __m512 v = Load16(x + j);
    vmax = _mm512_max_ps(vmax, v);
    _mm512_storeu_ps(buf + j, v);
  }
  for (; j < padded; ++j) buf[j] = j < valid ? static_cast<float>(x[j]) : neg_inf;
  float row_max = _mm512_reduce_max_ps(vmax);
  for (int64_t t = valid / 16 * 16; t < valid; ++t) row_max = std::max(row_max, buf[t]);
  const __m512 m = _mm512_set1_ps(row_max);
  __m512 vsum = _mm512_setzero_ps();
  for (j = 0; j < padded; j += 16) {
    __m512 e = kernels::internal::ExpNonPositive(_mm512_sub_ps(_mm512_loadu_ps(buf + j), m));
    vsum = _mm512_add_ps(vsum, e);
    _mm512_storeu_ps(buf + j, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
  for (j = 0; j + 16 <= valid; j += 16) Store16(x + j, _mm512_mul_ps(_mm512_loadu_ps(buf + j), inv));
  if (j < valid) {
    alignas(64) T tail[16];
    Store16(tail, _mm512_mul_ps(_mm512_loadu_ps(buf + j), inv));
    std::copy(tail, tail + (valid - j), x + j);
  }
  std::fill(x + valid, x + cols, T(0));
}

template <typename T>
void SoftmaxRowsAvx512(T* data, int64_t rows, const RowLengths& len) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buf;
    buf.resize((len.cols + 15) / 16 * 16);
    for (int64_t r = begin; r < end; ++r) {
      SoftmaxRowAvx512(data + r * len.cols, len.cols, len.valid(r), buf.data());
    }
  });
}
#pragma GCC diagnostic pop
#endif  // __x86_64__

// x: contiguous [rows, cols] float32 or bf16.
void SoftmaxRowsInPlace(const at::Tensor& x, const RowLengths& len) {
  const int64_t rows = x.size(0);
#if defined(__x86_64__)
  if (!g_force_portable_softmax && GetCpuFeatures().fast_bf16_matmul()) {
    if (x.scalar_type() == at::kFloat) return SoftmaxRowsAvx512(x.data_ptr<float>(), rows, len);
    if (x.scalar_type() == at::kBFloat16) {
      return SoftmaxRowsAvx512(x.data_ptr<c10::BFloat16>(), rows, len);
    }
  }
#endif
  at::Tensor xf = x.to(at::kFloat);
  if (len.causal) {
    // rows are (…, period) blocks: entry (i, j) is masked when j > base + i.
    at::Tensor i = at::arange(len.period, at::TensorOptions().dtype(at::kLong)).unsqueeze(1);
    at::Tensor j = at::arange(len.cols, at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
    xf.view({-1, len.period, len.cols})
        .masked_fill_(j > i + len.base, -std::numeric_limits<double>::infinity());
  }
  x.copy_(at::softmax(xf, -1));
}

// The tiled core: writes softmax(q·kᵀ·scale)·v into `out`, a [Hq, Sq, D]
// (possibly strided) view. q: [Hq, Sq, D], k, v: [Hkv, Sk, D], contiguous.
// Work item = (a few kv heads, one query tile); the score buffer is reused.
void AttentionInto(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const AttentionOptions& options, const at::Tensor& out) {
  const int64_t hq = q.size(0), sq = q.size(1), d = q.size(2);
  const int64_t hkv = k.size(0), sk = k.size(1);
  const int64_t group = hq / hkv;
  if (sq == 0) return;
  const int64_t tile = std::min(std::max<int64_t>(1, options.query_tile), sq);
  const int64_t row_bytes = group * tile * sk * static_cast<int64_t>(q.element_size());
  const int64_t heads_step =
      std::clamp<int64_t>(options.score_block_bytes / std::max<int64_t>(1, row_bytes), 1, hkv);
  const auto opts = q.options();
  at::Tensor score_buf = at::empty({heads_step * group * tile * sk}, opts);
  at::Tensor q_buf = at::empty({heads_step * group * tile * d}, opts);
  at::Tensor o_buf = at::empty({heads_step * group * tile * d}, opts);
  auto view = [](const at::Tensor& flat, at::IntArrayRef shape) {
    return flat.narrow(0, 0, c10::multiply_integers(shape)).view(shape);
  };
  const at::Tensor kt = k.transpose(1, 2);  // [Hkv, D, Sk]
  for (int64_t h0 = 0; h0 < hkv; h0 += heads_step) {
    const int64_t nh = std::min(heads_step, hkv - h0);
    for (int64_t q0 = 0; q0 < sq; q0 += tile) {
      const int64_t tq = std::min(tile, sq - q0);
      // Keys a causal tile can see: positions 0 .. q_offset + q0 + tq - 1.
      const int64_t kv_len = options.causal ? std::min(sk, options.q_offset + q0 + tq) : sk;
      // q tile, scaled, the query heads of one kv head stacked: [nh, group·tq, D]
      at::Tensor qt = view(q_buf, {nh * group, tq, d});
      at::mul_out(qt, q.narrow(0, h0 * group, nh * group).narrow(1, q0, tq), options.scale);
      at::Tensor s = view(score_buf, {nh, group * tq, kv_len});
      at::bmm_out(s, qt.view({nh, group * tq, d}), kt.narrow(0, h0, nh).narrow(2, 0, kv_len));
      RowLengths len;
      len.cols = kv_len;
      len.causal = options.causal;
      len.base = options.q_offset + q0;
      len.period = tq;
      SoftmaxRowsInPlace(s.view({nh * group * tq, kv_len}), len);
      at::Tensor o = view(o_buf, {nh, group * tq, d});
      at::bmm_out(o, s, v.narrow(0, h0, nh).narrow(1, 0, kv_len));
      out.narrow(0, h0 * group, nh * group).narrow(1, q0, tq).copy_(o.view({nh * group, tq, d}));
    }
  }
}

void CheckAttentionShapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionOptions& options, const char* layout) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attention (", layout,
              "): q, k, v must be 3-D, got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "attention: k ", k.sizes(), " and v ", v.sizes(),
              " differ");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "attention: q, k, v dtypes differ");
  TORCH_CHECK(options.q_offset >= 0, "attention: q_offset must be >= 0");
}

}  // namespace

void SoftmaxInPlace(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "SoftmaxInPlace: needs a contiguous float32 or bf16 tensor");
  if (x.numel() == 0) return;
  RowLengths len;
  len.cols = x.size(-1);
  SoftmaxRowsInPlace(x.view({-1, len.cols}), len);
}

void ForcePortableSoftmaxForTesting(bool force) { g_force_portable_softmax = force; }

at::Tensor AttentionHeadMajor(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const AttentionOptions& options) {
  CheckAttentionShapes(q, k, v, options, "head-major");
  TORCH_CHECK(q.size(2) == k.size(2), "attention: head dims differ: q ", q.sizes(), ", k ",
              k.sizes());
  TORCH_CHECK(k.size(0) > 0 && q.size(0) % k.size(0) == 0, "attention: ", q.size(0),
              " query heads are not a multiple of ", k.size(0), " kv heads");
  TORCH_CHECK(!options.causal || options.q_offset + q.size(1) <= k.size(1),
              "attention: causal queries at positions ", options.q_offset, "..",
              options.q_offset + q.size(1) - 1, " need that many keys, have ", k.size(1));
  at::Tensor out = at::empty(q.sizes(), q.options());
  AttentionInto(q.contiguous(), k.contiguous(), v.contiguous(), options, out);
  return out;
}

at::Tensor Attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttentionOptions& options) {
  CheckAttentionShapes(q, k, v, options, "token-major");
  TORCH_CHECK(q.size(2) == k.size(2), "attention: head dims differ: q ", q.sizes(), ", k ",
              k.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "attention: ", q.size(1),
              " query heads are not a multiple of ", k.size(1), " kv heads");
  TORCH_CHECK(!options.causal || options.q_offset + q.size(0) <= k.size(0),
              "attention: causal queries at positions ", options.q_offset, "..",
              options.q_offset + q.size(0) - 1, " need that many keys, have ", k.size(0));
  at::Tensor out = at::empty(q.sizes(), q.options());  // [Sq, Hq, D]
  AttentionInto(q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(),
                v.transpose(0, 1).contiguous(), options, out.transpose(0, 1));
  return out;
}

at::Tensor SegmentedAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              absl::Span<const int64_t> cu_seqlens,
                              const AttentionOptions& options) {
  CheckAttentionShapes(q, k, v, options, "segmented");
  TORCH_CHECK(q.sizes() == k.sizes(), "segmented attention: q ", q.sizes(), " and k ",
              k.sizes(), " differ");
  TORCH_CHECK(!options.causal, "segmented attention is bidirectional");
  TORCH_CHECK(cu_seqlens.size() >= 2 && cu_seqlens.front() == 0 &&
                  cu_seqlens.back() == q.size(0),
              "segmented attention: cu_seqlens must run from 0 to ", q.size(0));
  at::Tensor out = at::empty(q.sizes(), q.options());  // [N, H, D]
  for (size_t i = 0; i + 1 < cu_seqlens.size(); ++i) {
    const int64_t begin = cu_seqlens[i], len = cu_seqlens[i + 1] - cu_seqlens[i];
    TORCH_CHECK(len >= 0, "segmented attention: cu_seqlens must not decrease");
    if (len == 0) continue;
    auto head_major = [&](const at::Tensor& t) {
      return t.narrow(0, begin, len).transpose(0, 1).contiguous();  // [H, len, D]
    };
    AttentionInto(head_major(q), head_major(k), head_major(v), options,
                  out.narrow(0, begin, len).transpose(0, 1));
  }
  return out;
}

}  // namespace vlm::nn
