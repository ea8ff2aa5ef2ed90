// What the CPU can do, as every kernel's run-time dispatch sees it.
//
// VLM_ISA caps the instruction sets the dispatch may use, read once per
// process here and nowhere else: "avx2" hides AVX-512 and AMX (the AVX2 + FMA
// kernels run), "scalar" hides AVX2 as well (portable code and LibTorch), and
// "native" or unset leaves the CPU as detected. Tests use it to run the AVX2
// kernels on an AVX-512 machine; an unknown value is reported on stderr and
// ignored. (LibTorch's own oneDNN kernels are not capped by it.)
//
// Thread-safe; detection runs once per process.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace vlm {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avxvnni = false;  // VEX-encoded int8 dot products (Alder Lake, Zen 5)
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512bf16 = false;  // native bf16 dot products (vdpbf16ps)
  bool amx_bf16 = false;
  bool amx_int8 = false;
  bool amx_tile = false;
  bool avx512vnni = false;

  // "avx2", "scalar" or "" (not capped): the VLM_ISA cap applied, if any.
  std::string isa_cap;

  // True when oneDNN runs bf16 matmuls at full speed (AVX-512 BW/VL/DQ) and
  // the AVX-512 kernels may run.
  bool fast_bf16_matmul() const { return avx512f && avx512bw && avx512vl && avx512dq; }
  // The AVX2 kernels' requirement: bf16 weights widened to f32 in registers.
  bool avx2_fma() const { return avx2 && fma; }
  // One line for the startup log, e.g.
  // "avx2 fma avx512f ... -> bf16 compute: AVX-512 kernels".
  std::string Describe() const;
};

// The features every kernel dispatches on: the CPU's, capped by VLM_ISA.
const CpuFeatures& GetCpuFeatures();
// The CPU's features without the VLM_ISA cap (for logs and benchmarks).
const CpuFeatures& GetDetectedCpuFeatures();
// `detected` with the cap named by `isa` applied ("native", "avx2" or
// "scalar", any case; "" is native). INVALID_ARGUMENT for other names.
absl::StatusOr<CpuFeatures> CapCpuFeatures(const CpuFeatures& detected, std::string_view isa);

// Asks the kernel once per process for AMX tile state
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); Linux grants it to
// the whole process. True when the CPU has AMX tiles and the request was
// granted; otherwise false and `why` (if given) says what failed.
bool RequestAmxPermission(std::string* why = nullptr);

// The cores this process may use: sched_getaffinity, capped by a cgroup quota
// (v2 cpu.max, else v1 cpu.cfs_quota_us / cpu.cfs_period_us; rounded up) when
// one is set; at least 1.
int UsableCores();

// The dtype a model should compute in. "bfloat16" stays bfloat16 whenever
// the kernels have a bf16 path (AVX2 + FMA: the AVX2 kernels widen bf16 to
// f32 in registers; AVX-512: the AVX-512 ones), so weights keep their stored
// precision. Only without AVX2 + FMA does it become "float32", and then
// `*warning` says so (callers log it as a warning). Any other request is
// returned unchanged.
enum class ComputeDType { kBFloat16, kFloat32 };
ComputeDType ChooseComputeDType(ComputeDType requested, std::string* warning);
// The same decision for the given features (what ChooseComputeDType applies
// to GetCpuFeatures()).
ComputeDType ChooseComputeDTypeFor(const CpuFeatures& features, ComputeDType requested,
                                   std::string* warning);
const char* ComputeDTypeName(ComputeDType dtype);  // "bfloat16" / "float32"
// The --compute_dtype value every service accepts: bf16 or f32 (also
// bfloat16, float32; any case). INVALID_ARGUMENT names the accepted values.
absl::StatusOr<ComputeDType> ParseComputeDType(std::string_view value);

// f32 matmuls go to OpenBLAS, which picks its kernels from CPUID when it is
// loaded. OpenBLAS 0.3.21 does not recognise some newer CPUs and falls back to
// its SSE3 "Prescott" kernels (4x+ slower); OPENBLAS_CORETYPE in the
// environment at process start overrides that.
// The kernel family in use ("SkylakeX", "Haswell", "Prescott", ...), or "" when
// OpenBLAS is not loaded in this process.
std::string OpenBlasCoreName();
// The OPENBLAS_CORETYPE this CPU can run: "SkylakeX" (AVX-512), "Haswell" (AVX2) or "".
const char* SuggestedOpenBlasCoreType();
// A warning when OpenBLAS runs a kernel family older than the CPU allows, e.g.
// "OpenBLAS uses Prescott kernels on an AVX-512 CPU (f32 matmuls ~4x slower);
// start with OPENBLAS_CORETYPE=SkylakeX"; "" when all is well.
std::string OpenBlasWarning();

}  // namespace vlm
