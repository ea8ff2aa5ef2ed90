// The serving engine end to end in-process: batch invariance (greedy tokens
// and logprobs, seeded sampling) with sequences joining and leaving mid-way,
// prefix-cache hits equal to cold runs (text history, one image, two images,
// a hit ending mid-image, an image at another position, other features under
// the same tokens), preemption under a small KV cache, admission reservations
// (no preemption), blocks touched only as used, admission limits and
// cancellation. Each runs on a fake runner (scheduling and KV bookkeeping;
// see fake_model_runner.h) and, where the decoder's batched forward exists,
// on the real tiny checkpoint in float32.
#include "services/language/engine/engine.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"
#include "services/language/grammar/grammar_cache.h"
#include "services/language/grammar/tokenizer_vocabulary.h"
#include "services/language/model/decoder.h"
#include "services/language/model/projector.h"
#include "tests/unit/decoder_test_util.h"
#include "tests/unit/fake_model_runner.h"

namespace vlm::language {
namespace {

std::string TinyCheckpoint() {
  const char* dir = std::getenv("VLM_BINARY_DIR");
  return std::string(dir ? dir : ".") + "/tiny_checkpoint";
}

struct Outcome {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  std::string text;
  GenerationResult result;
  absl::Status status;
  bool done = false;
};

Outcome Collect(RequestStream& stream, std::atomic<int>* progress = nullptr,
                int cancel_after = -1) {
  Outcome o;
  EngineEvent e;
  while (true) {
    if (!stream.Next(&e, absl::Seconds(120))) {
      o.status = absl::DeadlineExceededError("no event for 120 s");
      return o;
    }
    if (e.kind == EngineEvent::Kind::kChunk) {
      o.ids.insert(o.ids.end(), e.chunk.token_ids.begin(), e.chunk.token_ids.end());
      for (const auto& lp : e.chunk.logprobs) o.logprobs.push_back(lp.chosen.logprob);
      o.text += e.chunk.text;
      if (progress) progress->store(static_cast<int>(o.ids.size()));
      if (cancel_after >= 0 && static_cast<int>(o.ids.size()) >= cancel_after) stream.Cancel();
      continue;
    }
    if (e.kind == EngineEvent::Kind::kError) {
      o.status = e.error;
    } else {
      o.result = e.result;
      o.text += e.result.tail_text;
      o.done = true;
    }
    return o;
  }
}

// A model + engine for one scenario.
struct Harness {
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<Engine> engine;
  testing::FakeModelRunner* fake = nullptr;
  Outcome Run(EngineRequest r) {
    absl::StatusOr<std::shared_ptr<RequestStream>> s = engine->Submit(std::move(r));
    if (!s.ok()) {
      Outcome o;
      o.status = s.status();
      return o;
    }
    return Collect(**s);
  }
};

class EngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto config = LoadModelConfig(TinyCheckpoint());
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = new ModelConfig(*config);
    auto tokenizer = Tokenizer::Load(TinyCheckpoint());
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = tokenizer->release();
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    delete config_;
  }

  static EngineOptions Options(int64_t num_blocks, int64_t block_size = 16, bool prefix = true) {
    EngineOptions o;
    o.num_blocks = num_blocks;
    o.block_size = block_size;
    o.prefix_cache = prefix;
    o.max_sequences = 8;
    o.max_batch_tokens = 64;
    o.kv_budget_bytes = static_cast<uint64_t>(num_blocks) * block_size * 1024;
    return o;
  }
  static Harness Fake(EngineOptions o, int delay_ms = 0) {
    Harness h;
    auto fake = std::make_unique<testing::FakeModelRunner>(
        o.num_blocks, o.block_size, config_->vision.spatial_merge_size, 1000, delay_ms);
    h.fake = fake.get();
    h.runner = std::move(fake);
    h.engine = std::make_unique<Engine>(h.runner.get(), tokenizer_, *config_, o);
    return h;
  }

