#include "services/vision/vision_service.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <exception>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/torch_util.h"
#include "common/grpc_status.h"
#include "common/kernels/kernel_path.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "common/model_fingerprint.h"
#include "common/safetensors.h"
#include "common/server.h"
#include "common/sha256.h"
#include "common/tensor_codec.h"
#include "services/vision/vision_model.h"

// ---------------------------------------------------------------------------
// Flags (each also VLM_<NAME> in the environment)
// ---------------------------------------------------------------------------
ABSL_FLAG(std::string, model_dir, "", "checkpoint directory (config.json, *.safetensors, "
                                      "preprocessor_config.json)");
ABSL_FLAG(std::string, compute_dtype, "bf16",
          "ViT compute dtype: bf16 (float32 on CPUs without AVX-512) or f32; also bfloat16, "
          "float32 (the same values as every service)");
ABSL_FLAG(int64_t, attention_query_tile, 1024,
          "queries per attention tile: bounds the score tensor to heads x tile x patches");
ABSL_FLAG(int, intra_op_threads, 0,
          "compute threads per encode worker (kernels and LibTorch); 0 = the cores this "
          "process may use (CPU affinity, capped by a cgroup cpu.max quota)");
ABSL_FLAG(int, encode_workers, 1, "ViT encodes running at once");
ABSL_FLAG(int, encode_queue_size, 16,
          "encodes waiting for a worker; more are refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(int, warmup_runs, 1,
          "warm-up forwards on a small generated image before health reports SERVING (>= 1)");
ABSL_FLAG(int64_t, max_encoded_bytes, 64 << 20, "largest encoded image accepted, in bytes");
ABSL_FLAG(bool, jpeg_scaled_decode, true,
          "decode a JPEG far above its pixel budget at a reduced libjpeg DCT scale (n/8, still "
          "at least twice the resized size per side) before the usual resize; false decodes "
          "every image at full size, as the reference processor does");
ABSL_FLAG(int64_t, max_decoded_pixels, 200'000'000,
          "largest image accepted, width x height as stored (checked from the header)");
ABSL_FLAG(int, min_image_side, 2,
          "smallest image side accepted, in pixels; 1 accepts 1-pixel images as HF does "
          "(it upscales them to the min_pixels area)");
ABSL_FLAG(int64_t, min_pixels_limit, 1024,
          "smallest min_pixels / max_pixels a request may ask for");
ABSL_FLAG(int64_t, max_pixels_limit, 0,
          "largest pixel budget a request may ask for (larger requests are lowered to it); "
          "0 = the checkpoint's max_pixels or, if smaller, the largest budget whose features "
          "fit --max_message_mb. A value whose features cannot fit is a start-up error.");
ABSL_FLAG(int64_t, default_max_pixels, 524288,
          "pixel budget of a request that sets none (larger images are resized down to it); "
          "sized for CPU serving: 524288 (0.5 MP; a 4:3 photo becomes 832x608, 1976 patches, "
          "494 tokens) keeps a photo's ViT + prefill near 10 s on 2 cores (README, Image "
          "sizes). 0 = the checkpoint's max_pixels. Capped by --max_pixels_limit.");
ABSL_FLAG(int64_t, cache_max_bytes, int64_t{1} << 30, "memory cache bound, in bytes");
ABSL_FLAG(int64_t, cache_max_entries, 4096, "memory cache bound, in images (0 disables it)");
ABSL_FLAG(double, cache_ttl_s, 0, "cache entry lifetime in seconds; 0 = no expiry");
ABSL_FLAG(std::string, cache_dir, "", "disk cache directory (survives restarts); empty disables");
ABSL_FLAG(int64_t, cache_disk_max_bytes, int64_t{10} << 30, "disk cache bound, in bytes");
ABSL_FLAG(std::string, replica_name, "", "name reported in responses; empty = the hostname");

namespace vlm::vision {
namespace {

constexpr char kLog[] = "vision";

double MsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

std::string Hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "vlm-vision";
  return name;
}

// Response bytes per patch at the default wire dtype (BF16): the last hidden
// state and every deepstack tap.
int64_t FeatureBytesPerPatch(const VisionConfig& vc) {
  const int64_t tensors = 1 + static_cast<int64_t>(vc.deepstack_visual_indexes.size());
  return vc.hidden_size * 2 * tensors;
}
constexpr int64_t kResponseEnvelope = 64 << 10;  // grid, hashes, timings, framing

FeatureDType CachedDType(ComputeDType dtype) {
  return dtype == ComputeDType::kBFloat16 ? FeatureDType::kBF16 : FeatureDType::kF32;
}

at::ScalarType ToScalarType(FeatureDType dtype) {
  switch (dtype) {
    case FeatureDType::kBF16: return at::kBFloat16;
    case FeatureDType::kF16: return at::kHalf;
    case FeatureDType::kF32: return at::kFloat;
  }
  return at::kFloat;
}

// A contiguous copy of a model output as cache bytes.
FeatureTensor ToFeatureTensor(const at::Tensor& tensor, FeatureDType dtype) {
  at::Tensor t = tensor.to(ToScalarType(dtype)).contiguous();
  FeatureTensor out;
  out.dtype = dtype;
  out.shape = t.sizes().vec();
  out.data.assign(static_cast<const char*>(t.data_ptr()), t.nbytes());
  return out;
}

absl::Status ToWire(const FeatureTensor& cached, v1::DType dtype, v1::Tensor* out) {
  if (static_cast<uint32_t>(cached.dtype) == static_cast<uint32_t>(dtype)) {
    out->set_dtype(dtype);
    for (int64_t d : cached.shape) out->add_shape(d);
    out->set_data(cached.data);
    return absl::OkStatus();
  }
  try {
    // A read-only view of the cached bytes; EncodeTensor copies while converting.
    at::Tensor view = at::from_blob(const_cast<char*>(cached.data.data()), cached.shape,
                                    at::TensorOptions().dtype(ToScalarType(cached.dtype)));
    return EncodeTensor(view, dtype, out);
  } catch (const std::exception& e) {
    return StatusFromException("features to wire", e);
  }
}

// A smooth, colourful test card for the warm-up forward.
RgbImage WarmupImage(int width, int height) {
  RgbImage image;
  image.width = width;
  image.height = height;
  image.pixels.resize(static_cast<size_t>(width) * height * 3);
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      uint8_t* p = &image.pixels[(static_cast<size_t>(y) * width + x) * 3];
      p[0] = static_cast<uint8_t>(255 * x / std::max(1, width - 1));
      p[1] = static_cast<uint8_t>(255 * y / std::max(1, height - 1));
      p[2] = static_cast<uint8_t>((x * 7 + y * 13) & 255);
    }
  }
  return image;
}

