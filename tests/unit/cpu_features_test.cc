// The compute-dtype parser every service shares, the usable-core count that
// sizes the vision service's threads, and the AMX permission request.
#include "common/cpu_features.h"

#include <sched.h>

#include <cstdlib>
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

TEST(IsaCapTest, Avx2HidesAvx512AndAmxButKeepsAvx2) {
  CpuFeatures all;
  all.avx2 = all.fma = all.f16c = all.avxvnni = true;
  all.avx512f = all.avx512bw = all.avx512vl = all.avx512dq = all.avx512bf16 = true;
  all.avx512vnni = all.amx_bf16 = all.amx_int8 = all.amx_tile = true;
  absl::StatusOr<CpuFeatures> avx2 = CapCpuFeatures(all, "AVX2");
  ASSERT_TRUE(avx2.ok()) << avx2.status();
  EXPECT_TRUE(avx2->avx2 && avx2->fma && avx2->avxvnni);
  EXPECT_FALSE(avx2->avx512f || avx2->avx512bw || avx2->avx512vl || avx2->avx512dq ||
               avx2->avx512bf16 || avx2->avx512vnni || avx2->amx_bf16 || avx2->amx_int8 ||
               avx2->amx_tile);
  EXPECT_FALSE(avx2->fast_bf16_matmul());
  EXPECT_TRUE(avx2->avx2_fma());
  EXPECT_EQ(avx2->isa_cap, "avx2");
  EXPECT_NE(avx2->Describe().find("VLM_ISA=avx2"), std::string::npos) << avx2->Describe();

  absl::StatusOr<CpuFeatures> scalar = CapCpuFeatures(all, "scalar");
  ASSERT_TRUE(scalar.ok());
  EXPECT_FALSE(scalar->avx2 || scalar->fma || scalar->avx512f || scalar->amx_tile);

  for (const char* native : {"", "native"}) {
    absl::StatusOr<CpuFeatures> same = CapCpuFeatures(all, native);
    ASSERT_TRUE(same.ok());
    EXPECT_TRUE(same->avx512bf16 && same->amx_tile) << native;
    EXPECT_TRUE(same->isa_cap.empty());
  }
  // A cap never adds what the CPU lacks.
  CpuFeatures old;
  absl::StatusOr<CpuFeatures> capped = CapCpuFeatures(old, "avx2");
  ASSERT_TRUE(capped.ok());
  EXPECT_FALSE(capped->avx2);

  absl::StatusOr<CpuFeatures> bad = CapCpuFeatures(all, "avx1024");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("avx2"), std::string::npos);
}

// Under VLM_ISA (the _avx2 / _scalar ctest entries) every kernel's dispatch
// sees the capped set; otherwise the CPU's own.
TEST(IsaCapTest, GetCpuFeaturesAppliesTheEnvironment) {
  const char* env = std::getenv("VLM_ISA");
  absl::StatusOr<CpuFeatures> expected = CapCpuFeatures(GetDetectedCpuFeatures(), env ? env : "");
  ASSERT_TRUE(expected.ok());
  const CpuFeatures& f = GetCpuFeatures();
  EXPECT_EQ(f.avx2, expected->avx2);
  EXPECT_EQ(f.avx512f, expected->avx512f);
  EXPECT_EQ(f.avx512bf16, expected->avx512bf16);
  EXPECT_EQ(f.amx_tile, expected->amx_tile);
  EXPECT_EQ(f.isa_cap, expected->isa_cap);
  if (env != nullptr && std::string(env) == "avx2") {
    EXPECT_FALSE(f.avx512f);
    std::string why;
    EXPECT_FALSE(RequestAmxPermission(&why));
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
