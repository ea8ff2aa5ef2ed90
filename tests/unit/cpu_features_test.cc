// The compute-dtype parser every service shares, the usable-core count that
// sizes the vision service's threads, and the AMX permission request.
#include "common/cpu_features.h"

#include <sched.h>

#include <string>

#include <gtest/gtest.h>

namespace vlm {
namespace {

TEST(ParseComputeDTypeTest, AcceptsTheSameSpellingsAsEveryService) {
  for (const char* v : {"bf16", "bfloat16", "BF16", "BFloat16"}) {
    absl::StatusOr<ComputeDType> d = ParseComputeDType(v);
    ASSERT_TRUE(d.ok()) << v;
    EXPECT_EQ(*d, ComputeDType::kBFloat16) << v;
  }
  for (const char* v : {"f32", "float32", "F32", "Float32"}) {
    absl::StatusOr<ComputeDType> d = ParseComputeDType(v);
    ASSERT_TRUE(d.ok()) << v;
    EXPECT_EQ(*d, ComputeDType::kFloat32) << v;
  }
}

TEST(ParseComputeDTypeTest, RejectsOthersNamingTheAcceptedValues) {
  for (const char* v : {"fp16", "", "bf 16", "float64"}) {
    absl::StatusOr<ComputeDType> d = ParseComputeDType(v);
    ASSERT_FALSE(d.ok()) << v;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find("bf16 or f32"), std::string::npos) << d.status();
  }
}

TEST(UsableCoresTest, IsAtLeastOneAndWithinTheAffinityMask) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  const int cores = UsableCores();
  EXPECT_GE(cores, 1);
  EXPECT_LE(cores, CPU_COUNT(&set));
}

TEST(UsableCoresTest, FollowsANarrowerAffinityMask) {
  cpu_set_t saved;
  ASSERT_EQ(sched_getaffinity(0, sizeof saved, &saved), 0);
  int first = -1;
  for (int c = 0; c < CPU_SETSIZE && first < 0; ++c) {
    if (CPU_ISSET(c, &saved)) first = c;
  }
  ASSERT_GE(first, 0);
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof one, &one), 0);
  EXPECT_EQ(UsableCores(), 1);
  ASSERT_EQ(sched_setaffinity(0, sizeof saved, &saved), 0);
}

TEST(AmxPermissionTest, GrantedOnlyWithAmxTilesAndOtherwiseSaysWhy) {
  std::string why;
  const bool granted = RequestAmxPermission(&why);
  if (!GetCpuFeatures().amx_tile || !GetCpuFeatures().amx_bf16) {
    EXPECT_FALSE(granted);
    EXPECT_NE(why.find("AMX"), std::string::npos) << why;
  } else if (!granted) {
    EXPECT_FALSE(why.empty());
  }
  EXPECT_EQ(RequestAmxPermission(), granted);  // decided once per process
}

}  // namespace
}  // namespace vlm
