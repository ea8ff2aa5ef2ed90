// Next-token selection (qwen3-vl-model.md section 7.4): penalties, temperature,
// top-k, top-p, min-p, softmax and a seeded multinomial draw over one row of
// logits. No LibTorch: logits arrive as a float span.
//
// Order, as HF's generate applies it:
//   vocabulary padding mask (ids >= the tokenizer's vocab size become -inf)
//   -> repetition penalty (HF: logit/p if > 0, logit*p if < 0, for every id
//      seen in the prompt or the completion so far)
//   -> presence and frequency penalties (OpenAI: logit -= presence*[count>0]
//      + frequency*count, counting completion tokens only, as vLLM does)
//   -> temperature (0 = greedy: argmax, lowest id on ties; nothing below runs)
//   -> top-k -> top-p -> min-p -> softmax -> multinomial.
//
// Logprobs are defined on the *model's* distribution as the penalties shape
// it: log_softmax of the masked, penalised logits, before temperature and the
// truncations (top-k/p, min-p). So a chosen token always has a finite logprob
// and the numbers do not depend on how adventurous the sampling was.
//
// Structured output: an allowed-token bitmask (grammar/matcher.h) removes
// every other id right after the vocabulary padding mask, before penalties.
// Everything after it, logprobs included, then works on the constrained
// distribution (renormalised over the allowed ids); top_logprobs lists only
// allowed ids.
//
// A Sampler belongs to one sequence (not thread-safe). Same seed, same config,
// same prompt and same logits => same tokens.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/types/span.h"

namespace vlm::language {

struct SamplingConfig {
  float temperature = 1.0f;         // >= 0; 0 = greedy
  int32_t top_k = 0;                // >= 0; 0 disables
  float top_p = 1.0f;               // (0, 1]; 1 disables
  float min_p = 0.0f;               // [0, 1); 0 disables
  float repetition_penalty = 1.0f;  // > 0 (at most kMaxRepetitionPenalty); 1 disables
  float presence_penalty = 0.0f;    // [-2, 2]
  float frequency_penalty = 0.0f;   // [-2, 2]
  std::optional<uint64_t> seed;     // unset: a random seed per Sampler
};

inline constexpr float kMaxRepetitionPenalty = 100.0f;
inline constexpr int kMaxTopLogprobs = 20;

// INVALID_ARGUMENT naming the offending field as `<prefix>.<field>` (e.g.
// "params.sampling.top_p must be in (0, 1]; got 1.5"). NaN is always invalid.
absl::Status ValidateSamplingConfig(const SamplingConfig& config,
                                    const std::string& prefix = "sampling");

// The transforms, each over a full row of logits in place (exposed for tests).
// -inf marks a removed id; every function keeps -inf entries at -inf.
void MaskVocabularyPadding(absl::Span<float> logits, int32_t valid_vocab);
// Sets to -inf every id whose bit in `allowed` is 0 (ids >= allowed_ids too).
void MaskDisallowed(absl::Span<float> logits, const uint32_t* allowed, int32_t allowed_ids);
void ApplyRepetitionPenalty(absl::Span<float> logits, absl::Span<const int32_t> seen_ids,
                            float penalty);
// `counts`: id -> times generated so far.
void ApplyPresenceFrequencyPenalties(absl::Span<float> logits,
                                     const absl::flat_hash_map<int32_t, int32_t>& counts,
                                     float presence, float frequency);
void ApplyTemperature(absl::Span<float> logits, float temperature);  // temperature > 0
// Keeps the k largest (ties at the k-th value are all kept, as HF's
// `logits < kth_value` test does).
void ApplyTopK(absl::Span<float> logits, int32_t k);
// The k-th largest value (1 <= k <= size).
float KthLargest(absl::Span<const float> values, int32_t k);
// Removes, in ascending order of probability, the ids whose cumulative
// probability is <= 1 - top_p; the most probable id always stays.
void ApplyTopP(absl::Span<float> logits, float top_p);
// Removes ids whose probability is below min_p * (the largest probability).
void ApplyMinP(absl::Span<float> logits, float min_p);
// Numerically stable softmax / log_softmax into `out` (same size as `logits`).
void Softmax(absl::Span<const float> logits, absl::Span<float> out);
void LogSoftmax(absl::Span<const float> logits, absl::Span<float> out);
// Index of the largest value, lowest index on ties; -1 if all are -inf/NaN.
int32_t ArgMax(absl::Span<const float> values);
// Draws an index from `probs` (non-negative, summing to ~1) with uniform `u`
// in [0, 1): the first index whose cumulative probability exceeds u * total.
int32_t DrawFromDistribution(absl::Span<const float> probs, double u);

struct TokenLogprobs {
  int32_t id = 0;
  float logprob = 0.0f;
  // The `top_logprobs` most likely ids under the same distribution, most
  // likely first (lowest id first on ties).
  std::vector<std::pair<int32_t, float>> top;
};

class Sampler {
 public:
  // `valid_vocab`: ids at or above it are never produced (151669 for Qwen3;
  // logits rows may be wider). `prompt_ids` feed the repetition penalty.
  Sampler(const SamplingConfig& config, int32_t valid_vocab,
          absl::Span<const int32_t> prompt_ids);

  // Chooses the next id from `logits` (one row, any width >= 1). Does not
  // record it: call Accept() with the id actually appended to the sequence.
  // When `logprobs` is non-null it receives the chosen id's logprob and the
  // `top_logprobs` best alternatives.
  // `allowed` (optional): bit i of allowed[i / 32] set iff id i may be drawn;
  // it covers ids [0, allowed_ids), ids beyond are disallowed.
  int32_t Sample(absl::Span<const float> logits, TokenLogprobs* logprobs = nullptr,
                 int top_logprobs = 0, const uint32_t* allowed = nullptr,
                 int32_t allowed_ids = 0);
  void Accept(int32_t id);

  uint64_t seed() const { return seed_; }
  const SamplingConfig& config() const { return config_; }

 private:
  double NextUniform();  // [0, 1), 53 bits

  SamplingConfig config_;
  int32_t valid_vocab_;
  uint64_t seed_;
  std::mt19937_64 rng_;
  std::vector<int32_t> seen_;                         // distinct ids, prompt + completion
  absl::flat_hash_set<int32_t> seen_set_;             // membership of seen_
  absl::flat_hash_map<int32_t, int32_t> generated_;   // completion id -> count
  std::vector<float> work_;                           // penalised logits
  std::vector<int32_t> candidate_ids_;                // ids surviving top-k, ascending
  std::vector<float> candidates_;                     // their logits
  std::vector<float> scratch_;                        // probabilities
};

}  // namespace vlm::language
