// vlm-bench-gemv-int4: the 4-bit weight products of the Qwen3-VL-2B decoder
// (common/kernels/gemv_int4.h) next to the int8 ones, in one run.
//
// Decode (batches ≤ 8): one decode step's weight set (--layers layers of
// q|k|v, o, gate|up, down as the decoder concatenates them, + the LM head)
// through GemvInt4 on each path this CPU runs (avx512vnni, avx2) and through
// GemvInt8, with the LM head in int8 and in int4 (the service's int4 form,
// whose leading layers are int8 as well: one in seven),
// next to each one's read-bandwidth bound: its own weight bytes (int4:
// nibbles + row scales + group ratios + zero points; int8: rows + scales)
// over the best read bandwidth of the run (measured every repetition over a
// 1 GiB buffer, scripts/bench/read_bandwidth). Weights are distinct buffers
// per layer (int4 0.9 GB, int8 1.7 GB at 28 layers: beyond the L3), so each
// call streams from DRAM. Implementations interleave per repetition; tables
// print medians.
//
// Prefill (--prefill_batches, default 64,512): GFLOP/s on one layer's shapes
// for the bf16 kernels::Gemm on packed weights, GemmInt8 and GemmInt4 (panels
// made per task from the quantized weights, the same micro-kernel).
//
// Usage: vlm-bench-gemv-int4 [--layers 28] [--reps 5] [--threads 2] [--batches 1,2,4,8]
//        [--prefill_batches 64,512] [--prefill_reps 3]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/cpu_features.h"
#include "common/kernels/gemm.h"
#include "common/kernels/gemv_int4.h"
#include "common/kernels/gemv_int8.h"
#include "common/kernels/quantize.h"
#include "common/kernels/quantize_int4.h"
#include "common/omp_wait_policy.h"
#include "scripts/bench/gemv_bench.h"

