// vlm-bench-vision: the vision encoder on a real-shape checkpoint.
//
//   vlm-bench-vision --model_dir=DIR [--bench_threads=2] [--bench_runs=5]
//                    [--bench_sizes=448,1024,1448] [--bench_hit_requests=50]
//                    [--bench_libtorch_path=false]
//                    [--compute_dtype=bfloat16] (and every vlm-vision flag)
//
// Prints one table:
//   - encode time per image size (median of --bench_runs in-process calls,
//     after one warm-up call): preprocessing and the ViT forward separately,
//     the forward both through the project's kernels (the service's model,
//     --vision_kernels) and through the previous LibTorch path (a second model
//     loaded with use_kernels=false), interleaved run by run;
//   - the ViT's FLOPs from the shapes (patch embed; per block qkv, attention
//     scores and values, proj, MLP) and the compute bound = FLOPs / the
//     machine's bf16 matmul FLOP/s, measured with at::matmul in the same run
//     on the same threads just before and after each row (the machine may be
//     shared: the rate is taken under the same conditions as the encodes);
//     ratio = forward time / bound;
//   - cache-hit latency of Encode through a real gRPC server on loopback
//     (same bytes -> MEMORY hit; content_hash alone), median and p90;
//   - resident memory after loading and the peak.
#include <grpcpp/grpcpp.h>
#include <png.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/cpu_features.h"
#include "common/flags.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "common/omp_wait_policy.h"
#include "common/safetensors.h"
#include "common/server.h"
#include "common/sha256.h"
#include "services/vision/preprocess.h"
#include "services/vision/vision_model.h"
#include "services/vision/vision_service.h"
#include "vlm/v1/vision.grpc.pb.h"
#include "scripts/bench/bench_util.h"

ABSL_FLAG(int, bench_threads, 2, "intra-op threads for the matmul bound and the encodes");
ABSL_FLAG(int, bench_runs, 5, "timed encodes per size (after one warm-up); the median is shown");
ABSL_FLAG(std::string, bench_sizes, "448,1024,1448",
          "square image sides to encode, each at its own size (448^2, 1 MP, 2 MP by default; "
          "the budget is the side^2, up to the server's max_pixels_limit)");
ABSL_FLAG(bool, bench_libtorch_path, true,
          "also time the LibTorch path (a second model) for comparison; false halves the run");
ABSL_FLAG(int, bench_hit_requests, 50, "gRPC cache-hit requests timed per kind");

namespace {

using Clock = std::chrono::steady_clock;

// CPU time of the calling thread: with --bench_threads=1 every step of both
// paths runs on this thread, and time spent descheduled (a shared machine)
// does not count.
double ThreadCpuNow() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  return v[i];
}

using vlm::bench::Median;

// A photo-like test card: gradients plus texture, so PNG does not collapse it.
vlm::vision::RgbImage TestImage(int side, int seed) {
  vlm::vision::RgbImage image;
  image.width = image.height = side;
  image.pixels.resize(static_cast<size_t>(side) * side * 3);
  uint32_t state = 2463534242u + seed;
  for (int y = 0; y < side; ++y) {
    for (int x = 0; x < side; ++x) {
      state ^= state << 13;
      state ^= state >> 17;
      state ^= state << 5;
      uint8_t* p = &image.pixels[(static_cast<size_t>(y) * side + x) * 3];
      p[0] = static_cast<uint8_t>(x * 255 / side);
      p[1] = static_cast<uint8_t>(y * 255 / side);
      p[2] = static_cast<uint8_t>(((x / 8 + y / 8) & 1) * 128 + (state & 63));
    }
  }
  return image;
}

std::string EncodePng(const vlm::vision::RgbImage& image) {
  png_image png;
  std::memset(&png, 0, sizeof(png));
  png.version = PNG_IMAGE_VERSION;
  png.width = image.width;
  png.height = image.height;
  png.format = PNG_FORMAT_RGB;
  png_alloc_size_t size = 0;
  png_image_write_to_memory(&png, nullptr, &size, 0, image.pixels.data(), 0, nullptr);
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&png, out.data(), &size, 0, image.pixels.data(), 0, nullptr)) {
    return "";
  }
  out.resize(size);
  return out;
}

