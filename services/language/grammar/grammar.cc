#include "services/language/grammar/grammar.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <queue>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace vlm::grammar {

// --- builder ------------------------------------------------------------

GrammarBuilder::Expr GrammarBuilder::MakeExpr(Kind kind) {
  Expr e;
  e.kind = kind;
  return e;
}

GrammarBuilder::ExprId GrammarBuilder::Add(Expr e) {
  if (overflowed_ || static_cast<int64_t>(exprs_.size()) >= limits_.max_expr_nodes) {
    overflowed_ = true;
    return 0;
  }
  exprs_.push_back(std::move(e));
  return static_cast<ExprId>(exprs_.size() - 1);
}

GrammarBuilder::ExprId GrammarBuilder::Empty() { return Add(MakeExpr(Kind::kEmpty)); }
GrammarBuilder::ExprId GrammarBuilder::Nothing() { return Add(MakeExpr(Kind::kNothing)); }

GrammarBuilder::ExprId GrammarBuilder::Bytes(const ByteSet& set) {
  if (set.none()) return Nothing();
  Expr e = MakeExpr(Kind::kBytes);
  e.bytes = set;
  return Add(std::move(e));
}

GrammarBuilder::ExprId GrammarBuilder::Byte(uint8_t b) {
  ByteSet s;
  s.set(b);
  return Bytes(s);
}

GrammarBuilder::ExprId GrammarBuilder::ByteRange(uint8_t lo, uint8_t hi) {
  ByteSet s;
  for (int b = lo; b <= hi; ++b) s.set(b);
  return Bytes(s);
}

GrammarBuilder::ExprId GrammarBuilder::Literal(absl::string_view bytes) {
  if (bytes.empty()) return Empty();
  std::vector<ExprId> parts;
  parts.reserve(bytes.size());
  for (char c : bytes) parts.push_back(Byte(static_cast<uint8_t>(c)));
  return Seq(std::move(parts));
}

GrammarBuilder::ExprId GrammarBuilder::Seq(std::vector<ExprId> parts) {
  if (parts.empty()) return Empty();
  if (parts.size() == 1) return parts[0];
  Expr e = MakeExpr(Kind::kSeq);
  e.kids = std::move(parts);
  return Add(std::move(e));
}

GrammarBuilder::ExprId GrammarBuilder::Alt(std::vector<ExprId> options) {
  if (options.empty()) return Nothing();
  if (options.size() == 1) return options[0];
  Expr e = MakeExpr(Kind::kAlt);
  e.kids = std::move(options);
  return Add(std::move(e));
}

GrammarBuilder::ExprId GrammarBuilder::Repeat(ExprId x, int32_t min, int32_t max) {
  if (max >= 0 && max < min) return Nothing();
  if (min == 1 && max == 1) return x;
  if (max == 0) return Empty();
  Expr e = MakeExpr(Kind::kRepeat);
  e.kids = {x};
  e.min = min;
  e.max = max;
  return Add(std::move(e));
}

GrammarBuilder::ExprId GrammarBuilder::Call(RuleId rule) {
  Expr e = MakeExpr(Kind::kCall);
  e.rule = rule;
  return Add(std::move(e));
}

GrammarBuilder::RuleId GrammarBuilder::AddRule(std::string name) {
  rules_.push_back(Rule{std::move(name), -1});
  return static_cast<RuleId>(rules_.size() - 1);
}

void GrammarBuilder::SetRuleBody(RuleId rule, ExprId body) { rules_[rule].body = body; }

// --- compilation ----------------------------------------------------------

// One Build() call: NFA per rule, subset construction, pruning, packing.
class GrammarCompilation {
 public:
  explicit GrammarCompilation(const GrammarBuilder& b)
      : b_(b),
        deadline_(std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(b.limits_.max_compile_ms)) {}

  absl::StatusOr<std::shared_ptr<const Grammar>> Run(GrammarBuilder::RuleId root);