// Debian's abseil has its own string_view; the decoder speaks it, the cache std's.
absl::string_view Absl(std::string_view s) { return absl::string_view(s.data(), s.size()); }
std::string_view Std(absl::string_view s) { return std::string_view(s.data(), s.size()); }

bool IsDecodable(ImageFormat format) {
  return format == ImageFormat::kJpeg || format == ImageFormat::kPng ||
         format == ImageFormat::kWebp;
}

}  // namespace

// ---------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------

absl::StatusOr<VisionServiceConfig> VisionServiceConfig::FromFlags() {
  VisionServiceConfig c;
  c.model_dir = absl::GetFlag(FLAGS_model_dir);
  absl::StatusOr<ComputeDType> dtype = ParseComputeDType(absl::GetFlag(FLAGS_compute_dtype));
  if (!dtype.ok()) return absl::InvalidArgumentError("--" + std::string(dtype.status().message()));
  c.compute_dtype = *dtype;
  c.attention_query_tile = absl::GetFlag(FLAGS_attention_query_tile);
  c.intra_op_threads = absl::GetFlag(FLAGS_intra_op_threads);
  if (c.intra_op_threads == 0) c.intra_op_threads = UsableCores();
  c.encode_workers = absl::GetFlag(FLAGS_encode_workers);
  c.encode_queue_size = absl::GetFlag(FLAGS_encode_queue_size);
  c.warmup_runs = absl::GetFlag(FLAGS_warmup_runs);
  c.decode_limits.max_encoded_bytes = absl::GetFlag(FLAGS_max_encoded_bytes);
  c.jpeg_scaled_decode = absl::GetFlag(FLAGS_jpeg_scaled_decode);
  c.decode_limits.max_decoded_pixels = absl::GetFlag(FLAGS_max_decoded_pixels);
  c.min_image_side = absl::GetFlag(FLAGS_min_image_side);
  c.min_pixels_limit = absl::GetFlag(FLAGS_min_pixels_limit);
  c.max_pixels_limit = absl::GetFlag(FLAGS_max_pixels_limit);
  c.default_max_pixels = absl::GetFlag(FLAGS_default_max_pixels);
  c.max_response_bytes = int64_t{absl::GetFlag(FLAGS_max_message_mb)} << 20;
  const int64_t cache_bytes = absl::GetFlag(FLAGS_cache_max_bytes);
  const int64_t cache_entries = absl::GetFlag(FLAGS_cache_max_entries);
  const double ttl = absl::GetFlag(FLAGS_cache_ttl_s);
  const int64_t disk_bytes = absl::GetFlag(FLAGS_cache_disk_max_bytes);
  if (cache_bytes < 0 || cache_entries < 0 || ttl < 0 || disk_bytes < 0) {
    return absl::InvalidArgumentError(
        "--cache_max_bytes, --cache_max_entries, --cache_ttl_s and --cache_disk_max_bytes must be "
        ">= 0");
  }
  c.cache.max_bytes = static_cast<size_t>(cache_bytes);
  c.cache.max_entries = static_cast<size_t>(cache_entries);
  c.cache.ttl = ttl > 0 ? absl::Seconds(ttl) : absl::InfiniteDuration();
  c.cache.disk_dir = absl::GetFlag(FLAGS_cache_dir);
  c.cache.disk_max_bytes = static_cast<uint64_t>(disk_bytes);
  c.replica_name = absl::GetFlag(FLAGS_replica_name);
  return c;
}

std::string VisionServiceConfig::Describe() const {
  return absl::StrFormat(
      "model_dir=%s compute_dtype=%s attention_query_tile=%d intra_op_threads=%d "
      "encode_workers=%d encode_queue_size=%d warmup_runs=%d max_encoded_bytes=%d jpeg_scaled_decode=%d "
      "max_decoded_pixels=%d min_image_side=%d min_pixels_limit=%d max_pixels_limit=%d "
      "default_max_pixels=%d "
      "max_response_bytes=%d cache_max_bytes=%d cache_max_entries=%d cache_ttl=%s cache_dir=%s cache_disk_max_bytes=%d "
      "replica=%s",
      model_dir, ComputeDTypeName(compute_dtype), attention_query_tile, intra_op_threads,
      encode_workers, encode_queue_size, warmup_runs, decode_limits.max_encoded_bytes,
      jpeg_scaled_decode,
      decode_limits.max_decoded_pixels, min_image_side, min_pixels_limit, max_pixels_limit,
      default_max_pixels,
      max_response_bytes, cache.max_bytes, cache.max_entries, absl::FormatDuration(cache.ttl),
      cache.disk_dir.empty() ? "(none)" : cache.disk_dir, cache.disk_max_bytes, replica_name);
}

// ---------------------------------------------------------------------------
// Metrics (process-wide; a second service in one process shares them)
// ---------------------------------------------------------------------------

struct VisionService::Metrics {
  template <typename T>
  using Family = prometheus::Family<T>;