  // Prompt pieces.
  static std::vector<int32_t> Text(uint32_t seed, int n) {
    std::mt19937 rng(seed);
    std::vector<int32_t> ids(n);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 900 + 50);
    return ids;
  }
  static ImageFeatures Image(uint32_t seed, int64_t h, int64_t w) {
    ImageFeatures f;
    f.grid = {1, h, w};
    at::manual_seed(seed);
    const int64_t rows = h * w;
    f.last_hidden = at::randn({rows, config_->vision.hidden_size}, at::kFloat);
    for (size_t l = 0; l < config_->vision.deepstack_visual_indexes.size(); ++l) {
      f.deepstack.push_back(at::randn({rows, config_->vision.hidden_size}, at::kFloat));
    }
    return f;
  }
  // Appends vision_start, the image's pads and vision_end to `prompt`.
  static void AddImage(EngineRequest* r, const ImageFeatures& image) {
    auto& ids = r->generation.prompt_ids;
    const int64_t m = config_->vision.spatial_merge_size;
    ids.push_back(static_cast<int32_t>(config_->vision_start_token_id));
    for (int64_t i = 0; i < image.grid[1] * image.grid[2] / (m * m); ++i) {
      ids.push_back(static_cast<int32_t>(config_->image_token_id));
    }
    ids.push_back(static_cast<int32_t>(config_->vision_end_token_id));
    r->generation.images.push_back(image);
    r->image_keys.push_back(ImageKey(image));
  }
  static void AddText(EngineRequest* r, const std::vector<int32_t>& ids) {
    r->generation.prompt_ids.insert(r->generation.prompt_ids.end(), ids.begin(), ids.end());
  }
  static EngineRequest Request(int max_tokens, float temperature = 0.0f, uint64_t seed = 0) {
    EngineRequest r;
    r.generation.max_tokens = max_tokens;
    r.generation.ignore_eos = true;
    r.generation.logprobs = true;
    r.generation.sampling.temperature = temperature;
    if (temperature > 0) r.generation.sampling.seed = seed;
    return r;
  }

  static void ExpectSame(const Outcome& got, const Outcome& want, const std::string& what) {
    ASSERT_TRUE(got.status.ok()) << what << ": " << got.status;
    ASSERT_TRUE(want.status.ok()) << what << ": " << want.status;
    EXPECT_EQ(got.ids, want.ids) << what;
    EXPECT_EQ(got.logprobs, want.logprobs) << what;
    EXPECT_EQ(got.text, want.text) << what;
  }

  // Runs every request alone (a fresh engine each), then all of them in one
  // engine, request i joining once request 0 has produced 2*i tokens; the
  // outcomes must be identical.
  void CheckBatchInvariance(const std::function<Harness()>& make,
                            const std::vector<EngineRequest>& requests, int min_batch) {
    std::vector<Outcome> alone;
    for (const EngineRequest& r : requests) {
      Harness h = make();
      alone.push_back(h.Run(r));
    }
    Harness h = make();
    std::vector<Outcome> batched(requests.size());
    std::atomic<int> progress{0};
    std::vector<std::thread> readers;
    for (size_t i = 0; i < requests.size(); ++i) {
      const absl::Time until = absl::Now() + absl::Seconds(60);
      while (progress.load() < static_cast<int>(2 * i) && absl::Now() < until &&
             !(i > 0 && batched[0].done)) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      auto stream = h.engine->Submit(requests[i]);
      ASSERT_TRUE(stream.ok()) << stream.status();
      readers.emplace_back([&, i, s = *stream] {
        batched[i] = Collect(*s, i == 0 ? &progress : nullptr);
      });
    }
    for (auto& t : readers) t.join();
    for (size_t i = 0; i < requests.size(); ++i) {
      ExpectSame(batched[i], alone[i], "request " + std::to_string(i));
    }
    if (h.fake != nullptr) {
      EXPECT_GE(h.fake->max_chunks(), min_batch);
    }
    EXPECT_GE(h.engine->Stats().max_batch_sequences, min_batch) << "the requests shared passes";
    EXPECT_EQ(h.engine->Stats().blocks_used, 0);
  }

  // Cold: `request` on a fresh engine. Hit: `warm` first, then `request`.
  Outcome CheckPrefixHit(const std::function<Harness()>& make, const EngineRequest& warm,
                         const EngineRequest& request, int64_t min_cached, int64_t max_cached,
                         const std::string& what) {
    Harness cold_h = make();
    Outcome cold = cold_h.Run(request);
    EXPECT_EQ(cold.result.cached_prompt_tokens, 0) << what;
    Harness h = make();
    Outcome w = h.Run(warm);
    EXPECT_TRUE(w.status.ok()) << w.status;
    Outcome hit = h.Run(request);
    ExpectSame(hit, cold, what);
    EXPECT_GE(hit.result.cached_prompt_tokens, min_cached) << what;
    EXPECT_LE(hit.result.cached_prompt_tokens, max_cached) << what;
    return hit;
  }

  static ModelConfig* config_;
  static Tokenizer* tokenizer_;
};
ModelConfig* EngineTest::config_ = nullptr;
Tokenizer* EngineTest::tokenizer_ = nullptr;

