#include "services/gateway/chat_pipeline.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>

#include <algorithm>
#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/sha256.h"
#include "services/gateway/backend_call.h"
#include "services/gateway/tool_calls.h"

namespace vlm::gateway {
namespace {

struct GatewayMetrics {
  prometheus::Gauge& running = prometheus::BuildGauge()
                                   .Name("vlm_gateway_admission_running")
                                   .Help("Chat requests admitted and running.")
                                   .Register(MetricsRegistry())
                                   .Add({});
  prometheus::Gauge& queued = prometheus::BuildGauge()
                                  .Name("vlm_gateway_admission_queued")
                                  .Help("Chat requests waiting for admission.")
                                  .Register(MetricsRegistry())
                                  .Add({});
  prometheus::Family<prometheus::Counter>& rejected =
      prometheus::BuildCounter()
          .Name("vlm_gateway_rejected_total")
          .Help("Chat requests refused before any backend call, by reason.")
          .Register(MetricsRegistry());
  prometheus::Histogram& queue_seconds =
      LatencyHistogramFamily("vlm_gateway_queue_seconds",
                             "Time a chat request waited for admission.")
          .Add({}, DefaultLatencyBuckets());
  prometheus::Histogram& vision_seconds =
      LatencyHistogramFamily("vlm_gateway_vision_seconds",
                             "Wall time of a request's parallel image encode phase.")
          .Add({}, DefaultLatencyBuckets());
  prometheus::Histogram& first_token_seconds =
      LatencyHistogramFamily("vlm_gateway_time_to_first_token_seconds",
                             "From request arrival to the first text delta.")
          .Add({}, DefaultLatencyBuckets());
  prometheus::Family<prometheus::Counter>& images =
      prometheus::BuildCounter()
          .Name("vlm_gateway_images_total")
          .Help("Images encoded for chat requests, by where their features came from.")
          .Register(MetricsRegistry());
  prometheus::Family<prometheus::Counter>& tokens =
      prometheus::BuildCounter()
          .Name("vlm_gateway_tokens_total")
          .Help("Tokens of completed chat requests, by kind (prompt, image, completion).")
          .Register(MetricsRegistry());
};

GatewayMetrics& Metrics() {
  static GatewayMetrics* metrics = new GatewayMetrics();
  return *metrics;
}

std::string NewRequestId() {
  thread_local absl::BitGen gen;
  return absl::StrFormat("%016x", absl::Uniform<uint64_t>(gen));
}

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

}  // namespace

const char* CacheLevelName(v1::CacheLevel level) {
  switch (level) {
    case v1::CACHE_LEVEL_MISS: return "miss";
    case v1::CACHE_LEVEL_MEMORY: return "memory";
    case v1::CACHE_LEVEL_PIXELS: return "pixels";
    case v1::CACHE_LEVEL_DISK: return "disk";
    default: return "unspecified";
  }
}

// One image of the request, in request order.
struct ChatPipeline::ImageJob {
  int number = 0;  // 1-based
  const v1::ImagePart* part = nullptr;
  std::string key;  // hex SHA-256 of the bytes, or the given content hash
  VisionRouter::EncodeOutcome outcome;
  double vision_ms = 0;
};

namespace {

v1::ImageOptions MergedOptions(const v1::ImageOptions& defaults, const v1::ImageOptions& own) {
  v1::ImageOptions merged = defaults;
  if (own.min_pixels() != 0) merged.set_min_pixels(own.min_pixels());
  if (own.max_pixels() != 0) merged.set_max_pixels(own.max_pixels());
  return merged;
}

}  // namespace

bool CollectingSink::OnDelta(v1::ChatChunk& chunk) {
  // Several choices: each gathers in `choices` (choice 0 as well, starting
  // from what the top-level fields gathered before another choice showed up).
  if (chunk.index() > 0 && response_->choices_size() == 0) {
    v1::ChatChoice* zero = response_->add_choices();
    zero->set_text(response_->text());
    zero->set_finish_reason(response_->finish_reason());
    *zero->mutable_logprobs() = response_->logprobs();
  }
  if (response_->choices_size() > 0) {
    while (response_->choices_size() <= chunk.index()) {
      const int index = response_->choices_size();
      response_->add_choices()->set_index(index);
    }
    v1::ChatChoice& choice = *response_->mutable_choices(chunk.index());
    choice.mutable_text()->append(chunk.text());
    for (const v1::TokenLogprob& lp : chunk.logprobs()) *choice.add_logprobs() = lp;
  }
  if (chunk.index() != 0) return true;
  response_->mutable_text()->append(chunk.text());
  for (v1::TokenLogprob& lp : *chunk.mutable_logprobs()) *response_->add_logprobs() = std::move(lp);
  return true;
}

bool CollectingSink::OnFinal(v1::ChatChunk& chunk) {
  OnDelta(chunk);
  if (chunk.index() < response_->choices_size()) {
    response_->mutable_choices(chunk.index())->set_finish_reason(chunk.finish_reason());
  }
  if (chunk.index() < response_->choices_size()) {
    *response_->mutable_choices(chunk.index())->mutable_tool_calls() = chunk.tool_calls();
  }
  if (chunk.index() == 0) {
    response_->set_finish_reason(chunk.finish_reason());
    *response_->mutable_tool_calls() = chunk.tool_calls();
  }
  if (!chunk.has_usage()) return true;  // a choice's end, not the request's
  for (int i = 0; i < chunk.choice_usage_size() && i < response_->choices_size(); ++i) {
    *response_->mutable_choices(i)->mutable_usage() = chunk.choice_usage(i);
  }
  response_->mutable_usage()->Swap(chunk.mutable_usage());
  response_->mutable_timings()->Swap(chunk.mutable_timings());
  response_->mutable_images()->Swap(chunk.mutable_images());
  response_->set_request_id(chunk.request_id());
  response_->mutable_language()->Swap(chunk.mutable_language());
  return true;
}

void Cancellation::Cancel() {
  std::function<void()> callback;
  {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return;
    cancelled_ = true;
    if (!callback_) return;
    callback = callback_;
    running_ = true;
  }
  callback();
  absl::MutexLock lock(&mu_);
  running_ = false;  // wakes an Unregister waiting in Await
}

bool Cancellation::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

void Cancellation::Register(std::function<void()> callback) {
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](bool* running) { return !*running; }, &running_));
    if (!cancelled_) {
      callback_ = std::move(callback);
      return;
    }
    callback_ = nullptr;  // Cancel() has run: nothing will call a stored callback
  }
  if (callback) callback();
}

