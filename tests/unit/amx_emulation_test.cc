// The AMX emulation (amx_emulation.h) against hand-worked cases of the SDM:
// tile shapes and strides, zeroing beyond the configured shape, TDPBF16PS's
// order (even and odd sums first, then into the destination), DAZ/FTZ,
// TDPB*D sign handling and int32 wrap-around, and the faults real hardware
// raises, which abort with a message.
#include "common/kernels/amx_emulation.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace vlm::amx_emulation {
namespace {

struct alignas(64) Cfg {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(Cfg) == 64);

// Tiles 0-2 as C[rows x n f32] += A[rows x 2k bf16] · B[k x 2n bf16].
Cfg DotConfig(int rows, int k_pairs, int n) {
  Cfg c;
  c.rows[0] = rows, c.colsb[0] = 4 * n;
  c.rows[1] = rows, c.colsb[1] = 4 * k_pairs;
  c.rows[2] = k_pairs, c.colsb[2] = 4 * n;
  return c;
}

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);  // exact for the values used here
}

class AmxEmulationTest : public ::testing::Test {
 protected:
  void TearDown() override { _tile_release(); }
};

TEST_F(AmxEmulationTest, LoadReadsConfiguredRowsAtTheStrideAndZeroesTheRest) {
  Cfg c;
  c.rows[3] = 3;
  c.colsb[3] = 12;
  _tile_loadconfig(&c);
  std::vector<uint8_t> mem(400);
  for (size_t i = 0; i < mem.size(); ++i) mem[i] = static_cast<uint8_t>(i + 1);
  std::memset(State().data[3], 0xEE, sizeof State().data[3]);  // stale contents
  _tile_loadd(3, mem.data(), 100);
  for (int r = 0; r < kMaxRows; ++r) {
    for (int b = 0; b < kMaxColsb; ++b) {
      const uint8_t want = r < 3 && b < 12 ? static_cast<uint8_t>(r * 100 + b + 1) : 0;
      ASSERT_EQ(State().data[3][r][b], want) << "row " << r << " byte " << b;
    }
  }
  std::vector<uint8_t> out(400, 0xAA);
  _tile_stored(3, out.data(), 50);
  for (int i = 0; i < 400; ++i) {
    const int r = i / 50, b = i % 50;
    const uint8_t want = r < 3 && b < 12 ? static_cast<uint8_t>(r * 100 + b + 1) : 0xAA;
    ASSERT_EQ(out[i], want) << "byte " << i;  // nothing beyond rows x colsb is written
  }
}

TEST_F(AmxEmulationTest, ZeroClearsAndStoreConfigGivesTheShapesBack) {
  Cfg c = DotConfig(5, 3, 7);
  _tile_loadconfig(&c);
  std::vector<uint8_t> ones(16 * 64, 0xFF);
  _tile_loadd(0, ones.data(), 64);
  _tile_zero(0);
  for (int r = 0; r < kMaxRows; ++r) {
    for (int b = 0; b < kMaxColsb; ++b) ASSERT_EQ(State().data[0][r][b], 0);
  }
  Cfg back;
  std::memset(static_cast<void*>(&back), 0x55, sizeof back);
  _tile_storeconfig(&back);
  EXPECT_EQ(std::memcmp(&back, &c, sizeof c), 0);
}

// dst = 1, one pair with both products 2^-24. The SDM sums even and odd
// first (2^-23) and then adds: 1 + 2^-23. Adding each product straight into
// the destination (the intrinsics guide's short form) would give 1 twice
// over (each addition a tie, rounded to even).
TEST_F(AmxEmulationTest, Bf16DotSumsEvenAndOddBeforeTheDestination) {
  Cfg c = DotConfig(1, 1, 1);
  _tile_loadconfig(&c);
  const float one = 1.0f;
  const uint16_t a[2] = {Bf16(std::ldexp(1.0f, -12)), Bf16(std::ldexp(1.0f, -12))};
  const uint16_t b[2] = {Bf16(std::ldexp(1.0f, -12)), Bf16(std::ldexp(1.0f, -12))};
  _tile_loadd(0, &one, 4);
  _tile_loadd(1, a, 4);
  _tile_loadd(2, b, 4);
  _tile_dpbf16ps(0, 1, 2);
  float out = 0;
  _tile_stored(0, &out, 4);
  EXPECT_EQ(out, 1.0f + std::ldexp(1.0f, -23));
}

// Within one instruction the even products chain by FMA from zero in k order:
// 2^24 + 1 - 2^24 keeps nothing of the 1 (2^24 + 1 rounds to 2^24), while a
// single sum of all three would be 1.
TEST_F(AmxEmulationTest, Bf16DotChainsEachParityInKOrderWithOneRoundingPerStep) {
  Cfg c = DotConfig(1, 3, 1);
  _tile_loadconfig(&c);
  const uint16_t a[6] = {Bf16(std::ldexp(1.0f, 24)), 0, Bf16(1.0f), 0, Bf16(-std::ldexp(1.0f, 24)), 0};
  const uint16_t b[6] = {Bf16(1.0f), 0, Bf16(1.0f), 0, Bf16(1.0f), 0};  // 3 rows of one pair
  _tile_zero(0);
  _tile_loadd(1, a, 12);
  _tile_loadd(2, b, 4);
  _tile_dpbf16ps(0, 1, 2);
  float out = -1;
  _tile_stored(0, &out, 4);
  EXPECT_EQ(out, 0.0f);
}

