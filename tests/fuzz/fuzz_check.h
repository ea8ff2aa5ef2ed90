// Small pieces shared by the libFuzzer targets of tests/fuzz.
//
// FUZZ_CHECK(cond, ...) aborts with a message when a property of the code
// under test does not hold; libFuzzer records the input as a crash. A target
// only checks properties its code promises (round trips, stated contracts);
// a refused input (a non-OK status) is never a finding.
#pragma once

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(cond, ...)                                                 \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "%s:%d: property failed: %s\n", __FILE__, __LINE__, \
                   #cond);                                                    \
      std::fprintf(stderr, __VA_ARGS__);                                      \
      std::fprintf(stderr, "\n");                                             \
      std::abort();                                                           \
    }                                                                         \
  } while (0)
