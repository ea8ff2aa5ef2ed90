// OpenMP wait policy for processes that also run their own worker pools.
//
// LibTorch's OpenMP runtime (libgomp) keeps its threads spinning for a while after
// every parallel region. A process that alternates LibTorch ops with its own pool
// (the decode GEMV, the compute kernels) then has idle OpenMP threads burning the
// cores the pool needs: on a 2-core machine about 28% of a batch-8 decode pass went
// to libgomp's spin-wait, and with OMP_WAIT_POLICY=passive the same pass ran 2x
// faster. libgomp reads the variable once, when the library is loaded (before
// main), so setting it from main() has no effect: the process must start with it.
#ifndef VLM_COMMON_OMP_WAIT_POLICY_H_
#define VLM_COMMON_OMP_WAIT_POLICY_H_

#include <string>

namespace vlm {

// Makes sure the process runs with OMP_WAIT_POLICY set. If the variable is unset, sets
// it to "passive" and re-executes the running binary (/proc/self/exe) with the same
// argv, keeping the PID; this call then never returns. If the variable is already set
// (by the operator, a launcher, the container's env or the re-exec itself), or the
// exec fails, it returns and the process continues unchanged.
//
// Call it first thing in main(), before any thread is started. Operators who want
// libgomp's default spinning set OMP_WAIT_POLICY=active explicitly.
void EnsureOmpWaitPolicy(char** argv);

// The policy this process started with ("passive", "active", or "" if unset), for
// the startup log line.
std::string OmpWaitPolicy();

}  // namespace vlm

#endif  // VLM_COMMON_OMP_WAIT_POLICY_H_