  prometheus::Registry& r = MetricsRegistry();
  Family<prometheus::Counter>& hits = prometheus::BuildCounter()
      .Name("vlm_vision_cache_hits_total")
      .Help("Images served from the cache, by level: memory (same bytes), pixels (same decoded "
            "picture), disk.")
      .Register(r);
  prometheus::Counter& hits_memory = hits.Add({{"level", "memory"}});
  prometheus::Counter& hits_pixels = hits.Add({{"level", "pixels"}});
  prometheus::Counter& hits_disk = hits.Add({{"level", "disk"}});
  prometheus::Counter& misses = prometheus::BuildCounter()
      .Name("vlm_vision_cache_misses_total")
      .Help("Images whose features were computed (ViT forwards).")
      .Register(r).Add({});
  prometheus::Counter& coalesced = prometheus::BuildCounter()
      .Name("vlm_vision_cache_coalesced_total")
      .Help("Requests that waited for a concurrent identical encode instead of computing.")
      .Register(r).Add({});
  prometheus::Counter& not_found = prometheus::BuildCounter()
      .Name("vlm_vision_cache_not_found_total")
      .Help("content_hash requests whose features were not cached.")
      .Register(r).Add({});
  prometheus::Counter& failures = prometheus::BuildCounter()
      .Name("vlm_vision_cache_compute_failures_total")
      .Help("Encodes that failed (bad images included); failures are never cached.")
      .Register(r).Add({});
  Family<prometheus::Counter>& evictions = prometheus::BuildCounter()
      .Name("vlm_vision_cache_evictions_total")
      .Help("Entries dropped by the size bounds, by tier.")
      .Register(r);
  prometheus::Counter& evictions_memory = evictions.Add({{"tier", "memory"}});
  prometheus::Counter& evictions_disk = evictions.Add({{"tier", "disk"}});
  prometheus::Counter& expirations = prometheus::BuildCounter()
      .Name("vlm_vision_cache_expirations_total")
      .Help("Entries dropped by the TTL (either tier).")
      .Register(r).Add({});
  Family<prometheus::Gauge>& bytes = prometheus::BuildGauge()
      .Name("vlm_vision_cache_bytes")
      .Help("Bytes held by the cache, by tier.")
      .Register(r);
  prometheus::Gauge& bytes_memory = bytes.Add({{"tier", "memory"}});
  prometheus::Gauge& bytes_disk = bytes.Add({{"tier", "disk"}});
  Family<prometheus::Gauge>& entries = prometheus::BuildGauge()
      .Name("vlm_vision_cache_entries")
      .Help("Images (memory) or files (disk) held by the cache, by tier.")
      .Register(r);
  prometheus::Gauge& entries_memory = entries.Add({{"tier", "memory"}});
  prometheus::Gauge& entries_disk = entries.Add({{"tier", "disk"}});
  prometheus::Counter& disk_errors = prometheus::BuildCounter()
      .Name("vlm_vision_cache_disk_errors_total")
      .Help("Disk-tier errors: corrupt or truncated files (deleted, never served) and IO failures.")
      .Register(r).Add({});
  prometheus::Counter& disk_corrupt = prometheus::BuildCounter()
      .Name("vlm_vision_cache_disk_corrupt_total")
      .Help("Disk-tier files that failed verification (included in disk_errors).")
      .Register(r).Add({});
  prometheus::Counter& disk_writes = prometheus::BuildCounter()
      .Name("vlm_vision_cache_disk_writes_total")
      .Help("Files written to the disk tier.")
      .Register(r).Add({});
  prometheus::Counter& disk_writes_dropped = prometheus::BuildCounter()
      .Name("vlm_vision_cache_disk_writes_dropped_total")
      .Help("Disk writes dropped (write queue full or entry larger than the bound).")
      .Register(r).Add({});

  prometheus::Histogram& decode_seconds =
      LatencyHistogramFamily("vlm_vision_decode_seconds", "Image decode time.")
          .Add({}, DefaultLatencyBuckets());
  prometheus::Histogram& preprocess_seconds =
      LatencyHistogramFamily("vlm_vision_preprocess_seconds",
                             "Resize, normalise and patchify time.")
          .Add({}, DefaultLatencyBuckets());
  prometheus::Histogram& encode_seconds =
      LatencyHistogramFamily("vlm_vision_encode_seconds", "ViT forward time.")
          .Add({}, DefaultLatencyBuckets());

  prometheus::Gauge& images_in_flight = prometheus::BuildGauge()
      .Name("vlm_vision_images_in_flight")
      .Help("Encode requests being handled now (cache hits, queued and running encodes).")
      .Register(r).Add({});
  prometheus::Gauge& queue_depth = prometheus::BuildGauge()
      .Name("vlm_vision_encode_queue_depth")
      .Help("Encodes waiting for a worker.")
      .Register(r).Add({});
  prometheus::Gauge& workers_busy = prometheus::BuildGauge()
      .Name("vlm_vision_encode_workers_busy")
      .Help("Encode workers running an encode.")
      .Register(r).Add({});
  Family<prometheus::Counter>& queue_refused = prometheus::BuildCounter()
      .Name("vlm_vision_encode_queue_refused_total")
      .Help("Encodes never computed: queue full, or deadline passed / cancelled while queued.")
      .Register(r);
  prometheus::Counter& refused_full = queue_refused.Add({{"reason", "queue_full"}});
  prometheus::Counter& refused_deadline = queue_refused.Add({{"reason", "deadline"}});
  prometheus::Counter& refused_cancelled = queue_refused.Add({{"reason", "cancelled"}});
  prometheus::Counter& bad_images = prometheus::BuildCounter()
      .Name("vlm_vision_invalid_images_total")
      .Help("Requests refused with INVALID_ARGUMENT.")
      .Register(r).Add({});
  Family<prometheus::Gauge>& weights = prometheus::BuildGauge()
      .Name("vlm_vision_weights_bytes")
      .Help("ViT weight bytes: used in place from the mapping, converted into memory, or "
            "repacked for the compute kernels.")
      .Register(r);
  prometheus::Gauge& weights_borrowed = weights.Add({{"kind", "mapped"}});
  prometheus::Gauge& weights_converted = weights.Add({{"kind", "converted"}});
  prometheus::Gauge& weights_packed = weights.Add({{"kind", "packed"}});

  static Metrics* Get() {
    static Metrics* metrics = new Metrics();
    return metrics;
  }
};

// ---------------------------------------------------------------------------
// Encode pool: a fixed set of workers and a bounded FIFO queue
// ---------------------------------------------------------------------------

class VisionService::EncodePool {
 public:
  EncodePool(int workers, int max_queue, int intra_op_threads, Metrics* metrics)
      : max_queue_(static_cast<size_t>(std::max(0, max_queue))), metrics_(metrics) {
    idle_ = std::max(1, workers);
    for (int i = 0; i < std::max(1, workers); ++i) {
      threads_.emplace_back([this, intra_op_threads] {
        // OpenMP thread counts are per thread: set ours before any ATen call.
        at::set_num_threads(std::max(1, intra_op_threads));
        WorkerLoop();
      });
    }
  }

