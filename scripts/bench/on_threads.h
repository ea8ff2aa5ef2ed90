// Benchmarks' helper: run one function on several threads started together.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

namespace vlm::bench {

// Runs fn(thread) for thread = 0..threads-1 (0 on the caller), released
// together once every thread has started; returns the wall seconds from the
// release until all have returned.
inline double OnThreads(int threads, const std::function<void(int)>& fn) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load()) {
      }
      fn(t);
    });
  }
  while (ready.load() < threads - 1) std::this_thread::yield();
  const auto t0 = std::chrono::steady_clock::now();
  go.store(true);
  fn(0);
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace vlm::bench