void Cancellation::Unregister() {
  absl::MutexLock lock(&mu_);
  callback_ = nullptr;
  mu_.Await(absl::Condition(+[](bool* running) { return !*running; }, &running_));
}

struct ChatPipeline::Record {
  std::string request_id;
  int images = 0;
  int cache_hits = 0;
  int prompt_tokens = 0;
  int completion_tokens = 0;
  double first_token_ms = 0;
  v1::LanguageRoute language;
};

Admission::Observer ChatPipeline::AdmissionGauges() {
  GatewayMetrics* metrics = &Metrics();
  return [metrics](int running, int queued) {
    metrics->running.Set(running);
    metrics->queued.Set(queued);
  };
}

ChatPipeline::ChatPipeline(GatewayOptions options, const Readiness* readiness,
                           Admission* admission, const VisionRouter* router,
                           const LanguageRouter* language)
    : options_(std::move(options)),
      readiness_(readiness),
      admission_(admission),
      router_(router),
      language_(language) {
  Metrics();
}

grpc::Status ChatPipeline::Run(const ChatCall& call, const v1::ChatRequest& request,
                               ChatSink* sink) const {
  const absl::Time start = absl::Now();
  Record record;
  const grpc::Status status = Handle(call, request, sink, &record);
  const LogLevel level = status.ok() || status.error_code() == grpc::StatusCode::CANCELLED ||
                                 status.error_code() == grpc::StatusCode::INVALID_ARGUMENT
                             ? LogLevel::kInfo
                             : LogLevel::kWarning;
  Log(level, "gateway", "chat",
      {{"rpc", call.front_end},
       {"request_id", record.request_id},
       {"code", GrpcCodeName(status.error_code())},
       {"error", status.error_message()},
       {"images", record.images},
       {"cache_hits", record.cache_hits},
       {"prompt_tokens", record.prompt_tokens},
       {"completion_tokens", record.completion_tokens},
       {"language_replica", record.language.replica()},
       {"language_route", record.language.route()},
       {"first_token_ms", record.first_token_ms},
       {"total_ms", Ms(absl::Now() - start)}});
  return status;
}

