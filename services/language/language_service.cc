#include "services/language/language_service.h"

#include <ATen/ATen.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/method_handler.h>
#include <prometheus/histogram.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/kernels/kernel_path.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/model_fingerprint.h"
#include "common/tensor_codec.h"
#include "common/time_util.h"
#include "nlohmann/json.hpp"
#include "services/language/grammar/tokenizer_vocabulary.h"
#include "services/language/sampling/stop_strings.h"
#include "services/language/text/utf8.h"

namespace vlm::language {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kLog[] = "language";

bool DeadlinePassed(const grpc::ServerContext* context) {
  return std::chrono::system_clock::now() > context->deadline();
}

absl::Status Invalid(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, " ", what));
}

// OpenAI's rule for function names: 1 to 64 of a-z, A-Z, 0-9, '_', '-'
// (they are spliced into the prompt and the tool-call grammar verbatim).
absl::Status ValidateToolName(const std::string& name) {
  if (name.empty() || name.size() > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("must be 1 to 64 characters; got ", name.size()));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') {
      return absl::InvalidArgumentError(
          absl::StrCat("\"", name, "\" may hold only a-z, A-Z, 0-9, '_' and '-'"));
    }
  }
  return absl::OkStatus();
}

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kCancelled:
      return v1::FINISH_REASON_CANCELLED;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

// Path of the first string field of `data` (a serialized `type`) that holds
// invalid UTF-8, e.g. "messages[0].content[1].text"; empty if there is none
// or the bytes stop parsing before one is found.
std::string FindInvalidUtf8Field(absl::string_view data, const google::protobuf::Descriptor* type) {
  using google::protobuf::FieldDescriptor;
  using google::protobuf::internal::WireFormatLite;
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(data.data()),
                                            static_cast<int>(data.size()));
  std::map<int, int> seen;  // field number -> occurrences so far (repeated index)
  while (true) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return "";
    const FieldDescriptor* field = type->FindFieldByNumber(WireFormatLite::GetTagFieldNumber(tag));
    const bool nested = field != nullptr &&
                        WireFormatLite::GetTagWireType(tag) ==
                            WireFormatLite::WIRETYPE_LENGTH_DELIMITED &&
                        (field->type() == FieldDescriptor::TYPE_STRING ||
                         field->type() == FieldDescriptor::TYPE_MESSAGE);
    if (!nested) {
      if (!WireFormatLite::SkipField(&in, tag)) return "";
      continue;
    }
    uint32_t length = 0;
    std::string bytes;
    if (!in.ReadVarint32(&length) || !in.ReadString(&bytes, static_cast<int>(length))) return "";
    std::string name = field->name();
    if (field->is_repeated()) absl::StrAppend(&name, "[", seen[field->number()]++, "]");
    if (field->type() == FieldDescriptor::TYPE_STRING) {
      if (utf8::FindInvalid(bytes) != absl::string_view::npos) return name;
    } else if (std::string inner = FindInvalidUtf8Field(bytes, field->message_type());
               !inner.empty()) {
      return absl::StrCat(name, ".", inner);
    }
  }
}

