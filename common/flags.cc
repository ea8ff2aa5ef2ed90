#include "common/flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/build_info.h"
#include "common/log.h"

namespace vlm {
namespace {

// Flags defined inside abseil (--flagfile, --help*, --version, ...) are not
// program configuration.
bool IsAbseilFlag(const absl::CommandLineFlag& flag) {
  const std::string file = flag.Filename();
  return absl::StartsWith(file, "absl/") || absl::StrContains(file, "/absl/");
}

template <typename Fn>
void ForEachProgramFlag(Fn fn) {
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (flag->IsRetired() || IsAbseilFlag(*flag)) continue;
    fn(*flag);
  }
}

// Names of the flags written in argv ("--name=v", "-name v", "--noname"), for
// the log only; --flagfile contents are not looked at.
std::set<std::string> FlagNamesInArgv(int argc, char** argv) {
  std::set<std::string> names;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "-")) continue;
    absl::ConsumePrefix(&arg, "-");
    arg = arg.substr(0, arg.find('='));
    names.insert(std::string(arg));
    if (absl::ConsumePrefix(&arg, "no")) names.insert(std::string(arg));
  }
  return names;
}

}  // namespace

std::string EnvVarForFlag(std::string_view flag_name) {
  std::string var = "VLM_";
  for (char c : flag_name) {
    var.push_back(c == '-' ? '_' : absl::ascii_toupper(static_cast<unsigned char>(c)));
  }
  return var;
}

std::optional<std::string> GetEnv(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

absl::Status ApplyEnvironmentOverrides(const EnvLookup& env,
                                       std::vector<std::pair<std::string, std::string>>* applied) {
  // Sorted by name so that errors and the applied list are deterministic.
  std::vector<absl::CommandLineFlag*> flags;
  ForEachProgramFlag([&](absl::CommandLineFlag& flag) { flags.push_back(&flag); });
  std::sort(flags.begin(), flags.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  for (absl::CommandLineFlag* flag : flags) {
    const std::string name(flag->Name());
    const std::string var = EnvVarForFlag(name);
    std::optional<std::string> value = env(var);
    if (!value.has_value()) continue;
    std::string error;
    if (!flag->ParseFrom(*value, &error)) {
      return absl::InvalidArgumentError(absl::StrCat("environment variable ", var, "=\"", *value,
                                                     "\" is not a valid --", name, ": ", error));
    }
    if (applied != nullptr) applied->emplace_back(name, *value);
  }
  return absl::OkStatus();
}

std::vector<char*> ParseCommandLine(int argc, char** argv, std::string_view usage) {
  static bool usage_set = false;  // abseil exits if the usage message is set twice
  if (!usage_set) {
    usage_set = true;
    absl::SetProgramUsageMessage(absl::string_view(usage.data(), usage.size()));
    absl::FlagsUsageConfig config;
    config.version_string = [] {
      const BuildInfo& info = GetBuildInfo();
      return absl::StrCat("vlm ", info.version, " (git ", info.git_commit, ", ", info.compiler,
                          ")\n");
    };
    absl::SetFlagsUsageConfig(config);
  }
  std::vector<std::pair<std::string, std::string>> applied;
  absl::Status env_status = ApplyEnvironmentOverrides(GetEnv, &applied);
  if (!env_status.ok()) {
    std::fprintf(stderr, "%s: %s\n", argc > 0 ? argv[0] : "vlm",
                 std::string(env_status.message()).c_str());
    std::exit(1);
  }
  // Environment values are in place; the command line now overrides them.
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  ApplyLogFlags();
  const std::set<std::string> given = FlagNamesInArgv(argc, argv);
  for (const auto& [name, value] : applied) {
    if (given.count(name)) {
      LogInfo("flags", "command line overrides environment", {{"variable", EnvVarForFlag(name)}});
    }
  }
  return positional;
}

std::vector<std::pair<std::string, std::string>> EffectiveConfiguration() {
  std::vector<std::pair<std::string, std::string>> config;
  ForEachProgramFlag([&](absl::CommandLineFlag& flag) {
    config.emplace_back(std::string(flag.Name()), flag.CurrentValue());
  });
  std::sort(config.begin(), config.end());
  return config;
}

void LogEffectiveConfiguration(std::string_view component) {
  std::vector<LogField> fields;
  for (const auto& [name, value] : EffectiveConfiguration()) fields.emplace_back(name, value);
  const BuildInfo& info = GetBuildInfo();
  fields.emplace_back("version", info.version);
  fields.emplace_back("git_commit", info.git_commit);
  Log(LogLevel::kInfo, component, "effective configuration", fields);
}

}  // namespace vlm