// The request's deadline: the front end's, the gRPC caller's, else the default.
absl::Time ChatPipeline::Deadline(const ChatCall& call, absl::Time start) const {
  absl::Time deadline = call.deadline;
  if (call.grpc_context != nullptr) {
    deadline = std::min(deadline, FromGrpcDeadline(call.grpc_context->deadline()));
  }
  if (deadline == absl::InfiniteFuture() && options_.default_deadline != absl::InfiniteDuration()) {
    deadline = start + options_.default_deadline;
  }
  return deadline;
}

// The image cost estimate (validation.h) at the vision service's own budget;
// without a budget (no replica answered GetImageBudget) no estimate is made
// and the vision service alone decides.
absl::Status ChatPipeline::CheckImageCost(const v1::ChatRequest& request,
                                          absl::Time deadline) const {
  bool inline_image = false;
  for (const v1::ChatMessage& message : request.messages()) {
    for (const v1::ContentPart& part : message.content()) {
      inline_image |= part.has_image() && part.image().source_case() == v1::ImagePart::kData;
    }
  }
  if (!inline_image || router_ == nullptr) return absl::OkStatus();
  ImageCostModel model = options_.limits.image_cost;
  absl::StatusOr<v1::ImageBudget> budget =
      router_->ImageBudget(std::min(deadline, absl::Now() + absl::Seconds(2)));
  absl::Status applied = budget.ok() ? ApplyImageBudget(*budget, &model) : budget.status();
  if (!applied.ok()) {
    LogWarning("gateway", "no image cost estimate", {{"reason", std::string(applied.message())}});
    return absl::OkStatus();
  }
  return gateway::CheckImageCost(request, model, deadline - absl::Now());
}

// Readiness, validation, then a slot (or RESOURCE_EXHAUSTED / the caller's
// cancellation or deadline while queued).
absl::StatusOr<Admission::Permit> ChatPipeline::Admit(const ChatCall& call,
                                                      const v1::ChatRequest& request,
                                                      absl::Time deadline) const {
  GatewayMetrics& metrics = Metrics();
  if (absl::Status s = readiness_->Check(kServiceName); !s.ok()) {
    metrics.rejected.Add({{"reason", "not_serving"}}).Increment();
    return s;
  }
  if (absl::Status s = ValidateChatRequest(request, options_.limits); !s.ok()) {
    metrics.rejected.Add({{"reason", "invalid_argument"}}).Increment();
    return s;
  }
  if (request.n() < 0 || request.n() > options_.max_n) {
    metrics.rejected.Add({{"reason", "invalid_argument"}}).Increment();
    return absl::InvalidArgumentError(absl::StrCat(
        "n is ", request.n(), "; it must be between 1 and ", options_.max_n, " (--max_n)"));
  }
  if (absl::Status s = CheckImageCost(request, deadline); !s.ok()) {
    metrics.rejected.Add({{"reason", absl::IsDeadlineExceeded(s) ? "deadline" : "invalid_argument"}})
        .Increment();
    return s;
  }
  const grpc::ServerContextBase* context = call.grpc_context;
  Cancellation* const cancellation = call.cancellation;
  absl::StatusOr<Admission::Permit> permit =
      admission_->Acquire(deadline, [context, cancellation] {
        return (context != nullptr && context->IsCancelled()) ||
               (cancellation != nullptr && cancellation->cancelled());
      });
  if (!permit.ok()) {
    const char* reason = permit.status().code() == absl::StatusCode::kResourceExhausted
                             ? "capacity"
                             : permit.status().code() == absl::StatusCode::kCancelled ? "cancelled"
                                                                                       : "deadline";
    metrics.rejected.Add({{"reason", reason}}).Increment();
  }
  return permit;
}

