#include "services/language/text/utf8.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace vlm::language::utf8 {
namespace {

constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

// For a lead byte: number of continuation bytes and the allowed range of the
// first one (Unicode table 3-7). needed < 0 means "not a lead byte".
struct Lead {
  int needed;
  uint8_t lower;
  uint8_t upper;
};

inline Lead ClassifyLead(uint8_t b) {
  if (b < 0x80) return {0, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {1, 0x80, 0xBF};
  if (b >= 0xE0 && b <= 0xEF) {
    return {2, static_cast<uint8_t>(b == 0xE0 ? 0xA0 : 0x80),
            static_cast<uint8_t>(b == 0xED ? 0x9F : 0xBF)};
  }
  if (b >= 0xF0 && b <= 0xF4) {
    return {3, static_cast<uint8_t>(b == 0xF0 ? 0x90 : 0x80),
            static_cast<uint8_t>(b == 0xF4 ? 0x8F : 0xBF)};
  }
  return {-1, 0, 0};
}

}  // namespace

size_t FindInvalid(absl::string_view text) {
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    // ASCII runs, eight bytes at a time.
    while (i + 8 <= n) {
      uint64_t word;
      std::memcpy(&word, p + i, 8);
      if (word & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    const uint8_t b = p[i];
    if (b < 0x80) {
      ++i;
      continue;
    }
    const Lead lead = ClassifyLead(b);
    if (lead.needed < 0) return i;
    if (i + static_cast<size_t>(lead.needed) >= n) return i;  // truncated
    if (p[i + 1] < lead.lower || p[i + 1] > lead.upper) return i;
    for (int k = 2; k <= lead.needed; ++k) {
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return i;
    }
    i += 1 + lead.needed;
  }
  return absl::string_view::npos;
}

absl::Status Validate(absl::string_view text, absl::string_view what) {
  const size_t bad = FindInvalid(text);
  if (bad == absl::string_view::npos) return absl::OkStatus();
  std::string bytes;
  for (size_t k = bad; k < text.size() && k < bad + 4; ++k) {
    absl::StrAppend(&bytes, k == bad ? "" : " ",
                    absl::StrFormat("%02x", static_cast<uint8_t>(text[k])));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, " is not valid UTF-8: ill-formed sequence at byte offset ", bad,
                   " (bytes ", bytes, ")"));
}

void Append(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

void ReplacingDecoder::Reset() {
  needed_ = 0;
  lower_ = 0x80;
  upper_ = 0xBF;
  held_len_ = 0;
}

void ReplacingDecoder::Feed(absl::string_view bytes, std::string* out) {
  for (size_t i = 0; i < bytes.size();) {
    const uint8_t b = static_cast<uint8_t>(bytes[i]);
    if (needed_ == 0) {
      ++i;
      if (b < 0x80) {
        out->push_back(static_cast<char>(b));
        continue;
      }
      const Lead lead = ClassifyLead(b);
      if (lead.needed < 0) {
        out->append(kReplacement);
        continue;
      }
      needed_ = lead.needed;
      lower_ = lead.lower;
      upper_ = lead.upper;
      held_[0] = static_cast<char>(b);
      held_len_ = 1;
      continue;
    }
    if (b < lower_ || b > upper_) {
      // The maximal subpart ends before this byte, which is decoded afresh.
      Reset();
      out->append(kReplacement);
      continue;
    }
    ++i;
    held_[held_len_++] = static_cast<char>(b);
    lower_ = 0x80;
    upper_ = 0xBF;
    if (--needed_ == 0) {
      out->append(held_, held_len_);
      Reset();
    }
  }
}

void ReplacingDecoder::Flush(std::string* out) {
  if (needed_ != 0) out->append(kReplacement);
  Reset();
}

}  // namespace vlm::language::utf8