// Reads the one request message of a raw call and parses it as `T`.
template <typename T>
absl::Status ReadRequest(grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>* stream,
                         T* request) {
  grpc::ByteBuffer buffer;
  if (!stream->Read(&buffer)) return absl::InvalidArgumentError("no request message");
  std::vector<grpc::Slice> slices;
  if (grpc::Status s = buffer.Dump(&slices); !s.ok()) return FromGrpcStatus(s);
  std::string data;
  data.reserve(buffer.Length());
  for (const grpc::Slice& slice : slices) {
    data.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  if (request->ParseFromString(data)) return absl::OkStatus();
  if (std::string field = FindInvalidUtf8Field(data, T::descriptor()); !field.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is not valid UTF-8"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("the request does not parse as ", T::descriptor()->full_name()));
}

template <typename T>
bool WriteMessage(grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>* stream,
                  const T& message) {
  grpc::ByteBuffer buffer;
  bool own = false;
  if (!grpc::SerializationTraits<T>::Serialize(message, &buffer, &own).ok()) return false;
  return stream->Write(buffer);
}

}  // namespace

// ---------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------

struct LanguageService::Metrics {
  prometheus::Histogram* ttft;
  prometheus::Histogram* itl;
  prometheus::Counter* prompt_tokens;
  prometheus::Counter* image_tokens;
  prometheus::Counter* generated_tokens;
  prometheus::Family<prometheus::Counter>* generations;
  prometheus::Gauge* prefill_tps;
  prometheus::Gauge* decode_tps;
  prometheus::Family<prometheus::Histogram>* stages;

  static Metrics* Get() {
    static Metrics* metrics = [] {
      auto* m = new Metrics;
      prometheus::Registry& r = MetricsRegistry();
      m->ttft = &LatencyHistogramFamily("vlm_language_time_to_first_token_seconds",
                                        "Request arrival to the first generated token.")
                     .Add({}, DefaultLatencyBuckets());
      m->itl = &prometheus::BuildHistogram()
                    .Name("vlm_language_inter_token_latency_seconds")
                    .Help("Time between consecutive streamed tokens of one generation.")
                    .Register(r)
                    .Add({}, prometheus::Histogram::BucketBoundaries{
                                 0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1,
                                 0.15, 0.2, 0.3, 0.5, 1, 2, 5});
      m->prompt_tokens = &prometheus::BuildCounter()
                              .Name("vlm_language_prompt_tokens_total")
                              .Help("Prompt tokens prefilled, image tokens included.")
                              .Register(r)
                              .Add({});
      m->image_tokens = &prometheus::BuildCounter()
                             .Name("vlm_language_image_tokens_total")
                             .Help("Image placeholder tokens prefilled.")
                             .Register(r)
                             .Add({});
      m->generated_tokens = &prometheus::BuildCounter()
                                 .Name("vlm_language_generated_tokens_total")
                                 .Help("Completion tokens sampled.")
                                 .Register(r)
                                 .Add({});
      m->generations = &prometheus::BuildCounter()
                            .Name("vlm_language_generations_total")
                            .Help("Generations that ran, by finish reason (stop, length, "
                                  "cancelled, error).")
                            .Register(r);
      m->prefill_tps = &prometheus::BuildGauge()
                            .Name("vlm_language_prefill_tokens_per_second")
                            .Help("Prefill speed of the last generation.")
                            .Register(r)
                            .Add({});
      m->decode_tps = &prometheus::BuildGauge()
                           .Name("vlm_language_decode_tokens_per_second")
                           .Help("Decode speed of the last generation (2 or more tokens).")
                           .Register(r)
                           .Add({});
      m->stages = &LatencyHistogramFamily("vlm_language_stage_seconds",
                                          "Time per generation stage: queue, projector, "
                                          "prefill, decode.");
      return m;
    }();
    return metrics;
  }

  void Stage(const char* stage, double ms) {
    stages->Add({{"stage", stage}}, DefaultLatencyBuckets()).Observe(ms / 1000.0);
  }
};

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------

struct LanguageService::Prepared {
  Prompt prompt;
  std::vector<ImageFeatures> images;
  std::vector<BlockKey> image_keys;  // one per image (with features only)
  int64_t image_tokens = 0;
};

LanguageService::LanguageService(Readiness* readiness, LanguageServiceOptions options)
    : readiness_(readiness), options_(std::move(options)), metrics_(Metrics::Get()) {
  // Methods 0 (Generate) and 1 (CountTokens) in proto order: the request
  // arrives as bytes (see the header); on the wire nothing changes.
  using RawHandler =
      grpc::internal::BidiStreamingHandler<LanguageService, grpc::ByteBuffer, grpc::ByteBuffer>;
  MarkMethodStreamed(0, new RawHandler(
                            [](LanguageService* self, grpc::ServerContext* context,
                               RawStream* stream) { return self->GenerateRaw(context, stream); },
                            this));
  MarkMethodStreamed(1, new RawHandler(
                            [](LanguageService* self, grpc::ServerContext* context,
                               RawStream* stream) { return self->CountTokensRaw(context, stream); },
                            this));
}

LanguageService::~LanguageService() {
  engine_.reset();  // stops the engine thread before the runner and model go
}

// The paged KV cache: --kv_cache_mb split into blocks of --kv_block_size tokens.
absl::StatusOr<int64_t> LanguageService::KvBlocks(int64_t block_size, uint64_t per_token) const {
  const uint64_t budget = static_cast<uint64_t>(std::max<int64_t>(0, options_.kv_cache_mb)) << 20;
  int64_t num_blocks = static_cast<int64_t>(budget / (per_token * block_size));
  // Never more than every admitted sequence could hold at once at full
  // context. The storage is only reserved at startup (pages are committed as
  // blocks are first used), but blocks past that bound would only ever hold
  // prefix-cache entries, growing the process without serving a request.
  const int64_t most = (max_context_ + block_size - 1) / block_size *
                       (std::max(1, options_.max_sequences) + std::max(0, options_.max_queue));
  if (num_blocks > most) {
    LogInfo(kLog, "KV cache capped to what admitted sequences can use",
            {{"kv_cache_mb", static_cast<long long>(options_.kv_cache_mb)},
             {"blocks", static_cast<long long>(most)},
             {"rule", "(max_sequences + max_queue) x max_context tokens"}});
    num_blocks = most;
  }
  if (num_blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_cache_mb=", options_.kv_cache_mb, " holds no KV block of ", block_size,
        " tokens (", per_token * block_size, " bytes each)"));
  }
  return num_blocks;
}

// The checkpoint's mapping and the decoder over it (layers load lazily).
std::string DefaultPackedCacheDir() {
  if (const char* packed = std::getenv("VLM_PACKED_CACHE_DIR");
      packed != nullptr && *packed != '\0') {
    return packed;
  }
  if (const char* cache = std::getenv("VLM_CACHE_DIR"); cache != nullptr && *cache != '\0') {
    return absl::StrCat(cache, "/packed");
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    return absl::StrCat(home, "/.cache/vlm/packed");
  }
  return "/tmp/vlm-cache/packed";
}

absl::Status LanguageService::LoadDecoder(bool pack_only) {
  const std::string& dir = options_.model_dir;
  LoadPhaseTimer timer("language_decoder");
  absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> checkpoint =
      SafetensorsCheckpoint::Open(dir);
  if (!checkpoint.ok()) return checkpoint.status();
  checkpoint_ = std::shared_ptr<const SafetensorsCheckpoint>(std::move(*checkpoint));
  DecoderOptions decoder_options;
  decoder_options.compute_dtype = options_.compute_dtype;
  decoder_options.matmul = options_.matmul;
  decoder_options.weight_dtype = options_.weight_dtype;
  decoder_options.int8_prefill_gemm = options_.int8_prefill_gemm;
  decoder_options.int4_int8_layers = options_.int4_int8_layers;
  decoder_options.touch_embedding = options_.eager_load;
  decoder_options.layers.eager_load = options_.eager_load;
  decoder_options.layers.resident_layers = options_.resident_layers;
  decoder_options.layers.prefetch_layers = pack_only ? 0 : options_.prefetch_layers;
  decoder_options.packed_dir = options_.packed_cache_dir;
  // Converted layers come in the background right after the load (from the
  // packed file, or packed in memory), off the first request's path.
  decoder_options.layers.background_materialize = !pack_only && !options_.eager_load;
  absl::StatusOr<std::unique_ptr<Decoder>> decoder =
      Decoder::Load(checkpoint_, config_, decoder_options);
  if (!decoder.ok()) return decoder.status();
  decoder_ = *std::move(decoder);
  LogInfo(kLog, "decoder loaded", {{"summary", decoder_->load_summary()}});
  return absl::OkStatus();
}

