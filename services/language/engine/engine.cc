#include "services/language/engine/engine.h"

#include <ATen/ATen.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/kernels/thread_pool.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/time_util.h"
#include "services/language/model/mrope.h"
#include "services/language/engine/scheduler.h"

namespace vlm::language {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kLog[] = "language";

}  // namespace

// ---------------------------------------------------------------------------
// Metrics (process-wide families, never destroyed)
// ---------------------------------------------------------------------------

struct Engine::Metrics {
  prometheus::Gauge* running;
  prometheus::Gauge* queue_depth;
  prometheus::Histogram* batch_tokens;
  prometheus::Histogram* batch_sequences;
  prometheus::Family<prometheus::Gauge>* kv_blocks;
  prometheus::Gauge* kv_blocks_reserved;
  prometheus::Gauge* kv_budget_bytes;
  prometheus::Gauge* kv_committed_bytes;
  prometheus::Counter* prefix_hit_tokens;
  prometheus::Counter* prefix_miss_tokens;
  prometheus::Counter* preemptions;
  prometheus::Family<prometheus::Histogram>* iteration;

  static Metrics* Get() {
    static Metrics* metrics = [] {
      auto* m = new Metrics;
      prometheus::Registry& r = MetricsRegistry();
      m->running = &prometheus::BuildGauge()
                        .Name("vlm_language_sequences_running")
                        .Help("Sequences in the engine's running batch.")
                        .Register(r)
                        .Add({});
      m->queue_depth = &prometheus::BuildGauge()
                            .Name("vlm_language_queue_depth")
                            .Help("Admitted generations not running (waiting or preempted).")
                            .Register(r)
                            .Add({});
      const prometheus::Histogram::BucketBoundaries sizes{1, 2, 4, 8, 16, 32, 64, 128, 256, 512,
                                                          1024, 2048};
      m->batch_tokens = &prometheus::BuildHistogram()
                             .Name("vlm_language_batch_tokens")
                             .Help("Tokens per engine iteration (decode + prefill).")
                             .Register(r)
                             .Add({}, sizes);
      m->batch_sequences = &prometheus::BuildHistogram()
                                .Name("vlm_language_batch_sequences")
                                .Help("Sequences per engine iteration.")
                                .Register(r)
                                .Add({}, prometheus::Histogram::BucketBoundaries{
                                             1, 2, 3, 4, 6, 8, 12, 16, 32, 64});
      m->kv_blocks = &prometheus::BuildGauge()
                          .Name("vlm_language_kv_blocks")
                          .Help("KV cache blocks by state: used (referenced), cached "
                                "(prefix-cache entries not in use), free.")
                          .Register(r);
      m->kv_blocks_reserved =
          &prometheus::BuildGauge()
               .Name("vlm_language_kv_blocks_reserved")
               .Help("KV blocks running sequences may still grow into (prompt + max_tokens), "
                     "not yet allocated; a waiting request starts when its own fit next to them.")
               .Register(r)
               .Add({});
      m->kv_committed_bytes =
          &prometheus::BuildGauge()
               .Name("vlm_language_kv_cache_committed_bytes")
               .Help("Bytes of the KV cache's blocks used at least once (memory committed); "
                     "the rest of the budget is reserved address space.")
               .Register(r)
               .Add({});
      m->kv_budget_bytes = &prometheus::BuildGauge()
                                .Name("vlm_language_kv_cache_budget_bytes")
                                .Help("Bytes of the paged KV cache (--kv_cache_mb).")
                                .Register(r)
                                .Add({});
      m->prefix_hit_tokens = &prometheus::BuildCounter()
                                  .Name("vlm_language_prefix_cache_hit_tokens_total")
                                  .Help("Prompt tokens whose KV came from the prefix cache.")
                                  .Register(r)
                                  .Add({});
      m->prefix_miss_tokens = &prometheus::BuildCounter()
                                   .Name("vlm_language_prefix_cache_miss_tokens_total")
                                   .Help("Prompt tokens that had to be prefilled.")
                                   .Register(r)
                                   .Add({});
      m->preemptions = &prometheus::BuildCounter()
                            .Name("vlm_language_preemptions_total")
                            .Help("Running sequences preempted for KV blocks (recomputed later).")
                            .Register(r)
                            .Add({});
      m->iteration = &LatencyHistogramFamily(
          "vlm_language_iteration_seconds",
          "Engine iteration time by phase: prefill (prompt tokens only), decode (generated "
          "tokens only), mixed.");
      return m;
    }();
    return metrics;
  }
};

