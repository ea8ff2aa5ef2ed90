#include "services/language/text/tokenizer.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace vlm::language {
namespace {

using json = nlohmann::json;

// The only pre-tokenizer regex this tokenizer implements (Qwen2, Qwen2.5, Qwen3).
constexpr absl::string_view kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

constexpr size_t kMaxCachedPieceBytes = 256;  // longer pieces rarely repeat
constexpr size_t kCacheCapacity = 1 << 16;    // entries; the cache is emptied when full

// ---------------------------------------------------------------------------
// GPT-2 byte-level alphabet: printable bytes map to themselves, the other 68
// to U+0100.. in increasing byte order.

struct ByteAlphabet {
  uint32_t byte_to_cp[256];
  int16_t cp_to_byte[324];  // -1 if the code point is not in the alphabet

  ByteAlphabet() {
    std::fill(std::begin(cp_to_byte), std::end(cp_to_byte), -1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      byte_to_cp[b] = printable ? b : next++;
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& Alphabet() {
  static const ByteAlphabet* alphabet = new ByteAlphabet();
  return *alphabet;
}

// Byte-level token string (UTF-8 of alphabet characters) -> raw bytes.
absl::StatusOr<std::string> ByteLevelToBytes(absl::string_view token) {
  const ByteAlphabet& a = Alphabet();
  std::string out;
  out.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    const auto b0 = static_cast<uint8_t>(token[i]);
    uint32_t cp;
    if (b0 < 0x80) {
      cp = b0;
      i += 1;
    } else if ((b0 & 0xE0) == 0xC0 && i + 1 < token.size()) {
      cp = ((b0 & 0x1F) << 6) | (static_cast<uint8_t>(token[i + 1]) & 0x3F);
      i += 2;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("character outside the byte-level alphabet in token \"", token, "\""));
    }
    if (cp >= 324 || a.cp_to_byte[cp] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("character outside the byte-level alphabet in token \"", token, "\""));
    }
    out.push_back(static_cast<char>(a.cp_to_byte[cp]));
  }
  return out;
}

std::string BytesToByteLevel(absl::string_view bytes) {
  std::string out;
  for (char c : bytes) utf8::Append(Alphabet().byte_to_cp[static_cast<uint8_t>(c)], &out);
  return out;
}

// ---------------------------------------------------------------------------
// Character classes of the pre-tokenizer regex, with ECMAScript meanings
// (the oracle is a JS library): \p{L} = general category L*, \p{N} = N*,
// \s = WhiteSpace + LineTerminator = TAB VT FF SP NBSP ZWNBSP(U+FEFF) Zs
// LF CR LS PS. (Oniguruma's \s, used by HF's Rust library, differs only in
// U+0085 being white space and U+FEFF not.)

enum : uint8_t { kL = 1, kN = 2, kWS = 4, kCRLF = 8 };

uint8_t ClassifySlow(uint32_t cp) {
  uint8_t cls = 0;
  const int8_t gc = u_charType(static_cast<UChar32>(cp));
  const uint32_t mask = U_MASK(gc);
  if (mask & U_GC_L_MASK) cls |= kL;
  if (mask & U_GC_N_MASK) cls |= kN;
  if ((cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0xFEFF || cp == 0x2028 || cp == 0x2029 ||
      gc == U_SPACE_SEPARATOR) {
    cls |= kWS;
  }
  if (cp == '\r' || cp == '\n') cls |= kCRLF;
  return cls;
}

// Classes of the whole BMP, built once (64 KiB); astral code points ask ICU.
const uint8_t* BmpClasses() {
  static const uint8_t* table = [] {
    auto* t = new uint8_t[0x10000];
    for (uint32_t cp = 0; cp < 0x10000; ++cp) t[cp] = ClassifySlow(cp);
    return t;
  }();
  return table;
}

struct Char {
  uint32_t len;
  uint8_t cls;
  uint32_t cp;
};

// Scanner over valid UTF-8 implementing the Qwen2 split regex with
// backtracking semantics, alternative by alternative:
//   1 (?i:'s|'t|'re|'ve|'m|'ll|'d)    (JS: [sS], [rR][eE], ... ASCII only)
//   2 [^\r\n\p{L}\p{N}]?\p{L}+
//   3 \p{N}
//   4  ?[^\s\p{L}\p{N}]+[\r\n]*
//   5 \s*[\r\n]+
//   6 \s+(?!\S)
//   7 \s+
class PreTokenizer {
 public:
  PreTokenizer(absl::string_view text, const uint8_t* bmp)
      : p_(reinterpret_cast<const uint8_t*>(text.data())), n_(text.size()), bmp_(bmp) {}

  // End of the match that starts at `i` (< size); the pattern matches every
  // character, so the result is always > i.
  size_t MatchAt(size_t i) const {
    const Char c0 = At(i);
    // 1: contractions.
    if (c0.cp == '\'' && i + 1 < n_) {
      const uint8_t a = p_[i + 1] | 0x20;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
      if (i + 2 < n_) {
        const uint8_t b = p_[i + 2] | 0x20;
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
          return i + 3;
        }
      }
    }
    // 2: an optional non-letter/number/newline prefix, then letters.
    if (c0.cls & kL) return RunWith(i + c0.len, kL);
    if (!(c0.cls & (kN | kCRLF)) && i + c0.len < n_) {
      const Char c1 = At(i + c0.len);
      if (c1.cls & kL) return RunWith(i + c0.len + c1.len, kL);
    }
    // 3: one number character.
    if (c0.cls & kN) return i + c0.len;
    // 4: optional space, symbols, trailing newlines.
    constexpr uint8_t kWordish = kWS | kL | kN;
    size_t j = i;
    if (c0.cp == ' ' && i + 1 < n_ && !(At(i + 1).cls & kWordish)) j = i + 1;
    if (j != i || !(c0.cls & kWordish)) {
      size_t e = RunWithout(j, kWordish);
      while (e < n_ && (p_[e] == '\r' || p_[e] == '\n')) ++e;
      return e;
    }
    // c0 is white space. Scan its run once for alternatives 5-7.
    size_t e = i;
    size_t last_start = i;
    size_t newline_end = 0;
    int count = 0;
    while (e < n_) {
      const Char c = At(e);
      if (!(c.cls & kWS)) break;
      if (c.cls & kCRLF) newline_end = e + c.len;
      last_start = e;
      e += c.len;
      ++count;
    }
    if (newline_end != 0) return newline_end;  // 5: up to the last newline
    if (e == n_) return e;                     // 6: run at the end of the text
    if (count >= 2) return last_start;         // 6: all but the last white space
    return e;                                  // 7
  }

 private:
  Char At(size_t i) const {
    const uint8_t b0 = p_[i];
    if (b0 < 0x80) return {1, bmp_[b0], b0};
    uint32_t cp;
    uint32_t len;
    if (b0 < 0xE0) {
      cp = ((b0 & 0x1F) << 6) | (p_[i + 1] & 0x3F);
      len = 2;
    } else if (b0 < 0xF0) {
      cp = ((b0 & 0x0F) << 12) | ((p_[i + 1] & 0x3F) << 6) | (p_[i + 2] & 0x3F);
      len = 3;
    } else {
      cp = ((b0 & 0x07) << 18) | ((p_[i + 1] & 0x3F) << 12) | ((p_[i + 2] & 0x3F) << 6) |
           (p_[i + 3] & 0x3F);
      return {4, ClassifySlow(cp), cp};
    }
    return {len, bmp_[cp], cp};
  }
  size_t RunWith(size_t i, uint8_t mask) const {
    while (i < n_) {
      const Char c = At(i);
      if (!(c.cls & mask)) break;
      i += c.len;
    }
    return i;
  }
  size_t RunWithout(size_t i, uint8_t mask) const {
    while (i < n_) {
      const Char c = At(i);
      if (c.cls & mask) break;
      i += c.len;
    }
    return i;
  }

  const uint8_t* p_;
  size_t n_;
  const uint8_t* bmp_;
};

bool IsAscii(absl::string_view s) {
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    if (w & 0x8080808080808080ull) return false;
  }
  for (; i < s.size(); ++i) {
    if (static_cast<uint8_t>(s[i]) & 0x80) return false;
  }
  return true;
}