 private:
  using Kind = GrammarBuilder::Kind;
  struct NState {
    std::vector<int32_t> eps;
    std::vector<std::pair<ByteSet, int32_t>> bytes;
    std::vector<std::pair<int32_t, int32_t>> calls;  // (rule, target)
  };
  struct Frag {
    int32_t start, end;
  };
  // Per-rule DFA before global numbering.
  struct DState {
    int32_t next[256];
    std::vector<std::pair<int32_t, int32_t>> calls;  // (rule, local target)
    bool final = false;
  };

  int32_t NewState() {
    nfa_.emplace_back();
    return static_cast<int32_t>(nfa_.size() - 1);
  }
  absl::StatusOr<Frag> BuildNfa(GrammarBuilder::ExprId e, int depth);
  // Epsilon closure, kept to the states that matter for the DFA (those with
  // byte or call edges, and the rule's end), sorted: equal sets, equal key.
  void Closure(std::vector<int32_t>* set);
  absl::Status Determinize(int rule, int32_t nfa_start, int32_t nfa_end);
  // Run's steps after the rule DFAs: global numbering, productive states,
  // pruning, the left-recursion check, the tables, the shortest outputs.
  absl::Status BuildRuleDfas();
  int32_t Global(int rule, int32_t local) const { return base_[rule] + local; }
  std::vector<uint8_t> ProductiveStates() const;
  void PruneUnproductive(const std::vector<uint8_t>& productive);
  absl::Status CheckNoLeftRecursion() const;
  void BuildTables(Grammar* g) const;
  std::vector<int64_t> ShortestOutputs() const;
  // Per global state: the fewest bytes to the end of its rule.
  std::vector<int64_t> BytesToRuleEnd(const std::vector<int64_t>& rule_min) const;

  const GrammarBuilder& b_;
  std::vector<NState> nfa_;
  std::vector<std::vector<DState>> dfa_;  // per rule; state 0 is the start
  int64_t total_dfa_states_ = 0;
  std::vector<int32_t> base_;  // global number of each rule's state 0; base_[rules] = total
  std::chrono::steady_clock::time_point deadline_;
  int32_t rule_end_ = -1;  // NFA end state of the rule being determinized
  std::vector<uint8_t> seen_;
  std::vector<int32_t> closure_work_, closure_all_;
  std::vector<std::vector<int32_t>> per_byte_ = std::vector<std::vector<int32_t>>(256);
};

absl::StatusOr<GrammarCompilation::Frag> GrammarCompilation::BuildNfa(GrammarBuilder::ExprId id,
                                                                      int depth) {
  if (depth > 2000) return absl::ResourceExhaustedError("grammar too large: expressions nest too deeply");
  if (static_cast<int64_t>(nfa_.size()) > b_.limits_.max_nfa_states) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "grammar too large: more than ", b_.limits_.max_nfa_states, " automaton states"));
  }
  const GrammarBuilder::Expr& e = b_.exprs_[id];
  switch (e.kind) {
    case Kind::kEmpty: {
      int32_t s = NewState(), t = NewState();
      nfa_[s].eps.push_back(t);
      return Frag{s, t};
    }
    case Kind::kNothing: {
      int32_t s = NewState(), t = NewState();
      return Frag{s, t};
    }
    case Kind::kBytes: {
      int32_t s = NewState(), t = NewState();
      nfa_[s].bytes.emplace_back(e.bytes, t);
      return Frag{s, t};
    }
    case Kind::kCall: {
      int32_t s = NewState(), t = NewState();
      nfa_[s].calls.emplace_back(e.rule, t);
      return Frag{s, t};
    }
    case Kind::kSeq: {
      int32_t s = NewState(), cur = s;
      for (GrammarBuilder::ExprId k : e.kids) {
        absl::StatusOr<Frag> f = BuildNfa(k, depth + 1);
        if (!f.ok()) return f.status();
        nfa_[cur].eps.push_back(f->start);
        cur = f->end;
      }
      return Frag{s, cur};
    }
    case Kind::kAlt: {
      int32_t s = NewState(), t = NewState();
      for (GrammarBuilder::ExprId k : e.kids) {
        absl::StatusOr<Frag> f = BuildNfa(k, depth + 1);
        if (!f.ok()) return f.status();
        nfa_[s].eps.push_back(f->start);
        nfa_[f->end].eps.push_back(t);
      }
      return Frag{s, t};
    }
    case Kind::kRepeat: {
      const GrammarBuilder::ExprId kid = e.kids[0];
      int32_t s = NewState(), cur = s;
      for (int32_t i = 0; i < e.min; ++i) {
        absl::StatusOr<Frag> f = BuildNfa(kid, depth + 1);
        if (!f.ok()) return f.status();
        nfa_[cur].eps.push_back(f->start);
        cur = f->end;
      }
      int32_t t = NewState();
      if (e.max < 0) {
        absl::StatusOr<Frag> f = BuildNfa(kid, depth + 1);
        if (!f.ok()) return f.status();
        nfa_[cur].eps.push_back(f->start);
        nfa_[cur].eps.push_back(t);
        nfa_[f->end].eps.push_back(f->start);
        nfa_[f->end].eps.push_back(t);
        return Frag{s, t};
      }
      for (int32_t i = e.min; i < e.max; ++i) {
        absl::StatusOr<Frag> f = BuildNfa(kid, depth + 1);
        if (!f.ok()) return f.status();
        nfa_[cur].eps.push_back(f->start);
        nfa_[cur].eps.push_back(t);
        cur = f->end;
      }
      nfa_[cur].eps.push_back(t);
      return Frag{s, t};
    }
  }
  return absl::InternalError("unknown expression kind");
}

