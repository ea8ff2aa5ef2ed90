#include "common/kernels/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include "absl/strings/str_cat.h"
#include "common/cpu_features.h"
#include "common/kernels/simd_math.h"
#include "common/kernels/thread_pool.h"
#include "common/kernels/path_override.h"
#include "common/kernels/simd.h"

namespace vlm {
namespace {

using Bf16 = c10::BFloat16;

using kernels::simd::ToF32;

// One work item: queries [i0, i1) of a run, one KV head.
struct Item {
  const PagedQueryRun* run = nullptr;
  int64_t kv_head = 0;
  int64_t i0 = 0, i1 = 0;
};

struct Geometry {
  int64_t hq = 0, hkv = 0, group = 0, d = 0, block_size = 0;
  float scale = 1;
};

// Per-thread buffers of a work item.
struct Scratch {
  std::vector<float> q;       // [NQ, D] scaled queries
  std::vector<float> acc;     // [NQ, D]
  std::vector<float> m, l;    // [NQ] running max, running sum
  std::vector<float> kf, vf;  // [block, D] one key/value block in f32 (portable path)
  std::vector<float> s;       // [NQ, ldk] scores of one block (avx512: of a step's blocks)
  std::vector<float> e;       // [group, ldk] exp(score - max) of one query (avx512)
};

// Loads the item's queries (scaled) and resets the softmax state.
template <typename T>
void Begin(const Item& it, const Geometry& g, const T* q, Scratch& w) {
  const int64_t nq = (it.i1 - it.i0) * g.group;
  w.q.resize(nq * g.d);
  w.acc.assign(nq * g.d, 0.0f);
  w.m.assign(nq, -std::numeric_limits<float>::infinity());
  w.l.assign(nq, 0.0f);
  for (int64_t i = it.i0; i < it.i1; ++i) {
    const int64_t row = it.run->row + i;
    for (int64_t h = 0; h < g.group; ++h) {
      const T* src = q + (row * g.hq + it.kv_head * g.group + h) * g.d;
      float* dst = w.q.data() + ((i - it.i0) * g.group + h) * g.d;
      for (int64_t k = 0; k < g.d; ++k) dst[k] = ToF32(src[k]) * g.scale;
    }
  }
}

// Writes acc / l rounded to T.
template <typename T>
void Finish(const Item& it, const Geometry& g, const Scratch& w, T* out) {
  for (int64_t i = it.i0; i < it.i1; ++i) {
    const int64_t row = it.run->row + i;
    for (int64_t h = 0; h < g.group; ++h) {
      const int64_t v = (i - it.i0) * g.group + h;
      T* dst = out + (row * g.hq + it.kv_head * g.group + h) * g.d;
      const float* a = w.acc.data() + v * g.d;
      for (int64_t k = 0; k < g.d; ++k) dst[k] = T(a[k] / w.l[v]);
    }
  }
}

// Keys of block b that query i of the item sees (<= 0: none).
inline int64_t Visible(const Item& it, int64_t i, int64_t b, int64_t bs) {
  return std::min(bs, it.run->start + i - b * bs + 1);
}

// ---------------------------------------------------------------------------
// Portable path.

template <typename T>
void ItemScalar(const Item& it, const Geometry& g, const T* q, const T* kc, const T* vc,
                Scratch& w, T* out) {
  Begin(it, g, q, w);
  const int64_t bs = g.block_size, d = g.d;
  const int64_t last = it.run->start + it.i1 - 1;  // largest cache index of the item
  w.kf.resize(bs * d);
  w.vf.resize(bs * d);
  w.s.resize(bs);
  for (int64_t b = 0; b <= last / bs; ++b) {
    const int64_t nk = std::min(bs, last + 1 - b * bs);
    const int64_t base = (static_cast<int64_t>(it.run->block_table[b]) * g.hkv + it.kv_head) * bs * d;
    // Keys are stored dimension-major within a block ([D, bs]), values [bs, D].
    for (int64_t t = 0; t < nk; ++t) {
      for (int64_t k = 0; k < d; ++k) w.kf[t * d + k] = ToF32(kc[base + k * bs + t]);
    }
    for (int64_t t = 0; t < nk * d; ++t) w.vf[t] = ToF32(vc[base + t]);
    for (int64_t i = it.i0; i < it.i1; ++i) {
      const int64_t valid = Visible(it, i, b, bs);
      if (valid <= 0) continue;
      for (int64_t h = 0; h < g.group; ++h) {
        const int64_t v = (i - it.i0) * g.group + h;
        const float* qv = w.q.data() + v * d;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < valid; ++t) {
          float s = 0;
          for (int64_t k = 0; k < d; ++k) s += qv[k] * w.kf[t * d + k];
          w.s[t] = s;
          mx = std::max(mx, s);
        }
        float* acc = w.acc.data() + v * d;
        const float m_new = std::max(w.m[v], mx);
        if (m_new > w.m[v]) {
          const float corr = std::exp(w.m[v] - m_new);
          w.l[v] *= corr;
          for (int64_t k = 0; k < d; ++k) acc[k] *= corr;
          w.m[v] = m_new;
        }
        for (int64_t t = 0; t < valid; ++t) {
          const float e = std::exp(w.s[t] - m_new);
          w.l[v] += e;
          for (int64_t k = 0; k < d; ++k) acc[k] += e * w.vf[t * d + k];
        }
      }
    }
  }
  Finish(it, g, w, out);
}

// ---------------------------------------------------------------------------
// AVX-512 path: scores of up to 4 query vectors × 16 keys per FMA chain
// (keys read dimension-major as the cache stores them, sums over head_dim in
// order per lane; the keys of up to kStepBlocks blocks at once so that 8
// chains are in flight), exp over 16 scores at a time, values accumulated
// over head_dim from the cache as stored (4 vectors of 16 at a time,
// head_dim % 16 == 0).

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

using kernels::simd::Load16;

// A group of up to 16 keys of one block: element c of key l at p[c·bs + l].
template <typename T>
struct KeyGroup {
  const T* p = nullptr;
  __mmask16 mask = 0;
};

// Scores of V query vectors (rows of q0, d apart) against J key groups:
// s[v, 16j + l] = Σ_c q[v, c]·k_j[c, l] (s rows ld floats apart), one FMA
// chain per (v, j) over c in order. V·J chains in flight hide the FMA latency
// (decode has V = 2: one 16-key group alone would wait on it). Keys are read
// where the cache stores them, dimension-major, so no transposition is needed.
template <int V, int J, typename T>
VLM_TARGET_AVX512 inline void ScoreTile(const float* q0, int64_t d, const KeyGroup<T>* groups,
                                 int64_t bs, int64_t ld, float* s) {
  __m512 acc[V][J];
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) acc[v][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; ++c) {
    __m512 k[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) k[j] = Load16(groups[j].p + c * bs, groups[j].mask);
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const __m512 qv = _mm512_set1_ps(q0[v * d + c]);
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j) acc[v][j] = _mm512_fmadd_ps(qv, k[j], acc[v][j]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(s + v * ld + 16 * j, acc[v][j]);
}

// ScoreTile over `count` key groups for V query vectors.
template <int V, int J, typename T>
VLM_TARGET_AVX512 inline void ScoreRows(const float* q0, int64_t d, const KeyGroup<T>* groups,
                                 int64_t count, int64_t bs, int64_t ld, float* s) {
  int64_t j = 0;
  for (; j + J <= count; j += J) ScoreTile<V, J>(q0, d, groups + j, bs, ld, s + 16 * j);
  for (; j < count; ++j) ScoreTile<V, 1>(q0, d, groups + j, bs, ld, s + 16 * j);
}

// acc_h[c] += Σ_t e_h[t]·v[t, c] for H heads (acc_h d floats apart, e_h ld_e
// apart), c over U vectors of 16 from c0; per element the sum runs over t in
// order. v: the block's values [nk, d] as stored (bf16 widened exactly).
template <int H, int U, typename T>
VLM_TARGET_AVX512 inline void ValueTile(const T* v, int64_t d, int64_t c0, int64_t valid, const float* e,
                                 int64_t ld_e, float* acc) {
  __m512 a[H][U];
#pragma GCC unroll 2
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) a[h][u] = _mm512_loadu_ps(acc + h * d + c0 + 16 * u);
  for (int64_t t = 0; t < valid; ++t) {
    __m512 vv[U];
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) vv[u] = Load16(v + t * d + c0 + 16 * u);
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) {
      const __m512 eh = _mm512_set1_ps(e[h * ld_e + t]);
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) a[h][u] = _mm512_fmadd_ps(eh, vv[u], a[h][u]);
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) _mm512_storeu_ps(acc + h * d + c0 + 16 * u, a[h][u]);
}