BlockKey ImageKey(const ImageFeatures& image) {
  ImageKeyBuilder key(image.grid[0], image.grid[1], image.grid[2]);
  auto add = [&key](const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    key.AddTensor(static_cast<int>(c.scalar_type()), c.data_ptr(), c.nbytes());
  };
  add(image.last_hidden);
  for (const at::Tensor& d : image.deepstack) add(d);
  return key.Finish();
}

// ---------------------------------------------------------------------------
// RequestStream
// ---------------------------------------------------------------------------

bool RequestStream::Next(EngineEvent* event, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  bool (*ready)(std::deque<EngineEvent>*) = [](std::deque<EngineEvent>* q) { return !q->empty(); };
  if (!mu_.AwaitWithTimeout(absl::Condition(ready, &events_), timeout)) return false;
  *event = std::move(events_.front());
  events_.pop_front();
  return true;
}

void RequestStream::Push(EngineEvent event) {
  absl::MutexLock lock(&mu_);
  events_.push_back(std::move(event));
}

// ---------------------------------------------------------------------------
// Engine
// ---------------------------------------------------------------------------

struct Engine::Request {
  EngineRequest request;
  std::shared_ptr<RequestStream> stream;
  SequenceState seq;
  bool has_rope = false;
  RopeIndex rope;
  std::unique_ptr<GenerationState> generation;
  std::vector<std::optional<ProjectedImages>> projected;  // per image, while needed
  Clock::time_point submitted, scheduled, first_token;
  double projector_ms = 0;
  bool done = false;
};

struct Engine::State {
  State(const EngineOptions& o)
      : kv(o.num_blocks, o.block_size, o.prefix_cache),
        scheduler(&kv, SchedulerOptions{o.max_sequences, o.max_batch_tokens}) {}
  KvCacheManager kv;
  Scheduler scheduler;
  std::vector<std::unique_ptr<Request>> active;
  int64_t preemptions = 0;
  int64_t iterations = 0;
  int max_batch_sequences = 0;
};

Engine::Engine(ModelRunner* runner, const Tokenizer* tokenizer, const ModelConfig& config,
               EngineOptions options)
    : runner_(runner), tokenizer_(tokenizer), config_(config), options_(std::move(options)),
      metrics_(Metrics::Get()) {
  options_.max_sequences = std::max(1, options_.max_sequences);
  options_.max_queue = std::max(0, options_.max_queue);
  generator_config_.eos_ids = options_.eos_ids;
  state_ = std::make_unique<State>(options_);
  metrics_->kv_budget_bytes->Set(static_cast<double>(options_.kv_budget_bytes));
  {
    absl::MutexLock lock(&mu_);
    ReadPool();
    Publish();
  }
  thread_ = std::thread([this] { Loop(); });
}

Engine::~Engine() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    cv_.SignalAll();
  }
  thread_.join();
}

