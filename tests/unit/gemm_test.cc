// Every GEMM path forced in turn against at::matmul in f32 on the same
// bf16-rounded inputs; fused epilogues; row invariance; bad input. The amx
// path runs on real tiles where the CPU has them, else on the AMX emulation
// (amx_emulation.h), so it never skips on an AVX-512 BF16 machine; its sums
// are also checked bit for bit against the SDM's TDPBF16PS order.
#include "common/cpu_features.h"
#include "common/kernels/gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "common/kernels/amx_emulation_support.h"
#include "common/kernels/gemm_internal.h"

namespace vlm::kernels {
namespace {

at::Tensor Bf16Round(const at::Tensor& t) { return t.to(at::kBFloat16).to(at::kFloat); }

GemmOptions Opts(Activation act, at::ScalarType out = at::kBFloat16) {
  GemmOptions o;
  o.activation = act;
  o.out_dtype = out;
  return o;
}

struct Case {
  int64_t m, n, k;
};

// f32 reference of act(x·wᵀ + b) + r on bf16-rounded x and w, and the bound
// of f32 summation error: 2e-6·sqrt(K)·(|x|·|w|ᵀ) (bf16 products are exact in
// f32; only the order of the K additions differs).
// The torch path gets at::linear's output already rounded to bf16 (oneDNN
// writes bf16) before the epilogue: `rounding` is that extra half ulp.
struct Reference {
  at::Tensor value;
  at::Tensor tolerance;
  at::Tensor rounding;
};

Reference MakeReference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                        Activation act, const at::Tensor& residual) {
  const at::Tensor xr = Bf16Round(x), wr = Bf16Round(w);
  at::Tensor v = at::matmul(xr.to(at::kDouble), wr.to(at::kDouble).t());
  at::Tensor abs_dot = at::matmul(xr.abs().to(at::kDouble), wr.abs().to(at::kDouble).t());
  const at::Tensor pre = v.abs();
  if (bias.defined()) v = v + bias.to(at::kDouble);
  at::Tensor slope = at::ones_like(v);  // |d act / d v| bound, to carry the error through
  if (act == Activation::kGeluTanh) v = at::gelu(v, "tanh"), slope = slope * 1.2;
  if (act == Activation::kGeluErf) v = at::gelu(v), slope = slope * 1.2;
  if (residual.defined()) v = v + residual.to(at::kDouble);
  const double k = static_cast<double>(x.size(1));
  return {v, abs_dot * slope * (2e-6 * std::sqrt(k)) + 1e-6, pre * slope * (1.0 / 256)};
}

// y (f32 or bf16) against the reference: within the summation bound, plus
// half a bf16 ulp (2^-8 relative with margin) when y is bf16.
void ExpectClose(const at::Tensor& y, const Reference& ref, const std::string& what,
                 bool rounded_before_epilogue) {
  const at::Tensor yd = y.to(at::kDouble);
  at::Tensor tol = ref.tolerance;
  if (rounded_before_epilogue) tol = tol + ref.rounding;
  if (y.scalar_type() == at::kBFloat16) tol = tol + ref.value.abs() * (1.0 / 256);
  const at::Tensor excess = (yd - ref.value).abs() - tol;
  const double worst = excess.max().item<double>();
  EXPECT_LE(worst, 0.0) << what << ": worst excess over tolerance " << worst
                        << " (max |err| " << (yd - ref.value).abs().max().item<double>() << ")";
  EXPECT_FALSE(y.isnan().any().item<bool>()) << what;
}

class GemmPathTest : public ::testing::TestWithParam<GemmPath> {
 protected:
  void SetUp() override {
    at::set_num_threads(2);
    at::manual_seed(20261201);
    if (GetParam() == GemmPath::kAmx) {
      RecordProperty("amx", testing::UseAmxEmulationUnlessHardware());
    }
    std::string missing;
    if (!GemmPathSupported(GetParam(), &missing)) {
      GTEST_SKIP() << "the " << GemmPathName(GetParam()) << " path cannot run here: " << missing;
    }
  }
  bool torch() const { return GetParam() == GemmPath::kTorch; }
  PackedWeight Pack(const at::Tensor& w, const at::Tensor& b = {}) {
    absl::StatusOr<PackedWeight> p = PackedWeight::Pack(w, b, GetParam());
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : PackedWeight();
  }
};

TEST_P(GemmPathTest, MatchesMatmulOnRandomShapesWithTails) {
  // Odd M, N, K; M from 1 to 4096; N and K not multiples of the panel width.
  const std::vector<Case> cases = {{1, 1, 1},     {1, 33, 17},   {2, 31, 64},  {3, 64, 31},
                                   {5, 100, 96},  {11, 47, 129}, {12, 32, 32}, {13, 65, 95},
                                   {31, 96, 257}, {97, 160, 63}, {257, 33, 130},
                                   {1000, 50, 40}, {4096, 40, 33},
                                   // K in several blocks of 512, odd and even, at
                                   // and past a block edge; N over several
                                   // 8-panel chunks
                                   {5, 40, 2049},  {29, 100, 3000}, {14, 300, 256},
                                   {25, 520, 257}, {50, 600, 4097}, {40, 70, 512},
                                   {30, 70, 513},
                                   // M over several row blocks of 24 tiles
                                   {601, 70, 1030}};
  for (const Case& c : cases) {
    const at::Tensor x = at::randn({c.m, c.k});
    const at::Tensor w = at::randn({c.n, c.k}) * 0.1;
    const PackedWeight pw = Pack(w);
    for (at::ScalarType out : {at::kFloat, at::kBFloat16}) {
      GemmOptions o;
      o.out_dtype = out;
      absl::StatusOr<at::Tensor> y = Gemm(x.to(at::kBFloat16), pw, o);
      ASSERT_TRUE(y.ok()) << y.status();
      ASSERT_EQ(y->scalar_type(), out);
      ExpectClose(*y, MakeReference(x, w, {}, Activation::kNone, {}),
                  "M=" + std::to_string(c.m) + " N=" + std::to_string(c.n) +
                      " K=" + std::to_string(c.k), torch());
    }
  }
}

TEST_P(GemmPathTest, F32InputIsRoundedToBf16First) {
  const at::Tensor x = at::randn({7, 70}), w = at::randn({45, 70});
  absl::StatusOr<at::Tensor> y32 = Gemm(x, Pack(w), Opts(Activation::kNone, at::kFloat));
  ASSERT_TRUE(y32.ok()) << y32.status();
  ExpectClose(*y32, MakeReference(x, w, {}, Activation::kNone, {}), "f32 x", torch());
}

TEST_P(GemmPathTest, FusedEpiloguesMatchUnfusedMath) {
  const int64_t m = 37, n = 77, k = 96;
  const at::Tensor x = at::randn({m, k}), w = at::randn({n, k}) * 0.2, b = at::randn({n});
  const PackedWeight pw = Pack(w, b);
  for (Activation act : {Activation::kNone, Activation::kGeluTanh, Activation::kGeluErf}) {
    for (at::ScalarType rdt : {at::kFloat, at::kBFloat16}) {
      const at::Tensor residual = at::randn({m, n}).to(rdt);
      GemmOptions o;
      o.activation = act;
      o.residual = residual;
      o.out_dtype = at::kFloat;
      absl::StatusOr<at::Tensor> y = Gemm(x.to(at::kBFloat16), pw, o);
      ASSERT_TRUE(y.ok()) << y.status();
      ExpectClose(*y, MakeReference(x, w, b, act, residual.to(at::kFloat)),
                  "activation " + std::to_string(static_cast<int>(act)), torch());
    }
  }
}

TEST_P(GemmPathTest, GeluCoversTheWholeRangeAccurately) {
  // x = identity picks single weights: y = gelu(w·1 + bias) over [-12, 12].
  const int64_t n = 1001;
  const at::Tensor v = at::linspace(-12, 12, n);
  const at::Tensor x = at::ones({1, 2});
  const at::Tensor w = at::zeros({n, 2});
  for (Activation act : {Activation::kGeluTanh, Activation::kGeluErf}) {
    absl::StatusOr<at::Tensor> y = Gemm(x, Pack(w, v), Opts(act, at::kFloat));
    ASSERT_TRUE(y.ok()) << y.status();
    const at::Tensor vd = v.to(at::kDouble);
    const at::Tensor ref = act == Activation::kGeluTanh ? at::gelu(vd, "tanh") : at::gelu(vd);
    const double err = (y->to(at::kDouble).view({n}) - ref).abs().max().item<double>();
    EXPECT_LT(err, 2e-6) << "activation " << static_cast<int>(act);
  }
}

TEST_P(GemmPathTest, GateUpGivesSiluTimesUp) {
  const int64_t m = 29, inter = 75, k = 64;
  const at::Tensor x = at::randn({m, k}), g = at::randn({inter, k}) * 0.2,
                   u = at::randn({inter, k}) * 0.2;
  absl::StatusOr<PackedWeight> pw = PackedWeight::PackGateUp(g, u, GetParam());
  ASSERT_TRUE(pw.ok()) << pw.status();
  EXPECT_EQ(pw->n(), inter);
  absl::StatusOr<at::Tensor> y =
      Gemm(x.to(at::kBFloat16), *pw, Opts(Activation::kSiluMul, at::kFloat));
  ASSERT_TRUE(y.ok()) << y.status();
  const at::Tensor xr = Bf16Round(x).to(at::kDouble);
  const at::Tensor gate = at::matmul(xr, Bf16Round(g).to(at::kDouble).t());
  const at::Tensor up = at::matmul(xr, Bf16Round(u).to(at::kDouble).t());
  const at::Tensor ref = at::silu(gate) * up;
  const double err = (y->to(at::kDouble) - ref).abs().max().item<double>();
  // torch: gate and up come back from at::linear rounded to bf16.
  EXPECT_LT(err, (torch() ? 1e-2 : 1e-4) * ref.abs().max().item<double>());
}

TEST_P(GemmPathTest, RowsAreBitIdenticalWhateverTheBatchAndThreads) {
  if (GetParam() == GemmPath::kTorch) GTEST_SKIP() << "the torch path promises no row invariance";
  // K: one block (odd and even), exactly one block, two blocks (the second
  // partial), several blocks (odd last block); n = 300: two panel chunks, the
  // second partial, and a partial last panel. m = 301 runs as two row blocks
  // of 13 tiles; the sub-batches as one block or two of other heights.
  for (int64_t k : {200, 512, 333, 1000, 2561}) {
  const int64_t m = 301, n = 300;
  const at::Tensor x = at::randn({m, k}).to(at::kBFloat16), w = at::randn({n, k});
  const PackedWeight pw = Pack(w, at::randn({n}));
  GemmOptions o;
  o.out_dtype = at::kFloat;
  o.threads = 2;
  absl::StatusOr<at::Tensor> full = Gemm(x, pw, o);
  ASSERT_TRUE(full.ok()) << full.status();
  // Sub-batches at every offset and length class (tails of 12, 32 and 96).
  for (auto [begin, len] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 1}, {5, 1}, {300, 1}, {1, 7}, {13, 12}, {40, 33}, {100, 97}, {3, 250},
           {1, 289}}) {
    for (int threads : {1, 2}) {
      o.threads = threads;
      absl::StatusOr<at::Tensor> part = Gemm(x.narrow(0, begin, len), pw, o);
      ASSERT_TRUE(part.ok()) << part.status();
      EXPECT_TRUE(at::equal(*part, full->narrow(0, begin, len)))
          << "rows " << begin << ".." << begin + len - 1 << " with " << threads << " threads, K "
          << k;
    }
  }
  }
}

