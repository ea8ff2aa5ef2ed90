// The generation loop of one request: prompt -> projector -> prefill ->
// (sample -> stream -> decode step)* -> finish reason (architecture.md, "Data
// flow", step 5), and GenerationState, its per-sequence part after the model.
//
// The service runs requests through the batching Engine (engine.h), which
// shares GenerationState; Generator is the plain one-request path over a
// contiguous KV cache, the reference the engine is tested against.
//
// Each sampled token is detokenized incrementally (UTF-8 safe), passed through
// the stop-string matcher (text that may still become a stop string is held
// back) and handed to the caller's sink as one chunk. Generation ends on an
// EOS id from generation_config.json (unless ignore_eos), a stop string,
// max_tokens (or the room left in the context: both are LENGTH), or
// cancellation, which is checked before every decode step.
//
// The model sits behind GenerationModel so the loop can be tested with a fake
// model; DecoderModel adapts the real Projector + Decoder.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model_config.h"
#include "services/language/model/decoder.h"
#include "services/language/model/mrope.h"
#include "services/language/model/projector.h"
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

// What the loop needs from a model. Implementations are shared by concurrent
// requests; a Sequence belongs to one request.
class GenerationModel {
 public:
  class Sequence {
   public:
    virtual ~Sequence() = default;
  };

  virtual ~GenerationModel() = default;
  // A sequence with room for `capacity` tokens (prompt + completion).
  virtual absl::StatusOr<std::unique_ptr<Sequence>> NewSequence(int64_t capacity) = 0;
  // Projects the prompt's images (in prompt order) and keeps them in `seq` for Prefill.
  virtual absl::Status ProjectImages(Sequence& seq, absl::Span<const ImageFeatures> images) = 0;
  // Runs the prompt (image pads expanded); float32 logits of its last position.
  virtual absl::StatusOr<at::Tensor> Prefill(Sequence& seq, absl::Span<const int32_t> ids) = 0;
  // Appends one token; float32 logits of the next position.
  virtual absl::StatusOr<at::Tensor> DecodeStep(Sequence& seq, int32_t id) = 0;
};

// GenerationModel over the real projector and decoder (not owned; both must
// outlive it). Positions come from GetRopeIndex over the prompt and grids.
class DecoderModel final : public GenerationModel {
 public:
  DecoderModel(const Projector* projector, const Decoder* decoder, const ModelConfig& config);
  absl::StatusOr<std::unique_ptr<Sequence>> NewSequence(int64_t capacity) override;
  absl::Status ProjectImages(Sequence& seq, absl::Span<const ImageFeatures> images) override;
  absl::StatusOr<at::Tensor> Prefill(Sequence& seq, absl::Span<const int32_t> ids) override;
  absl::StatusOr<at::Tensor> DecodeStep(Sequence& seq, int32_t id) override;

 private:
  const Projector* projector_;
  const Decoder* decoder_;
  ModelConfig config_;
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
};

struct GeneratorConfig {
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
};

// Called with each chunk; returning false ends generation (client gone).
using ChunkSink = std::function<bool(const GenerationChunk&)>;
// Checked before the projector, the prefill and every decode step; true stops.
using StopCheck = std::function<bool()>;

// The per-sequence logic after the model, shared by Generator and the serving
// engine: one logits row in, one chunk out. Owns the sequence's sampler
// (seeded RNG, penalties), incremental detokenizer and stop-string matcher;
// decides EOS / stop string / max_tokens. `request` and `tokenizer` must
// outlive it. Not thread-safe (one sequence, one thread at a time).
class GenerationState {
 public:
  GenerationState(const GenerationRequest& request, const Tokenizer* tokenizer,
                  const GeneratorConfig& config);

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
  const GeneratorConfig& config_;
  Sampler sampler_;
  StreamingDetokenizer detokenizer_;
  StopStringMatcher stops_;
  TokenLogprobs lp_;
  bool stopped_by_string_ = false;
  int32_t last_token_ = -1;
  GenerationResult result_;
};

class Generator {
 public:
  // Neither is owned; both must outlive the Generator. Thread-safe: one
  // Generate per request, any number concurrently.
  Generator(GenerationModel* model, const Tokenizer* tokenizer, GeneratorConfig config);

  // Errors are statuses of the model (INVALID_ARGUMENT for inputs it
  // rejects); cancellation is not an error but FinishReason::kCancelled.
  absl::StatusOr<GenerationResult> Generate(const GenerationRequest& request,
                                            const ChunkSink& sink,
                                            const StopCheck& should_stop = nullptr) const;

 private:
  GenerationModel* model_;
  const Tokenizer* tokenizer_;
  GeneratorConfig config_;
};

}  // namespace vlm::language
