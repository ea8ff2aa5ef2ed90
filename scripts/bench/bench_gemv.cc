// vlm-bench-gemv: decode-time matrix-vector products on the Qwen3-VL-2B
// decoder's shapes, LibTorch's bf16 at::linear against every vlm::Gemv path,
// next to a read-bandwidth bound measured in the same run.
//
// Weights are distinct buffers for all layers (about 3.4 GB with the LM head,
// far beyond the L3), used in decode order, so every call streams its weights
// from DRAM. Each repetition runs one decode step per implementation and
// thread count side by side (plus a bandwidth pass), so load from other
// processes hits them alike; the tables print medians.
//
// Usage: vlm-bench-gemv [--layers 28] [--reps 7] [--threads 1,2] [--batches 1]
//                       [--impls torch,avx512bf16,avx512bf16-fused,avx512,avx2,scalar]
// gemm: the decoder's packed path (kernels::Gemm, q|k|v and gate|up packed
// together, SiLU·up fused); B = 8 on it costs about what B = 1 does.
// gemm-cN: the same with N panels per work chunk (GemmOptions::panels_per_chunk;
// gemm-c8 is the chunking decode used before the automatic choice).
// gemm-P: the packed path forced to GEMM path P (gemm-avx512bf16, gemm-avx2,
// gemm-amx), e.g. the AVX2 kernels next to the AVX-512 ones in one run:
//   --impls avx512bf16,avx2,gemm-avx512bf16,gemm-avx2 --batches 1,4
// --batches: tokens per step (x is [B, in]), e.g. 1,4,8.
#include <cctype>
#include <chrono>
#include <optional>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <tuple>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/kernels/gemm.h"
#include "common/omp_wait_policy.h"
#include "scripts/bench/gemv_bench.h"
#include "common/kernels/gemv.h"

