#include "common/kernels/kernel_path.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <prometheus/gauge.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/metrics.h"

ABSL_FLAG(std::string, kernel_path, "auto",
          "GEMM path of the compute kernels: auto (amx only where a start-up check finds it "
          "agreeing with avx512bf16 and faster, else avx512bf16, else avx2 without AVX-512, else "
          "torch), or a path forced: amx, avx512bf16, avx2, torch");

namespace vlm::kernels {
namespace {

constexpr GemmPath kAllPaths[] = {GemmPath::kAmx, GemmPath::kAvx512Bf16, GemmPath::kAvx2,
                                  GemmPath::kTorch};

double Seconds(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// max |y - exact| / bound; +inf for a non-finite y or a wrong shape.
double WorstRatio(const at::Tensor& y, const at::Tensor& exact, const at::Tensor& bound) {
  if (!y.defined() || y.sizes() != exact.sizes()) return std::numeric_limits<double>::infinity();
  const at::Tensor yd = y.to(at::kDouble);
  if (!yd.isfinite().all().item<bool>()) return std::numeric_limits<double>::infinity();
  return ((yd - exact).abs() / bound).max().item<double>();
}

}  // namespace

GemmCandidate CandidateForPath(GemmPath path) {
  return {GemmPathName(path), [path](const at::Tensor& x, const PackedWeight& w, at::Tensor* y) {
            GemmOptions o;
            o.path = path;
            o.threads = 1;
            o.out_dtype = at::kFloat;
            return Gemm(x, w, y, o);
          }};
}

std::string PathCheck::Describe() const {
  if (!error.empty()) return error;
  return absl::StrFormat(
      "%s (worst error %.3g and %.3g of the bound), best of the timed runs %.3f vs %.3f ms",
      agrees ? "agree" : "DISAGREE", candidate_worst, reference_worst, candidate_seconds * 1e3,
      reference_seconds * 1e3);
}

PathCheck CheckGemmCandidate(const GemmCandidate& candidate, const GemmCandidate& reference,
                             const PathCheckOptions& o) {
  PathCheck check;
  try {
    at::Generator gen = at::detail::createCPUGenerator(o.seed);
    const at::Tensor x = at::randn({o.m, o.k}, gen, at::kFloat).to(at::kBFloat16);
    const at::Tensor w = at::randn({o.n, o.k}, gen, at::kFloat).to(at::kBFloat16);
    absl::StatusOr<PackedWeight> packed = PackedWeight::Pack(w, {}, GemmPath::kAvx512Bf16);
    if (!packed.ok()) {
      check.error = absl::StrCat("packing the check's weight: ", packed.status().message());
      return check;
    }
    const at::Tensor xd = x.to(at::kDouble), wd = w.to(at::kDouble);
    const at::Tensor exact = at::matmul(xd, wd.t());
    const double u = std::ldexp(1.0, -24), n = static_cast<double>(o.k + 2);
    const double gamma = n * u / (1 - n * u);
    // FTZ may drop a denormal partial sum: at most 2^-126 per addition.
    const at::Tensor bound = at::matmul(xd.abs(), wd.abs().t()) * gamma + n * std::ldexp(1.0, -126);

    at::Tensor yc, yr;
    if (absl::Status s = candidate.run(x, *packed, &yc); !s.ok()) {
      check.error = absl::StrCat(candidate.name, " failed: ", s.message());
      return check;
    }
    if (absl::Status s = reference.run(x, *packed, &yr); !s.ok()) {
      check.error = absl::StrCat(reference.name, " failed: ", s.message());
      return check;
    }
    check.candidate_worst = WorstRatio(yc, exact, bound);
    check.reference_worst = WorstRatio(yr, exact, bound);
    check.agrees = check.candidate_worst <= 1.0 && check.reference_worst <= 1.0;

    double best_c = std::numeric_limits<double>::infinity(), best_r = best_c;
    for (int i = 0; i < std::max(1, o.timing_runs); ++i) {
      at::Tensor y;
      best_c = std::min(best_c, Seconds([&] { (void)candidate.run(x, *packed, &y); }));
      best_r = std::min(best_r, Seconds([&] { (void)reference.run(x, *packed, &y); }));
    }
    check.candidate_seconds = best_c;
    check.reference_seconds = best_r;
    check.faster = best_c < best_r;
  } catch (const std::exception& e) {
    check.error = absl::StrCat("the check failed: ", e.what());
  }
  return check;
}

absl::StatusOr<std::optional<GemmPath>> ParseKernelPath(std::string_view value) {
  if (value == "auto") return std::optional<GemmPath>();
  for (GemmPath p : kAllPaths) {
    if (value == GemmPathName(p)) return std::optional<GemmPath>(p);
  }
  std::string names = "auto";
  for (GemmPath p : kAllPaths) absl::StrAppend(&names, ", ", GemmPathName(p));
  return absl::InvalidArgumentError(
      absl::StrCat("--kernel_path: unknown path '", std::string(value), "'; expected ", names));
}

absl::StatusOr<KernelPathChoice> ChooseKernelPath(std::optional<GemmPath> forced,
                                                  const std::optional<GemmCandidate>& amx_candidate,
                                                  std::string_view amx_missing,
                                                  const PathCheckOptions& options) {
  KernelPathChoice choice;
  if (forced.has_value()) {
    std::string missing;
    if (!GemmPathSupported(*forced, &missing)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--kernel_path=", GemmPathName(*forced), " cannot run here: ", missing));
    }
    choice.path = *forced;
    choice.reason = absl::StrCat("forced (", GemmPathName(*forced), ")");
    return choice;
  }
  choice.path = AutoGemmPath();
  if (choice.path != GemmPath::kAvx512Bf16) {
    choice.reason = "auto: no AVX-512 BF16 on this CPU, so no blocked kernels (amx needs it too)";
    return choice;
  }
  if (!amx_candidate.has_value()) {
    choice.reason = absl::StrCat("auto: no AMX (", std::string(amx_missing), ")");
    return choice;
  }
  const PathCheck check =
      CheckGemmCandidate(*amx_candidate, CandidateForPath(GemmPath::kAvx512Bf16), options);
  const std::string what = absl::StrCat(amx_candidate->name, " vs avx512bf16 on [", options.m,
                                        ", ", options.k, "] x [", options.n, ", ", options.k,
                                        "]: ", check.Describe());
  if (!check.error.empty() || !check.agrees) {
    choice.reason = absl::StrCat("auto: amx rejected, results wrong: ", what);
  } else if (!check.faster) {
    choice.reason = absl::StrCat("auto: amx rejected, not faster: ", what);
  } else {
    choice.path = GemmPath::kAmx;
    choice.reason = absl::StrCat("auto: amx verified: ", what);
  }
  return choice;
}

void ExportKernelPathMetric(GemmPath chosen) {
  static auto& family = prometheus::BuildGauge()
                            .Name("vlm_kernel_path")
                            .Help("Compute kernel path in use per operation (1 = chosen)")
                            .Register(MetricsRegistry());
  for (GemmPath p : kAllPaths) {
    family.Add({{"op", "gemm"}, {"path", GemmPathName(p)}}).Set(p == chosen ? 1 : 0);
  }
}

absl::StatusOr<KernelPathChoice> ChooseKernelPathAtStartup(std::string_view component) {
  static const absl::StatusOr<KernelPathChoice> result =
      []() -> absl::StatusOr<KernelPathChoice> {
    const std::string flag = absl::GetFlag(FLAGS_kernel_path);
    absl::StatusOr<std::optional<GemmPath>> forced = ParseKernelPath(flag);
    if (!forced.ok()) return forced.status();
    std::string env_reason;
    if (!forced->has_value()) {
      const char* env = std::getenv("VLM_GEMM_PATH");
      if (env != nullptr && *env != '\0' && std::string_view(env) != "auto") {
        absl::StatusOr<std::optional<GemmPath>> from_env = ParseKernelPath(env);
        if (!from_env.ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat("VLM_GEMM_PATH: unknown path '", env, "'"));
        }
        *forced = *from_env;
        env_reason = " by VLM_GEMM_PATH";
      }
    }
    std::optional<GemmCandidate> amx;
    std::string amx_missing;
    if (!forced->has_value() && GemmPathSupported(GemmPath::kAmx, &amx_missing)) {
      amx = CandidateForPath(GemmPath::kAmx);
    }
    absl::StatusOr<KernelPathChoice> choice = ChooseKernelPath(*forced, amx, amx_missing);
    if (!choice.ok()) return choice.status();
    if (!env_reason.empty()) choice->reason += env_reason;
    else if (forced->has_value()) choice->reason += " by --kernel_path";
    if (absl::Status s = SetDefaultGemmPath(choice->path); !s.ok()) return s;
    ExportKernelPathMetric(choice->path);
    return choice;
  }();
  if (result.ok()) {
    LogInfo(component, "kernel path", {{"op", "gemm"}, {"path", GemmPathName(result->path)},
                                       {"reason", result->reason}});
  }
  return result;
}

}  // namespace vlm::kernels
