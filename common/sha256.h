// SHA-256 (FIPS 180-4) over bytes, through OpenSSL. Digests are printed as 64
// lowercase hex characters.
//
// Thread-safety: the free functions are reentrant; a Sha256Hasher is used by
// one thread at a time.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace vlm {

using Sha256Digest = std::array<uint8_t, 32>;

Sha256Digest Sha256(const void* data, size_t size);
Sha256Digest Sha256(std::string_view data);
std::string Sha256Hex(const void* data, size_t size);
std::string Sha256Hex(std::string_view data);

// Lowercase hex of arbitrary bytes ("\x01\xab" -> "01ab").
std::string HexEncode(const void* data, size_t size);
std::string HexEncode(const Sha256Digest& digest);

// Incremental hashing: Update any number of times, then Finish once. After
// Finish the hasher is reset and may be reused for a new message.
class Sha256Hasher {
 public:
  Sha256Hasher();
  ~Sha256Hasher();
  Sha256Hasher(Sha256Hasher&&) noexcept;
  Sha256Hasher& operator=(Sha256Hasher&&) noexcept;
  Sha256Hasher(const Sha256Hasher&) = delete;
  Sha256Hasher& operator=(const Sha256Hasher&) = delete;

  void Update(const void* data, size_t size);
  void Update(std::string_view data) { Update(data.data(), data.size()); }
  Sha256Digest Finish();
  std::string FinishHex() { return HexEncode(Finish()); }

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace vlm
