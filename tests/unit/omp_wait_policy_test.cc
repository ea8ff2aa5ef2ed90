// The services start LibTorch's OpenMP threads with passive waiting (see
// common/omp_wait_policy.h): checked on the real binaries through libgomp's own
// report of its settings (OMP_DISPLAY_ENV=verbose prints them when it loads; a
// re-executed process prints twice, and the last report is the one in force).
#include <cstdio>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

// Runs `env <env_args> OMP_DISPLAY_ENV=verbose <binary> --version` and returns the value
// of the last GOMP_SPINCOUNT libgomp printed, or "" if none.
std::string LastSpinCount(const std::string& env_args, const std::string& binary) {
  const std::string cmd =
      "env " + env_args + " OMP_DISPLAY_ENV=verbose '" + binary + "' --version 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return "";
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  pclose(pipe);
  const std::string key = "GOMP_SPINCOUNT = '";
  const size_t at = out.rfind(key);
  if (at == std::string::npos) return "";
  const size_t end = out.find('\'', at + key.size());
  return out.substr(at + key.size(), end - at - key.size());
}

class OmpWaitPolicyTest : public testing::TestWithParam<const char*> {};

TEST_P(OmpWaitPolicyTest, UnsetPolicyRestartsWithPassiveWaiting) {
  // libgomp's default (unset) spins 300000 rounds; passive spins none.
  EXPECT_EQ(LastSpinCount("-u OMP_WAIT_POLICY", GetParam()), "0");
}

TEST_P(OmpWaitPolicyTest, OperatorChoiceIsKept) {
  const std::string active = LastSpinCount("OMP_WAIT_POLICY=active", GetParam());
  EXPECT_NE(active, "0");
  EXPECT_NE(active, "");
  EXPECT_EQ(LastSpinCount("OMP_WAIT_POLICY=passive", GetParam()), "0");
}

INSTANTIATE_TEST_SUITE_P(Services, OmpWaitPolicyTest,
                         testing::Values(VLM_LANGUAGE_PATH, VLM_VISION_PATH));

}  // namespace
