#include "services/gateway/api_keys.h"

#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace vlm::gateway {
namespace {

// Equal length and content; the loop does not stop at the first difference.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  }
  return diff == 0;
}

}  // namespace

absl::StatusOr<ApiKeys> ApiKeys::LoadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot read the API keys file ", path, ": ", std::strerror(errno)));
  }
  std::vector<std::string> keys;
  for (std::string line; std::getline(in, line);) {
    absl::string_view key = absl::StripAsciiWhitespace(line);
    if (key.empty() || key[0] == '#') continue;
    keys.emplace_back(key);
  }
  if (keys.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("the API keys file ", path, " holds no key"));
  }
  return ApiKeys(std::move(keys));
}

absl::Status ApiKeys::CheckAuthorization(std::string_view header) const {
  const absl::string_view authorization =
      absl::StripAsciiWhitespace(absl::string_view(header.data(), header.size()));
  if (authorization.empty()) {
    return absl::UnauthenticatedError(
        "an API key is required: send \"Authorization: Bearer YOUR_KEY\"");
  }
  constexpr absl::string_view kScheme = "bearer ";
  if (authorization.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(authorization.substr(0, kScheme.size()), kScheme)) {
    return absl::UnauthenticatedError(
        "the Authorization header must be \"Bearer YOUR_KEY\"");
  }
  const absl::string_view key = absl::StripAsciiWhitespace(authorization.substr(kScheme.size()));
  bool known = false;
  for (const std::string& k : keys_) known |= ConstantTimeEquals(key, k);
  if (!known) return absl::UnauthenticatedError("incorrect API key provided");
  return absl::OkStatus();
}

}  // namespace vlm::gateway