absl::StatusOr<std::shared_ptr<RequestStream>> Engine::Submit(EngineRequest request) {
  const GenerationRequest& g = request.generation;
  const int64_t prompt = static_cast<int64_t>(g.prompt_ids.size());
  if (prompt == 0) return absl::InvalidArgumentError("the prompt is empty");
  if (g.max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens must be at least 1; got ", g.max_tokens));
  }
  // The cache holds every token but the last sampled one.
  const int64_t tokens = prompt + g.max_tokens - 1;
  const int64_t blocks = (tokens + options_.block_size - 1) / options_.block_size;
  if (blocks > options_.num_blocks) {
    const double mib = static_cast<double>(options_.kv_budget_bytes) / (1 << 20);
    return absl::ResourceExhaustedError(absl::StrCat(
        "the prompt (", prompt, " tokens) plus max_tokens (", g.max_tokens, ") needs ", blocks,
        " KV blocks of ", options_.block_size, " tokens; the KV cache holds ",
        options_.num_blocks, " blocks (", options_.num_blocks * options_.block_size,
        " tokens, --kv_cache_mb=", static_cast<int64_t>(mib),
        "); shorten the conversation or lower max_tokens"));
  }

  auto r = std::make_unique<Request>();
  r->request = std::move(request);
  const GenerationRequest& gen = r->request.generation;
  r->seq.tokens = gen.prompt_ids;
  r->seq.prompt_len = prompt;
  if (options_.reserve_max_tokens) r->seq.max_cache_tokens = tokens;
  // Image spans: the runs of image pads, the k-th run belonging to image k.
  const int32_t pad = static_cast<int32_t>(config_.image_token_id);
  for (int64_t i = 0; i < prompt;) {
    if (gen.prompt_ids[i] != pad) {
      ++i;
      continue;
    }
    int64_t j = i;
    while (j < prompt && gen.prompt_ids[j] == pad) ++j;
    KeyedImageSpan span;
    span.start = i;
    span.length = j - i;
    r->seq.images.push_back(span);
    i = j;
  }
  if (r->seq.images.size() != gen.images.size() ||
      r->request.image_keys.size() != gen.images.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the prompt has ", r->seq.images.size(), " image placeholder runs for ",
        gen.images.size(), " images (", r->request.image_keys.size(), " image keys)"));
  }
  for (size_t k = 0; k < gen.images.size(); ++k) r->seq.images[k].key = r->request.image_keys[k];
  if (!gen.images.empty()) {
    std::vector<GridThw> grids;
    for (const ImageFeatures& image : gen.images) grids.push_back(image.grid);
    absl::StatusOr<RopeIndex> rope = GetRopeIndex(gen.prompt_ids, grids, config_);
    if (!rope.ok()) return rope.status();
    r->rope = *std::move(rope);
    r->has_rope = true;
  }
  r->projected.resize(gen.images.size());
  r->stream = std::make_shared<RequestStream>();
  r->submitted = Clock::now();
  std::shared_ptr<RequestStream> stream = r->stream;

  absl::MutexLock lock(&mu_);
  if (stop_) return absl::UnavailableError("the engine is shutting down");
  if (admitted_ >= options_.max_sequences + options_.max_queue) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "all ", options_.max_sequences, " sequence slots are busy and ",
        admitted_ - std::min(admitted_, stats_.running), " requests are already queued "
        "(--max_sequences, --max_queue); retry later"));
  }
  ++admitted_;
  r->seq.id = next_id_++;
  inbox_.push_back(std::move(r));
  Publish();
  cv_.SignalAll();
  return stream;
}

EngineStats Engine::Stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void Engine::ReadPool() {
  const BlockPool& pool = state_->kv.pool();
  stats_.blocks_total = pool.num_blocks();
  stats_.blocks_used = pool.num_used();
  stats_.blocks_cached = pool.num_cached();
  stats_.blocks_free = pool.num_free();
  stats_.blocks_reserved = state_->scheduler.reserved_blocks();
  stats_.blocks_touched = pool.num_touched();
  stats_.preemptions = state_->preemptions;
  stats_.iterations = state_->iterations;
  stats_.max_batch_sequences = state_->max_batch_sequences;
}

void Engine::Publish() {
  stats_.waiting = admitted_ - stats_.running;
  metrics_->running->Set(stats_.running);
  metrics_->queue_depth->Set(stats_.waiting);
  metrics_->kv_blocks->Add({{"state", "used"}}).Set(static_cast<double>(stats_.blocks_used));
  metrics_->kv_blocks->Add({{"state", "cached"}}).Set(static_cast<double>(stats_.blocks_cached));
  metrics_->kv_blocks->Add({{"state", "free"}}).Set(static_cast<double>(stats_.blocks_free));
  metrics_->kv_blocks_reserved->Set(static_cast<double>(stats_.blocks_reserved));
  if (stats_.blocks_total > 0) {
    metrics_->kv_committed_bytes->Set(static_cast<double>(options_.kv_budget_bytes) *
                                      static_cast<double>(stats_.blocks_touched) /
                                      static_cast<double>(stats_.blocks_total));
  }
}

