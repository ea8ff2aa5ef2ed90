#include "services/language/grammar/matcher.h"

#include <algorithm>
#include <cstring>
#include <limits>

namespace vlm::grammar {
namespace {

using Frame = Matcher::Frame;
using Config = Matcher::Config;

constexpr int32_t kBottom = -1;    // below the root rule: ending here ends the output
constexpr int32_t kSentinel = -2;  // an unknown caller (mask cache walks)
constexpr int kCanEnd = 1;         // a root-level configuration is final
constexpr int kEscapes = 2;        // a sentinel-level configuration is final

inline void AddConfig(std::vector<Config>& set, Config c) {
  for (const Config& x : set) {
    if (x.state == c.state && x.frame == c.frame) return;
  }
  set.push_back(c);
}

// Closes `set` in place: the start of every rule a configuration calls
// (pushing a frame) and the return state of every finished rule (popping).
// Frames pushed by this closure are shared when equal.
int Close(const Grammar& g, std::vector<Frame>& arena, std::vector<Config>& set) {
  const size_t first_new = arena.size();
  int flags = 0;
  for (size_t i = 0; i < set.size(); ++i) {
    const Config c = set[i];
    if (g.IsFinal(c.state)) {
      if (c.frame == kBottom) {
        flags |= kCanEnd;
      } else if (c.frame == kSentinel) {
        flags |= kEscapes;
      } else {
        const Frame& f = arena[c.frame];
        AddConfig(set, Config{f.ret, f.parent});
      }
    }
    if (!g.HasCalls(c.state)) continue;
    for (const Grammar::CallEdge* e = g.CallsBegin(c.state); e != g.CallsEnd(c.state); ++e) {
      int32_t frame = -1;
      for (size_t k = first_new; k < arena.size(); ++k) {
        if (arena[k].ret == e->ret && arena[k].parent == c.frame) {
          frame = static_cast<int32_t>(k);
          break;
        }
      }
      if (frame < 0) {
        arena.push_back(Frame{e->ret, c.frame});
        frame = static_cast<int32_t>(arena.size() - 1);
      }
      AddConfig(set, Config{e->callee_start, frame});
    }
  }
  return flags;
}

// out = Close(step of closed `in` by byte b). Returns the closure's flags.
inline int Step(const Grammar& g, std::vector<Frame>& arena, const std::vector<Config>& in,
                uint8_t b, std::vector<Config>& out) {
  out.clear();
  for (const Config& c : in) {
    const int32_t t = g.Next(c.state, b);
    if (t >= 0) AddConfig(out, Config{t, c.frame});
  }
  if (out.empty()) return 0;
  return Close(g, arena, out);
}

inline void SetBit(uint32_t* mask, int32_t id) { mask[id >> 5] |= 1u << (id & 31); }
inline bool TestBit(const uint32_t* mask, int32_t id) { return (mask[id >> 5] >> (id & 31)) & 1u; }

}  // namespace

// --- CompiledGrammar ------------------------------------------------------

CompiledGrammar::CompiledGrammar(std::shared_ptr<const Grammar> grammar,
                                 std::shared_ptr<const Vocabulary> vocab)
    : grammar_(std::move(grammar)), vocab_(std::move(vocab)) {
  std::fill(std::begin(byte_token_), std::end(byte_token_), -1);
  for (int32_t id = 0; id < vocab_->size(); ++id) {
    const std::string& t = vocab_->token(id);
    if (t.size() == 1 && byte_token_[static_cast<uint8_t>(t[0])] < 0) {
      byte_token_[static_cast<uint8_t>(t[0])] = id;
    }
  }
}

size_t CompiledGrammar::cached_states() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cache_.size();
}

