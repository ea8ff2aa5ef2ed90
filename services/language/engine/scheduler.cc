#include "services/language/engine/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace vlm::language {

Scheduler::Scheduler(KvCacheManager* kv, SchedulerOptions options)
    : kv_(kv), options_(options) {
  options_.max_sequences = std::max(1, options_.max_sequences);
  options_.max_batch_tokens = std::max<int64_t>(1, options_.max_batch_tokens);
}

absl::Status Scheduler::Add(SequenceState* seq) {
  seq->prefill_len = seq->prompt_len;
  const int64_t blocks = ReservedBlocks(*seq);
  if (blocks > kv_->pool().num_blocks()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence ", seq->id, " needs ", blocks, " KV blocks of ", kv_->block_size(),
        " tokens (", std::max(seq->prefill_len, seq->max_cache_tokens),
        " cache tokens); the pool has ", kv_->pool().num_blocks()));
  }
  seq->num_computed = 0;
  seq->running = false;
  waiting_.push_back(seq);
  return absl::OkStatus();
}

int64_t Scheduler::ReservedBlocks(const SequenceState& seq) const {
  return kv_->BlocksFor(std::max(seq.prefill_len, seq.max_cache_tokens));
}

int64_t Scheduler::reserved_blocks() const {
  int64_t total = 0;
  for (const SequenceState* seq : running_) {
    total += std::max<int64_t>(0, ReservedBlocks(*seq) - static_cast<int64_t>(seq->kv.table.size()));
  }
  return total;
}

void Scheduler::Preempt(SequenceState* victim, SchedulerOutput& out) {
  kv_->Free(victim->kv);
  victim->num_computed = 0;
  victim->prefill_len = static_cast<int64_t>(victim->tokens.size());
  victim->running = false;
  ++victim->preemptions;
  running_.erase(std::find(running_.begin(), running_.end(), victim));
  waiting_.push_front(victim);
  out.preempted.push_back(victim);
}

SchedulerOutput Scheduler::Schedule() {
  SchedulerOutput out;
  int64_t budget = options_.max_batch_tokens;

  // Grows `seq` to hold `tokens` cache indices, preempting the newest running
  // sequences while blocks are short. false when `seq` itself was preempted.
  auto grow = [&](SequenceState* seq, int64_t tokens) {
    while (!kv_->Grow(seq->kv, tokens)) {
      SequenceState* victim = running_.back();
      Preempt(victim, out);
      // A victim may already hold a chunk of this iteration (a decode token).
      for (auto it = out.chunks.begin(); it != out.chunks.end(); ++it) {
        if (it->seq != victim) continue;
        budget += it->count;
        (it->decode ? out.decode_tokens : out.prefill_tokens) -= it->count;
        out.chunks.erase(it);
        break;
      }
      if (victim == seq) return false;
    }
    return true;
  };

  // (a) decode: one token per decoding sequence, oldest first.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    SequenceState* seq = running_[i];
    if (!seq->decoding()) continue;
    if (!grow(seq, seq->num_computed + 1)) break;  // it was the newest: nothing after it
    out.chunks.push_back({seq, seq->num_computed, 1, /*decode=*/true, /*logits=*/true});
    out.decode_tokens += 1;
    budget -= 1;
  }
  // (b) prefill chunks of running sequences still prefilling, oldest first.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    SequenceState* seq = running_[i];
    if (seq->decoding()) continue;
    const int64_t n = std::min(seq->prefill_len - seq->num_computed, budget);
    if (!grow(seq, seq->num_computed + n)) break;
    out.chunks.push_back({seq, seq->num_computed, n, false,
                          seq->num_computed + n == seq->prefill_len});
    out.prefill_tokens += n;
    budget -= n;
  }
  // (b) then waiting sequences, FIFO, while the batch and the reservations allow.
  int64_t promised = waiting_.empty() ? 0 : reserved_blocks();
  while (budget > 0 && !waiting_.empty() && out.preempted.empty() &&
         static_cast<int>(running_.size()) < options_.max_sequences) {
    SequenceState* seq = waiting_.front();
    const int64_t matched =
        kv_->AcquirePrefix(seq->kv, seq->tokens, seq->images, seq->prefill_len - 1);
    const int64_t need = ReservedBlocks(*seq) - static_cast<int64_t>(seq->kv.table.size());
    if (need + promised > kv_->pool().num_available()) {
      kv_->Free(seq->kv);  // wait until running sequences finish and free their room
      break;
    }
    seq->num_computed = matched;
    const int64_t n = std::min(seq->prefill_len - matched, budget);
    kv_->Grow(seq->kv, matched + n);  // cannot fail: checked above
    promised += ReservedBlocks(*seq) - static_cast<int64_t>(seq->kv.table.size());
    waiting_.pop_front();
    seq->running = true;
    running_.push_back(seq);
    out.admitted.push_back(seq);
    if (seq->preemptions == 0) {
      seq->cached_prompt_tokens = matched;
      out.prefix_hit_tokens += matched;
      out.prefix_miss_tokens += seq->prompt_len - matched;
    }
    out.chunks.push_back({seq, matched, n, false, matched + n == seq->prefill_len});
    out.prefill_tokens += n;
    budget -= n;
  }
  return out;
}

void Scheduler::Complete(const SchedulerOutput& out) {
  for (const ScheduledChunk& c : out.chunks) {
    c.seq->num_computed = c.start + c.count;
    kv_->RegisterFull(c.seq->kv, c.seq->tokens, c.seq->images, c.seq->num_computed);
  }
}

void Scheduler::Remove(SequenceState* seq) {
  if (auto it = std::find(running_.begin(), running_.end(), seq); it != running_.end()) {
    running_.erase(it);
  }
  if (auto it = std::find(waiting_.begin(), waiting_.end(), seq); it != waiting_.end()) {
    waiting_.erase(it);
  }
  kv_->Free(seq->kv);
  seq->running = false;
}

}  // namespace vlm::language