std::vector<EngineRequest> MixedRequests(float temperature) {
  std::vector<EngineRequest> out;
  const int prompts[] = {5, 70, 17, 33, 2, 48, 90, 11};
  const int lengths[] = {40, 9, 23, 4, 31, 15, 6, 27};
  for (int i = 0; i < 8; ++i) {
    EngineRequest r;
    r.generation.max_tokens = lengths[i];
    r.generation.ignore_eos = true;
    r.generation.logprobs = true;
    r.generation.top_logprobs = 2;
    r.generation.sampling.temperature = temperature;
    r.generation.sampling.top_k = temperature > 0 ? 50 : 0;
    r.generation.sampling.seed = 1000 + i;
    std::mt19937 rng(i);
    for (int k = 0; k < prompts[i]; ++k) {
      r.generation.prompt_ids.push_back(static_cast<int32_t>(rng() % 900 + 50));
    }
    out.push_back(std::move(r));
  }
  return out;
}

// ---------------------------------------------------------------------------
// Fake runner: scheduling and KV bookkeeping
// ---------------------------------------------------------------------------

TEST_F(EngineTest, GreedyTokensAndLogprobsMatchAloneWhenBatchedWithOthersJoiningAndLeaving) {
  CheckBatchInvariance([] { return Fake(Options(256), /*delay_ms=*/2); }, MixedRequests(0.0f),
                       /*min_batch=*/4);
}

TEST_F(EngineTest, SeededSamplingGivesTheSameTextWhateverTheBatch) {
  CheckBatchInvariance([] { return Fake(Options(256), 2); }, MixedRequests(0.9f), 4);
}

TEST_F(EngineTest, TextHistoryWithThePreviousAnswerHitsTheCacheAndMatchesAColdRun) {
  EngineRequest warm = Request(20);
  AddText(&warm, Text(1, 40));
  Harness probe = Fake(Options(64));
  Outcome first = probe.Run(warm);
  ASSERT_TRUE(first.status.ok());
  // Turn 2: turn 1's prompt, its answer, a new question.
  EngineRequest next = Request(12);
  AddText(&next, warm.generation.prompt_ids);
  AddText(&next, first.ids);
  AddText(&next, Text(2, 9));
  // 40 + 20 tokens were computed (the last sampled one is not): 3 full blocks.
  Harness h = Fake(Options(64));
  ASSERT_TRUE(h.Run(warm).status.ok());
  const int64_t rows_before = h.fake->prefill_rows();
  Outcome hit = h.Run(next);
  Harness cold_h = Fake(Options(64));
  Outcome cold = cold_h.Run(next);
  ExpectSame(hit, cold, "turn 2");
  EXPECT_EQ(hit.result.cached_prompt_tokens, 48);
  EXPECT_EQ(h.fake->prefill_rows() - rows_before,
            static_cast<int64_t>(next.generation.prompt_ids.size()) - 48);
}

