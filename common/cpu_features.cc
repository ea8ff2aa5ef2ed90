#include "common/cpu_features.h"

#include <dlfcn.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <strings.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

namespace vlm {
namespace {

CpuFeatures Detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = __builtin_cpu_supports("f16c");
#if defined(__GNUC__) && __GNUC__ >= 12
  f.avxvnni = __builtin_cpu_supports("avxvnni");
#endif
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16");
#if defined(__GNUC__) && __GNUC__ >= 12
  f.amx_bf16 = __builtin_cpu_supports("amx-bf16");
  f.amx_int8 = __builtin_cpu_supports("amx-int8");
  f.amx_tile = __builtin_cpu_supports("amx-tile");
#endif
  f.avx512vnni = __builtin_cpu_supports("avx512vnni");
#endif
  return f;
}

CpuFeatures DetectCapped() {
  const CpuFeatures& detected = GetDetectedCpuFeatures();
  const char* env = std::getenv("VLM_ISA");
  if (env == nullptr) return detected;
  absl::StatusOr<CpuFeatures> capped = CapCpuFeatures(detected, env);
  if (!capped.ok()) {
    std::fprintf(stderr, "VLM_ISA ignored: %s\n", std::string(capped.status().message()).c_str());
    return detected;
  }
  return *capped;
}

}  // namespace

absl::StatusOr<CpuFeatures> CapCpuFeatures(const CpuFeatures& detected, std::string_view isa) {
  std::string v(isa);
  for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  CpuFeatures f = detected;
  if (v.empty() || v == "native") return f;
  if (v != "avx2" && v != "scalar") {
    return absl::InvalidArgumentError("VLM_ISA must be native, avx2 or scalar, got \"" +
                                      std::string(isa) + "\"");
  }
  f.isa_cap = v;
  f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = f.avx512bf16 = f.avx512vnni = false;
  f.amx_bf16 = f.amx_int8 = f.amx_tile = false;
  if (v == "scalar") f.avx2 = f.fma = f.f16c = f.avxvnni = false;
  return f;
}

std::string CpuFeatures::Describe() const {
  std::string s;
  auto add = [&s](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(avx2, "avx2");
  add(fma, "fma");
  add(avxvnni, "avxvnni");
  add(avx512f, "avx512f");
  add(avx512bw, "avx512bw");
  add(avx512vl, "avx512vl");
  add(avx512dq, "avx512dq");
  add(avx512bf16, "avx512bf16");
  add(avx512vnni, "avx512vnni");
  add(amx_bf16, "amx-bf16");
  add(amx_int8, "amx-int8");
  if (s.empty()) s = "(no avx2/avx512)";
  if (!isa_cap.empty()) s += " (capped by VLM_ISA=" + isa_cap + ")";
  s += fast_bf16_matmul() ? " -> bf16 compute: AVX-512 kernels"
       : avx2_fma()       ? " -> bf16 compute: AVX2 kernels (bf16 widened to f32 in registers)"
                          : " -> bf16 compute: unavailable, float32";
  return s;
}

const CpuFeatures& GetDetectedCpuFeatures() {
  static const CpuFeatures features = Detect();
  return features;
}

const CpuFeatures& GetCpuFeatures() {
  static const CpuFeatures features = DetectCapped();
  return features;
}

bool RequestAmxPermission(std::string* why) {
  struct Result {
    bool granted = false;
    std::string why;
  };
  static const Result result = [] {
    Result r;
    const CpuFeatures& f = GetCpuFeatures();
    if (!f.amx_tile || !f.amx_bf16) {
      r.why = "the CPU has no AMX-BF16 tiles";
      return r;
    }
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
      r.why = std::string("the kernel refused AMX tile state (arch_prctl: ") +
              std::strerror(errno) + ")";
      return r;
    }
    r.granted = true;
#else
    r.why = "AMX tile state can only be requested on Linux";
#endif
    return r;
  }();
  if (!result.granted && why != nullptr) *why = result.why;
  return result.granted;
}