template <int H, typename T>
VLM_TARGET_AVX512 inline void ValueRows(const T* v, int64_t d, int64_t valid, const float* e,
                                 int64_t ld_e, float* acc) {
  const int64_t nv = d / 16;
  int64_t c = 0;
  for (; c + 4 <= nv; c += 4) ValueTile<H, 4>(v, d, 16 * c, valid, e, ld_e, acc);
  for (; c < nv; ++c) ValueTile<H, 1>(v, d, 16 * c, valid, e, ld_e, acc);
}

// Blocks whose keys are transposed and scored together: more independent
// score sums in flight (a decode item scores 2 query vectors; one 16-key block
// alone gives 2 chains). Each block's softmax and values still run in order.
constexpr int64_t kStepBlocks = 4;

template <typename T>
VLM_TARGET_AVX512 void ItemAvx512(const Item& it, const Geometry& g, const T* q, const T* kc,
                           const T* vc, Scratch& w, T* out) {
  Begin(it, g, q, w);
  const int64_t bs = g.block_size, d = g.d;
  const int64_t ldk = (bs + 15) / 16 * 16;  // one block's columns in s
  const int64_t ld = kStepBlocks * ldk;     // row stride of s
  const int64_t nq = (it.i1 - it.i0) * g.group;
  const int64_t last = it.run->start + it.i1 - 1;
  const int64_t nblocks = last / bs + 1;
  const int64_t per_block = ldk / 16;  // key groups of a block
  thread_local std::vector<KeyGroup<T>> groups;
  groups.resize(kStepBlocks * per_block);
  w.s.resize(nq * ld);
  w.e.resize(g.group * ldk);
  auto base = [&](int64_t b) {
    return (static_cast<int64_t>(it.run->block_table[b]) * g.hkv + it.kv_head) * bs * d;
  };
  for (int64_t b0 = 0; b0 < nblocks; b0 += kStepBlocks) {
    const int64_t nb = std::min(kStepBlocks, nblocks - b0);
    // The step's keys as groups of 16: block j's scores at columns j·ldk..
    // of s (lanes past the block's size read as 0).
    for (int64_t j = 0; j < nb; ++j) {
      const T* kb = kc + base(b0 + j);
      for (int64_t u = 0; u < per_block; ++u) {
        const int64_t n = std::min<int64_t>(16, bs - 16 * u);
        groups[j * per_block + u] = {kb + 16 * u, static_cast<__mmask16>((1u << n) - 1u)};
      }
    }
    // Scores of every query vector of the item against the step's keys:
    // s[v, t] = Σ_c q[v, c]·k[t, c], summed over c in order (per lane).
    // Query vectors that see fewer keys compute a few unused scores.
    const int64_t count = nb * per_block;
    int64_t v0 = 0;
    for (; v0 + 4 <= nq; v0 += 4) {
      ScoreRows<4, 2>(w.q.data() + v0 * d, d, groups.data(), count, bs, ld, w.s.data() + v0 * ld);
    }
    for (; v0 + 2 <= nq; v0 += 2) {
      ScoreRows<2, 4>(w.q.data() + v0 * d, d, groups.data(), count, bs, ld, w.s.data() + v0 * ld);
    }
    for (; v0 < nq; ++v0) {
      ScoreRows<1, 4>(w.q.data() + v0 * d, d, groups.data(), count, bs, ld, w.s.data() + v0 * ld);
    }
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t b = b0 + j;
      const T* vb = vc + base(b);
      // Online softmax update of each query vector over its visible keys:
      // the heads of one query share `valid`. First each head's rescale, exp
      // and sum (in key order), then acc[c] += e[t]·v[t, c] for t in order,
      // two heads at a time so each value load serves both (the order per
      // element is unchanged, so results do not depend on the pairing).
      for (int64_t i = it.i0; i < it.i1; ++i) {
        const int64_t valid = Visible(it, i, b, bs);
        if (valid <= 0) continue;
        const int64_t v_first = (i - it.i0) * g.group;
        for (int64_t h = 0; h < g.group; ++h) {
          const int64_t v = v_first + h;
          const float* s = w.s.data() + v * ld + j * ldk;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < valid; ++t) mx = std::max(mx, s[t]);
          float* acc = w.acc.data() + v * d;
          const float m_new = std::max(w.m[v], mx);
          if (m_new > w.m[v]) {
            const float corr = std::exp(w.m[v] - m_new);
            w.l[v] *= corr;
            const __m512 cv = _mm512_set1_ps(corr);
            for (int64_t c = 0; c < d / 16; ++c) {
              _mm512_storeu_ps(acc + 16 * c, _mm512_mul_ps(cv, _mm512_loadu_ps(acc + 16 * c)));
            }
            w.m[v] = m_new;
          }
          const __m512 mv = _mm512_set1_ps(m_new);
          float* e = w.e.data() + h * ldk;
          for (int64_t t0 = 0; t0 < valid; t0 += 16) {
            _mm512_storeu_ps(e + t0, kernels::internal::ExpNonPositive(
                                         _mm512_sub_ps(_mm512_loadu_ps(s + t0), mv)));
          }
          for (int64_t t = 0; t < valid; ++t) w.l[v] += e[t];
        }
        int64_t h = 0;
        for (; h + 2 <= g.group; h += 2) {
          ValueRows<2>(vb, d, valid, w.e.data() + h * ldk, ldk, w.acc.data() + (v_first + h) * d);
        }
        for (; h < g.group; ++h) {
          ValueRows<1>(vb, d, valid, w.e.data() + h * ldk, ldk, w.acc.data() + (v_first + h) * d);
        }
      }
    }
  }
  _mm256_zeroupper();
  Finish(it, g, w, out);
}
#pragma GCC diagnostic pop

