// Small helpers every benchmark program uses: medians, the load average (the
// tables print it so a reader can judge the noise), wall and thread-CPU
// timing of a callable, and "--name value" arguments. Header-only.
#pragma once

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace vlm::bench {

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// /proc/loadavg's 1, 5 and 15 minute averages.
inline std::string LoadAverage() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

// Wall seconds of fn().
inline double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Seconds of the calling thread's own CPU time spent in fn(): time the thread
// was descheduled does not count, so the figure holds on a shared machine.
inline double ThreadCpuSeconds(const std::function<void()>& fn) {
  timespec a, b;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
  fn();
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
  return (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
}

// The integer after `name` on the command line, or `fallback`.
inline int ArgInt(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  }
  return fallback;
}

// The comma-separated integers after `name` ("256,1024"; "" is an empty
// list), or `fallback` when `name` is absent.
inline std::vector<int64_t> ArgList(int argc, char** argv, const char* name,
                                    std::vector<int64_t> fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) != 0) continue;
    std::vector<int64_t> v;
    for (const char* s = argv[i + 1]; *s != '\0';) {
      char* end = nullptr;
      const long long x = std::strtoll(s, &end, 10);
      if (end == s) break;
      v.push_back(x);
      s = *end == ',' ? end + 1 : end;
    }
    return v;
  }
  return fallback;
}

}  // namespace vlm::bench
