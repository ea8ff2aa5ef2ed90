// The public API vlm.v1.VisionLanguage: validates and admits a chat request,
// encodes its images in parallel on the vision replicas, streams the language
// service's completion back, and reports usage, timings and per-image cache
// results. The caller's deadline and cancellation reach both backends.
//
// Thread-safety: handlers run concurrently; the router, admission and the
// language stub are shared and thread-safe. Nothing here is owned except the
// language stub.
#ifndef VLM_SERVICES_GATEWAY_GATEWAY_SERVICE_H_
#define VLM_SERVICES_GATEWAY_GATEWAY_SERVICE_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>
#include <grpcpp/support/sync_stream.h>

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "common/readiness.h"
#include "services/gateway/admission.h"
#include "services/gateway/router.h"
#include "services/gateway/validation.h"
#include "vlm/v1/gateway.grpc.pb.h"
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
};

class GatewayService final : public v1::VisionLanguage::Service {
 public:
  static constexpr char kServiceName[] = "vlm.v1.VisionLanguage";

  GatewayService(GatewayOptions options, const Readiness* readiness, Admission* admission,
                 const VisionRouter* router, std::unique_ptr<v1::Language::StubInterface> language);

  grpc::Status Chat(grpc::ServerContext* context, const v1::ChatRequest* request,
                    v1::ChatResponse* response) override;
  grpc::Status ChatStream(grpc::ServerContext* context, const v1::ChatRequest* request,
                          grpc::ServerWriter<v1::ChatChunk>* writer) override;

  // Gauges vlm_gateway_admission_{running,queued}, for Admission's observer.
  static Admission::Observer AdmissionGauges();

 private:
  struct Record;  // what the access log line reports
  grpc::Status Handle(grpc::ServerContext* context, const v1::ChatRequest& request,
                      grpc::ServerWriter<v1::ChatChunk>* stream, v1::ChatResponse* unary,
                      Record* record);
  grpc::Status Logged(const char* rpc, grpc::ServerContext* context, const v1::ChatRequest& request,
                      grpc::ServerWriter<v1::ChatChunk>* stream, v1::ChatResponse* unary);

  const GatewayOptions options_;
  const Readiness* const readiness_;
  Admission* const admission_;
  const VisionRouter* const router_;
  const std::unique_ptr<v1::Language::StubInterface> language_;
};

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_GATEWAY_SERVICE_H_