int UsableCores() {
  int cores = 0;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) cores = CPU_COUNT(&set);
  if (cores <= 0) cores = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  // cgroup v2: "max 100000" (no limit) or "<quota> <period>"; cgroup v1:
  // cpu.cfs_quota_us (-1: no limit) and cpu.cfs_period_us.
  std::string quota, period;
  std::ifstream cpu_max("/sys/fs/cgroup/cpu.max");
  if (!(cpu_max >> quota >> period)) {
    std::ifstream q1("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), p1("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
    if (!(q1 >> quota && p1 >> period)) quota = "max";
  }
  if (quota != "max") {
    const double q = std::atof(quota.c_str()), p = std::atof(period.c_str());
    if (q > 0 && p > 0) {
      const int limit = static_cast<int>(std::ceil(q / p));
      if (limit > 0 && limit < cores) cores = limit;
    }
  }
  return cores > 0 ? cores : 1;
}

ComputeDType ChooseComputeDTypeFor(const CpuFeatures& f, ComputeDType requested,
                                   std::string* warning) {
  if (requested == ComputeDType::kBFloat16 && !f.fast_bf16_matmul() && !f.avx2_fma()) {
    if (warning) {
      *warning = "bfloat16 compute requested but this CPU has neither AVX-512 nor AVX2 + FMA [" +
                 f.Describe() + "]; computing in float32 (weights take twice the memory)";
    }
    return ComputeDType::kFloat32;
  }
  return requested;
}

ComputeDType ChooseComputeDType(ComputeDType requested, std::string* warning) {
  std::string why;
  const ComputeDType chosen = ChooseComputeDTypeFor(GetCpuFeatures(), requested, &why);
  if (!why.empty()) {
    // A precision change the operator did not ask for: say it on stderr
    // once per process whatever the caller does with the text.
    static const bool logged = [&why] {
      std::fprintf(stderr, "WARNING: %s\n", why.c_str());
      return true;
    }();
    (void)logged;
    if (warning != nullptr) *warning = why;
  }
  return chosen;
}

absl::StatusOr<ComputeDType> ParseComputeDType(std::string_view value) {
  std::string v(value);
  for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (v == "bf16" || v == "bfloat16") return ComputeDType::kBFloat16;
  if (v == "f32" || v == "float32") return ComputeDType::kFloat32;
  return absl::InvalidArgumentError("compute dtype must be bf16 or f32 (also bfloat16, float32), got \"" +
                                    std::string(value) + "\"");
}

const char* ComputeDTypeName(ComputeDType dtype) {
  return dtype == ComputeDType::kBFloat16 ? "bfloat16" : "float32";
}

std::string OpenBlasCoreName() {
  using CoreNameFn = char* (*)();
  auto fn = reinterpret_cast<CoreNameFn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (fn == nullptr) return "";
  const char* name = fn();
  return name ? name : "";
}

const char* SuggestedOpenBlasCoreType() {
  const CpuFeatures& f = GetCpuFeatures();
  if (f.fast_bf16_matmul()) return "SkylakeX";
  if (f.avx2) return "Haswell";
  return "";
}

std::string OpenBlasWarning() {
  const std::string core = OpenBlasCoreName();
  const std::string suggested = SuggestedOpenBlasCoreType();
  if (core.empty() || suggested.empty()) return "";
  // Kernel families that do not use AVX2 at all.
  static const char* const kOld[] = {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem",
                                     "Sandybridge", "Atom", "Katmai", "Coppermine",
                                     "Northwood", "Banias"};
  for (const char* old : kOld) {
    if (strcasecmp(core.c_str(), old) == 0) {
      return "OpenBLAS uses " + core + " kernels on a CPU that runs " + suggested +
             " ones (f32 matmuls several times slower); start the process with "
             "OPENBLAS_CORETYPE=" + suggested;
    }
  }
  return "";
}

}  // namespace vlm
