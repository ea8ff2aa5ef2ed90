// vlm.v1.Language: translates between the wire and the serving engine.
//
// Generate validates the request (INVALID_ARGUMENT naming the field), renders
// and tokenizes the conversation, keys its images (SHA-256 of grid + feature
// bytes, for the prefix cache), submits it to the Engine (engine.h) and
// streams one GenerateResponse per sampled token and a last one with finish
// reason, usage (cached_prompt_tokens: prompt tokens reused from the prefix
// cache) and timings. CountTokens renders and counts without generating.
//
// Structured output (params.constraint, tools / tool_choice): the grammar is
// compiled once per distinct text (an LRU of compiled grammars whose token
// mask caches keep warming across requests) before the request reaches the
// engine; every decode step of the sequence then samples only allowed tokens.
//
// Admission (Engine::Submit): at most `max_sequences` sequences run in one
// batch and at most `max_queue` more are admitted; beyond that
// RESOURCE_EXHAUSTED, as for a prompt + max_tokens that cannot fit the KV
// budget (--kv_cache_mb) even alone. A request's deadline is honoured while
// it waits (DEADLINE_EXCEEDED) and while it runs; a cancelled call is dropped
// by the engine at its next iteration and its KV blocks are freed.
//
// Readiness: every RPC answers UNAVAILABLE until Load() has warmed up the
// projector and the caller has marked the service SERVING.
//
// ReplicaInfo reports the checkpoint's fingerprint (common/model_fingerprint.h)
// and the engine's running / waiting sequences, for the gateway's routing.
//
// Wire: both methods take the request as raw bytes and parse it themselves,
// so that a string field holding invalid UTF-8 (which the generated proto3
// parser rejects before any handler runs, as an anonymous INTERNAL error) is
// answered with INVALID_ARGUMENT naming the field.
//
// Metrics (besides the bootstrap's per-RPC ones and the engine's, engine.cc):
// vlm_language_time_to_first_token_seconds, vlm_language_inter_token_latency_seconds,
// vlm_language_prompt_tokens_total, vlm_language_image_tokens_total,
// vlm_language_generated_tokens_total, vlm_language_generations_total{finish_reason},
// vlm_language_prefill_tokens_per_second and vlm_language_decode_tokens_per_second
// (of the last request), vlm_language_stage_seconds{stage=queue|projector|prefill|decode}.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/cpu_features.h"
#include "common/model_config.h"
#include "common/readiness.h"
#include "common/safetensors.h"
#include "services/language/text/chat_template.h"
#include "services/language/model/decoder.h"
#include "services/language/engine/engine.h"
#include "services/language/engine/generation_state.h"
#include "services/language/grammar/grammar_cache.h"
#include "services/language/model/projector.h"
#include "services/language/text/tokenizer.h"
#include "vlm/v1/language.grpc.pb.h"

namespace vlm::language {

inline constexpr char kLanguageServiceName[] = "vlm.v1.Language";

// One struct for the service's configuration, filled from flags by main.
struct LanguageServiceOptions {
  std::string model_dir;
  ComputeDType compute_dtype = ComputeDType::kBFloat16;
  bool eager_load = false;
  int resident_layers = 0;      // 0 = no bound
  int prefetch_layers = 1;
  MatmulPath matmul = MatmulPath::kAuto;             // decoder.h
  WeightDType weight_dtype = WeightDType::kBFloat16;  // decoder.h
  bool int8_prefill_gemm = true;  // DecoderOptions::int8_prefill_gemm
  int int4_int8_layers = kAutoInt4Int8Layers;  // DecoderOptions::int4_int8_layers
  int max_sequences = 8;        // sequences per engine batch (running at once)
  int max_queue = 16;           // generations admitted beyond the running ones
  int64_t max_batch_tokens = 512;  // tokens per forward pass (chunked prefill)
  int64_t kv_cache_mb = 2048;   // paged KV cache budget
  int64_t kv_block_size = 16;   // tokens per KV block
  bool prefix_cache = true;     // reuse KV of identical prefixes (text and images)
  int64_t max_context = 8192;   // prompt + completion tokens per sequence
  absl::Duration warmup_delay;  // artificial, for tests of readiness gating
  // Packed-weight files (DecoderOptions::packed_dir); empty: pack in memory.
  std::string packed_cache_dir;
};

// $VLM_PACKED_CACHE_DIR, else $VLM_CACHE_DIR/packed, else
// $HOME/.cache/vlm/packed (the model cache scripts/setup.sh and
// make_checkpoint.sh use), else /tmp/vlm-cache/packed. ctest sets
// VLM_PACKED_CACHE_DIR to a directory of the build tree for every test, so
// tests neither read nor leave packed files in the user's cache.
std::string DefaultPackedCacheDir();

class LanguageService final : public v1::Language::Service {
 public:
  // `readiness` must outlive the service; the service reports what it is
  // loading as the NOT_SERVING reason but never sets SERVING itself.
  LanguageService(Readiness* readiness, LanguageServiceOptions options);
  ~LanguageService() override;

