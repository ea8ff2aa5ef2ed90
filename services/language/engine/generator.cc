#include "services/language/engine/generator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace vlm::language {
namespace {

using Clock = std::chrono::steady_clock;

double MillisSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Clears the upper halves of the vector registers. A kernel that returns with
// them dirty (a 256/512-bit kernel without vzeroupper) makes every later
// legacy-SSE instruction of this thread pay a transition penalty: measured
// here, the sampler and detokenizer then ran ~20x slower (55 ms instead of
// 2 ms per token over a 151936-wide row). Cheap enough to run after every
// model call.
void ClearUpperVectorState() {
#if defined(__x86_64__)
  static const bool has_avx = __builtin_cpu_supports("avx");
  if (has_avx) asm volatile("vzeroupper" ::: "memory");
#endif
}

at::ScalarType ScalarTypeOf(ComputeDType dtype) {
  return dtype == ComputeDType::kBFloat16 ? at::kBFloat16 : at::kFloat;
}

// DecoderModel's per-request state: the KV cache and the projected images.
struct DecoderSequence final : GenerationModel::Sequence {
  std::unique_ptr<language::Sequence> seq;
  ProjectedImages images;
  std::vector<GridThw> grids;
};

DecoderSequence& Downcast(GenerationModel::Sequence& seq) {
  return static_cast<DecoderSequence&>(seq);
}

}  // namespace

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------
// DecoderModel
// ---------------------------------------------------------------------------

DecoderModel::DecoderModel(const Projector* projector, const Decoder* decoder,
                           const ModelConfig& config)
    : projector_(projector), decoder_(decoder), config_(config) {}

absl::StatusOr<std::unique_ptr<GenerationModel::Sequence>> DecoderModel::NewSequence(
    int64_t capacity) {
  absl::StatusOr<std::unique_ptr<language::Sequence>> seq = decoder_->NewSequence(capacity);
  if (!seq.ok()) return seq.status();
  auto out = std::make_unique<DecoderSequence>();
  out->seq = *std::move(seq);
  return out;
}

absl::Status DecoderModel::ProjectImages(Sequence& sequence,
                                         absl::Span<const ImageFeatures> images) {
  DecoderSequence& s = Downcast(sequence);
  s.grids.clear();
  s.images = {};
  if (images.empty()) return absl::OkStatus();
  try {
    // The projector takes all images' patches concatenated, in prompt order.
    const at::ScalarType dtype = ScalarTypeOf(projector_->compute_dtype());
    const size_t levels = images[0].deepstack.size();
    std::vector<at::Tensor> last;
    std::vector<std::vector<at::Tensor>> deep(levels);
    for (const ImageFeatures& image : images) {
      if (image.deepstack.size() != levels) {
        return absl::InvalidArgumentError("images carry different numbers of deepstack tensors");
      }
      last.push_back(image.last_hidden.to(dtype));
      for (size_t j = 0; j < levels; ++j) deep[j].push_back(image.deepstack[j].to(dtype));
      s.grids.push_back(image.grid);
    }
    std::vector<at::Tensor> deepstack;
    for (auto& level : deep) deepstack.push_back(level.size() == 1 ? level[0] : at::cat(level));
    at::Tensor all = last.size() == 1 ? last[0] : at::cat(last);
    absl::StatusOr<ProjectedImages> projected = projector_->Forward(all, deepstack, s.grids);
    if (!projected.ok()) return projected.status();
    s.images = *std::move(projected);
    return absl::OkStatus();
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("projecting images: ", e.what_without_backtrace()));
  }
}

absl::StatusOr<at::Tensor> DecoderModel::Prefill(Sequence& sequence,
                                                 absl::Span<const int32_t> ids) {
  DecoderSequence& s = Downcast(sequence);
  PrefillInput input;
  input.token_ids = ids;
  RopeIndex positions;
  if (!s.grids.empty()) {
    absl::StatusOr<RopeIndex> index = GetRopeIndex(ids, s.grids, config_);
    if (!index.ok()) return index.status();
    positions = *std::move(index);
    input.image_embeds = s.images.image_embeds;
    input.deepstack = s.images.deepstack;
    input.positions = &positions;
  }
  absl::StatusOr<at::Tensor> logits = decoder_->Prefill(*s.seq, input);
  s.images = {};  // the cache holds what the images contributed
  return logits;
}

absl::StatusOr<at::Tensor> DecoderModel::DecodeStep(Sequence& sequence, int32_t id) {
  return decoder_->DecodeStep(*Downcast(sequence).seq, id);
}

// ---------------------------------------------------------------------------
// GenerationState
// ---------------------------------------------------------------------------

GenerationState::GenerationState(const GenerationRequest& request, const Tokenizer* tokenizer,
                                 const GeneratorConfig& config)
    : request_(request), tokenizer_(tokenizer), config_(config),
      sampler_(request.sampling, tokenizer->vocab_size(), request.prompt_ids),
      detokenizer_(tokenizer, !request.include_special_tokens), stops_(request.stop) {
  result_.prompt_tokens = static_cast<int64_t>(request.prompt_ids.size());
  result_.seed = sampler_.seed();
}

TopLogprobEntry GenerationState::Entry(int32_t id, float logprob) const {
  TopLogprobEntry entry;
  entry.id = id;
  entry.logprob = logprob;
  const int32_t one[] = {id};
  if (absl::StatusOr<std::string> text = tokenizer_->Decode(one); text.ok()) {
    entry.token = *std::move(text);
  }
  return entry;
}