const CompiledGrammar::StateTokens& CompiledGrammar::TokensFor(int32_t state) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(state);
    if (it != cache_.end()) return *it->second;
  }
  // One walk of the trie from the state with an unknown caller.
  const Grammar& g = *grammar_;
  const Vocabulary& v = *vocab_;
  const int max_depth = v.max_token_bytes() + 1;
  std::vector<std::vector<Config>> level(max_depth + 1);
  std::vector<uint8_t> escaped(max_depth + 1, 0);  // some level 0..d can end its rule
  std::vector<size_t> arena_mark(max_depth + 1, 0);
  std::vector<Frame> arena;
  std::vector<uint32_t> accepted(v.mask_words(), 0);
  std::vector<int32_t> uncertain;
  level[0].push_back(Config{state, kSentinel});
  escaped[0] = (Close(g, arena, level[0]) & kEscapes) != 0;
  arena_mark[0] = arena.size();
  const std::vector<int32_t>& toks = v.trie_tokens();
  const int32_t n = v.trie_size();
  for (int32_t i = 1; i < n;) {
    const int32_t d = v.trie_depth(i);
    arena.resize(arena_mark[d - 1]);
    const int flags = Step(g, arena, level[d - 1], v.trie_byte(i), level[d]);
    if (level[d].empty()) {
      if (escaped[d - 1]) {
        for (int32_t k = v.trie_token_begin(i); k < v.trie_token_begin(v.trie_end(i)); ++k) {
          uncertain.push_back(toks[k]);
        }
      }
      i = v.trie_end(i);
      continue;
    }
    arena_mark[d] = arena.size();
    escaped[d] = escaped[d - 1] || (flags & kEscapes) != 0;
    for (int32_t k = v.trie_token_begin(i); k < v.trie_token_begin(i + 1); ++k) {
      SetBit(accepted.data(), toks[k]);
    }
    ++i;
  }
  auto result = std::make_unique<StateTokens>();
  std::sort(uncertain.begin(), uncertain.end());
  std::vector<int32_t> acc;
  for (int32_t id = 0; id < v.size(); ++id) {
    if (TestBit(accepted.data(), id)) acc.push_back(id);
  }
  const size_t rejected = v.size() - acc.size() - uncertain.size();
  if (rejected < acc.size()) {
    result->stores_rejected = true;
    size_t u = 0;
    for (int32_t id = 0; id < v.size(); ++id) {
      while (u < uncertain.size() && uncertain[u] < id) ++u;
      if (!TestBit(accepted.data(), id) && !(u < uncertain.size() && uncertain[u] == id)) {
        result->ids.push_back(id);
      }
    }
  } else {
    result->ids = std::move(acc);
  }
  result->uncertain = std::move(uncertain);
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = cache_.emplace(state, std::move(result));
  return *it->second;
}

// --- Matcher --------------------------------------------------------------

Matcher::Matcher(std::shared_ptr<const CompiledGrammar> grammar)
    : cg_(std::move(grammar)), g_(cg_->grammar()) {
  Reset();
}

void Matcher::Reset() {
  arena_.clear();
  history_.clear();
  Snapshot s;
  s.set.push_back(Config{g_.root_start(), kBottom});
  s.flags = Close(g_, arena_, s.set);
  s.arena_size = arena_.size();
  history_.push_back(std::move(s));
}

bool Matcher::Feed(absl::string_view bytes, Snapshot* out) {
  const size_t mark = arena_.size();
  scratch_a_ = history_.back().set;
  int flags = history_.back().flags;
  for (char c : bytes) {
    flags = Step(g_, arena_, scratch_a_, static_cast<uint8_t>(c), scratch_b_);
    if (scratch_b_.empty()) {
      arena_.resize(mark);
      return false;
    }
    std::swap(scratch_a_, scratch_b_);
  }
  out->set = scratch_a_;
  out->flags = flags;
  out->arena_size = arena_.size();
  return true;
}

bool Matcher::Alive(absl::string_view bytes) {
  const size_t mark = arena_.size();
  const std::vector<Config>* cur = &history_.back().set;
  bool alive = true;
  for (char c : bytes) {
    Step(g_, arena_, *cur, static_cast<uint8_t>(c), scratch_b_);
    if (scratch_b_.empty()) {
      alive = false;
      break;
    }
    std::swap(scratch_a_, scratch_b_);
    cur = &scratch_a_;
  }
  arena_.resize(mark);
  return alive;
}

bool Matcher::AcceptBytes(absl::string_view bytes) {
  if (IsTerminated()) return false;
  Snapshot s;
  if (!Feed(bytes, &s)) return false;
  history_.push_back(std::move(s));
  return true;
}

bool Matcher::AcceptToken(int32_t id) {
  const Vocabulary& v = cg_->vocab();
  if (IsTerminated() || id < 0 || id >= v.size()) return false;
  if (v.is_stop(id)) {
    if (!CanEnd()) return false;
    Snapshot s = history_.back();
    s.terminated = true;
    history_.push_back(std::move(s));
    return true;
  }
  if (v.token(id).empty()) return false;
  return AcceptBytes(v.token(id));
}