void Engine::Loop() {
  while (true) {
    std::vector<std::unique_ptr<Request>> incoming;
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && inbox_.empty() && state_->active.empty()) cv_.Wait(&mu_);
      if (stop_) break;
      incoming.swap(inbox_);
    }
    for (auto& r : incoming) {
      // Submit refused what the pool cannot hold, so this is a safety net.
      if (absl::Status s = state_->scheduler.Add(&r->seq); !s.ok()) {
        Released();
        EngineEvent e;
        e.kind = EngineEvent::Kind::kError;
        e.error = s;
        r->stream->Push(std::move(e));
        continue;
      }
      r->generation =
          std::make_unique<GenerationState>(r->request.generation, tokenizer_, generator_config_);
      state_->active.push_back(std::move(r));
    }
    Iterate();
  }
  // Shutdown: everything still admitted ends with UNAVAILABLE.
  std::vector<std::unique_ptr<Request>> rest;
  {
    absl::MutexLock lock(&mu_);
    rest.swap(inbox_);
  }
  for (auto& r : state_->active) rest.push_back(std::move(r));
  state_->active.clear();
  for (auto& r : rest) {
    EngineEvent e;
    e.kind = EngineEvent::Kind::kError;
    e.error = absl::UnavailableError("the language service is shutting down");
    r->stream->Push(std::move(e));
  }
}

void Engine::Finish(Request* r, FinishReason reason, const std::string& detail) {
  const Clock::time_point now = Clock::now();
  GenerationResult& result = r->generation->result();
  if (reason == FinishReason::kCancelled) {
    result.finish = FinishReason::kCancelled;
    result.finish_detail = detail;
  } else {
    r->generation->Finish();
  }
  result.cached_prompt_tokens = r->seq.cached_prompt_tokens;
  result.projector_ms = r->projector_ms;
  result.scheduled_at = r->scheduled;
  result.first_token_at = r->first_token;
  if (r->scheduled != Clock::time_point{}) {
    const Clock::time_point first = result.completion_tokens > 0 ? r->first_token : now;
    result.prefill_ms = MillisBetween(r->scheduled, first);
    if (result.completion_tokens > 0) result.decode_ms = MillisBetween(r->first_token, now);
  }
  state_->scheduler.Remove(&r->seq);
  r->done = true;
  Released();
  EngineEvent e;
  e.kind = EngineEvent::Kind::kDone;
  e.result = result;
  r->stream->Push(std::move(e));
}

void Engine::Released() {
  // Counts and gauges are current before the caller hears of the end.
  absl::MutexLock lock(&mu_);
  --admitted_;
  stats_.running = state_->scheduler.num_running();
  ReadPool();
  Publish();
}

void Engine::Fail(Request* r, const absl::Status& status) {
  state_->scheduler.Remove(&r->seq);
  r->done = true;
  LogWarning(kLog, "generation failed", {{"error", status.ToString()}});
  Released();
  EngineEvent e;
  e.kind = EngineEvent::Kind::kError;
  e.error = status;
  r->stream->Push(std::move(e));
}

