// vlm-language: the language service (projector + Qwen3 decoder, streaming
// generation) over gRPC. See architecture.md and language_service.h.
//
//   vlm-language --model_dir=/models/qwen3-vl-2b
//
// gRPC on :50053 and metrics on :9092 by default, so that the three services
// started with their defaults on one host find each other (the gateway expects
// language on 127.0.0.1:50053). Flags: --helpfull.
//
// Test hook (environment, not a flag): VLM_TEST_WARMUP_DELAY_MS delays the
// end of the warm-up, for tests of readiness gating.
#include <ATen/Parallel.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/cpu_features.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/omp_wait_policy.h"
#include "common/server.h"
#include "services/language/language_service.h"

ABSL_FLAG(std::string, model_dir, "", "Qwen3-VL checkpoint directory (config, safetensors, tokenizer)");
ABSL_FLAG(std::string, compute_dtype, "bf16",
          "bf16 or f32; bf16 falls back to f32 on CPUs without fast bf16 matmuls");
ABSL_FLAG(bool, eager_load, false, "materialize every decoder layer at startup instead of on first use");
ABSL_FLAG(int, resident_layers, 0,
          "most decoder layers kept resident (LRU pages dropped beyond); 0 = no bound");
ABSL_FLAG(int, prefetch_layers, 1, "decoder layers prepared ahead by the background thread; 0 = off");
ABSL_FLAG(int, max_sequences, 8, "sequences per engine batch (running at once)");
ABSL_FLAG(int, max_queue, 16,
          "generations admitted beyond the running ones; beyond: RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_batch_tokens, 512,
          "tokens per engine iteration (decode tokens + prefill chunks)");
ABSL_FLAG(int64_t, kv_cache_mb, 2048, "paged KV cache budget in MiB (blocks are printed at startup)");
ABSL_FLAG(int64_t, kv_block_size, 16, "tokens per KV cache block");
ABSL_FLAG(bool, prefix_cache, true, "reuse the KV of cached prompt prefixes (text and images)");
ABSL_FLAG(int64_t, max_context, 8192, "prompt + completion tokens per sequence (KV cache size)");
ABSL_FLAG(std::string, matmul, "auto",
          "decoder projections in bf16: kernels (packed weights, the project's GEMM for prefill "
          "and decode rows; needs AVX-512 BF16 or AMX), torch (at::linear + vlm::Gemv), auto "
          "(kernels where available); f32 compute always uses at::linear");
ABSL_FLAG(std::string, weight_dtype, "bf16",
          "decoder projection weights: bf16, int8 (one scale per group of 32) or int4 (4-bit, "
          "one scale and zero point per group of 32; LM head int4, the first "
          "--int4_int8_layers layers int8), quantized at layer materialization or pack time; "
          "needs --compute_dtype bf16; ignores --matmul");
ABSL_FLAG(int, int4_int8_layers, vlm::language::kAutoInt4Int8Layers,
          "with --weight_dtype int4: how many leading decoder layers stay int8 (their rounding "
          "error grows through every later layer); -1 = one layer in seven, rounded up (4 of "
          "the 2B's 28); 0 = every layer int4");
ABSL_FLAG(bool, int8_prefill_gemm, true,
          "with --weight_dtype int8: prefill rows on the bf16 GEMM over int8 weights converted "
          "per call (faster where prefill is compute-bound); false: the int8 GEMV like decode rows");
ABSL_FLAG(std::string, packed_cache_dir, vlm::language::DefaultPackedCacheDir(),
          "directory of packed-weight files: the converted decoder layers and LM head (packed "
          "bf16 panels, int8, int4) written on a checkpoint's first start and mapped read-only by later "
          "starts and replicas; empty = convert in memory at every start (default "
          "$VLM_PACKED_CACHE_DIR, else $VLM_CACHE_DIR/packed, else ~/.cache/vlm/packed)");
ABSL_FLAG(bool, pack_only, false,
          "build the packed-weight file for --model_dir and the weight flags into "
          "--packed_cache_dir, then exit (0 when the file is there); for an init container");
ABSL_FLAG(int, intra_op_threads, 0,
          "compute threads (the kernels' pool and LibTorch intra-op); 0 = the cores this "
          "process may use (CPU affinity, capped by a cgroup CPU quota)");

namespace {

constexpr char kLog[] = "language";

// VLM_TEST_WARMUP_DELAY_MS: milliseconds, >= 0; anything else is a startup error.
absl::StatusOr<absl::Duration> TestWarmupDelay() {
  std::optional<std::string> value = vlm::GetEnv("VLM_TEST_WARMUP_DELAY_MS");
  if (!value.has_value() || value->empty()) return absl::ZeroDuration();
  int ms = 0;
  if (!absl::SimpleAtoi(*value, &ms) || ms < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("VLM_TEST_WARMUP_DELAY_MS=\"", *value, "\" is not a number of milliseconds"));
  }
  return absl::Milliseconds(ms);
}