  ~EncodePool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      for (Job* job : queue_) {
        job->state = State::kStopped;
        job->cv.notify_all();
      }
      queue_.clear();
      metrics_->queue_depth.Set(0);
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  // Runs `work` on a worker and returns once it has run (OK). Without running
  // it: RESOURCE_EXHAUSTED when the queue is full, DEADLINE_EXCEEDED /
  // CANCELLED when that happens while queued, UNAVAILABLE when stopping.
  absl::Status Run(const std::function<void()>& work, absl::Time deadline,
                   const std::function<bool()>& is_cancelled) {
    Job job;
    job.work = &work;
    job.deadline = deadline;
    job.is_cancelled = &is_cancelled;
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("server is draining");
    if (queue_.size() >= max_queue_ + idle_) {
      metrics_->refused_full.Increment();
      return absl::ResourceExhaustedError(absl::StrCat(
          "vision encode queue is full: ", queue_.size(), " images waiting for ",
          threads_.size(), " worker(s) (--encode_queue_size=", max_queue_, "); retry later"));
    }
    queue_.push_back(&job);
    metrics_->queue_depth.Set(static_cast<double>(queue_.size()));
    cv_.notify_one();
    while (true) {
      switch (job.state) {
        case State::kDone: return absl::OkStatus();
        case State::kStopped: return absl::UnavailableError("server is draining");
        case State::kExpired: return Refuse(job.expired_by_cancel);
        case State::kRunning:
          job.cv.wait(lock);  // a started encode finishes (it checks the deadline itself)
          continue;
        case State::kQueued: break;
      }
      // gRPC reports a passed deadline as cancelled too: test the deadline first.
      const absl::Time now = absl::Now();
      const bool cancelled = now < deadline && is_cancelled && is_cancelled();
      if (cancelled || now >= deadline) {
        queue_.erase(std::find(queue_.begin(), queue_.end(), &job));
        metrics_->queue_depth.Set(static_cast<double>(queue_.size()));
        return Refuse(cancelled);
      }
      // Wake at the deadline, and every 50 ms to notice a cancelled call.
      const absl::Time until = std::min(deadline, now + absl::Milliseconds(50));
      job.cv.wait_until(lock, absl::ToChronoTime(until));
    }
  }

 private:
  enum class State { kQueued, kRunning, kDone, kExpired, kStopped };
  struct Job {
    const std::function<void()>* work = nullptr;
    absl::Time deadline;
    const std::function<bool()>* is_cancelled = nullptr;
    State state = State::kQueued;
    bool expired_by_cancel = false;
    std::condition_variable cv;
  };

  absl::Status Refuse(bool cancelled) {
    if (cancelled) {
      metrics_->refused_cancelled.Increment();
      return absl::CancelledError("request cancelled while waiting for an encode worker");
    }
    metrics_->refused_deadline.Increment();
    return absl::DeadlineExceededError(
        "deadline passed while waiting for an encode worker; the image was not encoded");
  }

  void WorkerLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      Job* job = queue_.front();
      queue_.pop_front();
      metrics_->queue_depth.Set(static_cast<double>(queue_.size()));
      // A job whose caller has not noticed its deadline yet is not started.
      const bool expired = absl::Now() >= job->deadline;
      const bool cancelled = !expired && *job->is_cancelled && (*job->is_cancelled)();
      if (cancelled || expired) {
        job->state = State::kExpired;
        job->expired_by_cancel = cancelled;
        job->cv.notify_all();
        continue;
      }
      job->state = State::kRunning;
      --idle_;
      metrics_->workers_busy.Increment();
      lock.unlock();
      (*job->work)();  // never throws: the work converts exceptions to statuses
      lock.lock();
      ++idle_;
      metrics_->workers_busy.Decrement();
      job->state = State::kDone;
      job->cv.notify_all();
    }
  }

  const size_t max_queue_;
  Metrics* metrics_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job*> queue_;
  size_t idle_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------

VisionService::VisionService(VisionServiceConfig config, const Readiness* readiness)
    : config_(std::move(config)), readiness_(readiness), metrics_(Metrics::Get()) {
  if (config_.replica_name.empty()) config_.replica_name = Hostname();
}

VisionService::~VisionService() {
  {
    std::lock_guard<std::mutex> lock(publisher_mu_);
    stop_publisher_ = true;
  }
  publisher_cv_.notify_all();
  if (publisher_.joinable()) publisher_.join();
  pool_.reset();
  if (cache_) cache_->FlushDiskWrites();
}

bool VisionService::loaded() const { return loaded_.load(std::memory_order_acquire); }

namespace {

absl::Status CheckServiceConfig(const VisionServiceConfig& c) {
  if (c.model_dir.empty()) return absl::InvalidArgumentError("--model_dir is required");
  if (c.encode_workers < 1 || c.encode_queue_size < 0 || c.intra_op_threads < 1 ||
      c.warmup_runs < 1) {
    return absl::InvalidArgumentError(
        "--encode_workers, --intra_op_threads and --warmup_runs must be >= 1, "
        "--encode_queue_size >= 0");
  }
  if (c.min_image_side < 1) return absl::InvalidArgumentError("--min_image_side must be >= 1");
  if (c.min_pixels_limit < 1 || c.max_pixels_limit < 0 || c.default_max_pixels < 0) {
    return absl::InvalidArgumentError(
        "--min_pixels_limit must be >= 1, --max_pixels_limit and --default_max_pixels >= 0");
  }
  if (c.decode_limits.max_encoded_bytes < 1 || c.decode_limits.max_decoded_pixels < 1) {
    return absl::InvalidArgumentError("--max_encoded_bytes and --max_decoded_pixels must be >= 1");
  }

  return absl::OkStatus();
}

}  // namespace

