// Reading samples out of the Prometheus text format, for tests.
#ifndef VLM_TESTS_UNIT_METRICS_TEXT_H_
#define VLM_TESTS_UNIT_METRICS_TEXT_H_

#include <optional>
#include <string>
#include <string_view>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace vlm::metrics_text {

// The first sample line for `key`: a bare metric name (any labels), or a name
// with its labels exactly as printed, e.g. vlm_model_load_seconds{phase="x"}.
inline std::string MetricLine(std::string_view text, std::string_view key) {
  const bool with_labels = key.find('{') != std::string_view::npos;
  for (absl::string_view line : absl::StrSplit(absl::string_view(text.data(), text.size()), '\n')) {
    if (line.empty() || line[0] == '#') continue;
    // Label values may hold spaces: match the key, then the separator after it.
    const size_t name_end = with_labels ? key.size() : line.find_first_of("{ ");
    if (name_end == absl::string_view::npos || name_end >= line.size()) continue;
    if (line.substr(0, name_end) == absl::string_view(key.data(), key.size()) &&
        (line[name_end] == ' ' || (!with_labels && line[name_end] == '{'))) {
      return std::string(line);
    }
  }
  return "";
}

inline std::optional<double> MetricValue(std::string_view text, std::string_view key) {
  const std::string line = MetricLine(text, key);
  const size_t space = line.rfind(' ');
  double value = 0;
  if (line.empty() || space == std::string::npos ||
      !absl::SimpleAtod(absl::string_view(line).substr(space + 1), &value)) {
    return std::nullopt;
  }
  return value;
}

}  // namespace vlm::metrics_text

#endif  // VLM_TESTS_UNIT_METRICS_TEXT_H_
