// The gateway's one request pipeline, shared by both front ends (gRPC
// vlm.v1.VisionLanguage and the OpenAI-compatible HTTP API):
//
//   readiness -> validate -> admit -> encode images in parallel (each on its
//   rendezvous replica) -> stream the generation of the language replica the
//   conversation is routed to (language_router.h), failing over to the next
//   one while no token has come yet
//
// Output goes to a ChatSink in order (text deltas, then one final chunk); a
// sink that reports its client gone, or a Cancellation, cancels the backend
// calls, so the language service frees the sequence's slot. Where it acts: a
// request queued for admission leaves the queue (polled every 10 ms); the
// language call is cancelled at once (and never starts once cancelled); the
// vision calls follow only a gRPC caller's own cancellation, so a Cancellation
// raised during the image phase takes effect when that phase ends. Errors come back as
// grpc::Status (the same codes for both front ends; HTTP maps them with
// HttpStatusForCode, http_status.h).
//
// Thread-safety: Run may be called from many threads at once; the routers
// and admission are shared and thread-safe. Nothing here is owned.
#ifndef VLM_SERVICES_GATEWAY_CHAT_PIPELINE_H_
#define VLM_SERVICES_GATEWAY_CHAT_PIPELINE_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/readiness.h"
#include "services/gateway/admission.h"
#include "services/gateway/language_router.h"
#include "services/gateway/router.h"
#include "services/gateway/validation.h"
#include "vlm/v1/gateway.pb.h"
#include "vlm/v1/language.grpc.pb.h"

namespace vlm::gateway {

struct GatewayOptions {
  ValidationLimits limits;
  // Qwen3-VL merges 2x2 patches into one token: an image takes
  // t*h*w / spatial_merge_size^2 tokens (ImageResult.tokens).
  int spatial_merge_size = 2;
  // Applied when the client sets no deadline (InfiniteDuration: none).
  absl::Duration default_deadline = absl::Minutes(5);
  // params.max_tokens when the client leaves it unset (0: leave it to the
  // language service, which then generates up to the context length).
  int default_max_tokens = 0;
  // The most choices one request may ask for (ChatRequest.n); more is
  // INVALID_ARGUMENT.
  int max_n = 8;
};

// Where a request's output goes. Called on the thread that runs the pipeline,
// never concurrently. Returning false means the client is gone: the pipeline
// cancels the generation and returns CANCELLED.
class ChatSink {
 public:
  virtual ~ChatSink() = default;
  // A text delta with its tokens' logprobs (text may be empty when a token
  // completes no UTF-8 character yet). request_id is set.
  virtual bool OnDelta(v1::ChatChunk& chunk) = 0;
  // The last chunk, only after the generation ended well: its own text delta,
  // finish_reason, usage, timings and per-image results.
  //
  // With n > 1 choices (ChatRequest.n) every chunk carries its choice's
  // index; deltas of different choices interleave. Once all choices ended,
  // OnFinal is called for each choice in index order, with its finish_reason
  // (and text/logprobs left); only the last of these (index n-1) carries the
  // request's usage, timings, per-image results and choice_usage.
  virtual bool OnFinal(v1::ChatChunk& chunk) = 0;
};

// Gathers a request's output into one ChatResponse (non-streaming calls).
class CollectingSink final : public ChatSink {
 public:
  explicit CollectingSink(v1::ChatResponse* response) : response_(response) {}
  bool OnDelta(v1::ChatChunk& chunk) override;
  bool OnFinal(v1::ChatChunk& chunk) override;

 private:
  v1::ChatResponse* response_;
};

// A cancellation signal one front end raises from any thread (e.g. an HTTP
// client's connection closed) and the pipeline observes. Thread-safe.
//
// Lifetime contract: the registered callback typically points at an object
// the registering thread owns and destroys right after Unregister (the
// pipeline's grpc::ClientContext). So:
//   - Cancel() runs the callback on the cancelling thread, outside the lock
//     (the callback may call cancelled()), and marks it running meanwhile;
//   - Unregister() returns only once no callback is running, and after it
//     returns the callback never runs again: the registrant may then destroy
//     whatever the callback touches;
//   - Register() after Cancel() runs the callback at once, on the registering
//     thread, before returning (a late registrant is cancelled too).
// The callback must not call Register/Unregister of the same Cancellation
// (Unregister would wait for itself), and must be quick (it runs on whatever
// thread cancels: a connection watcher, an HTTP writer, HttpServer::Stop).
// The Cancellation itself must outlive every Cancel() call on it.
class Cancellation {
 public:
  // Idempotent: the first call marks the cancellation and runs the registered
  // callback (if any); later calls return at once.
  void Cancel();
  bool cancelled() const;

