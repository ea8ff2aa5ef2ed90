// DecodeAttention (the AVX-512 bf16 kernel) against its ATen formulation and
// against float32 attention on the same bf16 values; PagedAttention (both
// paths) against the exact (float64) attention within the bound of its error
// analysis (PagedReference), and its batch invariance.
#include "services/language/model/decode_attention.h"

#include <algorithm>
#include <cstdlib>
#include <utility>
#include <vector>

#include "common/kernels/paged_attention.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "common/nn.h"

namespace vlm::language {
namespace {

struct Shape {
  int64_t hq, hkv, d, length, capacity;
};

// max |a - b| / max |b|
double RelErr(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>() /
         b.to(at::kFloat).abs().max().item<double>();
}

TEST(DecodeAttentionTest, Bf16KernelMatchesAtenAndFloat32) {
  const Shape shapes[] = {{4, 2, 32, 1, 8},      {4, 2, 32, 37, 64},   {16, 8, 128, 300, 512},
                          {16, 8, 128, 1025, 1100}, {8, 8, 64, 17, 17}, {8, 2, 64, 200, 256},
                          {2, 1, 256, 33, 40}};
  at::manual_seed(3);
  for (const Shape& s : shapes) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.d));
    // Scores of a few units: a peaked but not one-hot softmax.
    at::Tensor q = (at::randn({s.hq, s.d}) * 2).to(at::kBFloat16);
    at::Tensor k = at::randn({s.hkv, s.capacity, s.d}).to(at::kBFloat16);
    at::Tensor v = at::randn({s.hkv, s.capacity, s.d}).to(at::kBFloat16);
    at::Tensor got = DecodeAttention(q, k, v, s.length, scale);
    at::Tensor aten = DecodeAttentionReference(q, k, v, s.length, scale);
    ASSERT_EQ(got.sizes(), (at::IntArrayRef{s.hq, s.d}));
    EXPECT_EQ(got.scalar_type(), at::kBFloat16);
    // float32 attention over the same bf16 values (token-major nn::Attention).
    nn::AttentionOptions o;
    o.scale = scale;
    at::Tensor f32 = nn::Attention(q.to(at::kFloat).unsqueeze(0),
                                   k.narrow(1, 0, s.length).transpose(0, 1).to(at::kFloat),
                                   v.narrow(1, 0, s.length).transpose(0, 1).to(at::kFloat), o)[0];
    const double e_kernel = RelErr(got, f32), e_aten = RelErr(aten, f32);
    // Both round q·scale, scores, probabilities and the output to bf16.
    EXPECT_LT(e_kernel, 3e-2) << s.hq << "x" << s.d << " L=" << s.length;
    EXPECT_LT(e_aten, 3e-2) << s.hq << "x" << s.d << " L=" << s.length;
    EXPECT_LT(RelErr(got, aten), 3e-2) << s.hq << "x" << s.d << " L=" << s.length;
    std::printf("  Hq %ld Hkv %ld D %ld L %ld: kernel %.1e, aten %.1e vs f32, kernel vs aten %.1e "
                "(kernel used: %d)\n",
                static_cast<long>(s.hq), static_cast<long>(s.hkv), static_cast<long>(s.d),
                static_cast<long>(s.length), e_kernel, e_aten, RelErr(got, aten),
                DecodeAttentionHasKernel(at::kBFloat16, s.d));
  }
}

TEST(DecodeAttentionTest, OneKeyReturnsItsValue) {
  at::Tensor q = at::randn({4, 32}).to(at::kBFloat16);
  at::Tensor k = at::randn({2, 8, 32}).to(at::kBFloat16);
  at::Tensor v = at::randn({2, 8, 32}).to(at::kBFloat16);
  at::Tensor got = DecodeAttention(q, k, v, 1, 0.2);
  // Query heads 0, 1 read kv head 0; 2, 3 read kv head 1 (i / group).
  EXPECT_TRUE(at::equal(got[0], v[0][0]));
  EXPECT_TRUE(at::equal(got[1], v[0][0]));
  EXPECT_TRUE(at::equal(got[3], v[1][0]));
}

TEST(DecodeAttentionTest, Float32UsesAtenPath) {
  at::Tensor q = at::randn({4, 32});
  at::Tensor k = at::randn({2, 16, 32});
  at::Tensor v = at::randn({2, 16, 32});
  EXPECT_FALSE(DecodeAttentionHasKernel(at::kFloat, 32));
  EXPECT_TRUE(at::equal(DecodeAttention(q, k, v, 9, 0.3), DecodeAttentionReference(q, k, v, 9, 0.3)));
}

