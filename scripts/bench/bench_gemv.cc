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
// Usage: vlm-bench-gemv [--layers 28] [--reps 7] [--threads 1,2]
//                       [--impls torch,avx512bf16,avx512bf16-fused,avx512,avx2,scalar]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "services/language/gemv.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  const char* name;
  int64_t out, in;
};
// One Qwen3 decoder layer, in call order, and the tied LM head.
const Shape kLayerShapes[] = {{"q", 2048, 2048},    {"k", 1024, 2048},  {"v", 1024, 2048},
                              {"o", 2048, 2048},    {"gate", 6144, 2048}, {"up", 6144, 2048},
                              {"down", 2048, 6144}};
const Shape kHead = {"lm_head", 151936, 2048};
constexpr int kQ = 0, kK = 1, kV = 2, kO = 3, kGate = 4, kUp = 5, kDown = 6;

struct Impl {
  std::string name;
  bool torch = false;
  vlm::GemvPath path = vlm::GemvPath::kScalar;
  bool fused = false;  // GemvMulti for q/k/v and gate/up
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string LoadAverage() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

// bf16 values of magnitude 2^-7..2^-3 with random sign and mantissa (normal
// numbers only, so no path meets denormals). Touches every page.
at::Tensor RandomBf16(int64_t rows, int64_t cols, uint64_t seed) {
  at::Tensor t = at::empty({rows, cols}, at::kBFloat16);
  auto* p = reinterpret_cast<uint16_t*>(t.data_ptr());
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  const int64_t n = rows * cols;
  for (int64_t i = 0; i < n; ++i) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    const uint16_t sign = (s >> 20) & 1, exp = 120 + (s >> 21) % 5, mant = (s >> 30) & 0x7F;
    p[i] = static_cast<uint16_t>(sign << 15 | exp << 7 | mant);
  }
  return t;
}

struct Model {
  std::vector<std::vector<at::Tensor>> layers;  // [layer][kQ..kDown]
  at::Tensor head;
  int64_t step_bytes = 0;
};

// Activations: inputs of each kind and preallocated outputs.
struct Acts {
  at::Tensor x_hidden, x_inter;  // [1, 2048], [1, 6144] bf16
  std::vector<at::Tensor> y;     // per layer shape, bf16
  at::Tensor logits;             // [1, 151936] f32
};

