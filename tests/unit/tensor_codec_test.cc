#include "common/tensor_codec.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace vlm {
namespace {

using ::testing::HasSubstr;

std::string Bytes(std::initializer_list<int> b) {
  std::string s;
  for (int x : b) s.push_back(static_cast<char>(x));
  return s;
}

TEST(TensorCodecTest, EncodesLittleEndianBytesOfEachWireDType) {
  // 1.0 and -2.0: f32 0x3f800000 / 0xc0000000, bf16 0x3f80 / 0xc000, f16 0x3c00 / 0xc000.
  at::Tensor t = at::tensor({1.0, -2.0}, at::kDouble);
  auto f32 = EncodeTensor(t, v1::DTYPE_F32);
  ASSERT_TRUE(f32.ok()) << f32.status();
  EXPECT_EQ(f32->dtype(), v1::DTYPE_F32);
  ASSERT_EQ(f32->shape_size(), 1);
  EXPECT_EQ(f32->shape(0), 2);
  EXPECT_EQ(f32->data(), Bytes({0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0}));
  auto bf16 = EncodeTensor(t, v1::DTYPE_BF16);
  ASSERT_TRUE(bf16.ok());
  EXPECT_EQ(bf16->data(), Bytes({0x80, 0x3f, 0x00, 0xc0}));
  auto f16 = EncodeTensor(t, v1::DTYPE_F16);
  ASSERT_TRUE(f16.ok());
  EXPECT_EQ(f16->data(), Bytes({0x00, 0x3c, 0x00, 0xc0}));
}

TEST(TensorCodecTest, RoundTripsEveryWireDTypeExactly) {
  at::manual_seed(1);
  for (auto [wire, type] : {std::pair{v1::DTYPE_BF16, at::kBFloat16}, std::pair{v1::DTYPE_F16, at::kHalf},
                            std::pair{v1::DTYPE_F32, at::kFloat}}) {
    at::Tensor t = at::randn({3, 4, 5}).to(type);
    auto proto = EncodeTensor(t, wire);
    ASSERT_TRUE(proto.ok()) << proto.status();
    EXPECT_EQ(proto->data().size(), 60 * t.element_size());
    auto back = DecodeTensor(*proto);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->scalar_type(), type);
    EXPECT_EQ(back->sizes(), t.sizes());
    EXPECT_TRUE(at::equal(*back, t));
  }
}

TEST(TensorCodecTest, EncodeConvertsDTypeAndMakesNonContiguousInputRowMajor) {
  at::Tensor t = at::arange(6, at::kFloat).reshape({2, 3}).t();  // [3, 2], strided
  ASSERT_FALSE(t.is_contiguous());
  auto proto = EncodeTensor(t, v1::DTYPE_BF16);
  ASSERT_TRUE(proto.ok());
  auto back = DecodeTensor(*proto);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->sizes(), t.sizes());
  EXPECT_TRUE(at::equal(back->to(at::kFloat), t));  // small integers are exact in bf16
  // float -> bf16 conversion is round-to-nearest-even, as LibTorch's.
  at::Tensor x = at::randn({64});
  auto px = EncodeTensor(x, v1::DTYPE_BF16);
  ASSERT_TRUE(px.ok());
  EXPECT_TRUE(at::equal(*DecodeTensor(*px), x.to(at::kBFloat16)));
}