bool CpuHasAvx512() { return GetCpuFeatures().fast_bf16_matmul(); }  // F, BW, VL, DQ

template <typename T>
void Run(const std::vector<Item>& items, const Geometry& g, bool avx512, const at::Tensor& q,
         const at::Tensor& k, const at::Tensor& v, const at::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // On the kernels' pool, like the projections around it: an OpenMP region
  // here would wake libgomp's (passive) worker onto the core where the pool's
  // worker is still spinning after the previous GEMM.
  kernels::ParallelFor(static_cast<int64_t>(items.size()), 0, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch w;
    for (int64_t i = begin; i < end; ++i) {
      if (avx512) {
        ItemAvx512(items[i], g, qp, kp, vp, w, op);
      } else {
        ItemScalar(items[i], g, qp, kp, vp, w, op);
      }
    }
  });
}

}  // namespace

const char* AttentionPathName(AttentionPath path) {
  return path == AttentionPath::kAvx512 ? "avx512" : "scalar";
}

absl::StatusOr<AttentionPath> ParseAttentionPath(std::string_view name) {
  if (name == "auto") {
    return AttentionPathSupported(AttentionPath::kAvx512) ? AttentionPath::kAvx512
                                                         : AttentionPath::kScalar;
  }
  if (name == "avx512") return AttentionPath::kAvx512;
  if (name == "scalar") return AttentionPath::kScalar;
  return absl::InvalidArgumentError(absl::StrCat("unknown attention path '", std::string(name),
                                                 "'; expected avx512, scalar or auto"));
}

