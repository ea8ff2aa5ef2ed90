// Structured logging: one record per line on stderr, as text or JSON.
//
//   vlm::LogInfo("vision", "model loaded", {{"seconds", 1.25}, {"path", dir}});
//
// text: 2025-01-31T12:00:00.123Z INFO vision: model loaded seconds=1.25 path=/models/x
// json: {"ts":"2025-01-31T12:00:00.123Z","level":"info","component":"vision",
//        "msg":"model loaded","seconds":1.25,"path":"/models/x"}
//
// Flags: --log_format=text|json, --log_level=debug|info|warning|error (applied by
// vlm::ParseCommandLine, or set directly with SetLogFormat/SetLogLevel).
// All functions are thread-safe; a record is written with a single write(2).
#ifndef VLM_COMMON_LOG_H_
#define VLM_COMMON_LOG_H_

#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace vlm {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };
enum class LogFormat { kText, kJson };

// One key=value field. Numbers and booleans stay unquoted in JSON.
class LogField {
 public:
  LogField(std::string_view key, std::string_view value) : key_(key), value_(value) {}
  LogField(std::string_view key, const char* value) : key_(key), value_(value) {}
  LogField(std::string_view key, const std::string& value) : key_(key), value_(value) {}
  LogField(std::string_view key, bool value);
  LogField(std::string_view key, int value) : LogField(key, static_cast<long long>(value)) {}
  LogField(std::string_view key, long value) : LogField(key, static_cast<long long>(value)) {}
  LogField(std::string_view key, long long value);
  LogField(std::string_view key, unsigned value)
      : LogField(key, static_cast<unsigned long long>(value)) {}
  LogField(std::string_view key, unsigned long value)
      : LogField(key, static_cast<unsigned long long>(value)) {}
  LogField(std::string_view key, unsigned long long value);
  LogField(std::string_view key, double value);
  LogField(std::string_view key, float value) : LogField(key, static_cast<double>(value)) {}
  LogField(std::string_view key, absl::Duration value);  // as seconds

  const std::string& key() const { return key_; }
  const std::string& value() const { return value_; }
  bool is_literal() const { return literal_; }  // a JSON number or boolean

 private:
  std::string key_;
  std::string value_;
  bool literal_ = false;
};

void Log(LogLevel level, std::string_view component, std::string_view message,
         absl::Span<const LogField> fields);
inline void Log(LogLevel level, std::string_view component, std::string_view message,
                std::initializer_list<LogField> fields = {}) {
  Log(level, component, message, absl::Span<const LogField>(fields.begin(), fields.size()));
}
inline void LogDebug(std::string_view component, std::string_view message,
                     std::initializer_list<LogField> fields = {}) {
  Log(LogLevel::kDebug, component, message, fields);
}
inline void LogInfo(std::string_view component, std::string_view message,
                    std::initializer_list<LogField> fields = {}) {
  Log(LogLevel::kInfo, component, message, fields);
}
inline void LogWarning(std::string_view component, std::string_view message,
                       std::initializer_list<LogField> fields = {}) {
  Log(LogLevel::kWarning, component, message, fields);
}
inline void LogError(std::string_view component, std::string_view message,
                     std::initializer_list<LogField> fields = {}) {
  Log(LogLevel::kError, component, message, fields);
}

void SetLogFormat(LogFormat format);
void SetLogLevel(LogLevel min_level);  // records below it are dropped
bool LogEnabled(LogLevel level);
// Copies --log_format and --log_level into the logger (ParseCommandLine calls it).
void ApplyLogFlags();

// Formats one record without the trailing newline (exposed for tests).
std::string FormatLogRecord(LogFormat format, absl::Time time, LogLevel level,
                            std::string_view component, std::string_view message,
                            absl::Span<const LogField> fields);

// Replaces the stderr writer (tests); nullptr restores stderr. `sink` receives
// whole lines including the newline, serialized by the logger's lock.
void SetLogSinkForTesting(std::function<void(std::string_view line)> sink);

// Flag value parsing (absl flags custom types).
bool AbslParseFlag(absl::string_view text, LogFormat* format, std::string* error);
std::string AbslUnparseFlag(LogFormat format);
bool AbslParseFlag(absl::string_view text, LogLevel* level, std::string* error);
std::string AbslUnparseFlag(LogLevel level);

}  // namespace vlm

#endif  // VLM_COMMON_LOG_H_
