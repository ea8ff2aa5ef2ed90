#include "services/language/sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace vlm::language {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// exp(d) for d below this is under float's normal range (1.2e-38). Such terms
// are taken as 0: they cannot matter next to the maximum's exp(0) = 1, and
// computing them as denormals costs ~10x per element.
constexpr float kExpFloor = -87.0f;

inline float ExpOrZero(float d) { return d > kExpFloor ? std::exp(d) : 0.0f; }

absl::Status OutOfRange(const std::string& prefix, const char* field, const char* range,
                        double value) {
  return absl::InvalidArgumentError(
      absl::StrCat(prefix, ".", field, " must be ", range, "; got ", value));
}

// Splitmix64: spreads a random_device draw over 64 bits.
uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t RandomSeed() {
  std::random_device device;
  const uint64_t hi = device();
  const uint64_t lo = device();
  return SplitMix64((hi << 32) ^ lo);
}

float MaxFinite(absl::Span<const float> logits) {
  float max = kNegInf;
  for (float v : logits) max = std::max(max, v);
  return max;
}

}  // namespace

absl::Status ValidateSamplingConfig(const SamplingConfig& c, const std::string& prefix) {
  if (!(c.temperature >= 0.0f) || std::isinf(c.temperature)) {
    return OutOfRange(prefix, "temperature", ">= 0 (0 means greedy)", c.temperature);
  }
  if (c.top_k < 0) return OutOfRange(prefix, "top_k", ">= 0 (0 disables)", c.top_k);
  if (!(c.top_p > 0.0f && c.top_p <= 1.0f)) {
    return OutOfRange(prefix, "top_p", "in (0, 1]", c.top_p);
  }
  if (!(c.min_p >= 0.0f && c.min_p < 1.0f)) {
    return OutOfRange(prefix, "min_p", "in [0, 1)", c.min_p);
  }
  if (!(c.repetition_penalty > 0.0f && c.repetition_penalty <= kMaxRepetitionPenalty)) {
    return OutOfRange(prefix, "repetition_penalty", "in (0, 100] (1 disables)",
                      c.repetition_penalty);
  }
  if (!(c.presence_penalty >= -2.0f && c.presence_penalty <= 2.0f)) {
    return OutOfRange(prefix, "presence_penalty", "in [-2, 2]", c.presence_penalty);
  }
  if (!(c.frequency_penalty >= -2.0f && c.frequency_penalty <= 2.0f)) {
    return OutOfRange(prefix, "frequency_penalty", "in [-2, 2]", c.frequency_penalty);
  }
  return absl::OkStatus();
}

void MaskVocabularyPadding(absl::Span<float> logits, int32_t valid_vocab) {
  for (size_t i = std::max<int64_t>(valid_vocab, 0); i < logits.size(); ++i) logits[i] = kNegInf;
}

void ApplyRepetitionPenalty(absl::Span<float> logits, absl::Span<const int32_t> seen_ids,
                            float penalty) {
  if (penalty == 1.0f) return;
  for (int32_t id : seen_ids) {
    if (id < 0 || static_cast<size_t>(id) >= logits.size()) continue;
    float& v = logits[id];
    v = v > 0 ? v / penalty : v * penalty;  // -inf stays -inf
  }
}

void ApplyPresenceFrequencyPenalties(absl::Span<float> logits,
                                     const absl::flat_hash_map<int32_t, int32_t>& counts,
                                     float presence, float frequency) {
  if (presence == 0.0f && frequency == 0.0f) return;
  for (const auto& [id, count] : counts) {
    if (id < 0 || static_cast<size_t>(id) >= logits.size() || count <= 0) continue;
    logits[id] -= presence + frequency * static_cast<float>(count);
  }
}

void ApplyTemperature(absl::Span<float> logits, float temperature) {
  if (temperature == 1.0f) return;
  for (float& v : logits) v /= temperature;
}

float KthLargest(absl::Span<const float> values, int32_t k) {
  if (k <= 1024) {
    // One pass with a min-heap of the k largest seen so far.
    std::vector<float> heap(values.begin(), values.begin() + k);
    std::make_heap(heap.begin(), heap.end(), std::greater<float>());
    for (size_t i = k; i < values.size(); ++i) {
      if (values[i] > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
        heap.back() = values[i];
        std::push_heap(heap.begin(), heap.end(), std::greater<float>());
      }
    }
    return heap.front();
  }
  std::vector<float> copy(values.begin(), values.end());
  std::nth_element(copy.begin(), copy.begin() + (k - 1), copy.end(), std::greater<float>());
  return copy[k - 1];
}