TEST_F(EngineTest, ImagesInsideTheReusedPrefixAreNotProjectedAgain) {
  const ImageFeatures a = Image(1, 8, 8), b = Image(2, 4, 8);  // 16 and 8 tokens
  // One image.
  EngineRequest warm = Request(4);
  AddText(&warm, Text(3, 5));
  AddImage(&warm, a);
  AddText(&warm, Text(4, 20));
  EngineRequest next = Request(6);
  next.generation.prompt_ids = warm.generation.prompt_ids;
  next.generation.images = warm.generation.images;
  next.image_keys = warm.image_keys;
  AddText(&next, Text(5, 7));
  {
    Harness h = Fake(Options(64));
    ASSERT_TRUE(h.Run(warm).status.ok());
    EXPECT_EQ(h.fake->projections(), 1);
    Outcome hit = h.Run(next);
    EXPECT_EQ(h.fake->projections(), 1) << "the image lay inside the reused prefix";
    EXPECT_EQ(hit.result.cached_prompt_tokens, 32);
  }
  CheckPrefixHit([] { return Fake(Options(64)); }, warm, next, 32, 32, "one image");
  // Two images.
  EngineRequest warm2 = Request(3);
  AddText(&warm2, Text(6, 3));
  AddImage(&warm2, a);
  AddText(&warm2, Text(7, 4));
  AddImage(&warm2, b);
  AddText(&warm2, Text(8, 15));
  EngineRequest next2 = warm2;
  next2.generation.max_tokens = 8;
  AddText(&next2, Text(9, 5));
  CheckPrefixHit([] { return Fake(Options(64)); }, warm2, next2, 48, 48, "two images");
}

TEST_F(EngineTest, HitEndingMidImageProjectsTheImageAndSlicesItsRemainingRows) {
  const ImageFeatures a = Image(11, 8, 8);  // 16 pads at [4, 20)
  EngineRequest warm = Request(1);
  AddText(&warm, Text(12, 3));
  AddImage(&warm, a);  // prompt: 3 + 1 + 16 + 1 = 21 tokens: full blocks of 8 end at 16
  EngineRequest next = warm;
  next.generation.max_tokens = 10;
  AddText(&next, Text(13, 6));
  auto make = [] { return Fake(Options(64, /*block_size=*/8)); };
  Harness h = make();
  ASSERT_TRUE(h.Run(warm).status.ok());
  Outcome hit = h.Run(next);
  EXPECT_EQ(hit.result.cached_prompt_tokens, 16);
  EXPECT_EQ(h.fake->projections(), 2) << "the suffix holds image rows 12..15";
  CheckPrefixHit(make, warm, next, 16, 16, "hit ending mid-image");
}

TEST_F(EngineTest, ImageAtAnotherPositionOrWithOtherFeaturesDoesNotReuseItsBlocks) {
  const ImageFeatures a = Image(21, 8, 8), other = Image(22, 8, 8);
  EngineRequest warm = Request(2);
  AddText(&warm, Text(23, 5));
  AddImage(&warm, a);
  AddText(&warm, Text(24, 20));
  // The same image one token later: only the blocks before it can match.
  EngineRequest moved = Request(6);
  AddText(&moved, Text(23, 5));
  AddText(&moved, {77});
  AddImage(&moved, a);
  AddText(&moved, Text(24, 20));
  CheckPrefixHit([] { return Fake(Options(64, 4)); }, warm, moved, 4, 4, "image moved");
  // The same tokens with other features under them (as a caller reusing a
  // known image's content hash would send): no block past the image start.
  EngineRequest poisoned = Request(6);
  AddText(&poisoned, Text(23, 5));
  AddImage(&poisoned, other);
  AddText(&poisoned, Text(24, 20));
  CheckPrefixHit([] { return Fake(Options(64, 4)); }, warm, poisoned, 4, 4, "other features");
}

