// Stop strings over streamed text: text that could still be the start of a
// stop string is held back until it can no longer match, and nothing from the
// first occurrence of a stop string on is ever released.
//
//   StopStringMatcher stops({"\n\nUser:", "###"});
//   for each text delta d:  StopStringMatcher::Step s = stops.Push(d);
//                           send(s.text); if (s.stopped) break;
//   at the end (no stop):   send(stops.Flush());
//
// Matching is on bytes of UTF-8 text; since stop strings and deltas are whole
// UTF-8 characters, released text always ends on a character boundary. When
// several stop strings occur, the one that starts first wins. Not thread-safe.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace vlm::language {

inline constexpr int kMaxStopStrings = 16;
inline constexpr size_t kMaxStopStringBytes = 256;

// INVALID_ARGUMENT naming `field` ("params.stop[2] is empty") for an empty or
// invalid-UTF-8 stop string, more than kMaxStopStrings strings, or one longer
// than kMaxStopStringBytes.
absl::Status ValidateStopStrings(const std::vector<std::string>& stops,
                                 const std::string& field = "stop");

class StopStringMatcher {
 public:
  // Empty strings in `stops` are ignored.
  explicit StopStringMatcher(std::vector<std::string> stops);

  struct Step {
    std::string text;      // safe to release now
    bool stopped = false;  // a stop string was found; `text` ends right before it
    int stop_index = -1;   // which stop string (index into the constructor's list)
  };

  // Appends `delta` to the stream. After a stop, further calls return nothing.
  Step Push(absl::string_view delta);
  // End of the stream without a stop: releases the held-back text.
  std::string Flush();

  bool stopped() const { return stopped_; }
  size_t held_bytes() const { return held_.size(); }
  bool empty() const { return stops_.empty(); }

 private:
  std::vector<std::string> stops_;
  std::vector<int> original_index_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace vlm::language
