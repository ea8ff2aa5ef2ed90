// A process-wide pool for the compute kernels: ParallelFor cuts [0, tasks)
// into one contiguous part per participant; each drains its own part front to
// back, then helps with the others'. The caller is participant 0 and never
// waits for a worker that has not joined, so on a loaded machine a
// descheduled worker costs its share of time, not a stall (same design as the
// decode GEMV's pool). Workers spin about 1 ms after a job (kernels come back
// to back), then sleep.
//
// Thread-safety: ParallelFor may be called from any thread; while one call
// uses the workers, concurrent calls run alone on their caller. Nested calls
// (from inside a task) run inline. The work split never changes what a task
// computes: kernels that need bit-identical results keep their arithmetic
// inside a task.
#pragma once

#include <cstdint>
#include <functional>

namespace vlm::kernels {

// Runs fn(begin, end) over disjoint ranges covering [0, tasks), each range at
// most `grain` tasks long, on up to `threads` threads (the caller included).
// threads <= 0 means DefaultThreads(). Returns when every task has run.
void ParallelFor(int64_t tasks, int threads, int64_t grain,
                 const std::function<void(int64_t, int64_t)>& fn);

// at::get_num_threads() (the process's intra-op setting).
int DefaultThreads();

// True while the calling thread is running a ParallelFor task.
bool InParallelRegion();

}  // namespace vlm::kernels
