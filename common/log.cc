#include "common/log.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"

ABSL_FLAG(vlm::LogFormat, log_format, vlm::LogFormat::kText,
          "log record format: text (human) or json (one object per line)");
ABSL_FLAG(vlm::LogLevel, log_level, vlm::LogLevel::kInfo,
          "minimum log level: debug, info, warning or error");

namespace vlm {
namespace {

std::atomic<LogFormat> g_format{LogFormat::kText};
std::atomic<int> g_min_level{static_cast<int>(LogLevel::kInfo)};

struct Output {
  absl::Mutex mu;
  std::function<void(std::string_view)> sink ABSL_GUARDED_BY(mu);
};
Output& GetOutput() {
  static Output* output = new Output();  // never destroyed: logging works during exit
  return *output;
}

void WriteAll(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
}

// Escapes for a JSON string body; also used for quoted text values, so that a
// record never spans two lines.
void AppendEscaped(std::string* out, std::string_view s) {
  for (char c : s) {
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
          absl::StrAppendFormat(out, "\\u%04x", static_cast<unsigned char>(c));
        } else {
          out->push_back(c);
        }
    }
  }
}

// For the bare parts of a text record: only control bytes are escaped.
void AppendLineSafe(std::string* out, std::string_view s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      AppendEscaped(out, std::string_view(&c, 1));
    } else {
      out->push_back(c);
    }
  }
}

void AppendJsonString(std::string* out, std::string_view s) {
  out->push_back('"');
  AppendEscaped(out, s);
  out->push_back('"');
}

// Text values are bare unless empty or containing space, quote, '=' or control bytes.
void AppendTextValue(std::string* out, std::string_view s) {
  bool bare = !s.empty();
  for (char c : s) {
    if (c == ' ' || c == '"' || c == '=' || c == '\\' || static_cast<unsigned char>(c) < 0x20 ||
        c == 0x7f) {
      bare = false;
      break;
    }
  }
  if (bare) {
    out->append(s);
  } else {
    AppendJsonString(out, s);
  }
}

const char* TextLevel(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kWarning: return "WARN";
    case LogLevel::kError: return "ERROR";
  }
  return "?";
}

}  // namespace

LogField::LogField(std::string_view key, bool value)
    : key_(key), value_(value ? "true" : "false"), literal_(true) {}
LogField::LogField(std::string_view key, long long value)
    : key_(key), value_(absl::StrCat(value)), literal_(true) {}
LogField::LogField(std::string_view key, unsigned long long value)
    : key_(key), value_(absl::StrCat(value)), literal_(true) {}
LogField::LogField(std::string_view key, double value) : key_(key) {
  value_ = absl::StrFormat("%.6g", value);
  literal_ = std::isfinite(value);  // JSON has no NaN or Inf: those stay strings
}
LogField::LogField(std::string_view key, absl::Duration value)
    : LogField(key, absl::ToDoubleSeconds(value)) {}

std::string FormatLogRecord(LogFormat format, absl::Time time, LogLevel level,
                            std::string_view component, std::string_view message,
                            absl::Span<const LogField> fields) {
  const std::string ts = absl::FormatTime("%Y-%m-%d%ET%H:%M:%E3SZ", time, absl::UTCTimeZone());
  std::string out;
  out.reserve(64 + message.size() + fields.size() * 24);
  if (format == LogFormat::kJson) {
    absl::StrAppend(&out, "{\"ts\":\"", ts, "\",\"level\":\"", AbslUnparseFlag(level),
                    "\",\"component\":");
    AppendJsonString(&out, component);
    out.append(",\"msg\":");
    AppendJsonString(&out, message);
    for (const LogField& f : fields) {
      out.push_back(',');
      AppendJsonString(&out, f.key());
      out.push_back(':');
      if (f.is_literal()) {
        out.append(f.value());
      } else {
        AppendJsonString(&out, f.value());
      }
    }
    out.push_back('}');
    return out;
  }
  absl::StrAppend(&out, ts, " ", TextLevel(level), " ");
  AppendLineSafe(&out, component);
  out.append(": ");
  AppendLineSafe(&out, message);
  for (const LogField& f : fields) {
    out.push_back(' ');
    AppendLineSafe(&out, f.key());
    out.push_back('=');
    AppendTextValue(&out, f.value());
  }
  return out;
}

void Log(LogLevel level, std::string_view component, std::string_view message,
         absl::Span<const LogField> fields) {
  if (!LogEnabled(level)) return;
  std::string line = FormatLogRecord(g_format.load(std::memory_order_relaxed), absl::Now(), level,
                                     component, message, fields);
  line.push_back('\n');
  Output& output = GetOutput();
  absl::MutexLock lock(&output.mu);
  if (output.sink) {
    output.sink(line);
  } else {
    WriteAll(STDERR_FILENO, line);
  }
}

void SetLogFormat(LogFormat format) { g_format.store(format, std::memory_order_relaxed); }
void SetLogLevel(LogLevel min_level) {
  g_min_level.store(static_cast<int>(min_level), std::memory_order_relaxed);
}
bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) >= g_min_level.load(std::memory_order_relaxed);
}

void ApplyLogFlags() {
  SetLogFormat(absl::GetFlag(FLAGS_log_format));
  SetLogLevel(absl::GetFlag(FLAGS_log_level));
}

void SetLogSinkForTesting(std::function<void(std::string_view line)> sink) {
  Output& output = GetOutput();
  absl::MutexLock lock(&output.mu);
  output.sink = std::move(sink);
}

bool AbslParseFlag(absl::string_view text, LogFormat* format, std::string* error) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "text") {
    *format = LogFormat::kText;
  } else if (t == "json") {
    *format = LogFormat::kJson;
  } else {
    *error = "must be text or json";
    return false;
  }
  return true;
}

std::string AbslUnparseFlag(LogFormat format) {
  return format == LogFormat::kJson ? "json" : "text";
}

bool AbslParseFlag(absl::string_view text, LogLevel* level, std::string* error) {
  const std::string t = absl::AsciiStrToLower(text);
  if (t == "debug") {
    *level = LogLevel::kDebug;
  } else if (t == "info") {
    *level = LogLevel::kInfo;
  } else if (t == "warning" || t == "warn") {
    *level = LogLevel::kWarning;
  } else if (t == "error") {
    *level = LogLevel::kError;
  } else {
    *error = "must be debug, info, warning or error";
    return false;
  }
  return true;
}

std::string AbslUnparseFlag(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
  }
  return "info";
}

}  // namespace vlm