void GrammarCompilation::Closure(std::vector<int32_t>* set) {
  seen_.resize(nfa_.size(), 0);
  // Scratch vectors kept across calls: Determinize closes a set per target.
  std::vector<int32_t>& work = closure_work_;
  std::vector<int32_t>& all = closure_all_;
  work.clear();
  all.clear();
  for (int32_t s : *set) {
    if (!seen_[s]) {
      seen_[s] = 1;
      all.push_back(s);
      work.push_back(s);
    }
  }
  while (!work.empty()) {
    int32_t s = work.back();
    work.pop_back();
    for (int32_t t : nfa_[s].eps) {
      if (!seen_[t]) {
        seen_[t] = 1;
        all.push_back(t);
        work.push_back(t);
      }
    }
  }
  set->clear();
  for (int32_t s : all) {
    seen_[s] = 0;
    if (!nfa_[s].bytes.empty() || !nfa_[s].calls.empty() || s == rule_end_) set->push_back(s);
  }
  std::sort(set->begin(), set->end());
  set->erase(std::unique(set->begin(), set->end()), set->end());
}

absl::Status GrammarCompilation::Determinize(int rule, int32_t nfa_start, int32_t nfa_end) {
  rule_end_ = nfa_end;
  std::vector<DState>& out = dfa_[rule];
  // Hashed: a schema's rules intern thousands of sets (ids in insertion order).
  absl::flat_hash_map<std::vector<int32_t>, int32_t> ids;
  std::vector<std::vector<int32_t>> sets;
  auto intern = [&](std::vector<int32_t> set) -> absl::StatusOr<int32_t> {
    Closure(&set);
    if (set.empty()) return -1;
    auto it = ids.find(set);
    if (it != ids.end()) return it->second;
    if (++total_dfa_states_ > b_.limits_.max_dfa_states) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "grammar too large: more than ", b_.limits_.max_dfa_states, " automaton states"));
    }
    int32_t id = static_cast<int32_t>(sets.size());
    ids.emplace(set, id);
    sets.push_back(std::move(set));
    out.emplace_back();
    return id;
  };
  absl::StatusOr<int32_t> start = intern({nfa_start});
  if (!start.ok()) return start.status();
  if (*start < 0) {  // an empty start set cannot happen: Closure keeps nfa_start's end
    out.emplace_back();
  }
  for (size_t i = 0; i < sets.size(); ++i) {
    if (i % 64 == 63 && std::chrono::steady_clock::now() > deadline_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "grammar too large: compilation took more than ", b_.limits_.max_compile_ms, " ms"));
    }
    const std::vector<int32_t> members = sets[i];
    DState& d = out[i];
    std::fill(std::begin(d.next), std::end(d.next), -1);
    d.final = std::binary_search(members.begin(), members.end(), nfa_end);
    // Byte transitions: the target set of each byte; a byte whose set equals
    // the previous byte's reuses its target (classes are mostly runs).
    for (auto& v : per_byte_) v.clear();
    for (int32_t s : members) {
      for (const auto& [set, t] : nfa_[s].bytes) {
        for (size_t b = set._Find_first(); b < 256; b = set._Find_next(b)) per_byte_[b].push_back(t);
      }
    }
    absl::flat_hash_map<std::vector<int32_t>, int32_t> local;
    int32_t prev_target = -1;
    for (int b = 0; b < 256; ++b) {
      std::vector<int32_t>& targets = per_byte_[b];
      if (targets.empty()) {
        prev_target = -1;
        continue;
      }
      std::sort(targets.begin(), targets.end());
      targets.erase(std::unique(targets.begin(), targets.end()), targets.end());
      int32_t target;
      if (b > 0 && prev_target >= 0 && targets == per_byte_[b - 1]) {
        target = prev_target;
      } else if (auto it = local.find(targets); it != local.end()) {
        target = it->second;
      } else {
        absl::StatusOr<int32_t> t = intern(targets);
        if (!t.ok()) return t.status();
        target = *t;
        local.emplace(targets, target);
      }
      out[i].next[b] = target;  // `out` may have grown: index again
      prev_target = target;
    }
    std::map<int32_t, std::vector<int32_t>> per_rule;
    for (int32_t s : members) {
      for (const auto& [r, t] : nfa_[s].calls) per_rule[r].push_back(t);
    }
    for (auto& [r, targets] : per_rule) {
      absl::StatusOr<int32_t> t = intern(targets);
      if (!t.ok()) return t.status();
      if (*t >= 0) out[i].calls.emplace_back(r, *t);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Grammar>> GrammarCompilation::Run(
    GrammarBuilder::RuleId root) {
  if (b_.overflowed_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "grammar too large: more than ", b_.limits_.max_expr_nodes, " expression nodes"));
  }
  const int num_rules = static_cast<int>(b_.rules_.size());
  if (root < 0 || root >= num_rules) return absl::InvalidArgumentError("no root rule");
  if (absl::Status s = BuildRuleDfas(); !s.ok()) return s;
  // Global numbering: rule r's states are base_[r] .. base_[r + 1] - 1.
  base_.assign(num_rules + 1, 0);
  for (int r = 0; r < num_rules; ++r) base_[r + 1] = base_[r] + static_cast<int32_t>(dfa_[r].size());
  const std::vector<uint8_t> productive = ProductiveStates();
  if (!productive[Global(root, 0)]) {
    return absl::InvalidArgumentError("the schema admits no value");
  }
  PruneUnproductive(productive);
  if (absl::Status s = CheckNoLeftRecursion(); !s.ok()) return s;
  auto g = std::make_shared<Grammar>();
  BuildTables(g.get());
  g->root_start_ = Global(root, 0);
  const std::vector<int64_t> rule_min = ShortestOutputs();
  g->min_output_bytes_ = rule_min[root];
  g->to_rule_end_ = BytesToRuleEnd(rule_min);
  return std::shared_ptr<const Grammar>(std::move(g));
}

