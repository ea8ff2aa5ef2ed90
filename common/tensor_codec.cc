#include "common/tensor_codec.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "wire tensors are little-endian");

namespace vlm {
namespace {

bool ToScalarType(v1::DType dtype, at::ScalarType* out) {
  switch (dtype) {
    case v1::DTYPE_BF16: *out = at::kBFloat16; return true;
    case v1::DTYPE_F16: *out = at::kHalf; return true;
    case v1::DTYPE_F32: *out = at::kFloat; return true;
    default: return false;
  }
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

size_t WireDTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
    case v1::DTYPE_F16: return 2;
    case v1::DTYPE_F32: return 4;
    default: return 0;
  }
}

const char* WireDTypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16: return "BF16";
    case v1::DTYPE_F16: return "F16";
    case v1::DTYPE_F32: return "F32";
    default: return "UNSPECIFIED";
  }
}

absl::Status EncodeTensor(const at::Tensor& tensor, v1::DType dtype, v1::Tensor* out) {
  at::ScalarType type;
  if (!ToScalarType(dtype, &type)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot encode to wire dtype ", static_cast<int>(dtype)));
  }
  if (!tensor.defined()) return absl::InvalidArgumentError("cannot encode an undefined tensor");
  if (!at::isFloatingType(tensor.scalar_type())) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot encode a ", c10::toString(tensor.scalar_type()), " tensor; expected floating point"));
  }
  try {
    at::Tensor t = tensor.to(at::kCPU, type).contiguous();
    out->Clear();
    out->set_dtype(dtype);
    for (int64_t d : t.sizes()) out->add_shape(d);
    out->mutable_data()->assign(static_cast<const char*>(t.data_ptr()), t.nbytes());
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("encode tensor: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::Tensor> EncodeTensor(const at::Tensor& tensor, v1::DType dtype) {
  v1::Tensor out;
  if (auto s = EncodeTensor(tensor, dtype, &out); !s.ok()) return s;
  return out;
}

absl::StatusOr<at::Tensor> DecodeTensor(const v1::Tensor& proto, const DecodeExpectation& expect) {
  const std::string what(expect.what);
  at::ScalarType type;
  if (!ToScalarType(proto.dtype(), &type)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": unknown or unspecified dtype ", static_cast<int>(proto.dtype())));
  }
  std::vector<int64_t> shape(proto.shape().begin(), proto.shape().end());
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": negative dimension in shape ", ShapeString(shape)));
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": shape ", ShapeString(shape), " overflows"));
    }
  }
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(WireDTypeSize(proto.dtype())), &nbytes) ||
      nbytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": shape ", ShapeString(shape), " overflows"));
  }
  if (proto.data().size() != nbytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", proto.data().size(), " data bytes but shape ",
                                                   ShapeString(shape), " x ", WireDTypeName(proto.dtype()),
                                                   " needs ", nbytes));
  }
  if (!expect.shape.empty() && expect.rank >= 0 && expect.rank != static_cast<int>(expect.shape.size())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expectation is inconsistent (rank ", expect.rank,
                                                   " vs shape ", ShapeString(expect.shape), ")"));
  }
  const int rank = expect.shape.empty() ? expect.rank : static_cast<int>(expect.shape.size());
  if (rank >= 0 && static_cast<int>(shape.size()) != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": expected rank ", rank, ", got shape ", ShapeString(shape)));
  }
  for (size_t i = 0; i < expect.shape.size(); ++i) {
    if (expect.shape[i] >= 0 && expect.shape[i] != shape[i]) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": expected shape ", ShapeString(expect.shape),
                                                     " (-1 = any), got ", ShapeString(shape)));
    }
  }
  try {
    at::Tensor out = at::empty(shape, at::TensorOptions().dtype(type));
    if (nbytes > 0) std::memcpy(out.data_ptr(), proto.data().data(), nbytes);
    return out;
  } catch (const c10::Error& e) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": ", e.what_without_backtrace()));
  }
}

}  // namespace vlm
