// Scheduler policy without a model: decode first, chunked prefill within the
// token budget, the batch width, admission only when the prefill fits,
// preemption of the newest sequence with full recompute, prefix reuse, and a
// random workload that always finishes and returns every block.
#include "services/language/scheduler.h"

#include <gtest/gtest.h>

#include <memory>
#include <numeric>
#include <random>
#include <vector>

namespace vlm::language {
namespace {

std::unique_ptr<SequenceState> Seq(int prompt, int first = 1000) {
  auto s = std::make_unique<SequenceState>();
  s->tokens.resize(prompt);
  std::iota(s->tokens.begin(), s->tokens.end(), first);
  s->prompt_len = prompt;
  return s;
}

// Runs one iteration as the engine does (every logits chunk samples token 7).
SchedulerOutput Step(Scheduler& s) {
  SchedulerOutput out = s.Schedule();
  s.Complete(out);
  for (const ScheduledChunk& c : out.chunks) {
    if (c.logits) s.Append(c.seq, 7);
  }
  return out;
}

const ScheduledChunk* ChunkOf(const SchedulerOutput& out, const SequenceState* seq) {
  for (const ScheduledChunk& c : out.chunks) {
    if (c.seq == seq) return &c;
  }
  return nullptr;
}

TEST(SchedulerTest, DecodeTokensComeFirstAndLongPromptsAreChunkedByTheBudget) {
  KvCacheManager kv(64, 4, false);
  Scheduler s(&kv, {8, 8});
  auto a = Seq(4), b = Seq(20);
  s.Add(a.get());
  SchedulerOutput first = Step(s);
  ASSERT_EQ(first.chunks.size(), 1u);
  EXPECT_TRUE(first.chunks[0].logits);
  EXPECT_TRUE(a->decoding());

  s.Add(b.get());
  SchedulerOutput second = Step(s);
  const ScheduledChunk* ca = ChunkOf(second, a.get());
  const ScheduledChunk* cb = ChunkOf(second, b.get());
  ASSERT_NE(ca, nullptr);
  ASSERT_NE(cb, nullptr);
  EXPECT_TRUE(ca->decode);
  EXPECT_EQ(ca->count, 1);
  EXPECT_EQ(cb->count, 7) << "budget 8 minus one decode token";
  EXPECT_FALSE(cb->logits);
  // The long prompt never stalls the running stream: a decodes every step.
  for (int i = 0; i < 3; ++i) {
    SchedulerOutput o = Step(s);
    ASSERT_NE(ChunkOf(o, a.get()), nullptr);
    EXPECT_LE(o.prefill_tokens + o.decode_tokens, 8);
  }
  // b: 7 + 7 + 6 prompt tokens (the last chunk samples), then one decode step.
  EXPECT_TRUE(b->decoding());
  EXPECT_EQ(b->tokens.size(), 22u);
}

TEST(SchedulerTest, AtMostMaxSequencesRunAndTheRestWaitInOrder) {
  KvCacheManager kv(64, 4, false);
  Scheduler s(&kv, {2, 64});
  auto a = Seq(3), b = Seq(3), c = Seq(3);
  s.Add(a.get());
  s.Add(b.get());
  s.Add(c.get());
  Step(s);
  EXPECT_EQ(s.num_running(), 2);
  EXPECT_EQ(s.num_waiting(), 1);
  EXPECT_FALSE(c->running);
  s.Remove(a.get());
  SchedulerOutput o = Step(s);
  EXPECT_TRUE(c->running);
  EXPECT_NE(ChunkOf(o, c.get()), nullptr);
}

TEST(SchedulerTest, WaitingRequestIsAdmittedOnlyWhenItsWholePrefillFits) {
  KvCacheManager kv(4, 4, false);
  Scheduler s(&kv, {8, 64});
  auto a = Seq(8), b = Seq(9);  // b needs 3 blocks; 2 are left while a runs
  s.Add(a.get());
  s.Add(b.get());
  SchedulerOutput o = Step(s);
  EXPECT_TRUE(a->running);
  EXPECT_FALSE(b->running);
  EXPECT_EQ(ChunkOf(o, b.get()), nullptr);
  s.Remove(a.get());
  Step(s);
  EXPECT_TRUE(b->running);
}

TEST(SchedulerTest, NewestSequenceIsPreemptedAndRecomputedWithItsGeneratedTokens) {
  KvCacheManager kv(4, 4, false);  // 16 tokens in all
  Scheduler s(&kv, {8, 64});
  auto old_one = Seq(7), young = Seq(7);
  s.Add(old_one.get());
  s.Add(young.get());
  Step(s);  // both prefilled: 2 blocks each, every block in use
  ASSERT_TRUE(old_one->decoding());
  ASSERT_TRUE(young->decoding());
  // Each has 8 tokens (7 + 1 sampled); the next decode needs index 7: fits.
  Step(s);
  // Now both need a third block at index 8: the newest goes.
  SchedulerOutput o = Step(s);
  ASSERT_EQ(o.preempted.size(), 1u);
  EXPECT_EQ(o.preempted[0], young.get());
  EXPECT_FALSE(young->running);
  EXPECT_EQ(young->num_computed, 0);
  EXPECT_EQ(young->prefill_len, 9) << "prompt + generated tokens are recomputed";
  EXPECT_EQ(ChunkOf(o, young.get()), nullptr);
  EXPECT_NE(ChunkOf(o, old_one.get()), nullptr);
  s.Remove(old_one.get());
  SchedulerOutput back = Step(s);
  const ScheduledChunk* c = ChunkOf(back, young.get());
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->start, 0);
  EXPECT_EQ(c->count, 9);
  EXPECT_FALSE(c->decode) << "recomputed tokens run as prefill rows";
  EXPECT_TRUE(c->logits);
  SchedulerOutput next = Step(s);
  ASSERT_NE(ChunkOf(next, young.get()), nullptr);
  EXPECT_TRUE(ChunkOf(next, young.get())->decode);
}

TEST(SchedulerTest, AdmissionReusesTheCachedPrefixAndCountsHitsOnce) {
  KvCacheManager kv(16, 4, true);
  Scheduler s(&kv, {8, 64});
  auto a = Seq(10);
  s.Add(a.get());
  Step(s);
  s.Remove(a.get());  // its two full blocks stay cached
  auto b = Seq(10);
  s.Add(b.get());
  SchedulerOutput o = Step(s);
  EXPECT_EQ(o.prefix_hit_tokens, 8);
  EXPECT_EQ(o.prefix_miss_tokens, 2);
  EXPECT_EQ(b->cached_prompt_tokens, 8);
  const ScheduledChunk* c = ChunkOf(o, b.get());
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->start, 8);
  EXPECT_EQ(c->count, 2);
  s.Remove(b.get());
}

