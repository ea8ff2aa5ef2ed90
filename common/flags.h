// Command-line flags (abseil) with environment overrides.
//
// Every flag --foo_bar of the program can also be set with the environment
// variable VLM_FOO_BAR; the command line wins over the environment, which wins
// over the default. Flags defined by abseil itself (--flagfile, --help, ...) are
// not taken from the environment.
//
//   int main(int argc, char** argv) {
//     std::vector<char*> args = vlm::ParseCommandLine(argc, argv, "serves the ViT");
//     vlm::LogEffectiveConfiguration("vision");
//     ...
#ifndef VLM_COMMON_FLAGS_H_
#define VLM_COMMON_FLAGS_H_

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace vlm {

// Applies environment overrides, parses argv (exits with a message on a bad
// flag or environment value, prints usage on --help), applies the logging
// flags, and returns the positional arguments (argv[0] first).
// Call once, from main(), before starting threads.
std::vector<char*> ParseCommandLine(int argc, char** argv, std::string_view usage);

// "foo_bar" -> "VLM_FOO_BAR".
std::string EnvVarForFlag(std::string_view flag_name);

// Looks an environment variable up; nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
std::optional<std::string> GetEnv(const std::string& name);

// Sets every program flag whose VLM_ variable is set in `env`. Runs before the
// command line is parsed, so that the command line wins (ParseCommandLine does
// both). InvalidArgument names the variable and the flag when a value does not
// parse. Returns the applied (flag name, value)
// pairs through `applied` when non-null.
absl::Status ApplyEnvironmentOverrides(const EnvLookup& env = GetEnv,
                                       std::vector<std::pair<std::string, std::string>>* applied = nullptr);

// The program's flags (abseil's own excluded) as sorted (name, current value).
std::vector<std::pair<std::string, std::string>> EffectiveConfiguration();

// Logs EffectiveConfiguration() as one INFO record "effective configuration"
// with one field per flag.
void LogEffectiveConfiguration(std::string_view component);

}  // namespace vlm

#endif  // VLM_COMMON_FLAGS_H_