absl::StatusOr<GenerationState::Step> GenerationState::Next(absl::Span<const float> logits) {
  const bool want_logprobs = request_.logprobs || request_.top_logprobs > 0;
  const int32_t id = sampler_.Sample(logits, want_logprobs ? &lp_ : nullptr, request_.top_logprobs);
  sampler_.Accept(id);
  last_token_ = id;
  ++result_.completion_tokens;

  Step step;
  GenerationChunk& chunk = step.chunk;
  chunk.token_ids.push_back(id);
  if (want_logprobs) {
    GeneratedTokenLogprob entry;
    entry.chosen = Entry(id, lp_.logprob);
    for (const auto& [alt, alt_lp] : lp_.top) entry.top.push_back(Entry(alt, alt_lp));
    chunk.logprobs.push_back(std::move(entry));
  }
  if (!request_.ignore_eos &&
      std::find(config_.eos_ids.begin(), config_.eos_ids.end(), id) != config_.eos_ids.end()) {
    // The EOS token ends the text; its own text is never part of it.
    result_.finish = FinishReason::kStop;
    result_.finish_detail = "eos";
    step.finished = true;
  } else {
    absl::StatusOr<std::string> delta = detokenizer_.Push(id);
    if (!delta.ok()) return delta.status();
    StopStringMatcher::Step s = stops_.Push(*delta);
    chunk.text = std::move(s.text);
    if (s.stopped) {
      result_.finish = FinishReason::kStop;
      result_.finish_detail = absl::StrCat("stop string ", s.stop_index);
      stopped_by_string_ = step.finished = true;
    }
  }
  if (!step.finished && result_.completion_tokens >= request_.max_tokens) {
    result_.finish = FinishReason::kLength;
    result_.finish_detail = "max_tokens";
    step.finished = true;
  }
  return step;
}

void GenerationState::Finish() {
  if (stopped_by_string_) return;
  // Bytes of an unfinished character become U+FFFD; that tail can still
  // complete a stop string.
  StopStringMatcher::Step step = stops_.Push(detokenizer_.Finish());
  result_.tail_text = std::move(step.text);
  if (step.stopped) {
    result_.finish = FinishReason::kStop;
    result_.finish_detail = absl::StrCat("stop string ", step.stop_index);
  } else {
    result_.tail_text += stops_.Flush();
  }
}

// ---------------------------------------------------------------------------
// Generator
// ---------------------------------------------------------------------------

Generator::Generator(GenerationModel* model, const Tokenizer* tokenizer, GeneratorConfig config)
    : model_(model), tokenizer_(tokenizer), config_(std::move(config)) {}

absl::StatusOr<GenerationResult> Generator::Generate(const GenerationRequest& request,
                                                     const ChunkSink& sink,
                                                     const StopCheck& should_stop) const {
  GenerationResult result;
  result.prompt_tokens = static_cast<int64_t>(request.prompt_ids.size());
  auto stop_requested = [&] { return should_stop && should_stop(); };
  auto cancelled = [&](const char* where) {
    result.finish = FinishReason::kCancelled;
    result.finish_detail = absl::StrCat("cancelled ", where);
    return result;
  };
  if (request.prompt_ids.empty()) return absl::InvalidArgumentError("the prompt is empty");
  if (request.max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens must be at least 1; got ", request.max_tokens));
  }

  absl::StatusOr<std::unique_ptr<GenerationModel::Sequence>> seq =
      model_->NewSequence(result.prompt_tokens + request.max_tokens);
  if (!seq.ok()) return seq.status();

  if (stop_requested()) return cancelled("before the projector");
  Clock::time_point t = Clock::now();
  if (!request.images.empty()) {
    if (absl::Status s = model_->ProjectImages(**seq, request.images); !s.ok()) return s;
  }
  result.projector_ms = MillisSince(t);

  if (stop_requested()) return cancelled("before prefill");
  t = Clock::now();
  absl::StatusOr<at::Tensor> logits = model_->Prefill(**seq, request.prompt_ids);
  ClearUpperVectorState();
  if (!logits.ok()) return logits.status();
  result.prefill_ms = MillisSince(t);

  GenerationState state(request, tokenizer_, config_);
  result.seed = state.result().seed;
  const Clock::time_point decode_start = Clock::now();
  while (true) {
    at::Tensor row;
    try {
      row = logits->reshape({-1}).to(at::kFloat).contiguous();
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("logits: ", e.what_without_backtrace()));
    }
    absl::StatusOr<GenerationState::Step> step =
        state.Next(absl::Span<const float>(row.data_ptr<float>(), row.numel()));
    if (!step.ok()) return step.status();
    result.completion_tokens = state.completion_tokens();
    if (result.completion_tokens == 1) result.first_token_at = Clock::now();
    if (!sink(step->chunk)) return cancelled("by the sink");
    if (step->finished) break;
    if (stop_requested()) {
      result.decode_ms = MillisSince(decode_start);
      return cancelled("between decode steps");
    }
    logits = model_->DecodeStep(**seq, state.last_token());
    ClearUpperVectorState();
    if (!logits.ok()) return logits.status();
  }
  result.decode_ms = MillisSince(decode_start);
  state.Finish();
  result.finish = state.result().finish;
  result.finish_detail = state.result().finish_detail;
  result.tail_text = state.result().tail_text;
  return result;
}

}  // namespace vlm::language
