#include "common/flags.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "common/log.h"

ABSL_FLAG(int, test_port, 7, "a test flag");
ABSL_FLAG(std::string, test_name, "default", "a test flag");
ABSL_FLAG(bool, test_enabled, false, "a test flag");

namespace vlm {
namespace {

EnvLookup FakeEnv(std::map<std::string, std::string> vars, std::set<std::string>* asked = nullptr) {
  return [vars = std::move(vars), asked](const std::string& name) -> std::optional<std::string> {
    if (asked != nullptr) asked->insert(name);
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(FlagsTest, EnvVarNameIsPrefixedUppercase) {
  EXPECT_EQ(EnvVarForFlag("grpc_address"), "VLM_GRPC_ADDRESS");
  EXPECT_EQ(EnvVarForFlag("max_message_mb"), "VLM_MAX_MESSAGE_MB");
}

TEST(FlagsTest, EnvironmentOverridesDefaults) {
  absl::FlagSaver saver;
  std::vector<std::pair<std::string, std::string>> applied;
  ASSERT_TRUE(ApplyEnvironmentOverrides(
                  FakeEnv({{"VLM_TEST_PORT", "42"}, {"VLM_TEST_ENABLED", "true"},
                           {"VLM_UNRELATED", "x"}}),
                  &applied)
                  .ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_test_port), 42);
  EXPECT_TRUE(absl::GetFlag(FLAGS_test_enabled));
  EXPECT_EQ(absl::GetFlag(FLAGS_test_name), "default");  // not in the environment
  const std::vector<std::pair<std::string, std::string>> want = {{"test_enabled", "true"},
                                                                 {"test_port", "42"}};
  EXPECT_EQ(applied, want);
}

TEST(FlagsTest, BadEnvironmentValueNamesTheVariableAndTheFlag) {
  absl::FlagSaver saver;
  absl::Status status = ApplyEnvironmentOverrides(FakeEnv({{"VLM_TEST_PORT", "seven"}}));
  ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("VLM_TEST_PORT"), absl::string_view::npos) << status;
  EXPECT_NE(status.message().find("--test_port"), absl::string_view::npos) << status;
  EXPECT_EQ(absl::GetFlag(FLAGS_test_port), 7);
}

TEST(FlagsTest, AbseilsOwnFlagsAreNotReadFromTheEnvironment) {
  absl::FlagSaver saver;
  std::set<std::string> asked;
  ASSERT_TRUE(ApplyEnvironmentOverrides(
                  FakeEnv({{"VLM_FLAGFILE", "/nonexistent"}, {"VLM_HELP", "true"}}, &asked))
                  .ok());
  EXPECT_TRUE(asked.count("VLM_TEST_PORT"));
  EXPECT_TRUE(asked.count("VLM_LOG_FORMAT"));
  for (const char* absl_flag : {"VLM_FLAGFILE", "VLM_HELP", "VLM_VERSION", "VLM_FROMENV"}) {
    EXPECT_FALSE(asked.count(absl_flag)) << absl_flag;
  }
}

TEST(FlagsTest, EffectiveConfigurationListsProgramFlagsSorted) {
  absl::FlagSaver saver;
  absl::SetFlag(&FLAGS_test_name, "shown");
  const auto config = EffectiveConfiguration();
  std::map<std::string, std::string> by_name(config.begin(), config.end());
  EXPECT_EQ(by_name["test_name"], "shown");
  EXPECT_EQ(by_name["test_port"], "7");
  EXPECT_EQ(by_name["log_format"], "text");
  EXPECT_FALSE(by_name.count("flagfile"));
  EXPECT_FALSE(by_name.count("helpfull"));
  EXPECT_TRUE(std::is_sorted(config.begin(), config.end()));
}

TEST(FlagsTest, EffectiveConfigurationIsOneLogRecord) {
  std::vector<std::string> lines;
  SetLogSinkForTesting([&](std::string_view line) { lines.emplace_back(line); });
  LogEffectiveConfiguration("test");
  SetLogSinkForTesting(nullptr);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("test: effective configuration"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find(" test_port=7"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find(" git_commit="), std::string::npos) << lines[0];
}

void ParseWithBadEnvironment() {
  setenv("VLM_TEST_PORT", "not-a-number", 1);
  char arg0[] = "prog";
  char* argv[] = {arg0, nullptr};
  ParseCommandLine(1, argv, "test");
}

TEST(FlagsDeathTest, ParseCommandLineExitsOnBadEnvironmentValue) {
  EXPECT_EXIT(ParseWithBadEnvironment(), testing::ExitedWithCode(1), "VLM_TEST_PORT");
}

// Last: ParseCommandLine is meant to run once per process.
TEST(FlagsTest, CommandLineWinsOverEnvironmentWhichWinsOverDefault) {
  absl::FlagSaver saver;
  setenv("VLM_TEST_PORT", "42", 1);
  setenv("VLM_TEST_NAME", "from_env", 1);
  setenv("VLM_LOG_FORMAT", "json", 1);
  char arg0[] = "prog";
  char arg1[] = "--test_port=99";
  char arg2[] = "positional";
  char* argv[] = {arg0, arg1, arg2, nullptr};
  std::vector<char*> rest = ParseCommandLine(3, argv, "test");
  unsetenv("VLM_TEST_PORT");
  unsetenv("VLM_TEST_NAME");
  unsetenv("VLM_LOG_FORMAT");

  EXPECT_EQ(absl::GetFlag(FLAGS_test_port), 99);
  EXPECT_EQ(absl::GetFlag(FLAGS_test_name), "from_env");
  EXPECT_FALSE(absl::GetFlag(FLAGS_test_enabled));
  ASSERT_EQ(rest.size(), 2u);
  EXPECT_STREQ(rest[1], "positional");

  // The logging flags were applied to the logger.
  std::vector<std::string> lines;
  SetLogSinkForTesting([&](std::string_view line) { lines.emplace_back(line); });
  LogInfo("test", "after parse");
  SetLogSinkForTesting(nullptr);
  SetLogFormat(LogFormat::kText);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].rfind("{\"ts\":", 0), 0u) << lines[0];
}

}  // namespace
}  // namespace vlm
