// The kernels' process-wide pool (common/kernels/thread_pool.h), which the
// bf16 decode GEMV, the int8 GEMV, the GEMM and the quantizer all share:
// every task runs exactly once whatever the split, nested calls run inline,
// and callers on several threads at once all finish.
#include "common/kernels/thread_pool.h"

#include <atomic>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

namespace vlm::kernels {
namespace {

TEST(ThreadPoolTest, EveryTaskRunsExactlyOnceWithinGrain) {
  for (int threads : {1, 2, 3, 8}) {
    for (int64_t tasks : {1, 2, 7, 64, 1000}) {
      for (int64_t grain : {1, 3, 64}) {
        std::vector<std::atomic<int>> runs(tasks);
        std::atomic<bool> range_ok{true};
        ParallelFor(tasks, threads, grain, [&](int64_t b, int64_t e) {
          if (b >= e || e - b > grain || b < 0 || e > tasks) range_ok = false;
          for (int64_t i = b; i < e; ++i) runs[i].fetch_add(1);
        });
        EXPECT_TRUE(range_ok) << threads << " threads, " << tasks << " tasks, grain " << grain;
        for (int64_t i = 0; i < tasks; ++i) {
          ASSERT_EQ(runs[i].load(), 1) << "task " << i << " of " << tasks << ", " << threads
                                       << " threads, grain " << grain;
        }
      }
    }
  }
}

TEST(ThreadPoolTest, NoTasksRunsNothing) {
  bool ran = false;
  ParallelFor(0, 2, 1, [&](int64_t, int64_t) { ran = true; });
  EXPECT_FALSE(ran);
}

TEST(ThreadPoolTest, NestedCallsRunInlineOnTheCallingThread) {
  std::atomic<int> inner_tasks{0};
  std::atomic<bool> nested_elsewhere{false};
  ParallelFor(8, 2, 1, [&](int64_t, int64_t) {
    EXPECT_TRUE(InParallelRegion());
    const std::thread::id me = std::this_thread::get_id();
    ParallelFor(16, 2, 1, [&](int64_t b, int64_t e) {
      if (std::this_thread::get_id() != me) nested_elsewhere = true;
      inner_tasks += static_cast<int>(e - b);
    });
    EXPECT_TRUE(InParallelRegion());  // still inside the outer task
  });
  EXPECT_FALSE(InParallelRegion());
  EXPECT_EQ(inner_tasks.load(), 8 * 16);
  EXPECT_FALSE(nested_elsewhere.load());
}

TEST(ThreadPoolTest, ConcurrentCallersAllFinishWithEveryTask) {
  constexpr int kCallers = 4, kCalls = 200;
  std::vector<std::thread> callers;
  std::vector<int64_t> sums(kCallers, 0);
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int call = 0; call < kCalls; ++call) {
        std::atomic<int64_t> sum{0};
        ParallelFor(100, 2, 4, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) sum += i;
        });
        sums[c] += sum.load();
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) EXPECT_EQ(sums[c], int64_t{kCalls} * 4950) << "caller " << c;
}

TEST(ThreadPoolTest, DefaultThreadsFollowsLibTorchSetting) {
  at::set_num_threads(2);
  EXPECT_EQ(DefaultThreads(), 2);
  at::set_num_threads(1);
  EXPECT_EQ(DefaultThreads(), 1);
}

}  // namespace
}  // namespace vlm::kernels