void ApplyTopK(absl::Span<float> logits, int32_t k) {
  if (k <= 0 || static_cast<size_t>(k) >= logits.size()) return;
  const float kth = KthLargest(logits, k);
  for (float& v : logits) {
    if (v < kth) v = kNegInf;
  }
}

void ApplyTopP(absl::Span<float> logits, float top_p) {
  if (top_p >= 1.0f) return;
  const float max = MaxFinite(logits);
  if (max == kNegInf) return;
  // Candidates: ids with a finite logit, most probable first. Only the head
  // up to the top_p mass matters, so sort a growing prefix.
  std::vector<int32_t> order;
  order.reserve(logits.size());
  double total = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (logits[i] == kNegInf) continue;
    order.push_back(static_cast<int32_t>(i));
    total += ExpOrZero(logits[i] - max);
  }
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  size_t sorted = 0;
  size_t keep = order.size();
  double before = 0.0;  // probability mass strictly ahead of order[i]
  for (size_t want = 256;; want *= 4) {
    const size_t m = std::min(want, order.size());
    std::partial_sort(order.begin() + sorted, order.begin() + m, order.end(), by_logit);
    bool found = false;
    for (size_t i = sorted; i < m; ++i) {
      // HF removes an id when the ascending cumulative probability up to and
      // including it is <= 1 - top_p, i.e. when the mass ahead of it is >= top_p.
      if (i > 0 && before >= top_p) {
        keep = i;
        found = true;
        break;
      }
      before += ExpOrZero(logits[order[i]] - max) / total;
    }
    sorted = m;
    if (found || m == order.size()) break;
  }
  for (size_t i = keep; i < order.size(); ++i) logits[order[i]] = kNegInf;
}

void ApplyMinP(absl::Span<float> logits, float min_p) {
  if (min_p <= 0.0f) return;
  const float max = MaxFinite(logits);
  if (max == kNegInf) return;
  // p_i < min_p * p_max  <=>  exp(l_i - l_max) < min_p  <=>  l_i < l_max + log(min_p).
  const double threshold = static_cast<double>(max) + std::log(static_cast<double>(min_p));
  for (float& v : logits) {
    if (static_cast<double>(v) < threshold) v = kNegInf;
  }
}

void Softmax(absl::Span<const float> logits, absl::Span<float> out) {
  const float max = MaxFinite(logits);
  if (max == kNegInf) {
    std::fill(out.begin(), out.end(), 0.0f);
    return;
  }
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    out[i] = ExpOrZero(logits[i] - max);
    sum += out[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (float& v : out) v *= inv;
}

void LogSoftmax(absl::Span<const float> logits, absl::Span<float> out) {
  const float max = MaxFinite(logits);
  if (max == kNegInf) {
    std::fill(out.begin(), out.end(), kNegInf);
    return;
  }
  double sum = 0.0;
  for (float v : logits) sum += ExpOrZero(v - max);
  const float log_sum = static_cast<float>(std::log(sum));
  for (size_t i = 0; i < logits.size(); ++i) out[i] = (logits[i] - max) - log_sum;
}

int32_t ArgMax(absl::Span<const float> values) {
  int32_t best = -1;
  float best_value = kNegInf;
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] > best_value) {
      best_value = values[i];
      best = static_cast<int32_t>(i);
    }
  }
  return best;
}

int32_t DrawFromDistribution(absl::Span<const float> probs, double u) {
  double total = 0.0;
  for (float p : probs) total += p;
  const double target = u * total;
  double cumulative = 0.0;
  int32_t last_positive = -1;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0.0f) continue;
    cumulative += probs[i];
    last_positive = static_cast<int32_t>(i);
    if (cumulative > target) return last_positive;
  }
  return last_positive;  // rounding left u * total at the very end
}

Sampler::Sampler(const SamplingConfig& config, int32_t valid_vocab,
                 absl::Span<const int32_t> prompt_ids)
    : config_(config),
      valid_vocab_(valid_vocab),
      seed_(config.seed.has_value() ? *config.seed : RandomSeed()),
      rng_(seed_) {
  if (config_.repetition_penalty != 1.0f) {
    for (int32_t id : prompt_ids) {
      if (seen_set_.insert(id).second) seen_.push_back(id);
    }
  }
}

double Sampler::NextUniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