const icu::Normalizer2* Nfc() {
  static const icu::Normalizer2* nfc = [] {
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* n = icu::Normalizer2::getNFCInstance(status);
    return U_SUCCESS(status) ? n : nullptr;
  }();
  return nfc;
}

// ---------------------------------------------------------------------------
// BPE over one pre-token: symbols start as single bytes and the adjacent pair
// with the lowest merge rank (leftmost on ties) is merged until none is left.
// Tokenizer::Bpe does it by linear scans for short pieces and with a heap
// for long ones.

constexpr int32_t kLinearBpeMaxBytes = 48;

struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
};

struct Candidate {
  int32_t rank;
  int32_t pos;  // byte index of the left symbol: the leftmost-first tie-break
  int32_t left;
  int32_t right;
  int32_t merged;
  bool operator>(const Candidate& o) const {
    return rank != o.rank ? rank > o.rank : pos > o.pos;
  }
};

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path));
  return ss.str();
}

bool FileExists(const std::string& path) { return std::ifstream(path).good(); }

std::string TypeOf(const json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>()
                                                                      : std::string();
}

// Streams model.vocab and model.merges (150k entries each) out of
// tokenizer.json without building a JSON DOM for them, which would take
// seconds; the small rest of the file is parsed into a DOM separately.
class VocabAndMerges : public json::json_sax_t {
 public:
  std::vector<std::pair<std::string, int64_t>> vocab;
  std::vector<std::pair<std::string, std::string>> merges;
  bool saw_vocab = false;
  bool saw_merges = false;
  std::string error;