TEST(TensorCodecTest, EncodeRejectsNonFloatAndBadWireDType) {
  auto s1 = EncodeTensor(at::arange(4, at::kLong), v1::DTYPE_F32);
  EXPECT_EQ(s1.status().code(), absl::StatusCode::kInvalidArgument);
  auto s2 = EncodeTensor(at::ones({2}), v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(s2.status().code(), absl::StatusCode::kInvalidArgument);
  auto s3 = EncodeTensor(at::Tensor(), v1::DTYPE_F32);
  EXPECT_EQ(s3.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorCodecTest, DecodedTensorOwnsItsMemory) {
  auto proto = EncodeTensor(at::ones({4}), v1::DTYPE_F32);
  ASSERT_TRUE(proto.ok());
  auto t = DecodeTensor(*proto);
  ASSERT_TRUE(t.ok());
  proto->mutable_data()->assign(16, '\0');
  EXPECT_TRUE(at::equal(*t, at::ones({4})));
}

TEST(TensorCodecTest, DecodeHandlesEmptyAndScalarShapes) {
  v1::Tensor empty;
  empty.set_dtype(v1::DTYPE_F16);
  empty.add_shape(0);
  empty.add_shape(7);
  auto e = DecodeTensor(empty);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->numel(), 0);
  EXPECT_EQ(e->dim(), 2);
  v1::Tensor scalar;
  scalar.set_dtype(v1::DTYPE_F32);
  scalar.set_data(Bytes({0x00, 0x00, 0x80, 0x3f}));
  auto s = DecodeTensor(scalar);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->dim(), 0);
  EXPECT_EQ(s->item<float>(), 1.0f);
}

v1::Tensor Valid() {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_BF16);
  t.add_shape(2);
  t.add_shape(3);
  t.set_data(std::string(12, '\0'));
  return t;
}

void ExpectInvalid(const v1::Tensor& t, const DecodeExpectation& e, const std::string& needle) {
  auto r = DecodeTensor(t, e);
  ASSERT_FALSE(r.ok()) << needle;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(needle));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(std::string(e.what)));
}

TEST(TensorCodecTest, DecodeRejectsInconsistentMessagesNamingTheMismatch) {
  DecodeExpectation e;
  e.what = "last_hidden";
  v1::Tensor t = Valid();
  t.set_dtype(v1::DTYPE_UNSPECIFIED);
  ExpectInvalid(t, e, "dtype");
  t = Valid();
  t.set_dtype(static_cast<v1::DType>(77));
  ExpectInvalid(t, e, "dtype 77");
  t = Valid();
  t.set_shape(1, -3);
  ExpectInvalid(t, e, "negative");
  t = Valid();
  t.mutable_data()->pop_back();
  ExpectInvalid(t, e, "11 data bytes but shape [2, 3] x BF16 needs 12");
  t = Valid();
  t.set_shape(0, int64_t{1} << 40);
  t.set_shape(1, int64_t{1} << 40);
  ExpectInvalid(t, e, "overflows");
  t = Valid();
  t.set_shape(0, int64_t{1} << 62);
  t.set_shape(1, 1);  // numel fits, bytes do not
  ExpectInvalid(t, e, "overflows");
}

TEST(TensorCodecTest, DecodeChecksExpectedRankAndShape) {
  DecodeExpectation rank3;
  rank3.what = "deepstack[0]";
  rank3.rank = 3;
  ExpectInvalid(Valid(), rank3, "expected rank 3");
  DecodeExpectation shape;
  shape.what = "features";
  shape.shape = {-1, 4};
  ExpectInvalid(Valid(), shape, "expected shape [-1, 4]");
  shape.shape = {-1, 3};
  EXPECT_TRUE(DecodeTensor(Valid(), shape).ok());
  shape.shape = {2, 3};
  shape.rank = 2;
  EXPECT_TRUE(DecodeTensor(Valid(), shape).ok());
  shape.rank = 1;
  ExpectInvalid(Valid(), shape, "inconsistent");
}

TEST(TensorCodecTest, WireDTypeHelpers) {
  EXPECT_EQ(WireDTypeSize(v1::DTYPE_BF16), 2u);
  EXPECT_EQ(WireDTypeSize(v1::DTYPE_F16), 2u);
  EXPECT_EQ(WireDTypeSize(v1::DTYPE_F32), 4u);
  EXPECT_EQ(WireDTypeSize(v1::DTYPE_UNSPECIFIED), 0u);
  EXPECT_STREQ(WireDTypeName(v1::DTYPE_BF16), "BF16");
}

}  // namespace
}  // namespace vlm