TEST_F(AmxEmulationTest, Bf16DotTreatsDenormalInputsAsZeroAndFlushesDenormalResults) {
  Cfg c = DotConfig(1, 1, 2);
  _tile_loadconfig(&c);
  // Column 0: a bf16 denormal (0x0001) times 2^100 -> 0 under DAZ (2^-33 without).
  // Column 1: 2^-70 · 2^-70 = 2^-140, an f32 denormal -> 0 under FTZ.
  const uint16_t a[2] = {0x0001, Bf16(std::ldexp(1.0f, -70))};
  const uint16_t b[4] = {Bf16(std::ldexp(1.0f, 100)), 0, 0, Bf16(std::ldexp(1.0f, -70))};
  // The destination's own denormal counts as zero too (DAZ).
  const float dst[2] = {0.0f, std::numeric_limits<float>::denorm_min()};
  _tile_loadd(0, dst, 8);
  _tile_loadd(1, a, 4);
  _tile_loadd(2, b, 8);
  _tile_dpbf16ps(0, 1, 2);
  float out[2] = {-1, -1};
  _tile_stored(0, out, 8);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], 0.0f);
  EXPECT_FALSE(std::signbit(out[1]));
}

TEST_F(AmxEmulationTest, Int8DotsExtendBytesBySignAndWrapInt32) {
  Cfg c = DotConfig(1, 1, 1);
  _tile_loadconfig(&c);
  const uint8_t a[4] = {255, 1, 0, 0};  // u8: 255, 1; s8: -1, 1
  const uint8_t b[4] = {255, 2, 0, 0};
  auto run = [&](int which, int32_t start) {
    _tile_loadd(0, &start, 4);
    _tile_loadd(1, a, 4);
    _tile_loadd(2, b, 4);
    if (which == 0) _tile_dpbssd(0, 1, 2);
    if (which == 1) _tile_dpbsud(0, 1, 2);
    if (which == 2) _tile_dpbusd(0, 1, 2);
    if (which == 3) _tile_dpbuud(0, 1, 2);
    int32_t out;
    _tile_stored(0, &out, 4);
    return out;
  };
  EXPECT_EQ(run(0, 0), (-1) * (-1) + 1 * 2);
  EXPECT_EQ(run(1, 0), (-1) * 255 + 1 * 2);
  EXPECT_EQ(run(2, 0), 255 * (-1) + 1 * 2);
  EXPECT_EQ(run(3, 0), 255 * 255 + 1 * 2);
  EXPECT_EQ(run(3, std::numeric_limits<int32_t>::max()),
            std::numeric_limits<int32_t>::min() + 255 * 255 + 1);  // wrap-around
}

using AmxEmulationDeathTest = AmxEmulationTest;

TEST_F(AmxEmulationDeathTest, WhatHardwareFaultsOnAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  float buf[256] = {};
  EXPECT_DEATH(
      {
        _tile_release();
        _tile_loadd(0, buf, 64);
      },
      "no tile configuration loaded");
  EXPECT_DEATH(
      {
        Cfg c = DotConfig(2, 2, 2);
        _tile_loadconfig(&c);
        _tile_zero(5);
      },
      "tmm5: tile is not configured");
  EXPECT_DEATH(
      {
        Cfg c;
        c.rows[0] = 17;
        c.colsb[0] = 64;
        _tile_loadconfig(&c);
      },
      "rows beyond the palette");
  EXPECT_DEATH(
      {
        Cfg c;
        c.rows[0] = 1;
        c.colsb[0] = 4;
        c.reserved[3] = 1;
        _tile_loadconfig(&c);
      },
      "reserved byte");
  EXPECT_DEATH(
      {
        Cfg c = DotConfig(4, 3, 2);
        c.rows[2] = 4;  // B has 4 pair rows, A only 3 pairs
        _tile_loadconfig(&c);
        _tile_dpbf16ps(0, 1, 2);
      },
      "K mismatch");
  EXPECT_DEATH(
      {
        Cfg c = DotConfig(4, 3, 2);
        c.rows[0] = 3;
        _tile_loadconfig(&c);
        _tile_dpbf16ps(0, 1, 2);
      },
      "M mismatch");
  EXPECT_DEATH(
      {
        Cfg c = DotConfig(4, 4, 4);
        c.colsb[1] = 16;
        _tile_loadconfig(&c);
        _tile_dpbusd(0, 1, 1);
      },
      "the three tiles must differ");
}

TEST_F(AmxEmulationTest, TileStateIsPerThread) {
  Cfg c = DotConfig(1, 1, 1);
  _tile_loadconfig(&c);
  bool other_configured = true;
  std::thread([&] { other_configured = State().configured; }).join();
  EXPECT_TRUE(State().configured);
  EXPECT_FALSE(other_configured);
}

}  // namespace
}  // namespace vlm::amx_emulation
