// UTF-8 validation and replacement decoding for the tokenizer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace vlm::language::utf8 {

// Byte offset of the first ill-formed sequence in `text` (Unicode 15 table 3-7:
// no overlongs, surrogates or code points above U+10FFFF; truncated sequences
// count as ill-formed), or absl::string_view::npos if `text` is well-formed.
size_t FindInvalid(absl::string_view text);

// INVALID_ARGUMENT "<what> is not valid UTF-8: ill-formed sequence at byte
// offset N (bytes ..)" if `text` is ill-formed, OK otherwise.
absl::Status Validate(absl::string_view text, absl::string_view what = "text");

// Appends the UTF-8 encoding of code point `cp` (must be a scalar value).
void Append(uint32_t cp, std::string* out);

// Converts arbitrary bytes to valid UTF-8 exactly like the WHATWG Encoding
// Standard's UTF-8 decoder (the JS TextDecoder): every maximal subpart of an
// ill-formed sequence becomes one U+FFFD. Streaming: bytes may be fed in any
// split; the concatenated output equals a one-shot decode of all the bytes.
// An incomplete trailing sequence is held back until more bytes arrive or
// Flush() turns it into U+FFFD. Not thread-safe.
class ReplacingDecoder {
 public:
  // Appends every character completed by `bytes` to `out`.
  void Feed(absl::string_view bytes, std::string* out);
  // Ends the stream: a held-back incomplete sequence becomes one U+FFFD.
  void Flush(std::string* out);
  // True while an incomplete sequence is held back.
  bool pending() const { return needed_ != 0; }

 private:
  void Reset();

  int needed_ = 0;  // continuation bytes still expected
  uint8_t lower_ = 0x80;
  uint8_t upper_ = 0xBF;
  int held_len_ = 0;
  char held_[4] = {};
};

}  // namespace vlm::language::utf8