TEST_F(EngineTest, SmallCachePreemptsTheNewestAndEveryStreamStaysContinuous) {
  std::vector<EngineRequest> requests;
  for (int i = 0; i < 6; ++i) {
    EngineRequest r = Request(30, i % 2 ? 0.8f : 0.0f, 50 + i);
    AddText(&r, Text(30 + i, 20 + i));
    requests.push_back(std::move(r));
  }
  auto make = [] {
    EngineOptions o = Options(/*num_blocks=*/24, /*block_size=*/4, /*prefix=*/false);
    o.reserve_max_tokens = false;  // admit on the prefill alone, so growth must preempt
    return Fake(o, 1);
  };
  std::vector<Outcome> alone;
  for (const EngineRequest& r : requests) alone.push_back(make().Run(r));
  Harness h = make();
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const EngineRequest& r : requests) {
    auto s = h.engine->Submit(r);
    ASSERT_TRUE(s.ok()) << s.status();
    streams.push_back(*s);
  }
  for (size_t i = 0; i < streams.size(); ++i) {
    ExpectSame(Collect(*streams[i]), alone[i], "request " + std::to_string(i));
  }
  const EngineStats stats = h.engine->Stats();
  EXPECT_GT(stats.preemptions, 0);
  EXPECT_EQ(stats.blocks_used, 0);
  EXPECT_EQ(stats.blocks_free, 24);
}

// Structured output under preemption: each sequence's grammar matcher lives
// in its generation state, which a preemption keeps while the KV is
// recomputed; so constrained streams are the same as alone and complete.
TEST_F(EngineTest, ConstrainedSequencesSurvivePreemptionAndMatchTheirAloneRuns) {
  auto vocab = grammar::VocabularyFromTokenizer(*tokenizer_);
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  grammar::GrammarCache cache(*vocab, 4);
  auto compiled = cache.Get(grammar::GrammarKind::kJsonSchema, R"({"type": "object",
      "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
      "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3}},
      "required": ["id", "tags"]})");
  ASSERT_TRUE(compiled.ok()) << compiled.status();
  std::vector<EngineRequest> requests;
  for (int i = 0; i < 6; ++i) {
    EngineRequest r = Request(40, i % 2 ? 0.8f : 0.0f, 70 + i);
    r.generation.ignore_eos = false;
    r.generation.grammar = *compiled;
    AddText(&r, Text(30 + i, 20 + i));
    requests.push_back(std::move(r));
  }
  auto make = [] {
    EngineOptions o = Options(/*num_blocks=*/24, /*block_size=*/4, /*prefix=*/false);
    o.reserve_max_tokens = false;  // admit on the prefill alone, so growth must preempt
    o.eos_ids = {151645, 151643};
    return Fake(o, 1);
  };
  std::vector<Outcome> alone;
  for (const EngineRequest& r : requests) alone.push_back(make().Run(r));
  Harness h = make();
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const EngineRequest& r : requests) {
    auto s = h.engine->Submit(r);
    ASSERT_TRUE(s.ok()) << s.status();
    streams.push_back(*s);
  }
  for (size_t i = 0; i < streams.size(); ++i) {
    const Outcome got = Collect(*streams[i]);
    ExpectSame(got, alone[i], "request " + std::to_string(i));
    EXPECT_EQ(got.result.finish_detail, "grammar complete") << got.text;
    const nlohmann::json v = nlohmann::json::parse(got.text, nullptr, false);
    EXPECT_TRUE(v.is_object() && v["id"].is_number_integer() && v["tags"].is_array()) << got.text;
  }
  EXPECT_GT(h.engine->Stats().preemptions, 0);
}

