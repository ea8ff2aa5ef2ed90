// What the CPU can do for the matmul paths LibTorch takes. bf16 matmuls are
// fast only through oneDNN on AVX-512 (BW/VL/DQ; native BF16 is a bonus);
// elsewhere they run ~50x slower than f32, so callers fall back to f32.
//
// Thread-safe; detection runs once per process.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace vlm {

struct CpuFeatures {
  bool avx2 = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512bf16 = false;  // native bf16 dot products (vdpbf16ps)
  bool amx_bf16 = false;
  bool amx_int8 = false;
  bool amx_tile = false;
  bool avx512vnni = false;

  // True when oneDNN runs bf16 matmuls at full speed (AVX-512 BW/VL/DQ).
  bool fast_bf16_matmul() const { return avx512f && avx512bw && avx512vl && avx512dq; }
  // One line for the startup log, e.g. "avx2 avx512f avx512bw ... -> bf16 matmul: oneDNN".
  std::string Describe() const;
};

const CpuFeatures& GetCpuFeatures();

// Asks the kernel once per process for AMX tile state
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); Linux grants it to
// the whole process. True when the CPU has AMX tiles and the request was
// granted; otherwise false and `why` (if given) says what failed.
bool RequestAmxPermission(std::string* why = nullptr);

// The cores this process may use: sched_getaffinity, capped by a cgroup quota
// (v2 cpu.max, else v1 cpu.cfs_quota_us / cpu.cfs_period_us; rounded up) when
// one is set; at least 1.
int UsableCores();

// The dtype a model should compute in: "bfloat16" is honoured only on CPUs
// with fast_bf16_matmul(); otherwise "float32" and `*warning` explains why.
// Any other request is returned unchanged.
enum class ComputeDType { kBFloat16, kFloat32 };
ComputeDType ChooseComputeDType(ComputeDType requested, std::string* warning);
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
