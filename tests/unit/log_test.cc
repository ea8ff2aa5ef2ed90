#include "common/log.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdio.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"

namespace vlm {
namespace {

// 1700000000 s after the epoch is 2023-11-14T22:13:20Z.
const absl::Time kTime = absl::FromUnixMillis(1700000000123);

TEST(LogTest, TextRecordHasTimestampLevelComponentMessageAndFields) {
  const LogField fields[] = {{"n", 3}, {"path", "/a/b"}, {"note", "two words"}, {"ok", true},
                             {"empty", ""}};
  EXPECT_EQ(FormatLogRecord(LogFormat::kText, kTime, LogLevel::kWarning, "vision", "loaded", fields),
            "2023-11-14T22:13:20.123Z WARN vision: loaded n=3 path=/a/b note=\"two words\" ok=true "
            "empty=\"\"");
}

TEST(LogTest, TextRecordStaysOnOneLine) {
  const LogField fields[] = {{"error", "line1\nline2 \"q\""}};
  const std::string line =
      FormatLogRecord(LogFormat::kText, kTime, LogLevel::kError, "x", "bad\nmessage", fields);
  EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  EXPECT_NE(line.find(R"(error="line1\nline2 \"q\"")"), std::string::npos) << line;
  EXPECT_NE(line.find(R"( x: bad\nmessage )"), std::string::npos) << line;
  EXPECT_NE(FormatLogRecord(LogFormat::kText, kTime, LogLevel::kInfo, "x", "say \"hi\"", {})
                .find("x: say \"hi\""),
            std::string::npos);
}

TEST(LogTest, JsonRecordParsesWithTypedFields) {
  const LogField fields[] = {{"n", 3},
                             {"seconds", 1.25},
                             {"ok", false},
                             {"text", "quote\" backslash\\ newline\n tab\t bell\a"},
                             {"nan", std::numeric_limits<double>::quiet_NaN()},
                             {"wait", absl::Milliseconds(1500)}};
  const std::string line =
      FormatLogRecord(LogFormat::kJson, kTime, LogLevel::kInfo, "lang", "msg \"x\"", fields);
  EXPECT_EQ(line.find('\n'), std::string::npos);
  nlohmann::json j = nlohmann::json::parse(line);
  EXPECT_EQ(j["ts"], "2023-11-14T22:13:20.123Z");
  EXPECT_EQ(j["level"], "info");
  EXPECT_EQ(j["component"], "lang");
  EXPECT_EQ(j["msg"], "msg \"x\"");
  EXPECT_EQ(j["n"], 3);
  EXPECT_DOUBLE_EQ(j["seconds"].get<double>(), 1.25);
  EXPECT_EQ(j["ok"], false);
  EXPECT_EQ(j["text"], "quote\" backslash\\ newline\n tab\t bell\a");
  EXPECT_EQ(j["nan"], "nan");  // JSON has no NaN
  EXPECT_DOUBLE_EQ(j["wait"].get<double>(), 1.5);
}

TEST(LogTest, LevelsBelowTheMinimumAreDropped) {
  std::vector<std::string> lines;
  SetLogSinkForTesting([&](std::string_view line) { lines.emplace_back(line); });
  SetLogLevel(LogLevel::kWarning);
  LogInfo("t", "dropped");
  LogWarning("t", "kept");
  SetLogLevel(LogLevel::kDebug);
  LogDebug("t", "kept too");
  SetLogLevel(LogLevel::kInfo);
  SetLogSinkForTesting(nullptr);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find("WARN t: kept\n"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("DEBUG t: kept too\n"), std::string::npos) << lines[1];
}

TEST(LogTest, FlagValuesParse) {
  LogFormat format;
  std::string error;
  EXPECT_TRUE(AbslParseFlag("JSON", &format, &error));
  EXPECT_EQ(format, LogFormat::kJson);
  EXPECT_FALSE(AbslParseFlag("xml", &format, &error));
  EXPECT_EQ(error, "must be text or json");
  LogLevel level;
  EXPECT_TRUE(AbslParseFlag("warning", &level, &error));
  EXPECT_EQ(level, LogLevel::kWarning);
  EXPECT_EQ(AbslUnparseFlag(LogLevel::kError), "error");
  EXPECT_FALSE(AbslParseFlag("loud", &level, &error));
}

// Records from many threads reach stderr as whole lines, never interleaved.
TEST(LogTest, ConcurrentRecordsOnStderrAreWholeLines) {
  char path[] = "/tmp/vlm_log_test_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  fflush(stderr);
  const int saved_stderr = dup(STDERR_FILENO);
  ASSERT_GE(saved_stderr, 0);
  ASSERT_EQ(dup2(fd, STDERR_FILENO), STDERR_FILENO);

  SetLogFormat(LogFormat::kJson);
  constexpr int kThreads = 8, kRecords = 300;
  const std::string payload(200, 'p');
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRecords; ++i) {
        LogInfo("race", "record", {{"thread", t}, {"i", i}, {"payload", payload}});
      }
    });
  }
  for (auto& th : threads) th.join();
  SetLogFormat(LogFormat::kText);
  dup2(saved_stderr, STDERR_FILENO);
  close(saved_stderr);
  close(fd);

  std::ifstream in(path);
  std::string line;
  std::vector<int> next(kThreads, 0);
  int count = 0;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line);  // throws on a torn line
    const int t = j["thread"].get<int>();
    ASSERT_GE(t, 0);
    ASSERT_LT(t, kThreads);
    EXPECT_EQ(j["i"].get<int>(), next[t]++);  // each thread's records stay in order
    EXPECT_EQ(j["payload"], payload);
    ++count;
  }
  unlink(path);
  EXPECT_EQ(count, kThreads * kRecords);
}

}  // namespace
}  // namespace vlm
