// get_rope_index and the interleaved MRoPE tables against the worked examples
// of docs/qwen3-vl-model.md §6 and the index sets of §6.2 / §9.
#include "services/language/model/mrope.h"

#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace vlm::language {
namespace {

constexpr int32_t kVs = 151652, kVe = 151653, kPad = 151655, kVideo = 151656;

ModelConfig Config(int64_t head_dim = 128, std::array<int64_t, 3> section = {24, 20, 20}) {
  ModelConfig c;
  c.image_token_id = kPad;
  c.video_token_id = kVideo;
  c.vision_start_token_id = kVs;
  c.vision_end_token_id = kVe;
  c.vision.spatial_merge_size = 2;
  c.text.head_dim = head_dim;
  c.text.rope_theta = 5000000;
  c.text.mrope_section = section;
  return c;
}

std::vector<int32_t> Pads(int n) { return std::vector<int32_t>(n, kPad); }

std::vector<int32_t> Cat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

using Axis = std::vector<int64_t>;

TEST(GetRopeIndexTest, TextOnlyPositionsAreTheIndex) {
  const std::vector<int32_t> ids = {1, 2, 3, 4, 5};
  auto r = GetRopeIndex(ids, {}, Config());
  ASSERT_TRUE(r.ok()) << r.status();
  for (int a = 0; a < 3; ++a) EXPECT_EQ(r->positions[a], (Axis{0, 1, 2, 3, 4}));
  EXPECT_EQ(r->rope_delta, 0);
}

// §6.1: <|im_start|>user\n<|vision_start|> + 6 pads (grid (1,4,6)) + <|vision_end|> + 6 tokens.
TEST(GetRopeIndexTest, SpecWorkedExampleOneImage) {
  const auto ids = Cat({{151644, 872, 198, kVs}, Pads(6), {kVe, 1, 2, 3, 4, 5, 6}});
  ASSERT_EQ(ids.size(), 17u);
  const GridThw grid = {1, 4, 6};
  auto r = GetRopeIndex(ids, {&grid, 1}, Config());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->positions[0], (Axis{0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 7, 8, 9, 10, 11, 12, 13}));
  EXPECT_EQ(r->positions[1], (Axis{0, 1, 2, 3, 4, 4, 4, 5, 5, 5, 7, 8, 9, 10, 11, 12, 13}));
  EXPECT_EQ(r->positions[2], (Axis{0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}));
  EXPECT_EQ(r->rope_delta, -3);
}

// §7.3 / §6.1: the 480x640 image (grid (1,30,40), 300 pads) in prompt a), S = 314.
TEST(GetRopeIndexTest, SpecWorkedExample480x640) {
  const auto ids = Cat({{151644, 872, 198, kVs}, Pads(300),
                        {kVe, 74785, 419, 2168, 13, 151645, 198, 151644, 77091, 198}});
  ASSERT_EQ(ids.size(), 314u);
  const GridThw grid = {1, 30, 40};
  auto r = GetRopeIndex(ids, {&grid, 1}, Config());
  ASSERT_TRUE(r.ok()) << r.status();
  int64_t min_h = 1 << 30, max_h = -1, min_w = 1 << 30, max_w = -1;
  for (int i = 4; i < 304; ++i) {
    EXPECT_EQ(r->positions[0][i], 4);
    min_h = std::min(min_h, r->positions[1][i]);
    max_h = std::max(max_h, r->positions[1][i]);
    min_w = std::min(min_w, r->positions[2][i]);
    max_w = std::max(max_w, r->positions[2][i]);
  }
  EXPECT_EQ(min_h, 4);
  EXPECT_EQ(max_h, 18);
  EXPECT_EQ(min_w, 4);
  EXPECT_EQ(max_w, 23);
  for (int a = 0; a < 3; ++a) EXPECT_EQ(r->positions[a][304], 24);  // <|vision_end|>
  EXPECT_EQ(r->rope_delta, -280);
}

