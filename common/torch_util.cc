#include "common/torch_util.h"

#include <new>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace vlm {

absl::Status StatusFromException(const char* where, const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    return absl::InternalError(absl::StrCat(where, ": ", c10_error->what_without_backtrace()));
  }
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(where, ": out of memory"));
  }
  return absl::InternalError(absl::StrCat(where, ": ", e.what()));
}

}  // namespace vlm
