// Compiled grammars shared across requests, keyed by a hash of (kind,
// options, text): the same response_format compiles once, and its token-mask
// cache (matcher.h) keeps warming across requests. Least recently used
// entries are evicted beyond `capacity`. Thread-safe; compilation runs
// outside the lock (two requests racing on a new schema may both compile).
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/language/grammar/json_schema.h"
#include "services/language/grammar/matcher.h"
#include "services/language/grammar/vocabulary.h"

namespace vlm::grammar {

// kToolCall: a JSON Schema value between Qwen3's tool-call tags
// (kToolCallPrefix + value + kToolCallSuffix).
enum class GrammarKind { kJsonSchema, kJsonValue, kJsonObject, kRegex, kToolCall };
inline constexpr char kToolCallPrefix[] = "<tool_call>\n";
inline constexpr char kToolCallSuffix[] = "\n</tool_call>";

class GrammarCache {
 public:
  GrammarCache(std::shared_ptr<const Vocabulary> vocab, size_t capacity, JsonFormat format = {});

  // `text`: the schema (kJsonSchema, kToolCall) or pattern (kRegex); ignored for JSON mode.
  absl::StatusOr<std::shared_ptr<const CompiledGrammar>> Get(GrammarKind kind, absl::string_view text);

  size_t size() const;
  int64_t hits() const;
  int64_t misses() const;

 private:
  struct Entry {
    std::string key;
    std::shared_ptr<const CompiledGrammar> grammar;
  };
  std::shared_ptr<const Vocabulary> vocab_;
  size_t capacity_;
  JsonFormat format_;
  mutable std::mutex mu_;
  std::list<Entry> lru_;  // front: most recent
  absl::flat_hash_map<uint64_t, std::list<Entry>::iterator> index_;
  int64_t hits_ = 0, misses_ = 0;
};

}  // namespace vlm::grammar
