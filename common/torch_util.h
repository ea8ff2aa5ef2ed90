// Small bridges between LibTorch and the project's types, shared by every
// service that runs LibTorch code.
#pragma once

#include <exception>

#include <c10/core/ScalarType.h>

#include "absl/status/status.h"
#include "common/cpu_features.h"

namespace vlm {

// The tensor dtype a compute dtype runs in.
inline at::ScalarType ScalarTypeOf(ComputeDType dtype) {
  return dtype == ComputeDType::kBFloat16 ? at::kBFloat16 : at::kFloat;
}

// A LibTorch (or other) exception as a status prefixed by `where`:
// RESOURCE_EXHAUSTED for std::bad_alloc, INTERNAL otherwise (c10 errors
// without their C++ backtrace).
absl::Status StatusFromException(const char* where, const std::exception& e);

}  // namespace vlm