// FLOPs of one ViT forward over one image of `n` patches (multiply-add = 2).
struct VitFlops {
  double patch_embed = 0, linear = 0, attention = 0;
  double total() const { return patch_embed + linear + attention; }
};
VitFlops CountFlops(const vlm::VisionConfig& c, int64_t patch_dim, double n) {
  const double d = static_cast<double>(c.hidden_size);
  const double inter = static_cast<double>(c.intermediate_size);
  VitFlops f;
  f.patch_embed = 2 * n * patch_dim * d;
  const double qkv = 2 * n * d * 3 * d;
  const double proj = 2 * n * d * d;
  const double mlp = 2 * n * d * inter * 2;
  const double scores = 2 * n * n * d;  // all heads: heads x n x n x head_dim
  const double values = 2 * n * n * d;
  f.linear = c.depth * (qkv + proj + mlp);
  f.attention = c.depth * (scores + values);
  return f;
}

// The machine's bf16 matmul rate on the current threads: best of a few GEMM
// shapes the ViT runs (1024^3; the MLP's 4096x1024x4096).
double MeasureMatmulFlops(at::ScalarType dtype) {
  const auto opts = at::TensorOptions().dtype(dtype);
  double best = 0;
  for (auto [m, k, n] : {std::array<int64_t, 3>{1024, 1024, 1024},
                         std::array<int64_t, 3>{4096, 1024, 4096}}) {
    at::Tensor a = at::randn({m, k}, opts), b = at::randn({k, n}, opts);
    at::matmul(a, b);  // warm-up (oneDNN primitive creation)
    std::vector<double> times;
    for (int i = 0; i < 7; ++i) {
      const auto t0 = Clock::now();
      at::Tensor c = at::matmul(a, b);
      times.push_back(Seconds(t0));
    }
    best = std::max(best, 2.0 * m * k * n / Median(times));
  }
  return best;
}

