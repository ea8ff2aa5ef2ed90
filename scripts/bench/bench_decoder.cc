// vlm-bench-decoder: the language model core on a checkpoint, without the
// service: load time and RSS (lazy), prefill tokens/s, decode ms/token and its
// ratio to the memory-bandwidth bound (weight bytes read per token / read
// bandwidth measured in the same run). Prints a table of medians.
//
//   vlm-bench-decoder --checkpoint /work/cache/ckpt-2b --threads 2
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "services/language/decoder.h"
#include "services/language/gemv.h"
#include "services/language/projector.h"

ABSL_FLAG(std::string, checkpoint, "", "model directory");
ABSL_FLAG(int, threads, 2, "intra-op threads");
ABSL_FLAG(std::string, dtype, "bf16", "compute dtype: bf16 or f32");
ABSL_FLAG(int, prompt_tokens, 128, "prefill length (random text ids)");
ABSL_FLAG(int, decode_tokens, 32, "decode steps");
ABSL_FLAG(int, resident_layers, 0, "layer residency bound (0: none)");
ABSL_FLAG(int, prefetch_layers, 1, "layers prefetched ahead");
ABSL_FLAG(bool, eager, false, "materialize every layer at load");
ABSL_FLAG(bool, gemv, true, "decode projections through vlm::Gemv");
ABSL_FLAG(int64_t, chunk, 512, "prefill chunk tokens");

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double RssMb() {
  auto m = vlm::ReadProcessMemory();
  return m.ok() ? m->resident_bytes / 1048576.0 : -1;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Run() {
  using namespace vlm;
  using namespace vlm::language;
  const std::string dir = absl::GetFlag(FLAGS_checkpoint);
  at::set_num_threads(absl::GetFlag(FLAGS_threads));
  const double rss0 = RssMb();
  const double t0 = Now();
  auto config = LoadModelConfig(dir);
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  if (!config.ok() || !ckpt.ok()) {
    std::fprintf(stderr, "%s %s\n", config.status().ToString().c_str(), ckpt.status().ToString().c_str());
    return 1;
  }
  std::shared_ptr<const SafetensorsCheckpoint> checkpoint(*std::move(ckpt));
  const ComputeDType dtype =
      absl::GetFlag(FLAGS_dtype) == "f32" ? ComputeDType::kFloat32 : ComputeDType::kBFloat16;
  ProjectorOptions po;
  po.compute_dtype = dtype;
  auto projector = Projector::Load(*checkpoint, *config, po);
  if (!projector.ok() || !(*projector)->WarmUp().ok()) {
    std::fprintf(stderr, "projector: %s\n", projector.status().ToString().c_str());
    return 1;
  }
  const double t_projector = Now();
  DecoderOptions o;
  o.compute_dtype = dtype;
  o.use_gemv = absl::GetFlag(FLAGS_gemv);
  o.prefill_chunk_tokens = absl::GetFlag(FLAGS_chunk);
  o.layers.eager_load = absl::GetFlag(FLAGS_eager);
  o.layers.resident_layers = absl::GetFlag(FLAGS_resident_layers);
  o.layers.prefetch_layers = absl::GetFlag(FLAGS_prefetch_layers);
  auto decoder = Decoder::Load(checkpoint, *config, o);
  if (!decoder.ok()) {
    std::fprintf(stderr, "decoder: %s\n", decoder.status().ToString().c_str());
    return 1;
  }
  Decoder& d = **decoder;
  const double t_loaded = Now();
  const double rss_loaded = RssMb();
  std::printf("%s\n%s\n", (*projector)->load_summary().c_str(), d.load_summary().c_str());

  const int n_prompt = absl::GetFlag(FLAGS_prompt_tokens);
  const int n_decode = absl::GetFlag(FLAGS_decode_tokens);
  std::mt19937 rng(1);
  std::vector<int32_t> ids(n_prompt);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 150000);
  auto seq = d.NewSequence(n_prompt + n_decode + 1);
  if (!seq.ok()) return 1;

  // First request: prefill (cold layers) + decode.
  PrefillInput in;
  in.token_ids = ids;
  double t = Now();
  auto logits = d.Prefill(**seq, in);
  const double prefill_cold = Now() - t;
  if (!logits.ok()) {
    std::fprintf(stderr, "prefill: %s\n", logits.status().ToString().c_str());
    return 1;
  }
  std::vector<double> steps;
  for (int i = 0; i < n_decode; ++i) {
    const int32_t next = static_cast<int32_t>(logits->argmax().item<int64_t>() % 150000);
    t = Now();
    logits = d.DecodeStep(**seq, next);
    steps.push_back(Now() - t);
    if (!logits.ok()) return 1;
  }
  const double rss_after = RssMb();
  // Warm prefill on a fresh sequence.
  (*seq)->Reset();
  t = Now();
  if (!d.Prefill(**seq, in).ok()) return 1;
  const double prefill_warm = Now() - t;

  // Read bandwidth with the same threads over a 1 GiB buffer.
  std::vector<uint8_t> buffer(size_t{1} << 30, 1);
  MeasureReadBandwidth(buffer.data(), buffer.size(), absl::GetFlag(FLAGS_threads));
  std::vector<double> bws;
  for (int i = 0; i < 3; ++i) {
    bws.push_back(MeasureReadBandwidth(buffer.data(), buffer.size(), absl::GetFlag(FLAGS_threads)));
  }
  const double bw = Median(bws);
  const double bytes = static_cast<double>(d.decode_weight_bytes());
  const double bound_ms = bytes / bw * 1e3;
  // Steady state: skip the first 2 steps (page-in, first touch of the head).
  std::vector<double> steady(steps.begin() + std::min<size_t>(2, steps.size()), steps.end());
  const double step_ms = Median(steady) * 1e3;

  std::printf("\n| metric | value |\n|---|---|\n");
  std::printf("| threads | %d |\n", absl::GetFlag(FLAGS_threads));
  std::printf("| projector load + warm-up | %.3f s |\n", t_projector - t0);
  std::printf("| decoder load (%s) | %.3f s |\n", o.layers.eager_load ? "eager" : "lazy",
              t_loaded - t_projector);
  std::printf("| RSS before / after load | %.0f / %.0f MB |\n", rss0, rss_loaded);
  std::printf("| prefill %d tokens, cold / warm | %.3f / %.3f s (%.1f tok/s warm) |\n", n_prompt,
              prefill_cold, prefill_warm, n_prompt / prefill_warm);
  std::printf("| first decode step | %.1f ms |\n", steps.empty() ? 0 : steps[0] * 1e3);
  std::printf("| decode step (median of %zu) | %.1f ms (%.2f tok/s) |\n", steady.size(), step_ms,
              1e3 / step_ms);
  std::printf("| weight bytes per decode step | %.1f MB |\n", bytes / 1048576.0);
  std::printf("| read bandwidth (%d threads) | %.1f GB/s |\n", absl::GetFlag(FLAGS_threads), bw / 1e9);
  std::printf("| bandwidth bound | %.1f ms |\n", bound_ms);
  std::printf("| decode / bound | %.2fx |\n", step_ms / bound_ms);
  std::printf("| RSS after first request | %.0f MB |\n", rss_after);
  std::printf("| layers resident / materializations | %d / %ld |\n", d.layers().resident_layers(),
              static_cast<long>(d.layers().materializations()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return Run();
}
