// KvCacheManager: growth by blocks, prefix matching (never the whole prompt),
// registration of computed full blocks, freeing, and the switch that turns
// the prefix cache off.
#include "services/language/engine/kv_cache_manager.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

namespace vlm::language {
namespace {

std::vector<int32_t> Iota(int n, int first = 100) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

TEST(KvCacheManagerTest, GrowAllocatesWholeBlocksOrNothing) {
  KvCacheManager kv(4, 16, true);
  KvBlocks seq;
  EXPECT_TRUE(kv.Grow(seq, 1));
  EXPECT_EQ(seq.table.size(), 1u);
  EXPECT_TRUE(kv.Grow(seq, 16));
  EXPECT_EQ(seq.table.size(), 1u);
  EXPECT_TRUE(kv.Grow(seq, 17));
  EXPECT_EQ(seq.table.size(), 2u);
  EXPECT_FALSE(kv.Grow(seq, 16 * 4 + 1));
  EXPECT_EQ(seq.table.size(), 2u) << "a failed Grow allocates nothing";
  kv.Free(seq);
  EXPECT_EQ(kv.pool().num_free(), 4);
}

TEST(KvCacheManagerTest, RegisteredPrefixIsReusedButNeverTheWholePrompt) {
  KvCacheManager kv(8, 4, true);
  const std::vector<int32_t> prompt = Iota(12);  // exactly three blocks
  KvBlocks first;
  ASSERT_EQ(kv.AcquirePrefix(first, prompt, {}, 11), 0);
  ASSERT_TRUE(kv.Grow(first, 12));
  kv.RegisterFull(first, prompt, {}, 12);
  kv.Free(first);
  EXPECT_EQ(kv.pool().num_cached(), 3);

  KvBlocks second;
  // Same prompt: the last token must be recomputed, so only two blocks match.
  EXPECT_EQ(kv.AcquirePrefix(second, prompt, {}, 11), 8);
  EXPECT_EQ(second.table.size(), 2u);
  EXPECT_EQ(kv.pool().num_used(), 2);
  kv.Free(second);

  // A longer prompt that starts the same way reuses all three.
  std::vector<int32_t> longer = prompt;
  longer.push_back(7);
  longer.push_back(8);
  KvBlocks third;
  EXPECT_EQ(kv.AcquirePrefix(third, longer, {}, 13), 12);
  // A prompt that differs in its first token reuses nothing.
  std::vector<int32_t> other = longer;
  other[0] = 1;
  KvBlocks fourth;
  EXPECT_EQ(kv.AcquirePrefix(fourth, other, {}, 13), 0);
  kv.Free(third);
  kv.Free(fourth);
  EXPECT_EQ(kv.pool().num_used(), 0);
}

TEST(KvCacheManagerTest, OnlyBlocksFullOfComputedTokensAreRegistered) {
  KvCacheManager kv(8, 4, true);
  const std::vector<int32_t> tokens = Iota(10);
  KvBlocks seq;
  ASSERT_TRUE(kv.Grow(seq, 10));
  kv.RegisterFull(seq, tokens, {}, 7);  // block 0 full, block 1 not yet
  EXPECT_EQ(seq.registered, 1u);
  kv.RegisterFull(seq, tokens, {}, 10);
  EXPECT_EQ(seq.registered, 2u);
  kv.Free(seq);
  EXPECT_EQ(kv.pool().num_cached(), 2);
  EXPECT_EQ(kv.pool().num_free(), 6);
}

TEST(KvCacheManagerTest, DifferentImageFeaturesUnderTheSamePadsDoNotMatch) {
  KvCacheManager kv(8, 4, true);
  std::vector<int32_t> tokens = {1, 9, 9, 9, 9, 9, 9, 9, 9, 2};
  KeyedImageSpan a{1, 8, BlockKey{1, 1}};
  KeyedImageSpan b{1, 8, BlockKey{2, 2}};
  KvBlocks seq;
  ASSERT_TRUE(kv.Grow(seq, 10));
  kv.RegisterFull(seq, tokens, {&a, 1}, 10);
  kv.Free(seq);
  KvBlocks same, other;
  EXPECT_EQ(kv.AcquirePrefix(same, tokens, {&a, 1}, 9), 8);
  EXPECT_EQ(kv.AcquirePrefix(other, tokens, {&b, 1}, 9), 0);
  kv.Free(same);
  kv.Free(other);
}

TEST(KvCacheManagerTest, PrefixCacheOffNeitherMatchesNorRegisters) {
  KvCacheManager kv(8, 4, false);
  const std::vector<int32_t> prompt = Iota(12);
  KvBlocks seq;
  ASSERT_TRUE(kv.Grow(seq, 12));
  kv.RegisterFull(seq, prompt, {}, 12);
  kv.Free(seq);
  EXPECT_EQ(kv.pool().num_cached(), 0);
  EXPECT_EQ(kv.AcquirePrefix(seq, prompt, {}, 11), 0);
}

TEST(KvCacheManagerTest, CachedBlocksAreEvictedWhenFreeOnesRunOut) {
  KvCacheManager kv(3, 4, true);
  const std::vector<int32_t> prompt = Iota(12);
  KvBlocks seq;
  ASSERT_TRUE(kv.Grow(seq, 12));
  kv.RegisterFull(seq, prompt, {}, 12);
  kv.Free(seq);
  EXPECT_EQ(kv.pool().num_cached(), 3);
  KvBlocks other;
  EXPECT_TRUE(kv.Grow(other, 12)) << "cached unreferenced blocks count as available";
  EXPECT_EQ(kv.pool().num_cached(), 0);
  kv.Free(other);
}

}  // namespace
}  // namespace vlm::language