TEST(DecodeAttentionTest, RejectsBadShapes) {
  at::Tensor q = at::randn({3, 32}).to(at::kBFloat16);  // 3 heads over 2 kv heads
  at::Tensor k = at::randn({2, 16, 32}).to(at::kBFloat16);
  EXPECT_THROW(DecodeAttention(q, k, k, 4, 1.0), c10::Error);
  at::Tensor q4 = at::randn({4, 32}).to(at::kBFloat16);
  EXPECT_THROW(DecodeAttention(q4, k, k, 17, 1.0), c10::Error);  // beyond capacity
  EXPECT_THROW(DecodeAttention(q4, k, k, 0, 1.0), c10::Error);
}

}  // namespace
}  // namespace vlm::language

// ---------------------------------------------------------------------------
// PagedAttention (paged_attention.h): causal GQA through a block table.
// ---------------------------------------------------------------------------

namespace vlm::language {
namespace {

struct PagedShape {
  int64_t hq, hkv, d, block_size;
};

// A KV cache of `blocks` random blocks and runs of several sequences whose
// block tables are random permutations of disjoint block ids.
struct PagedSetup {
  at::Tensor q, k, v;                     // [R, Hq, D], K [blocks, Hkv, D, bs], V [blocks, Hkv, bs, D]
  std::vector<std::vector<int32_t>> tables;
  std::vector<PagedQueryRun> runs;
};

PagedSetup MakePaged(const PagedShape& s, at::ScalarType dtype,
                     const std::vector<std::pair<int64_t, int64_t>>& start_count, uint64_t seed) {
  at::manual_seed(seed);
  PagedSetup p;
  int64_t rows = 0, blocks = 0;
  for (const auto& [start, count] : start_count) {
    rows += count;
    blocks += (start + count + s.block_size - 1) / s.block_size;
  }
  p.q = (at::randn({rows, s.hq, s.d}) * 2).to(dtype);
  p.k = at::randn({blocks + 3, s.hkv, s.block_size, s.d}).to(dtype).transpose(2, 3).contiguous();
  p.v = at::randn({blocks + 3, s.hkv, s.block_size, s.d}).to(dtype);
  const at::Tensor perm = at::randperm(blocks + 3, at::TensorOptions().dtype(at::kLong));
  int64_t row = 0, next = 0;
  p.tables.resize(start_count.size());
  for (size_t i = 0; i < start_count.size(); ++i) {
    const auto [start, count] = start_count[i];
    for (int64_t b = 0; b < (start + count + s.block_size - 1) / s.block_size; ++b) {
      p.tables[i].push_back(static_cast<int32_t>(perm[next++].item<int64_t>()));
    }
    p.runs.push_back({row, count, start, p.tables[i]});
    row += count;
  }
  return p;
}

// The exact attention (float64 over the cache's values) and, per query row
// and head, the bound the error analysis below gives for the kernel's float32
// arithmetic.
struct PagedWant {
  at::Tensor out;    // [R, Hq, D] float64: softmax(q·kᵀ·scale)·v
  at::Tensor bound;  // [R, Hq, D] float64: |kernel - out| allowed per element
};

// Error analysis of PagedAttention in float32 (u = 2^-24, γ_n = n·u/(1-n·u)),
// for one query and head with n visible keys in B blocks, head_dim D:
//  1. Scores. The kernel rounds scale to f32 and q·scale (2 roundings), then
//     sums D products in some order: |ŝ_t - s_t| <= γ_{D+3}·A_t with
//     A_t = scale·Σ_c |q_c·k_tc| (the dot-product bound, any order, fma or
//     not). δ = γ_{D+3}·max_t A_t bounds every score's error.
//  2. Exponentials. ê_t = exp(fl(ŝ_t - m))·(1 + η_t): the subtraction's
//     rounding, u·|ŝ_t - m| <= 2u·(S + δ) with S = max_t |s_t|, becomes a
//     relative error of exp, and exp itself is within 2 ulp (4u; Cephes
//     expf, std::exp). So |η_t| <= η = (2(S + δ) + 4)·u. Scores more than 87
//     below the max give exactly 0 (e^-87 < 2^-125: negligible). The online
//     rescaling multiplies acc and l by the same rounded factor, so its error
//     cancels in acc/l; only the products' roundings remain (at most B
//     rescales, γ_B on each of acc and l).
//  3. Both together perturb each weight e^{s_t} by a relative ρ <= e^δ(1 + η)
//     - 1; normalised weights then move by at most 2ρ/(1 - ρ) of themselves,
//     so the output moves by at most 2ρ/(1 - ρ)·V, V = max over the visible
//     values of |v_tc| (the output is a convex combination of them).
//  4. Sums. acc_c = Σ_t ê_t·v_tc over n terms (one rounding for the product,
//     n for the additions) is within γ_{n+1}·l·V, l = Σ ê_t within γ_n·l, and
//     the division adds u: with |o_c| <= V that is (γ_{n+1} + γ_n + u)·V.
// Total:  |ô_c - o_c| <= V·(2ρ/(1 - ρ) + γ_{n+1} + γ_n + 2γ_B + u).
// bf16 caches: q, k, v are the same bf16 values in both (converted exactly),
// and the output is rounded once to bf16 (8 significant bits, unit roundoff
// 2^-8): + 2^-8·(|o_c| + the f32 bound).
// The float64 reference's own error (~n·D·2^-53 relative) is far below.
// The bound is a worst case: observed f32 errors are 1e-3..1e-2 of it (a rounding
// error per step is rarely at its maximum and they mostly cancel); a wrong
// key, mask or softmax is off by a sizeable fraction of V.
PagedWant PagedReference(const PagedSetup& p, double scale, at::ScalarType dtype) {
  const int64_t hq = p.q.size(1), hkv = p.v.size(1), bs = p.v.size(2), d = p.v.size(3);
  const int64_t group = hq / hkv;
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  PagedWant want{at::zeros(p.q.sizes(), f64), at::zeros(p.q.sizes(), f64)};
  const double u = std::ldexp(1.0, -24);
  auto gamma = [u](double n) { return n * u / (1 - n * u); };
  for (const PagedQueryRun& run : p.runs) {
    std::vector<int64_t> ids(run.block_table.begin(), run.block_table.end());
    const at::Tensor index = at::tensor(ids, at::TensorOptions().dtype(at::kLong));
    // [blocks, Hkv, bs, D] -> [Hkv, blocks·bs, D]
    auto gather = [&](const at::Tensor& c) {
      return c.index_select(0, index).transpose(0, 1).reshape({hkv, -1, d}).to(at::kDouble);
    };
    const at::Tensor k = gather(p.k.transpose(2, 3)), v = gather(p.v);
    for (int64_t i = 0; i < run.count; ++i) {
      const int64_t len = run.start + i + 1, blocks = (len + bs - 1) / bs;
      const at::Tensor q = p.q[run.row + i].to(at::kDouble).view({hkv, group, d});
      const at::Tensor kl = k.narrow(1, 0, len), vl = v.narrow(1, 0, len);
      const at::Tensor scores = at::matmul(q, kl.transpose(1, 2)) * scale;  // [Hkv, G, len]
      const at::Tensor out = at::matmul(at::softmax(scores, -1), vl);      // [Hkv, G, D]
      want.out[run.row + i] = out.view({hq, d});
      // Per head: A = max_t scale·Σ|q·k_t|, S = max_t |s_t|, V = max |v|.
      const at::Tensor a = (at::matmul(q.abs(), kl.abs().transpose(1, 2)) * scale).amax(-1);
      const at::Tensor s = scores.abs().amax(-1);
      const at::Tensor big_v = vl.abs().amax({1, 2}).view({hkv, 1}).expand({hkv, group});
      const at::Tensor delta = gamma(static_cast<double>(d + 3)) * a;
      const at::Tensor eta = (2 * (s + delta) + 4) * u;
      const at::Tensor rho = at::exp(delta) * (1 + eta) - 1;
      const double sums = gamma(len + 1.0) + gamma(len) + 2 * gamma(blocks) + u;
      at::Tensor f32 = (big_v * (2 * rho / (1 - rho) + sums)).view({hq, 1}).expand({hq, d});
      if (dtype == at::kBFloat16) f32 = f32 + std::ldexp(1.0, -8) * (out.view({hq, d}).abs() + f32);
      want.bound[run.row + i] = f32;
    }
  }
  return want;
}

// Largest |got - out| / bound: at most 1 within the bound.
double WorstOfBound(const at::Tensor& got, const at::Tensor& out, const at::Tensor& bound) {
  return ((got.to(at::kDouble) - out).abs() / bound).max().item<double>();
}

const PagedShape kPagedShapes[] = {
    {4, 2, 32, 4}, {16, 8, 128, 16}, {8, 8, 64, 5}, {2, 1, 256, 16}, {6, 2, 48, 7}};
// Prefill runs (a whole prompt, a continuation after a prefix) and decode runs.
const std::vector<std::pair<int64_t, int64_t>> kRuns = {{0, 37}, {21, 12}, {40, 1}, {0, 1}, {5, 1}};

TEST(PagedAttentionTest, MatchesExactSoftmaxWithinTheErrorBoundOnEveryPath) {
  for (AttentionPath path : {AttentionPath::kAvx512, AttentionPath::kScalar}) {
    if (!AttentionPathSupported(path)) continue;
    for (const PagedShape& s : kPagedShapes) {
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
        const PagedSetup p = MakePaged(s, dtype, kRuns, 17);
        PagedAttentionOptions o;
        o.scale = 1.0 / std::sqrt(static_cast<double>(s.d));
        o.path = path;
        const at::Tensor got = PagedAttention(p.q, p.k, p.v, p.runs, o);
        ASSERT_EQ(got.sizes(), p.q.sizes());
        ASSERT_EQ(got.scalar_type(), dtype);
        const PagedWant want = PagedReference(p, o.scale, dtype);
        const double worst = WorstOfBound(got, want.out, want.bound);
        EXPECT_LE(worst, 1.0) << AttentionPathName(path) << " " << at::toString(dtype) << " Hq "
                              << s.hq << " D " << s.d << " block " << s.block_size;
        double rel = 0;
        for (int64_t r = 0; r < got.size(0); ++r) rel = std::max(rel, RelErr(got[r], want.out[r]));
        std::printf("  paged %s %s Hq %ld Hkv %ld D %ld block %ld: worst error %.1e of the bound "
                    "(relative to the row's max %.1e)\n",
                    AttentionPathName(path), at::toString(dtype), static_cast<long>(s.hq),
                    static_cast<long>(s.hkv), static_cast<long>(s.d),
                    static_cast<long>(s.block_size), worst, rel);
      }
    }
  }
}

// The bound has teeth: dropping one key of a 37-key prompt's last query
// (an off-by-one in the causal mask) is far outside it.
TEST(PagedAttentionTest, ErrorBoundCatchesAMissingKey) {
  const PagedShape s = {16, 8, 128, 16};
  const PagedSetup p = MakePaged(s, at::kFloat, {{0, 37}}, 19);
  const double scale = 1.0 / std::sqrt(128.0);
  const PagedWant want = PagedReference(p, scale, at::kFloat);
  // Queries 0..35 see one key fewer: query i attends keys 0..i-1 (query 0 none).
  PagedSetup shifted = p;
  shifted.runs = {{1, 36, 0, p.tables[0]}};
  PagedAttentionOptions o;
  o.scale = scale;
  const at::Tensor got = PagedAttention(p.q, p.k, p.v, shifted.runs, o);
  const PagedWant short_want = PagedReference(shifted, scale, at::kFloat);
  // Rows 1..36 (row 0 is no run's): computed right for the shifted runs...
  EXPECT_LE(WorstOfBound(got.narrow(0, 1, 36), short_want.out.narrow(0, 1, 36),
                         short_want.bound.narrow(0, 1, 36)),
            1.0);
  // ...and each is far outside the bound of the full prompt's attention.
  for (int64_t r = 1; r < 37; ++r) {
    EXPECT_GT(WorstOfBound(got[r], want.out[r], want.bound[r]), 10.0) << "row " << r;
  }
}

TEST(PagedAttentionTest, PathsAgree) {
  if (!AttentionPathSupported(AttentionPath::kAvx512)) GTEST_SKIP() << "no AVX-512";
  for (const PagedShape& s : kPagedShapes) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const PagedSetup p = MakePaged(s, dtype, kRuns, 23);
      PagedAttentionOptions o;
      o.scale = 1.0 / std::sqrt(static_cast<double>(s.d));
      o.path = AttentionPath::kAvx512;
      const at::Tensor a = PagedAttention(p.q, p.k, p.v, p.runs, o);
      o.path = AttentionPath::kScalar;
      const at::Tensor b = PagedAttention(p.q, p.k, p.v, p.runs, o);
      // Each path is within the bound of the exact result, so within twice it of the other.
      const PagedWant want = PagedReference(p, o.scale, dtype);
      const double worst =
          ((a.to(at::kDouble) - b.to(at::kDouble)).abs() / (2 * want.bound)).max().item<double>();
      EXPECT_LE(worst, 1.0) << at::toString(dtype) << " D " << s.d;
    }
  }
}

