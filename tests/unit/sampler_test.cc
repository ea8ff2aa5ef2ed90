// Sampler transforms against values worked out by hand from their
// definitions (qwen3-vl-model.md 7.4 and HF's logits warpers), determinism by
// seed, and the empirical distribution of the multinomial draw.
#include "services/language/sampling/sampler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <algorithm>
#include <map>
#include <random>
#include <vector>

namespace vlm::language {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

using ::testing::ElementsAre;
using ::testing::FloatNear;
using ::testing::HasSubstr;

std::vector<float> LogOf(const std::vector<double>& probs) {
  std::vector<float> out;
  for (double p : probs) out.push_back(static_cast<float>(std::log(p)));
  return out;
}

std::vector<bool> Kept(const std::vector<float>& logits) {
  std::vector<bool> kept;
  for (float v : logits) kept.push_back(v != -kInf);
  return kept;
}

TEST(SamplerTransformTest, MaskVocabularyPaddingRemovesIdsAtAndAboveTheVocabulary) {
  std::vector<float> logits = {1, 2, 3, 4};
  MaskVocabularyPadding(absl::MakeSpan(logits), 2);
  EXPECT_THAT(logits, ElementsAre(1, 2, -kInf, -kInf));
}

TEST(SamplerTransformTest, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogits) {
  std::vector<float> logits = {2.0f, -2.0f, 0.5f, 3.0f};
  const std::vector<int32_t> seen = {0, 1};
  ApplyRepetitionPenalty(absl::MakeSpan(logits), seen, 2.0f);
  EXPECT_THAT(logits, ElementsAre(1.0f, -4.0f, 0.5f, 3.0f));
  // A penalty below 1 rewards repetition the same way round.
  std::vector<float> reward = {2.0f, -2.0f};
  ApplyRepetitionPenalty(absl::MakeSpan(reward), seen, 0.5f);
  EXPECT_THAT(reward, ElementsAre(4.0f, -1.0f));
}

TEST(SamplerTransformTest, PresenceAndFrequencyPenaltiesSubtractPerCount) {
  std::vector<float> logits = {1.0f, 1.0f, 1.0f};
  const absl::flat_hash_map<int32_t, int32_t> counts = {{0, 3}, {2, 1}};
  ApplyPresenceFrequencyPenalties(absl::MakeSpan(logits), counts, 0.5f, 0.25f);
  // 1 - 0.5 - 3*0.25 = -0.25; untouched; 1 - 0.5 - 0.25 = 0.25.
  EXPECT_THAT(logits, ElementsAre(FloatNear(-0.25f, 1e-6), 1.0f, FloatNear(0.25f, 1e-6)));
}

TEST(SamplerTransformTest, TemperatureDividesLogits) {
  std::vector<float> logits = {1.0f, 2.0f, -3.0f};
  ApplyTemperature(absl::MakeSpan(logits), 0.5f);
  EXPECT_THAT(logits, ElementsAre(2.0f, 4.0f, -6.0f));
}

TEST(SamplerTransformTest, TopKKeepsTheKLargestAndTiesAtTheKth) {
  std::vector<float> a = {1, 5, 3, 4, 2};
  ApplyTopK(absl::MakeSpan(a), 2);
  EXPECT_THAT(a, ElementsAre(-kInf, 5, -kInf, 4, -kInf));
  std::vector<float> ties = {1, 5, 3, 3, 2};
  ApplyTopK(absl::MakeSpan(ties), 2);  // HF removes only logits < the 2nd value (3)
  EXPECT_THAT(ties, ElementsAre(-kInf, 5, 3, 3, -kInf));
  std::vector<float> off = {1, 2};
  ApplyTopK(absl::MakeSpan(off), 0);
  EXPECT_THAT(off, ElementsAre(1, 2));
  ApplyTopK(absl::MakeSpan(off), 7);
  EXPECT_THAT(off, ElementsAre(1, 2));
}

TEST(SamplerTransformTest, TopPDropsTheAscendingTailUpToOneMinusTopP) {
  // Probabilities 0.15, 0.5, 0.05, 0.3 (shuffled). Ascending cumulative:
  // 0.05, 0.2, 0.5, 1.0 for ids 2, 0, 3, 1.
  const std::vector<float> base = LogOf({0.15, 0.5, 0.05, 0.3});
  std::vector<float> a = base;
  ApplyTopP(absl::MakeSpan(a), 0.75f);  // remove cumulative <= 0.25: ids 2 and 0
  EXPECT_THAT(Kept(a), ElementsAre(false, true, false, true));
  std::vector<float> b = base;
  ApplyTopP(absl::MakeSpan(b), 0.85f);  // remove <= 0.15: id 2
  EXPECT_THAT(Kept(b), ElementsAre(true, true, false, true));
  std::vector<float> c = base;
  ApplyTopP(absl::MakeSpan(c), 0.1f);  // everything but the most probable
  EXPECT_THAT(Kept(c), ElementsAre(false, true, false, false));
  std::vector<float> d = base;
  ApplyTopP(absl::MakeSpan(d), 1.0f);
  EXPECT_EQ(d, base);
  // Kept logits are unchanged.
  EXPECT_EQ(a[1], base[1]);
  EXPECT_EQ(a[3], base[3]);
}

TEST(SamplerTransformTest, TopPOverAWideRowSortsBeyondTheFirstBlock) {
  // 1000 equal logits: each has probability 0.001; the mass ahead of id i is
  // i/1000, kept while < 0.5005, so ids 0..500 stay (ties: lower id first).
  std::vector<float> logits(1000, 0.25f);
  logits.push_back(-kInf);
  ApplyTopP(absl::MakeSpan(logits), 0.5005f);
  int kept = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (logits[i] != -kInf) {
      ++kept;
      EXPECT_LE(i, 500u);
    }
  }
  EXPECT_EQ(kept, 501);
}