// Every image of the request, encoded in parallel, each on its rendezvous
// replica; the per-image results of the response in `images`.
grpc::Status ChatPipeline::EncodeImages(const ChatCall& call, const v1::ChatRequest& request,
                                        absl::Time deadline, const std::string& request_id,
                                        std::vector<ImageJob>* jobs,
                                        std::vector<v1::ImageResult>* images, double* vision_ms,
                                        Record* record) const {
  GatewayMetrics& metrics = Metrics();
  for (const v1::ChatMessage& message : request.messages()) {
    for (const v1::ContentPart& part : message.content()) {
      if (!part.has_image()) continue;
      ImageJob job;
      job.number = static_cast<int>(jobs->size()) + 1;
      job.part = &part.image();
      jobs->push_back(std::move(job));
    }
  }
  record->images = static_cast<int>(jobs->size());
  auto encode = [&](ImageJob& job) {
    const absl::Time begin = absl::Now();
    v1::EncodeRequest encode_request;
    if (job.part->source_case() == v1::ImagePart::kData) {
      job.key = Sha256Hex(job.part->data());
      encode_request.set_image(job.part->data());
    } else {
      job.key = absl::AsciiStrToLower(job.part->content_hash());
      encode_request.set_content_hash(job.key);
    }
    *encode_request.mutable_options() =
        MergedOptions(request.image_options(), job.part->options());
    job.outcome = router_->Encode(call.grpc_context, deadline, job.key, encode_request, request_id);
    job.vision_ms = Ms(absl::Now() - begin);
  };
  const absl::Time vision_start = absl::Now();
  if (!jobs->empty()) {
    std::vector<std::thread> threads;
    for (size_t i = 1; i < jobs->size(); ++i) threads.emplace_back(encode, std::ref((*jobs)[i]));
    encode((*jobs)[0]);
    for (std::thread& t : threads) t.join();
  }
  *vision_ms = Ms(absl::Now() - vision_start);
  if (!jobs->empty()) metrics.vision_seconds.Observe(*vision_ms / 1000);
  for (const ImageJob& job : *jobs) {
    if (!job.outcome.status.ok()) {
      return MapVisionError(job.number, job.outcome.status, job.outcome.replica,
                            job.outcome.attempts);
    }
  }
  for (ImageJob& job : *jobs) {
    const v1::EncodeResponse& r = job.outcome.response;
    v1::ImageResult result;
    result.set_content_hash(r.features().content_hash().empty() ? job.key
                                                                : r.features().content_hash());
    result.set_cache(r.cache());
    *result.mutable_grid() = r.features().grid();
    const int64_t merge = options_.spatial_merge_size;
    result.set_tokens(static_cast<int32_t>(r.features().grid().t() * r.features().grid().h() *
                                           r.features().grid().w() / (merge * merge)));
    result.set_vision_ms(job.vision_ms);
    result.set_replica(r.replica().empty() ? job.outcome.replica : r.replica());
    *result.mutable_budget() = r.options();
    metrics.images.Add({{"cache", CacheLevelName(r.cache())}}).Increment();
    if (r.cache() != v1::CACHE_LEVEL_MISS && r.cache() != v1::CACHE_LEVEL_UNSPECIFIED) {
      ++record->cache_hits;
    }
    images->push_back(std::move(result));
  }
  return grpc::Status::OK;
}

// The language request: the messages with each image's features moved in,
// the generation parameters (the default max_tokens when unset).
v1::GenerateRequest ChatPipeline::BuildGenerateRequest(const v1::ChatRequest& request,
                                                       std::vector<ImageJob>& jobs,
                                                       const std::string& request_id) const {
  v1::GenerateRequest generate;
  size_t next_image = 0;
  for (const v1::ChatMessage& message : request.messages()) {
    v1::LanguageMessage* out = generate.add_messages();
    out->set_role(message.role());
    *out->mutable_tool_calls() = message.tool_calls();
    out->set_tool_call_id(message.tool_call_id());
    for (const v1::ContentPart& part : message.content()) {
      v1::LanguageContentPart* out_part = out->add_content();
      if (part.has_image()) {
        out_part->mutable_image()->Swap(jobs[next_image++].outcome.response.mutable_features());
      } else {
        out_part->set_text(part.text());
      }
    }
  }
  *generate.mutable_params() = request.params();
  *generate.mutable_tools() = request.tools();
  *generate.mutable_tool_choice() = request.tool_choice();
  if (!generate.params().has_max_tokens() && options_.default_max_tokens > 0) {
    generate.mutable_params()->set_max_tokens(options_.default_max_tokens);
  }
  generate.set_add_generation_prompt(true);
  generate.set_request_id(request_id);
  return generate;
}

