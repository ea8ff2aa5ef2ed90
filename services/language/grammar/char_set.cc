#include "services/language/grammar/char_set.h"

#include <algorithm>
#include <string>

namespace vlm::grammar {
namespace {

constexpr uint32_t kSurrogateLo = 0xD800, kSurrogateHi = 0xDFFF;

int Utf8Length(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

void Encode(uint32_t cp, uint8_t out[4]) {
  const int n = Utf8Length(cp);
  if (n == 1) {
    out[0] = static_cast<uint8_t>(cp);
    return;
  }
  for (int i = n - 1; i > 0; --i) {
    out[i] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
    cp >>= 6;
  }
  static constexpr uint8_t kLead[5] = {0, 0, 0xC0, 0xE0, 0xF0};
  out[0] = static_cast<uint8_t>(kLead[n] | cp);
}

// Splits [lo, hi] (one encoded length, no surrogates) into ranges whose
// encodings are products of per-byte ranges, and appends one byte-range
// sequence per piece (the classic UTF-8 range split).
void SplitUtf8(uint32_t lo, uint32_t hi, std::vector<std::vector<std::pair<uint8_t, uint8_t>>>* out) {
  static constexpr uint32_t kBounds[] = {0x7F, 0x7FF, 0xFFFF};
  for (uint32_t m : kBounds) {
    if (lo <= m && m < hi) {
      SplitUtf8(lo, m, out);
      SplitUtf8(m + 1, hi, out);
      return;
    }
  }
  const int n = Utf8Length(lo);
  for (int i = 1; i < n; ++i) {
    const uint32_t mask = (1u << (6 * i)) - 1;
    if ((lo & ~mask) != (hi & ~mask)) {
      if ((lo & mask) != 0) {
        SplitUtf8(lo, lo | mask, out);
        SplitUtf8((lo | mask) + 1, hi, out);
        return;
      }
      if ((hi & mask) != mask) {
        SplitUtf8(lo, (hi & ~mask) - 1, out);
        SplitUtf8(hi & ~mask, hi, out);
        return;
      }
    }
  }
  uint8_t a[4], z[4];
  Encode(lo, a);
  Encode(hi, z);
  std::vector<std::pair<uint8_t, uint8_t>> seq;
  for (int i = 0; i < n; ++i) seq.emplace_back(a[i], z[i]);
  out->push_back(std::move(seq));
}

}  // namespace

CodepointSet CodepointSet::All() { return Range(0, kMaxCodepoint); }

CodepointSet CodepointSet::Range(uint32_t lo, uint32_t hi) {
  CodepointSet s;
  s.Add(lo, hi);
  return s;
}

void CodepointSet::Add(uint32_t lo, uint32_t hi) {
  hi = std::min(hi, kMaxCodepoint);
  if (lo > hi) return;
  // Surrogates are cut out.
  if (lo < kSurrogateLo && hi >= kSurrogateLo) {
    ranges_.emplace_back(lo, kSurrogateLo - 1);
    if (hi > kSurrogateHi) ranges_.emplace_back(kSurrogateHi + 1, hi);
  } else if (lo >= kSurrogateLo && lo <= kSurrogateHi) {
    if (hi > kSurrogateHi) ranges_.emplace_back(kSurrogateHi + 1, hi);
  } else {
    ranges_.emplace_back(lo, hi);
  }
  Normalize();
}

void CodepointSet::AddSet(const CodepointSet& other) {
  ranges_.insert(ranges_.end(), other.ranges_.begin(), other.ranges_.end());
  Normalize();
}

void CodepointSet::Normalize() {
  std::sort(ranges_.begin(), ranges_.end());
  std::vector<std::pair<uint32_t, uint32_t>> merged;
  for (const auto& r : ranges_) {
    if (!merged.empty() && r.first <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  ranges_ = std::move(merged);
}

CodepointSet CodepointSet::Complement() const {
  CodepointSet c;
  uint32_t next = 0;
  for (const auto& [lo, hi] : ranges_) {
    if (lo > next) c.Add(next, lo - 1);
    next = hi + 1;
  }
  if (next <= kMaxCodepoint) c.Add(next, kMaxCodepoint);
  return c;
}

CodepointSet CodepointSet::Intersect(const CodepointSet& other) const {
  CodepointSet c;
  for (const auto& [a, b] : ranges_) {
    for (const auto& [x, y] : other.ranges_) {
      const uint32_t lo = std::max(a, x), hi = std::min(b, y);
      if (lo <= hi) c.ranges_.emplace_back(lo, hi);
    }
  }
  c.Normalize();
  return c;
}

bool CodepointSet::Contains(uint32_t cp) const {
  for (const auto& [lo, hi] : ranges_) {
    if (cp >= lo && cp <= hi) return true;
  }
  return false;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  uint8_t buf[4];
  Encode(cp, buf);
  out->append(reinterpret_cast<const char*>(buf), Utf8Length(cp));
}

GrammarBuilder::ExprId Utf8Chars(GrammarBuilder& b, const CodepointSet& set) {
  std::vector<std::vector<std::pair<uint8_t, uint8_t>>> seqs;
  ByteSet ascii;
  for (const auto& [lo, hi] : set.ranges()) {
    if (lo < 0x80) {
      for (uint32_t c = lo; c <= std::min<uint32_t>(hi, 0x7F); ++c) ascii.set(c);
    }
    if (hi >= 0x80) SplitUtf8(std::max<uint32_t>(lo, 0x80), hi, &seqs);
  }
  std::vector<GrammarBuilder::ExprId> options;
  if (ascii.any()) options.push_back(b.Bytes(ascii));
  for (const auto& seq : seqs) {
    std::vector<GrammarBuilder::ExprId> parts;
    for (const auto& [lo, hi] : seq) parts.push_back(b.ByteRange(lo, hi));
    options.push_back(b.Seq(std::move(parts)));
  }
  return b.Alt(std::move(options));
}

GrammarBuilder::ExprId JsonStringChars(GrammarBuilder& b, const CodepointSet& set) {
  // Printable characters without '"' and '\' are written as themselves.
  CodepointSet raw = CodepointSet::Range(0x20, kMaxCodepoint);
  CodepointSet quote_backslash;
  quote_backslash.Add('"', '"');
  quote_backslash.Add('\\', '\\');
  raw = raw.Intersect(quote_backslash.Complement()).Intersect(set);
  std::vector<GrammarBuilder::ExprId> options;
  if (!raw.empty()) options.push_back(Utf8Chars(b, raw));
  if (set.Contains('"')) options.push_back(b.Literal("\\\""));
  if (set.Contains('\\')) options.push_back(b.Literal("\\\\"));
  static constexpr char kHex[] = "0123456789abcdef";
  for (uint32_t c = 0; c < 0x20; ++c) {
    if (!set.Contains(c)) continue;
    switch (c) {
      case '\b': options.push_back(b.Literal("\\b")); break;
      case '\f': options.push_back(b.Literal("\\f")); break;
      case '\n': options.push_back(b.Literal("\\n")); break;
      case '\r': options.push_back(b.Literal("\\r")); break;
      case '\t': options.push_back(b.Literal("\\t")); break;
      default: {
        std::string esc = "\\u00";
        esc += kHex[c >> 4];
        esc += kHex[c & 15];
        options.push_back(b.Literal(esc));
      }
    }
  }
  return b.Alt(std::move(options));
}

}  // namespace vlm::grammar
