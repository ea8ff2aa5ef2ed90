#include "common/sha256.h"

#include <openssl/evp.h>

#include <cstdlib>
#include <utility>

namespace vlm {
namespace {

// OpenSSL only fails here on allocation failure or a broken library; neither
// is recoverable, and a wrong digest would silently poison caches.
void Check(int ok) {
  if (ok != 1) std::abort();
}

}  // namespace

struct Sha256Hasher::State {
  EVP_MD_CTX* ctx = nullptr;
  State() : ctx(EVP_MD_CTX_new()) {
    if (ctx == nullptr) std::abort();
    Reset();
  }
  ~State() { EVP_MD_CTX_free(ctx); }
  void Reset() { Check(EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr)); }
};

Sha256Hasher::Sha256Hasher() : state_(std::make_unique<State>()) {}
Sha256Hasher::~Sha256Hasher() = default;
Sha256Hasher::Sha256Hasher(Sha256Hasher&&) noexcept = default;
Sha256Hasher& Sha256Hasher::operator=(Sha256Hasher&&) noexcept = default;

void Sha256Hasher::Update(const void* data, size_t size) {
  if (!state_) state_ = std::make_unique<State>();  // used after being moved from
  if (size > 0) Check(EVP_DigestUpdate(state_->ctx, data, size));
}

Sha256Digest Sha256Hasher::Finish() {
  if (!state_) state_ = std::make_unique<State>();
  Sha256Digest digest;
  unsigned int len = 0;
  Check(EVP_DigestFinal_ex(state_->ctx, digest.data(), &len));
  if (len != digest.size()) std::abort();
  state_->Reset();
  return digest;
}

Sha256Digest Sha256(const void* data, size_t size) {
  Sha256Digest digest;
  unsigned int len = 0;
  Check(EVP_Digest(data, size, digest.data(), &len, EVP_sha256(), nullptr));
  if (len != digest.size()) std::abort();
  return digest;
}

Sha256Digest Sha256(std::string_view data) { return Sha256(data.data(), data.size()); }

std::string Sha256Hex(const void* data, size_t size) { return HexEncode(Sha256(data, size)); }
std::string Sha256Hex(std::string_view data) { return HexEncode(Sha256(data)); }

std::string HexEncode(const void* data, size_t size) {
  static constexpr char kDigits[] = "0123456789abcdef";
  const auto* bytes = static_cast<const uint8_t*>(data);
  std::string out(2 * size, '0');
  for (size_t i = 0; i < size; ++i) {
    out[2 * i] = kDigits[bytes[i] >> 4];
    out[2 * i + 1] = kDigits[bytes[i] & 0xf];
  }
  return out;
}

std::string HexEncode(const Sha256Digest& digest) { return HexEncode(digest.data(), digest.size()); }

}  // namespace vlm
