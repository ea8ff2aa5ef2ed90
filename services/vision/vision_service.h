// vlm.v1.VisionEncoder: translates Encode requests into the vision pipeline
// (decode -> preprocess -> ViT) behind the embedding cache, and the results
// back into wire tensors. It owns the model, the cache and a bounded pool of
// encode workers; it decides nothing about the model's numbers.
//
//   vlm::vision::VisionService service(*VisionServiceConfig::FromFlags(), &server.readiness());
//   server.AddService(&service, VisionService::kServiceName, "loading weights");
//   ... server.Start() ...
//   absl::Status loaded = service.Load();   // mmap, model, cache, workers, warm-up forward
//   if (loaded.ok()) server.readiness().SetServing(VisionService::kServiceName);
//
// Encode semantics:
//   - `image` bytes: cache key = SHA-256(bytes) + effective options + the
//     vision fingerprint (weights' headers, vision_config, preprocessing,
//     compute dtype). A miss decodes, looks the decoded pixels up (another
//     container of the same picture hits at level PIXELS), then preprocesses
//     and runs the ViT on a worker.
//   - `content_hash` alone: only a lookup (memory, flight in progress, disk);
//     NOT_FOUND if these bytes were not encoded with the same options.
//   - options: 0 = the server default (default_max_pixels, the checkpoint's
//     min_pixels); values above max_pixels_limit are lowered to it, values
//     below min_pixels_limit or an explicit min_pixels > max_pixels are
//     INVALID_ARGUMENT naming the limit (ResolvePixelBudget). The response's
//     options carry the budget used.
//   - bad images are INVALID_ARGUMENT naming the problem; nothing is cached.
//   - the work queue is bounded: RESOURCE_EXHAUSTED past encode_queue_size
//     waiting encodes; a request whose deadline passes (or that is cancelled)
//     while queued gets DEADLINE_EXCEEDED (CANCELLED) and is never computed.
//   - cache level: MISS when this request ran the ViT; a request that waited
//     for another request's identical encode reports MEMORY.
//
// Thread-safety: Encode and EncodeImage may run concurrently once Load has
// returned OK; before that they answer UNAVAILABLE.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/cpu_features.h"
#include "common/model_config.h"
#include "common/readiness.h"
#include "services/vision/embedding_cache.h"
#include "services/vision/image_decoder.h"
#include "services/vision/preprocess.h"
#include "vlm/v1/vision.grpc.pb.h"

namespace vlm {
class SafetensorsCheckpoint;
class VisionModel;
}  // namespace vlm

namespace vlm::vision {

struct VisionServiceConfig {
  std::string model_dir;  // HF checkpoint directory (config.json, *.safetensors, preprocessor_config.json)
  ComputeDType compute_dtype = ComputeDType::kBFloat16;
  int64_t attention_query_tile = 1024;
  int intra_op_threads = 1;   // at::set_num_threads in every encode worker (flag default: the usable cores)
  int encode_workers = 1;     // ViT forwards running at once
  int encode_queue_size = 16; // encodes waiting for a worker; beyond: RESOURCE_EXHAUSTED
  int warmup_runs = 1;        // forwards on a generated image before SERVING

  DecodeLimits decode_limits;
  // JPEGs far above their budget are decoded at a reduced DCT scale (at least
  // twice the resized size per side; DecodeImage's min_size).
  bool jpeg_scaled_decode = true;
  // Smallest image side accepted. HF upscales even a 1x1 image to the
  // min_pixels area; 2 (the default) rejects 1-pixel-wide images as
  // degenerate, 1 restores the reference's behaviour.
  int min_image_side = 2;
  // Bounds of a request's min_pixels / max_pixels. max_pixels_limit 0 = the
  // checkpoint's max_pixels, lowered if needed so that the features of the
  // largest image fit max_response_bytes; an explicit value that does not fit
  // fails Load. Requests above the limit are lowered to it.
  int64_t min_pixels_limit = 1024;
  int64_t max_pixels_limit = 0;
  // The budget of a request that sets none (0 = the checkpoint's max_pixels),
  // capped by max_pixels_limit: a CPU-sized default.
  int64_t default_max_pixels = 524288;
  // Largest response message (gRPC send limit); an image whose features would
  // not fit is INVALID_ARGUMENT before any compute.
  int64_t max_response_bytes = int64_t{128} << 20;

  EmbeddingCacheOptions cache;
  std::string replica_name;  // reported in every response; empty = hostname