  bool null() override { return Other("null"); }
  bool boolean(bool) override { return Other("a boolean"); }
  bool number_integer(number_integer_t v) override {
    if (InVocab()) return Fail(absl::StrCat("negative id ", v, " for \"", key_, "\""));
    return Other("a number");
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (InVocab()) {
      vocab.emplace_back(std::move(key_), static_cast<int64_t>(std::min<uint64_t>(v, 1ull << 40)));
      return true;
    }
    return Other("a number");
  }
  bool number_float(number_float_t, const string_t&) override { return Other("a number"); }
  bool binary(binary_t&) override { return Other("binary"); }
  bool string(string_t& v) override {
    if (InMerges()) {  // older format: "left right"
      const size_t sp = v.find(' ');
      if (sp == std::string::npos || v.find(' ', sp + 1) != std::string::npos) {
        return Fail(absl::StrCat("bad merge \"", v, "\""));
      }
      merges.emplace_back(v.substr(0, sp), v.substr(sp + 1));
      return true;
    }
    if (InMergePair()) {
      if (pair_size_ == 0) merges.back().first = std::move(v);
      if (pair_size_ == 1) merges.back().second = std::move(v);
      ++pair_size_;
      return true;
    }
    return Other("a string");
  }
  bool start_object(std::size_t) override {
    if (InMerges() || InMergePair()) return Fail("a merge is an object");
    stack_.push_back({false, {}});
    if (InVocab()) saw_vocab = true;
    return true;
  }
  bool key(string_t& k) override {
    if (InVocab()) {
      key_ = std::move(k);
    } else {
      stack_.back().key = std::move(k);
    }
    return true;
  }
  bool end_object() override {
    stack_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    if (InMergePair()) return Fail("a merge holds a nested array");
    stack_.push_back({true, {}});
    if (InMerges()) saw_merges = true;
    if (InMergePair()) {
      merges.emplace_back();
      pair_size_ = 0;
    }
    return true;
  }
  bool end_array() override {
    if (InMergePair() && pair_size_ != 2) return Fail("a merge is not a pair of strings");
    stack_.pop_back();
    return true;
  }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& e) override {
    return Fail(absl::StrCat("invalid JSON at byte ", position, ": ", e.what()));
  }

 private:
  struct Frame {
    bool array;
    std::string key;  // objects: the key being read
  };
  bool InModel(size_t depth, const char* key) const {
    return stack_.size() == depth && stack_[0].key == "model" && stack_[1].key == key;
  }
  bool InVocab() const { return InModel(3, "vocab") && !stack_[2].array; }
  bool InMerges() const { return InModel(3, "merges") && stack_[2].array; }
  bool InMergePair() const { return InModel(4, "merges") && stack_[3].array; }
  bool Other(const char* what) {
    if (InVocab()) return Fail(absl::StrCat("vocab entry \"", key_, "\" is ", what));
    if (InMerges() || InMergePair()) return Fail(absl::StrCat("a merge holds ", what));
    return true;
  }
  bool Fail(std::string message) {
    error = std::move(message);
    return false;
  }

  std::vector<Frame> stack_;
  std::string key_;
  int pair_size_ = 0;
};