absl::Status LanguageService::PackOnly() {
  const std::string& dir = options_.model_dir;
  if (dir.empty()) return absl::InvalidArgumentError("--model_dir is required");
  if (options_.packed_cache_dir.empty()) {
    return absl::InvalidArgumentError("--pack_only needs a --packed_cache_dir");
  }
  if (auto k = kernels::ChooseKernelPathAtStartup(kLog); !k.ok()) return k.status();
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  if (!config.ok()) return config.status();
  config_ = *std::move(config);
  if (absl::Status s = LoadDecoder(/*pack_only=*/true); !s.ok()) return s;
  if (const auto& file = decoder_->layers().packed_file();
      file != nullptr && decoder_->packed_file_outcome().state == "mapped") {
    // An existing file: check every section (a full read, affordable here,
    // not at a serving start) and rebuild it if one fails.
    for (int l = 0; l < decoder_->layers().num_layers(); ++l) {
      if (absl::Status v = file->VerifyGroup(l); !v.ok()) {
        LogWarning(kLog, "packed weights rejected, rebuilding",
                   {{"path", file->path()}, {"reason", "section_checksum"},
                    {"error", v.ToString()}});
        CountPackedFileRejection("section_checksum");
        file->Discard();
        decoder_.reset();
        if (absl::Status s = LoadDecoder(/*pack_only=*/true); !s.ok()) return s;
        break;
      }
    }
  }
  const PackedFileOutcome& outcome = decoder_->packed_file_outcome();
  if (outcome.state != "built" && outcome.state != "mapped") {
    return absl::FailedPreconditionError(absl::StrCat(
        "no packed-weight file for projections ", ProjectionFormName(decoder_->projection_form()),
        outcome.reason.empty() ? "" : absl::StrCat(": ", outcome.reason)));
  }
  LogInfo(kLog, "packed-weight file ready", {{"path", outcome.path}, {"state", outcome.state}});
  return absl::OkStatus();
}

absl::Status LanguageService::LoadConfigFiles() {
  LoadPhaseTimer timer("language_config");
  const std::string& dir = options_.model_dir;
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  if (!config.ok()) return config.status();
  config_ = *std::move(config);
  absl::StatusOr<GenerationConfig> generation = LoadGenerationConfig(dir);
  if (generation.ok()) {
    generation_config_ = *std::move(generation);
  } else if (absl::IsNotFound(generation.status())) {
    LogWarning(kLog, "no generation_config.json; greedy defaults, EOS from the tokenizer");
  } else {
    return generation.status();
  }
  if (!config_.tie_warning.empty()) LogWarning(kLog, config_.tie_warning);
  return absl::OkStatus();
}

absl::Status LanguageService::Load() {
  const std::string& dir = options_.model_dir;
  if (dir.empty()) return absl::InvalidArgumentError("--model_dir is required");
  // The GEMM path (AMX only where a start-up check verified it), before packing.
  if (auto k = kernels::ChooseKernelPathAtStartup(kLog); !k.ok()) return k.status();
  readiness_->SetNotServing(kLanguageServiceName, "warming up: reading the model files");

  // The tokenizer (the slowest file to parse) loads beside the weights.
  // The grammar engine's view of the vocabulary is built from it there too,
  // off the path to SERVING.
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      absl::UnknownError("tokenizer not loaded");
  absl::StatusOr<std::shared_ptr<const grammar::Vocabulary>> vocab =
      absl::UnknownError("grammar vocabulary not built");
  std::thread tokenizer_thread([&] {
    {
      LoadPhaseTimer timer("language_tokenizer");
      tokenizer = Tokenizer::Load(dir);
    }
    if (!tokenizer.ok()) return;
    LoadPhaseTimer timer("language_grammar_vocabulary");
    vocab = grammar::VocabularyFromTokenizer(**tokenizer);
  });
  struct Joiner {
    std::thread& t;
    ~Joiner() {
      if (t.joinable()) t.join();
    }
  } joiner{tokenizer_thread};

  if (absl::Status s = LoadConfigFiles(); !s.ok()) return s;
  readiness_->SetNotServing(kLanguageServiceName,
                            "warming up: mapping the decoder (a first start packs its weights)");
  if (absl::Status s = LoadDecoder(); !s.ok()) return s;
  {
    absl::StatusOr<std::string> fingerprint = ModelFingerprintOfDir(dir);
    if (!fingerprint.ok()) return fingerprint.status();
    fingerprint_ = *std::move(fingerprint);
    LogInfo(kLog, "model fingerprint", {{"fingerprint", fingerprint_}});
  }

  readiness_->SetNotServing(kLanguageServiceName, "projector warming up");
  {
    LoadPhaseTimer timer("language_projector");
    ProjectorOptions projector_options;
    projector_options.compute_dtype = options_.compute_dtype;
    absl::StatusOr<std::unique_ptr<Projector>> projector =
        Projector::Load(*checkpoint_, config_, projector_options);
    if (!projector.ok()) return projector.status();
    projector_ = *std::move(projector);
    LogInfo(kLog, "projector loaded", {{"summary", projector_->load_summary()}});
  }
  {
    LoadPhaseTimer timer("language_warmup");
    if (absl::Status s = projector_->WarmUp(); !s.ok()) return s;
    if (options_.warmup_delay > absl::ZeroDuration()) {
      LogInfo(kLog, "artificial warm-up delay", {{"seconds", options_.warmup_delay}});
      absl::SleepFor(options_.warmup_delay);
    }
  }

  tokenizer_thread.join();
  if (!tokenizer.ok()) return tokenizer.status();
  tokenizer_ = *std::move(tokenizer);
  if (!vocab.ok()) return vocab.status();
  constexpr size_t kGrammarCacheEntries = 64;
  grammars_ = std::make_unique<grammar::GrammarCache>(*std::move(vocab), kGrammarCacheEntries);
  return StartEngine();
}

