// Durations between steady-clock time points, as the services report them
// (logs and metrics in milliseconds). Header-only.
#pragma once

#include <chrono>

namespace vlm {

// Milliseconds from a to b (negative when b is earlier).
inline double MillisBetween(std::chrono::steady_clock::time_point a,
                            std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace vlm