absl::Status Unsupported(absl::string_view what) {
  return absl::UnimplementedError(
      absl::StrCat("tokenizer.json: unsupported ", what,
                   " (this tokenizer implements the Qwen2/Qwen3 byte-level BPE pipeline only)"));
}

// The pipeline of section 7.1: NFC (or none), Split(Qwen2 regex, Isolated) +
// ByteLevel(no regex), BPE without affixes or byte fallback, ByteLevel decoder.
absl::Status CheckPipeline(const json& t) {
  if (t.contains("normalizer") && !t["normalizer"].is_null() && TypeOf(t["normalizer"]) != "NFC") {
    return Unsupported(absl::StrCat("normalizer ", t["normalizer"].dump()));
  }
  const json& pre = t.value("pre_tokenizer", json());
  bool pre_ok = TypeOf(pre) == "Sequence" && pre.contains("pretokenizers") &&
                pre["pretokenizers"].is_array() && pre["pretokenizers"].size() == 2;
  if (pre_ok) {
    const json& split = pre["pretokenizers"][0];
    const json& bl = pre["pretokenizers"][1];
    pre_ok = TypeOf(split) == "Split" && split.contains("pattern") &&
             split["pattern"].value("Regex", "") == kQwen2Pattern &&
             split.value("behavior", "") == "Isolated" && !split.value("invert", false) &&
             TypeOf(bl) == "ByteLevel" && !bl.value("add_prefix_space", false) &&
             !bl.value("use_regex", true);
  }
  if (!pre_ok) return Unsupported(absl::StrCat("pre_tokenizer ", pre.dump()));
  if (TypeOf(t.value("decoder", json())) != "ByteLevel") {
    return Unsupported(absl::StrCat("decoder ", t.value("decoder", json()).dump()));
  }
  const json& m = t.value("model", json());
  auto empty_or_null = [&](const char* key) {
    return !m.contains(key) || m[key].is_null() || (m[key].is_string() && m[key] == "");
  };
  if (!m.is_object() || (m.contains("type") && TypeOf(m) != "BPE")) {
    return Unsupported("model (expected BPE)");
  }
  if (m.value("byte_fallback", false) || !empty_or_null("continuing_subword_prefix") ||
      !empty_or_null("end_of_word_suffix") || !empty_or_null("dropout") ||
      m.value("ignore_merges", false)) {
    return Unsupported("BPE options (byte_fallback, affixes, dropout or ignore_merges)");
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& dir) {
  const std::string path = dir + "/tokenizer.json";
  absl::StatusOr<std::string> tok = ReadFile(path);
  if (!tok.ok()) return tok.status();
  std::string config;
  const std::string config_path = dir + "/tokenizer_config.json";
  if (FileExists(config_path)) {
    absl::StatusOr<std::string> c = ReadFile(config_path);
    if (!c.ok()) return c.status();
    config = *std::move(c);
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = FromJson(*tok, config);
  if (!t.ok()) {
    return absl::Status(t.status().code(), absl::StrCat(path, ": ", t.status().message()));
  }
  return t;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(absl::string_view tokenizer_json,
                                                               absl::string_view config_json) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  if (absl::Status s = t->Init(tokenizer_json, config_json); !s.ok()) return s;
  return t;
}

// Merges: "a b" strings (older files) or ["a", "b"] pairs; rank = index.
// A repeated pair keeps its last rank, as in HF's and the JS library's maps.
absl::Status Tokenizer::BuildMerges(
    absl::Span<const std::pair<std::string, std::string>> merges) {
  merges_.reserve(merges.size());
  std::string joined;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    joined.assign(left).append(right);
    auto l = vocab_.find(left);
    auto r = vocab_.find(right);
    auto lr = vocab_.find(joined);
    if (l == vocab_.end() || r == vocab_.end() || lr == vocab_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("merge ", rank, " (\"", left, "\", \"", right, "\") is not in the vocab"));
    }
    const uint64_t key = (static_cast<uint64_t>(l->second) << 32) | static_cast<uint32_t>(r->second);
    merges_[key] = Merge{static_cast<int32_t>(rank), lr->second};
  }

  return absl::OkStatus();
}

