// The scheduler of the serving engine: decides, each iteration, which tokens
// of which sequences run in the next forward pass. It never touches tensors;
// blocks come from the KvCacheManager.
//
// One iteration (Schedule):
//  (a) every running sequence that is decoding contributes its one new token
//      (oldest first); a block is allocated at a boundary, and when none is
//      left even after evicting unreferenced cached blocks, the NEWEST running
//      sequence is preempted: its blocks are freed and it goes to the front
//      of the waiting queue with prompt + generated tokens, to be recomputed
//      (the engine keeps its sampler and stream position);
//  (b) running sequences still prefilling, then waiting ones in FIFO order,
//      contribute prompt chunks until max_batch_tokens is used, while fewer
//      than max_sequences run. An admitted sequence reuses its longest cached
//      prefix (never the whole prompt).
//
// Admission reserves room to grow: each sequence has a reservation of
// BlocksFor(max(prefill_len, max_cache_tokens)) blocks (max_cache_tokens =
// prompt + max_tokens - 1, the most its cache can hold). The blocks a running
// sequence has not allocated yet (reservation - blocks held) are its
// outstanding need, and the waiting sequence at the head of the queue is
// admitted only when its own outstanding need (after taking its cached
// prefix) plus every running sequence's fits in the blocks Allocate can
// supply (free + unreferenced cached). Growth within a reservation then
// always finds a block (allocating lowers the need and the supply alike;
// finishing, cancelling and preempting free both), so sequences that all
// declare max_cache_tokens are never preempted. The price: a request asking
// for many tokens holds room it may not use, and later requests wait (FIFO,
// so a large one is never starved by small ones behind it).
// Preemption stays as the fallback for growth beyond a reservation (a
// sequence without max_cache_tokens reserves only its prefill) and is
// reported in SchedulerOutput::preempted.
// A sequence whose prompt + max_tokens fits the pool alone always makes
// progress: growth preempts newer sequences first, and the oldest one never
// waits for a younger one. One whose reservation exceeds the whole pool is
// refused by Add.
//
// Thread-safety: none (the engine thread owns it). Sequences are owned by the
// caller and must stay alive until Remove.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/status/status.h"
#include "services/language/engine/kv_cache_manager.h"

namespace vlm::language {

// The scheduler's view of one request.
struct SequenceState {
  uint64_t id = 0;
  std::vector<int32_t> tokens;    // prompt + generated so far
  int64_t prompt_len = 0;
  // Tokens [0, prefill_len) run as prefill rows: the prompt, or after a
  // preemption everything known then (recomputed); later tokens are decode rows.
  int64_t prefill_len = 0;
  int64_t num_computed = 0;       // tokens whose K/V is in the cache
  // Cache indices the sequence can reach, prompt + max_tokens - 1 (the last
  // sampled token is never cached): its admission reserves blocks for them.
  // 0: no growth is reserved, only the prefill.
  int64_t max_cache_tokens = 0;
  std::vector<KeyedImageSpan> images;  // image-pad runs of the prompt, in order
  KvBlocks kv;
  bool running = false;
  int64_t cached_prompt_tokens = 0;  // prompt tokens reused at first admission
  int preemptions = 0;
  bool decoding() const { return running && num_computed >= prefill_len; }
};

struct SchedulerOptions {
  int max_sequences = 8;          // running at once (the batch width)
  int64_t max_batch_tokens = 512; // tokens per forward pass
};

// The tokens one sequence runs this iteration: tokens[start, start + count).
struct ScheduledChunk {
  SequenceState* seq = nullptr;
  int64_t start = 0;
  int64_t count = 0;
  bool decode = false;  // one generated token (decode rows), else prefill rows
  bool logits = false;  // the chunk ends at the last known token: sample after it
};

struct SchedulerOutput {
  std::vector<ScheduledChunk> chunks;
  std::vector<SequenceState*> preempted;  // this iteration, now waiting
  std::vector<SequenceState*> admitted;   // moved from waiting to running
  int64_t prefill_tokens = 0;
  int64_t decode_tokens = 0;
  // Prompt tokens reused from the prefix cache / to compute, over `admitted`
  // on their first admission.
  int64_t prefix_hit_tokens = 0;
  int64_t prefix_miss_tokens = 0;
};

class Scheduler {
 public:
  Scheduler(KvCacheManager* kv, SchedulerOptions options);

  // Appends a new sequence (tokens = prompt, prefill_len = prompt_len) to the
  // waiting queue. RESOURCE_EXHAUSTED, queueing nothing, when its reservation
  // needs more blocks than the pool has (it could never run).
  absl::Status Add(SequenceState* seq);
  SchedulerOutput Schedule();
  // After the forward pass of `out`: the chunks' tokens are in the cache
  // (full blocks are registered in the prefix cache).
  void Complete(const SchedulerOutput& out);
  // The token sampled after a logits chunk (the next decode input).
  void Append(SequenceState* seq, int32_t token) { seq->tokens.push_back(token); }
  // Finished or cancelled: frees the blocks, forgets the sequence.
  void Remove(SequenceState* seq);

  int num_running() const { return static_cast<int>(running_.size()); }
  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  // Blocks of a sequence's reservation (see the admission rule above).
  int64_t ReservedBlocks(const SequenceState& seq) const;
  // The running sequences' outstanding needs: blocks promised, not yet allocated.
  int64_t reserved_blocks() const;
  const KvCacheManager& kv() const { return *kv_; }

 private:
  void Preempt(SequenceState* victim, SchedulerOutput& out);

  KvCacheManager* kv_;
  SchedulerOptions options_;
  std::vector<SequenceState*> running_;  // admission order, newest last
  std::deque<SequenceState*> waiting_;
};

}  // namespace vlm::language