// §6.1: a VS [4 pads] VE b VS [6 pads] VE c, grids (1,4,4) and (1,4,6), S = 17.
TEST(GetRopeIndexTest, SpecWorkedExampleTwoImages) {
  const auto ids = Cat({{7, kVs}, Pads(4), {kVe, 8, kVs}, Pads(6), {kVe, 9}});
  ASSERT_EQ(ids.size(), 17u);
  const GridThw grids[] = {{1, 4, 4}, {1, 4, 6}};
  auto r = GetRopeIndex(ids, grids, Config());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->positions[0], (Axis{0, 1, 2, 2, 2, 2, 4, 5, 6, 7, 7, 7, 7, 7, 7, 10, 11}));
  EXPECT_EQ(r->positions[1], (Axis{0, 1, 2, 2, 3, 3, 4, 5, 6, 7, 7, 7, 8, 8, 8, 10, 11}));
  EXPECT_EQ(r->positions[2], (Axis{0, 1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 7, 8, 9, 10, 11}));
  EXPECT_EQ(r->rope_delta, -5);
  // [3, S] tensor form.
  at::Tensor t = r->ToTensor();
  ASSERT_EQ(t.sizes(), (at::IntArrayRef{3, 17}));
  EXPECT_EQ(t[1][12].item<int64_t>(), 8);
}