absl::Status VisionService::ReadPreprocessing(const VisionConfig& vc) {
  const VisionServiceConfig& c = config_;
  absl::StatusOr<PreprocessorConfig> pp = LoadPreprocessorConfig(c.model_dir);
  if (!pp.ok()) return pp.status();
  if (pp->patch_size != vc.patch_size || pp->merge_size != vc.spatial_merge_size ||
      pp->temporal_patch_size != vc.temporal_patch_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "preprocessor_config.json (patch ", pp->patch_size, ", merge ", pp->merge_size,
        ", temporal ", pp->temporal_patch_size, ") disagrees with config.json vision_config (",
        vc.patch_size, ", ", vc.spatial_merge_size, ", ", vc.temporal_patch_size, ")"));
  }
  PreprocessOptions options;
  options.patch_size = static_cast<int>(pp->patch_size);
  options.merge_size = static_cast<int>(pp->merge_size);
  options.temporal_patch_size = static_cast<int>(pp->temporal_patch_size);
  options.rescale_factor = pp->do_rescale ? pp->rescale_factor : 1.0;
  for (int i = 0; i < 3; ++i) {
    options.image_mean[i] = pp->do_normalize ? static_cast<float>(pp->image_mean[i]) : 0.0f;
    options.image_std[i] = pp->do_normalize ? static_cast<float>(pp->image_std[i]) : 1.0f;
  }
  if (!pp->do_resize || !pp->do_convert_rgb || pp->resample != 3) {
    return absl::InvalidArgumentError(
        "preprocessor_config.json: only do_resize, do_convert_rgb and BICUBIC resampling (3) are "
        "supported");
  }
  // The largest budget: the checkpoint's maximum, and no more than what the
  // response limit carries, so that the features of every image a request may
  // ask for fit one message (an operator's explicit limit that cannot fit is a
  // start-up error rather than a refusal of some pictures later).
  const int64_t factor = int64_t{options.patch_size} * options.merge_size;
  const int64_t patch_area = int64_t{options.patch_size} * options.patch_size;
  const int64_t per_patch_bytes = FeatureBytesPerPatch(vc);
  const int64_t fitting_patches = (c.max_response_bytes - kResponseEnvelope) / per_patch_bytes;
  const int64_t min_default = std::max(pp->min_pixels, c.min_pixels_limit);
  int64_t max_limit = c.max_pixels_limit;
  if (max_limit > 0 &&
      !BudgetFitsPatches(factor, options.patch_size, min_default, max_limit, fitting_patches)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_pixels_limit=", max_limit, " allows images of up to ",
        LargestResizedArea(factor, std::min(min_default, max_limit), max_limit) / patch_area,
        " patches, whose features (", per_patch_bytes, " bytes per patch) do not fit "
        "--max_message_mb=", c.max_response_bytes >> 20, " (", fitting_patches,
        " patches); raise --max_message_mb or lower --max_pixels_limit to at most ",
        LargestFittingBudget(factor, options.patch_size, min_default, max_limit,
                             fitting_patches)));
  }
  if (max_limit == 0) {
    max_limit = LargestFittingBudget(factor, options.patch_size, min_default, pp->max_pixels,
                                     fitting_patches);
    if (max_limit == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--max_message_mb=", c.max_response_bytes >> 20,
          " cannot carry the features of even the smallest image; raise it"));
    }
    if (max_limit != pp->max_pixels) {
      LogInfo(kLog, "max_pixels_limit lowered so that the largest image's features fit a message",
              {{"checkpoint_max_pixels", static_cast<long long>(pp->max_pixels)},
               {"max_pixels_limit", static_cast<long long>(max_limit)},
               {"max_message_mb", static_cast<long long>(c.max_response_bytes >> 20)}});
    }
  }
  if (c.min_pixels_limit > max_limit) {
    return absl::InvalidArgumentError(absl::StrCat("--min_pixels_limit=", c.min_pixels_limit,
                                                   " exceeds the max_pixels limit ", max_limit));
  }
  config_.max_pixels_limit = max_limit;
  // Server defaults: --default_max_pixels (0 = the checkpoint's), inside the limits.
  const int64_t wanted_max = c.default_max_pixels > 0 ? c.default_max_pixels : pp->max_pixels;
  options.max_pixels = std::clamp(wanted_max, c.min_pixels_limit, max_limit);
  options.min_pixels = std::clamp(pp->min_pixels, c.min_pixels_limit, options.max_pixels);
  if (options.max_pixels != wanted_max || options.min_pixels != pp->min_pixels) {
    LogWarning(kLog, "pixel defaults clamped to the server limits",
               {{"checkpoint_min_pixels", static_cast<long long>(pp->min_pixels)},
                {"wanted_max_pixels", static_cast<long long>(wanted_max)},
                {"min_pixels", static_cast<long long>(options.min_pixels)},
                {"max_pixels", static_cast<long long>(options.max_pixels)}});
  }
  if (absl::Status s = ValidatePreprocessOptions(options); !s.ok()) return s;
  default_options_ = options;
  return absl::OkStatus();
}

absl::Status VisionService::LoadWeights(const ModelConfig& model_config) {
  const VisionServiceConfig& c = config_;
  {
    LoadPhaseTimer timer("vision_weights");
    absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> checkpoint =
        SafetensorsCheckpoint::Open(c.model_dir);
    if (!checkpoint.ok()) return checkpoint.status();
    checkpoint_ = std::move(*checkpoint);
    VisionModelOptions model_options;
    model_options.compute_dtype = c.compute_dtype;
    model_options.attention_query_tile = c.attention_query_tile;
    absl::StatusOr<std::unique_ptr<VisionModel>> model =
        VisionModel::Load(*checkpoint_, model_config, model_options);
    if (!model.ok()) return model.status();
    model_ = std::move(*model);
    LogInfo(kLog, "vision model loaded", {{"summary", model_->load_summary()}});
    metrics_->weights_borrowed.Set(static_cast<double>(model_->borrowed_weight_bytes()));
    metrics_->weights_converted.Set(static_cast<double>(model_->converted_weight_bytes()));
    metrics_->weights_packed.Set(static_cast<double>(model_->packed_weight_bytes()));
  }
  const FeatureDType cached_dtype = CachedDType(model_->compute_dtype());
  feature_dtype_size_ = FeatureDTypeSize(cached_dtype);

  return absl::OkStatus();
}

// Weights' headers + vision_config, preprocessing, compute dtype.
absl::Status VisionService::ComputeFingerprint(const std::string& config_json) {
  const PreprocessOptions& options = default_options_;
  const std::string prefix =
      checkpoint_->Has("model.visual.patch_embed.proj.weight") ? "model.visual." : "visual.";
  absl::StatusOr<std::string> component =
      ComponentFingerprint(config_json, *checkpoint_, "vision_config", prefix);
  if (!component.ok()) return component.status();
  fingerprint_ = Sha256Hex(absl::StrFormat(
      "vlm-vision-features v1\nweights %s\npreprocess patch=%d merge=%d temporal=%d "
      "rescale=%.17g mean=%.9g,%.9g,%.9g std=%.9g,%.9g,%.9g%s\ncompute %s\n",
      *component, options.patch_size, options.merge_size, options.temporal_patch_size,
      options.rescale_factor, options.image_mean[0], options.image_mean[1], options.image_mean[2],
      options.image_std[0], options.image_std[1], options.image_std[2],
      config_.jpeg_scaled_decode ? " jpeg_scaled_decode=2x" : "",
      ComputeDTypeName(model_->compute_dtype())));

  return absl::OkStatus();
}

absl::Status VisionService::StartCacheAndWorkers() {
  const VisionServiceConfig& c = config_;
  {
    LoadPhaseTimer timer("vision_cache");
    absl::StatusOr<std::unique_ptr<EmbeddingCache>> cache = EmbeddingCache::Create(c.cache);
    if (!cache.ok()) return cache.status();
    cache_ = std::move(*cache);
  }
  at::set_num_threads(c.intra_op_threads);
  pool_ = std::make_unique<EncodePool>(c.encode_workers, c.encode_queue_size, c.intra_op_threads,
                                       metrics_);

  return absl::OkStatus();
}