bool AttentionPathSupported(AttentionPath path) {
  return path == AttentionPath::kScalar || CpuHasAvx512();
}

AttentionPath DefaultAttentionPath() {
  static const AttentionPath path = kernels::internal::PathFromEnvironment(
      "VLM_ATTENTION_PATH", *ParseAttentionPath("auto"), ParseAttentionPath,
      [](AttentionPath p, std::string* missing) {
        if (!AttentionPathSupported(p)) *missing = "AVX-512 F/BW/VL/DQ";
        return AttentionPathSupported(p);
      });
  return path;
}

at::Tensor PagedAttention(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, absl::Span<const PagedQueryRun> runs,
                          const PagedAttentionOptions& options) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "paged attention: q must be a contiguous [R, Hq, D] float32/bf16 tensor, got ",
              q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type() && v_cache.size(3) == q.size(2) &&
                  k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2),
              "paged attention: caches must be contiguous K [blocks, Hkv, ", q.size(2),
              ", block_size] and V [blocks, Hkv, block_size, ", q.size(2),
              "] in q's dtype, got ", k_cache.sizes(), " and ", v_cache.sizes());
  Geometry g;
  g.hq = q.size(1);
  g.hkv = v_cache.size(1);
  g.d = q.size(2);
  g.block_size = v_cache.size(2);
  g.scale = static_cast<float>(options.scale);
  TORCH_CHECK(g.hkv > 0 && g.hq % g.hkv == 0 && g.block_size > 0 && g.d > 0,
              "paged attention: ", g.hq, " query heads over ", g.hkv, " KV heads, block size ",
              g.block_size);
  g.group = g.hq / g.hkv;
  const int64_t rows = q.size(0), blocks = v_cache.size(0);
  const int64_t tile = std::max<int64_t>(1, options.query_tile);
  std::vector<Item> items;
  for (const PagedQueryRun& run : runs) {
    TORCH_CHECK(run.count >= 1 && run.row >= 0 && run.row + run.count <= rows && run.start >= 0,
                "paged attention: run rows [", run.row, ", ", run.row + run.count,
                ") outside q's ", rows, " rows");
    const int64_t needed = (run.start + run.count + g.block_size - 1) / g.block_size;
    TORCH_CHECK(static_cast<int64_t>(run.block_table.size()) >= needed, "paged attention: ",
                run.block_table.size(), " blocks in the table, ", needed, " needed");
    for (int64_t i = 0; i < needed; ++i) {
      TORCH_CHECK(run.block_table[i] >= 0 && run.block_table[i] < blocks,
                  "paged attention: block id ", run.block_table[i], " outside 0..", blocks - 1);
    }
    for (int64_t h = 0; h < g.hkv; ++h) {
      for (int64_t i0 = 0; i0 < run.count; i0 += tile) {
        items.push_back({&run, h, i0, std::min(run.count, i0 + tile)});
      }
    }
  }
  at::Tensor out = at::zeros_like(q);
  const AttentionPath path = options.path.value_or(DefaultAttentionPath());
  const bool avx512 = path == AttentionPath::kAvx512 && CpuHasAvx512() && g.d % 16 == 0;
  if (q.scalar_type() == at::kFloat) {
    Run<float>(items, g, avx512, q, k_cache, v_cache, out);
  } else {
    Run<Bf16>(items, g, avx512, q, k_cache, v_cache, out);
  }
  return out;
}

}  // namespace vlm
