// Stop strings over a stream of text deltas: what is released, what is held
// back, and where the stream ends.
#include "services/language/sampling/stop_strings.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "services/language/text/utf8.h"

namespace vlm::language {
namespace {

using ::testing::HasSubstr;

// Feeds `deltas`, returns the released pieces (one per Push, then Flush if no stop).
struct Streamed {
  std::vector<std::string> pieces;
  std::string text;
  bool stopped = false;
  int stop_index = -1;
};

Streamed Feed(std::vector<std::string> stops, const std::vector<std::string>& deltas) {
  StopStringMatcher matcher(std::move(stops));
  Streamed run;
  for (const std::string& d : deltas) {
    StopStringMatcher::Step step = matcher.Push(d);
    run.pieces.push_back(step.text);
    run.text += step.text;
    if (step.stopped) {
      run.stopped = true;
      run.stop_index = step.stop_index;
      break;
    }
  }
  if (!run.stopped) {
    run.pieces.push_back(matcher.Flush());
    run.text += run.pieces.back();
  }
  return run;
}

TEST(StopStringTest, WithoutStopsEverythingPassesAtOnce) {
  Streamed r = Feed({}, {"Hello", " world"});
  EXPECT_EQ(r.pieces, (std::vector<std::string>{"Hello", " world", ""}));
  EXPECT_FALSE(r.stopped);
}

TEST(StopStringTest, APossibleStartIsHeldBackUntilItCannotMatch) {
  Streamed r = Feed({"END"}, {"hello E", "N", "X more"});
  EXPECT_EQ(r.pieces, (std::vector<std::string>{"hello ", "", "ENX more", ""}));
  EXPECT_EQ(r.text, "hello ENX more");
  EXPECT_FALSE(r.stopped);
}

TEST(StopStringTest, HeldTextIsReleasedAtTheEndOfTheStream) {
  Streamed r = Feed({"END"}, {"the EN"});
  EXPECT_EQ(r.pieces, (std::vector<std::string>{"the ", "EN"}));
}

TEST(StopStringTest, StopAcrossTokenBoundariesCutsBeforeIt) {
  Streamed r = Feed({"END"}, {"foo E", "N", "D bar", "never seen"});
  EXPECT_EQ(r.pieces, (std::vector<std::string>{"foo ", "", ""}));
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.stop_index, 0);
}

TEST(StopStringTest, StopInsideOneDeltaReleasesTheTextBeforeIt) {
  Streamed r = Feed({"\n\n"}, {"line one\n\nline two"});
  EXPECT_EQ(r.text, "line one");
  EXPECT_TRUE(r.stopped);
}

TEST(StopStringTest, StopAtTheVeryStartReleasesNothing) {
  Streamed r = Feed({"###"}, {"###", "after"});
  EXPECT_EQ(r.pieces, (std::vector<std::string>{""}));
  EXPECT_TRUE(r.stopped);
  Streamed split = Feed({"###"}, {"#", "#", "# x"});
  EXPECT_EQ(split.text, "");
  EXPECT_TRUE(split.stopped);
}

TEST(StopStringTest, TheEarliestOccurrenceWinsAmongOverlappingStops) {
  // "abc" starts at 1, "bcd" at 2: "abc" wins, whichever is listed first.
  Streamed r = Feed({"bcd", "abc"}, {"xab", "cd"});
  EXPECT_EQ(r.text, "x");
  EXPECT_EQ(r.stop_index, 1);
  // A stop contained in a longer one that starts earlier.
  Streamed nested = Feed({"bc", "abcd"}, {"zabc", "d"});
  EXPECT_EQ(nested.text, "za");  // "bc" completes first, at offset 2
  EXPECT_EQ(nested.stop_index, 0);
}

TEST(StopStringTest, SelfOverlappingStopIsFoundAfterAFalseStart) {
  Streamed r = Feed({"aab"}, {"a", "a", "a", "b", "tail"});
  EXPECT_EQ(r.pieces, (std::vector<std::string>{"", "", "a", ""}));
  EXPECT_EQ(r.text, "a");
  EXPECT_TRUE(r.stopped);
}

TEST(StopStringTest, MultiByteCharactersAreNeverSplit) {
  // "é" = C3 A9, "ê" = C3 AA: same lead byte, different characters.
  Streamed r = Feed({"ê!"}, {"caf", "é", "!", " ok"});
  EXPECT_EQ(r.text, "café! ok");
  for (const std::string& p : r.pieces) EXPECT_TRUE(utf8::Validate(p).ok()) << p;
  Streamed stop = Feed({"é!"}, {"caf", "é", "!", " ok"});
  EXPECT_EQ(stop.pieces, (std::vector<std::string>{"caf", "", ""}));
  EXPECT_TRUE(stop.stopped);
  Streamed euro = Feed({"€€"}, {"1€", "€2"});
  EXPECT_EQ(euro.text, "1");
  EXPECT_TRUE(euro.stopped);
}

TEST(StopStringTest, EmptyStopStringsAreIgnored) {
  Streamed r = Feed({"", "Z"}, {"abc", "Z"});
  EXPECT_EQ(r.text, "abc");
  EXPECT_EQ(r.stop_index, 1);
}

TEST(StopStringTest, ValidationNamesTheField) {
  EXPECT_TRUE(ValidateStopStrings({"a", "\n"}).ok());
  absl::Status empty = ValidateStopStrings({"a", ""}, "params.stop");
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(empty.message()), HasSubstr("params.stop[1]"));
  absl::Status bad = ValidateStopStrings({std::string("\xC3\x28")}, "params.stop");
  EXPECT_THAT(std::string(bad.message()), HasSubstr("params.stop[0]"));
  EXPECT_THAT(std::string(bad.message()), HasSubstr("UTF-8"));
  absl::Status many =
      ValidateStopStrings(std::vector<std::string>(kMaxStopStrings + 1, "x"), "params.stop");
  EXPECT_THAT(std::string(many.message()), HasSubstr("params.stop"));
  absl::Status long_one =
      ValidateStopStrings({std::string(kMaxStopStringBytes + 1, 'x')}, "params.stop");
  EXPECT_EQ(long_one.code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace vlm::language
