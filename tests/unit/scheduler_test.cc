// Scheduler policy without a model: decode first, chunked prefill within the
// token budget, the batch width, admission only when the prefill fits,
// preemption of the newest sequence with full recompute, prefix reuse, a
// random workload that always finishes and returns every block; admission
// reservations (prompt + max_tokens): queued until they fit, freed at the
// end, no preemption in a workload that declares them, and a sequence larger
// than the pool refused by Add.
#include "services/language/engine/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
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
  ASSERT_TRUE(s.Add(a.get()).ok());
  SchedulerOutput first = Step(s);
  ASSERT_EQ(first.chunks.size(), 1u);
  EXPECT_TRUE(first.chunks[0].logits);
  EXPECT_TRUE(a->decoding());

  ASSERT_TRUE(s.Add(b.get()).ok());
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
  ASSERT_TRUE(s.Add(a.get()).ok());
  ASSERT_TRUE(s.Add(b.get()).ok());
  ASSERT_TRUE(s.Add(c.get()).ok());
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
  ASSERT_TRUE(s.Add(a.get()).ok());
  ASSERT_TRUE(s.Add(b.get()).ok());
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
  ASSERT_TRUE(s.Add(old_one.get()).ok());
  ASSERT_TRUE(s.Add(young.get()).ok());
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
  ASSERT_TRUE(s.Add(a.get()).ok());
  Step(s);
  s.Remove(a.get());  // its two full blocks stay cached
  auto b = Seq(10);
  ASSERT_TRUE(s.Add(b.get()).ok());
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
      if (added < seqs.size() && rng() % 2 == 0) {
        ASSERT_TRUE(s.Add(seqs[added++].get()).ok());
      }
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

// Runs `seqs` (added in order, one every `every` iterations) until each has
// generated target[i] tokens; returns the preemptions. Every iteration checks
// that the running sequences' outstanding reservations fit the pool.
int RunWorkload(Scheduler& s, const KvCacheManager& kv,
                std::vector<std::unique_ptr<SequenceState>>& seqs, const std::vector<int>& target,
                std::mt19937& rng, int* finished) {
  int preemptions = 0;
  size_t added = 0;
  *finished = 0;
  for (int iter = 0; iter < 5000 && *finished < static_cast<int>(seqs.size()); ++iter) {
    if (added < seqs.size() && rng() % 2 == 0) {
      EXPECT_TRUE(s.Add(seqs[added++].get()).ok());
    }
    SchedulerOutput out = s.Schedule();
    preemptions += static_cast<int>(out.preempted.size());
    EXPECT_LE(s.reserved_blocks(), kv.pool().num_available()) << kv.pool().DebugString();
    s.Complete(out);
    for (const ScheduledChunk& c : out.chunks) {
      if (!c.logits) continue;
      SequenceState* q = c.seq;
      s.Append(q, 7);
      const size_t i = static_cast<size_t>(
          std::find_if(seqs.begin(), seqs.end(), [&](auto& p) { return p.get() == q; }) -
          seqs.begin());
      if (static_cast<int>(q->tokens.size()) - q->prompt_len == target[i]) {
        s.Remove(q);
        ++*finished;
      }
    }
  }
  return preemptions;
}

TEST(SchedulerReservationTest, SequenceWaitsUntilItsMaxTokensFitNextToTheRunningReservations) {
  KvCacheManager kv(8, 4, false);  // 32 tokens
  Scheduler s(&kv, {8, 64});
  auto a = Seq(4), b = Seq(4), c = Seq(4);
  a->max_cache_tokens = 4 + 12 - 1;  // 4 blocks
  b->max_cache_tokens = 4 + 20 - 1;  // 6 blocks: 4 + 6 > 8
  c->max_cache_tokens = 4 + 4 - 1;   // 2 blocks: would fit, but waits behind b (FIFO)
  ASSERT_TRUE(s.Add(a.get()).ok());
  ASSERT_TRUE(s.Add(b.get()).ok());
  ASSERT_TRUE(s.Add(c.get()).ok());
  for (int i = 0; i < 5; ++i) {
    SchedulerOutput o = Step(s);
    EXPECT_TRUE(o.preempted.empty());
    EXPECT_TRUE(a->running);
    EXPECT_FALSE(b->running) << "b's prompt fits (1 block of "
                             << kv.pool().num_available() << " free) but its growth does not";
    EXPECT_FALSE(c->running);
    EXPECT_EQ(ChunkOf(o, b.get()), nullptr);
  }
  // a holds 2 blocks (8 cache tokens after 5 steps) of its 4.
  EXPECT_EQ(a->kv.table.size(), 2u);
  EXPECT_EQ(s.reserved_blocks(), 2);
  EXPECT_EQ(s.num_waiting(), 2);
}

