// libFuzzer target: the wire tensor codec (vlm.v1.Tensor <-> at::Tensor).
//
// Input: byte 0 gives the expectation (bits 0-2: required rank 0..4, or none
// for 5..7; bit 3: also require shape[0] == 2 when a rank >= 1 is required);
// the rest is a serialized vlm.v1.Tensor. Properties of an accepted tensor:
// the decoded tensor has the message's shape and dtype, owns
// numel * element size bytes equal to the message's data, and encoding it
// again with the same dtype gives back the same shape and the same bytes.
#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/tensor_codec.h"
#include "google/protobuf/stubs/logging.h"
#include "tests/fuzz/fuzz_check.h"

// Protobuf logs every refused UTF-8 string field; refusals are expected here.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  vlm::v1::Tensor proto;
  if (!proto.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
  vlm::DecodeExpectation expect;
  expect.what = "fuzzed";
  const int rank = data[0] & 7;
  if (rank <= 4) {
    expect.rank = rank;
    if ((data[0] & 8) && rank >= 1) {
      expect.shape.assign(rank, -1);
      expect.shape[0] = 2;
    }
  }
  auto tensor = vlm::DecodeTensor(proto, expect);
  if (!tensor.ok()) return 0;
  FUZZ_CHECK(tensor->dim() == proto.shape_size(), "rank %lld for %d dims",
             static_cast<long long>(tensor->dim()), proto.shape_size());
  if (expect.rank >= 0) FUZZ_CHECK(tensor->dim() == expect.rank, "rank not enforced");
  if (!expect.shape.empty()) FUZZ_CHECK(tensor->size(0) == 2, "shape[0] not enforced");
  for (int i = 0; i < proto.shape_size(); ++i) {
    FUZZ_CHECK(tensor->size(i) == proto.shape(i), "dim %d is %lld, message says %lld", i,
               static_cast<long long>(tensor->size(i)), static_cast<long long>(proto.shape(i)));
  }
  FUZZ_CHECK(tensor->is_contiguous(), "decoded tensor is not contiguous");
  const size_t nbytes = static_cast<size_t>(tensor->numel()) * tensor->element_size();
  FUZZ_CHECK(nbytes == proto.data().size(), "%zu tensor bytes for %zu data bytes", nbytes,
             proto.data().size());
  FUZZ_CHECK(nbytes == 0 || std::memcmp(tensor->data_ptr(), proto.data().data(), nbytes) == 0,
             "decoded bytes differ from the message's");
  auto again = vlm::EncodeTensor(*tensor, proto.dtype());
  FUZZ_CHECK(again.ok(), "re-encoding failed: %s", again.status().ToString().c_str());
  FUZZ_CHECK(again->dtype() == proto.dtype() && again->shape_size() == proto.shape_size() &&
                 again->data() == proto.data(),
             "re-encoded tensor differs");
  for (int i = 0; i < proto.shape_size(); ++i) {
    FUZZ_CHECK(again->shape(i) == proto.shape(i), "re-encoded dim %d differs", i);
  }
  return 0;
}