absl::Status LanguageService::StartEngine() {
  GenerationStateConfig generator_config;
  for (int64_t id : generation_config_.eos_token_ids) {
    generator_config.eos_ids.push_back(static_cast<int32_t>(id));
  }
  if (generator_config.eos_ids.empty()) {
    const SpecialTokenIds& special = tokenizer_->special_ids();
    for (int32_t id : {special.im_end, special.endoftext}) {
      if (id >= 0) generator_config.eos_ids.push_back(id);
    }
  }
  max_context_ = std::min<int64_t>(options_.max_context, config_.text.max_position_embeddings);

  const int64_t block_size = std::max<int64_t>(1, options_.kv_block_size);
  const uint64_t per_token = decoder_->kv_bytes_per_token();
  absl::StatusOr<int64_t> blocks = KvBlocks(block_size, per_token);
  if (!blocks.ok()) return blocks.status();
  const int64_t num_blocks = *blocks;
  {
    LoadPhaseTimer timer("language_kv_cache");
    absl::StatusOr<std::unique_ptr<DecoderRunner>> runner =
        DecoderRunner::Create(projector_.get(), decoder_.get(), num_blocks, block_size);
    if (!runner.ok()) return runner.status();
    runner_ = *std::move(runner);
  }
  EngineOptions engine_options;
  engine_options.max_sequences = options_.max_sequences;
  engine_options.max_queue = options_.max_queue;
  engine_options.max_batch_tokens = std::max<int64_t>(1, options_.max_batch_tokens);
  engine_options.num_blocks = num_blocks;
  engine_options.block_size = block_size;
  engine_options.prefix_cache = options_.prefix_cache;
  engine_options.kv_budget_bytes = static_cast<uint64_t>(num_blocks) * block_size * per_token;
  engine_options.eos_ids = generator_config.eos_ids;
  engine_ = std::make_unique<Engine>(runner_.get(), tokenizer_.get(), config_, engine_options);
  LogInfo(kLog, "ready to generate",
          {{"max_context", static_cast<long long>(max_context_)},
           {"max_sequences", options_.max_sequences},
           {"max_queue", options_.max_queue},
           {"max_batch_tokens", static_cast<long long>(engine_options.max_batch_tokens)},
           {"kv_cache_mb", static_cast<long long>(options_.kv_cache_mb)},
           {"kv_blocks", static_cast<long long>(num_blocks)},
           {"kv_block_size", static_cast<long long>(block_size)},
           {"kv_tokens", static_cast<long long>(num_blocks * block_size)},
           {"kv_bytes_per_token", static_cast<long long>(per_token)},
           {"prefix_cache", options_.prefix_cache ? "on" : "off"},
           {"eos_ids", absl::StrJoin(generator_config.eos_ids, ",")}});
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Request translation
// ---------------------------------------------------------------------------

absl::StatusOr<LanguageService::Prepared> LanguageService::Prepare(
    const v1::GenerateRequest& request, bool with_features) const {
  if (request.messages_size() == 0) return Invalid("messages", "is empty: nothing to answer");
  const int64_t merge = config_.vision.spatial_merge_size;
  const size_t levels = config_.vision.deepstack_visual_indexes.size();
  Prepared out;
  std::vector<ChatMessage> messages;
  for (int i = 0; i < request.messages_size(); ++i) {
    const v1::LanguageMessage& m = request.messages(i);
    const std::string field = absl::StrCat("messages[", i, "]");
    if (m.role() != "system" && m.role() != "user" && m.role() != "assistant" &&
        m.role() != "tool") {
      return Invalid(field + ".role", absl::StrCat("is \"", m.role(),
                                                   "\"; expected system, user, assistant or tool"));
    }
    ChatMessage message;
    message.role = m.role();
    if (m.tool_calls_size() > 0 && m.role() != "assistant") {
      return Invalid(field + ".tool_calls", "are allowed on assistant messages only");
    }
    for (int c = 0; c < m.tool_calls_size(); ++c) {
      const v1::ToolCall& call = m.tool_calls(c);
      const std::string where = absl::StrCat(field, ".tool_calls[", c, "]");
      if (call.name().empty()) return Invalid(where + ".name", "is empty");
      if (nlohmann::json::parse(call.arguments(), nullptr, false).is_discarded()) {
        return Invalid(where + ".arguments", "is not JSON text");
      }
      message.tool_calls.push_back(ChatToolCall{call.name(), call.arguments()});
    }
    for (int j = 0; j < m.content_size(); ++j) {
      const v1::LanguageContentPart& part = m.content(j);
      const std::string part_field = absl::StrCat(field, ".content[", j, "]");
      if (part.has_image()) {
        const v1::VisionFeatures& image = part.image();
        const ImageGrid grid{image.grid().t(), image.grid().h(), image.grid().w()};
        absl::StatusOr<int64_t> tokens = ImageTokenCount(grid, merge);
        if (!tokens.ok()) return Invalid(part_field + ".image.grid", std::string(tokens.status().message()));
        out.image_tokens += *tokens;
        if (with_features) {
          const std::string what = part_field + ".image";
          const int64_t rows = grid.t * grid.h * grid.w;
          const DecodeExpectation expect{"", 2, {rows, config_.vision.hidden_size}};
          auto decode = [&](const v1::Tensor& t,
                            const std::string& name) -> absl::StatusOr<at::Tensor> {
            if (t.dtype() != v1::DTYPE_BF16 && t.dtype() != v1::DTYPE_F32) {
              return Invalid(name + ".dtype", absl::StrCat("is ", WireDTypeName(t.dtype()),
                                                           "; expected BF16 or F32"));
            }
            DecodeExpectation e = expect;
            e.what = name;
            absl::StatusOr<at::Tensor> tensor = DecodeTensor(t, e);
            if (!tensor.ok()) {
              return Invalid(name, absl::StrCat("does not match grid (", grid.t, ", ", grid.h,
                                                ", ", grid.w, ") x vision hidden ",
                                                config_.vision.hidden_size, ": ",
                                                tensor.status().message()));
            }
            return tensor;
          };
          ImageFeatures features;
          features.grid = {grid.t, grid.h, grid.w};
          absl::StatusOr<at::Tensor> last = decode(image.last_hidden(), what + ".last_hidden");
          if (!last.ok()) return last.status();
          features.last_hidden = *std::move(last);
          if (static_cast<size_t>(image.deepstack_size()) != levels) {
            return Invalid(what + ".deepstack", absl::StrCat("has ", image.deepstack_size(),
                                                             " tensors; the model needs ", levels));
          }
          for (int k = 0; k < image.deepstack_size(); ++k) {
            absl::StatusOr<at::Tensor> d =
                decode(image.deepstack(k), absl::StrCat(what, ".deepstack[", k, "]"));
            if (!d.ok()) return d.status();
            features.deepstack.push_back(*std::move(d));
          }
          // The prefix-cache key of the image: its grid and the feature bytes
          // as received (never only a client-supplied hash).
          out.image_keys.push_back(ImageKey(features));
          out.images.push_back(std::move(features));
        }
        message.content.push_back(ChatPart::Image(grid));
      } else if (part.has_text()) {
        if (absl::Status s = utf8::Validate(part.text(), part_field + ".text"); !s.ok()) return s;
        message.content.push_back(ChatPart::Text(part.text()));
      } else {
        return Invalid(part_field, "has neither text nor image");
      }
    }
    messages.push_back(std::move(message));
  }
  ChatTemplateOptions template_options;
  template_options.add_generation_prompt = request.add_generation_prompt();
  for (int t = 0; t < request.tools_size(); ++t) {
    const v1::Tool& tool = request.tools(t);
    const std::string where = absl::StrCat("tools[", t, "]");
    if (absl::Status s = ValidateToolName(tool.name()); !s.ok()) {
      return Invalid(where + ".name", std::string(s.message()));
    }
    for (int u = 0; u < t; ++u) {
      if (request.tools(u).name() == tool.name()) {
        return Invalid(where + ".name", absl::StrCat("\"", tool.name(), "\" repeats tools[", u, "]"));
      }
    }
    absl::StatusOr<std::string> json = ToolJson(tool.name(), tool.description(), tool.parameters());
    if (!json.ok()) return Invalid(where + ".parameters", std::string(json.status().message()));
    template_options.tools.push_back(*std::move(json));
  }
  absl::StatusOr<Prompt> prompt = BuildPrompt(*tokenizer_, messages, template_options, merge);
  if (!prompt.ok()) return prompt.status();
  out.prompt = *std::move(prompt);
  return out;
}

absl::Status LanguageService::ResolveParams(const v1::GenerationParams& params,
                                            int64_t prompt_tokens, GenerationRequest* out) const {
  // Defaults from generation_config.json; do_sample false means greedy.
  const GenerationConfig& g = generation_config_;
  SamplingConfig& s = out->sampling;
  s.temperature = g.do_sample ? static_cast<float>(g.temperature) : 0.0f;
  s.top_k = static_cast<int32_t>(std::clamp<int64_t>(g.top_k, 0, INT32_MAX));
  s.top_p = static_cast<float>(g.top_p);
  s.repetition_penalty = static_cast<float>(g.repetition_penalty);
  const v1::SamplingParams& p = params.sampling();
  if (p.has_temperature()) s.temperature = p.temperature();
  if (p.has_top_k()) s.top_k = p.top_k();
  if (p.has_top_p()) s.top_p = p.top_p();
  if (p.has_min_p()) s.min_p = p.min_p();
  if (p.has_repetition_penalty()) s.repetition_penalty = p.repetition_penalty();
  if (p.has_presence_penalty()) s.presence_penalty = p.presence_penalty();
  if (p.has_frequency_penalty()) s.frequency_penalty = p.frequency_penalty();
  if (p.has_seed()) s.seed = p.seed();
  if (absl::Status st = ValidateSamplingConfig(s, "params.sampling"); !st.ok()) return st;

  if (prompt_tokens >= max_context_) {
    return Invalid("messages", absl::StrCat("make a prompt of ", prompt_tokens,
                                            " tokens; the context holds ", max_context_,
                                            " (--max_context), prompt plus at least one "
                                            "generated token"));
  }
  const int64_t room = max_context_ - prompt_tokens;
  if (params.has_max_tokens()) {
    if (params.max_tokens() < 1 || params.max_tokens() > max_context_) {
      return Invalid("params.max_tokens", absl::StrCat("must be in [1, ", max_context_,
                                                       "]; got ", params.max_tokens()));
    }
    out->max_tokens = std::min<int64_t>(params.max_tokens(), room);
  } else {
    out->max_tokens = std::min<int64_t>(g.max_new_tokens.value_or(room), room);
  }
  if (params.top_logprobs() < 0 || params.top_logprobs() > kMaxTopLogprobs) {
    return Invalid("params.top_logprobs", absl::StrCat("must be in [0, ", kMaxTopLogprobs,
                                                       "]; got ", params.top_logprobs()));
  }
  out->stop.assign(params.stop().begin(), params.stop().end());
  if (absl::Status st = ValidateStopStrings(out->stop, "params.stop"); !st.ok()) return st;
  out->ignore_eos = params.ignore_eos();
  out->logprobs = params.logprobs() || params.top_logprobs() > 0;
  out->top_logprobs = params.top_logprobs();
  out->include_special_tokens = params.include_special_tokens();
  return absl::OkStatus();
}

absl::Status LanguageService::ResolveConstraint(const v1::GenerateRequest& request,
                                                GenerationRequest* out) const {
  const v1::GenerationParams& params = request.params();
  const v1::ToolChoice& choice = request.tool_choice();
  const bool tool_constrained = choice.mode() == v1::TOOL_CHOICE_REQUIRED ||
                                choice.mode() == v1::TOOL_CHOICE_FUNCTION;
  if (choice.mode() != v1::TOOL_CHOICE_AUTO && choice.mode() != v1::TOOL_CHOICE_NONE &&
      !tool_constrained) {
    return Invalid("tool_choice.mode", absl::StrCat("is ", static_cast<int>(choice.mode()),
                                                    ", not a ToolChoiceMode"));
  }
  if (tool_constrained && request.tools_size() == 0) {
    return Invalid("tool_choice", "requires tools: none were given");
  }
  if (choice.mode() != v1::TOOL_CHOICE_FUNCTION && !choice.function().empty()) {
    return Invalid("tool_choice.function", "is set but tool_choice.mode is not FUNCTION");
  }
  if (tool_constrained && params.constraint_case() != v1::GenerationParams::CONSTRAINT_NOT_SET) {
    return Invalid("params.constraint",
                   "cannot be combined with tool_choice required or a named function");
  }
  // What to compile, and the field an error names.
  grammar::GrammarKind kind;
  std::string text, field;
  if (tool_constrained) {
    // One call: {"name": <a tool's name>, "arguments": <its parameters>}
    // between the tool-call tags, for the chosen tool or any of them. Each
    // tool's schema is compiled alone first so that an error names it.
    // Ordered: "name" before "arguments" as the model writes calls, and the
    // tool's properties in its own order.
    nlohmann::ordered_json options = nlohmann::ordered_json::array();
    bool found = false;
    for (int t = 0; t < request.tools_size(); ++t) {
      const v1::Tool& tool = request.tools(t);
      if (choice.mode() == v1::TOOL_CHOICE_FUNCTION && tool.name() != choice.function()) continue;
      found = true;
      nlohmann::ordered_json arguments =
          tool.parameters().empty()
              ? nlohmann::ordered_json{{"type", "object"}}
              : nlohmann::ordered_json::parse(tool.parameters(), nullptr, false);
      nlohmann::ordered_json properties = nlohmann::ordered_json::object();
      properties["name"] = {{"const", tool.name()}};
      properties["arguments"] = std::move(arguments);
      nlohmann::ordered_json call = nlohmann::ordered_json::object();
      call["type"] = "object";
      call["properties"] = std::move(properties);
      call["required"] = {"name", "arguments"};
      const std::string where = absl::StrCat("tools[", t, "].parameters");
      absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> alone =
          grammars_->Get(grammar::GrammarKind::kToolCall, call.dump());
      if (!alone.ok()) {
        return Invalid(where, absl::StrCat(absl::IsResourceExhausted(alone.status())
                                               ? "is too expensive to compile: "
                                               : "is not a supported schema: ",
                                           alone.status().message()));
      }
      options.push_back(std::move(call));
    }
    if (!found) {
      return Invalid("tool_choice.function",
                     absl::StrCat("is \"", choice.function(), "\", which is not among tools"));
    }
    kind = grammar::GrammarKind::kToolCall;
    text = options.size() == 1 ? options[0].dump()
                               : nlohmann::ordered_json{{"anyOf", options}}.dump();
    field = choice.mode() == v1::TOOL_CHOICE_FUNCTION ? "tool_choice" : "tools";
  } else {
    switch (params.constraint_case()) {
      case v1::GenerationParams::kJsonSchema:
        kind = grammar::GrammarKind::kJsonSchema;
        text = params.json_schema();
        field = "params.json_schema";
        break;
      case v1::GenerationParams::kJsonObject:
        if (!params.json_object()) return absl::OkStatus();
        kind = grammar::GrammarKind::kJsonObject;
        field = "params.json_object";
        break;
      case v1::GenerationParams::kRegex:
        kind = grammar::GrammarKind::kRegex;
        text = params.regex();
        field = "params.regex";
        break;
      default:
        return absl::OkStatus();
    }
  }
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> compiled =
      grammars_->Get(kind, text);
  if (!compiled.ok()) {
    return Invalid(field, absl::StrCat(absl::IsResourceExhausted(compiled.status())
                                           ? "is too expensive to compile: "
                                           : kind == grammar::GrammarKind::kRegex
                                               ? "is not a supported regular expression: "
                                               : "is not a supported schema: ",
                                       compiled.status().message()));
  }
  // Every token holds at least one byte, so max_tokens of at least the
  // shortest output's bytes plus the stop token always fits a valid output.
  const int64_t shortest = (*compiled)->grammar().MinOutputBytes();
  if (shortest + 1 > out->max_tokens) {
    return Invalid(field, absl::StrCat("has a shortest valid output of ", shortest,
                                       " bytes; with the stop token that needs max_tokens >= ",
                                       shortest + 1, " (one token may be one byte), got ",
                                       out->max_tokens));
  }
  out->grammar = *std::move(compiled);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// RPCs
// ---------------------------------------------------------------------------

grpc::Status LanguageService::Generate(grpc::ServerContext* context,
                                       const v1::GenerateRequest* request,
                                       grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const Clock::time_point arrival = Clock::now();
  if (grpc::Status s = readiness_->CheckGrpc(kLanguageServiceName); !s.ok()) return s;
  return RunGenerate(context, arrival, *request,
                     [writer](const v1::GenerateResponse& r) { return writer->Write(r); });
}

grpc::Status LanguageService::GenerateRaw(grpc::ServerContext* context, RawStream* stream) {
  const Clock::time_point arrival = Clock::now();
  if (grpc::Status s = readiness_->CheckGrpc(kLanguageServiceName); !s.ok()) return s;
  v1::GenerateRequest request;
  if (absl::Status s = ReadRequest(stream, &request); !s.ok()) return ToGrpcStatus(s);
  return RunGenerate(context, arrival, request,
                     [stream](const v1::GenerateResponse& r) { return WriteMessage(stream, r); });
}

grpc::Status LanguageService::CountTokens(grpc::ServerContext* context,
                                          const v1::GenerateRequest* request,
                                          v1::CountTokensResponse* response) {
  if (grpc::Status s = readiness_->CheckGrpc(kLanguageServiceName); !s.ok()) return s;
  return RunCountTokens(*request, response);
}

grpc::Status LanguageService::ReplicaInfo(grpc::ServerContext* /*context*/,
                                          const v1::ReplicaInfoRequest* /*request*/,
                                          v1::ReplicaInfoResponse* response) {
  if (grpc::Status s = readiness_->CheckGrpc(kLanguageServiceName); !s.ok()) return s;
  const EngineStats stats = engine_->Stats();
  response->set_model_fingerprint(fingerprint_);
  response->set_running(stats.running);
  response->set_waiting(stats.waiting);
  response->set_max_sequences(options_.max_sequences);
  response->set_max_queue(options_.max_queue);
  return grpc::Status::OK;
}

grpc::Status LanguageService::CountTokensRaw(grpc::ServerContext* context, RawStream* stream) {
  if (grpc::Status s = readiness_->CheckGrpc(kLanguageServiceName); !s.ok()) return s;
  v1::GenerateRequest request;
  if (absl::Status s = ReadRequest(stream, &request); !s.ok()) return ToGrpcStatus(s);
  v1::CountTokensResponse response;
  grpc::Status status = RunCountTokens(request, &response);
  if (status.ok() && !WriteMessage(stream, response)) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
  }
  return status;
}

namespace {

// One streamed delta: text, token ids, logprobs.
v1::GenerateResponse ChunkResponse(const GenerationChunk& chunk) {
  v1::GenerateResponse response;
  response.set_text(chunk.text);
  for (int32_t id : chunk.token_ids) response.add_token_ids(id);
  for (const GeneratedTokenLogprob& lp : chunk.logprobs) {
    v1::TokenLogprob* out = response.add_logprobs();
    out->set_token_id(lp.chosen.id);
    out->set_token(lp.chosen.token);
    out->set_logprob(lp.chosen.logprob);
    for (const TopLogprobEntry& alt : lp.top) {
      v1::TopLogprob* t = out->add_top();
      t->set_token_id(alt.id);
      t->set_token(alt.token);
      t->set_logprob(alt.logprob);
    }
  }
  return response;
}

// The stream's last message: the held-back text, finish reason, usage, timings.
v1::GenerateResponse FinalResponse(const GenerationResult& result, int64_t prompt_tokens,
                                   int64_t image_tokens, double queue_ms, double first_token_ms,
                                   double total_ms) {
  v1::GenerateResponse last;
  last.set_text(result.tail_text);
  last.set_finish_reason(ToProto(result.finish));
  v1::Usage* usage = last.mutable_usage();
  usage->set_prompt_tokens(static_cast<int32_t>(prompt_tokens));
  usage->set_image_tokens(static_cast<int32_t>(image_tokens));
  usage->set_completion_tokens(static_cast<int32_t>(result.completion_tokens));
  usage->set_total_tokens(static_cast<int32_t>(prompt_tokens + result.completion_tokens));
  usage->set_cached_prompt_tokens(static_cast<int32_t>(result.cached_prompt_tokens));
  v1::LanguageTimings* timings = last.mutable_timings();
  timings->set_queue_ms(queue_ms);
  timings->set_projector_ms(result.projector_ms);
  timings->set_prefill_ms(result.prefill_ms);
  timings->set_first_token_ms(first_token_ms);
  timings->set_decode_ms(result.decode_ms);
  timings->set_total_ms(total_ms);
  return last;
}

}  // namespace

grpc::Status LanguageService::RunGenerate(
    grpc::ServerContext* context, Clock::time_point arrival, const v1::GenerateRequest& request,
    const std::function<bool(const v1::GenerateResponse&)>& write) {
  absl::StatusOr<Prepared> prepared = Prepare(request, /*with_features=*/true);
  if (!prepared.ok()) return ToGrpcStatus(prepared.status());
  EngineRequest submit;
  GenerationRequest& gen = submit.generation;
  const int64_t prompt_tokens = static_cast<int64_t>(prepared->prompt.ids.size());
  if (absl::Status s = ResolveParams(request.params(), prompt_tokens, &gen); !s.ok()) {
    return ToGrpcStatus(s);
  }
  if (absl::Status s = ResolveConstraint(request, &gen); !s.ok()) return ToGrpcStatus(s);
  gen.prompt_ids = std::move(prepared->prompt.ids);
  gen.images = std::move(prepared->images);
  submit.image_keys = std::move(prepared->image_keys);

  absl::StatusOr<std::shared_ptr<RequestStream>> submitted = engine_->Submit(std::move(submit));
  if (!submitted.ok()) return ToGrpcStatus(submitted.status());
  RequestStream& stream = **submitted;

  Clock::time_point last_token = arrival;
  int64_t sent = 0;
  auto send = [&](const GenerationChunk& chunk) {
    const Clock::time_point now = Clock::now();
    if (sent == 0) {
      metrics_->ttft->Observe(MillisBetween(arrival, now) / 1000.0);
    } else {
      metrics_->itl->Observe(MillisBetween(last_token, now) / 1000.0);
    }
    last_token = now;
    sent += static_cast<int64_t>(chunk.token_ids.size());
    return write(ChunkResponse(chunk));
  };

  // Forward the engine's events; cancellation and deadlines are polled (gRPC's
  // sync API has no callback for them) and passed to the engine. The poll
  // wakes this thread every kCancelPoll at most, or at the deadline: every
  // wake-up of a handler thread preempts a compute thread (the engine's pool
  // keeps both cores busy), and at 10 ms with 8 streams that was 800 a second.
  // The engine acts on a cancellation at its next iteration anyway.
  constexpr absl::Duration kCancelPoll = absl::Milliseconds(100);
  const absl::Time deadline = absl::FromChrono(context->deadline());
  bool client_gone = false;
  EngineEvent event;
  while (true) {
    const absl::Duration poll =
        stream.cancelled()
            ? kCancelPoll
            : std::max(absl::Milliseconds(1), std::min(kCancelPoll, deadline - absl::Now()));
    if (!stream.Next(&event, poll)) {
      if (!stream.cancelled() && (context->IsCancelled() || DeadlinePassed(context))) {
        stream.Cancel();
      }
      continue;
    }
    if (event.kind != EngineEvent::Kind::kChunk) break;
    if (!client_gone && !send(event.chunk)) {
      client_gone = true;
      stream.Cancel();
    }
  }
  const double total_ms = MillisBetween(arrival, Clock::now());
  metrics_->prompt_tokens->Increment(static_cast<double>(prompt_tokens));
  metrics_->image_tokens->Increment(static_cast<double>(prepared->image_tokens));
  metrics_->generated_tokens->Increment(static_cast<double>(sent));
  if (event.kind == EngineEvent::Kind::kError) {
    metrics_->generations->Add({{"finish_reason", "error"}}).Increment();
    LogWarning(kLog, "generation failed", {{"request_id", request.request_id()},
                                           {"error", event.error.ToString()}});
    return ToGrpcStatus(event.error);
  }
  GenerationResult& result = event.result;
  const bool scheduled = result.scheduled_at != Clock::time_point{};
  const double queue_ms = MillisBetween(arrival, scheduled ? result.scheduled_at : Clock::now());
  metrics_->generations->Add({{"finish_reason", FinishReasonName(result.finish)}}).Increment();
  metrics_->Stage("queue", queue_ms);
  metrics_->Stage("projector", result.projector_ms);
  metrics_->Stage("prefill", result.prefill_ms);
  metrics_->Stage("decode", result.decode_ms);
  const int64_t computed = prompt_tokens - result.cached_prompt_tokens;
  if (result.prefill_ms > 0 && computed > 0) {
    metrics_->prefill_tps->Set(static_cast<double>(computed) / (result.prefill_ms / 1000));
  }
  if (result.completion_tokens > 1 && result.decode_ms > 0) {
    metrics_->decode_tps->Set(static_cast<double>(result.completion_tokens - 1) /
                              (result.decode_ms / 1000));
  }
  const double first_token_ms = result.completion_tokens > 0
                                    ? MillisBetween(arrival, result.first_token_at)
                                    : 0.0;
  LogInfo(kLog, "generation finished",
          {{"request_id", request.request_id()},
           {"finish", result.finish_detail},
           {"prompt_tokens", static_cast<long long>(prompt_tokens)},
           {"cached_prompt_tokens", static_cast<long long>(result.cached_prompt_tokens)},
           {"image_tokens", static_cast<long long>(prepared->image_tokens)},
           {"completion_tokens", static_cast<long long>(result.completion_tokens)},
           {"queue_ms", queue_ms},
           {"projector_ms", result.projector_ms},
           {"prefill_ms", result.prefill_ms},
           {"first_token_ms", first_token_ms},
           {"decode_ms", result.decode_ms},
           {"grammar_ms", result.grammar_ms},
           {"total_ms", total_ms}});

  if (result.finish == FinishReason::kCancelled) {
    if (DeadlinePassed(context)) {
      return grpc::Status(
          grpc::StatusCode::DEADLINE_EXCEEDED,
          scheduled ? absl::StrCat("deadline exceeded after ", result.completion_tokens,
                                   " generated tokens")
                    : std::string("the deadline passed while waiting for a sequence slot"));
    }
    return grpc::Status(grpc::StatusCode::CANCELLED,
                        absl::StrCat("generation cancelled after ", result.completion_tokens,
                                     " tokens"));
  }

  write(FinalResponse(result, prompt_tokens, prepared->image_tokens, queue_ms, first_token_ms,
                      total_ms));
  return grpc::Status::OK;
}

grpc::Status LanguageService::RunCountTokens(const v1::GenerateRequest& request,
                                             v1::CountTokensResponse* response) {
  absl::StatusOr<Prepared> prepared = Prepare(request, /*with_features=*/false);
  if (!prepared.ok()) return ToGrpcStatus(prepared.status());
  v1::Usage* usage = response->mutable_usage();
  const int32_t prompt = static_cast<int32_t>(prepared->prompt.ids.size());
  usage->set_prompt_tokens(prompt);
  usage->set_image_tokens(static_cast<int32_t>(prepared->image_tokens));
  usage->set_completion_tokens(0);
  usage->set_total_tokens(prompt);
  return grpc::Status::OK;
}

}  // namespace vlm::language