// Streams the generation of the replica the conversation is routed to; `last`
// gets the final response (finish reason, usage, timings) and `route` where it
// ran. A replica that fails UNAVAILABLE before its first response is replaced
// by the next one of the plan (which prefills from scratch); once a response
// has been streamed a failure is the request's. A client gone is CANCELLED.
grpc::Status ChatPipeline::Relay(const ChatCall& call, absl::Time deadline, absl::Time start,
                                 v1::GenerateRequest generate, const std::string& request_id,
                                 const std::string& route_key, ChatSink* sink,
                                 v1::GenerateResponse* last, double* first_token_ms,
                                 v1::LanguageRoute* route) const {
  Cancellation* const cancellation = call.cancellation;
  const LanguageRouter::Plan plan = language_->Route(route_key);
  if (plan.order.empty()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, language_->UnavailableReason());
  }
  grpc::Status failed;
  for (size_t attempt = 0; attempt < plan.order.size(); ++attempt) {
    LanguageReplica::Call replica_call(plan.order[attempt]);
    const LanguageReplica& replica = replica_call.replica();
    route->set_replica(replica.name());
    route->set_route(attempt == 0 ? plan.route : "failover");
    route->set_attempts(static_cast<int32_t>(attempt + 1));
    CountLanguageRequest(replica.name(), route->route());
    std::unique_ptr<grpc::ClientContext> backend =
        BackendContext(call.grpc_context, deadline, request_id);
    // A front end's cancellation (e.g. an HTTP client gone) reaches the language
    // service at once, not only at the next delta. Unregistered before
    // `backend` goes (declared after it).
    struct Registration {
      Cancellation* c;
      ~Registration() {
        if (c != nullptr) c->Unregister();
      }
    } registration{cancellation};
    if (cancellation != nullptr) {
      grpc::ClientContext* raw = backend.get();
      cancellation->Register([raw] { raw->TryCancel(); });
    }
    std::unique_ptr<grpc::ClientReaderInterface<v1::GenerateResponse>> reader =
        replica.stub().Generate(backend.get(), generate);
    v1::GenerateResponse delta;
    if (!reader->Read(&delta)) {
      failed = reader->Finish();
      const bool client_left = (cancellation != nullptr && cancellation->cancelled()) ||
                               (call.grpc_context != nullptr && call.grpc_context->IsCancelled());
      if (failed.error_code() != grpc::StatusCode::UNAVAILABLE || client_left ||
          absl::Now() >= deadline || attempt + 1 == plan.order.size()) {
        return MapLanguageError(failed, 0, replica.name());
      }
      LogWarning("gateway", "language replica unavailable before the first token; failing over",
                 {{"request_id", request_id},
                  {"replica", replica.name()},
                  {"next", plan.order[attempt + 1]->name()},
                  {"error", failed.error_message()}});
      continue;
    }
    generate.Clear();  // the features can be large; no other replica will need them now
    language_->Served(plan.key, replica.name());

    bool finished = false;
    bool client_gone = false;
    int chunks = 0;
    do {
      if (*first_token_ms < 0 && (!delta.text().empty() || delta.token_ids_size() > 0)) {
        *first_token_ms = Ms(absl::Now() - start);
      }
      if (delta.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
        // Held back until the stream's status says the generation really ended well.
        *last = std::move(delta);
        finished = true;
        continue;
      }
      ++chunks;
      v1::ChatChunk chunk;
      chunk.set_text(delta.text());
      chunk.mutable_logprobs()->Swap(delta.mutable_logprobs());
      chunk.set_request_id(request_id);
      if (!sink->OnDelta(chunk) || (cancellation != nullptr && cancellation->cancelled())) {
        client_gone = true;
        backend->TryCancel();
        break;
      }
    } while (reader->Read(&delta));
    const grpc::Status status = reader->Finish();
    if (client_gone) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the client cancelled the request");
    }
    // The caller's cancellation or deadline shows up here as the backend's
    // CANCELLED or DEADLINE_EXCEEDED.
    if (!status.ok()) return MapLanguageError(status, chunks, replica.name());
    if (!finished) {
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          "language service ended the stream without a finish reason");
    }
    return grpc::Status::OK;
  }
  return MapLanguageError(failed, 0, route->replica());
}