// One forward on a small generated image, on a worker, warmup_runs times.
absl::Status VisionService::WarmUp() {
  {
    LoadPhaseTimer timer("vision_warmup");
    absl::Status warm;
    const RgbImage card = WarmupImage(64, 48);
    std::function<void()> work = [&] {
      try {
        absl::StatusOr<PreprocessResult> pre = PreprocessImage(card, default_options_);
        if (!pre.ok()) {
          warm = pre.status();
          return;
        }
        const PreprocessedImage& p = pre->patches;
        at::Tensor pixels = at::from_blob(const_cast<float*>(p.pixel_values.data()),
                                          {p.num_patches(), p.patch_dim}, at::kFloat);
        const GridThw grid = {p.grid_t, p.grid_h, p.grid_w};
        absl::StatusOr<vlm::VisionFeatures> out = model_->Forward(pixels, {grid});
        warm = out.status();
      } catch (const std::exception& e) {
        warm = StatusFromException("warm-up", e);
      }
    };
    for (int run = 0; run < config_.warmup_runs; ++run) {
      if (absl::Status ran = pool_->Run(work, absl::InfiniteFuture(), {}); !ran.ok()) return ran;
      if (!warm.ok()) {
        return absl::Status(warm.code(), absl::StrCat("warm-up forward failed: ", warm.message()));
      }
    }
    LogInfo(kLog, "warm-up forward done", {{"seconds", timer.Stop()}});
  }

  return absl::OkStatus();
}

void VisionService::StartPublisher() {
  publisher_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(publisher_mu_);
    while (!publisher_cv_.wait_for(lock, std::chrono::seconds(1), [&] { return stop_publisher_; })) {
      lock.unlock();
      PublishCacheStats();
      lock.lock();
    }
  });
}

absl::Status VisionService::Load() {
  if (loaded() || model_ != nullptr) return absl::FailedPreconditionError("Load called twice");
  if (absl::Status s = CheckServiceConfig(config_); !s.ok()) return s;
  // The GEMM path (AMX only where a start-up check verified it), before packing.
  if (auto k = kernels::ChooseKernelPathAtStartup(kLog); !k.ok()) return k.status();
  LogInfo(kLog, "loading the vision encoder", {{"config", config_.Describe()}});
  LoadPhaseTimer config_timer("vision_config");
  absl::StatusOr<std::string> config_json = ReadFileToString(config_.model_dir + "/config.json");
  if (!config_json.ok()) return config_json.status();
  absl::StatusOr<ModelConfig> model_config = ParseModelConfig(*config_json);
  if (!model_config.ok()) return model_config.status();
  if (absl::Status s = ReadPreprocessing(model_config->vision); !s.ok()) return s;
  config_timer.Stop();
  if (absl::Status s = LoadWeights(*model_config); !s.ok()) return s;
  if (absl::Status s = ComputeFingerprint(*config_json); !s.ok()) return s;
  if (absl::Status s = StartCacheAndWorkers(); !s.ok()) return s;
  if (absl::Status s = WarmUp(); !s.ok()) return s;
  StartPublisher();
  LogInfo(kLog, "vision encoder ready",
          {{"fingerprint", fingerprint_},
           {"default_min_pixels", static_cast<long long>(default_options_.min_pixels)},
           {"default_max_pixels", static_cast<long long>(default_options_.max_pixels)},
           {"max_pixels_limit", static_cast<long long>(config_.max_pixels_limit)},
           {"replica", config_.replica_name}});
  loaded_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------

absl::StatusOr<PreprocessOptions> VisionService::EffectiveOptions(int64_t min_pixels,
                                                                  int64_t max_pixels) const {
  return ResolvePixelBudget(default_options_, config_.min_pixels_limit, config_.max_pixels_limit,
                            min_pixels, max_pixels);
}

absl::Status VisionService::CheckResponseFits(int64_t patches, size_t dtype_size) const {
  const int64_t bytes =
      patches * FeatureBytesPerPatch(model_->config()) / 2 * static_cast<int64_t>(dtype_size);
  if (bytes + kResponseEnvelope > config_.max_response_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the features of this image (", patches, " patches, ", bytes,
        " bytes) exceed the response limit of ", config_.max_response_bytes,
        " bytes (--max_message_mb); ask for a smaller max_pixels or the BF16 dtype"));
  }
  return absl::OkStatus();
}

absl::StatusOr<FeaturesPtr> VisionService::Compute(std::string_view bytes,
                                                   const PreprocessOptions& options,
                                                   const CacheKeyContext& key_context,
                                                   PixelKeyProbe* probe, absl::Time deadline,
                                                   EncodeOutcome* outcome) const {
  // decode (limits from the header first); a JPEG far above its budget at a
  // reduced DCT scale, still twice the resized size per side
  const int64_t factor = int64_t{options.patch_size} * options.merge_size;
  DecodeSizeHint min_size;
  if (config_.jpeg_scaled_decode) {
    min_size = [&](int64_t width, int64_t height) -> std::pair<int64_t, int64_t> {
      absl::StatusOr<ImageSize> size =
          SmartResize(height, width, factor, options.min_pixels, options.max_pixels);
      if (!size.ok()) return {width, height};
      return {std::min(width, 2 * size->width), std::min(height, 2 * size->height)};
    };
  }
  auto start = std::chrono::steady_clock::now();
  absl::StatusOr<DecodedImage> decoded = DecodeImage(Absl(bytes), config_.decode_limits, min_size);
  if (!decoded.ok()) return decoded.status();
  const RgbImage& image = decoded->image;
  const int64_t width = decoded->source_width, height = decoded->source_height;
  outcome->decode_ms = MsSince(start);
  if (width < config_.min_image_side || height < config_.min_image_side) {
    return absl::InvalidArgumentError(absl::StrCat(
        "image is ", width, "x", height, " pixels; min_image_side is ",
        config_.min_image_side, " (--min_image_side=1 accepts it and upscales like HF)"));
  }
  // Size checks before anything is cached or computed (aspect ratio, response size).
  absl::StatusOr<ImageSize> size =
      SmartResize(height, width, factor, options.min_pixels, options.max_pixels);
  if (!size.ok()) return size.status();
  const int64_t patches = (size->height / options.patch_size) * (size->width / options.patch_size);
  if (absl::Status s = CheckResponseFits(patches, feature_dtype_size_); !s.ok()) return s;

  // the same picture in another container? (A reduced-scale decode is keyed
  // with its stored size too: that size decides the grid.)
  if (probe != nullptr) {
    CacheKeyContext pixel_context = key_context;
    if (decoded->scale_num != 8) {
      absl::StrAppend(&pixel_context.model_fingerprint, " decoded at ", decoded->scale_num,
                      "/8 of ", width, "x", height);
    }
    absl::StatusOr<FeaturesPtr> hit =
        probe->Find(KeyForPixels(Std(image.bytes()), image.width, image.height, pixel_context));
    if (!hit.ok()) return hit.status();
    if (*hit != nullptr) return *hit;
  }
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError("deadline passed before the ViT forward started");
  }

  // preprocess
  start = std::chrono::steady_clock::now();
  absl::StatusOr<PreprocessResult> pre = PreprocessImage(image, options, width, height);
  if (!pre.ok()) return pre.status();
  const PreprocessedImage& p = pre->patches;
  outcome->preprocess_ms = MsSince(start);

  // ViT
  start = std::chrono::steady_clock::now();
  auto features = std::make_shared<CachedFeatures>();
  try {
    at::Tensor pixels = at::from_blob(const_cast<float*>(p.pixel_values.data()),
                                      {p.num_patches(), p.patch_dim}, at::kFloat);
    const GridThw grid = {p.grid_t, p.grid_h, p.grid_w};
    absl::StatusOr<vlm::VisionFeatures> out = model_->Forward(pixels, {grid});
    if (!out.ok()) return out.status();
    const FeatureDType dtype = CachedDType(model_->compute_dtype());
    features->grid_t = p.grid_t;
    features->grid_h = p.grid_h;
    features->grid_w = p.grid_w;
    features->last_hidden = ToFeatureTensor(out->last_hidden, dtype);
    for (const at::Tensor& tap : out->deepstack) {
      features->deepstack.push_back(ToFeatureTensor(tap, dtype));
    }
  } catch (const std::exception& e) {
    return StatusFromException("vision encode", e);
  }
  features->content_hash = outcome->content_hash;
  outcome->encode_ms = MsSince(start);
  return FeaturesPtr(std::move(features));
}

