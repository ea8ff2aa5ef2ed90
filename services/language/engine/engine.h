// The serving engine of the language service: one thread owns the model and,
// while there is work, runs iterations of
//   schedule (Scheduler over the KvCacheManager's blocks)
//   -> one forward pass over every scheduled token (ModelRunner)
//   -> per sequence: sample, detokenize, stop strings (GenerationState)
//   -> push chunks to each request's stream.
// Callers (gRPC handlers) only Submit and read their RequestStream.
//
// Admission (Submit): INVALID_ARGUMENT for a request the model cannot run
// (bad image spans); RESOURCE_EXHAUSTED, naming --kv_cache_mb and the
// numbers, for one whose prompt + max_tokens cannot fit the KV budget even
// alone; RESOURCE_EXHAUSTED when max_sequences run and max_queue more are
// admitted already. Nothing else is affected by a refused request.
// An admitted request starts running only when the KV blocks for its prompt
// plus max_tokens fit next to what the running ones may still grow into
// (reserve_max_tokens; scheduler.h), so running requests are not preempted.
//
// Cancellation: RequestStream::Cancel (client gone, deadline) makes the engine
// drop the request at its next iteration and free its blocks.
//
// Thread-safety: Submit, Stats and RequestStream are safe from any thread.
// The runner and tokenizer must outlive the engine.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/model_config.h"
#include "services/language/engine/block_key.h"
#include "services/language/engine/generator.h"
#include "services/language/engine/model_runner.h"
#include "services/language/text/tokenizer.h"

namespace vlm::language {

struct SchedulerOutput;  // scheduler.h
struct SequenceState;

struct EngineOptions {
  int max_sequences = 8;           // running at once: the batch width
  int max_queue = 16;              // admitted beyond the running ones
  int64_t max_batch_tokens = 512;  // tokens per forward pass (chunked prefill)
  int64_t num_blocks = 0;          // KV blocks (from --kv_cache_mb)
  int64_t block_size = 16;         // tokens per KV block
  bool prefix_cache = true;
  // A request starts only when the blocks for prompt + max_tokens fit next to
  // the running requests' reservations (no preemption); false: only its
  // prefill has to fit, and growth preempts the newest running request.
  bool reserve_max_tokens = true;
  uint64_t kv_budget_bytes = 0;    // for messages and metrics (num_blocks x bytes per block)
  std::vector<int32_t> eos_ids;
};

// One request for the engine: a validated GenerationRequest plus the keys of
// its images (ImageKeyBuilder over their features, one per image).
struct EngineRequest {
  GenerationRequest generation;
  std::vector<BlockKey> image_keys;
};

// The prefix-cache key of an image (ImageKeyBuilder over its grid and the
// bytes of last_hidden and every deepstack tensor, as received).
BlockKey ImageKey(const ImageFeatures& image);

// What a request's stream yields, in order: chunks, then exactly one end
// (done with the result, or an error status).
struct EngineEvent {
  enum class Kind { kChunk, kDone, kError };
  Kind kind = Kind::kChunk;
  GenerationChunk chunk;    // kChunk
  GenerationResult result;  // kDone (finish kCancelled after Cancel)
  absl::Status error;       // kError
};

class RequestStream {
 public:
  // Waits up to `timeout` for the next event; false if none came.
  bool Next(EngineEvent* event, absl::Duration timeout);
  // Asks the engine to drop the request (idempotent).
  void Cancel() { cancelled_.store(true, std::memory_order_relaxed); }
  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }

 private:
  friend class Engine;
  void Push(EngineEvent event);
  absl::Mutex mu_;
  std::deque<EngineEvent> events_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> cancelled_{false};
};

struct EngineStats {
  int running = 0;
  int waiting = 0;  // admitted, not running (queued or preempted)
  int64_t blocks_total = 0, blocks_used = 0, blocks_cached = 0, blocks_free = 0;
  int64_t blocks_reserved = 0;  // promised to running requests, not yet allocated
  int64_t blocks_touched = 0;   // handed out at least once: their memory is committed
  int64_t preemptions = 0;
  int64_t iterations = 0;
  int max_batch_sequences = 0;  // most sequences one forward pass has served
};

class Engine {
 public:
  Engine(ModelRunner* runner, const Tokenizer* tokenizer, const ModelConfig& config,
         EngineOptions options);
  ~Engine();  // stops the thread; pending requests end with UNAVAILABLE

  absl::StatusOr<std::shared_ptr<RequestStream>> Submit(EngineRequest request);
  EngineStats Stats() const;
  const EngineOptions& options() const { return options_; }

 private:
  struct Request;
  struct Metrics;
  void Loop();
  void Iterate();
  // Iterate's steps: drop finished requests; the request owning a scheduled
  // sequence; build and run one forward pass over the scheduled chunks
  // (returns how many ran); sample each chunk that wants logits and stream
  // its text.
  void SweepFinished();
  Request* Owner(const SequenceState* seq) const;
  size_t RunPass(const SchedulerOutput& out);
  void SampleAndStream(const SchedulerOutput& ran, const std::vector<Request*>& owners,
                       const at::Tensor& logits);
  void Finish(Request* r, FinishReason reason, const std::string& detail);
  void Fail(Request* r, const absl::Status& status);
  // Bookkeeping when a request ends (before its stream hears of it).
  void Released();
  // The runner's input for tokens[start, start + count) of `r`: positions,
  // block table and image rows (projecting images on first need).
  absl::Status BuildChunk(Request* r, int64_t start, int64_t count, SequenceChunk* chunk);
  // Copies the pool's counts into stats_ (engine thread, or before it starts).
  void ReadPool() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets the gauges from stats_.
  void Publish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  ModelRunner* runner_;
  const Tokenizer* tokenizer_;
  ModelConfig config_;
  EngineOptions options_;
  GeneratorConfig generator_config_;
  Metrics* metrics_;

  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  std::vector<std::unique_ptr<Request>> inbox_ ABSL_GUARDED_BY(mu_);
  int admitted_ ABSL_GUARDED_BY(mu_) = 0;  // submitted, not yet finished
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  EngineStats stats_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;

  // Engine thread only.
  struct State;
  std::unique_ptr<State> state_;
  std::thread thread_;
};

}  // namespace vlm::language
