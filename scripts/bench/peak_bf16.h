// Benchmarks' helper: the machine's VDPBF16PS issue rate from a register-only loop.
#pragma once

// GCC 12 AVX-512 headers warn about their own "undefined" vectors when inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>
#include <vector>

#include "scripts/bench/on_threads.h"

namespace vlm::bench {
namespace {

// 24 independent accumulators, operands in registers. The accumulators start
// from different values: were they equal, the compiler would fold the 24
// identical chains into one (it did, and the "peak" was one latency-bound
// chain counted 24 times). Needs AVX-512 BF16.
__attribute__((target("avx512f,avx512bf16"), noinline)) float Avx512Bf16Loop(int64_t iters) {
  __m512 acc[24];
#pragma GCC unroll 24
  for (int i = 0; i < 24; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80), b = (__m512bh)_mm512_set1_epi32(0x00010001);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  __m512 s = acc[0];
#pragma GCC unroll 24
  for (int i = 1; i < 24; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

// GFLOP/s of the loop on `threads` threads started together (16 lanes x 2
// bf16 MACs x 2 FLOP per instruction).
double PeakAvx512Bf16(int threads, int64_t iters) {
  std::vector<float> sink(threads);
  const double s = OnThreads(threads, [&](int t) { sink[t] = Avx512Bf16Loop(iters); });
  return static_cast<double>(iters) * 24 * 16 * 4 * threads / s / 1e9;
}

}  // namespace
}  // namespace vlm::bench
