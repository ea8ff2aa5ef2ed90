#include "services/language/grammar/regex.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/language/grammar/char_set.h"

namespace vlm::grammar {
namespace {

constexpr int kMaxRepeat = 1000;
constexpr int kMaxNesting = 200;

class RegexParser {
 public:
  RegexParser(GrammarBuilder& b, absl::string_view p, RegexEncoding enc)
      : b_(b), p_(p), enc_(enc) {}

  absl::StatusOr<GrammarBuilder::ExprId> Parse() {
    if (!p_.empty() && p_[0] == '^') ++pos_;
    absl::StatusOr<GrammarBuilder::ExprId> e = ParseAlt(0);
    if (!e.ok()) return e;
    if (pos_ < p_.size() && p_[pos_] == '$' && pos_ + 1 == p_.size()) ++pos_;
    if (pos_ != p_.size()) return Error(p_[pos_] == ')' ? "unbalanced ')'" : "unexpected character");
    return e;
  }

 private:
  using ExprId = GrammarBuilder::ExprId;

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("regex: ", what, " at offset ", pos_, " of \"", p_, "\""));
  }
  bool AtEnd() const { return pos_ >= p_.size(); }
  char Peek() const { return p_[pos_]; }

  ExprId Chars(const CodepointSet& set) {
    return enc_ == RegexEncoding::kUtf8 ? Utf8Chars(b_, set) : JsonStringChars(b_, set);
  }

  // Next UTF-8 code point of the pattern.
  absl::StatusOr<uint32_t> NextCodepoint() {
    const uint8_t c = static_cast<uint8_t>(p_[pos_]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || pos_ + n > p_.size()) return Error("invalid UTF-8");
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (int i = 1; i < n; ++i) {
      const uint8_t cc = static_cast<uint8_t>(p_[pos_ + i]);
      if ((cc & 0xC0) != 0x80) return Error("invalid UTF-8");
      cp = (cp << 6) | (cc & 0x3F);
    }
    pos_ += n;
    return cp;
  }

