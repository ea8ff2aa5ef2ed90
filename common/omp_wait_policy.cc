#include "common/omp_wait_policy.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace vlm {

void EnsureOmpWaitPolicy(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (setenv("OMP_WAIT_POLICY", "passive", /*overwrite=*/1) != 0) return;
  execv("/proc/self/exe", argv);
  // Still here: the exec failed (no /proc, say). The process goes on with libgomp's
  // default policy; the startup log shows it.
  std::fprintf(stderr, "OMP_WAIT_POLICY: cannot re-execute with passive waiting: %s\n",
               std::strerror(errno));
}

std::string OmpWaitPolicy() {
  const char* v = std::getenv("OMP_WAIT_POLICY");
  return v == nullptr ? std::string() : std::string(v);
}

}  // namespace vlm