  // Reads the configs, tokenizer and tensor headers, loads the projector and
  // warms it up (plus options.warmup_delay). Call once, before SetServing.
  absl::Status Load();
  // --pack_only: reads the config and checkpoint headers and builds (or
  // verifies the header of) the packed-weight file in
  // options.packed_cache_dir, then returns; FAILED_PRECONDITION when no file
  // could be written. Touches no layer page beyond the conversion.
  absl::Status PackOnly();

  // The typed entry points (in-process callers; gRPC calls reach the raw
  // handlers installed by the constructor, which parse and then do the same).
  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override;
  grpc::Status CountTokens(grpc::ServerContext* context, const v1::GenerateRequest* request,
                           v1::CountTokensResponse* response) override;
  grpc::Status ReplicaInfo(grpc::ServerContext* context, const v1::ReplicaInfoRequest* request,
                           v1::ReplicaInfoResponse* response) override;

  const LanguageServiceOptions& options() const { return options_; }
  // After Load: the model and the engine, for benchmarks, tests and logs.
  const Decoder* decoder() const { return decoder_.get(); }
  Engine* engine() const { return engine_.get(); }
  const Projector* projector() const { return projector_.get(); }

 private:
  struct Metrics;
  struct Prepared;  // a validated, tokenized request

  // Validation + chat template + tokenization. `with_features` also decodes
  // and checks the image features (Generate); CountTokens needs only grids.
  absl::StatusOr<Prepared> Prepare(const v1::GenerateRequest& request, bool with_features) const;
  absl::Status ResolveParams(const v1::GenerationParams& params, int64_t prompt_tokens,
                             GenerationRequest* out) const;
  // Structured output: the grammar of params.constraint or of a required /
  // named tool call, compiled (or found in the cache) into out->grammar.
  // INVALID_ARGUMENT naming the field for a bad, unsupported or too large
  // schema, and for one whose shortest output cannot fit out->max_tokens.
  absl::Status ResolveConstraint(const v1::GenerateRequest& request, GenerationRequest* out) const;
  using RawStream = grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;
  grpc::Status GenerateRaw(grpc::ServerContext* context, RawStream* stream);
  grpc::Status CountTokensRaw(grpc::ServerContext* context, RawStream* stream);
  // KV blocks for --kv_cache_mb (capped at what admitted sequences can use).
  absl::Status LoadDecoder(bool pack_only = false);
  // config.json and generation_config.json into config_ / generation_config_.
  absl::Status LoadConfigFiles();
  // The KV pool, the runner and the engine, once the decoder and tokenizer are loaded.
  absl::Status StartEngine();
  absl::StatusOr<int64_t> KvBlocks(int64_t block_size, uint64_t per_token) const;
  grpc::Status RunGenerate(grpc::ServerContext* context,
                           std::chrono::steady_clock::time_point arrival,
                           const v1::GenerateRequest& request,
                           const std::function<bool(const v1::GenerateResponse&)>& write);
  grpc::Status RunCountTokens(const v1::GenerateRequest& request, v1::CountTokensResponse* out);

  Readiness* readiness_;
  LanguageServiceOptions options_;
  ModelConfig config_;
  GenerationConfig generation_config_;
  std::shared_ptr<const SafetensorsCheckpoint> checkpoint_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Projector> projector_;
  std::unique_ptr<Decoder> decoder_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<grammar::GrammarCache> grammars_;  // compiled constraints, by text
  Metrics* metrics_;  // process-wide families, never destroyed
  int64_t max_context_ = 0;  // options.max_context capped by the model
  std::string fingerprint_;  // ModelFingerprintOfDir(model_dir), set by Load
};

}  // namespace vlm::language