TEST(SchedulerReservationTest, FinishedSequenceFreesItsReservation) {
  KvCacheManager kv(8, 4, false);
  Scheduler s(&kv, {8, 64});
  auto a = Seq(4), b = Seq(4), c = Seq(4);
  a->max_cache_tokens = 15;  // 4 blocks
  b->max_cache_tokens = 23;  // 6 blocks
  c->max_cache_tokens = 7;   // 2 blocks
  ASSERT_TRUE(s.Add(a.get()).ok());
  ASSERT_TRUE(s.Add(b.get()).ok());
  ASSERT_TRUE(s.Add(c.get()).ok());
  Step(s);
  EXPECT_EQ(s.reserved_blocks(), 3) << "a holds 1 of its 4 blocks";
  s.Remove(a.get());
  EXPECT_EQ(s.reserved_blocks(), 0);
  EXPECT_EQ(kv.pool().num_available(), 8);
  SchedulerOutput o = Step(s);
  EXPECT_TRUE(b->running);
  EXPECT_TRUE(c->running) << "6 + 2 blocks fill the pool exactly";
  EXPECT_EQ(o.admitted.size(), 2u);
  EXPECT_EQ(s.reserved_blocks(), 5 + 1);
  // Both grow to their ends without a preemption.
  for (int i = 0; i < 19; ++i) {
    SchedulerOutput step = Step(s);
    EXPECT_TRUE(step.preempted.empty()) << "step " << i;
    if (c->running && c->tokens.size() == 8u) s.Remove(c.get());  // c's 4 tokens
  }
  EXPECT_EQ(b->tokens.size(), 24u);
  EXPECT_EQ(b->num_computed, 23);
  EXPECT_EQ(b->kv.table.size(), 6u);
  s.Remove(b.get());
  EXPECT_EQ(kv.pool().num_used(), 0);
  EXPECT_EQ(s.reserved_blocks(), 0);
}

TEST(SchedulerReservationTest, TheWorkloadThatPreemptsWithoutReservationsRunsOneAtATime) {
  // NewestSequenceIsPreemptedAndRecomputedWithItsGeneratedTokens, with each
  // sequence declaring the 4 tokens it will generate (7 + 4 - 1 = 10 cache
  // tokens, 3 blocks each; 3 + 3 > 4).
  KvCacheManager kv(4, 4, false);
  Scheduler s(&kv, {8, 64});
  auto old_one = Seq(7), young = Seq(7);
  old_one->max_cache_tokens = young->max_cache_tokens = 10;
  ASSERT_TRUE(s.Add(old_one.get()).ok());
  ASSERT_TRUE(s.Add(young.get()).ok());
  int steps = 0;
  for (SequenceState* seq : {old_one.get(), young.get()}) {
    while (seq->tokens.size() < 11u) {
      SchedulerOutput o = Step(s);
      ASSERT_TRUE(o.preempted.empty());
      EXPECT_FALSE(old_one->running && young->running);
      ASSERT_LT(++steps, 20);
    }
    s.Remove(seq);
  }
  EXPECT_EQ(young->preemptions, 0);
  EXPECT_EQ(kv.pool().num_used(), 0);
}

TEST(SchedulerReservationTest, RandomWorkloadWithReservationsNeverPreempts) {
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
      seqs.back()->max_cache_tokens = prompt + max_new - 1;
      target.push_back(max_new);
    }
    int finished = 0;
    const int preemptions = RunWorkload(s, kv, seqs, target, rng, &finished);
    EXPECT_EQ(preemptions, 0) << "seed " << seed;
    EXPECT_EQ(finished, 16) << "seed " << seed;
    EXPECT_EQ(kv.pool().num_used(), 0) << "seed " << seed << ": " << kv.pool().DebugString();
    EXPECT_EQ(s.reserved_blocks(), 0);
  }
}

TEST(SchedulerReservationTest, SequenceLargerThanThePoolIsRefusedNotQueued) {
  KvCacheManager kv(4, 4, true);  // 16 tokens
  Scheduler s(&kv, {8, 64});
  auto grows = Seq(5), long_prompt = Seq(17), fits = Seq(5);
  grows->max_cache_tokens = 5 + 16 - 1;  // 20 cache tokens: 5 blocks
  fits->max_cache_tokens = 16;
  const absl::Status refused = s.Add(grows.get());
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("needs 5 KV blocks"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("the pool has 4"), std::string::npos) << refused;
  EXPECT_EQ(s.Add(long_prompt.get()).code(), absl::StatusCode::kResourceExhausted)
      << "a prompt of 17 tokens alone needs 5 blocks";
  EXPECT_EQ(s.num_waiting(), 0);
  ASSERT_TRUE(s.Add(fits.get()).ok());
  for (int i = 0; i < 12; ++i) {
    SchedulerOutput o = Step(s);
    EXPECT_TRUE(o.preempted.empty());
  }
  EXPECT_EQ(fits->num_computed, 16);
  s.Remove(fits.get());
  EXPECT_EQ(kv.pool().num_used(), 0);
}

}  // namespace
}  // namespace vlm::language
