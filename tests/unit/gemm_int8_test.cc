// GemmInt8 (prefill over int8 weights on the blocked GEMM): on every blocked
// path this CPU runs, bit for bit the same as Gemm on the dequantized weight
// packed as bf16 (plain, gate/up with SiLU·up, residual in place), close to
// at::matmul in f64 on those weights, row-invariant, and clear errors for bad
// input. Shapes cover full 512-blocks of the int8 layout, natural-order tail
// groups, K padding, partial panels and more than one row block. The amx
// path runs on the AMX emulation where the CPU has no AMX tiles.
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "common/kernels/amx_emulation_support.h"
#include "common/kernels/gemm.h"
#include "common/kernels/quantize.h"

namespace vlm::kernels {
namespace {

struct Case {
  int64_t m, n, k;
};

// M: 1, few rows (2-panel chunks), tiles with a tail, > 288 (two row blocks).
// K: all-tail (40 -> 64), one full block + a tail group (520 -> 544), full
// blocks only (1024), full blocks + tails (1100 -> 1120), the 2B's 2048.
// N: partial panels (37, 70), whole ones (96).
const std::vector<Case> kCases = {
    {1, 37, 40},    {3, 70, 520},   {13, 96, 1024}, {29, 37, 1100},
    {64, 70, 2048}, {300, 40, 544}, {7, 33, 2048},  {1, 64, 512},
};

QuantizedWeight Quantized(int64_t n, int64_t k) {
  absl::StatusOr<QuantizedWeight> w = QuantizeInt8(at::randn({n, k}) * 0.05);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : QuantizedWeight();
}

// The dequantized weight as bf16, as GemmInt8 documents it.
at::Tensor DequantBf16(const QuantizedWeight& w) {
  return DequantizeInt8(w).to(at::kBFloat16);
}

class GemmInt8PathTest : public ::testing::TestWithParam<GemmPath> {
 protected:
  void SetUp() override {
    at::set_num_threads(2);
    at::manual_seed(20261202);
    if (GetParam() == GemmPath::kAmx) {
      RecordProperty("amx", testing::UseAmxEmulationUnlessHardware());
    }
    std::string missing;
    if (!GemmPathSupported(GetParam(), &missing)) {
      GTEST_SKIP() << "the " << GemmPathName(GetParam()) << " path cannot run here: " << missing;
    }
  }
  GemmOptions Opts(Activation act = Activation::kNone) const {
    GemmOptions o;
    o.activation = act;
    o.path = GetParam();
    return o;
  }
};

TEST_P(GemmInt8PathTest, EqualsGemmOnTheDequantizedWeightBitForBit) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "M=" << c.m << " N=" << c.n << " K=" << c.k);
    const QuantizedWeight w = Quantized(c.n, c.k);
    ASSERT_FALSE(w.empty());
    const at::Tensor x = at::randn({c.m, c.k}).to(at::kBFloat16);
    absl::StatusOr<PackedWeight> packed = PackedWeight::Pack(DequantBf16(w), {}, GetParam());
    ASSERT_TRUE(packed.ok()) << packed.status();
    for (at::ScalarType out : {at::kBFloat16, at::kFloat}) {
      GemmOptions o = Opts();
      o.out_dtype = out;
      at::Tensor y, ref;
      ASSERT_TRUE(GemmInt8(x, w, &y, o).ok());
      ASSERT_TRUE(Gemm(x, *packed, &ref, o).ok());
      EXPECT_TRUE(at::equal(y, ref)) << "max |diff| "
                                     << (y.to(at::kFloat) - ref.to(at::kFloat)).abs().max().item<float>();
    }
    // An independent check of the same product: f64 matmul on the bf16 weight.
    at::Tensor y;
    GemmOptions o = Opts();
    o.out_dtype = at::kFloat;
    ASSERT_TRUE(GemmInt8(x, w, &y, o).ok());
    const at::Tensor wd = DequantBf16(w).to(at::kDouble), xd = x.to(at::kDouble);
    const at::Tensor want = at::matmul(xd, wd.t());
    const at::Tensor bound = at::matmul(xd.abs(), wd.abs().t()) * (2e-6 * std::sqrt(c.k)) + 1e-6;
    EXPECT_TRUE(((y.to(at::kDouble) - want).abs() <= bound).all().item<bool>())
        << "max |err| " << (y.to(at::kDouble) - want).abs().max().item<double>();
  }
}