  // While registered, `callback` runs on Cancel() (at once if already
  // cancelled). One at a time: a new registration replaces the previous one
  // (after waiting for it, if it is running).
  void Register(std::function<void()> callback);
  // Removes the callback, waiting for it to return if Cancel() is running it.
  void Unregister();

 private:
  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool running_ ABSL_GUARDED_BY(mu_) = false;  // Cancel() is running callback_
  std::function<void()> callback_ ABSL_GUARDED_BY(mu_);
};

// Who is calling, for deadlines, cancellation and the access log.
struct ChatCall {
  const char* front_end = "grpc";  // access log "rpc" field: Chat, ChatStream, http, http_stream
  // The gRPC caller (may be null): its deadline and cancellation reach both backends.
  const grpc::ServerContextBase* grpc_context = nullptr;
  // A deadline set by the front end (InfiniteFuture: none; the default applies
  // when neither this nor the gRPC context sets one).
  absl::Time deadline = absl::InfiniteFuture();
  Cancellation* cancellation = nullptr;  // may be null; not owned
};

// The cache level's name as the metrics label and the HTTP API's x_vlm show it
// ("miss", "memory", "pixels", "disk"; "unspecified").
const char* CacheLevelName(v1::CacheLevel level);

class ChatPipeline {
 public:
  static constexpr char kServiceName[] = "vlm.v1.VisionLanguage";

  ChatPipeline(GatewayOptions options, const Readiness* readiness, Admission* admission,
               const VisionRouter* router, const LanguageRouter* language);

  // Runs one request to the end (or its first error) and logs one access line.
  // request.request_id is used when set, else a new id is made.
  grpc::Status Run(const ChatCall& call, const v1::ChatRequest& request, ChatSink* sink) const;

  const GatewayOptions& options() const { return options_; }
  const Readiness* readiness() const { return readiness_; }

  // Gauges vlm_gateway_admission_{running,queued}, for Admission's observer.
  static Admission::Observer AdmissionGauges();

 private:
  struct Record;    // what the access log line reports
  struct ImageJob;  // one image's encode
  grpc::Status Handle(const ChatCall& call, const v1::ChatRequest& request, ChatSink* sink,
                      Record* record) const;
  // Handle's steps, in order.
  absl::Time Deadline(const ChatCall& call, absl::Time start) const;
  absl::StatusOr<Admission::Permit> Admit(const ChatCall& call, const v1::ChatRequest& request,
                                          absl::Time deadline) const;
  absl::Status CheckImageCost(const v1::ChatRequest& request, absl::Time deadline) const;
  grpc::Status EncodeImages(const ChatCall& call, const v1::ChatRequest& request,
                            absl::Time deadline, const std::string& request_id,
                            std::vector<ImageJob>* jobs, std::vector<v1::ImageResult>* images,
                            double* vision_ms, Record* record) const;
  v1::GenerateRequest BuildGenerateRequest(const v1::ChatRequest& request,
                                           std::vector<ImageJob>& jobs,
                                           const std::string& request_id) const;
  grpc::Status Relay(const ChatCall& call, absl::Time deadline, absl::Time start,
                     v1::GenerateRequest generate, const std::string& request_id,
                     const std::string& route_key, ChatSink* sink, v1::GenerateResponse* last,
                     double* first_token_ms, v1::LanguageRoute* route) const;
  // n > 1: runs the n choices' relays in parallel (choice 0 first, the others
  // once its prompt is in the prefix cache); `lasts` gets each one's final
  // response.
  grpc::Status RelayChoices(const ChatCall& call, absl::Time deadline, absl::Time start, int n,
                            v1::GenerateRequest generate, const std::string& request_id,
                            const std::string& route_key, ChatSink* sink,
                            std::vector<v1::GenerateResponse>* lasts, double* first_token_ms,
                            v1::LanguageRoute* route) const;
  grpc::Status Finish(std::vector<v1::GenerateResponse>& lasts, absl::Time start, absl::Time admitted,
                      double vision_ms, double first_token_ms, std::vector<v1::ImageResult>& images,
                      const v1::LanguageRoute& route, const std::string& request_id,
                      ChatSink* sink, Record* record) const;

  const GatewayOptions options_;
  const Readiness* const readiness_;
  Admission* const admission_;
  const VisionRouter* const router_;
  const LanguageRouter* const language_;
};

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_CHAT_PIPELINE_H_