TEST(SamplerTransformTest, MinPRemovesIdsBelowAFractionOfTheTopProbability) {
  const std::vector<float> base = LogOf({0.5, 0.3, 0.15, 0.05});
  std::vector<float> a = base;
  ApplyMinP(absl::MakeSpan(a), 0.2f);  // threshold 0.1
  EXPECT_THAT(Kept(a), ElementsAre(true, true, true, false));
  std::vector<float> b = base;
  ApplyMinP(absl::MakeSpan(b), 0.5f);  // threshold 0.25
  EXPECT_THAT(Kept(b), ElementsAre(true, true, false, false));
}

TEST(SamplerTransformTest, SoftmaxAndLogSoftmax) {
  const std::vector<float> logits = {0.0f, std::log(3.0f), -kInf};
  std::vector<float> p(3), lp(3);
  Softmax(logits, absl::MakeSpan(p));
  EXPECT_THAT(p, ElementsAre(FloatNear(0.25f, 1e-6), FloatNear(0.75f, 1e-6), 0.0f));
  LogSoftmax(logits, absl::MakeSpan(lp));
  EXPECT_NEAR(lp[0], std::log(0.25), 1e-6);
  EXPECT_NEAR(lp[1], std::log(0.75), 1e-6);
  EXPECT_EQ(lp[2], -kInf);
}

TEST(SamplerTransformTest, ArgMaxPrefersTheLowestIdOnTies) {
  EXPECT_EQ(ArgMax(std::vector<float>{1, 3, 3, 2}), 1);
  EXPECT_EQ(ArgMax(std::vector<float>{-kInf, -kInf}), -1);
}