namespace {

using Clock = std::chrono::steady_clock;
using vlm::bench::CheckOk;
using vlm::bench::RandomBf16;
namespace k = vlm::kernels;

double Seconds(const std::function<void()>& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The decoder's four products per layer: [out, in].
struct Proj {
  const char* name;
  int64_t out, in;
};
constexpr Proj kProjs[] = {{"qkv", 4096, 2048}, {"o", 2048, 2048}, {"gate_up", 12288, 2048},
                           {"down", 2048, 6144}};

struct LayerSet {
  std::vector<k::Int4Weight> w4;
  std::vector<k::QuantizedWeight> w8;
};

std::string CpuModel() {
  std::FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (f == nullptr) return "?";
  char line[512];
  std::string name = "?";
  while (std::fgets(line, sizeof line, f) != nullptr) {
    std::string l(line);
    if (l.rfind("model name", 0) == 0) {
      name = l.substr(l.find(':') + 2);
      if (!name.empty() && name.back() == '\n') name.pop_back();
      break;
    }
  }
  std::fclose(f);
  return name;
}

}  // namespace

int main(int argc, char** argv) {
  vlm::EnsureOmpWaitPolicy(argv);
  int layers = 28, reps = 5, threads = 2, prefill_reps = 3;
  std::string batches_arg = "1,2,4,8", prefill_arg = "64,512";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--layers") layers = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--reps") reps = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--threads") threads = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--batches") batches_arg = value;
    else if (flag == "--prefill_batches") prefill_arg = value;
    else if (flag == "--prefill_reps") prefill_reps = std::max(1, std::atoi(value.c_str()));
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  at::set_num_threads(threads);
  std::printf("vlm-bench-gemv-int4: %d layers, %d reps, %d threads, CPU %s, load average %s\n",
              layers, reps, threads, CpuModel().c_str(), vlm::bench::LoadAverage().c_str());

  // In-cache ceiling: one 512 x 2048 weight (0.55 MB int4) on one thread,
  // 200 calls, B = 1: the kernels' compute rate where DRAM is not the limit.
  {
    const at::Tensor w = RandomBf16(512, 2048, 3), x = RandomBf16(1, 2048, 4);
    auto q4 = k::QuantizeInt4(w);
    auto q8 = k::QuantizeInt8(w);
    CheckOk(q4.status(), "QuantizeInt4");
    CheckOk(q8.status(), "QuantizeInt8");
    at::Tensor y = at::empty({1, 512}, at::kFloat);
    std::printf("\n### In-cache rate, 512 x 2048, B = 1, one thread (weight GB/s, best of 7 "
                "rounds of 40 calls, kernels interleaved; DRAM-bound decode needs only the read "
                "bandwidth)\n\n| kernel | GB/s |\n|---|---|\n");
    std::vector<k::GemvInt4Path> paths;
    for (k::GemvInt4Path p : {k::GemvInt4Path::kAvx512Vnni, k::GemvInt4Path::kAvx2,
                              k::GemvInt4Path::kScalar}) {
      if (k::GemvInt4PathSupported(p)) paths.push_back(p);
    }
    double best8 = 0;
    std::vector<double> best4(paths.size(), 0);
    for (int round = 0; round <= 7; ++round) {  // round 0 warms up
      const double t8 = Seconds([&] {
        for (int i = 0; i < 40; ++i) CheckOk(k::GemvInt8(x, *q8, &y, {std::nullopt, 1}), "GemvInt8");
      });
      if (round > 0) best8 = std::max(best8, 40.0 * q8->bytes() / t8 / 1e9);
      for (size_t j = 0; j < paths.size(); ++j) {
        const int calls = paths[j] == k::GemvInt4Path::kScalar ? 1 : 40;
        const double t4 = Seconds([&] {
          for (int i = 0; i < calls; ++i) CheckOk(k::GemvInt4(x, *q4, &y, {paths[j], 1}), "GemvInt4");
        });
        if (round > 0) best4[j] = std::max(best4[j], calls * 1.0 * q4->bytes() / t4 / 1e9);
      }
    }
    std::printf("| int8 | %.1f |\n", best8);
    for (size_t j = 0; j < paths.size(); ++j) {
      std::printf("| int4/%s | %.1f |\n", k::GemvInt4PathName(paths[j]), best4[j]);
    }
  }

  // Quantizers on one layer's four bf16 weights (50 M weights), per path, on
  // one thread and on --threads: the scalar int4 row is the reference the
  // vector rows reproduce byte for byte. Median of 3 (scalar: 1 run).
  {
    std::vector<at::Tensor> ws;
    double weights = 0;
    for (const Proj& p : kProjs) {
      ws.push_back(RandomBf16(p.out, p.in, 31 + p.out));
      weights += static_cast<double>(ws.back().numel());
    }
    std::printf("\n### Quantization, one layer's weights (%.1f M), ns per weight, median of 3\n\n"
                "| quantizer | 1 thread | %d threads |\n|---|---|---|\n",
                weights / 1e6, threads);
    auto time = [&](int runs, const std::function<void(const at::Tensor&)>& f) {
      std::vector<double> t;
      for (int i = 0; i < runs; ++i) {
        t.push_back(Seconds([&] {
          for (const at::Tensor& w : ws) f(w);
        }));
      }
      return vlm::bench::Median(t) / weights * 1e9;
    };
    for (k::QuantizeInt4Path p : {k::QuantizeInt4Path::kScalar, k::QuantizeInt4Path::kAvx2,
                                  k::QuantizeInt4Path::kAvx512}) {
      if (!k::QuantizeInt4PathSupported(p)) continue;
      const int runs = p == k::QuantizeInt4Path::kScalar ? 1 : 3;
      double ns[2];
      for (int t = 0; t < 2; ++t) {
        const int n = t == 0 ? 1 : threads;
        ns[t] = time(runs, [&](const at::Tensor& w) {
          CheckOk(k::QuantizeInt4(w, p, n).status(), "QuantizeInt4");
        });
      }
      std::printf("| int4/%s | %.2f | %.2f |\n", k::QuantizeInt4PathName(p), ns[0], ns[1]);
    }
    double ns8[2];
    for (int t = 0; t < 2; ++t) {
      at::set_num_threads(t == 0 ? 1 : threads);
      ns8[t] = time(3, [&](const at::Tensor& w) { CheckOk(k::QuantizeInt8(w).status(), "QuantizeInt8"); });
    }
    at::set_num_threads(threads);
    std::printf("| int8 (default path) | %.2f | %.2f |\n", ns8[0], ns8[1]);
  }

  // Weights: random bf16 per matrix, quantized both ways, the bf16 dropped.
  std::vector<LayerSet> set(layers);
  int64_t bytes4 = 0, bytes8 = 0;
  double quantize4_s = 0, quantize8_s = 0, weights = 0;
  for (int l = 0; l < layers; ++l) {
    for (const Proj& p : kProjs) {
      const at::Tensor w = RandomBf16(p.out, p.in, 100 * l + p.out);
      absl::StatusOr<k::Int4Weight> q4;
      absl::StatusOr<k::QuantizedWeight> q8;
      quantize4_s += Seconds([&] { q4 = k::QuantizeInt4(w); });
      quantize8_s += Seconds([&] { q8 = k::QuantizeInt8(w); });
      weights += static_cast<double>(w.numel());
      CheckOk(q4.status(), "QuantizeInt4");
      CheckOk(q8.status(), "QuantizeInt8");
      bytes4 += static_cast<int64_t>(q4->bytes());
      bytes8 += static_cast<int64_t>(q8->bytes());
      set[l].w4.push_back(*std::move(q4));
      set[l].w8.push_back(*std::move(q8));
    }
  }
  std::printf("\nquantization, %d threads: int4 %.2f ns/weight, int8 %.2f ns/weight\n", threads,
              quantize4_s / weights * 1e9, quantize8_s / weights * 1e9);
  const vlm::bench::Shape head_shape = vlm::bench::kHead;
  k::Int4Weight head4;
  k::QuantizedWeight head8;
  {
    const at::Tensor w = RandomBf16(head_shape.out, head_shape.in, 7);
    auto q4 = k::QuantizeInt4(w);
    auto q8 = k::QuantizeInt8(w);
    CheckOk(q4.status(), "QuantizeInt4 head");
    CheckOk(q8.status(), "QuantizeInt8 head");
    head4 = *std::move(q4);
    head8 = *std::move(q8);
  }

  std::vector<k::GemvInt4Path> paths4;
  for (k::GemvInt4Path p : {k::GemvInt4Path::kAvx512Vnni, k::GemvInt4Path::kAvx2}) {
    if (k::GemvInt4PathSupported(p)) paths4.push_back(p);
  }
  vlm::bench::ReadBound bound(size_t{1} << 30);
  std::vector<vlm::bench::StepResult> rows;
  auto row = [&](const std::string& impl, int batch, int64_t bytes) -> vlm::bench::StepResult& {
    for (auto& r : rows) {
      if (r.impl == impl && r.batch == batch) return r;
    }
    rows.push_back({impl, threads, batch, bytes, {}});
    return rows.back();
  };
  const std::vector<int> batches = vlm::bench::SplitInts(batches_arg);
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0: warm-up
    bound.Measure(threads);
    for (int b : batches) {
      if (b < 1 || b > 8) continue;
      at::Tensor x2048 = RandomBf16(b, 2048, 11), x6144 = RandomBf16(b, 6144, 12);
      at::Tensor y[4], logits = at::empty({b, head_shape.out}, at::kFloat);
      for (int i = 0; i < 4; ++i) y[i] = at::empty({b, kProjs[i].out}, at::kBFloat16);
      auto step4 = [&](k::GemvInt4Path path, bool int4_head) {
        k::GemvInt4Options o;
        o.path = path;
        o.threads = threads;
        for (const LayerSet& s : set) {
          for (int i = 0; i < 4; ++i) {
            CheckOk(k::GemvInt4(i == 3 ? x6144 : x2048, s.w4[i], &y[i], o), "GemvInt4");
          }
        }
        if (int4_head) CheckOk(k::GemvInt4(x2048, head4, &logits, o), "GemvInt4 head");
        else CheckOk(k::GemvInt8(x2048, head8, &logits), "GemvInt8 head");
      };
      auto step8 = [&] {
        for (const LayerSet& s : set) {
          for (int i = 0; i < 4; ++i) {
            CheckOk(k::GemvInt8(i == 3 ? x6144 : x2048, s.w8[i], &y[i]), "GemvInt8");
          }
        }
        CheckOk(k::GemvInt8(x2048, head8, &logits), "GemvInt8 head");
      };
      const double t8 = Seconds(step8);
      if (rep > 0) row("int8 (head int8)", b, bytes8 + static_cast<int64_t>(head8.bytes())).seconds.push_back(t8);
      for (k::GemvInt4Path p : paths4) {
        const double a = Seconds([&] { step4(p, false); });
        const double c = Seconds([&] { step4(p, true); });
        if (rep == 0) continue;
        const std::string name = std::string("int4/") + k::GemvInt4PathName(p);
        row(name + " (head int8)", b, bytes4 + static_cast<int64_t>(head8.bytes())).seconds.push_back(a);
        row(name + " (head int4)", b, bytes4 + static_cast<int64_t>(head4.bytes())).seconds.push_back(c);
      }
    }
  }
  std::printf("\n### Decode step: %d layers + LM head, read bandwidth best %.1f GB/s (median %.1f)\n\n",
              layers, bound.best() / 1e9, bound.median() / 1e9);
  vlm::bench::PrintStepTable(rows, bound, "int8 (head int8)");

  // Prefill: one layer's shapes, GFLOP/s.
  const std::vector<int> prefill = vlm::bench::SplitInts(prefill_arg);
  if (prefill.empty() || k::DefaultGemmPath() == k::GemmPath::kTorch) return 0;
  std::printf("\n### Prefill, one layer's four products (gemm path %s), GFLOP/s, median of %d\n\n"
              "| M | Gemm bf16 (packed) | GemmInt8 | GemmInt4 | int4 / bf16 |\n|---|---|---|---|---|\n",
              k::GemmPathName(k::DefaultGemmPath()), prefill_reps);
  std::vector<k::PackedWeight> packed;
  for (const Proj& p : kProjs) {
    auto w = k::PackedWeight::Pack(RandomBf16(p.out, p.in, 5 + p.out));
    CheckOk(w.status(), "Pack");
    packed.push_back(*std::move(w));
  }
  for (int m : prefill) {
    if (m < 1) continue;
    const at::Tensor x2048 = RandomBf16(m, 2048, 21), x6144 = RandomBf16(m, 6144, 22);
    double flops = 0;
    for (const Proj& p : kProjs) flops += 2.0 * m * p.out * p.in;
    std::vector<double> tb, t8, t4;
    for (int rep = 0; rep <= prefill_reps; ++rep) {
      const double b = Seconds([&] {
        for (int i = 0; i < 4; ++i) {
          at::Tensor y;
          CheckOk(k::Gemm(i == 3 ? x6144 : x2048, packed[i], &y), "Gemm");
        }
      });
      const double e = Seconds([&] {
        for (int i = 0; i < 4; ++i) {
          at::Tensor y;
          CheckOk(k::GemmInt8(i == 3 ? x6144 : x2048, set[0].w8[i], &y), "GemmInt8");
        }
      });
      const double f = Seconds([&] {
        for (int i = 0; i < 4; ++i) {
          at::Tensor y;
          CheckOk(k::GemmInt4(i == 3 ? x6144 : x2048, set[0].w4[i], &y), "GemmInt4");
        }
      });
      if (rep == 0) continue;
      tb.push_back(b);
      t8.push_back(e);
      t4.push_back(f);
    }
    const double gb = flops / vlm::bench::Median(tb) / 1e9, g8 = flops / vlm::bench::Median(t8) / 1e9,
                 g4 = flops / vlm::bench::Median(t4) / 1e9;
    std::printf("| %d | %.1f | %.1f | %.1f | %.2fx |\n", m, gb, g8, g4, g4 / gb);
  }
  return 0;
}