// Added tokens by first byte, longest first (the splitter's candidates), and
// the ids of the special tokens the chat template and generation use.
void Tokenizer::IndexAddedTokens() {
  added_by_first_byte_.assign(256, {});
  for (size_t i = 0; i < added_.size(); ++i) {
    added_by_first_byte_[static_cast<uint8_t>(added_[i].content[0])].push_back(
        static_cast<int32_t>(i));
  }
  for (auto& list : added_by_first_byte_) {
    std::stable_sort(list.begin(), list.end(), [&](int32_t a, int32_t b) {
      return added_[a].content.size() > added_[b].content.size();
    });
  }
  auto id_of = [&](absl::string_view s) { return TokenToId(s).value_or(-1); };
  special_ids_.endoftext = id_of("<|endoftext|>");
  special_ids_.im_start = id_of("<|im_start|>");
  special_ids_.im_end = id_of("<|im_end|>");
  special_ids_.vision_start = id_of("<|vision_start|>");
  special_ids_.vision_end = id_of("<|vision_end|>");
  special_ids_.image_pad = id_of("<|image_pad|>");
  special_ids_.video_pad = id_of("<|video_pad|>");
}

absl::Status Tokenizer::Init(absl::string_view tokenizer_json, absl::string_view config_json) {
  if (Nfc() == nullptr) return absl::InternalError("ICU NFC normalizer unavailable");
  VocabAndMerges big;
  if (!json::sax_parse(tokenizer_json.begin(), tokenizer_json.end(), &big)) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", big.error));
  }
  if (!big.saw_vocab || !big.saw_merges) {
    return absl::InvalidArgumentError("tokenizer.json has no model.vocab object or model.merges array");
  }
  // Everything but the vocab and merges, as a DOM.
  json t = json::parse(
      tokenizer_json.begin(), tokenizer_json.end(),
      [](int, json::parse_event_t event, json& parsed) {
        return !(event == json::parse_event_t::key && (parsed == "vocab" || parsed == "merges"));
      },
      false);
  if (t.is_discarded() || !t.is_object()) {
    return absl::InvalidArgumentError("tokenizer.json is not a JSON object");
  }
  if (absl::Status s = CheckPipeline(t); !s.ok()) return s;

  // Base vocabulary.
  int64_t max_id = -1;
  for (const auto& [token, id] : big.vocab) {
    if (id >= (1 << 30)) {
      return absl::InvalidArgumentError(absl::StrCat("bad id for vocab token \"", token, "\""));
    }
    max_id = std::max(max_id, id);
  }
  const json& added = t.value("added_tokens", json::array());
  for (const json& a : added) {
    if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() ||
        !a.contains("content") || !a["content"].is_string() || a["content"] == "" ||
        a["id"].get<int64_t>() < 0 || a["id"].get<int64_t>() >= (1 << 30)) {
      return absl::InvalidArgumentError(absl::StrCat("bad added token ", a.dump()));
    }
    max_id = std::max(max_id, a["id"].get<int64_t>());
  }
  pieces_.assign(max_id + 1, std::string());
  kinds_.assign(max_id + 1, Kind::kUnused);
  vocab_.reserve(big.vocab.size() + added.size());
  for (auto& [token, id] : big.vocab) {
    absl::StatusOr<std::string> bytes = ByteLevelToBytes(token);
    if (!bytes.ok()) return bytes.status();
    pieces_[id] = *std::move(bytes);
    kinds_[id] = Kind::kBase;
    vocab_[std::move(token)] = static_cast<int32_t>(id);
  }
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_.find(BytesToByteLevel(std::string(1, static_cast<char>(b))));
    if (it == vocab_.end()) {
      return absl::InvalidArgumentError(absl::StrFormat("vocab lacks the token of byte 0x%02x", b));
    }
    byte_ids_[b] = it->second;
  }

  if (absl::Status s = BuildMerges(big.merges); !s.ok()) return s;

  // Added tokens override the base entry of the same id.
  for (const json& a : added) {
    AddedToken token;
    token.id = a["id"].get<int32_t>();
    token.content = a["content"].get<std::string>();
    token.special = a.value("special", false);
    if (absl::Status s = utf8::Validate(token.content, "added token"); !s.ok()) return s;
    pieces_[token.id] = token.content;
    kinds_[token.id] = token.special ? Kind::kSpecial : Kind::kAdded;
    vocab_[token.content] = token.id;
    added_.push_back(std::move(token));
  }
  if (!config_json.empty()) {
    json c = json::parse(config_json.begin(), config_json.end(), nullptr, false);
    if (c.is_discarded() || !c.is_object()) {
      return absl::InvalidArgumentError("tokenizer_config.json is not a JSON object");
    }
    for (const json& s : c.value("additional_special_tokens", json::array())) {
      std::string content = s.is_string() ? s.get<std::string>() : s.value("content", "");
      for (AddedToken& a : added_) {
        if (a.content == content) {
          a.special = true;
          kinds_[a.id] = Kind::kSpecial;
        }
      }
    }
  }
  IndexAddedTokens();
  BmpClasses();  // build the class table now, not in the first request
  return absl::OkStatus();
}