TEST_P(GemmInt8PathTest, GateUpWithSiluMulEqualsPackGateUp) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "M=" << c.m << " I=" << c.n << " K=" << c.k);
    const QuantizedWeight w = Quantized(2 * c.n, c.k);  // gate rows, then up rows
    ASSERT_FALSE(w.empty());
    const at::Tensor d = DequantBf16(w);
    absl::StatusOr<PackedWeight> packed =
        PackedWeight::PackGateUp(d.narrow(0, 0, c.n), d.narrow(0, c.n, c.n), GetParam());
    ASSERT_TRUE(packed.ok()) << packed.status();
    const at::Tensor x = at::randn({c.m, c.k}).to(at::kBFloat16);
    at::Tensor y, ref;
    ASSERT_TRUE(GemmInt8(x, w, &y, Opts(Activation::kSiluMul)).ok());
    ASSERT_TRUE(Gemm(x, *packed, &ref, Opts(Activation::kSiluMul)).ok());
    ASSERT_EQ(y.sizes(), ref.sizes());
    EXPECT_TRUE(at::equal(y, ref));
  }
}

TEST_P(GemmInt8PathTest, ResidualInPlaceEqualsGemm) {
  const Case c{37, 70, 1100};
  const QuantizedWeight w = Quantized(c.n, c.k);
  absl::StatusOr<PackedWeight> packed = PackedWeight::Pack(DequantBf16(w), {}, GetParam());
  ASSERT_TRUE(packed.ok()) << packed.status();
  const at::Tensor x = at::randn({c.m, c.k}).to(at::kBFloat16);
  // Rows of a wider tensor, as the decoder updates its prefill rows in place.
  at::Tensor base = at::randn({c.m + 5, c.n}).to(at::kBFloat16);
  at::Tensor a = base.clone(), b = base.clone();
  at::Tensor ya = a.narrow(0, 2, c.m), yb = b.narrow(0, 2, c.m);
  GemmOptions oa = Opts(), ob = Opts();
  oa.residual = ya;
  ob.residual = yb;
  ASSERT_TRUE(GemmInt8(x, w, &ya, oa).ok());
  ASSERT_TRUE(Gemm(x, *packed, &yb, ob).ok());
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_FALSE(at::equal(a, base));
}

TEST_P(GemmInt8PathTest, RowsAreTheSameInAnyBatch) {
  const QuantizedWeight w = Quantized(96, 2048);
  const at::Tensor x = at::randn({300, 2048}).to(at::kBFloat16);
  at::Tensor all;
  ASSERT_TRUE(GemmInt8(x, w, &all, Opts()).ok());
  for (int64_t r : {0, 1, 150, 299}) {
    for (int64_t rows : {1, 3, 12}) {
      const int64_t r0 = std::min<int64_t>(r, 300 - rows);
      at::Tensor part;
      ASSERT_TRUE(GemmInt8(x.narrow(0, r0, rows), w, &part, Opts()).ok());
      EXPECT_TRUE(at::equal(part, all.narrow(0, r0, rows))) << "rows " << r0 << " + " << rows;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(BlockedPaths, GemmInt8PathTest,
                         ::testing::Values(GemmPath::kAvx512Bf16, GemmPath::kAmx, GemmPath::kAvx2),
                         [](const auto& info) { return std::string(GemmPathName(info.param)); });

TEST(GemmInt8Test, BadInputGetsAClearStatus) {
  absl::StatusOr<QuantizedWeight> w = QuantizeInt8(at::randn({8, 64}));
  ASSERT_TRUE(w.ok());
  at::Tensor y;
  EXPECT_EQ(GemmInt8(at::randn({2, 64}), QuantizedWeight(), &y).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GemmInt8(at::randn({2, 63}), *w, &y).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GemmInt8(at::randn({2, 64}), *w, nullptr).code(), absl::StatusCode::kInvalidArgument);
  GemmOptions torch;
  torch.path = GemmPath::kTorch;
  EXPECT_EQ(GemmInt8(at::randn({2, 64}), *w, &y, torch).code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<QuantizedWeight> odd = QuantizeInt8(at::randn({7, 64}));
  ASSERT_TRUE(odd.ok());
  GemmOptions silu;
  silu.activation = Activation::kSiluMul;
  EXPECT_EQ(GemmInt8(at::randn({2, 64}), *odd, &y, silu).code(),
            absl::StatusCode::kInvalidArgument);
  at::Tensor wrong = at::empty({2, 5}, at::kFloat);
  EXPECT_EQ(GemmInt8(at::randn({2, 64}), *w, &wrong).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace vlm::kernels
