// Little-endian field encoding shared by the cache's key derivation and its
// disk format (both are pinned byte for byte).
#pragma once

#include <cstdint>
#include <string>

namespace vlm::vision {

inline void AppendU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline void AppendU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline void AppendI64(std::string* out, int64_t v) { AppendU64(out, static_cast<uint64_t>(v)); }

}  // namespace vlm::vision
