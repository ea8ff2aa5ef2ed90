#include "services/language/grammar/grammar_cache.h"

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"

namespace vlm::grammar {

GrammarCache::GrammarCache(std::shared_ptr<const Vocabulary> vocab, size_t capacity, JsonFormat format)
    : vocab_(std::move(vocab)), capacity_(capacity == 0 ? 1 : capacity), format_(format) {}

absl::StatusOr<std::shared_ptr<const CompiledGrammar>> GrammarCache::Get(GrammarKind kind,
                                                                        absl::string_view text) {
  if (kind == GrammarKind::kJsonValue || kind == GrammarKind::kJsonObject) text = {};
  const std::string key = absl::StrCat(static_cast<int>(kind), "|", text);
  const uint64_t hash = absl::HashOf(key);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(hash);
    if (it != index_.end() && it->second->key == key) {
      lru_.splice(lru_.begin(), lru_, it->second);
      ++hits_;
      return it->second->grammar;
    }
    ++misses_;
  }
  absl::StatusOr<std::shared_ptr<const Grammar>> g;
  switch (kind) {
    case GrammarKind::kJsonSchema: g = CompileJsonSchema(text, format_); break;
    case GrammarKind::kJsonValue: g = CompileJsonMode(false, format_); break;
    case GrammarKind::kJsonObject: g = CompileJsonMode(true, format_); break;
    case GrammarKind::kRegex: g = CompileRegex(text, format_.limits); break;
    case GrammarKind::kToolCall:
      g = CompileJsonSchemaBetween(text, kToolCallPrefix, kToolCallSuffix, format_);
      break;
  }
  if (!g.ok()) return g.status();
  auto compiled = std::make_shared<const CompiledGrammar>(*std::move(g), vocab_);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(hash);
  if (it != index_.end()) {  // a racing compile or a hash collision: replace
    lru_.erase(it->second);
    index_.erase(it);
  }
  lru_.push_front(Entry{key, compiled});
  index_[hash] = lru_.begin();
  while (lru_.size() > capacity_) {
    index_.erase(absl::HashOf(lru_.back().key));
    lru_.pop_back();
  }
  return compiled;
}

size_t GrammarCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lru_.size();
}
int64_t GrammarCache::hits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
}
int64_t GrammarCache::misses() const {
  std::lock_guard<std::mutex> lock(mu_);
  return misses_;
}

}  // namespace vlm::grammar
