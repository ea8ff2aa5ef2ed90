// libFuzzer target: the Qwen3 tokenizer's Encode / Decode and the streaming
// detokenizer, on the real tokenizer.json (fuzz_check.h says where it is read).
//
// Input: byte 0 selects the mode, the rest is the payload.
//   even: payload is text. Encode must accept exactly the valid UTF-8 texts
//         (utf8::FindInvalid), and for an NFC text Decode(Encode(text)) is the
//         text again (byte-level BPE is lossless; NFC is the only rewrite).
//   odd:  payload is little-endian uint32 ids taken modulo vocab_size + 16 (so
//         some are out of range); bit 1 of byte 0 is skip_special_tokens.
//         Decode fails exactly when an id is invalid; otherwise its text is
//         valid UTF-8 and equals the concatenated deltas of a
//         StreamingDetokenizer fed one id at a time (the header's contract).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include "services/language/text/tokenizer.h"
#include "services/language/text/utf8.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_tokenizer.h"

namespace {

using vlm::language::StreamingDetokenizer;
using vlm::language::Tokenizer;
namespace utf8 = vlm::language::utf8;

bool IsNfc(const std::string& text) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
  if (U_FAILURE(status)) return false;
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(text);
  bool normalized = nfc->isNormalized(u, status);
  return U_SUCCESS(status) && normalized;
}

void FuzzEncode(const Tokenizer& tokenizer, const std::string& text) {
  auto ids = tokenizer.Encode(text);
  const bool valid = utf8::FindInvalid(text) == absl::string_view::npos;
  FUZZ_CHECK(ids.ok() == valid, "Encode ok=%d but valid UTF-8=%d (%s)", ids.ok(), valid,
             ids.status().ToString().c_str());
  if (!ids.ok()) return;
  for (int32_t id : *ids) FUZZ_CHECK(tokenizer.IsValidId(id), "Encode produced invalid id %d", id);
  if (!IsNfc(text)) return;
  auto back = tokenizer.Decode(*ids);
  FUZZ_CHECK(back.ok(), "Decode of Encode output failed: %s", back.status().ToString().c_str());
  FUZZ_CHECK(*back == text, "Decode(Encode(text)) differs: %zu bytes in, %zu bytes out",
             text.size(), back->size());
}

void FuzzDecode(const Tokenizer& tokenizer, const uint8_t* data, size_t size, bool skip_special) {
  std::vector<int32_t> ids;
  const uint32_t modulus = static_cast<uint32_t>(tokenizer.vocab_size()) + 16;
  for (size_t i = 0; i + 4 <= size && ids.size() < 4096; i += 4) {
    uint32_t v = uint32_t{data[i]} | uint32_t{data[i + 1]} << 8 | uint32_t{data[i + 2]} << 16 |
                 uint32_t{data[i + 3]} << 24;
    ids.push_back(static_cast<int32_t>(v % modulus));
  }
  bool all_valid = true;
  for (int32_t id : ids) all_valid = all_valid && tokenizer.IsValidId(id);
  auto text = tokenizer.Decode(ids, skip_special);
  FUZZ_CHECK(text.ok() == all_valid, "Decode ok=%d but all ids valid=%d", text.ok(), all_valid);
  StreamingDetokenizer stream(&tokenizer, skip_special);
  std::string streamed;
  for (int32_t id : ids) {
    auto delta = stream.Push(id);
    if (!delta.ok()) {
      FUZZ_CHECK(!tokenizer.IsValidId(id), "Push refused valid id %d: %s", id,
                 delta.status().ToString().c_str());
      return;
    }
    FUZZ_CHECK(utf8::FindInvalid(*delta) == absl::string_view::npos,
               "a streamed delta is not valid UTF-8");
    streamed += *delta;
  }
  streamed += stream.Finish();
  FUZZ_CHECK(text.ok(), "every Push succeeded but Decode failed");
  FUZZ_CHECK(utf8::FindInvalid(*text) == absl::string_view::npos, "Decode text is not valid UTF-8");
  FUZZ_CHECK(streamed == *text, "streamed text (%zu bytes) != Decode (%zu bytes)", streamed.size(),
             text->size());
}

}  // namespace

// Loading the 11 MB tokenizer.json takes seconds under ASan: done once here,
// outside the per-input timeout.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  vlm::fuzz::SharedTokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Tokenizer& tokenizer = vlm::fuzz::SharedTokenizer();
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  if ((mode & 1) == 0) {
    FuzzEncode(tokenizer, std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  } else {
    FuzzDecode(tokenizer, data + 1, size - 1, (mode & 2) != 0);
  }
  return 0;
}