TEST_P(GemmPathTest, WritesIntoStridedOutputAndResidualInPlace) {
  const int64_t m = 20, n = 40, k = 64;
  const at::Tensor x = at::randn({m, k}), w = at::randn({n, k}) * 0.1;
  at::Tensor big = at::randn({m, n + 8});
  at::Tensor y = big.narrow(1, 4, n);  // row stride n + 8
  const at::Tensor before = y.clone();
  GemmOptions o;
  o.residual = y;  // y += x·wᵀ
  ASSERT_TRUE(Gemm(x.to(at::kBFloat16), Pack(w), &y, o).ok());
  ExpectClose(y, MakeReference(x, w, {}, Activation::kNone, before), "in-place residual", torch());
  EXPECT_TRUE(at::equal(big.narrow(1, 0, 4), big.narrow(1, 0, 4)));
}

INSTANTIATE_TEST_SUITE_P(Paths, GemmPathTest,
                         ::testing::Values(GemmPath::kAmx, GemmPath::kAvx512Bf16, GemmPath::kAvx2,
                                           GemmPath::kTorch),
                         [](const auto& info) { return std::string(GemmPathName(info.param)); });

TEST(GemmTest, BadInputGetsInvalidArgument) {
  const at::Tensor w = at::randn({8, 16});
  absl::StatusOr<PackedWeight> pw = PackedWeight::Pack(w, {}, GemmPath::kTorch);
  ASSERT_TRUE(pw.ok());
  auto code = [&](const at::Tensor& x, GemmOptions o = {}) {
    return Gemm(x, *pw, o).status().code();
  };
  EXPECT_EQ(code(at::randn({3, 15})), absl::StatusCode::kInvalidArgument);  // K mismatch
  EXPECT_EQ(code(at::randn({3, 16}).to(at::kLong)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(at::randn({16})), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(at::Tensor()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(at::randn({3, 16}), Opts(Activation::kSiluMul)),
            absl::StatusCode::kInvalidArgument);
  GemmOptions bad_residual;
  bad_residual.residual = at::randn({3, 9});
  EXPECT_EQ(code(at::randn({3, 16}), bad_residual), absl::StatusCode::kInvalidArgument);
  GemmOptions other_family;
  other_family.path = GemmPath::kAvx512Bf16;
  EXPECT_EQ(code(at::randn({3, 16}), other_family),
            absl::StatusCode::kInvalidArgument);  // packed for torch
  EXPECT_EQ(PackedWeight::Pack(at::randn({4})).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PackedWeight::Pack(w, at::randn({7})).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PackedWeight::PackGateUp(w, at::randn({8, 15})).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseGemmPath("fast").status().code(), absl::StatusCode::kInvalidArgument);
  at::Tensor y;
  EXPECT_EQ(Gemm(at::randn({2, 16}), PackedWeight(), &y).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GemmTest, UnsupportedPathIsFailedPrecondition) {
  for (GemmPath p : {GemmPath::kAmx, GemmPath::kAvx512Bf16, GemmPath::kAvx2}) {
    std::string missing;
    if (GemmPathSupported(p, &missing)) continue;
    EXPECT_FALSE(missing.empty());
    EXPECT_EQ(PackedWeight::Pack(at::randn({4, 4}), {}, p).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

TEST(GemmTest, AutomaticChoiceLeavesAmxOutUntilVerified) {
  testing::UseAmxEmulationUnlessHardware();
  EXPECT_NE(AutoGemmPath(), GemmPath::kAmx);
  EXPECT_TRUE(GemmPathSupported(AutoGemmPath()));
}

TEST(GemmTest, SetDefaultGemmPathChangesWhatPackUses) {
  testing::UseAmxEmulationUnlessHardware();
  if (!GemmPathSupported(GemmPath::kAmx)) GTEST_SKIP() << "no AVX-512 BF16 for the epilogue";
  const GemmPath before = DefaultGemmPath();
  ASSERT_TRUE(SetDefaultGemmPath(GemmPath::kAmx).ok());
  absl::StatusOr<PackedWeight> p = PackedWeight::Pack(at::randn({4, 4}));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->path(), GemmPath::kAmx);
  ASSERT_TRUE(SetDefaultGemmPath(before).ok());
  EXPECT_EQ(DefaultGemmPath(), before);
}

// The TDPBF16PS sums of the AMX kernel as the SDM's Operation section gives
// them, written out as plain loops: per output, per 32-wide K block (one
// TDPBF16PS on 16 pairs), the even and the odd products each summed by FMA
// from zero, denormals flushed (inputs DAZ, results FTZ); then
// acc += (even + odd). The epilogue adds the bias in f32.
float FlushF32(float f) { return std::fpclassify(f) == FP_SUBNORMAL ? std::copysign(0.0f, f) : f; }

at::Tensor SdmOrderReference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous(), wf = w.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const float* wp = wf.data_ptr<float>();
  const at::Tensor bf = bias.defined() ? bias.to(at::kFloat).contiguous() : at::zeros({n});
  const float* bp = bf.data_ptr<float>();
  at::Tensor y = at::empty({m, n});
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0;
      for (int64_t k0 = 0; k0 < k; k0 += 32) {
        float even = 0, odd = 0;
        for (int64_t kk = k0; kk < std::min(k, k0 + 32); ++kk) {
          const float a = FlushF32(xp[i * k + kk]), b = FlushF32(wp[j * k + kk]);
          float& part = kk % 2 == 0 ? even : odd;
          part = FlushF32(std::fma(a, b, part));
        }
        acc = FlushF32(acc + FlushF32(even + odd));
      }
      yp[i * n + j] = bias.defined() ? acc + bp[j] : acc;
    }
  }
  return y;
}

TEST(GemmAmxTest, SumsEqualTheSdmOrderBitForBitAndStayWithinTheBound) {
  const std::string mode = testing::UseAmxEmulationUnlessHardware();
  if (!GetCpuFeatures().avx512bf16) {
    GTEST_SKIP() << "the amx path needs AVX-512 BF16 (its epilogue) even when emulated; this "
                    "CPU or VLM_ISA does not offer it";
  }
  std::string missing;
  ASSERT_TRUE(GemmPathSupported(GemmPath::kAmx, &missing)) << missing;
  at::manual_seed(7);
  const uint64_t dots_before = testing::EmulatedTileDotInstructions();
  // Row tails of 1, 16 and 31 past 32-row blocks, a row block boundary (96),
  // column tails, K tails inside a pair and a block, K below one block.
  for (Case c : std::vector<Case>{{1, 1, 1}, {17, 33, 31}, {63, 70, 100}, {100, 45, 513},
                                  {33, 300, 64}, {97, 64, 1001}}) {
    SCOPED_TRACE(::testing::Message() << "M=" << c.m << " N=" << c.n << " K=" << c.k);
    const at::Tensor x = at::randn({c.m, c.k}).to(at::kBFloat16);
    const at::Tensor w = (at::randn({c.n, c.k}) * 0.1).to(at::kBFloat16);
    const at::Tensor b = at::randn({c.n});
    absl::StatusOr<PackedWeight> pw = PackedWeight::Pack(w, b, GemmPath::kAmx);
    ASSERT_TRUE(pw.ok()) << pw.status();
    GemmOptions o;
    o.out_dtype = at::kFloat;
    o.threads = 2;
    absl::StatusOr<at::Tensor> y = Gemm(x, *pw, o);
    ASSERT_TRUE(y.ok()) << y.status();
    const at::Tensor ref = SdmOrderReference(x, w, b);
    EXPECT_TRUE(at::equal(*y, ref)) << "differing elements: "
                                    << (*y != ref).sum().item<int64_t>() << " of " << ref.numel();
    // Bound of the f64 product: each even/odd chain rounds at most 16 times,
    // their sum once, the running sum once per block, the bias once:
    // |err| <= γ(d)·Σ|x·w| + u·|y| with d = 17 + blocks, γ(d) = d·u / (1 - d·u).
    const double u = std::ldexp(1.0, -24);
    const double d = 17.0 + static_cast<double>((c.k + 31) / 32);
    const at::Tensor xd = x.to(at::kDouble), wd = w.to(at::kDouble);
    const at::Tensor exact = at::matmul(xd, wd.t()) + b.to(at::kDouble);
    const at::Tensor bound = at::matmul(xd.abs(), wd.abs().t()) * (d * u / (1 - d * u)) +
                             exact.abs() * (2 * u);
    const at::Tensor excess = (y->to(at::kDouble) - exact).abs() - bound;
    EXPECT_LE(excess.max().item<double>(), 0.0);
  }
  if (mode == "emulation") {
    EXPECT_GT(testing::EmulatedTileDotInstructions(), dots_before) << "the emulated tiles did not run";
  }
}

// Only where the CPU has AMX: the hardware's tiles against the emulation.
TEST(GemmAmxTest, RealTilesMatchTheEmulationBitForBit) {
  if (!testing::HaveAmxHardware()) GTEST_SKIP() << "no AMX tiles here (the emulation runs instead)";
  internal::SetAmxBlockKernel(nullptr);
  const at::Tensor x = at::randn({77, 1000}).to(at::kBFloat16);
  absl::StatusOr<PackedWeight> pw =
      PackedWeight::Pack(at::randn({130, 1000}), at::randn({130}), GemmPath::kAmx);
  ASSERT_TRUE(pw.ok()) << pw.status();
  GemmOptions o;
  o.out_dtype = at::kFloat;
  absl::StatusOr<at::Tensor> hardware = Gemm(x, *pw, o);
  testing::UseAmxEmulation();
  absl::StatusOr<at::Tensor> emulated = Gemm(x, *pw, o);
  internal::SetAmxBlockKernel(nullptr);
  ASSERT_TRUE(hardware.ok() && emulated.ok());
  EXPECT_TRUE(at::equal(*hardware, *emulated))
      << (*hardware != *emulated).sum().item<int64_t>() << " elements differ";
}

TEST(GemmTest, PackedBytesAreReported) {
  const at::Tensor w = at::randn({64, 100});
  absl::StatusOr<PackedWeight> p = PackedWeight::Pack(w, at::randn({64}));
  ASSERT_TRUE(p.ok());
  if (p->path() == GemmPath::kTorch) {
    EXPECT_EQ(p->bytes(), 64u * 100 * 2 + 64 * 4);  // bf16 copy of an f32 weight + f32 bias
  } else {
    EXPECT_EQ(p->bytes(), 2u * 128 * 32 * 2 + 64 * 4);  // 2 panels x 128 (padded) K + bias
  }
}

// Run by ctest with VLM_GEMM_PATH set (gemm_test_env_path).
TEST(GemmTest, EnvironmentChoosesTheDefaultPath) {
  const char* env = std::getenv("VLM_GEMM_PATH");
  if (env == nullptr) GTEST_SKIP() << "VLM_GEMM_PATH is not set";
  absl::StatusOr<GemmPath> want = ParseGemmPath(env);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(DefaultGemmPath(), *want);
  absl::StatusOr<PackedWeight> p = PackedWeight::Pack(at::randn({4, 4}));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->path(), *want);
}

}  // namespace
}  // namespace vlm::kernels
