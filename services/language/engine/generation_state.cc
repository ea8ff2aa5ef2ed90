#include "services/language/engine/generation_state.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace vlm::language {

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
// GenerationState
// ---------------------------------------------------------------------------

GenerationState::GenerationState(const GenerationRequest& request, const Tokenizer* tokenizer,
                                 const GenerationStateConfig& config)
    : request_(request), tokenizer_(tokenizer), config_(config),
      sampler_(request.sampling, tokenizer->vocab_size(), request.prompt_ids),
      detokenizer_(tokenizer, !request.include_special_tokens), stops_(request.stop) {
  result_.prompt_tokens = static_cast<int64_t>(request.prompt_ids.size());
  result_.seed = sampler_.seed();
  if (request.grammar != nullptr) {
    matcher_ = std::make_unique<grammar::Matcher>(request.grammar);
    mask_.assign(request.grammar->vocab().mask_words(), 0);
  }
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
  const std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  if (matcher_ != nullptr) matcher_->FillMask(mask_.data());
  const std::chrono::steady_clock::time_point t1 = std::chrono::steady_clock::now();
  int32_t id =
      matcher_ == nullptr
          ? sampler_.Sample(logits, want_logprobs ? &lp_ : nullptr, request_.top_logprobs)
          : sampler_.Sample(logits, want_logprobs ? &lp_ : nullptr, request_.top_logprobs,
                            mask_.data(), matcher_->compiled().vocab().size());
  bool grammar_end = false;
  if (matcher_ != nullptr) {
    // Bounded output: a token after which no complete output fits in the
    // tokens left (one byte each plus the stop token) is drawn again among
    // those that keep one in reach, so a constrained generation always ends
    // with a complete output by max_tokens (admission checked that the
    // shortest one fits).
    const grammar::Vocabulary& vocab = matcher_->compiled().vocab();
    const int64_t left = request_.max_tokens - result_.completion_tokens;
    if (!vocab.is_stop(id)) {
      const int64_t after = matcher_->MinBytesToEndAfter(id);
      if (after < 0 || after + 2 > left) {
        matcher_->FillMaskWithinBudget(left, mask_.data());
        id = sampler_.Sample(logits, want_logprobs ? &lp_ : nullptr, request_.top_logprobs,
                             mask_.data(), vocab.size());
      }
    }
    // Filling the mask (t1 - t0); applying it is part of sampling.
    result_.grammar_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
    const bool allowed = id >= 0 && id < vocab.size() && ((mask_[id >> 5] >> (id & 31)) & 1u);
    if (!allowed && matcher_->CanEnd() && !vocab.stop_tokens().empty()) {
      // No allowed token has a finite logit (a logits row narrower than the
      // stop token's id): the output is complete, so it ends here.
      id = vocab.stop_tokens().front();
    }
    if (!matcher_->AcceptToken(id)) {
      return absl::InternalError(absl::StrCat(
          "no token the grammar allows has a finite logit after ", result_.completion_tokens,
          " generated tokens (sampled id ", id, ")"));
    }
    grammar_end = matcher_->IsTerminated();
  }
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
  if (grammar_end) {
    // The grammar's stop token: the output is complete; its text is never part of it.
    result_.finish = FinishReason::kStop;
    result_.finish_detail = "grammar complete";
    step.finished = true;
  } else if (!request_.ignore_eos &&
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

}  // namespace vlm::language
