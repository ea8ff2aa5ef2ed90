#include "services/language/grammar/vocabulary.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace vlm::grammar {

absl::StatusOr<std::shared_ptr<const Vocabulary>> Vocabulary::Create(
    std::vector<std::string> token_bytes, std::vector<int32_t> stop_tokens) {
  std::shared_ptr<Vocabulary> v(new Vocabulary());
  v->tokens_ = std::move(token_bytes);
  const int32_t n = v->size();
  v->is_stop_.assign(n, 0);
  for (int32_t id : stop_tokens) {
    if (id < 0 || id >= n) {
      return absl::InvalidArgumentError(absl::StrCat("stop token ", id, " is outside the vocabulary of ", n));
    }
    if (!v->is_stop_[id]) v->stop_tokens_.push_back(id);
    v->is_stop_[id] = 1;
  }
  std::vector<int32_t> order;
  for (int32_t id = 0; id < n; ++id) {
    if (!v->tokens_[id].empty() && !v->is_stop_[id]) order.push_back(id);
  }
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return v->tokens_[a] != v->tokens_[b] ? v->tokens_[a] < v->tokens_[b] : a < b;
  });
  // Sorted order visits the trie in preorder: each token shares a prefix
  // with the path so far, and the nodes below that prefix are new.
  v->byte_ = {0};
  v->depth_ = {0};
  v->end_ = {0};
  std::vector<int32_t> path = {0};  // path[d]: node at depth d
  std::vector<std::pair<int32_t, int32_t>> node_token;  // (node, id)
  auto close_to = [&](size_t depth) {
    while (path.size() > depth + 1) {
      v->end_[path.back()] = static_cast<int32_t>(v->byte_.size());
      path.pop_back();
    }
  };
  const std::string* prev = nullptr;
  for (int32_t id : order) {
    const std::string& t = v->tokens_[id];
    v->max_len_ = std::max<int>(v->max_len_, static_cast<int>(t.size()));
    size_t common = 0;
    if (prev) {
      while (common < prev->size() && common < t.size() && (*prev)[common] == t[common]) ++common;
    }
    close_to(common);
    for (size_t d = common; d < t.size(); ++d) {
      v->byte_.push_back(static_cast<uint8_t>(t[d]));
      v->depth_.push_back(static_cast<int32_t>(d + 1));
      v->end_.push_back(0);
      path.push_back(static_cast<int32_t>(v->byte_.size() - 1));
    }
    node_token.emplace_back(path.back(), id);
    prev = &t;
  }
  close_to(0);
  v->end_[0] = static_cast<int32_t>(v->byte_.size());
  const int32_t nodes = static_cast<int32_t>(v->byte_.size());
  v->token_begin_.assign(nodes + 1, 0);
  for (const auto& [node, id] : node_token) ++v->token_begin_[node + 1];
  std::partial_sum(v->token_begin_.begin(), v->token_begin_.end(), v->token_begin_.begin());
  v->token_ids_.resize(node_token.size());
  std::vector<int32_t> fill(v->token_begin_.begin(), v->token_begin_.end() - 1);
  for (const auto& [node, id] : node_token) v->token_ids_[fill[node]++] = id;
  return std::shared_ptr<const Vocabulary>(std::move(v));
}

absl::StatusOr<std::string> ByteLevelDecode(absl::string_view token) {
  // GPT-2: printable Latin-1 bytes map to themselves; the other 68 bytes map
  // to U+0100.. in byte order.
  static const auto* table = [] {
    auto* t = new std::vector<int16_t>(0x200, -1);
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      if (printable) {
        (*t)[b] = static_cast<int16_t>(b);
      } else {
        (*t)[256 + next++] = static_cast<int16_t>(b);
      }
    }
    return t;
  }();
  std::string out;
  for (size_t i = 0; i < token.size();) {
    const uint8_t c = static_cast<uint8_t>(token[i]);
    uint32_t cp;
    if (c < 0x80) {
      cp = c;
      i += 1;
    } else if ((c >> 5) == 6 && i + 1 < token.size()) {
      cp = ((c & 0x1F) << 6) | (static_cast<uint8_t>(token[i + 1]) & 0x3F);
      i += 2;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("not a byte-level token: \"", token, "\""));
    }
    if (cp >= table->size() || (*table)[cp] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("not a byte-level token: \"", token, "\""));
    }
    out.push_back(static_cast<char>((*table)[cp]));
  }
  return out;
}

}  // namespace vlm::grammar