absl::Status GrammarCompilation::BuildRuleDfas() {
  const int num_rules = static_cast<int>(b_.rules_.size());
  dfa_.resize(num_rules);
  for (int r = 0; r < num_rules; ++r) {
    if (b_.rules_[r].body < 0) {
      return absl::InternalError(absl::StrCat("rule ", b_.rules_[r].name, " has no body"));
    }
    nfa_.clear();
    absl::StatusOr<Frag> f = BuildNfa(b_.rules_[r].body, 0);
    if (!f.ok()) return f.status();
    if (absl::Status s = Determinize(r, f->start, f->end); !s.ok()) return s;
  }

  return absl::OkStatus();
}

// Productive states: those from which the rule can end. A call edge counts
// once the callee's start and the return state are productive.
std::vector<uint8_t> GrammarCompilation::ProductiveStates() const {
  const int num_rules = static_cast<int>(dfa_.size());
  const int32_t n = base_[num_rules];
  std::vector<uint8_t> productive(n, 0);
  {
    // Worklist over reverse edges: a state is re-examined when a successor
    // (byte target, callee start or return state) becomes productive.
    std::vector<std::vector<int32_t>> rev(n);
    std::vector<int32_t> work;
    for (int r = 0; r < num_rules; ++r) {
      for (int32_t s = 0; s < static_cast<int32_t>(dfa_[r].size()); ++s) {
        const int32_t gs = Global(r, s);
        const DState& d = dfa_[r][s];
        int32_t last = -1;
        for (int b = 0; b < 256; ++b) {
          if (d.next[b] >= 0 && d.next[b] != last) rev[Global(r, d.next[b])].push_back(gs);
          last = d.next[b];
        }
        for (const auto& [callee, t] : d.calls) {
          rev[Global(callee, 0)].push_back(gs);
          rev[Global(r, t)].push_back(gs);
        }
        if (d.final) {
          productive[gs] = 1;
          work.push_back(gs);
        }
      }
    }
    std::vector<int32_t> rule_of(n);
    for (int r = 0; r < num_rules; ++r) {
      for (int32_t s = base_[r]; s < base_[r + 1]; ++s) rule_of[s] = r;
    }
    auto check = [&](int32_t gs) {
      const int r = rule_of[gs];
      const DState& d = dfa_[r][gs - base_[r]];
      for (int b = 0; b < 256; ++b) {
        if (d.next[b] >= 0 && productive[Global(r, d.next[b])]) return true;
      }
      for (const auto& [callee, t] : d.calls) {
        if (productive[Global(callee, 0)] && productive[Global(r, t)]) return true;
      }
      return false;
    };
    while (!work.empty()) {
      int32_t t = work.back();
      work.pop_back();
      for (int32_t gs : rev[t]) {
        if (!productive[gs] && check(gs)) {
          productive[gs] = 1;
          work.push_back(gs);
        }
      }
    }
  }
  return productive;
}