std::string Mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.0f MiB", bytes / 1048576.0);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  vlm::EnsureOmpWaitPolicy(argv);  // as the vision service runs: see omp_wait_policy.h
  vlm::ParseCommandLine(argc, argv, "vlm-bench-vision: ViT encode time vs the matmul bound");
  const int threads = absl::GetFlag(FLAGS_bench_threads);
  const int runs = std::max(1, absl::GetFlag(FLAGS_bench_runs));
  std::vector<int> sizes;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_bench_sizes), ',')) {
    int side = 0;
    if (!absl::SimpleAtoi(s, &side) || side < 32) {
      std::fprintf(stderr, "bad --bench_sizes entry \"%s\"\n", std::string(s).c_str());
      return 2;
    }
    sizes.push_back(side);
  }
  absl::StatusOr<vlm::vision::VisionServiceConfig> config =
      vlm::vision::VisionServiceConfig::FromFlags();
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 2;
  }
  if (config->model_dir.empty()) {
    std::fprintf(stderr, "--model_dir is required (e.g. a checkpoint from "
                         "vlm-make-checkpoint --preset 2b)\n");
    return 2;
  }
  config->intra_op_threads = threads;
  config->encode_workers = 1;
  at::set_num_threads(threads);

  // --- load -------------------------------------------------------------
  const auto load_start = Clock::now();
  vlm::vision::VisionService service(*config, nullptr);
  if (absl::Status s = service.Load(); !s.ok()) {
    std::fprintf(stderr, "load: %s\n", s.ToString().c_str());
    return 1;
  }
  const double load_s = Seconds(load_start);
  const vlm::ProcessMemory after_load = vlm::ReadProcessMemory().value_or(vlm::ProcessMemory{});
  const vlm::VisionModel& model = *service.model();
  const at::ScalarType dtype =
      model.compute_dtype() == vlm::ComputeDType::kBFloat16 ? at::kBFloat16 : at::kFloat;

  std::printf("vlm-bench-vision\n");
  std::printf("model %s\ncpu: %s\ncompute %s, %d intra-op thread(s), median of %d run(s) after 1 "
              "warm-up\n",
              config->model_dir.c_str(), vlm::GetCpuFeatures().Describe().c_str(),
              vlm::ComputeDTypeName(model.compute_dtype()), threads, runs);
  std::printf("load + warm-up %.2f s; %s\n", load_s, model.load_summary().c_str());
  // The previous path, for comparison: same checkpoint, LibTorch for every step.
  absl::StatusOr<std::unique_ptr<vlm::SafetensorsCheckpoint>> checkpoint =
      vlm::SafetensorsCheckpoint::Open(config->model_dir);
  absl::StatusOr<vlm::ModelConfig> model_config = vlm::LoadModelConfig(config->model_dir);
  if (!checkpoint.ok() || !model_config.ok()) {
    std::fprintf(stderr, "open %s: %s\n", config->model_dir.c_str(),
                 (!checkpoint.ok() ? checkpoint.status() : model_config.status()).ToString().c_str());
    return 1;
  }
  const bool compare = absl::GetFlag(FLAGS_bench_libtorch_path);
  vlm::VisionModelOptions old_options;
  old_options.compute_dtype = config->compute_dtype;
  old_options.attention_query_tile = config->attention_query_tile;
  old_options.use_kernels = false;
  absl::StatusOr<std::unique_ptr<vlm::VisionModel>> old_model =
      compare ? vlm::VisionModel::Load(**checkpoint, *model_config, old_options)
              : absl::StatusOr<std::unique_ptr<vlm::VisionModel>>(nullptr);
  if (!old_model.ok()) {
    std::fprintf(stderr, "load (LibTorch path): %s\n", old_model.status().ToString().c_str());
    return 1;
  }
  std::printf(compare ? "new = %s; old = LibTorch (at::linear, tiled attention)\n"
                      : "new = %s; old = not run (--bench_libtorch_path=false)\n",
              model.uses_kernels() ? "project kernels (packed GEMM, flash attention)"
                                   : "LibTorch too (kernels not in use here)");
  std::printf("bound = ViT FLOPs / the %s matmul rate (at::matmul, best of 1024^3 and "
              "4096x1024x4096),\n        measured just before and after each row's encodes "
              "(mean; the machine is shared)\n\n",
              at::toString(dtype));

  // --- encode time per size, in-process model calls ----------------------
  std::printf("ViT ms: wall time; cpu ms: the calling thread's CPU time (all of the work only "
              "with --bench_threads=1)\n\n");
  std::printf("| image | patches | GFLOP | attn %% | mm GFLOP/s | pre ms | old ViT ms | new ViT ms | "
              "speedup | bound ms | old/bound | new/bound | old cpu ms | new cpu ms | cpu speedup |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  struct Row {
    int side;
    std::string png;
  };
  std::vector<Row> images;
  for (int side : sizes) {
    const vlm::vision::RgbImage image = TestImage(side, side);
    // The image at its own size: the service's default budget (a CPU-sized
    // 0.75 MP) would resize the larger ones down.
    vlm::vision::PreprocessOptions options = service.default_options();
    options.max_pixels = std::max<int64_t>(
        options.max_pixels, std::min<int64_t>(int64_t{side} * side, service.config().max_pixels_limit));
    absl::StatusOr<vlm::vision::PreprocessResult> first =
        vlm::vision::PreprocessImage(image, options);
    if (!first.ok()) {
      std::fprintf(stderr, "preprocess %d: %s\n", side, first.status().ToString().c_str());
      return 1;
    }
    const vlm::vision::PreprocessedImage& p = first->patches;
    at::Tensor pixels = at::from_blob(const_cast<float*>(p.pixel_values.data()),
                                      {p.num_patches(), p.patch_dim}, at::kFloat);
    const vlm::GridThw grid = {p.grid_t, p.grid_h, p.grid_w};
    std::vector<double> pre_s, vit_s, old_s, vit_cpu, old_cpu;
    const double matmul_before = MeasureMatmulFlops(dtype);
    for (int run = 0; run <= runs; ++run) {
      auto t0 = Clock::now();
      absl::StatusOr<vlm::vision::PreprocessResult> again =
          vlm::vision::PreprocessImage(image, options);
      const double pre = Seconds(t0);
      t0 = Clock::now();
      double c0 = ThreadCpuNow();
      absl::StatusOr<vlm::VisionFeatures> out = model.Forward(pixels, {grid});
      const double vit = Seconds(t0), vit_c = ThreadCpuNow() - c0;
      t0 = Clock::now();
      c0 = ThreadCpuNow();
      absl::StatusOr<vlm::VisionFeatures> old_out =
          compare ? (*old_model)->Forward(pixels, {grid}) : absl::StatusOr<vlm::VisionFeatures>(
                                                               absl::UnknownError("not run"));
      const double old_vit = Seconds(t0), old_c = ThreadCpuNow() - c0;
      if (compare && out.ok() && !old_out.ok()) out = old_out.status();
      if (!again.ok() || !out.ok()) {
        std::fprintf(stderr, "encode %d: %s\n", side,
                     (!again.ok() ? again.status() : out.status()).ToString().c_str());
        return 1;
      }
      if (run == 0) continue;  // warm-up
      pre_s.push_back(pre);
      vit_s.push_back(vit);
      old_s.push_back(old_vit);
      vit_cpu.push_back(vit_c);
      old_cpu.push_back(old_c);
    }
    const double matmul_flops = 0.5 * (matmul_before + MeasureMatmulFlops(dtype));
    const VitFlops flops = CountFlops(model.config(), model.patch_dim(), p.num_patches());
    const double bound = flops.total() / matmul_flops;
    const double vit = Median(vit_s), old_vit = Median(old_s);
    const double vit_c = Median(vit_cpu), old_c = Median(old_cpu);
    std::printf("| %dx%d | %lld | %.0f | %.0f%% | %.0f | %.1f | %.1f | %.1f | %.2fx | %.1f | %.2fx | %.2fx | %.0f | %.0f | %.2fx |\n",
                side, side, static_cast<long long>(p.num_patches()), flops.total() / 1e9,
                100 * flops.attention / flops.total(), matmul_flops / 1e9, 1e3 * Median(pre_s),
                1e3 * old_vit, 1e3 * vit, old_vit / vit, 1e3 * bound, old_vit / bound, vit / bound,
                1e3 * old_c, 1e3 * vit_c, old_c / vit_c);
    std::fflush(stdout);
    images.push_back({side, EncodePng(image)});
  }
  const vlm::ProcessMemory after_encodes = vlm::ReadProcessMemory().value_or(vlm::ProcessMemory{});

  // --- cache hits through gRPC on loopback ---------------------------------
  vlm::ServerOptions server_options;
  server_options.grpc_address = "127.0.0.1:0";
  server_options.metrics_address = "";
  server_options.handle_signals = false;
  server_options.max_message_mb = 1024;
  vlm::Server server(server_options);
  server.AddService(&service, vlm::vision::VisionService::kServiceName, "bench");
  if (absl::Status s = server.Start(); !s.ok()) {
    std::fprintf(stderr, "server: %s\n", s.ToString().c_str());
    return 1;
  }
  server.readiness().SetServing(vlm::vision::VisionService::kServiceName);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(server.grpc_address(),
                                           grpc::InsecureChannelCredentials(), args);
  auto stub = vlm::v1::VisionEncoder::NewStub(channel);
  auto call = [&](const vlm::v1::EncodeRequest& request, vlm::v1::EncodeResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
    return stub->Encode(&ctx, request, response);
  };
  std::printf("\ncache hits through gRPC (loopback, in-process server), %d requests each:\n",
              absl::GetFlag(FLAGS_bench_hit_requests));
  std::printf("%-11s %9s %12s %10s %10s %12s %12s\n", "image", "reply MiB", "miss total ms",
              "hit p50 ms", "hit p90 ms", "hash p50 ms", "server p50 ms");
  for (const Row& row : images) {
    vlm::v1::EncodeRequest by_bytes;
    by_bytes.set_image(row.png);
    vlm::v1::EncodeRequest by_hash;
    by_hash.set_content_hash(vlm::Sha256Hex(row.png));
    vlm::v1::EncodeResponse response;
    auto t0 = Clock::now();
    grpc::Status s = call(by_bytes, &response);
    const double miss = Seconds(t0);
    if (!s.ok()) {
      std::fprintf(stderr, "miss %d: %s\n", row.side, s.error_message().c_str());
      return 1;
    }
    const double reply_mib = response.ByteSizeLong() / 1048576.0;
    std::vector<double> hit, hash, server_ms;
    for (int i = 0; i < absl::GetFlag(FLAGS_bench_hit_requests); ++i) {
      t0 = Clock::now();
      s = call(by_bytes, &response);
      hit.push_back(Seconds(t0));
      server_ms.push_back(response.timings().total_ms());
      if (!s.ok() || response.cache() != vlm::v1::CACHE_LEVEL_MEMORY) {
        std::fprintf(stderr, "hit %d: %s\n", row.side, s.error_message().c_str());
        return 1;
      }
      t0 = Clock::now();
      s = call(by_hash, &response);
      hash.push_back(Seconds(t0));
      if (!s.ok()) return 1;
    }
    std::printf("%4dx%-6d %9.1f %12.1f %10.2f %10.2f %12.2f %12.3f\n", row.side, row.side,
                reply_mib, 1e3 * miss, 1e3 * Quantile(hit, 0.5), 1e3 * Quantile(hit, 0.9),
                1e3 * Quantile(hash, 0.5), Quantile(server_ms, 0.5));
  }
  server.Shutdown();
  (void)server.Wait();

  const vlm::ProcessMemory final_memory = vlm::ReadProcessMemory().value_or(vlm::ProcessMemory{});
  std::printf("\nresident memory: after load %s (ViT weights %s mapped in place, %s converted); "
              "after the encodes %s; at the end %s; peak %s\n",
              Mib(after_load.resident_bytes).c_str(),
              Mib(model.borrowed_weight_bytes()).c_str(),
              Mib(model.converted_weight_bytes()).c_str(),
              Mib(after_encodes.resident_bytes).c_str(), Mib(final_memory.resident_bytes).c_str(),
              Mib(final_memory.peak_resident_bytes).c_str());
  return 0;
}