std::optional<int32_t> Tokenizer::TokenToId(absl::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<std::string> Tokenizer::IdToToken(int32_t id) const {
  if (!IsValidId(id)) {
    return absl::InvalidArgumentError(absl::StrCat("token id ", id, " is not in the vocabulary"));
  }
  return kinds_[id] == Kind::kBase ? BytesToByteLevel(pieces_[id]) : pieces_[id];
}

// ---------------------------------------------------------------------------
// Encoding

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(absl::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (absl::Status s = EncodeTo(text, &ids); !s.ok()) return s;
  return ids;
}

absl::Status Tokenizer::EncodeTo(absl::string_view text, std::vector<int32_t>* ids) const {
  if (absl::Status s = utf8::Validate(text); !s.ok()) return s;
  // Added tokens are matched on the raw text, leftmost then longest.
  size_t start = 0;
  size_t i = 0;
  while (i < text.size()) {
    const auto& candidates = added_by_first_byte_[static_cast<uint8_t>(text[i])];
    const AddedToken* match = nullptr;
    for (int32_t k : candidates) {
      const std::string& c = added_[k].content;
      if (text.size() - i >= c.size() && std::memcmp(text.data() + i, c.data(), c.size()) == 0) {
        match = &added_[k];
        break;
      }
    }
    if (match == nullptr) {
      ++i;
      continue;
    }
    EncodePlain(text.substr(start, i - start), ids);
    ids->push_back(match->id);
    i += match->content.size();
    start = i;
  }
  EncodePlain(text.substr(start), ids);
  return absl::OkStatus();
}

void Tokenizer::EncodePlain(absl::string_view text, std::vector<int32_t>* ids) const {
  if (text.empty()) return;
  std::string normalized;
  if (!IsAscii(text)) {
    UErrorCode status = U_ZERO_ERROR;
    const icu::StringPiece piece(text.data(), static_cast<int32_t>(text.size()));
    if (!Nfc()->isNormalizedUTF8(piece, status)) {
      status = U_ZERO_ERROR;
      icu::StringByteSink<std::string> sink(&normalized, static_cast<int32_t>(text.size()));
      Nfc()->normalizeUTF8(0, piece, sink, nullptr, status);
      if (U_SUCCESS(status)) text = normalized;
    }
  }
  const PreTokenizer pre(text, BmpClasses());
  for (size_t i = 0; i < text.size();) {
    const size_t end = pre.MatchAt(i);
    EncodePiece(text.substr(i, end - i), ids);
    i = end;
  }
}

void Tokenizer::EncodePiece(absl::string_view piece, std::vector<int32_t>* ids) const {
  if (piece.size() == 1) {
    ids->push_back(byte_ids_[static_cast<uint8_t>(piece[0])]);
    return;
  }
  const bool cacheable = piece.size() <= kMaxCachedPieceBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_enabled_) {
      auto it = cache_.find(piece);
      if (it != cache_.end()) {
        ids->insert(ids->end(), it->second.begin(), it->second.end());
        return;
      }
    }
  }
  const size_t first = ids->size();
  Bpe(piece, ids);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (!cache_enabled_) return;
    if (cache_.size() >= kCacheCapacity) cache_.clear();
    cache_.try_emplace(piece, ids->begin() + first, ids->end());
  }
}