void GrammarCompilation::PruneUnproductive(const std::vector<uint8_t>& productive) {
  const int num_rules = static_cast<int>(dfa_.size());
  for (int r = 0; r < num_rules; ++r) {
    for (DState& d : dfa_[r]) {
      for (int b = 0; b < 256; ++b) {
        if (d.next[b] >= 0 && !productive[Global(r, d.next[b])]) d.next[b] = -1;
      }
      std::vector<std::pair<int32_t, int32_t>> kept;
      for (const auto& [callee, t] : d.calls) {
        if (productive[Global(callee, 0)] && productive[Global(r, t)]) kept.emplace_back(callee, t);
      }
      d.calls = std::move(kept);
    }
  }
}

absl::Status GrammarCompilation::CheckNoLeftRecursion() const {
  const int num_rules = static_cast<int>(dfa_.size());
  // Left recursion: a rule that can call itself (directly or through other
  // rules) before reading a byte. Nullable rules are followed through.
  std::vector<uint8_t> nullable(num_rules, 0);
  for (bool changed = true; changed;) {
    changed = false;
    for (int r = 0; r < num_rules; ++r) {
      if (nullable[r]) continue;
      std::vector<uint8_t> seen(dfa_[r].size(), 0);
      std::vector<int32_t> work = {0};
      seen[0] = 1;
      bool found = false;
      while (!work.empty() && !found) {
        int32_t s = work.back();
        work.pop_back();
        if (dfa_[r][s].final) found = true;
        for (const auto& [callee, t] : dfa_[r][s].calls) {
          if (nullable[callee] && !seen[t]) {
            seen[t] = 1;
            work.push_back(t);
          }
        }
      }
      if (found) {
        nullable[r] = 1;
        changed = true;
      }
    }
  }
  std::vector<std::vector<int32_t>> first_calls(num_rules);
  for (int r = 0; r < num_rules; ++r) {
    std::vector<uint8_t> seen(dfa_[r].size(), 0);
    std::vector<int32_t> work = {0};
    seen[0] = 1;
    while (!work.empty()) {
      int32_t s = work.back();
      work.pop_back();
      for (const auto& [callee, t] : dfa_[r][s].calls) {
        first_calls[r].push_back(callee);
        if (nullable[callee] && !seen[t]) {
          seen[t] = 1;
          work.push_back(t);
        }
      }
    }
  }
  {
    std::vector<uint8_t> color(num_rules, 0);  // 0 new, 1 on the path, 2 done
    for (int start = 0; start < num_rules; ++start) {
      if (color[start]) continue;
      std::vector<std::pair<int32_t, size_t>> path = {{start, 0}};
      color[start] = 1;
      while (!path.empty()) {
        auto& [r, i] = path.back();
        if (i == first_calls[r].size()) {
          color[r] = 2;
          path.pop_back();
          continue;
        }
        int32_t c = first_calls[r][i++];
        if (color[c] == 1) {
          return absl::InvalidArgumentError(absl::StrCat(
              "left-recursive definition: '", b_.rules_[c].name,
              "' can refer to itself before any character is produced"));
        }
        if (color[c] == 0) {
          color[c] = 1;
          path.emplace_back(c, 0);
        }
      }
    }
  }
  return absl::OkStatus();
}