  // From the --flags (and VLM_* environment variables) defined in
  // vision_service.cc; INVALID_ARGUMENT names a bad flag value.
  static absl::StatusOr<VisionServiceConfig> FromFlags();
  // Every field on one line, for the startup log.
  std::string Describe() const;
};

// What one image produced, for in-process callers (benchmarks) and the RPC.
struct EncodeOutcome {
  FeaturesPtr features;
  CacheLevel level = CacheLevel::kMiss;
  std::string content_hash;  // of the bytes this request sent (or named)
  int64_t min_pixels = 0;    // the pixel budget used (after defaults and limits)
  int64_t max_pixels = 0;
  double decode_ms = 0;
  double preprocess_ms = 0;
  double encode_ms = 0;
  double total_ms = 0;
};

// A request in model terms; pixels 0 = server default.
struct EncodeCall {
  // Exactly one of image_bytes (may be empty: a bad image) / content_hash is used.
  bool by_hash = false;
  std::string_view image_bytes;
  std::string content_hash;
  int64_t min_pixels = 0;
  int64_t max_pixels = 0;
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> is_cancelled;  // optional; polled while waiting
};

class VisionService final : public v1::VisionEncoder::Service {
 public:
  static constexpr char kServiceName[] = "vlm.v1.VisionEncoder";

  // `readiness` is not owned (the Server's); may be null for in-process use.
  VisionService(VisionServiceConfig config, const Readiness* readiness);
  ~VisionService() override;  // stops the workers, finishes queued disk writes

  // Maps the weights, builds the model and the cache, starts the workers and
  // runs one warm-up forward on a small generated image. Call once.
  absl::Status Load();
  bool loaded() const;

  grpc::Status Encode(grpc::ServerContext* context, const v1::EncodeRequest* request,
                      v1::EncodeResponse* response) override;

  // The RPC's work without the wire: same validation, cache, queue and metrics.
  absl::StatusOr<EncodeOutcome> EncodeImage(const EncodeCall& call);

  // The pixel budget (defaults, limits) and patch geometry a caller needs to
  // predict an image's grid from its size; UNAVAILABLE until Load has
  // succeeded (answered while draining: the numbers do not change).
  grpc::Status GetImageBudget(grpc::ServerContext* context, const v1::ImageBudgetRequest* request,
                              v1::ImageBudget* response) override;
  absl::StatusOr<v1::ImageBudget> ImageBudget() const;

  EmbeddingCacheStats cache_stats() const;
  // Hex fingerprint keying the cache; valid after Load.
  const std::string& model_fingerprint() const { return fingerprint_; }
  const VisionModel* model() const { return model_.get(); }
  const VisionServiceConfig& config() const { return config_; }
  // The checkpoint's preprocessing with the effective default pixel budget (after Load).
  const PreprocessOptions& default_options() const { return default_options_; }

 private:
  class EncodePool;
  struct Metrics;

  // Load's steps, in order: preprocessing defaults inside the operator's
  // limits (checked against vision_config), the model, the cache key's
  // fingerprint, the cache and the encode workers, the warm-up forward, and
  // the thread publishing cache statistics.
  absl::Status ReadPreprocessing(const VisionConfig& vision_config);
  absl::Status LoadWeights(const ModelConfig& model_config);
  absl::Status ComputeFingerprint(const std::string& config_json);
  absl::Status StartCacheAndWorkers();
  absl::Status WarmUp();
  void StartPublisher();
  absl::StatusOr<PreprocessOptions> EffectiveOptions(int64_t min_pixels, int64_t max_pixels) const;
  // Decode, pixel-key probe, preprocess, ViT; runs on a worker.
  absl::StatusOr<FeaturesPtr> Compute(std::string_view bytes, const PreprocessOptions& options,
                                      const CacheKeyContext& key_context, PixelKeyProbe* probe,
                                      absl::Time deadline, EncodeOutcome* outcome) const;
  absl::Status CheckResponseFits(int64_t patches, size_t dtype_size) const;
  absl::Status FillResponse(const EncodeOutcome& outcome, v1::DType dtype,
                            v1::EncodeResponse* response) const;
  void PublishCacheStats();

  VisionServiceConfig config_;
  const Readiness* readiness_;
  PreprocessOptions default_options_;
  std::unique_ptr<SafetensorsCheckpoint> checkpoint_;
  std::unique_ptr<VisionModel> model_;
  std::unique_ptr<EmbeddingCache> cache_;
  std::unique_ptr<EncodePool> pool_;
  std::string fingerprint_;
  size_t feature_dtype_size_ = 2;  // bytes per element of the cached features
  Metrics* metrics_;               // process-wide, never destroyed
  std::mutex stats_mu_;            // serialises PublishCacheStats
  EmbeddingCacheStats published_{};
  std::atomic<bool> loaded_{false};
  // Refreshes the cache metrics every second (disk writes finish in the background).
  std::mutex publisher_mu_;
  std::condition_variable publisher_cv_;
  bool stop_publisher_ = false;
  std::thread publisher_;
};

}  // namespace vlm::vision