void Tokenizer::Bpe(absl::string_view piece, std::vector<int32_t>* ids) const {
  const int32_t n = static_cast<int32_t>(piece.size());
  auto find = [&](int32_t left, int32_t right) -> const Merge* {
    auto it = merges_.find((static_cast<uint64_t>(left) << 32) | static_cast<uint32_t>(right));
    return it == merges_.end() ? nullptr : &it->second;
  };

  if (n <= kLinearBpeMaxBytes) {
    // Short pieces (nearly all): arrays of symbols and of the rank of each
    // adjacent pair, a linear scan for the lowest rank (the first such is the
    // leftmost), two lookups per merge.
    int32_t sym[kLinearBpeMaxBytes];
    int32_t rank[kLinearBpeMaxBytes];
    int32_t merged[kLinearBpeMaxBytes];
    int32_t m = n;
    auto lookup = [&](int32_t i) {
      const Merge* mm = find(sym[i], sym[i + 1]);
      rank[i] = mm ? mm->rank : INT32_MAX;
      merged[i] = mm ? mm->merged : -1;
    };
    for (int32_t i = 0; i < n; ++i) sym[i] = byte_ids_[static_cast<uint8_t>(piece[i])];
    for (int32_t i = 0; i + 1 < m; ++i) lookup(i);
    while (m > 1) {
      int32_t best = -1;
      int32_t best_rank = INT32_MAX;
      for (int32_t i = 0; i + 1 < m; ++i) {
        if (rank[i] < best_rank) {
          best_rank = rank[i];
          best = i;
        }
      }
      if (best < 0) break;
      sym[best] = merged[best];
      for (int32_t i = best + 1; i + 1 < m; ++i) {  // drop symbol best + 1
        sym[i] = sym[i + 1];
        rank[i] = rank[i + 1];
        merged[i] = merged[i + 1];
      }
      --m;
      if (best > 0) lookup(best - 1);
      if (best + 1 < m) lookup(best);
    }
    ids->insert(ids->end(), sym, sym + m);
    return;
  }

  // Long pieces: a min-heap of candidate pairs over a linked list of symbols,
  // O(n log n). Stale candidates are recognised by their symbol ids (a
  // symbol's id only changes by growing, so an unchanged pair of ids is still
  // the same pair).
  thread_local std::vector<Symbol> symbols;
  thread_local std::vector<Candidate> heap;
  symbols.resize(n);
  heap.clear();
  auto push = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (const Merge* m = find(symbols[pos].id, symbols[next].id)) {
      heap.push_back({m->rank, pos, symbols[pos].id, symbols[next].id, m->merged});
      std::push_heap(heap.begin(), heap.end(), std::greater<Candidate>());
    }
  };
  for (int32_t i = 0; i < n; ++i) {
    symbols[i] = {byte_ids_[static_cast<uint8_t>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1};
  }
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<Candidate>());
    const Candidate c = heap.back();
    heap.pop_back();
    Symbol& left = symbols[c.pos];
    if (left.id != c.left || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    if (right.id != c.right) continue;
    left.id = c.merged;
    right.id = -1;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = c.pos;
    if (left.prev >= 0) push(left.prev);
    if (left.next >= 0) push(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) ids->push_back(symbols[i].id);
}