TEST(SchedulerTest, RandomWorkloadAlwaysFinishesAndReturnsEveryBlock) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    std::mt19937 rng(seed);
    const int block = 4;
    const int blocks = 12;  // 48 tokens: every request below fits alone
    KvCacheManager kv(blocks, block, seed % 2 == 0);
    Scheduler s(&kv, {static_cast<int>(1 + rng() % 6), static_cast<int64_t>(4 + rng() % 30)});
    std::vector<std::unique_ptr<SequenceState>> seqs;
    std::vector<int> target;
    for (int i = 0; i < 16; ++i) {
      const int prompt = 1 + static_cast<int>(rng() % 30);
      const int max_new = 1 + static_cast<int>(rng() % (48 - prompt));
      seqs.push_back(Seq(prompt, static_cast<int>(rng() % 3) * 10));  // shared prefixes
      target.push_back(max_new);
    }
    size_t added = 0;
    int finished = 0;
    for (int iter = 0; iter < 5000 && finished < 16; ++iter) {
      if (added < seqs.size() && rng() % 2 == 0) s.Add(seqs[added++].get());
      SchedulerOutput out = s.Schedule();
      s.Complete(out);
      for (const ScheduledChunk& c : out.chunks) {
        if (!c.logits) continue;
        SequenceState* q = c.seq;
        s.Append(q, 7);
        const size_t i = static_cast<size_t>(std::find_if(seqs.begin(), seqs.end(),
                                                          [&](auto& p) { return p.get() == q; }) -
                                             seqs.begin());
        if (static_cast<int>(q->tokens.size()) - q->prompt_len == target[i]) {
          s.Remove(q);
          ++finished;
        }
      }
      if (added == seqs.size() && s.num_running() + s.num_waiting() == 0) break;
    }
    EXPECT_EQ(finished, 16) << "seed " << seed;
    EXPECT_EQ(kv.pool().num_used(), 0) << "seed " << seed << ": " << kv.pool().DebugString();
    EXPECT_EQ(kv.pool().num_available(), blocks);
  }
}

}  // namespace
}  // namespace vlm::language