namespace {

using Clock = std::chrono::steady_clock;
using vlm::bench::kDown;
using vlm::bench::kGate;
using vlm::bench::kK;
using vlm::bench::kO;
using vlm::bench::kUp;
using vlm::bench::kV;
using vlm::bench::kHead;
using vlm::bench::kLayerShapes;
using vlm::bench::kQ;
using vlm::bench::Median;
using vlm::bench::RandomBf16;

struct Impl {
  std::string name;
  bool torch = false;
  // kernels::Gemm on packed weights (q|k|v and gate|up packed together, as
  // the decoder packs them); "gemm-cN": N panels per work chunk.
  bool gemm = false;
  int panels_per_chunk = 0;
  std::optional<vlm::kernels::GemmPath> gemm_path;  // "gemm-P": forced GEMM path
  vlm::GemvPath path = vlm::GemvPath::kScalar;
  bool fused = false;  // GemvMulti for q/k/v and gate/up
};

struct Model {
  std::vector<std::vector<at::Tensor>> layers;  // [layer][kQ..kDown]
  at::Tensor head;
  // For gemm impls: per layer q|k|v, o, gate|up, down; and the head.
  std::vector<std::vector<vlm::kernels::PackedWeight>> packed;
  vlm::kernels::PackedWeight packed_head;
  int64_t step_bytes = 0;
};

// Activations for B tokens: inputs of each kind and preallocated outputs.
struct Acts {
  at::Tensor x_hidden, x_inter;  // [B, 2048], [B, 6144] bf16
  std::vector<at::Tensor> y;     // per layer shape [B, out], bf16
  at::Tensor logits;             // [B, 151936] f32
  at::Tensor qkv, gate_up;       // gemm impls: [B, 4096], [B, 6144] bf16
};

Acts MakeActs(int batch) {
  Acts a;
  a.x_hidden = RandomBf16(batch, 2048, 1);
  a.x_inter = RandomBf16(batch, 6144, 2);
  for (const auto& s : kLayerShapes) a.y.push_back(at::empty({batch, s.out}, at::kBFloat16));
  a.logits = at::empty({batch, kHead.out}, at::kFloat);
  a.qkv = at::empty({batch, 4096}, at::kBFloat16);
  a.gate_up = at::empty({batch, 6144}, at::kBFloat16);
  return a;
}

// Per-call times in microseconds, keyed by call name.
using Times = std::map<std::string, std::vector<double>>;

void Check(const absl::Status& s) { vlm::bench::CheckOk(s, "gemv"); }

// One decode step's matrix-vector products; returns its seconds.
double Step(const Impl& impl, const Model& m, Acts& a, Times* times) {
  vlm::GemvOptions opt;
  opt.path = impl.path;
  auto timed = [&](const std::string& name, auto&& call) {
    const auto t0 = Clock::now();
    call();
    times->operator[](name).push_back(
        std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  };
  const auto start = Clock::now();
  if (impl.gemm) {
    vlm::kernels::GemmOptions go;
    go.panels_per_chunk = impl.panels_per_chunk;
    go.path = impl.gemm_path;
    vlm::kernels::GemmOptions gu = go;
    gu.activation = vlm::kernels::Activation::kSiluMul;
    for (const std::vector<vlm::kernels::PackedWeight>& w : m.packed) {
      timed("q+k+v", [&] { Check(vlm::kernels::Gemm(a.x_hidden, w[0], &a.qkv, go)); });
      timed("o", [&] { Check(vlm::kernels::Gemm(a.x_hidden, w[1], &a.y[kO], go)); });
      timed("gate+up", [&] { Check(vlm::kernels::Gemm(a.x_hidden, w[2], &a.gate_up, gu)); });
      timed("down", [&] { Check(vlm::kernels::Gemm(a.x_inter, w[3], &a.y[kDown], go)); });
    }
    timed(kHead.name, [&] { Check(vlm::kernels::Gemm(a.x_hidden, m.packed_head, &a.logits, go)); });
    return std::chrono::duration<double>(Clock::now() - start).count();
  }
  for (const std::vector<at::Tensor>& w : m.layers) {
    for (int i = 0; i < 7; ++i) {
      const at::Tensor& x = i == kDown ? a.x_inter : a.x_hidden;
      if (impl.torch) {
        timed(kLayerShapes[i].name, [&] { a.y[i] = at::linear(x, w[i]); });
      } else if (impl.fused && (i == kQ || i == kGate)) {
        const int n = i == kQ ? 3 : 2;
        std::vector<at::Tensor*> ys;
        for (int j = 0; j < n; ++j) ys.push_back(&a.y[i + j]);
        timed(i == kQ ? "q+k+v" : "gate+up",
              [&] { Check(vlm::GemvMulti(x, absl::MakeConstSpan(&w[i], n), ys, opt)); });
        i += n - 1;
      } else {
        timed(kLayerShapes[i].name, [&] { Check(vlm::Gemv(x, w[i], &a.y[i], opt)); });
      }
    }
  }
  if (impl.torch) {
    timed(kHead.name, [&] { a.logits = at::linear(a.x_hidden, m.head); });
  } else {
    timed(kHead.name, [&] { Check(vlm::Gemv(a.x_hidden, m.head, &a.logits, opt)); });
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  vlm::EnsureOmpWaitPolicy(argv);  // as the language service runs: see omp_wait_policy.h
  int layers = 28, reps = 7;
  std::string threads_arg = "1,2", batches_arg = "1";
  std::string impls_arg = "torch,avx512bf16,avx512bf16-fused,avx512,avx2,scalar";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--layers") layers = std::atoi(value.c_str());
    else if (flag == "--reps") reps = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--threads") threads_arg = value;
    else if (flag == "--batches") batches_arg = value;
    else if (flag == "--impls") impls_arg = value;
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  const std::vector<int> thread_counts = vlm::bench::SplitInts(threads_arg);
  const std::vector<int> batches = vlm::bench::SplitInts(batches_arg);
  std::vector<Impl> impls;
  for (const std::string& name : vlm::bench::SplitList(impls_arg)) {
    Impl impl;
    impl.name = name;
    if (name == "torch") {
      impl.torch = true;
    } else if (name == "gemm" || (name.rfind("gemm-c", 0) == 0 && name.size() > 6 &&
                                  std::isdigit(static_cast<unsigned char>(name[6])))) {
      impl.gemm = true;
      if (name.size() > 6) impl.panels_per_chunk = std::atoi(name.c_str() + 6);
    } else if (name.rfind("gemm-", 0) == 0) {
      absl::StatusOr<vlm::kernels::GemmPath> p = vlm::kernels::ParseGemmPath(name.substr(5));
      if (!p.ok()) {
        std::fprintf(stderr, "%s\n", std::string(p.status().message()).c_str());
        return 2;
      }
      std::string missing;
      if (*p == vlm::kernels::GemmPath::kTorch) {
        std::fprintf(stderr, "%s: the packed impls need a blocked GEMM path\n", name.c_str());
        return 2;
      }
      if (!vlm::kernels::GemmPathSupported(*p, &missing)) {
        std::printf("skipping %s: %s\n", name.c_str(), missing.c_str());
        continue;
      }
      impl.gemm = true;
      impl.gemm_path = *p;
    } else {
      const bool fused = name.size() > 6 && name.compare(name.size() - 6, 6, "-fused") == 0;
      absl::StatusOr<vlm::GemvPath> p =
          vlm::ParseGemvPath(fused ? name.substr(0, name.size() - 6) : name);
      if (!p.ok()) {
        std::fprintf(stderr, "%s\n", std::string(p.status().message()).c_str());
        return 2;
      }
      std::string missing;
      if (!vlm::GemvPathSupported(*p, &missing)) {
        std::printf("skipping %s: CPU lacks %s\n", name.c_str(), missing.c_str());
        continue;
      }
      impl.path = *p;
      impl.fused = fused;
    }
    impls.push_back(impl);
  }

  std::printf("vlm-bench-gemv: %d layers, %d reps, load average %s, best path %s\n", layers, reps,
              vlm::bench::LoadAverage().c_str(), vlm::GemvPathName(*vlm::ParseGemvPath("auto")));
  const auto alloc_start = Clock::now();
  Model m;
  for (int l = 0; l < layers; ++l) {
    m.layers.emplace_back();
    for (int i = 0; i < 7; ++i) {
      const auto& s = kLayerShapes[i];
      m.layers.back().push_back(RandomBf16(s.out, s.in, 100 * l + i));
      m.step_bytes += s.out * s.in * 2;
    }
  }
  m.head = RandomBf16(kHead.out, kHead.in, 99999);
  m.step_bytes += kHead.out * kHead.in * 2;
  if (std::any_of(impls.begin(), impls.end(), [](const Impl& i) { return i.gemm; })) {
    // Every blocked path reads the same panels: pack once for the first
    // forced path (or the default one); the others override it per call.
    std::optional<vlm::kernels::GemmPath> pack_path;
    for (const Impl& i : impls) {
      if (i.gemm && i.gemm_path.has_value()) {
        pack_path = i.gemm_path;
        break;
      }
    }
    auto pack = [](absl::StatusOr<vlm::kernels::PackedWeight> w) {
      Check(w.status());
      return *std::move(w);
    };
    for (const std::vector<at::Tensor>& w : m.layers) {
      m.packed.push_back(
          {pack(vlm::kernels::PackedWeight::Pack(at::cat({w[kQ], w[kK], w[kV]}), {}, pack_path)),
           pack(vlm::kernels::PackedWeight::Pack(w[kO], {}, pack_path)),
           pack(vlm::kernels::PackedWeight::PackGateUp(w[kGate], w[kUp], pack_path)),
           pack(vlm::kernels::PackedWeight::Pack(w[kDown], {}, pack_path))});
    }
    m.packed_head = pack(vlm::kernels::PackedWeight::Pack(m.head, {}, pack_path));
  }
  // One bound per thread count, over one 1 GiB buffer.
  const at::Tensor bw_buffer = RandomBf16(1, (size_t{1} << 30) / 2, 4242);
  std::map<int, vlm::bench::ReadBound> bounds;
  for (int t : thread_counts) bounds.try_emplace(t, bw_buffer);
  std::printf("weights: %.2f GB per step (%.1f MB per layer), filled in %.1f s\n",
              m.step_bytes / 1e9, (m.step_bytes - kHead.out * kHead.in * 2) / 1e6 / layers,
              std::chrono::duration<double>(Clock::now() - alloc_start).count());

  std::map<int, Acts> acts;
  for (int b : batches) acts.emplace(b, MakeActs(b));

  // Per (threads, batch, impl): per-call times and step seconds.
  using Key = std::tuple<int, int, std::string>;
  std::map<Key, Times> times;
  std::map<Key, std::vector<double>> steps;
  for (int t : thread_counts) {  // warm-up: thread pools, oneDNN primitives
    at::set_num_threads(t);
    for (int b : batches) {
      for (const Impl& impl : impls) {
        Times ignored;
        Step(impl, m, acts[b], &ignored);
      }
    }
  }
  for (int r = 0; r < reps; ++r) {
    for (int t : thread_counts) {
      at::set_num_threads(t);
      bounds.at(t).Measure(t);
      for (int b : batches) {
        for (const Impl& impl : impls) {
          const Key key{t, b, impl.name};
          steps[key].push_back(Step(impl, m, acts[b], &times[key]));
        }
      }
    }
    std::fprintf(stderr, "rep %d/%d done, load average %s\n", r + 1, reps,
                 vlm::bench::LoadAverage().c_str());
  }

  std::printf("\nRead bandwidth (1 GiB, sum of 64-bit words; bound = best over reps):\n");
  for (int t : thread_counts) {
    std::printf("  %d thread(s): bound %.1f GB/s (median %.1f)\n", t, bounds.at(t).best() / 1e9,
                bounds.at(t).median() / 1e9);
  }

  std::printf("\nPer call (median over %d layers x %d reps; lm_head over %d reps); ratio = time / "
              "(weight bytes / read bandwidth)\n",
              layers, reps, reps);
  std::printf("%-8s %-16s %8s %3s %3s %10s %8s %7s %10s\n", "call", "impl", "MB", "thr", "B",
              "us/call", "GB/s", "ratio", "best us");
  std::vector<std::pair<std::string, int64_t>> calls;
  for (const auto& s : kLayerShapes) calls.emplace_back(s.name, s.out * s.in * 2);
  calls.emplace_back("q+k+v", (2048 + 1024 + 1024) * 2048 * 2);
  calls.emplace_back("gate+up", 2 * 6144 * 2048 * 2);
  calls.emplace_back(kHead.name, kHead.out * kHead.in * 2);
  for (const auto& [call, bytes] : calls) {
    for (int t : thread_counts) {
      const double bw = bounds.at(t).best();
      for (int b : batches) {
        for (const Impl& impl : impls) {
          const Times& tm = times[Key{t, b, impl.name}];
          auto it = tm.find(call);
          if (it == tm.end()) continue;
          const double us = Median(it->second);
          std::printf("%-8s %-16s %8.1f %3d %3d %10.1f %8.1f %7.2f %10.1f\n", call.c_str(),
                      impl.name.c_str(), bytes / 1e6, t, b, us, bytes / us / 1e3,
                      us * 1e-6 / (bytes / bw), vlm::bench::Min(it->second));
        }
      }
    }
  }

  std::printf("\nOne decode step: %d layers x 7 matrix-vector products + LM head, %.2f GB of "
              "weights, B tokens at once (median over %d reps)\n\n",
              layers, m.step_bytes / 1e9, reps);
  for (int t : thread_counts) {
    std::vector<vlm::bench::StepResult> rows;
    for (int b : batches) {
      for (const Impl& impl : impls) {
        rows.push_back({impl.name, t, b, m.step_bytes, steps[Key{t, b, impl.name}]});
      }
    }
    vlm::bench::PrintStepTable(rows, bounds.at(t), impls.empty() ? "" : impls[0].name);
    std::printf("\n");
  }
  // Fixed cost per call (thread wake-up and join, argument checks): a tiny
  // matrix called back to back.
  std::printf("Fixed cost per call: x[1,256] w[128,256], back to back (median of 5 x 2000 calls)\n");
  std::printf("%-16s %3s %10s\n", "impl", "thr", "us/call");
  const at::Tensor tiny_w = RandomBf16(128, 256, 5), tiny_x = RandomBf16(1, 256, 6);
  at::Tensor tiny_y = at::empty({1, 128}, at::kBFloat16);
  for (int t : thread_counts) {
    at::set_num_threads(t);
    for (const Impl& impl : impls) {
      vlm::GemvOptions opt;
      opt.path = impl.path;
      std::vector<double> per_call;
      for (int r = 0; r < 5; ++r) {
        const auto t0 = Clock::now();
        for (int i = 0; i < 2000; ++i) {
          if (impl.torch) tiny_y = at::linear(tiny_x, tiny_w);
          else Check(vlm::Gemv(tiny_x, tiny_w, &tiny_y, opt));
        }
        per_call.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / 2000);
      }
      std::printf("%-16s %3d %10.2f\n", impl.name.c_str(), t, Median(per_call));
    }
  }

  std::printf("\nload average at end: %s\n", vlm::bench::LoadAverage().c_str());
  return 0;
}