TEST_F(EngineTest, ReservationsRunWhatFitsToMaxTokensAndNeverPreempt) {
  // prompt 20..25 + max_tokens 30 - 1: 13 or 14 blocks of 4 each. In 28
  // blocks any two fit, never three.
  std::vector<EngineRequest> requests;
  for (int i = 0; i < 6; ++i) {
    EngineRequest r = Request(30, i % 2 ? 0.8f : 0.0f, 50 + i);
    AddText(&r, Text(30 + i, 20 + i));
    requests.push_back(std::move(r));
  }
  auto make = [](bool reserve) {
    EngineOptions o = Options(/*num_blocks=*/28, /*block_size=*/4, /*prefix=*/false);
    o.reserve_max_tokens = reserve;
    return Fake(o, 1);
  };
  std::vector<Outcome> alone;
  for (const EngineRequest& r : requests) alone.push_back(make(true).Run(r));
  for (bool reserve : {true, false}) {
    Harness h = make(reserve);
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (const EngineRequest& r : requests) {
      auto s = h.engine->Submit(r);
      ASSERT_TRUE(s.ok()) << s.status();
      streams.push_back(*s);
    }
    for (size_t i = 0; i < streams.size(); ++i) {
      ExpectSame(Collect(*streams[i]), alone[i],
                 absl::StrCat(reserve ? "reserved" : "unreserved", " request ", i));
    }
    const EngineStats stats = h.engine->Stats();
    if (reserve) {
      EXPECT_EQ(stats.preemptions, 0);
      EXPECT_EQ(stats.max_batch_sequences, 2) << "two reservations fit, three do not";
    } else {
      EXPECT_GT(stats.preemptions, 0) << "the same workload admitted on its prompts alone";
    }
    EXPECT_EQ(stats.blocks_reserved, 0);
    EXPECT_EQ(stats.blocks_used, 0);
    EXPECT_EQ(stats.blocks_free, 28);
  }
}

TEST_F(EngineTest, OnlyBlocksInUseAreTouchedAndReleasedOnesAreReusedFirst) {
  Harness h = Fake(Options(/*num_blocks=*/256, /*block_size=*/4, /*prefix=*/false));
  EXPECT_EQ(h.engine->Stats().blocks_touched, 0);
  for (int i = 0; i < 3; ++i) {
    EngineRequest r = Request(6);
    AddText(&r, Text(60 + i, 10));  // 10 + 6 - 1 = 15 cache tokens: 4 blocks
    Outcome o = h.Run(r);
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(h.engine->Stats().blocks_touched, 4) << "run " << i;
  }
}

TEST_F(EngineTest, RequestThatCannotFitTheCacheAloneIsRefusedNamingKvCacheMb) {
  Harness h = Fake(Options(4, 4));  // 16 tokens
  EngineRequest big = Request(10);
  AddText(&big, Text(40, 10));  // 10 + 10 - 1 = 19 tokens
  Outcome o = h.Run(big);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(o.status.message(), "--kv_cache_mb")) << o.status;
  EXPECT_TRUE(absl::StrContains(o.status.message(), "5 KV blocks")) << o.status;
  // Nothing else is affected: one that fits (10 + 7 - 1 = 16) runs.
  EngineRequest fits = Request(7);
  AddText(&fits, Text(40, 10));
  Outcome ok = h.Run(fits);
  EXPECT_TRUE(ok.status.ok()) << ok.status;
  EXPECT_EQ(ok.ids.size(), 7u);
}

TEST_F(EngineTest, RejectsAnEmptyPromptAndZeroMaxTokens) {
  Harness h = Fake(Options(16));
  Outcome empty = h.Run(Request(3));
  EXPECT_EQ(empty.status.code(), absl::StatusCode::kInvalidArgument) << empty.status;
  EXPECT_TRUE(absl::StrContains(empty.status.message(), "prompt is empty")) << empty.status;
  EngineRequest zero = Request(0);
  AddText(&zero, Text(41, 5));
  Outcome none = h.Run(zero);
  EXPECT_EQ(none.status.code(), absl::StatusCode::kInvalidArgument) << none.status;
  EXPECT_TRUE(absl::StrContains(none.status.message(), "max_tokens")) << none.status;
}

