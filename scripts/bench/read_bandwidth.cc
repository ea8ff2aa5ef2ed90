// Read bandwidth for the benchmarks' bounds (see read_bandwidth.h).
#include "scripts/bench/read_bandwidth.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "common/cpu_features.h"

namespace vlm {

// ---------------------------------------------------------------------------
// Read bandwidth. Each thread sums the 64-bit words of its contiguous share in
// one of two orders, and the faster order counts: plain sequential, or tiles
// of four 4 KiB chunks read side by side while the next tile is prefetched
// (the order Gemv reads four rows of a 2048-wide bf16 matrix). Vectorized for
// AVX-512 or AVX2 when the CPU has them.

namespace {

constexpr size_t kChunk = 4096, kTile = 4 * kChunk;

// The three versions differ only in the vector type; `V`, `LOAD` and `ADD`
// name it and its operations, `acc` is V[4].
#define VLM_SUM_RANGE(V, LOAD, ADD)                                             \
  size_t i = 0;                                                                 \
  if (tiles) {                                                                  \
    for (; i + kTile <= n; i += kTile) {                                        \
      for (size_t j = 0; j < kChunk; j += sizeof(V)) {                          \
        for (size_t c = 0; c < 4; ++c) {                                        \
          const char* q = p + i + c * kChunk + j;                               \
          if (j % 64 == 0) _mm_prefetch(q + kTile, _MM_HINT_T0);                \
          acc[c] = ADD(acc[c], LOAD(q));                                        \
        }                                                                       \
      }                                                                         \
    }                                                                           \
  } else {                                                                      \
    for (; i + 4 * sizeof(V) <= n; i += 4 * sizeof(V)) {                        \
      for (size_t c = 0; c < 4; ++c) acc[c] = ADD(acc[c], LOAD(p + i + c * sizeof(V))); \
    }                                                                           \
  }                                                                             \
  for (; i + sizeof(V) <= n; i += sizeof(V)) acc[0] = ADD(acc[0], LOAD(p + i));

#define VLM_LOAD512(q) _mm512_loadu_si512(q)
__attribute__((target("avx512f"))) uint64_t SumAvx512(const char* p, size_t n, bool tiles) {
  __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                    _mm512_setzero_si512()};
  VLM_SUM_RANGE(__m512i, VLM_LOAD512, _mm512_add_epi64)
  return _mm512_reduce_add_epi64(
      _mm512_add_epi64(_mm512_add_epi64(acc[0], acc[1]), _mm512_add_epi64(acc[2], acc[3])));
}

#define VLM_LOAD256(q) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))
__attribute__((target("avx2"))) uint64_t SumAvx2(const char* p, size_t n, bool tiles) {
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                    _mm256_setzero_si256()};
  VLM_SUM_RANGE(__m256i, VLM_LOAD256, _mm256_add_epi64)
  const __m256i s = _mm256_add_epi64(_mm256_add_epi64(acc[0], acc[1]),
                                     _mm256_add_epi64(acc[2], acc[3]));
  uint64_t lanes[4];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), s);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

inline uint64_t Load64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline uint64_t Add64(uint64_t a, uint64_t b) { return a + b; }
uint64_t SumScalar(const char* p, size_t n, bool tiles) {
  uint64_t acc[4] = {0, 0, 0, 0};
  VLM_SUM_RANGE(uint64_t, Load64, Add64)
  return acc[0] + acc[1] + acc[2] + acc[3];
}

// Seconds for `threads` threads to sum their shares of [data, data + bytes).
double TimedSum(const char* data, size_t bytes, int threads, bool tiles) {
  auto sum = SumScalar;
  if (GetCpuFeatures().avx512f) sum = SumAvx512;
  else if (GetCpuFeatures().avx2) sum = SumAvx2;
  std::vector<uint64_t> sums(threads);
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  auto work = [&](int t) {
    const size_t lo = bytes / threads * t / 64 * 64;
    const size_t hi = t + 1 == threads ? bytes : bytes / threads * (t + 1) / 64 * 64;
    ready.fetch_add(1);
    while (!go.load(std::memory_order_acquire)) {
    }
    sums[t] = sum(data + lo, hi - lo, tiles);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
  while (ready.load() < threads - 1) std::this_thread::yield();
  const auto start = std::chrono::steady_clock::now();
  go.store(true, std::memory_order_release);
  work(0);
  for (std::thread& th : pool) th.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Keep the sums observable so the reads cannot be optimized away.
  volatile uint64_t sink = 0;
  for (uint64_t s : sums) sink = sink + s;
  (void)sink;
  return seconds;
}

}  // namespace

double MeasureReadBandwidth(const void* data, size_t bytes, int threads) {
  threads = std::max(1, threads);
  const char* p = static_cast<const char*>(data);
  const double seconds =
      std::min(TimedSum(p, bytes, threads, false), TimedSum(p, bytes, threads, true));
  return static_cast<double>(bytes) / seconds;
}

double BestReadBandwidth(size_t bytes, int threads, int passes) {
  std::vector<uint64_t> buffer(bytes / 8);
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = i;
  double best = 0;
  for (int i = 0; i < passes; ++i) {
    best = std::max(best, MeasureReadBandwidth(buffer.data(), buffer.size() * 8, threads));
  }
  return best;
}

}  // namespace vlm