// A query's output is bit-identical whether its prompt runs as one run, as
// single-token runs or beside other runs, with any query tile and 1 or 2
// threads: it depends only on q and keys 0..p.
TEST(PagedAttentionTest, QueryResultDoesNotDependOnRunsTilesOrThreads) {
  for (AttentionPath path : {AttentionPath::kAvx512, AttentionPath::kScalar}) {
    if (!AttentionPathSupported(path)) continue;
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const PagedShape s = {16, 8, 128, 16};
      const PagedSetup p = MakePaged(s, dtype, {{0, 70}}, 29);
      PagedAttentionOptions o;
      o.scale = 1.0 / std::sqrt(128.0);
      o.path = path;
      const at::Tensor whole = PagedAttention(p.q, p.k, p.v, p.runs, o);
      // Single-token runs, in reverse, with tile 1, 2 threads.
      std::vector<PagedQueryRun> singles;
      for (int64_t i = 69; i >= 0; --i) singles.push_back({i, 1, i, p.tables[0]});
      at::set_num_threads(2);
      o.query_tile = 1;
      const at::Tensor single = PagedAttention(p.q, p.k, p.v, singles, o);
      // Uneven runs (a chunked prompt) with tile 7.
      std::vector<PagedQueryRun> chunks = {{0, 5, 0, p.tables[0]}, {5, 30, 5, p.tables[0]},
                                           {35, 1, 35, p.tables[0]}, {36, 34, 36, p.tables[0]}};
      o.query_tile = 7;
      const at::Tensor chunked = PagedAttention(p.q, p.k, p.v, chunks, o);
      at::set_num_threads(1);
      EXPECT_TRUE(at::equal(single, whole)) << AttentionPathName(path) << " " << at::toString(dtype);
      EXPECT_TRUE(at::equal(chunked, whole)) << AttentionPathName(path) << " " << at::toString(dtype);
    }
  }
}

