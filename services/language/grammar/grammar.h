// A byte-level grammar for constrained decoding: a set of rules, each a
// deterministic automaton over bytes whose edges may also call another rule
// (a recursive transition network, i.e. a pushdown automaton whose stack holds
// return states). JSON Schemas, JSON mode and regular expressions are
// translated into this form (json_schema.h, regex.h) through GrammarBuilder.
//
// Layers: GrammarBuilder holds an expression per rule (bytes, sequence,
// alternation, bounded repetition, rule call); Build() turns each rule into a
// byte NFA (Thompson), determinizes it (subset construction, calls treated as
// symbols), drops states that cannot reach the rule's end, rejects
// left-recursive rules (a rule that can call itself before reading a byte
// would make the matcher's closure infinite), and packs the transitions into a
// dense table over byte classes. Everything is immutable after Build().
#pragma once

#include <bitset>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace vlm::grammar {

using ByteSet = std::bitset<256>;

// Size and time limits of one compilation; exceeding one gives
// RESOURCE_EXHAUSTED naming the limit ("grammar too large"), never unbounded
// memory or time.
struct GrammarLimits {
  int64_t max_expr_nodes = 400000;
  int64_t max_nfa_states = 1000000;
  int64_t max_dfa_states = 100000;
  int64_t max_compile_ms = 5000;  // automaton construction (Build)
};

class Grammar;

class GrammarBuilder {
 public:
  using ExprId = int32_t;
  using RuleId = int32_t;

  explicit GrammarBuilder(GrammarLimits limits = {}) : limits_(limits) {}

  ExprId Empty();                         // matches ""
  ExprId Nothing();                       // matches no string at all
  ExprId Bytes(const ByteSet& set);       // one byte from `set`
  ExprId Byte(uint8_t b);
  ExprId ByteRange(uint8_t lo, uint8_t hi);
  ExprId Literal(absl::string_view bytes);
  ExprId Seq(std::vector<ExprId> parts);
  ExprId Alt(std::vector<ExprId> options);
  // `e` repeated min..max times; max < 0 means unbounded.
  ExprId Repeat(ExprId e, int32_t min, int32_t max);
  ExprId Optional(ExprId e) { return Repeat(e, 0, 1); }
  ExprId Star(ExprId e) { return Repeat(e, 0, -1); }
  ExprId Call(RuleId rule);

  RuleId AddRule(std::string name);
  void SetRuleBody(RuleId rule, ExprId body);
  int num_rules() const { return static_cast<int>(rules_.size()); }

  // True once the expression limit was hit; further nodes are not stored and
  // Build() fails with RESOURCE_EXHAUSTED.
  bool overflowed() const { return overflowed_; }
  int64_t num_exprs() const { return static_cast<int64_t>(exprs_.size()); }

  absl::StatusOr<std::shared_ptr<const Grammar>> Build(RuleId root) const;

 private:
  friend class GrammarCompilation;
  enum class Kind : uint8_t { kEmpty, kNothing, kBytes, kSeq, kAlt, kRepeat, kCall };
  struct Expr {
    Kind kind = Kind::kEmpty;
    ByteSet bytes;
    std::vector<ExprId> kids;
    int32_t min = 0, max = 0;
    RuleId rule = -1;
  };
  static Expr MakeExpr(Kind kind);
  ExprId Add(Expr e);

  GrammarLimits limits_;
  std::vector<Expr> exprs_;
  struct Rule {
    std::string name;
    ExprId body = -1;
  };
  std::vector<Rule> rules_;
  bool overflowed_ = false;
};

// The compiled automaton. States are numbered globally across rules.
class Grammar {
 public:
  struct CallEdge {
    int32_t callee_start;  // start state of the called rule
    int32_t ret;           // state of the caller after the callee returns
  };

  int num_states() const { return static_cast<int>(final_.size()); }
  int num_rules() const { return static_cast<int>(rule_start_.size()); }
  int root_start() const { return root_start_; }
  // Next state on byte `b`, or -1.
  int32_t Next(int32_t state, uint8_t b) const {
    return trans_[static_cast<size_t>(state) * num_classes_ + byte_class_[b]];
  }
  // True if the state's rule may end (return to its caller) here.
  bool IsFinal(int32_t state) const { return final_[state] != 0; }
  const CallEdge* CallsBegin(int32_t state) const { return calls_.data() + call_begin_[state]; }
  const CallEdge* CallsEnd(int32_t state) const { return calls_.data() + call_begin_[state + 1]; }
  bool HasCalls(int32_t state) const { return call_begin_[state] != call_begin_[state + 1]; }
  int num_byte_classes() const { return num_classes_; }

  // Length in bytes of the shortest complete output (used to refuse a request
  // whose max_tokens cannot fit any valid output).
  int64_t MinOutputBytes() const { return min_output_bytes_; }
  // Fewest bytes from `state` to the end of its rule (calls at their
  // callees' shortest length): with a stack, the shortest completion of a
  // configuration (Matcher::MinBytesToEnd).
  int64_t BytesToRuleEnd(int32_t state) const { return to_rule_end_[state]; }
  // A summary for logs and tests: rules, states, byte classes.
  std::string DebugSummary() const;

 private:
  friend class GrammarCompilation;
  int num_classes_ = 1;
  uint8_t byte_class_[256] = {};
  std::vector<int32_t> trans_;
  std::vector<uint8_t> final_;
  std::vector<int32_t> call_begin_;
  std::vector<CallEdge> calls_;
  std::vector<int32_t> rule_start_;
  std::vector<std::string> rule_names_;
  int32_t root_start_ = 0;
  int64_t min_output_bytes_ = 0;
  std::vector<int64_t> to_rule_end_;
};

}  // namespace vlm::grammar
