// Conversion between at::Tensor and the wire's vlm.v1.Tensor (dtype BF16, F16
// or F32; row-major shape; little-endian bytes).
//
// Decode never trusts the message: dtype, shape and byte count are checked
// (overflow-safe) before any byte is read, and the result owns its memory.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "vlm/v1/common.pb.h"

namespace at {
class Tensor;
}

namespace vlm {

// Bytes per element of a wire dtype; 0 for DTYPE_UNSPECIFIED or unknown values.
size_t WireDTypeSize(v1::DType dtype);
const char* WireDTypeName(v1::DType dtype);  // "BF16", "F16", "F32", "UNSPECIFIED"

// Encodes a floating-point tensor (any float dtype, any strides) as `dtype`:
// a contiguous, converted copy. INVALID_ARGUMENT for an undefined or
// non-floating tensor or an unsupported wire dtype.
absl::Status EncodeTensor(const at::Tensor& tensor, v1::DType dtype, v1::Tensor* out);
absl::StatusOr<v1::Tensor> EncodeTensor(const at::Tensor& tensor, v1::DType dtype);

struct DecodeExpectation {
  // Names the tensor in messages, e.g. "last_hidden".
  std::string_view what = "tensor";
  // If >= 0, the required number of dimensions.
  int rank = -1;
  // If non-empty, the required shape; -1 entries accept any size. Implies rank.
  std::vector<int64_t> shape;
};

// Decodes into an owning CPU tensor of the wire dtype (kBFloat16/kHalf/kFloat).
// INVALID_ARGUMENT naming `what` and the mismatch on any inconsistency.
absl::StatusOr<at::Tensor> DecodeTensor(const v1::Tensor& proto, const DecodeExpectation& expect = {});

}  // namespace vlm
