// vlm-bench-load: what opening a checkpoint costs. Opens a checkpoint
// directory (or file) with SafetensorsCheckpoint and prints a table: header
// parse + mmap time (median of --runs opens), tensor count, bytes, and the
// resident memory (VmRSS / VmHWM from /proc/self/status) before and after
// opening, after touching every page (with the page-in rate), after evicting
// every tensor, and after touching again (re-fault from the page cache).
//
// Usage: vlm-bench-load --checkpoint DIR [--runs 5] [--cold]   (or: vlm-bench-load DIR)
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/safetensors.h"

ABSL_FLAG(std::string, checkpoint, "", "checkpoint directory, index .json or .safetensors file");
ABSL_FLAG(int, runs, 5, "number of opens whose median time is reported");
ABSL_FLAG(bool, cold, false,
          "drop the checkpoint files from the page cache (posix_fadvise DONTNEED) before the "
          "first touch, so it measures reading from disk");

namespace vlm {
namespace {

struct Memory {
  double rss_mb = 0;  // VmRSS
  double hwm_mb = 0;  // VmHWM (peak)
};

Memory ReadMemory() {
  Memory m;
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    auto value = [&](const char* key, double* out) {
      const std::string k = key;
      if (line.compare(0, k.size(), k) != 0) return;
      int64_t kb = 0;
      std::string digits;
      for (char c : line.substr(k.size())) {
        if (c >= '0' && c <= '9') digits += c;
      }
      if (absl::SimpleAtoi(digits, &kb)) *out = kb / 1024.0;
    };
    value("VmRSS:", &m.rss_mb);
    value("VmHWM:", &m.hwm_mb);
  }
  return m;
}

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

void Row(const std::string& what, const std::string& value) {
  std::printf("| %-44s | %34s |\n", what.c_str(), value.c_str());
}

void MemoryRow(const std::string& when, const Memory& m) {
  Row("RSS " + when, absl::StrFormat("%.1f MB (peak %.1f)", m.rss_mb, m.hwm_mb));
}

// Asks the kernel to drop the file's clean cached pages.
bool DropFromPageCache(const std::string& file) {
  const int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0;
  close(fd);
  return ok;
}

int Run(const std::string& path, int runs, bool cold) {
  const Memory before = ReadMemory();
  std::vector<double> open_ms;
  for (int i = 0; i < runs; ++i) {
    const absl::Time t0 = absl::Now();
    auto ckpt = SafetensorsCheckpoint::Open(path);
    const absl::Duration d = absl::Now() - t0;
    if (!ckpt.ok()) {
      std::fprintf(stderr, "vlm-bench-load: %s\n", std::string(ckpt.status().message()).c_str());
      return 1;
    }
    open_ms.push_back(Ms(d));
  }
  std::vector<double> sorted = open_ms;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];

  auto opened = SafetensorsCheckpoint::Open(path);
  if (!opened.ok()) {
    std::fprintf(stderr, "vlm-bench-load: %s\n", std::string(opened.status().message()).c_str());
    return 1;
  }
  const SafetensorsCheckpoint& ckpt = **opened;
  const Memory after_open = ReadMemory();
  const std::vector<std::string> names = ckpt.Names();
  const double gb = ckpt.total_bytes() / 1e9;

  auto touch_all = [&](absl::Duration* d) -> bool {
    const absl::Time t0 = absl::Now();
    for (const std::string& name : names) {
      if (auto s = ckpt.Touch(name); !s.ok()) {
        std::fprintf(stderr, "vlm-bench-load: %s\n", std::string(s.message()).c_str());
        return false;
      }
    }
    *d = absl::Now() - t0;
    return true;
  };
  if (cold) {
    for (const std::string& file : ckpt.files()) {
      if (!DropFromPageCache(file)) std::fprintf(stderr, "vlm-bench-load: cannot drop %s\n", file.c_str());
    }
  }
  absl::Duration touch1, touch2;
  if (!touch_all(&touch1)) return 1;
  const Memory after_touch = ReadMemory();
  const absl::Time e0 = absl::Now();
  for (const std::string& name : names) {
    if (auto s = ckpt.Evict(name); !s.ok()) {
      std::fprintf(stderr, "vlm-bench-load: %s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  const absl::Duration evict = absl::Now() - e0;
  const Memory after_evict = ReadMemory();
  if (!touch_all(&touch2)) return 1;
  const Memory after_retouch = ReadMemory();

  std::printf("checkpoint %s (%zu file(s))\n\n", path.c_str(), ckpt.files().size());
  std::printf("| %-44s | %34s |\n|%s|%s|\n", "what", "value", std::string(46, '-').c_str(),
              std::string(36, '-').c_str());
  std::string all;
  for (double ms : open_ms) all += absl::StrFormat("%s%.2f", all.empty() ? "" : " ", ms);
  Row(absl::StrFormat("open: header parse + mmap (median of %d)", runs), absl::StrFormat("%.2f ms", median));
  Row("  each open", all + " ms");
  Row("tensors", absl::StrFormat("%zu", ckpt.size()));
  Row("tensor bytes", absl::StrFormat("%.3f GB", gb));
  MemoryRow("before open", before);
  MemoryRow("after open", after_open);
  Row(cold ? "touch every page (first, cold: from disk)" : "touch every page (first)",
      absl::StrFormat("%.0f ms, %.2f GB/s", Ms(touch1), gb / absl::ToDoubleSeconds(touch1)));
  MemoryRow("after touch", after_touch);
  Row("evict every tensor (madvise DONTNEED)", absl::StrFormat("%.0f ms", Ms(evict)));
  MemoryRow("after evict", after_evict);
  Row("touch every page again (from page cache)",
      absl::StrFormat("%.0f ms, %.2f GB/s", Ms(touch2), gb / absl::ToDoubleSeconds(touch2)));
  MemoryRow("after second touch", after_retouch);
  return 0;
}

}  // namespace
}  // namespace vlm

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Measures checkpoint open/mmap/page-in costs: vlm-bench-load --checkpoint DIR");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  std::string path = absl::GetFlag(FLAGS_checkpoint);
  if (path.empty() && rest.size() == 2) path = rest[1];
  if (path.empty() || rest.size() > 2) {
    std::fprintf(stderr, "usage: vlm-bench-load --checkpoint DIR [--runs N]\n");
    return 2;
  }
  return vlm::Run(path, std::max(1, absl::GetFlag(FLAGS_runs)), absl::GetFlag(FLAGS_cold));
}