int64_t Matcher::MinBytesToEnd(const std::vector<Config>& set) const {
  int64_t best = std::numeric_limits<int64_t>::max();
  for (const Config& c : set) {
    int64_t cost = g_.BytesToRuleEnd(c.state);
    for (int32_t f = c.frame; f >= 0 && cost < best; f = arena_[f].parent) {
      cost += g_.BytesToRuleEnd(arena_[f].ret);
    }
    best = std::min(best, cost);
  }
  return best;
}

int64_t Matcher::MinBytesToEnd() const {
  if (IsTerminated()) return 0;
  return MinBytesToEnd(history_.back().set);
}

int64_t Matcher::MinBytesToEndAfter(int32_t id) {
  const Vocabulary& v = cg_->vocab();
  if (IsTerminated() || id < 0 || id >= v.size()) return -1;
  if (v.is_stop(id)) return CanEnd() ? 0 : -1;
  if (v.token(id).empty()) return -1;
  const size_t mark = arena_.size();
  Snapshot s;
  if (!Feed(v.token(id), &s)) return -1;
  const int64_t after = MinBytesToEnd(s.set);
  arena_.resize(mark);
  return after;
}

void Matcher::FillMaskWithinBudget(int64_t tokens_left, uint32_t* mask) {
  const Vocabulary& v = cg_->vocab();
  std::memset(mask, 0, sizeof(uint32_t) * v.mask_words());
  if (IsTerminated()) return;
  if (CanEnd()) {
    for (int32_t id : v.stop_tokens()) SetBit(mask, id);
  }
  for (int b = 0; b < 256; ++b) {
    const int32_t id = cg_->ByteToken(static_cast<uint8_t>(b));
    if (id < 0) continue;
    const int64_t after = MinBytesToEndAfter(id);
    if (after >= 0 && after + 2 <= tokens_left) SetBit(mask, id);
  }
}

bool Matcher::CanEnd() const { return !IsTerminated() && (history_.back().flags & kCanEnd) != 0; }

bool Matcher::Rollback(int n) {
  if (n < 0 || n > num_accepted()) return false;
  history_.resize(history_.size() - n);
  arena_.resize(history_.back().arena_size);
  return true;
}

bool Matcher::IsTokenAllowedUncached(int32_t id) {
  const Vocabulary& v = cg_->vocab();
  if (IsTerminated() || id < 0 || id >= v.size()) return false;
  if (v.is_stop(id)) return CanEnd();
  if (v.token(id).empty()) return false;
  return Alive(v.token(id));
}

void Matcher::FillMask(uint32_t* mask) {
  const Vocabulary& v = cg_->vocab();
  const int32_t words = v.mask_words();
  std::memset(mask, 0, sizeof(uint32_t) * words);
  if (IsTerminated()) return;
  const std::vector<Config>& set = history_.back().set;
  // Distinct states of the current set.
  std::vector<int32_t> states;
  for (const Config& c : set) states.push_back(c.state);
  std::sort(states.begin(), states.end());
  states.erase(std::unique(states.begin(), states.end()), states.end());
  std::vector<const CompiledGrammar::StateTokens*> parts;
  for (int32_t s : states) parts.push_back(&cg_->TokensFor(s));
  for (const CompiledGrammar::StateTokens* p : parts) {
    if (p->stores_rejected) {
      // accepted = everything - rejected - uncertain
      tmp_mask_.assign(words, ~0u);
      if (v.size() % 32) tmp_mask_[words - 1] = (1u << (v.size() % 32)) - 1;
      for (int32_t id : p->ids) tmp_mask_[id >> 5] &= ~(1u << (id & 31));
      for (int32_t id : p->uncertain) tmp_mask_[id >> 5] &= ~(1u << (id & 31));
      for (int32_t w = 0; w < words; ++w) mask[w] |= tmp_mask_[w];
    } else {
      for (int32_t id : p->ids) SetBit(mask, id);
    }
  }
  // Uncertain tokens: checked against the real stacks.
  for (const CompiledGrammar::StateTokens* p : parts) {
    for (int32_t id : p->uncertain) {
      if (!TestBit(mask, id) && Alive(v.token(id))) SetBit(mask, id);
    }
  }
  if (CanEnd()) {
    for (int32_t id : v.stop_tokens()) SetBit(mask, id);
  }
}

void MaskLogits(const uint32_t* mask, int32_t mask_ids, float* logits, int32_t n) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int32_t i = 0; i < n; ++i) {
    if (i >= mask_ids || !((mask[i >> 5] >> (i & 31)) & 1u)) logits[i] = neg_inf;
  }
}

}  // namespace vlm::grammar