// Per-call times in microseconds, keyed by call name.
using Times = std::map<std::string, std::vector<double>>;

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "gemv failed: %s\n", std::string(s.message()).c_str());
    std::exit(1);
  }
}

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

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int layers = 28, reps = 7;
  std::string threads_arg = "1,2";
  std::string impls_arg = "torch,avx512bf16,avx512bf16-fused,avx512,avx2,scalar";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--layers") layers = std::atoi(value.c_str());
    else if (flag == "--reps") reps = std::atoi(value.c_str());
    else if (flag == "--threads") threads_arg = value;
    else if (flag == "--impls") impls_arg = value;
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  std::vector<int> thread_counts;
  for (const std::string& t : Split(threads_arg)) thread_counts.push_back(std::atoi(t.c_str()));
  std::vector<Impl> impls;
  for (const std::string& name : Split(impls_arg)) {
    Impl impl;
    impl.name = name;
    if (name == "torch") {
      impl.torch = true;
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
              LoadAverage().c_str(), vlm::GemvPathName(*vlm::ParseGemvPath("auto")));
  const auto alloc_start = Clock::now();
  Model m;
  for (int l = 0; l < layers; ++l) {
    m.layers.emplace_back();
    for (int i = 0; i < 7; ++i) {
      const Shape& s = kLayerShapes[i];
      m.layers.back().push_back(RandomBf16(s.out, s.in, 100 * l + i));
      m.step_bytes += s.out * s.in * 2;
    }
  }
  m.head = RandomBf16(kHead.out, kHead.in, 99999);
  m.step_bytes += kHead.out * kHead.in * 2;
  const size_t bw_bytes = size_t{1} << 30;
  const at::Tensor bw_buffer = RandomBf16(1, bw_bytes / 2, 4242);
  std::printf("weights: %.2f GB per step (%.1f MB per layer), filled in %.1f s\n",
              m.step_bytes / 1e9, (m.step_bytes - kHead.out * kHead.in * 2) / 1e6 / layers,
              std::chrono::duration<double>(Clock::now() - alloc_start).count());

  Acts a;
  a.x_hidden = RandomBf16(1, 2048, 1);
  a.x_inter = RandomBf16(1, 6144, 2);
  for (const Shape& s : kLayerShapes) a.y.push_back(at::empty({1, s.out}, at::kBFloat16));
  a.logits = at::empty({1, kHead.out}, at::kFloat);

  // results[threads][impl]: per-call times and step seconds; bandwidth per threads.
  std::map<int, std::map<std::string, Times>> times;
  std::map<int, std::map<std::string, std::vector<double>>> steps;
  std::map<int, std::vector<double>> bandwidth;
  for (int t : thread_counts) {  // warm-up: thread pools, oneDNN primitives
    at::set_num_threads(t);
    for (const Impl& impl : impls) {
      Times ignored;
      Step(impl, m, a, &ignored);
    }
  }
  for (int r = 0; r < reps; ++r) {
    for (int t : thread_counts) {
      at::set_num_threads(t);
      bandwidth[t].push_back(vlm::MeasureReadBandwidth(bw_buffer.data_ptr(), bw_bytes, t));
      for (const Impl& impl : impls) {
        steps[t][impl.name].push_back(Step(impl, m, a, &times[t][impl.name]));
      }
    }
    std::fprintf(stderr, "rep %d/%d done, load average %s\n", r + 1, reps, LoadAverage().c_str());
  }

  // The bound is the best read bandwidth seen in the run (each rep measures
  // it once per thread count, best of two read orders).
  std::map<int, double> bound;
  for (int t : thread_counts) {
    bound[t] = *std::max_element(bandwidth[t].begin(), bandwidth[t].end());
  }
  std::printf("\nRead bandwidth (1 GiB, sum of 64-bit words; bound = best over reps):\n");
  for (int t : thread_counts) {
    std::vector<double>& b = bandwidth[t];
    std::printf("  %d thread(s): bound %.1f GB/s (median %.1f)\n", t, bound[t] / 1e9,
                Median(b) / 1e9);
  }

  std::printf("\nPer call (median over %d layers x %d reps; lm_head over %d reps); ratio = time / "
              "(weight bytes / read bandwidth)\n",
              layers, reps, reps);
  std::printf("%-8s %-16s %8s %3s %10s %8s %7s %10s\n", "call", "impl", "MB", "thr", "us/call",
              "GB/s", "ratio", "best us");
  std::vector<std::pair<std::string, int64_t>> calls;
  for (const Shape& s : kLayerShapes) calls.emplace_back(s.name, s.out * s.in * 2);
  calls.emplace_back("q+k+v", (2048 + 1024 + 1024) * 2048 * 2);
  calls.emplace_back("gate+up", 2 * 6144 * 2048 * 2);
  calls.emplace_back(kHead.name, kHead.out * kHead.in * 2);
  for (const auto& [call, bytes] : calls) {
    for (int t : thread_counts) {
      const double bw = bound[t];
      for (const Impl& impl : impls) {
        auto it = times[t][impl.name].find(call);
        if (it == times[t][impl.name].end()) continue;
        const double us = Median(it->second);
        std::printf("%-8s %-16s %8.1f %3d %10.1f %8.1f %7.2f %10.1f\n", call.c_str(),
                    impl.name.c_str(), bytes / 1e6, t, us, bytes / us / 1e3,
                    us * 1e-6 / (bytes / bw),
                    *std::min_element(it->second.begin(), it->second.end()));
      }
    }
  }

  std::printf("\nOne decode step: %d layers x 7 matrix-vector products + LM head, %.2f GB of "
              "weights (median over %d reps)\n",
              layers, m.step_bytes / 1e9, reps);
  std::printf("%-16s %3s %9s %8s %11s %11s %7s %9s\n", "impl", "thr", "ms/step", "GB/s", "tok/s",
              "bound tok/s", "ratio", "best ms");
  for (int t : thread_counts) {
    const double bw = bound[t];
    const double bound_s = m.step_bytes / bw;
    for (const Impl& impl : impls) {
      const double s = Median(steps[t][impl.name]);
      const std::vector<double>& all = steps[t][impl.name];
      std::printf("%-16s %3d %9.1f %8.1f %11.2f %11.2f %7.2f %9.1f\n", impl.name.c_str(), t,
                  s * 1e3, m.step_bytes / s / 1e9, 1 / s, 1 / bound_s, s / bound_s,
                  *std::min_element(all.begin(), all.end()) * 1e3);
    }
  }
  // Fixed cost per call (thread wake-up and join, argument checks): a tiny
  // matrix called back to back.
  std::printf("\nFixed cost per call: x[1,256] w[128,256], back to back (median of 5 x 2000 calls)\n");
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

  std::printf("\nload average at end: %s\n", LoadAverage().c_str());
  return 0;
}