TEST(SamplerTransformTest, DrawFromDistributionWalksTheCumulativeSum) {
  const std::vector<float> probs = {0.2f, 0.0f, 0.8f};
  EXPECT_EQ(DrawFromDistribution(probs, 0.0), 0);
  EXPECT_EQ(DrawFromDistribution(probs, 0.1), 0);
  EXPECT_EQ(DrawFromDistribution(probs, 0.25), 2);  // never the zero-probability id 1
  EXPECT_EQ(DrawFromDistribution(probs, 0.999999), 2);
}

TEST(SamplingConfigTest, ValidationNamesTheField) {
  auto check = [](SamplingConfig c, const char* field) {
    absl::Status s = ValidateSamplingConfig(c, "params.sampling");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(std::string(s.message()), HasSubstr(std::string("params.sampling.") + field));
  };
  SamplingConfig ok;
  EXPECT_TRUE(ValidateSamplingConfig(ok).ok());
  SamplingConfig c;
  c.temperature = -0.1f;
  check(c, "temperature");
  c = ok;
  c.temperature = std::nanf("");
  check(c, "temperature");
  c = ok;
  c.top_k = -1;
  check(c, "top_k");
  c = ok;
  c.top_p = 0.0f;
  check(c, "top_p");
  c.top_p = 1.01f;
  check(c, "top_p");
  c = ok;
  c.min_p = 1.0f;
  check(c, "min_p");
  c.min_p = -0.5f;
  check(c, "min_p");
  c = ok;
  c.repetition_penalty = 0.0f;
  check(c, "repetition_penalty");
  c = ok;
  c.presence_penalty = 2.5f;
  check(c, "presence_penalty");
  c = ok;
  c.frequency_penalty = -2.5f;
  check(c, "frequency_penalty");
  c = ok;
  c.top_p = 1.0f;
  c.min_p = 0.0f;
  c.temperature = 0.0f;
  EXPECT_TRUE(ValidateSamplingConfig(c).ok());
}

TEST(SamplerTest, GreedyTakesTheArgmaxAfterPenalties) {
  SamplingConfig c;
  c.temperature = 0.0f;
  c.repetition_penalty = 4.0f;
  const std::vector<int32_t> prompt = {1};
  Sampler sampler(c, 4, prompt);
  // id 1 (4.0) is penalised to 1.0 and loses to id 2 (3.0).
  const std::vector<float> logits = {0.0f, 4.0f, 3.0f, 0.0f};
  EXPECT_EQ(sampler.Sample(logits), 2);
  SamplingConfig plain;
  plain.temperature = 0.0f;
  Sampler unpenalised(plain, 4, prompt);
  EXPECT_EQ(unpenalised.Sample(logits), 1);
}

TEST(SamplerTest, PresencePenaltyCountsCompletionTokensOnly) {
  SamplingConfig c;
  c.temperature = 0.0f;
  c.presence_penalty = 2.0f;
  const std::vector<int32_t> prompt = {0};
  Sampler sampler(c, 2, prompt);
  const std::vector<float> logits = {1.0f, 0.0f};
  EXPECT_EQ(sampler.Sample(logits), 0);  // the prompt's 0 is not penalised
  sampler.Accept(0);
  EXPECT_EQ(sampler.Sample(logits), 1);  // 1 - 2 < 0
}

TEST(SamplerTest, NeverProducesVocabularyPadding) {
  SamplingConfig greedy;
  greedy.temperature = 0.0f;
  std::vector<float> logits = {0.0f, 1.0f, 50.0f};
  EXPECT_EQ(Sampler(greedy, 2, {}).Sample(logits), 1);
  SamplingConfig hot;
  hot.temperature = 5.0f;
  hot.seed = 7;
  Sampler sampler(hot, 2, {});
  for (int i = 0; i < 200; ++i) EXPECT_LT(sampler.Sample(logits), 2);
}

