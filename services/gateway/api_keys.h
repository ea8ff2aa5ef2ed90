// API keys: a fixed set of bearer tokens, read once from a file (one key per
// line; blank lines and lines starting with '#' are skipped; surrounding
// whitespace is trimmed). Both front ends check the same header value:
// HTTP `Authorization: Bearer KEY`, gRPC `authorization: Bearer KEY` metadata.
//
// Thread-safety: immutable after construction.
#ifndef VLM_SERVICES_GATEWAY_API_KEYS_H_
#define VLM_SERVICES_GATEWAY_API_KEYS_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vlm::gateway {

class ApiKeys {
 public:
  // Errors: the file cannot be read (NOT_FOUND / PERMISSION_DENIED ...), or it
  // holds no key (INVALID_ARGUMENT: an empty file must not silently mean "open").
  static absl::StatusOr<ApiKeys> LoadFile(const std::string& path);
  explicit ApiKeys(std::vector<std::string> keys) : keys_(std::move(keys)) {}

  // OK when `authorization` is "Bearer <a known key>" (scheme case-insensitive);
  // otherwise UNAUTHENTICATED saying whether the key was missing or wrong.
  // Compares in time independent of where a wrong key differs.
  absl::Status CheckAuthorization(std::string_view authorization) const;

  size_t size() const { return keys_.size(); }

 private:
  std::vector<std::string> keys_;
};

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_API_KEYS_H_