absl::StatusOr<EncodeOutcome> VisionService::EncodeImage(const EncodeCall& call) {
  const auto start = std::chrono::steady_clock::now();
  if (!loaded()) return absl::UnavailableError("vision encoder is still loading");
  metrics_->images_in_flight.Increment();
  struct InFlight {
    Metrics* m;
    ~InFlight() { m->images_in_flight.Decrement(); }
  } in_flight{metrics_};

  absl::StatusOr<EncodeOutcome> result = [&]() -> absl::StatusOr<EncodeOutcome> {
    absl::StatusOr<PreprocessOptions> options = EffectiveOptions(call.min_pixels, call.max_pixels);
    if (!options.ok()) return options.status();
    CacheKeyContext key_context{options->min_pixels, options->max_pixels, fingerprint_};
    WaitOptions wait{call.deadline, call.is_cancelled};
    EncodeOutcome outcome;
    outcome.min_pixels = options->min_pixels;
    outcome.max_pixels = options->max_pixels;

    if (call.by_hash) {
      absl::StatusOr<Sha256Digest> digest = ParseContentHash(call.content_hash);
      if (!digest.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("content_hash: ", digest.status().message()));
      }
      outcome.content_hash = HexEncode(*digest);
      absl::StatusOr<CacheResult> found = cache_->Lookup(KeyForContentHash(*digest, key_context), wait);
      if (!found.ok()) {
        if (absl::IsNotFound(found.status())) {
          return absl::NotFoundError(absl::StrCat(
              "no cached features for content_hash ", outcome.content_hash, " with min_pixels ",
              options->min_pixels, " and max_pixels ", options->max_pixels,
              " on this replica; send the image bytes"));
        }
        return found.status();
      }
      outcome.features = found->features;
      outcome.level = found->coalesced && found->level == CacheLevel::kMiss ? CacheLevel::kMemory
                                                                            : found->level;
    } else {
      // Refuse what cannot be decoded before hashing or queueing it.
      const ImageFormat format = SniffImageFormat(Absl(call.image_bytes));
      if (call.image_bytes.empty() || !IsDecodable(format) ||
          static_cast<int64_t>(call.image_bytes.size()) > config_.decode_limits.max_encoded_bytes) {
        absl::StatusOr<DecodedImage> refused = DecodeImage(Absl(call.image_bytes), config_.decode_limits);
        if (!refused.ok()) return refused.status();
      }
      const Sha256Digest digest = Sha256(call.image_bytes);
      outcome.content_hash = HexEncode(digest);
      const PreprocessOptions& opts = *options;
      ComputeFn compute = [&](PixelKeyProbe& probe) -> absl::StatusOr<FeaturesPtr> {
        absl::StatusOr<FeaturesPtr> computed = absl::InternalError("encode did not run");
        std::function<void()> work = [&] {
          try {
            computed = Compute(call.image_bytes, opts, key_context, &probe, call.deadline, &outcome);
          } catch (const std::exception& e) {
            computed = StatusFromException("vision encode", e);
          }
        };
        if (absl::Status ran = pool_->Run(work, call.deadline, call.is_cancelled); !ran.ok()) {
          return ran;
        }
        return computed;
      };
      absl::StatusOr<CacheResult> got =
          cache_->GetOrCompute(KeyForContentHash(digest, key_context), compute, wait);
      if (!got.ok()) return got.status();
      outcome.features = got->features;
      outcome.level = got->coalesced && got->level == CacheLevel::kMiss ? CacheLevel::kMemory
                                                                        : got->level;
    }
    return outcome;
  }();

  if (result.ok()) {
    result->total_ms = MsSince(start);
    if (result->decode_ms > 0) metrics_->decode_seconds.Observe(result->decode_ms / 1e3);
    if (result->preprocess_ms > 0) {
      metrics_->preprocess_seconds.Observe(result->preprocess_ms / 1e3);
    }
    if (result->encode_ms > 0) metrics_->encode_seconds.Observe(result->encode_ms / 1e3);
  } else if (absl::IsInvalidArgument(result.status())) {
    metrics_->bad_images.Increment();
    LogDebug(kLog, "image refused", {{"error", std::string(result.status().message())}});
  } else if (!absl::IsNotFound(result.status()) && !absl::IsDeadlineExceeded(result.status()) &&
             !absl::IsCancelled(result.status()) && !absl::IsResourceExhausted(result.status())) {
    LogWarning(kLog, "encode failed", {{"error", result.status().ToString()}});
  }
  PublishCacheStats();
  return result;
}

