// The services' start-up choice of the GEMM path (--kernel_path).
//
// AMX is used only where it has been seen to work on this machine: on a CPU
// that reports AMX-BF16 and whose kernel grants the tile state, the start-up
// check runs one small GEMM on the AMX path and on avx512bf16, requires both
// within the summation bound of the exact (f64) product, times both (best of
// a few single-thread runs), and makes AMX the process's default only if it
// agreed and was faster. Everything else keeps AutoGemmPath() (avx512bf16,
// else torch). The choice and its reason are logged and exported as
// vlm_kernel_path{op="gemm",path} (1 for the chosen path, 0 for the others).
//
// --kernel_path=auto|amx|avx512bf16|torch (also VLM_KERNEL_PATH) forces a
// path instead; a forced path that cannot run here fails the start.
// VLM_GEMM_PATH (the kernels' own override, for tests and benchmarks) counts
// as forcing when --kernel_path is auto. Paths are what GemmPathSupported
// allows, so a cap on the CPU features (cpu_features.h) applies here too.
//
// The check's candidates are injected (GemmCandidate), so tests run it with
// the emulated AMX kernel and with a deliberately wrong one.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/kernels/gemm.h"

namespace vlm::kernels {

// One way to compute y = x·wᵀ: x [M, K] bf16, w packed in the blocked layout,
// y [M, N] f32 (allocated by the runner when undefined).
struct GemmCandidate {
  std::string name;
  std::function<absl::Status(const at::Tensor& x, const PackedWeight& w, at::Tensor* y)> run;
};
// Gemm forced onto `path`, one thread.
GemmCandidate CandidateForPath(GemmPath path);

struct PathCheckOptions {
  // Two 32-row AMX blocks and a 16-row tail, 8 panels, a K tail (1000 = 31
  // blocks of 32 + 8).
  int64_t m = 80, n = 256, k = 1000;
  int timing_runs = 5;  // best of, each path, alternating
  uint64_t seed = 20261203;
};

struct PathCheck {
  bool agrees = false;    // both within the bound of the exact product, nothing non-finite
  bool faster = false;    // candidate's best time below the reference's
  double candidate_worst = 0;  // max |y - exact| / bound over y's elements (<= 1 agrees)
  double reference_worst = 0;
  double candidate_seconds = 0;  // best of timing_runs
  double reference_seconds = 0;
  std::string error;  // a runner's failure, if any
  std::string Describe() const;  // one line for the log and the choice's reason
};

// Runs both on the same random bf16 operands. The bound per element is
// γ(K+2)·Σ|x_k·w_k| with γ(n) = n·u / (1 - n·u), u = 2^-24: bf16 products are
// exact in f32 and any order of f32 additions of K terms (plus AMX's even/odd
// split and its per-block sums) stays within it.
PathCheck CheckGemmCandidate(const GemmCandidate& candidate, const GemmCandidate& reference,
                             const PathCheckOptions& options = {});

struct KernelPathChoice {
  GemmPath path = GemmPath::kTorch;
  std::string reason;
};

// "auto" -> nullopt; a GemmPathName -> that path; else INVALID_ARGUMENT
// naming the accepted values.
absl::StatusOr<std::optional<GemmPath>> ParseKernelPath(std::string_view value);

// The decision, without side effects. forced: from ParseKernelPath.
// amx_candidate: the AMX path to check, or nullopt when AMX cannot run here
// (`amx_missing` says why). Auto picks amx only when the check agrees and is faster.
absl::StatusOr<KernelPathChoice> ChooseKernelPath(std::optional<GemmPath> forced,
                                                  const std::optional<GemmCandidate>& amx_candidate,
                                                  std::string_view amx_missing,
                                                  const PathCheckOptions& options = {});

// What each service calls once at start, before packing weights: reads
// --kernel_path (and VLM_GEMM_PATH), checks AMX where the hardware has it,
// sets the process's default (SetDefaultGemmPath), logs the choice for
// `component` and sets vlm_kernel_path. Later calls return the first result.
absl::StatusOr<KernelPathChoice> ChooseKernelPathAtStartup(std::string_view component);

// Sets vlm_kernel_path{op="gemm",path}: 1 for `chosen`, 0 for the other paths.
void ExportKernelPathMetric(GemmPath chosen);

}  // namespace vlm::kernels
