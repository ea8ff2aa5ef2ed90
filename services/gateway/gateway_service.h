// The gRPC front end vlm.v1.VisionLanguage: translates Chat / ChatStream to
// the gateway's one request pipeline (chat_pipeline.h), which validates,
// admits, encodes the images in parallel on the vision replicas and streams
// the language service's completion back with usage, timings and per-image
// cache results. The caller's deadline and cancellation reach both backends.
//
// A caller that goes away (cancels, its deadline passes, or its connection is
// closed or reset) is noticed by gRPC itself: the backend calls are made with
// ClientContext::FromServerContext, whose cancellation propagation cancels
// the vision and language calls as soon as the server call ends, so the
// language service frees the sequence at once; a request still queued for
// admission polls ServerContext::IsCancelled and leaves the queue; a stream
// write that fails ends the request too. lifecycle_test checks it with
// ChatStream clients that die with a TCP reset.
// When API keys are configured, calls need `authorization: Bearer KEY`
// metadata (UNAUTHENTICATED otherwise); health and reflection stay open.
//
// Thread-safety: handlers run concurrently; the pipeline and the keys are
// shared and thread-safe.
#ifndef VLM_SERVICES_GATEWAY_GATEWAY_SERVICE_H_
#define VLM_SERVICES_GATEWAY_GATEWAY_SERVICE_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>
#include <grpcpp/support/sync_stream.h>

#include <memory>
#include <string>

#include "common/readiness.h"
#include "services/gateway/admission.h"
#include "services/gateway/api_keys.h"
#include "services/gateway/chat_pipeline.h"
#include "services/gateway/router.h"
#include "vlm/v1/gateway.grpc.pb.h"
#include "vlm/v1/language.grpc.pb.h"

namespace vlm::gateway {

class GatewayService final : public v1::VisionLanguage::Service {
 public:
  static constexpr char kServiceName[] = "vlm.v1.VisionLanguage";

  // Serves through `pipeline` (not owned; shared with the HTTP front end).
  // `api_keys` may be null (no authentication); not owned.
  explicit GatewayService(const ChatPipeline* pipeline, const ApiKeys* api_keys = nullptr);
  // Owns a pipeline of its own (a gRPC-only gateway).
  GatewayService(GatewayOptions options, const Readiness* readiness, Admission* admission,
                 const VisionRouter* router, const LanguageRouter* language);

  grpc::Status Chat(grpc::ServerContext* context, const v1::ChatRequest* request,
                    v1::ChatResponse* response) override;
  grpc::Status ChatStream(grpc::ServerContext* context, const v1::ChatRequest* request,
                          grpc::ServerWriter<v1::ChatChunk>* writer) override;

  // Gauges vlm_gateway_admission_{running,queued}, for Admission's observer.
  static Admission::Observer AdmissionGauges() { return ChatPipeline::AdmissionGauges(); }

 private:
  grpc::Status Authenticate(const grpc::ServerContext* context) const;

  std::unique_ptr<ChatPipeline> owned_pipeline_;
  const ChatPipeline* const pipeline_;
  const ApiKeys* const api_keys_;
};

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_GATEWAY_SERVICE_H_
