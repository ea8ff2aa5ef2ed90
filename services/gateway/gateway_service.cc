#include "services/gateway/gateway_service.h"

#include <string>
#include <utility>

#include "common/grpc_status.h"

namespace vlm::gateway {
namespace {

// ChatStream: each chunk goes out as it comes.
class WriterSink final : public ChatSink {
 public:
  explicit WriterSink(grpc::ServerWriter<v1::ChatChunk>* writer) : writer_(writer) {}
  bool OnDelta(v1::ChatChunk& chunk) override { return writer_->Write(chunk); }
  bool OnFinal(v1::ChatChunk& chunk) override { return writer_->Write(chunk); }

 private:
  grpc::ServerWriter<v1::ChatChunk>* writer_;
};

}  // namespace

GatewayService::GatewayService(const ChatPipeline* pipeline, const ApiKeys* api_keys)
    : pipeline_(pipeline), api_keys_(api_keys) {}

GatewayService::GatewayService(GatewayOptions options, const Readiness* readiness,
                               Admission* admission, const VisionRouter* router,
                               const LanguageRouter* language)
    : owned_pipeline_(std::make_unique<ChatPipeline>(std::move(options), readiness, admission,
                                                     router, language)),
      pipeline_(owned_pipeline_.get()),
      api_keys_(nullptr) {}

grpc::Status GatewayService::Authenticate(const grpc::ServerContext* context) const {
  if (api_keys_ == nullptr) return grpc::Status::OK;
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  const std::string_view value =
      it == metadata.end() ? std::string_view() : std::string_view(it->second.data(), it->second.size());
  return ToGrpcStatus(api_keys_->CheckAuthorization(value));
}

grpc::Status GatewayService::Chat(grpc::ServerContext* context, const v1::ChatRequest* request,
                                  v1::ChatResponse* response) {
  if (grpc::Status s = Authenticate(context); !s.ok()) return s;
  CollectingSink sink(response);
  ChatCall call;
  call.front_end = "Chat";
  call.grpc_context = context;
  return pipeline_->Run(call, *request, &sink);
}

grpc::Status GatewayService::ChatStream(grpc::ServerContext* context,
                                        const v1::ChatRequest* request,
                                        grpc::ServerWriter<v1::ChatChunk>* writer) {
  if (grpc::Status s = Authenticate(context); !s.ok()) return s;
  WriterSink sink(writer);
  ChatCall call;
  call.front_end = "ChatStream";
  call.grpc_context = context;
  return pipeline_->Run(call, *request, &sink);
}

}  // namespace vlm::gateway
