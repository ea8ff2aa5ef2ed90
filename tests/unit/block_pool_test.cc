// BlockPool states (free / cached / in use), LRU eviction of unreferenced
// cached blocks, and the prefix keys of full blocks (tokens, parent chain,
// image key and offset).
#include "services/language/engine/block_pool.h"

#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "services/language/engine/block_key.h"

namespace vlm::language {
namespace {

BlockKey Key(uint64_t v) { return BlockKey{v, v * 7 + 1}; }

TEST(BlockPoolTest, AllocatesEveryBlockOnceThenNothing) {
  BlockPool pool(4);
  std::set<int32_t> seen;
  for (int i = 0; i < 4; ++i) {
    std::optional<int32_t> b = pool.Allocate();
    ASSERT_TRUE(b.has_value());
    EXPECT_TRUE(seen.insert(*b).second);
    EXPECT_EQ(pool.ref_count(*b), 1);
  }
  EXPECT_FALSE(pool.Allocate().has_value());
  EXPECT_EQ(pool.num_used(), 4);
  EXPECT_EQ(pool.num_available(), 0);
  for (int32_t b : seen) pool.Release(b);
  EXPECT_EQ(pool.num_free(), 4);
  EXPECT_EQ(pool.num_used(), 0);
}

TEST(BlockPoolTest, ReleasedKeyedBlockStaysCachedAndIsFoundByKey) {
  BlockPool pool(2);
  const int32_t b = *pool.Allocate();
  pool.Register(b, Key(1));
  pool.Release(b);
  EXPECT_EQ(pool.num_cached(), 1);
  EXPECT_EQ(pool.num_free(), 1);
  std::optional<int32_t> hit = pool.Acquire(Key(1));
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(*hit, b);
  EXPECT_EQ(pool.ref_count(b), 1);
  EXPECT_EQ(pool.num_cached(), 0);
  EXPECT_FALSE(pool.Acquire(Key(2)).has_value());
  // Shared: two references, one release keeps it in use.
  ASSERT_TRUE(pool.Acquire(Key(1)).has_value());
  pool.Release(b);
  EXPECT_EQ(pool.ref_count(b), 1);
  pool.Release(b);
  EXPECT_EQ(pool.num_cached(), 1);
}

TEST(BlockPoolTest, FreeBlocksGoFirstThenLeastRecentlyReleasedCachedBlockIsEvicted) {
  BlockPool pool(3);
  const int32_t a = *pool.Allocate(), b = *pool.Allocate(), c = *pool.Allocate();
  pool.Register(a, Key(1));
  pool.Register(b, Key(2));
  pool.Release(b);  // b released before a: b is the least recent
  pool.Release(a);
  pool.Release(c);  // unkeyed: free
  EXPECT_EQ(pool.Allocate(), c);
  EXPECT_EQ(pool.Allocate(), b);  // evicted, its key forgotten
  EXPECT_FALSE(pool.Contains(Key(2)));
  EXPECT_TRUE(pool.Contains(Key(1)));
  EXPECT_FALSE(pool.keyed(b));
  EXPECT_EQ(pool.Allocate(), a);
  EXPECT_FALSE(pool.Allocate().has_value());
}

TEST(BlockPoolTest, SecondBlockWithAKnownKeyStaysUnkeyedAndReturnsToTheFreeList) {
  BlockPool pool(2);
  const int32_t a = *pool.Allocate(), b = *pool.Allocate();
  pool.Register(a, Key(5));
  pool.Register(b, Key(5));
  EXPECT_TRUE(pool.keyed(a));
  EXPECT_FALSE(pool.keyed(b));
  pool.Release(b);
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_EQ(*pool.Acquire(Key(5)), a);
  EXPECT_NE(pool.DebugString().find("blocks=2"), std::string::npos) << pool.DebugString();
}

TEST(BlockKeyTest, KeysChainThroughParentsAndCoverOnlyFullBlocks) {
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  std::vector<int32_t> b = a;
  b[1] = 99;  // differs in block 0 only
  const std::vector<BlockKey> ka = ComputeBlockKeys(a, 4, {});
  const std::vector<BlockKey> kb = ComputeBlockKeys(b, 4, {});
  ASSERT_EQ(ka.size(), 2u);  // 9 tokens: two full blocks of 4
  EXPECT_NE(ka[0], kb[0]);
  EXPECT_NE(ka[1], kb[1]) << "block 1 has equal tokens but a different parent";
  // Resuming from known keys gives the same chain.
  EXPECT_EQ(ComputeBlockKeys(a, 4, {}, absl::MakeConstSpan(ka).subspan(0, 1)), ka);
}

TEST(BlockKeyTest, ImageKeyAndOffsetEnterTheKeysOfItsBlocks) {
  const std::vector<int32_t> tokens = {7, 9, 9, 9, 9, 9, 9, 8};  // 9 = image pad
  KeyedImageSpan image{1, 6, BlockKey{1, 2}};
  KeyedImageSpan other = image;
  other.key = BlockKey{3, 4};
  KeyedImageSpan shifted = image;  // same pads, image starts one later
  shifted.start = 2;
  shifted.length = 5;
  const auto k1 = ComputeBlockKeys(tokens, 4, {&image, 1});
  const auto k2 = ComputeBlockKeys(tokens, 4, {&other, 1});
  const auto k3 = ComputeBlockKeys(tokens, 4, {&shifted, 1});
  const auto k4 = ComputeBlockKeys(tokens, 4, {&image, 1});
  EXPECT_EQ(k1, k4);
  EXPECT_NE(k1[0], k2[0]);
  EXPECT_NE(k1[0], k3[0]);
  EXPECT_NE(k1[1], k3[1]);
}

TEST(BlockKeyTest, ImageKeyCoversGridAndEveryFeatureByte) {
  const float a[4] = {1, 2, 3, 4};
  float b[4] = {1, 2, 3, 4};
  auto key = [](int64_t h, const float* data) {
    ImageKeyBuilder k(1, h, 2);
    k.AddTensor(6, data, 16);
    return k.Finish();
  };
  EXPECT_EQ(key(2, a), key(2, b));
  EXPECT_NE(key(2, a), key(4, a));
  b[3] = 5;
  EXPECT_NE(key(2, a), key(2, b));
}

}  // namespace
}  // namespace vlm::language
