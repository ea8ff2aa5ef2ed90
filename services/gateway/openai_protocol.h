// The OpenAI chat-completions wire format <-> the gateway's ChatRequest and
// ChatChunk: request parsing (with errors naming the offending field, as
// OpenAI's `param`), and the JSON of chat.completion, chat.completion.chunk,
// usage, logprobs and error objects, in the shapes of OpenAI's API reference.
//
// Extension fields (ignored by OpenAI clients): request `top_k`, `min_p`,
// `repetition_penalty`, `ignore_eos`; response `x_vlm` with the request id,
// timings (ms), image tokens and per-image results (cache level, grid, replica).
//
// Thread-safety: free functions; ChunkFormatter is used by one thread.
#ifndef VLM_SERVICES_GATEWAY_OPENAI_PROTOCOL_H_
#define VLM_SERVICES_GATEWAY_OPENAI_PROTOCOL_H_

#include <grpcpp/support/status.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "nlohmann/json.hpp"
#include "services/gateway/tool_calls.h"
#include "vlm/v1/gateway.pb.h"

namespace vlm::gateway {

// An error as the HTTP front end reports it: {"error": {"message", "type",
// "param", "code"}} with HttpStatusForCode(code) (http_status.h).
struct ApiError {
  grpc::StatusCode code = grpc::StatusCode::INVALID_ARGUMENT;
  std::string message;
  std::string param;       // e.g. "temperature", "messages[0].content[1].image_url.url"; "" = null
  std::string error_code;  // OpenAI's machine-readable "code" ("" = null)
};

// A pipeline (or backend) status as an ApiError. Validation messages name
// proto fields ("params.sampling.top_p is 1.5; ..."): they are renamed to the
// OpenAI parameter ("top_p is 1.5; ...") and that name becomes `param`. With
// `request`, an error about "image N" points at that image's URL
// ("messages[i].content[j].image_url.url").
ApiError ApiErrorFromStatus(const grpc::Status& status, const v1::ChatRequest* request = nullptr);

// {"error": {...}} as JSON text.
std::string ErrorJson(const ApiError& error);

struct ParseOptions {
  std::string served_model_name;     // a request naming another model gets 404 model_not_found
  bool allow_remote_images = false;  // http(s) image URLs; refused (400) when false
  // image_url.detail as the image's max_pixels: "low" is a small fixed budget
  // (512x512), "high" asks for as much as the vision service allows (it lowers
  // the request to its --max_pixels_limit); "auto"/absent leave the vision
  // service's --default_max_pixels.
  int64_t detail_low_max_pixels = 512 * 512;
  int64_t detail_high_max_pixels = int64_t{1} << 40;
};

// An http(s) image URL left for the front end to fetch into
// request.messages(message).content(part).image().data.
struct RemoteImage {
  int message = 0;
  int part = 0;
  std::string url;
  std::string param;  // where it was, for errors
};

struct OpenAiChatRequest {
  v1::ChatRequest request;
  std::string model;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool logprobs = false;
  // Tools offered with tool_choice other than none: the answer's
  // <tool_call> blocks become message.tool_calls (ChunkFormatter).
  bool tool_calls = false;
  std::vector<RemoteImage> remote_images;
  // `n` goes to request.n (0 when absent); its upper bound is the pipeline's.
};

// Parses a POST /v1/chat/completions body. Fields whose value is null count
// as absent; a body nested deeper than 32 levels is refused before parsing. Returns the error (400 naming `param`; 404 for another model) or
// nullopt with *out filled. Ranges the gateway checks for both front ends
// (ValidateChatRequest) are left to it.
std::optional<ApiError> ParseChatCompletionRequest(std::string_view body,
                                                   const ParseOptions& options,
                                                   OpenAiChatRequest* out);

// "image/png" etc. from the first bytes, or "" if not JPEG, PNG or WebP (what
// the vision service decodes).
std::string SniffImageType(std::string_view bytes);

// Formats one completion's JSON: the same id, created time and model in every
// object.
class ChunkFormatter {
 public:
  ChunkFormatter(std::string id, int64_t created, std::string model, bool logprobs,
                 bool include_usage);

  const std::string& id() const { return id_; }

  // Tool calls (OpenAiChatRequest::tool_calls): the model writes each call as
  // <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> (Qwen3's
  // format). Text before the first block is the message content; the blocks
  // become message.tool_calls (id "call_<completion>_<i>", function.name,
  // function.arguments as a JSON string) and finish_reason "tool_calls".
  // Streamed: content deltas go out as they come, except text that may be
  // the start of a block; once a block starts the rest is held and the calls
  // are sent at the end as OpenAI streams them (a delta naming each call with
  // empty arguments, then one with its arguments). Text whose blocks do not
  // parse as calls stays content.
  void set_tool_calls(bool on) { tool_calls_ = on; }

  // chat.completion.chunk objects (JSON text, without SSE framing), in order:
  // Each chunk names its choice (ChatChunk.index; n > 1); a choice starts
  // with its role chunk.
  std::string RoleChunk(int index = 0) const;                // delta {role, content ""}
  std::string DeltaChunk(const v1::ChatChunk& delta) const;  // delta {content} (+ logprobs)
  // For a choice's final ChatChunk: its own text delta (if any), the chunk
  // with finish_reason; for the request's last one (the one with usage) also
  // x_vlm (with n > 1, each choice's usage as x_vlm.choice_usage) and then
  // the usage chunk (choices []) when include_usage.
  std::vector<std::string> FinalChunks(const v1::ChatChunk& last) const;

  // The chat.completion object of a non-streaming request.
  std::string Completion(const v1::ChatResponse& response) const;

 private:
  nlohmann::json ChunkBase() const;
  nlohmann::json DeltaJson(int index, const nlohmann::json& delta,
                           const google::protobuf::RepeatedPtrField<v1::TokenLogprob>* logprobs,
                           const char* finish_reason) const;
  nlohmann::json ChoiceJson(int index, const std::string& text, v1::FinishReason reason,
                            const google::protobuf::RepeatedPtrField<v1::TokenLogprob>& logprobs)
      const;
  // Text released as content so far from `text` (streaming, tool-call mode).
  std::string ReleaseContent(int index, const std::string& text) const;
  std::string CallIdPrefix(int index) const;  // "call_<completion id>_" (choice 0)

  const std::string id_;
  const int64_t created_;
  const std::string model_;
  const bool logprobs_;
  const bool include_usage_;
  bool tool_calls_ = false;
  // Streaming in tool-call mode (one thread uses a formatter): each choice's
  // text so far and how much of it went out as content.
  struct Stream {
    std::string text;
    size_t released = 0;
  };
  mutable std::map<int, Stream> streams_;
};

// Pieces shared with the non-streaming path; exposed for tests.
nlohmann::json UsageJson(const v1::Usage& usage);
nlohmann::json LogprobsJson(const google::protobuf::RepeatedPtrField<v1::TokenLogprob>& logprobs);
const char* FinishReasonName(v1::FinishReason reason);

// JSON text for the wire: invalid UTF-8 (a lossy token piece) is replaced, never thrown on.
std::string DumpJson(const nlohmann::json& json);

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_OPENAI_PROTOCOL_H_
