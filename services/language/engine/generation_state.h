// A request's generation parameters and the per-sequence logic after the
// model (architecture.md, "Data flow", step 5): GenerationState turns one
// logits row into one streamed chunk. The serving Engine (engine.h) keeps one
// per running sequence.
//
// Each sampled token is detokenized incrementally (UTF-8 safe), passed through
// the stop-string matcher (text that may still become a stop string is held
// back) and handed to the caller as one chunk. Generation ends on an EOS id
// from generation_config.json (unless ignore_eos), a stop string or
// max_tokens (LENGTH); the engine adds the room left in the context (LENGTH)
// and cancellation.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model_config.h"
#include "services/language/grammar/matcher.h"
#include "services/language/model/mrope.h"  // GridThw
#include "services/language/sampling/sampler.h"
#include "services/language/sampling/stop_strings.h"
#include "services/language/text/tokenizer.h"

namespace vlm::language {

// Pre-projector features of one image as they arrive over the wire.
struct ImageFeatures {
  at::Tensor last_hidden;             // [t*h*w, vision_hidden], bf16 or f32
  std::vector<at::Tensor> deepstack;  // same shape each, deepstack_visual_indexes order
  GridThw grid{};                     // (t, h, w) in patches
};

struct GenerationRequest {
  std::vector<int32_t> prompt_ids;   // image pads expanded
  std::vector<ImageFeatures> images;  // one per image span of the prompt, in order
  SamplingConfig sampling;
  int64_t max_tokens = 1;            // >= 1; prompt + max_tokens must fit the context
  std::vector<std::string> stop;     // validated (ValidateStopStrings)
  bool ignore_eos = false;
  bool logprobs = false;
  int top_logprobs = 0;              // 0..kMaxTopLogprobs
  bool include_special_tokens = false;
  // Structured output (JSON schema, JSON mode, regex, tool call): each step
  // samples only tokens the grammar allows, and the generation ends when the
  // grammar is complete and a stop token is drawn (EOS is allowed only then;
  // ignore_eos does not apply). As the tokens left run short, only tokens
  // that keep a complete output within max_tokens are drawn, so the output
  // is always complete (the caller checks that the shortest one fits:
  // Grammar::MinOutputBytes() + 1 <= max_tokens). Null: unconstrained.
  std::shared_ptr<const grammar::CompiledGrammar> grammar;
};

struct GenerationStateConfig {
  std::vector<int32_t> eos_ids;  // generation_config.json eos_token_id
};

struct TopLogprobEntry {
  int32_t id = 0;
  std::string token;  // the token's own text, invalid UTF-8 replaced by U+FFFD
  float logprob = 0;
};
struct GeneratedTokenLogprob {
  TopLogprobEntry chosen;
  std::vector<TopLogprobEntry> top;
};

// One streamed piece: the tokens sampled since the last chunk and the text
// that became safe to release (possibly empty while held back).
struct GenerationChunk {
  std::string text;
  std::vector<int32_t> token_ids;
  std::vector<GeneratedTokenLogprob> logprobs;  // one per token when requested
};

enum class FinishReason { kStop, kLength, kCancelled };
const char* FinishReasonName(FinishReason reason);  // "stop", "length", "cancelled"

struct GenerationResult {
  FinishReason finish = FinishReason::kStop;
  std::string finish_detail;  // "eos", "stop string 1", "max_tokens", "sink closed", ...
  std::string tail_text;      // released at the end (held-back text), not yet sent
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  uint64_t seed = 0;          // the sampler's seed (random when unset)
  double projector_ms = 0;
  double prefill_ms = 0;
  double decode_ms = 0;       // decode steps + sampling, after the first token
  std::chrono::steady_clock::time_point first_token_at{};  // when the first chunk was ready
  // Serving engine only: prompt tokens reused from the prefix cache, and when
  // the request first entered a batch.
  int64_t cached_prompt_tokens = 0;
  std::chrono::steady_clock::time_point scheduled_at{};
  // Constrained requests: time spent filling the allowed-token masks.
  double grammar_ms = 0;
};

// The per-sequence logic after the model: one logits row in, one chunk out.
// Owns the sequence's sampler (seeded RNG, penalties), incremental
// detokenizer, stop-string matcher and grammar matcher (structured output);
// decides EOS / grammar end / stop string / max_tokens. The state survives
// a preemption untouched (the engine recomputes only the KV), so the grammar
// matcher needs no replay. `request` and `tokenizer` must
// outlive it. Not thread-safe (one sequence, one thread at a time).
class GenerationState {
 public:
  GenerationState(const GenerationRequest& request, const Tokenizer* tokenizer,
                  const GenerationStateConfig& config);

  struct Step {
    GenerationChunk chunk;  // exactly one token
    bool finished = false;  // EOS, stop string or max_tokens: no more tokens
  };
  // Samples the next token from `logits` (float32, one row of any width),
  // records it and returns its chunk. INTERNAL if detokenizing fails.
  absl::StatusOr<Step> Next(absl::Span<const float> logits);
  // After the last Next (finished or not): releases held-back text into
  // result().tail_text, unless a stop string already ended the text.
  void Finish();

  int32_t last_token() const { return last_token_; }
  int64_t completion_tokens() const { return result_.completion_tokens; }
  // finish, finish_detail, completion_tokens, seed, tail_text (after Finish).
  GenerationResult& result() { return result_; }

 private:
  TopLogprobEntry Entry(int32_t id, float logprob) const;

  const GenerationRequest& request_;
  const Tokenizer* tokenizer_;
  const GenerationStateConfig& config_;
  Sampler sampler_;
  StreamingDetokenizer detokenizer_;
  StopStringMatcher stops_;
  TokenLogprobs lp_;
  std::unique_ptr<grammar::Matcher> matcher_;  // constrained requests only
  std::vector<uint32_t> mask_;                 // the matcher's allowed-token bitmask
  bool stopped_by_string_ = false;
  int32_t last_token_ = -1;
  GenerationResult result_;
};

}  // namespace vlm::language