// Byte classes (bytes that every state treats alike share one), the
// transition table over classes, finals and call edges.
void GrammarCompilation::BuildTables(Grammar* g) const {
  const int num_rules = static_cast<int>(dfa_.size());
  const int32_t n = base_[num_rules];
  {
    // Refines the byte classes by each state's transitions: bytes stay in
    // one class while every state sends them to the same target. New class
    // ids in order of first appearance over the bytes. Per old class, the
    // (target, new class) pairs seen so far: few per class, a linear search.
    std::vector<int32_t> cls(256, 0), next_cls(256);
    std::vector<std::vector<std::pair<int32_t, int32_t>>> seen(256);
    int num = 1;
    for (int r = 0; r < num_rules && num < 256; ++r) {
      for (const DState& d : dfa_[r]) {
        int32_t count = 0;
        for (int b = 0; b < 256; ++b) {
          std::vector<std::pair<int32_t, int32_t>>& pairs = seen[cls[b]];
          int32_t id = -1;
          for (const auto& [target, c] : pairs) {
            if (target == d.next[b]) {
              id = c;
              break;
            }
          }
          if (id < 0) {
            id = count++;
            pairs.emplace_back(d.next[b], id);
          }
          next_cls[b] = id;
        }
        for (int b = 0; b < 256; ++b) seen[cls[b]].clear();
        cls.swap(next_cls);
        num = count;
      }
    }
    g->num_classes_ = num;
    for (int b = 0; b < 256; ++b) g->byte_class_[b] = static_cast<uint8_t>(cls[b]);
  }
  const int c = g->num_classes_;
  g->trans_.assign(static_cast<size_t>(n) * c, -1);
  g->final_.assign(n, 0);
  g->call_begin_.assign(n + 1, 0);
  for (int r = 0; r < num_rules; ++r) {
    g->rule_start_.push_back(Global(r, 0));
    g->rule_names_.push_back(b_.rules_[r].name);
    for (int32_t s = 0; s < static_cast<int32_t>(dfa_[r].size()); ++s) {
      const DState& d = dfa_[r][s];
      const int32_t gs = Global(r, s);
      for (int b = 0; b < 256; ++b) {
        g->trans_[static_cast<size_t>(gs) * c + g->byte_class_[b]] =
            d.next[b] >= 0 ? Global(r, d.next[b]) : -1;
      }
      g->final_[gs] = d.final ? 1 : 0;
      for (const auto& [callee, t] : d.calls) {
        g->calls_.push_back(Grammar::CallEdge{Global(callee, 0), Global(r, t)});
      }
      g->call_begin_[gs + 1] = static_cast<int32_t>(g->calls_.size());
    }
  }
}