TEST(GetRopeIndexTest, ImageAtTheEndGivesDeltaFromItsExtent) {
  // Pads last: next = base + max(t, hm, wm).
  const auto ids = Cat({{kVs}, Pads(6)});
  const GridThw grid = {1, 2, 12};  // hm = 1, wm = 6
  auto r = GetRopeIndex(ids, {&grid, 1}, Config());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->positions[2], (Axis{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(r->positions[1], (Axis{0, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(r->rope_delta, 7 - 7);
}

TEST(GetRopeIndexTest, RejectsPadCountNotMatchingGrids) {
  const auto ids = Cat({{1, kVs}, Pads(5), {kVe}});
  const GridThw grid = {1, 4, 6};  // needs 6
  auto r = GetRopeIndex(ids, {&grid, 1}, Config());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("5 image pad tokens"), std::string::npos) << r.status();
  // No grid for the pads at all.
  r = GetRopeIndex(ids, {}, Config());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GetRopeIndexTest, RejectsRunsThatSplitImagesDifferently) {
  // 10 pads total as needed by 4 + 6, but in runs of 5 and 5.
  const auto ids = Cat({{kVs}, Pads(5), {kVe, kVs}, Pads(5), {kVe}});
  const GridThw grids[] = {{1, 4, 4}, {1, 4, 6}};
  auto r = GetRopeIndex(ids, grids, Config());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("has 5 tokens"), std::string::npos) << r.status();
}

TEST(GetRopeIndexTest, RejectsPadRunNotAfterVisionStart) {
  const auto ids = Cat({{1, 2}, Pads(4), {kVe}});
  const GridThw grid = {1, 4, 4};
  auto r = GetRopeIndex(ids, {&grid, 1}, Config());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("does not directly follow <|vision_start|>"),
            std::string::npos)
      << r.status();
  // Pads at index 0.
  r = GetRopeIndex(Pads(4), {&grid, 1}, Config());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GetRopeIndexTest, RejectsVideoPadsAndBadGrids) {
  const std::vector<int32_t> video = {kVs, kVideo, kVe};
  EXPECT_EQ(GetRopeIndex(video, {}, Config()).status().code(), absl::StatusCode::kInvalidArgument);
  const auto ids = Cat({{kVs}, Pads(3), {kVe}});
  const GridThw odd = {1, 3, 4};
  EXPECT_EQ(GetRopeIndex(ids, {&odd, 1}, Config()).status().code(),
            absl::StatusCode::kInvalidArgument);
  const GridThw zero = {0, 4, 4};
  EXPECT_EQ(GetRopeIndex(ids, {&zero, 1}, Config()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

std::vector<int> Where(const std::vector<int>& axes, int axis) {
  std::vector<int> out;
  for (size_t j = 0; j < axes.size(); ++j) {
    if (axes[j] == axis) out.push_back(static_cast<int>(j));
  }
  return out;
}

// §9: tiny (head_dim 32, section [6,5,5]).
TEST(MultimodalRotaryTest, TinyIndexSets) {
  MultimodalRotary rope(Config(32, {6, 5, 5}).text);
  const auto& axes = rope.frequency_axes();
  ASSERT_EQ(axes.size(), 16u);
  EXPECT_EQ(Where(axes, 0), (std::vector<int>{0, 3, 6, 9, 12, 15}));
  EXPECT_EQ(Where(axes, 1), (std::vector<int>{1, 4, 7, 10, 13}));
  EXPECT_EQ(Where(axes, 2), (std::vector<int>{2, 5, 8, 11, 14}));
}

// §6.2: 2B (head_dim 128, section [24,20,20]).
TEST(MultimodalRotaryTest, Qwen3VL2BIndexSets) {
  MultimodalRotary rope(Config().text);
  const auto& axes = rope.frequency_axes();
  ASSERT_EQ(axes.size(), 64u);
  std::vector<int> t, h, w;
  for (int j = 0; j < 60; j += 3) {
    t.push_back(j);
    h.push_back(j + 1);
    w.push_back(j + 2);
  }
  for (int j = 60; j < 64; ++j) t.push_back(j);
  EXPECT_EQ(Where(axes, 0), t);
  EXPECT_EQ(Where(axes, 1), h);
  EXPECT_EQ(Where(axes, 2), w);
  EXPECT_EQ(t.size(), 24u);
}

TEST(MultimodalRotaryTest, InverseFrequenciesFollowTheSpec) {
  MultimodalRotary rope(Config().text);
  const at::Tensor inv = rope.inv_freq();
  ASSERT_EQ(inv.numel(), 64);
  for (int j = 0; j < 64; ++j) {
    const double expect = 1.0 / std::pow(5000000.0, 2.0 * j / 128.0);
    EXPECT_NEAR(inv[j].item<float>(), expect, expect * 1e-6) << j;
  }
}

TEST(MultimodalRotaryTest, CosSinTakeEachFrequencyFromItsAxis) {
  MultimodalRotary rope(Config(32, {6, 5, 5}).text);
  // One token at (t, h, w) = (3, 10, 200).
  at::Tensor pos = at::tensor(std::vector<int64_t>{3, 10, 200}).view({3, 1});
  auto [cos, sin] = rope.CosSin(pos);
  ASSERT_EQ(cos.sizes(), (at::IntArrayRef{1, 32}));
  EXPECT_EQ(cos.scalar_type(), at::kFloat);
  const float p[3] = {3, 10, 200};
  const auto& axes = rope.frequency_axes();
  for (int j = 0; j < 16; ++j) {
    const float f = p[axes[j]] * rope.inv_freq()[j].item<float>();
    EXPECT_FLOAT_EQ(cos[0][j].item<float>(), std::cos(f)) << j;
    EXPECT_FLOAT_EQ(cos[0][j + 16].item<float>(), std::cos(f)) << j;  // emb = [f, f]
    EXPECT_FLOAT_EQ(sin[0][j].item<float>(), std::sin(f)) << j;
    EXPECT_FLOAT_EQ(sin[0][j + 16].item<float>(), std::sin(f)) << j;
  }
}

TEST(MultimodalRotaryTest, TextPositionsAreOrdinaryRope) {
  MultimodalRotary rope(Config().text);
  auto [cos, sin] = rope.CosSinText(41, 3);
  ASSERT_EQ(cos.sizes(), (at::IntArrayRef{3, 128}));
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 64; ++j) {
      const float f = static_cast<float>(41 + i) * rope.inv_freq()[j].item<float>();
      EXPECT_FLOAT_EQ(cos[i][j].item<float>(), std::cos(f));
      EXPECT_FLOAT_EQ(sin[i][j + 64].item<float>(), std::sin(f));
    }
  }
}

}  // namespace
}  // namespace vlm::language