absl::Status Engine::BuildChunk(Request* r, int64_t start, int64_t count,
                                SequenceChunk* chunk) {
  SequenceState& seq = r->seq;
  const int64_t end = start + count;
  chunk->token_ids = absl::Span<const int32_t>(seq.tokens).subspan(start, count);
  chunk->start = start;
  chunk->block_table = seq.kv.table;
  // positions: [3, count] int64; prompt tokens from get_rope_index, later
  // ones (generated) at index + rope_delta on all three axes.
  at::Tensor positions = at::empty({3, count}, at::kLong);
  int64_t* p = positions.data_ptr<int64_t>();
  for (int64_t i = start; i < end; ++i) {
    for (int a = 0; a < 3; ++a) {
      p[a * count + (i - start)] = r->has_rope && i < seq.prompt_len
                                       ? r->rope.positions[a][i]
                                       : i + (r->has_rope ? r->rope.rope_delta : 0);
    }
  }
  chunk->positions = positions;
  // Projector rows of the image pads in [start, end): whole images are
  // projected on first need, then sliced.
  std::vector<at::Tensor> rows;
  std::vector<std::vector<at::Tensor>> deep;
  for (size_t k = 0; k < seq.images.size(); ++k) {
    const KeyedImageSpan& span = seq.images[k];
    const int64_t lo = std::max(start, span.start);
    const int64_t hi = std::min(end, span.start + span.length);
    if (lo >= hi) continue;
    if (!r->projected[k]) {
      const Clock::time_point t = Clock::now();
      absl::StatusOr<ProjectedImages> projected =
          runner_->ProjectImage(r->request.generation.images[k]);
      if (!projected.ok()) return projected.status();
      if (projected->num_tokens() != span.length) {
        return absl::InvalidArgumentError(absl::StrCat(
            "image ", k, " projects to ", projected->num_tokens(), " tokens; the prompt holds ",
            span.length, " placeholders for it"));
      }
      r->projected[k] = *std::move(projected);
      r->projector_ms += MillisBetween(t, Clock::now());
    }
    const ProjectedImages& img = *r->projected[k];
    rows.push_back(img.image_embeds.slice(0, lo - span.start, hi - span.start));
    deep.resize(img.deepstack.size());
    for (size_t l = 0; l < img.deepstack.size(); ++l) {
      deep[l].push_back(img.deepstack[l].slice(0, lo - span.start, hi - span.start));
    }
  }
  chunk->image_embeds = at::Tensor();
  chunk->deepstack.clear();
  if (!rows.empty()) {
    chunk->image_embeds = rows.size() == 1 ? rows[0] : at::cat(rows);
    for (auto& level : deep) chunk->deepstack.push_back(level.size() == 1 ? level[0] : at::cat(level));
  }
  return absl::OkStatus();
}

void Engine::Iterate() {
  State& st = *state_;
  const Clock::time_point begin = Clock::now();
  for (auto& r : st.active) {
    if (r->stream->cancelled()) Finish(r.get(), FinishReason::kCancelled, "cancelled");
  }
  SweepFinished();

  SchedulerOutput out = st.scheduler.Schedule();
  st.preemptions += static_cast<int64_t>(out.preempted.size());
  if (!out.preempted.empty()) metrics_->preemptions->Increment(out.preempted.size());
  metrics_->prefix_hit_tokens->Increment(static_cast<double>(out.prefix_hit_tokens));
  metrics_->prefix_miss_tokens->Increment(static_cast<double>(out.prefix_miss_tokens));
  for (SequenceState* seq : out.preempted) {
    for (auto& p : Owner(seq)->projected) p.reset();
  }

  if (!out.chunks.empty()) {
    const size_t ran = RunPass(out);
    const double seconds = std::chrono::duration<double>(Clock::now() - begin).count();
    const char* phase = out.prefill_tokens == 0  ? "decode"
                        : out.decode_tokens == 0 ? "prefill"
                                                 : "mixed";
    metrics_->iteration->Add({{"phase", phase}}, DefaultLatencyBuckets()).Observe(seconds);
    metrics_->batch_tokens->Observe(static_cast<double>(out.prefill_tokens + out.decode_tokens));
    metrics_->batch_sequences->Observe(static_cast<double>(ran));
    ++st.iterations;
    st.max_batch_sequences = std::max(st.max_batch_sequences, static_cast<int>(ran));
  }
  SweepFinished();
  {
    absl::MutexLock lock(&mu_);
    stats_.running = st.scheduler.num_running();
    ReadPool();
    Publish();
  }
  if (out.chunks.empty() && !st.active.empty()) {
    // Nothing could run (every admitted request is cancelled or waits for
    // blocks held by requests that finish on their own): do not spin.
    absl::SleepFor(absl::Milliseconds(1));
  }
}

