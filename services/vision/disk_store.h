// The embedding cache's disk tier: one integrity-checked file per key in a
// directory that survives restarts, bounded by bytes (least recently used
// first; recency survives restarts through file mtimes), written by one
// background thread. IO errors never fail a request; they are counted.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/vision/cache_key.h"

namespace vlm::vision::embedding_cache_internal {

// One file per key, "<64 hex>.emb", written as "tmp-*" then renamed:
//   [0,8)   magic "VLMEMBC\n"
//   [8,12)  format version (u32 LE)
//   [12,16) kind: 1 = entry, 2 = alias (u32 LE)
//   [16,48) the key (must match the file name)
//   [48,56) payload length (u64 LE; the file is exactly header + payload)
//   [56,88) SHA-256 of the payload
// Entry payload: created (i64 unix ns), has_pixel_key (u8), pixel key (32),
// content hash (u32 length + bytes), grid t, h, w (i64), tensor count (u32),
// then per tensor (last_hidden first): dtype (u32), rank (u32), dims (i64),
// data length (u64), data. Alias payload: the target entry's key (32); an
// alias always points at an entry file (or at nothing, once it is evicted).

class DiskStore {
 public:
  struct Loaded {
    FeaturesPtr value;
    CacheKey primary;
    std::optional<CacheKey> pixel_key;
    absl::Time created;
  };

  static absl::StatusOr<std::unique_ptr<DiskStore>> Open(const std::string& dir,
                                                         uint64_t max_bytes,
                                                         size_t max_pending_bytes);
  ~DiskStore();

  // Follows one alias. A corrupt file is deleted and counted; nullopt then.
  std::optional<Loaded> Read(const CacheKey& key);
  // Queued for the writer thread; dropped (and counted) if the queue is full.
  void WriteEntry(const CacheKey& primary, const std::optional<CacheKey>& pixel_key,
                  FeaturesPtr value, absl::Time created);
  void WriteAlias(const CacheKey& alias, const CacheKey& target);
  void Remove(const CacheKey& key);
  void Flush();
  // Counters since Open and the current size of the directory.
  struct Stats {
    uint64_t writes = 0;          // files written (entries and aliases)
    uint64_t writes_dropped = 0;  // queue full or file larger than the bound
    uint64_t evictions = 0;       // files deleted by the byte bound
    uint64_t errors = 0;          // corrupt files + IO failures
    uint64_t corrupt = 0;         // of which: files that failed verification
    uint64_t bytes = 0;
    uint64_t files = 0;
  };
  Stats GetStats() const;

 private:
  enum class Kind : uint32_t { kEntry = 1, kAlias = 2 };
  enum class ReadStatus { kOk, kMissing, kCorrupt, kIoError };
  struct Job {
    Kind kind = Kind::kEntry;
    CacheKey key;
    CacheKey target;  // aliases
    std::optional<CacheKey> pixel_key;
    FeaturesPtr value;
    absl::Time created;
    size_t pending_bytes = 0;
  };
  struct FileInfo {
    uint64_t size = 0;
    std::list<CacheKey>::iterator position;
  };

  static constexpr char kMagic[8] = {'V', 'L', 'M', 'E', 'M', 'B', 'C', '\n'};
  static constexpr uint32_t kVersion = 1;
  static constexpr size_t kHeaderSize = 88;

  DiskStore(std::string dir, uint64_t max_bytes, size_t max_pending_bytes)
      : dir_(std::move(dir)), max_bytes_(max_bytes), max_pending_bytes_(max_pending_bytes) {}

  std::string PathFor(const CacheKey& key) const { return dir_ + "/" + key.Hex() + ".emb"; }
  void Scan();
  void Enqueue(Job job);
  void WriterLoop();
  void Process(const Job& job);
  bool WriteFile(const CacheKey& key, Kind kind, const std::vector<std::string_view>& pieces);
  ReadStatus ReadFile(const CacheKey& key, Kind* kind, std::string* payload);
  bool Known(const CacheKey& key) const;
  void Touch(const CacheKey& key);
  void ForgetIfGone(const CacheKey& key);
  void Drop(const CacheKey& key, bool corrupt);
  void ForgetLocked(const CacheKey& key);
  void TrackLocked(const CacheKey& key, uint64_t size);
  void EvictLocked();

  const std::string dir_;
  const uint64_t max_bytes_;
  const size_t max_pending_bytes_;

  // Guards the index and the queue. Every rename and unlink of a "<key>.emb"
  // happens under it together with the index update, so the index always
  // matches the directory.
  mutable std::mutex mu_;
  std::list<CacheKey> lru_;  // front = most recently used
  std::unordered_map<CacheKey, FileInfo, CacheKeyHash> files_;
  uint64_t bytes_ = 0;
  uint64_t writes_ = 0;
  uint64_t writes_dropped_ = 0;
  uint64_t evictions_ = 0;
  uint64_t errors_ = 0;
  uint64_t corrupt_ = 0;

  std::deque<Job> queue_;
  size_t pending_bytes_ = 0;
  bool writing_ = false;
  bool stop_ = false;
  uint64_t tmp_counter_ = 0;
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  std::thread writer_;
};

}  // namespace vlm::vision::embedding_cache_internal
