#include "common/kernels/thread_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include <ATen/Parallel.h>

namespace vlm::kernels {
namespace {

thread_local bool t_in_region = false;

struct alignas(64) Part {
  std::atomic<int64_t> next{0};
  int64_t end = 0;
};

struct Job {
  const std::function<void(int64_t, int64_t)>* fn = nullptr;
  int64_t tasks = 0;
  int64_t grain = 1;
  int parts = 0;
  Part* part = nullptr;  // part[i] counts chunks of `grain` tasks
};

// Parts for up to this many threads live on the caller's stack (no heap
// allocation per call: decode makes ~200 calls per token).
constexpr int kInlineParts = 8;

void Participate(Job& job, int first) {
  t_in_region = true;
  for (int i = 0; i < job.parts; ++i) {
    Part& p = job.part[(first + i) % job.parts];
    for (;;) {
      const int64_t c = p.next.fetch_add(1, std::memory_order_relaxed);
      if (c >= p.end) break;
      const int64_t begin = c * job.grain;
      (*job.fn)(begin, std::min(job.tasks, begin + job.grain));
    }
  }
  t_in_region = false;
}

// Joining and closing a job go through one atomic word (closed bit | number of
// workers inside), so the caller only waits for workers that already joined.
class WorkerPool {
 public:
  static WorkerPool& Instance() {
    static WorkerPool* pool = new WorkerPool;  // workers live as long as the process
    return *pool;
  }

  void Run(Job& job, int threads) {
    std::unique_lock<std::mutex> lock(run_mu_, std::try_to_lock);
    if (!lock.owns_lock()) {  // another caller's job is running: do this one alone
      Participate(job, 0);
      return;
    }
    while (static_cast<int>(workers_) < threads - 1) {
      std::thread(&WorkerPool::WorkerLoop, this, static_cast<int>(workers_++)).detach();
    }
    wanted_.store(threads - 1, std::memory_order_relaxed);
    job_.store(&job, std::memory_order_relaxed);
    state_.store(0, std::memory_order_release);  // open, nobody inside
    generation_.fetch_add(1, std::memory_order_release);
    {
      std::lock_guard<std::mutex> sleep_lock(sleep_mu_);
      if (sleepers_ > 0) sleep_cv_.notify_all();
    }
    Participate(job, 0);
    state_.fetch_or(kClosed, std::memory_order_acq_rel);
    while ((state_.load(std::memory_order_acquire) & ~kClosed) != 0) _mm_pause();
  }

 private:
  static constexpr int64_t kClosed = int64_t{1} << 40;
  static constexpr auto kSpin = std::chrono::microseconds(1000);

  void WorkerLoop(int id) {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      auto spin_start = std::chrono::steady_clock::now();
      uint64_t g;
      for (int spins = 1; (g = generation_.load(std::memory_order_acquire)) == seen; ++spins) {
        _mm_pause();
        if (spins % 256 == 0 && std::chrono::steady_clock::now() - spin_start > kSpin) {
          std::unique_lock<std::mutex> sleep_lock(sleep_mu_);
          ++sleepers_;
          sleep_cv_.wait(sleep_lock,
                         [&] { return generation_.load(std::memory_order_acquire) != seen; });
          --sleepers_;
          spin_start = std::chrono::steady_clock::now();
        }
      }
      seen = g;
      if (id >= wanted_.load(std::memory_order_relaxed)) continue;
      int64_t s = state_.load(std::memory_order_acquire);
      bool joined = false;
      while (!joined && (s & kClosed) == 0) {
        joined = state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel);
      }
      if (!joined) continue;
      Participate(*job_.load(std::memory_order_relaxed), id + 1);
      state_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::mutex run_mu_;  // one job at a time; guards workers_
  size_t workers_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> state_{kClosed};
  std::atomic<Job*> job_{nullptr};
  std::atomic<int> wanted_{0};
  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
  int sleepers_ = 0;  // guarded by sleep_mu_
};

}  // namespace

int DefaultThreads() { return std::max(1, at::get_num_threads()); }

bool InParallelRegion() { return t_in_region; }

void ParallelFor(int64_t tasks, int threads, int64_t grain,
                 const std::function<void(int64_t, int64_t)>& fn) {
  if (tasks <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (threads <= 0) threads = DefaultThreads();
  const int64_t chunks = (tasks + grain - 1) / grain;
  threads = static_cast<int>(std::min<int64_t>(threads, chunks));
  if (threads <= 1 || t_in_region || at::in_parallel_region()) {
    const bool outer = t_in_region;
    t_in_region = true;
    for (int64_t b = 0; b < tasks; b += grain) fn(b, std::min(tasks, b + grain));
    t_in_region = outer;
    return;
  }
  Job job;
  job.fn = &fn;
  job.tasks = tasks;
  job.grain = grain;
  job.parts = threads;
  Part inline_parts[kInlineParts];
  std::unique_ptr<Part[]> heap_parts;
  if (threads <= kInlineParts) {
    job.part = inline_parts;
  } else {
    heap_parts.reset(new Part[threads]);
    job.part = heap_parts.get();
  }
  for (int t = 0; t < threads; ++t) {
    job.part[t].next = chunks * t / threads;
    job.part[t].end = chunks * (t + 1) / threads;
  }
  WorkerPool::Instance().Run(job, threads);
}

}  // namespace vlm::kernels