int Run() {
  using vlm::language::LanguageServiceOptions;
  LanguageServiceOptions options;
  options.model_dir = absl::GetFlag(FLAGS_model_dir);
  absl::StatusOr<vlm::ComputeDType> dtype =
      vlm::ParseComputeDType(absl::GetFlag(FLAGS_compute_dtype));
  if (!dtype.ok()) {
    vlm::LogError(kLog, "bad --compute_dtype", {{"error", dtype.status().ToString()}});
    return 2;
  }
  options.compute_dtype = *dtype;
  options.eager_load = absl::GetFlag(FLAGS_eager_load);
  options.resident_layers = absl::GetFlag(FLAGS_resident_layers);
  options.prefetch_layers = absl::GetFlag(FLAGS_prefetch_layers);
  options.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  options.max_queue = absl::GetFlag(FLAGS_max_queue);
  options.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.kv_cache_mb = absl::GetFlag(FLAGS_kv_cache_mb);
  options.kv_block_size = absl::GetFlag(FLAGS_kv_block_size);
  options.prefix_cache = absl::GetFlag(FLAGS_prefix_cache);
  options.max_context = absl::GetFlag(FLAGS_max_context);
  absl::StatusOr<vlm::language::MatmulPath> matmul =
      vlm::language::ParseMatmulPath(absl::GetFlag(FLAGS_matmul));
  if (!matmul.ok()) {
    vlm::LogError(kLog, "bad --matmul", {{"error", matmul.status().ToString()}});
    return 2;
  }
  options.matmul = *matmul;
  absl::StatusOr<vlm::language::WeightDType> weight_dtype =
      vlm::language::ParseWeightDType(absl::GetFlag(FLAGS_weight_dtype));
  if (!weight_dtype.ok()) {
    vlm::LogError(kLog, "bad --weight_dtype", {{"error", weight_dtype.status().ToString()}});
    return 2;
  }
  options.weight_dtype = *weight_dtype;
  options.int8_prefill_gemm = absl::GetFlag(FLAGS_int8_prefill_gemm);
  options.int4_int8_layers = absl::GetFlag(FLAGS_int4_int8_layers);
  options.packed_cache_dir = absl::GetFlag(FLAGS_packed_cache_dir);
  absl::StatusOr<absl::Duration> warmup_delay = TestWarmupDelay();
  if (!warmup_delay.ok()) {
    vlm::LogError(kLog, "bad test hook", {{"error", warmup_delay.status().ToString()}});
    return 2;
  }
  options.warmup_delay = *warmup_delay;
  if (options.model_dir.empty() || options.max_sequences < 1 || options.max_queue < 0 ||
      options.max_context < 2 || options.resident_layers < 0 || options.max_batch_tokens < 1 ||
      options.kv_cache_mb < 1 || options.kv_block_size < 1) {
    vlm::LogError(kLog, "bad flags: need --model_dir, --max_sequences >= 1, --max_queue >= 0, "
                        "--max_context >= 2, --resident_layers >= 0, --max_batch_tokens >= 1, "
                        "--kv_cache_mb >= 1, --kv_block_size >= 1");
    return 2;
  }
  int threads = absl::GetFlag(FLAGS_intra_op_threads);
  if (threads <= 0) threads = vlm::UsableCores();
  at::set_num_threads(threads);
  vlm::LogInfo(kLog, "cpu", {{"features", vlm::GetCpuFeatures().Describe()},
                             {"intra_op_threads", threads},
                             {"omp_wait_policy", vlm::OmpWaitPolicy()}});

  if (absl::GetFlag(FLAGS_pack_only)) {
    vlm::Readiness readiness;
    vlm::language::LanguageService service(&readiness, options);
    if (absl::Status s = service.PackOnly(); !s.ok()) {
      vlm::LogError(kLog, "pack failed", {{"error", s.ToString()}});
      return 1;
    }
    return 0;
  }

  const std::string name = vlm::language::kLanguageServiceName;
  vlm::Server server(vlm::ServerOptions::FromFlags());
  vlm::language::LanguageService service(&server.readiness(), options);
  server.AddService(&service, name, "warming up: starting");
  if (absl::Status s = server.Start(); !s.ok()) {
    vlm::LogError(kLog, "cannot start", {{"error", s.ToString()}});
    return 1;
  }
  std::thread loader([&] {
    absl::Status loaded = service.Load();
    if (loaded.ok()) {
      server.readiness().SetServing(name);
      vlm::LogInfo(kLog, "serving");
    } else {
      vlm::LogError(kLog, "load failed", {{"error", loaded.ToString()}});
      server.Shutdown(loaded);
    }
  });
  absl::Status done = server.Wait();
  loader.join();
  return done.ok() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  vlm::EnsureOmpWaitPolicy(argv);  // before any thread: see omp_wait_policy.h
  absl::SetFlag(&FLAGS_grpc_address, "0.0.0.0:50053");
  absl::SetFlag(&FLAGS_metrics_address, "0.0.0.0:9092");
  vlm::ParseCommandLine(argc, argv, "vlm-language: projector + Qwen3 decoder, streaming generation");
  vlm::LogEffectiveConfiguration(kLog);
  return Run();
}