TEST(SamplerTest, SameSeedSameTokensDifferentSeedDifferentTokens) {
  std::vector<float> logits(64);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = 0.05f * static_cast<float>(i % 13);
  auto run = [&](uint64_t seed) {
    SamplingConfig c;
    c.temperature = 1.0f;
    c.seed = seed;
    Sampler s(c, 64, {});
    std::vector<int32_t> ids;
    for (int i = 0; i < 50; ++i) {
      ids.push_back(s.Sample(logits));
      s.Accept(ids.back());
    }
    return ids;
  };
  EXPECT_EQ(run(1234), run(1234));
  EXPECT_NE(run(1234), run(1235));
  SamplingConfig unseeded;
  Sampler a(unseeded, 64, {}), b(unseeded, 64, {});
  EXPECT_NE(a.seed(), b.seed());
}

// Chi-square goodness of fit with a fixed seed (deterministic). With 3 and
// 4 degrees of freedom the 0.1% critical values are 16.27 and 18.47.
double ChiSquare(const std::vector<int>& counts, const std::vector<double>& expected_probs,
                 int n) {
  double chi = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double e = expected_probs[i] * n;
    chi += (counts[i] - e) * (counts[i] - e) / e;
  }
  return chi;
}

TEST(SamplerTest, MultinomialFollowsTheSoftmax) {
  const std::vector<double> p = {0.4, 0.3, 0.2, 0.1};
  const std::vector<float> logits = LogOf(p);
  SamplingConfig c;
  c.temperature = 1.0f;
  c.seed = 42;
  Sampler sampler(c, 4, {});
  const int n = 20000;
  std::vector<int> counts(4);
  for (int i = 0; i < n; ++i) ++counts[sampler.Sample(logits)];
  EXPECT_LT(ChiSquare(counts, p, n), 16.27) << counts[0] << " " << counts[1] << " " << counts[2]
                                            << " " << counts[3];
}

TEST(SamplerTest, TemperatureFlattensTheDistribution) {
  // Temperature 2: p_i ∝ sqrt(p_i) = (0.8, 0.4, 0.2)/1.4 for p = (0.64, 0.16, 0.04, +padding).
  const std::vector<float> logits = LogOf({0.64, 0.16, 0.04, 0.16});
  SamplingConfig c;
  c.temperature = 2.0f;
  c.seed = 3;
  Sampler sampler(c, 3, {});  // id 3 is padding
  const int n = 20000;
  std::vector<int> counts(3);
  for (int i = 0; i < n; ++i) ++counts[sampler.Sample(logits)];
  EXPECT_LT(ChiSquare(counts, {0.8 / 1.4, 0.4 / 1.4, 0.2 / 1.4}, n), 13.82);
}

TEST(SamplerTest, TruncationsApplyInOrderBeforeTheDraw) {
  // p = 0.35 0.25 0.2 0.12 0.08. top_k 4 drops id 4 and leaves
  // 0.380 0.272 0.217 0.130 (over 0.92); top_p 0.62 then keeps the ids whose
  // mass ahead is < 0.62: id 0 (0), id 1 (0.380), not id 2 (0.652). Without
  // top_k first, id 2 would have 0.60 ahead and stay: the order matters.
  const std::vector<float> logits = LogOf({0.35, 0.25, 0.2, 0.12, 0.08});
  SamplingConfig c;
  c.top_k = 4;
  c.top_p = 0.62f;
  c.seed = 11;
  Sampler sampler(c, 5, {});
  const int n = 20000;
  std::map<int, int> counts;
  for (int i = 0; i < n; ++i) ++counts[sampler.Sample(logits)];
  ASSERT_EQ(counts.size(), 2u);
  // 0.35 : 0.25 -> 0.5833 / 0.4167; binomial sd ~ 0.0035 -> 5 sd = 0.0175.
  EXPECT_NEAR(counts[0] / static_cast<double>(n), 0.35 / 0.6, 0.0175);
  // min_p last: id 1 has 0.25/0.35 = 0.71 of the top probability.
  c.min_p = 0.75f;
  Sampler strict(c, 5, {});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(strict.Sample(logits), 0);
  c.min_p = 0.7f;
  Sampler loose(c, 5, {});
  std::map<int, int> loose_counts;
  for (int i = 0; i < 200; ++i) ++loose_counts[loose.Sample(logits)];
  EXPECT_EQ(loose_counts.size(), 2u);
}