void Tokenizer::ClearCache() const {
  std::lock_guard<std::mutex> lock(cache_mu_);
  cache_.clear();
}

void Tokenizer::SetCacheEnabled(bool enabled) const {
  std::lock_guard<std::mutex> lock(cache_mu_);
  cache_enabled_ = enabled;
  if (!enabled) cache_.clear();
}

size_t Tokenizer::cache_size() const {
  std::lock_guard<std::mutex> lock(cache_mu_);
  return cache_.size();
}

// ---------------------------------------------------------------------------
// Decoding

absl::StatusOr<std::string> Tokenizer::Decode(absl::Span<const int32_t> ids,
                                              bool skip_special_tokens) const {
  StreamingDetokenizer stream(this, skip_special_tokens);
  std::string out;
  for (int32_t id : ids) {
    absl::StatusOr<std::string> delta = stream.Push(id);
    if (!delta.ok()) return delta.status();
    out += *delta;
  }
  out += stream.Finish();
  return out;
}

StreamingDetokenizer::StreamingDetokenizer(const Tokenizer* tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

absl::StatusOr<std::string> StreamingDetokenizer::Push(int32_t id) {
  if (!tokenizer_->IsValidId(id)) {
    return absl::InvalidArgumentError(absl::StrCat("token id ", id, " is not in the vocabulary (",
                                                   tokenizer_->vocab_size(), " ids)"));
  }
  std::string out;
  switch (tokenizer_->kinds_[id]) {
    case Tokenizer::Kind::kBase:
      decoder_.Feed(tokenizer_->pieces_[id], &out);
      break;
    case Tokenizer::Kind::kSpecial:
      if (skip_special_tokens_) break;  // filtered before decoding: no boundary
      [[fallthrough]];
    case Tokenizer::Kind::kAdded:
      // Byte-level runs are decoded separately on each side of an added token.
      decoder_.Flush(&out);
      out += tokenizer_->pieces_[id];
      break;
    case Tokenizer::Kind::kUnused:
      break;
  }
  return out;
}

std::string StreamingDetokenizer::Finish() {
  std::string out;
  decoder_.Flush(&out);
  return out;
}

}  // namespace vlm::language
