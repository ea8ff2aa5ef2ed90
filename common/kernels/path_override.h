// Internal to common/kernels: the one way an operation's path is forced from
// the environment (VLM_GEMM_PATH, VLM_GEMV_PATH, ...; docs/architecture.md
// lists them). Read by each operation once per process.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace vlm::kernels::internal {

// The path named by `variable` when it is set, names a path (`parse`) and the
// CPU can run it (`supported(path, &missing)`); else `best`. A value that
// cannot be used is reported on stderr and ignored.
template <typename Path, typename Parse, typename Supported>
Path PathFromEnvironment(const char* variable, Path best, Parse parse, Supported supported) {
  const char* env = std::getenv(variable);
  if (env == nullptr || *env == '\0') return best;
  absl::StatusOr<Path> path = parse(std::string_view(env));
  if (!path.ok()) {
    std::fprintf(stderr, "%s ignored: %s\n", variable, std::string(path.status().message()).c_str());
    return best;
  }
  std::string missing;
  if (!supported(*path, &missing)) {
    std::fprintf(stderr, "%s=%s ignored: this CPU lacks %s\n", variable, env, missing.c_str());
    return best;
  }
  return *path;
}

}  // namespace vlm::kernels::internal