  absl::StatusOr<uint32_t> Hex(int digits) {
    if (pos_ + digits > p_.size()) return Error("short hex escape");
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      const char c = p_[pos_++];
      int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
      if (d < 0) return Error("bad hex digit");
      v = v * 16 + d;
    }
    return v;
  }

  static CodepointSet Digits() { return CodepointSet::Range('0', '9'); }
  static CodepointSet Word() {
    CodepointSet s = CodepointSet::Range('0', '9');
    s.Add('A', 'Z');
    s.Add('a', 'z');
    s.Add('_', '_');
    return s;
  }
  static CodepointSet Space() {
    CodepointSet s = CodepointSet::Range('\t', '\r');
    s.Add(' ', ' ');
    return s;
  }

  // After a backslash: a class escape or a single character.
  absl::StatusOr<CodepointSet> Escape(bool in_class) {
    if (AtEnd()) return Error("trailing backslash");
    const char c = Peek();
    ++pos_;
    switch (c) {
      case 'd': return Digits();
      case 'D': return Digits().Complement();
      case 'w': return Word();
      case 'W': return Word().Complement();
      case 's': return Space();
      case 'S': return Space().Complement();
      case 'n': return CodepointSet::Of('\n');
      case 'r': return CodepointSet::Of('\r');
      case 't': return CodepointSet::Of('\t');
      case 'f': return CodepointSet::Of('\f');
      case 'v': return CodepointSet::Of('\v');
      case '0': return CodepointSet::Of(0);
      case 'x': {
        absl::StatusOr<uint32_t> v = Hex(2);
        if (!v.ok()) return v.status();
        return CodepointSet::Of(*v);
      }
      case 'u': {
        absl::StatusOr<uint32_t> v = Hex(4);
        if (!v.ok()) return v.status();
        return CodepointSet::Of(*v);
      }
      case 'b':
        if (in_class) return CodepointSet::Of('\b');
        return Error("word boundary \\b is not supported");
      case 'B': return Error("\\B is not supported");
      default:
        if (c >= '1' && c <= '9') return Error("backreferences are not supported");
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return Error("unknown escape");
        --pos_;
        absl::StatusOr<uint32_t> cp = NextCodepoint();
        if (!cp.ok()) return cp.status();
        return CodepointSet::Of(*cp);
    }
  }

  absl::StatusOr<CodepointSet> Class() {
    // '[' already consumed.
    bool negate = false;
    if (!AtEnd() && Peek() == '^') {
      negate = true;
      ++pos_;
    }
    CodepointSet set;
    bool first = true;
    while (true) {
      if (AtEnd()) return Error("unterminated character class");
      if (Peek() == ']' && !first) {
        ++pos_;
        break;
      }
      first = false;
      CodepointSet item;
      bool single = false;
      uint32_t lo = 0;
      if (Peek() == '\\') {
        ++pos_;
        absl::StatusOr<CodepointSet> e = Escape(true);
        if (!e.ok()) return e.status();
        item = *e;
        if (item.ranges().size() == 1 && item.ranges()[0].first == item.ranges()[0].second) {
          single = true;
          lo = item.ranges()[0].first;
        }
      } else {
        absl::StatusOr<uint32_t> cp = NextCodepoint();
        if (!cp.ok()) return cp.status();
        single = true;
        lo = *cp;
        item = CodepointSet::Of(lo);
      }
      if (single && pos_ + 1 < p_.size() && Peek() == '-' && p_[pos_ + 1] != ']') {
        ++pos_;
        uint32_t hi;
        if (Peek() == '\\') {
          ++pos_;
          absl::StatusOr<CodepointSet> e = Escape(true);
          if (!e.ok()) return e.status();
          if (e->ranges().size() != 1 || e->ranges()[0].first != e->ranges()[0].second) {
            return Error("class escape as a range bound");
          }
          hi = e->ranges()[0].first;
        } else {
          absl::StatusOr<uint32_t> cp = NextCodepoint();
          if (!cp.ok()) return cp.status();
          hi = *cp;
        }
        if (hi < lo) return Error("reversed range in character class");
        item = CodepointSet::Range(lo, hi);
      }
      set.AddSet(item);
    }
    return negate ? set.Complement() : set;
  }

  absl::StatusOr<ExprId> ParseAlt(int depth) {
    if (depth > kMaxNesting) return Error("groups nest too deeply");
    std::vector<ExprId> options;
    while (true) {
      absl::StatusOr<ExprId> s = ParseSeq(depth);
      if (!s.ok()) return s;
      options.push_back(*s);
      if (AtEnd() || Peek() != '|') break;
      ++pos_;
    }
    return b_.Alt(std::move(options));
  }

  absl::StatusOr<ExprId> ParseSeq(int depth) {
    std::vector<ExprId> parts;
    while (!AtEnd() && Peek() != '|' && Peek() != ')') {
      if (Peek() == '$' && pos_ + 1 == p_.size()) break;  // the implied end anchor
      absl::StatusOr<ExprId> atom = ParseAtom(depth);
      if (!atom.ok()) return atom;
      absl::StatusOr<ExprId> q = ParseQuantifiers(*atom);
      if (!q.ok()) return q;
      parts.push_back(*q);
    }
    return b_.Seq(std::move(parts));
  }

  absl::StatusOr<int> Number() {
    if (AtEnd() || Peek() < '0' || Peek() > '9') return Error("expected a number in {}");
    int64_t v = 0;
    while (!AtEnd() && Peek() >= '0' && Peek() <= '9') {
      v = v * 10 + (Peek() - '0');
      if (v > kMaxRepeat) {
        return absl::ResourceExhaustedError(
            absl::StrCat("regex: repetition bound above ", kMaxRepeat, " in \"", p_, "\""));
      }
      ++pos_;
    }
    return static_cast<int>(v);
  }

  absl::StatusOr<ExprId> ParseQuantifiers(ExprId atom) {
    while (!AtEnd()) {
      const char c = Peek();
      int min, max;
      if (c == '*') {
        min = 0, max = -1;
        ++pos_;
      } else if (c == '+') {
        min = 1, max = -1;
        ++pos_;
      } else if (c == '?') {
        min = 0, max = 1;
        ++pos_;
      } else if (c == '{') {
        ++pos_;
        absl::StatusOr<int> a = Number();
        if (!a.ok()) return a.status();
        min = max = *a;
        if (!AtEnd() && Peek() == ',') {
          ++pos_;
          if (!AtEnd() && Peek() == '}') {
            max = -1;
          } else {
            absl::StatusOr<int> z = Number();
            if (!z.ok()) return z.status();
            max = *z;
          }
        }
        if (AtEnd() || Peek() != '}') return Error("unterminated {m,n}");
        ++pos_;
        if (max >= 0 && max < min) return Error("{m,n} with n < m");
      } else {
        break;
      }
      if (!AtEnd() && Peek() == '?') ++pos_;  // lazy: the same language
      atom = b_.Repeat(atom, min, max);
    }
    return atom;
  }

  absl::StatusOr<ExprId> ParseAtom(int depth) {
    const char c = Peek();
    switch (c) {
      case '(': {
        ++pos_;
        if (!AtEnd() && Peek() == '?') {
          ++pos_;
          if (!AtEnd() && Peek() == ':') {
            ++pos_;
          } else if (!AtEnd() && Peek() == '<' && pos_ + 1 < p_.size() && p_[pos_ + 1] != '=' &&
                     p_[pos_ + 1] != '!') {
            const size_t close = p_.find('>', pos_);
            if (close == absl::string_view::npos) return Error("unterminated group name");
            pos_ = close + 1;
          } else {
            return Error("lookaround and inline flags are not supported");
          }
        }
        absl::StatusOr<ExprId> inner = ParseAlt(depth + 1);
        if (!inner.ok()) return inner;
        if (AtEnd() || Peek() != ')') return Error("missing ')'");
        ++pos_;
        return inner;
      }
      case '[': {
        ++pos_;
        absl::StatusOr<CodepointSet> set = Class();
        if (!set.ok()) return set.status();
        return Chars(*set);
      }
      case '.':
        ++pos_;
        return Chars(CodepointSet::Of('\n').Complement());
      case '\\': {
        ++pos_;
        absl::StatusOr<CodepointSet> set = Escape(false);
        if (!set.ok()) return set.status();
        return Chars(*set);
      }
      case '^':
      case '$':
        return Error("anchors are only supported at the ends of the pattern");
      case '*':
      case '+':
      case '?':
      case '{':
        return Error("quantifier without an operand");
      default: {
        absl::StatusOr<uint32_t> cp = NextCodepoint();
        if (!cp.ok()) return cp.status();
        return Chars(CodepointSet::Of(*cp));
      }
    }
  }

  GrammarBuilder& b_;
  absl::string_view p_;
  RegexEncoding enc_;
  size_t pos_ = 0;
};

}  // namespace

absl::StatusOr<GrammarBuilder::ExprId> TranslateRegex(GrammarBuilder& b, absl::string_view pattern,
                                                      RegexEncoding encoding) {
  return RegexParser(b, pattern, encoding).Parse();
}

}  // namespace vlm::grammar