absl::Status VisionService::FillResponse(const EncodeOutcome& outcome, v1::DType dtype,
                                         v1::EncodeResponse* response) const {
  const CachedFeatures& f = *outcome.features;
  if (absl::Status s = CheckResponseFits(f.grid_t * f.grid_h * f.grid_w, WireDTypeSize(dtype));
      !s.ok()) {
    return s;
  }
  v1::VisionFeatures* features = response->mutable_features();
  features->mutable_grid()->set_t(f.grid_t);
  features->mutable_grid()->set_h(f.grid_h);
  features->mutable_grid()->set_w(f.grid_w);
  if (absl::Status s = ToWire(f.last_hidden, dtype, features->mutable_last_hidden()); !s.ok()) {
    return s;
  }
  for (const FeatureTensor& tap : f.deepstack) {
    if (absl::Status s = ToWire(tap, dtype, features->add_deepstack()); !s.ok()) return s;
  }
  features->set_content_hash(outcome.content_hash);
  features->set_model_fingerprint(fingerprint_);
  switch (outcome.level) {
    case CacheLevel::kMiss: response->set_cache(v1::CACHE_LEVEL_MISS); break;
    case CacheLevel::kMemory: response->set_cache(v1::CACHE_LEVEL_MEMORY); break;
    case CacheLevel::kPixels: response->set_cache(v1::CACHE_LEVEL_PIXELS); break;
    case CacheLevel::kDisk: response->set_cache(v1::CACHE_LEVEL_DISK); break;
  }
  v1::EncodeTimings* timings = response->mutable_timings();
  timings->set_decode_ms(outcome.decode_ms);
  timings->set_preprocess_ms(outcome.preprocess_ms);
  timings->set_encode_ms(outcome.encode_ms);
  timings->set_total_ms(outcome.total_ms);
  response->set_replica(config_.replica_name);
  response->mutable_options()->set_min_pixels(outcome.min_pixels);
  response->mutable_options()->set_max_pixels(outcome.max_pixels);
  return absl::OkStatus();
}

grpc::Status VisionService::Encode(grpc::ServerContext* context, const v1::EncodeRequest* request,
                                   v1::EncodeResponse* response) {
  if (readiness_ != nullptr) {
    if (grpc::Status s = readiness_->CheckGrpc(kServiceName); !s.ok()) return s;
  }
  const auto start = std::chrono::steady_clock::now();
  v1::DType dtype = request->dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_BF16 : request->dtype();
  if (WireDTypeSize(dtype) == 0) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("dtype ", static_cast<int>(request->dtype()), " is not BF16, F16 or F32")));
  }
  EncodeCall call;
  switch (request->source_case()) {
    case v1::EncodeRequest::kImage: call.image_bytes = request->image(); break;
    case v1::EncodeRequest::kContentHash:
      call.by_hash = true;
      call.content_hash = request->content_hash();
      break;
    default:
      return ToGrpcStatus(
          absl::InvalidArgumentError("EncodeRequest needs either image bytes or a content_hash"));
  }
  call.min_pixels = request->options().min_pixels();
  call.max_pixels = request->options().max_pixels();
  const auto deadline = context->deadline();
  call.deadline = deadline == std::chrono::system_clock::time_point::max()
                      ? absl::InfiniteFuture()
                      : absl::FromChrono(deadline);
  call.is_cancelled = [context] { return context->IsCancelled(); };
  absl::StatusOr<EncodeOutcome> outcome = EncodeImage(call);
  if (!outcome.ok()) return ToGrpcStatus(outcome.status());
  outcome->total_ms = MsSince(start);
  return ToGrpcStatus(FillResponse(*outcome, dtype, response));
}

absl::StatusOr<v1::ImageBudget> VisionService::ImageBudget() const {
  if (!loaded()) return absl::UnavailableError("vision encoder is still loading");
  const PreprocessOptions& o = default_options_;
  v1::ImageBudget budget;
  budget.set_default_min_pixels(o.min_pixels);
  budget.set_default_max_pixels(o.max_pixels);
  budget.set_min_pixels_limit(config_.min_pixels_limit);
  budget.set_max_pixels_limit(config_.max_pixels_limit);
  budget.set_patch_size(o.patch_size);
  budget.set_merge_size(o.merge_size);
  budget.set_temporal_patch_size(o.temporal_patch_size);
  budget.set_max_aspect_ratio(config_.decode_limits.max_aspect_ratio);
  return budget;
}

grpc::Status VisionService::GetImageBudget(grpc::ServerContext* /*context*/,
                                           const v1::ImageBudgetRequest* /*request*/,
                                           v1::ImageBudget* response) {
  absl::StatusOr<v1::ImageBudget> budget = ImageBudget();
  if (!budget.ok()) return ToGrpcStatus(budget.status());
  *response = *std::move(budget);
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------
// Cache statistics -> metrics
// ---------------------------------------------------------------------------

EmbeddingCacheStats VisionService::cache_stats() const {
  return cache_ ? cache_->Stats() : EmbeddingCacheStats{};
}

void VisionService::PublishCacheStats() {
  if (!cache_) return;
  std::lock_guard<std::mutex> lock(stats_mu_);
  const EmbeddingCacheStats s = cache_->Stats();
  EmbeddingCacheStats& p = published_;
  auto add = [](prometheus::Counter& counter, uint64_t now, uint64_t& before) {
    if (now > before) counter.Increment(static_cast<double>(now - before));
    before = now;
  };
  Metrics& m = *metrics_;
  add(m.hits_memory, s.memory_hits, p.memory_hits);
  add(m.hits_pixels, s.pixel_hits, p.pixel_hits);
  add(m.hits_disk, s.disk_hits, p.disk_hits);
  add(m.misses, s.misses, p.misses);
  add(m.coalesced, s.coalesced, p.coalesced);
  add(m.not_found, s.not_found, p.not_found);
  add(m.failures, s.compute_failures, p.compute_failures);
  add(m.evictions_memory, s.evictions, p.evictions);
  add(m.evictions_disk, s.disk_evictions, p.disk_evictions);
  add(m.expirations, s.expirations, p.expirations);
  add(m.disk_errors, s.disk_errors, p.disk_errors);
  add(m.disk_corrupt, s.disk_corrupt, p.disk_corrupt);
  add(m.disk_writes, s.disk_writes, p.disk_writes);
  add(m.disk_writes_dropped, s.disk_writes_dropped, p.disk_writes_dropped);
  m.bytes_memory.Set(static_cast<double>(s.memory_bytes));
  m.bytes_disk.Set(static_cast<double>(s.disk_bytes));
  m.entries_memory.Set(static_cast<double>(s.memory_entries));
  m.entries_disk.Set(static_cast<double>(s.disk_files));
}

}  // namespace vlm::vision