void Sampler::Accept(int32_t id) {
  if (config_.repetition_penalty != 1.0f && seen_set_.insert(id).second) seen_.push_back(id);
  ++generated_[id];
}

void MaskDisallowed(absl::Span<float> logits, const uint32_t* allowed, int32_t allowed_ids) {
  const int64_t n = static_cast<int64_t>(logits.size());
  const int64_t covered = std::min<int64_t>(n, std::max<int32_t>(0, allowed_ids));
  // Word at a time: a grammar's mask is mostly all-ones (inside a string) or
  // all-zeros (between structural tokens).
  for (int64_t base = 0; base < covered; base += 32) {
    const uint32_t word = allowed[base >> 5];
    const int64_t end = std::min<int64_t>(covered, base + 32);
    if (word == 0xFFFFFFFFu) continue;
    if (word == 0) {
      std::fill(logits.begin() + base, logits.begin() + end, kNegInf);
      continue;
    }
    for (int64_t i = base; i < end; ++i) {
      if (!((word >> (i - base)) & 1u)) logits[i] = kNegInf;
    }
  }
  std::fill(logits.begin() + covered, logits.end(), kNegInf);
}

int32_t Sampler::Sample(absl::Span<const float> logits, TokenLogprobs* logprobs,
                        int top_logprobs, const uint32_t* allowed, int32_t allowed_ids) {
  work_.assign(logits.begin(), logits.end());
  absl::Span<float> row(work_);
  MaskVocabularyPadding(row, valid_vocab_);
  if (allowed != nullptr) MaskDisallowed(row, allowed, allowed_ids);
  ApplyRepetitionPenalty(row, seen_, config_.repetition_penalty);
  ApplyPresenceFrequencyPenalties(row, generated_, config_.presence_penalty,
                                  config_.frequency_penalty);

  std::vector<float> log_probs;
  if (logprobs != nullptr) {
    log_probs.resize(row.size());
    LogSoftmax(row, absl::MakeSpan(log_probs));
  }

  int32_t id;
  if (config_.temperature == 0.0f) {
    id = ArgMax(row);
  } else {
    // The truncations only ever keep ids that survive top-k, so run the rest
    // on those candidates (in id order, so the draw matches a full-row pass).
    const int32_t k = config_.top_k;
    const bool truncate = k > 0 && static_cast<size_t>(k) < row.size();
    const float kth = truncate ? KthLargest(row, k) : kNegInf;
    candidate_ids_.clear();
    candidates_.clear();
    for (size_t i = 0; i < row.size(); ++i) {
      if (row[i] != kNegInf && row[i] >= kth) {
        candidate_ids_.push_back(static_cast<int32_t>(i));
        candidates_.push_back(row[i]);
      }
    }
    absl::Span<float> c(candidates_);
    ApplyTemperature(c, config_.temperature);
    ApplyTopP(c, config_.top_p);
    ApplyMinP(c, config_.min_p);
    scratch_.resize(c.size());
    Softmax(c, absl::MakeSpan(scratch_));
    const int32_t index = DrawFromDistribution(scratch_, NextUniform());
    id = index < 0 ? -1 : candidate_ids_[index];
  }
  if (id < 0) id = 0;  // every logit was -inf or NaN: nothing sensible to pick

  if (logprobs != nullptr) {
    logprobs->id = id;
    logprobs->logprob = log_probs[id];
    logprobs->top.clear();
    const int n = std::clamp(top_logprobs, 0, static_cast<int>(log_probs.size()));
    if (n > 0) {
      // Min-heap (worst on top) of the n best (logprob desc, id asc).
      auto better = [&](int32_t a, int32_t b) {
        return log_probs[a] > log_probs[b] || (log_probs[a] == log_probs[b] && a < b);
      };
      std::vector<int32_t> heap;
      heap.reserve(n);
      for (int32_t i = 0; i < static_cast<int32_t>(log_probs.size()); ++i) {
        if (log_probs[i] == kNegInf) continue;  // masked: never an alternative
        if (static_cast<int>(heap.size()) < n) {
          heap.push_back(i);
          std::push_heap(heap.begin(), heap.end(), better);
        } else if (better(i, heap.front())) {
          std::pop_heap(heap.begin(), heap.end(), better);
          heap.back() = i;
          std::push_heap(heap.begin(), heap.end(), better);
        }
      }
      std::sort_heap(heap.begin(), heap.end(), better);
      for (int32_t i : heap) logprobs->top.emplace_back(i, log_probs[i]);
    }
  }
  return id;
}

}  // namespace vlm::language
