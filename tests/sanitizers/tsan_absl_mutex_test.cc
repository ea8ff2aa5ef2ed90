// TSan build only (label concurrency): data guarded by absl::Mutex, handed
// over through CondVar::Wait, Mutex::Await and LockWhen, gives no TSan report.
// Without tests/sanitizers/tsan_absl_mutex.cc every one of these accesses is
// reported as a race (Debian's abseil is not instrumented) and, with
// TSAN_OPTIONS=halt_on_error=1 (scripts/test.sh), the test fails.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace {

TEST(TsanAbslMutexTest, GuardedCountersHaveNoReportedRace) {
  absl::Mutex mu;
  int64_t counter = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) {
        absl::MutexLock lock(&mu);
        ++counter;
      }
    });
  }
  for (auto& t : threads) t.join();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(counter, 4000);
}

TEST(TsanAbslMutexTest, HandOverThroughCondVarAwaitAndLockWhen) {
  absl::Mutex mu;
  absl::CondVar cv;
  std::vector<int> payload;  // written by the producer, read after each handover
  int stage = 0;
  std::thread producer([&] {
    {
      absl::MutexLock lock(&mu);
      payload.push_back(1);
      stage = 1;
      cv.Signal();
    }
    mu.LockWhen(absl::Condition(+[](int* s) { return *s == 2; }, &stage));
    payload.push_back(3);
    stage = 3;
    mu.Unlock();
  });
  {
    absl::MutexLock lock(&mu);
    while (stage != 1) cv.WaitWithTimeout(&mu, absl::Seconds(10));
    EXPECT_EQ(payload.size(), 1u);
    payload.push_back(2);
    stage = 2;
    mu.Await(absl::Condition(+[](int* s) { return *s == 3; }, &stage));
    EXPECT_EQ(payload, (std::vector<int>{1, 2, 3}));
  }
  producer.join();
}

}  // namespace
