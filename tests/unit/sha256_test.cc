#include "common/sha256.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>

namespace vlm {
namespace {

// FIPS 180-2 appendix B / NIST CSRC example values.
constexpr char kEmpty[] = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
constexpr char kAbc[] = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
constexpr char k448Msg[] = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
constexpr char k448[] = "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1";
constexpr char k896Msg[] =
    "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu";
constexpr char k896[] = "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1";
constexpr char kMillionA[] = "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0";

TEST(Sha256Test, OneShotMatchesFipsVectors) {
  EXPECT_EQ(Sha256Hex(""), kEmpty);
  EXPECT_EQ(Sha256Hex(nullptr, 0), kEmpty);
  EXPECT_EQ(Sha256Hex("abc"), kAbc);
  EXPECT_EQ(Sha256Hex(k448Msg), k448);
  EXPECT_EQ(Sha256Hex(k896Msg), k896);
  EXPECT_EQ(Sha256Hex(std::string(1000000, 'a')), kMillionA);
}

TEST(Sha256Test, DigestBytesMatchHex) {
  Sha256Digest d = Sha256("abc");
  EXPECT_EQ(d[0], 0xba);
  EXPECT_EQ(d[31], 0xad);
  EXPECT_EQ(HexEncode(d), kAbc);
}

TEST(Sha256Test, IncrementalEqualsOneShotForAnyChunking) {
  const std::string million(1000000, 'a');
  for (size_t chunk : {1u, 3u, 63u, 64u, 65u, 1000u, 999983u}) {
    Sha256Hasher h;
    for (size_t i = 0; i < million.size(); i += chunk) h.Update(million.data() + i, std::min(chunk, million.size() - i));
    EXPECT_EQ(h.FinishHex(), kMillionA) << "chunk " << chunk;
  }
  Sha256Hasher h;
  h.Update("ab");
  h.Update("");
  h.Update("c");
  EXPECT_EQ(h.FinishHex(), kAbc);
}

TEST(Sha256Test, HasherResetsAfterFinishAndSurvivesMove) {
  Sha256Hasher h;
  h.Update("abc");
  EXPECT_EQ(h.FinishHex(), kAbc);
  EXPECT_EQ(h.FinishHex(), kEmpty);  // reset: a fresh, empty message
  h.Update(k448Msg);
  Sha256Hasher moved = std::move(h);
  EXPECT_EQ(moved.FinishHex(), k448);
}

TEST(Sha256Test, HexEncodeIsLowercase) {
  const unsigned char bytes[] = {0x00, 0x0f, 0xa0, 0xff};
  EXPECT_EQ(HexEncode(bytes, sizeof(bytes)), "000fa0ff");
  EXPECT_EQ(HexEncode(bytes, 0), "");
}

}  // namespace
}  // namespace vlm