TEST(SamplerTest, SamplerDrawsExactlyWhatTheFullRowPipelineDraws) {
  // The Sampler runs the truncations on top-k candidates only; replaying the
  // documented pipeline over the whole row with the same uniforms (the seed's
  // mt19937_64, 53 bits) must give the same ids.
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(5000);
  for (float& v : logits) v = normal(gen);
  SamplingConfig c;
  c.temperature = 0.8f;
  c.top_k = 50;
  c.top_p = 0.9f;
  c.min_p = 0.05f;
  c.repetition_penalty = 1.3f;
  c.presence_penalty = 0.5f;
  c.frequency_penalty = 0.25f;
  c.seed = 77;
  std::vector<int32_t> seen = {3, 17, 4000};
  Sampler sampler(c, 4990, seen);
  std::mt19937_64 rng(77);
  absl::flat_hash_map<int32_t, int32_t> counts;
  for (int step = 0; step < 200; ++step) {
    std::vector<float> row = logits;
    absl::Span<float> r(row);
    MaskVocabularyPadding(r, 4990);
    ApplyRepetitionPenalty(r, seen, c.repetition_penalty);
    ApplyPresenceFrequencyPenalties(r, counts, c.presence_penalty, c.frequency_penalty);
    ApplyTemperature(r, c.temperature);
    ApplyTopK(r, c.top_k);
    ApplyTopP(r, c.top_p);
    ApplyMinP(r, c.min_p);
    std::vector<float> probs(row.size());
    Softmax(row, absl::MakeSpan(probs));
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    const int32_t expected = DrawFromDistribution(probs, u);
    const int32_t got = sampler.Sample(logits);
    ASSERT_EQ(got, expected) << "step " << step;
    sampler.Accept(got);
    if (std::find(seen.begin(), seen.end(), got) == seen.end()) seen.push_back(got);
    ++counts[got];
  }
}

TEST(SamplerTest, LogprobsAreTheLogSoftmaxOfThePenalisedLogits) {
  const std::vector<float> logits = {0.0f, std::log(3.0f), 2.0f, 9.0f};
  SamplingConfig c;
  c.temperature = 0.0f;
  c.repetition_penalty = 2.0f;  // id 2 (prompt) goes 2.0 -> 1.0
  const std::vector<int32_t> prompt = {2};
  Sampler sampler(c, 3, prompt);  // id 3 is padding
  TokenLogprobs lp;
  const int32_t id = sampler.Sample(logits, &lp, 2);
  EXPECT_EQ(id, 1);
  const double z = 1.0 + 3.0 + std::exp(1.0);
  EXPECT_EQ(lp.id, 1);
  EXPECT_NEAR(lp.logprob, std::log(3.0 / z), 1e-5);
  ASSERT_EQ(lp.top.size(), 2u);
  EXPECT_EQ(lp.top[0].first, 1);
  EXPECT_EQ(lp.top[1].first, 2);
  EXPECT_NEAR(lp.top[1].second, 1.0 - std::log(z), 1e-5);
  // Temperature does not change them.
  SamplingConfig hot = c;
  hot.temperature = 3.0f;
  hot.seed = 5;
  TokenLogprobs lp_hot;
  Sampler(hot, 3, prompt).Sample(logits, &lp_hot, 0);
  EXPECT_TRUE(lp_hot.top.empty());
  const double expected[] = {std::log(1.0 / z), std::log(3.0 / z), 1.0 - std::log(z)};
  EXPECT_NEAR(lp_hot.logprob, expected[lp_hot.id], 1e-5);
}

}  // namespace
}  // namespace vlm::language