// VLM_ATTENTION_PATH forces the default (ctest runs this once with "scalar").
TEST(PagedAttentionTest, EnvironmentForcesDefaultPath) {
  const char* env = std::getenv("VLM_ATTENTION_PATH");
  if (env == nullptr || *env == '\0') {
    EXPECT_EQ(DefaultAttentionPath(), *ParseAttentionPath("auto"));
  } else {
    EXPECT_EQ(DefaultAttentionPath(), *ParseAttentionPath(env));
  }
}

TEST(PagedAttentionTest, PathNamesParseAndBadInputThrows) {
  EXPECT_EQ(*ParseAttentionPath("scalar"), AttentionPath::kScalar);
  EXPECT_EQ(*ParseAttentionPath("avx512"), AttentionPath::kAvx512);
  EXPECT_TRUE(ParseAttentionPath("auto").ok());
  EXPECT_FALSE(ParseAttentionPath("amx").ok());
  EXPECT_TRUE(AttentionPathSupported(AttentionPath::kScalar));
  const PagedSetup p = MakePaged({4, 2, 32, 4}, at::kFloat, {{0, 9}}, 31);
  PagedAttentionOptions o;
  std::vector<int32_t> table = p.tables[0];
  std::vector<PagedQueryRun> runs = {{0, 9, 0, table}};
  table[1] = static_cast<int32_t>(p.k.size(0));  // outside the cache
  EXPECT_THROW(PagedAttention(p.q, p.k, p.v, runs, o), c10::Error);
  runs = {{0, 9, 0, absl::MakeConstSpan(p.tables[0]).subspan(0, 2)}};  // table too short
  EXPECT_THROW(PagedAttention(p.q, p.k, p.v, runs, o), c10::Error);
  runs = {{5, 9, 0, p.tables[0]}};  // rows outside q
  EXPECT_THROW(PagedAttention(p.q, p.k, p.v, runs, o), c10::Error);
  EXPECT_THROW(PagedAttention(p.q, p.k.to(at::kBFloat16), p.v, {}, o), c10::Error);
}

}  // namespace
}  // namespace vlm::language