// Shortest output per rule: the shortest path from its start to a final
// state, where a call costs its callee's shortest length; iterated to a
// fixpoint.
std::vector<int64_t> GrammarCompilation::ShortestOutputs() const {
  const int num_rules = static_cast<int>(dfa_.size());
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max() / 4;
  std::vector<int64_t> rule_min(num_rules, kInf);
  for (bool changed = true; changed;) {
    changed = false;
    for (int r = 0; r < num_rules; ++r) {
      const int32_t m = static_cast<int32_t>(dfa_[r].size());
      std::vector<int64_t> dist(m, kInf);
      using Item = std::pair<int64_t, int32_t>;
      std::priority_queue<Item, std::vector<Item>, std::greater<Item>> pq;
      dist[0] = 0;
      pq.emplace(0, 0);
      int64_t best = kInf;
      while (!pq.empty()) {
        const int64_t d0 = pq.top().first;
        const int32_t s = pq.top().second;
        pq.pop();
        if (d0 != dist[s]) continue;
        if (dfa_[r][s].final) best = std::min(best, d0);
        auto relax = [&](int32_t t, int64_t w) {
          if (t >= 0 && w < kInf && d0 + w < dist[t]) {
            dist[t] = d0 + w;
            pq.emplace(dist[t], t);
          }
        };
        for (int b = 0; b < 256; ++b) relax(dfa_[r][s].next[b], 1);
        for (const auto& [callee, t] : dfa_[r][s].calls) relax(t, rule_min[callee]);
      }
      if (best < rule_min[r]) {
        rule_min[r] = best;
        changed = true;
      }
    }
  }
  return rule_min;
}

// Dijkstra from the final states over reversed edges (a byte costs 1, a
// call its callee's shortest output), per rule.
std::vector<int64_t> GrammarCompilation::BytesToRuleEnd(const std::vector<int64_t>& rule_min) const {
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max() / 4;
  std::vector<int64_t> out(base_.back(), kInf);
  for (int r = 0; r < static_cast<int>(dfa_.size()); ++r) {
    const int32_t m = static_cast<int32_t>(dfa_[r].size());
    std::vector<std::vector<std::pair<int32_t, int64_t>>> rev(m);
    std::vector<int32_t> seen(m, -1);
    for (int32_t s = 0; s < m; ++s) {
      for (int b = 0; b < 256; ++b) {
        const int32_t t = dfa_[r][s].next[b];
        if (t >= 0 && seen[t] != s) {
          seen[t] = s;
          rev[t].emplace_back(s, 1);
        }
      }
      for (const auto& [callee, t] : dfa_[r][s].calls) {
        if (rule_min[callee] < kInf) rev[t].emplace_back(s, rule_min[callee]);
      }
    }
    std::vector<int64_t> dist(m, kInf);
    using Item = std::pair<int64_t, int32_t>;
    std::priority_queue<Item, std::vector<Item>, std::greater<Item>> pq;
    for (int32_t s = 0; s < m; ++s) {
      if (dfa_[r][s].final) {
        dist[s] = 0;
        pq.emplace(0, s);
      }
    }
    while (!pq.empty()) {
      const auto [d0, t] = pq.top();
      pq.pop();
      if (d0 != dist[t]) continue;
      for (const auto& [s, w] : rev[t]) {
        if (d0 + w < dist[s]) {
          dist[s] = d0 + w;
          pq.emplace(dist[s], s);
        }
      }
    }
    for (int32_t s = 0; s < m; ++s) out[Global(r, s)] = dist[s];
  }
  return out;
}

absl::StatusOr<std::shared_ptr<const Grammar>> GrammarBuilder::Build(RuleId root) const {
  GrammarCompilation c(*this);
  return c.Run(root);
}

std::string Grammar::DebugSummary() const {
  return absl::StrCat(num_rules(), " rules, ", num_states(), " states, ", num_classes_,
                      " byte classes, ", calls_.size(), " call edges");
}

}  // namespace vlm::grammar