TEST_F(EngineTest, FullBatchAndQueueRefuseAndCancelFreesTheSlotAndBlocks) {
  EngineOptions o = Options(64);
  o.max_sequences = 1;
  o.max_queue = 1;
  Harness h = Fake(o, 5);
  EngineRequest long_one = Request(400);
  AddText(&long_one, Text(50, 8));
  auto running = h.engine->Submit(long_one);
  ASSERT_TRUE(running.ok());
  EngineRequest small = Request(2);
  AddText(&small, Text(51, 4));
  auto queued = h.engine->Submit(small);
  ASSERT_TRUE(queued.ok());
  auto refused = h.engine->Submit(small);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "--max_queue"));

  Outcome cancelled = Collect(**running, nullptr, /*cancel_after=*/3);
  EXPECT_TRUE(cancelled.done);
  EXPECT_EQ(cancelled.result.finish, FinishReason::kCancelled);
  EXPECT_LT(cancelled.ids.size(), 400u);
  Outcome next = Collect(**queued);
  EXPECT_TRUE(next.done);
  EXPECT_EQ(next.ids.size(), 2u);
  EXPECT_EQ(h.engine->Stats().blocks_used, 0);
}

// ---------------------------------------------------------------------------
// The real decoder (tiny checkpoint, float32)
// ---------------------------------------------------------------------------

class EngineDecoderTest : public EngineTest {
 protected:
  static void SetUpTestSuite() {
    EngineTest::SetUpTestSuite();
    auto checkpoint = SafetensorsCheckpoint::Open(TinyCheckpoint());
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    checkpoint_ = new std::shared_ptr<const SafetensorsCheckpoint>(std::move(*checkpoint));
    DecoderOptions d;
    d.compute_dtype = ComputeDType::kFloat32;
    auto decoder = Decoder::Load(*checkpoint_, *config_, d);
    ASSERT_TRUE(decoder.ok()) << decoder.status();
    decoder_ = decoder->release();
    ProjectorOptions p;
    p.compute_dtype = ComputeDType::kFloat32;
    auto projector = Projector::Load(**checkpoint_, *config_, p);
    ASSERT_TRUE(projector.ok()) << projector.status();
    projector_ = projector->release();
  }
  static void TearDownTestSuite() {
    delete projector_;
    delete decoder_;
    delete checkpoint_;
    EngineTest::TearDownTestSuite();
  }
  void SetUp() override {
    auto probe = DecoderRunner::Create(projector_, decoder_, 1, 16);
    ASSERT_TRUE(probe.ok()) << probe.status();
  }
  static Harness Real(EngineOptions o) {
    Harness h;
    auto runner = DecoderRunner::Create(projector_, decoder_, o.num_blocks, o.block_size);
    EXPECT_TRUE(runner.ok()) << runner.status();
    h.runner = std::move(*runner);
    h.engine = std::make_unique<Engine>(h.runner.get(), tokenizer_, *config_, o);
    return h;
  }
  static std::shared_ptr<const SafetensorsCheckpoint>* checkpoint_;
  static Decoder* decoder_;
  static Projector* projector_;
};
std::shared_ptr<const SafetensorsCheckpoint>* EngineDecoderTest::checkpoint_ = nullptr;
Decoder* EngineDecoderTest::decoder_ = nullptr;
Projector* EngineDecoderTest::projector_ = nullptr;

TEST_F(EngineDecoderTest, GreedyTokensAndLogprobsAreIdenticalAloneAndBatched) {
  CheckBatchInvariance([] { return Real(Options(256)); }, MixedRequests(0.0f), 3);
}

TEST_F(EngineDecoderTest, SeededSamplingGivesTheSameTextAloneAndBatched) {
  CheckBatchInvariance([] { return Real(Options(256)); }, MixedRequests(0.9f), 3);
}