void Engine::SweepFinished() {
  std::vector<std::unique_ptr<Request>>& active = state_->active;
  active.erase(std::remove_if(active.begin(), active.end(),
                              [](const std::unique_ptr<Request>& r) { return r->done; }),
               active.end());
}

Engine::Request* Engine::Owner(const SequenceState* seq) const {
  for (auto& r : state_->active) {
    if (&r->seq == seq) return r.get();
  }
  return nullptr;
}

size_t Engine::RunPass(const SchedulerOutput& out) {
  State& st = *state_;
  std::vector<SequenceChunk> chunks;
  std::vector<Request*> owners;
  SchedulerOutput ran;
  for (const ScheduledChunk& c : out.chunks) {
    Request* r = Owner(c.seq);
    if (r->scheduled == Clock::time_point{}) r->scheduled = Clock::now();
    SequenceChunk chunk;
    chunk.decode = c.decode;
    chunk.logits = c.logits;
    if (absl::Status s = BuildChunk(r, c.start, c.count, &chunk); !s.ok()) {
      Fail(r, s);
      continue;
    }
    chunks.push_back(std::move(chunk));
    owners.push_back(r);
    ran.chunks.push_back(c);
  }
  absl::StatusOr<at::Tensor> logits =
      chunks.empty() ? absl::StatusOr<at::Tensor>(at::Tensor()) : runner_->Forward(chunks);
  if (!logits.ok()) {
    for (Request* r : owners) Fail(r, logits.status());
    return ran.chunks.size();
  }
  st.scheduler.Complete(ran);
  SampleAndStream(ran, owners, *logits);
  // The cache holds what the images contributed once the prompt is in.
  for (Request* r : owners) {
    if (!r->done && r->seq.num_computed >= r->seq.prompt_len) {
      for (auto& p : r->projected) p.reset();
    }
  }
  return ran.chunks.size();
}

void Engine::SampleAndStream(const SchedulerOutput& ran, const std::vector<Request*>& owners,
                             const at::Tensor& logits) {
  at::Tensor all;
  if (logits.defined()) all = logits.to(at::kFloat).contiguous();
  // Sampling, logprobs and detokenizing touch only their own request's
  // state, so the sequences' steps run side by side on the kernels' pool
  // (a full-vocabulary log-softmax per sequence is serial work the pool's
  // other thread would otherwise spin through); the results are the same.
  std::vector<size_t> sampled;  // indices into ran.chunks, one logits row each
  for (size_t i = 0; i < ran.chunks.size(); ++i) {
    if (ran.chunks[i].logits) sampled.push_back(i);
  }
  std::vector<absl::StatusOr<GenerationState::Step>> steps(sampled.size(),
                                                           absl::UnknownError("not sampled"));
  if (!sampled.empty()) {
    const int64_t width = all.size(-1);
    kernels::ParallelFor(static_cast<int64_t>(sampled.size()), 0, 1,
                         [&](int64_t begin, int64_t end) {
                           for (int64_t j = begin; j < end; ++j) {
                             const float* data = all.data_ptr<float>() + j * width;
                             steps[j] = owners[sampled[j]]->generation->Next(
                                 absl::Span<const float>(data, width));
                           }
                         });
  }
  for (size_t j = 0; j < sampled.size(); ++j) {
    Request* r = owners[sampled[j]];
    absl::StatusOr<GenerationState::Step>& step = steps[j];
    if (!step.ok()) {
      Fail(r, step.status());
      continue;
    }
    state_->scheduler.Append(&r->seq, r->generation->last_token());
    if (r->generation->completion_tokens() == 1) r->first_token = Clock::now();
    EngineEvent e;
    e.kind = EngineEvent::Kind::kChunk;
    e.chunk = std::move(step->chunk);
    r->stream->Push(std::move(e));
    if (step->finished) Finish(r, FinishReason::kStop, "");
  }
}

}  // namespace vlm::language