namespace {

// Choice i's seed when the request gives one: choice 0 keeps it (so n = 1 and
// choice 0 of n > 1 agree), the others get SplitMix64(seed + i), far apart
// from each other and from the seeds of neighbouring requests.
uint64_t ChoiceSeed(uint64_t seed, int choice) {
  if (choice == 0) return seed;
  uint64_t z = seed + static_cast<uint64_t>(choice) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// One choice's view of the request's sink: tags its chunks with the choice
// index and serializes the choices' calls (the sink is called by one thread
// at a time). Notes the first delta, which means the prompt is prefilled.
class ChoiceSink final : public ChatSink {
 public:
  ChoiceSink(ChatSink* sink, absl::Mutex* mu, int index, bool* started)
      : sink_(sink), mu_(mu), index_(index), started_(started) {}
  bool OnDelta(v1::ChatChunk& chunk) override {
    absl::MutexLock lock(mu_);
    *started_ = true;
    chunk.set_index(index_);
    return sink_->OnDelta(chunk);
  }
  bool OnFinal(v1::ChatChunk&) override { return false; }  // the pipeline sends the finals

 private:
  ChatSink* const sink_;
  absl::Mutex* const mu_;
  const int index_;
  bool* const started_;
};

// Tools offered (and tool_choice not NONE): gathers each choice's text and
// puts the calls parsed from it on the choice's final chunk.
class ToolCallSink final : public ChatSink {
 public:
  ToolCallSink(ChatSink* sink, std::string request_id)
      : sink_(sink), request_id_(std::move(request_id)) {}
  bool OnDelta(v1::ChatChunk& chunk) override {
    text_[chunk.index()] += chunk.text();
    return sink_->OnDelta(chunk);
  }
  bool OnFinal(v1::ChatChunk& chunk) override {
    std::string& text = text_[chunk.index()];
    text += chunk.text();
    for (v1::ToolCall& call :
         ParseToolCallText(text, ToolCallIdPrefix(request_id_, chunk.index())).calls) {
      *chunk.add_tool_calls() = std::move(call);
    }
    return sink_->OnFinal(chunk);
  }

 private:
  ChatSink* const sink_;
  const std::string request_id_;
  std::map<int, std::string> text_;
};

}  // namespace

grpc::Status ChatPipeline::RelayChoices(const ChatCall& call, absl::Time deadline,
                                        absl::Time start, int n, v1::GenerateRequest generate,
                                        const std::string& request_id,
                                        const std::string& route_key, ChatSink* sink,
                                        std::vector<v1::GenerateResponse>* lasts,
                                        double* first_token_ms, v1::LanguageRoute* route) const {
  struct Choice {
    Cancellation cancellation;  // raised by the request's, or by a sibling that failed
    v1::GenerateResponse last;
    double first_token_ms = -1;
    v1::LanguageRoute route;
    grpc::Status status;
    bool started = false;  // guarded by mu
    bool done = false;     // guarded by mu
  };
  std::vector<std::unique_ptr<Choice>> choices;
  for (int i = 0; i < n; ++i) choices.push_back(std::make_unique<Choice>());
  auto cancel_all = [&choices] {
    for (auto& c : choices) c->cancellation.Cancel();
  };
  // The request's cancellation reaches every choice. Unregistered before
  // `choices` goes (declared after it).
  struct Registration {
    Cancellation* c;
    ~Registration() {
      if (c != nullptr) c->Unregister();
    }
  } registration{call.cancellation};
  if (call.cancellation != nullptr) call.cancellation->Register(cancel_all);

  absl::Mutex mu;
  auto run = [&](int i, v1::GenerateRequest request) {
    Choice& c = *choices[i];
    ChatCall choice_call = call;
    choice_call.cancellation = &c.cancellation;
    ChoiceSink choice_sink(sink, &mu, i, &c.started);
    grpc::Status status = Relay(choice_call, deadline, start, std::move(request), request_id,
                                route_key, &choice_sink, &c.last, &c.first_token_ms, &c.route);
    if (!status.ok()) cancel_all();  // one choice failing fails the request
    absl::MutexLock lock(&mu);
    c.status = std::move(status);
    c.done = true;
  };
  auto request_for = [&generate](int i) {
    v1::GenerateRequest request = generate;
    v1::SamplingParams* sampling = request.mutable_params()->mutable_sampling();
    if (sampling->has_seed()) sampling->set_seed(ChoiceSeed(sampling->seed(), i));
    return request;
  };
  std::vector<std::thread> threads;
  threads.emplace_back(run, 0, request_for(0));
  bool first_failed = false;
  {
    // The others start once choice 0's prompt is prefilled (its first token),
    // so they find it in the replica's prefix cache instead of prefilling it
    // n times side by side.
    absl::MutexLock lock(&mu);
    Choice* first = choices[0].get();
    mu.Await(absl::Condition(
        +[](Choice* c) { return c->started || c->done; }, first));
    first_failed = first->done && !first->status.ok();
  }
  for (int i = 1; i < n && !first_failed; ++i) threads.emplace_back(run, i, request_for(i));
  generate.Clear();
  for (std::thread& t : threads) t.join();

  // The first real failure (a sibling's CANCELLED follows it).
  grpc::Status failed;
  for (auto& c : choices) {
    if (c->status.ok()) continue;
    if (failed.ok() || (failed.error_code() == grpc::StatusCode::CANCELLED &&
                        c->status.error_code() != grpc::StatusCode::CANCELLED)) {
      failed = c->status;
    }
  }
  if (!failed.ok()) return failed;
  *first_token_ms = choices[0]->first_token_ms;
  for (auto& c : choices) {
    if (c->first_token_ms >= 0 && (*first_token_ms < 0 || c->first_token_ms < *first_token_ms)) {
      *first_token_ms = c->first_token_ms;
    }
  }
  *route = choices[0]->route;
  for (auto& c : choices) lasts->push_back(std::move(c->last));
  return grpc::Status::OK;
}

// The final chunks (one per choice): text left, usage, timings, per-image
// results on the last; metrics and the access-log record. With several
// choices, usage counts the prompt once and sums the completions.
grpc::Status ChatPipeline::Finish(std::vector<v1::GenerateResponse>& lasts, absl::Time start,
                                  absl::Time admitted, double vision_ms, double first_token_ms,
                                  std::vector<v1::ImageResult>& images,
                                  const v1::LanguageRoute& route, const std::string& request_id,
                                  ChatSink* sink, Record* record) const {
  GatewayMetrics& metrics = Metrics();
  const v1::GenerateResponse& first = lasts.front();
  const v1::LanguageTimings& lt = first.timings();
  v1::ChatTimings timings;
  timings.set_queue_ms(Ms(admitted - start) + lt.queue_ms());
  timings.set_vision_ms(vision_ms);
  timings.set_projector_ms(lt.projector_ms());
  timings.set_prefill_ms(lt.prefill_ms());
  if (first_token_ms < 0 && !first.text().empty()) first_token_ms = Ms(absl::Now() - start);
  timings.set_first_token_ms(first_token_ms < 0 ? 0 : first_token_ms);
  double decode_ms = 0;
  for (const v1::GenerateResponse& last : lasts) {
    decode_ms = std::max(decode_ms, last.timings().decode_ms());
  }
  timings.set_decode_ms(decode_ms);
  timings.set_total_ms(Ms(absl::Now() - start));
  if (first_token_ms >= 0) metrics.first_token_seconds.Observe(first_token_ms / 1000);

  v1::Usage usage = first.usage();
  for (size_t i = 1; i < lasts.size(); ++i) {
    usage.set_completion_tokens(usage.completion_tokens() + lasts[i].usage().completion_tokens());
  }
  usage.set_total_tokens(usage.prompt_tokens() + usage.completion_tokens());
  record->first_token_ms = timings.first_token_ms();
  record->prompt_tokens = usage.prompt_tokens();
  record->completion_tokens = usage.completion_tokens();
  metrics.tokens.Add({{"kind", "prompt"}}).Increment(usage.prompt_tokens());
  metrics.tokens.Add({{"kind", "image"}}).Increment(usage.image_tokens());
  metrics.tokens.Add({{"kind", "completion"}}).Increment(usage.completion_tokens());

  for (size_t i = 0; i < lasts.size(); ++i) {
    v1::GenerateResponse& last = lasts[i];
    v1::ChatChunk chunk;
    chunk.set_index(static_cast<int32_t>(i));
    chunk.set_text(last.text());
    chunk.mutable_logprobs()->Swap(last.mutable_logprobs());
    chunk.set_finish_reason(last.finish_reason());
    chunk.set_request_id(request_id);
    if (i + 1 == lasts.size()) {
      *chunk.mutable_usage() = usage;
      if (lasts.size() > 1) {
        for (const v1::GenerateResponse& l : lasts) *chunk.add_choice_usage() = l.usage();
      }
      *chunk.mutable_timings() = timings;
      for (v1::ImageResult& image : images) *chunk.add_images() = std::move(image);
      *chunk.mutable_language() = route;
    }
    if (!sink->OnFinal(chunk)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the client cancelled the request");
    }
  }
  return grpc::Status::OK;
}

// admit -> encode the images -> build the language request -> relay -> account.
grpc::Status ChatPipeline::Handle(const ChatCall& call, const v1::ChatRequest& request,
                                  ChatSink* sink, Record* record) const {
  const absl::Time start = absl::Now();
  record->request_id = request.request_id().empty() ? NewRequestId() : request.request_id();
  const std::string& request_id = record->request_id;
  const absl::Time deadline = Deadline(call, start);
  absl::StatusOr<Admission::Permit> permit = Admit(call, request, deadline);
  if (!permit.ok()) return ToGrpcStatus(permit.status());
  const absl::Time admitted = absl::Now();
  Metrics().queue_seconds.Observe(absl::ToDoubleSeconds(admitted - start));

  std::vector<ImageJob> jobs;
  std::vector<v1::ImageResult> images;
  double vision_ms = 0;
  if (grpc::Status s =
          EncodeImages(call, request, deadline, request_id, &jobs, &images, &vision_ms, record);
      !s.ok()) {
    return s;
  }
  // A front end's client that left during admission or the image phase never
  // starts a generation.
  if (call.cancellation != nullptr && call.cancellation->cancelled()) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "the client cancelled the request");
  }
  std::vector<std::string> image_keys;
  for (const ImageJob& job : jobs) image_keys.push_back(job.key);
  const std::string route_key = ConversationRouteKey(request, image_keys);
  ToolCallSink tool_sink(sink, request_id);
  if (request.tools_size() > 0 && request.tool_choice().mode() != v1::TOOL_CHOICE_NONE) {
    sink = &tool_sink;
  }
  std::vector<v1::GenerateResponse> lasts;
  double first_token_ms = -1;
  const int n = std::max(1, request.n());
  if (n == 1) {
    lasts.emplace_back();
    if (grpc::Status s = Relay(call, deadline, start,
                               BuildGenerateRequest(request, jobs, request_id), request_id,
                               route_key, sink, &lasts[0], &first_token_ms, &record->language);
        !s.ok()) {
      return s;
    }
  } else if (grpc::Status s = RelayChoices(call, deadline, start, n,
                                           BuildGenerateRequest(request, jobs, request_id),
                                           request_id, route_key, sink, &lasts, &first_token_ms,
                                           &record->language);
             !s.ok()) {
    return s;
  }
  return Finish(lasts, start, admitted, vision_ms, first_token_ms, images, record->language,
                request_id, sink, record);
}

}  // namespace vlm::gateway
