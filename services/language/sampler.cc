#include "services/language/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace vlm::language {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

void ApplyTopK(absl::Span<float> logits, int32_t k) {
  if (k <= 0 || static_cast<size_t>(k) >= logits.size()) return;
  std::vector<float> values(logits.begin(), logits.end());
  std::nth_element(values.begin(), values.begin() + (k - 1), values.end(), std::greater<float>());
  const float kth = values[k - 1];
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
    total += std::exp(static_cast<double>(logits[i] - max));
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
      before += std::exp(static_cast<double>(logits[order[i]] - max)) / total;
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
  // p_i < min_p * p_max  <=>  exp(l_i - l_max) < min_p.
  for (float& v : logits) {
    if (v != kNegInf && std::exp(static_cast<double>(v - max)) < min_p) v = kNegInf;
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
    out[i] = std::exp(logits[i] - max);
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
  for (float v : logits) sum += std::exp(static_cast<double>(v - max));
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

int32_t Sampler::Sample(absl::Span<const float> logits, TokenLogprobs* logprobs,
                        int top_logprobs) {
  work_.assign(logits.begin(), logits.end());
  absl::Span<float> row(work_);
  MaskVocabularyPadding(row, valid_vocab_);
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
    ApplyTemperature(row, config_.temperature);
    ApplyTopK(row, config_.top_k);
    ApplyTopP(row, config_.top_p);
    ApplyMinP(row, config_.min_p);
    scratch_.resize(row.size());
    Softmax(row, absl::MakeSpan(scratch_));
    id = DrawFromDistribution(scratch_, NextUniform());
  }
  if (id < 0) id = 0;  // every logit was -inf or NaN: nothing sensible to pick

  if (logprobs != nullptr) {
    logprobs->id = id;
    logprobs->logprob = log_probs[id];
    logprobs->top.clear();
    const int n = std::clamp(top_logprobs, 0, static_cast<int>(log_probs.size()));
    if (n > 0) {
      std::vector<int32_t> order(log_probs.size());
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](int32_t a, int32_t b) {
        return log_probs[a] > log_probs[b] || (log_probs[a] == log_probs[b] && a < b);
      });
      for (int i = 0; i < n; ++i) logprobs->top.emplace_back(order[i], log_probs[order[i]]);
    }
  }
  return id;
}

}  // namespace vlm::language