TEST_F(EngineDecoderTest, PrefixHitsGiveTheTokensAndLogprobsOfColdRuns) {
  auto make = [] { return Real(Options(128, 8)); };
  const ImageFeatures a = Image(61, 8, 8), b = Image(62, 4, 8);
  // Text-only history.
  EngineRequest warm = Request(3);
  AddText(&warm, Text(63, 37));
  EngineRequest next = warm;
  next.generation.max_tokens = 8;
  AddText(&next, Text(64, 11));
  CheckPrefixHit(make, warm, next, 32, 32, "text history");
  // One image, inside the prefix.
  EngineRequest w1 = Request(2);
  AddText(&w1, Text(65, 5));
  AddImage(&w1, a);
  AddText(&w1, Text(66, 12));
  EngineRequest n1 = w1;
  n1.generation.max_tokens = 8;
  AddText(&n1, Text(67, 6));
  CheckPrefixHit(make, w1, n1, 32, 32, "one image");
  // Two images.
  EngineRequest w2 = Request(2);
  AddText(&w2, Text(68, 3));
  AddImage(&w2, a);
  AddText(&w2, Text(69, 4));
  AddImage(&w2, b);
  AddText(&w2, Text(70, 9));
  EngineRequest n2 = w2;
  n2.generation.max_tokens = 8;
  AddText(&n2, Text(71, 5));
  CheckPrefixHit(make, w2, n2, 40, 40, "two images");
  // The hit ends inside the image (16 pads at [4, 20); blocks of 8).
  EngineRequest w3 = Request(1);
  AddText(&w3, Text(72, 3));
  AddImage(&w3, a);
  EngineRequest n3 = w3;
  n3.generation.max_tokens = 8;
  AddText(&n3, Text(73, 6));
  CheckPrefixHit(make, w3, n3, 16, 16, "hit ending mid-image");
  // The image one token later than in the cached prompt.
  EngineRequest n4 = Request(8);
  AddText(&n4, Text(65, 5));
  AddText(&n4, {77});
  AddImage(&n4, a);
  AddText(&n4, Text(66, 12));
  CheckPrefixHit(make, w1, n4, 0, 0, "image in another position");
}

TEST_F(EngineDecoderTest, BatchedEngineMatchesThePlainOneRequestLoop) {
  // The plain path: each request alone, its prompt in one prefill pass and
  // one pass per generated token (decoder_test_util.h), sampled by its own
  // GenerationState: no scheduler, no prefix cache, no batch. Logprobs agree
  // to a tolerance; greedy tokens exactly.
  Harness h = Real(Options(256));
  std::vector<EngineRequest> requests = MixedRequests(0.0f);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const EngineRequest& r : requests) {
    auto s = h.engine->Submit(r);
    ASSERT_TRUE(s.ok()) << s.status();
    streams.push_back(*s);
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    Outcome batched = Collect(*streams[i]);
    ASSERT_TRUE(batched.status.ok()) << batched.status;
    std::vector<int32_t> ids;
    std::vector<float> logprobs;
    const GenerationRequest& g = requests[i].generation;
    ASSERT_TRUE(g.images.empty());  // text prompts: positions 0, 1, 2, ...
    decoder_test::ForwardRun plain(*decoder_,
                                   static_cast<int64_t>(g.prompt_ids.size()) + g.max_tokens);
    decoder_test::PromptInput prompt;
    prompt.token_ids = g.prompt_ids;
    auto logits = plain.Prefill(prompt);
    const GenerationStateConfig eos;  // Options() sets no EOS ids either
    GenerationState state(g, tokenizer_, eos);
    for (;;) {
      ASSERT_TRUE(logits.ok()) << logits.status();
      const at::Tensor row = logits->contiguous();
      auto step = state.Next(absl::Span<const float>(row.data_ptr<float>(), row.numel()));
      ASSERT_TRUE(step.ok()) << step.status();
      ids.insert(ids.end(), step->chunk.token_ids.begin(), step->chunk.token_ids.end());
      for (const auto& lp : step->chunk.logprobs) logprobs.push_back(lp.chosen.logprob);
      if (step->finished) break;
      logits = plain.DecodeStep(state.last_token());
    }
    EXPECT_EQ(batched.ids, ids) << "request " << i;
    ASSERT_EQ(batched.logprobs.size(), logprobs.size());
    for (size_t k = 0; k < logprobs.size(); ++k) {
      EXPECT_NEAR(batched.logprobs[k], logprobs[k], 1e-4) << "request " << i << " token " << k;
    }
  }
  EXPECT_GE(h.engine->Stats().max_batch_sequences, 4);
}

}  // namespace
}  // namespace vlm::language
