#include "services/language/sampling/stop_strings.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/language/text/utf8.h"

namespace vlm::language {

absl::Status ValidateStopStrings(const std::vector<std::string>& stops, const std::string& field) {
  if (stops.size() > static_cast<size_t>(kMaxStopStrings)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has ", stops.size(),
                                                   " strings; at most ", kMaxStopStrings,
                                                   " are allowed"));
  }
  for (size_t i = 0; i < stops.size(); ++i) {
    const std::string name = absl::StrCat(field, "[", i, "]");
    if (stops[i].empty()) return absl::InvalidArgumentError(absl::StrCat(name, " is empty"));
    if (stops[i].size() > kMaxStopStringBytes) {
      return absl::InvalidArgumentError(absl::StrCat(name, " is ", stops[i].size(),
                                                     " bytes; at most ", kMaxStopStringBytes,
                                                     " are allowed"));
    }
    if (absl::Status s = utf8::Validate(stops[i], name); !s.ok()) return s;
  }
  return absl::OkStatus();
}

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops) {
  for (size_t i = 0; i < stops.size(); ++i) {
    if (stops[i].empty()) continue;
    stops_.push_back(std::move(stops[i]));
    original_index_.push_back(static_cast<int>(i));
  }
}

StopStringMatcher::Step StopStringMatcher::Push(absl::string_view delta) {
  Step step;
  if (stopped_) return step;
  if (stops_.empty()) {
    step.text = std::string(delta);
    return step;
  }
  // Every occurrence that starts in released text was ruled out when that
  // text was released, so it is enough to search the held text + delta.
  held_.append(delta.data(), delta.size());
  const absl::string_view text(held_);
  size_t first = absl::string_view::npos;
  int which = -1;
  for (size_t k = 0; k < stops_.size(); ++k) {
    const size_t pos = text.find(stops_[k]);
    if (pos < first) {
      first = pos;
      which = static_cast<int>(k);
    }
  }
  if (which >= 0) {
    step.text = held_.substr(0, first);
    step.stopped = true;
    step.stop_index = original_index_[which];
    stopped_ = true;
    held_.clear();
    return step;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const std::string& stop : stops_) {
    const size_t longest = std::min(stop.size() - 1, text.size());
    for (size_t n = longest; n > hold; --n) {
      if (text.substr(text.size() - n) == absl::string_view(stop).substr(0, n)) {
        hold = n;
        break;
      }
    }
  }
  step.text = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return step;
}

std::string StopStringMatcher::Flush() {
  if (stopped_) return {};
  std::string out;
  out.swap(held_);
  return out;
}

}  // namespace vlm::language
