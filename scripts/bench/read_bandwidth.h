// Read bandwidth of memory, measured the way the decode kernels read it: the
// bound the benchmarks print next to their kernels. Benchmark support only.
#pragma once

#include <cstddef>

namespace vlm {

// Read bandwidth of `bytes` at `data` with `threads` threads (std::thread),
// bytes per second of one full pass: the memory bound Gemv is measured against.
double MeasureReadBandwidth(const void* data, size_t bytes, int threads);

// The best of `passes` MeasureReadBandwidth passes over a fresh buffer of
// `bytes` (allocated, filled and freed here).
double BestReadBandwidth(size_t bytes, int threads, int passes = 3);

}  // namespace vlm
