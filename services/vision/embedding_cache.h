// The vision encoder's content-addressed cache of pre-projector ViT features.
//
// Two tiers: an in-memory LRU (bounded by bytes and by entries, with a TTL) and
// an optional directory on disk that survives restarts (bounded by bytes, every
// file integrity-checked with SHA-256; a corrupt file is deleted, counted and
// never served). Concurrent misses on one key compute once ("single flight").
//
// Keys (all SHA-256, see the Key* functions below):
//   bytes key  = H(content hash of the encoded image, options, model fingerprint)
//   pixel key  = H(decoded RGB pixels, width, height, options, model fingerprint)
// The bytes key is derived from the content hash, so a request that carries only
// a content hash of bytes sent earlier looks up the same entry (Lookup). The
// pixel key lets the same picture sent in another container format hit: the
// compute callable decodes, computes the pixel key and asks the PixelKeyProbe
// before running the ViT.
//
// Thread-safety: every public method of EmbeddingCache may be called
// concurrently. Values are immutable and shared (FeaturesPtr): readers never
// copy feature buffers, and a value stays valid after its entry is evicted.
// Disk writes are asynchronous (one writer thread); disk IO errors never fail a
// request, they are counted. One process per disk directory.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/vision/cache_key.h"

namespace vlm::vision {

// ----------------------------------------------------------------------------
// The cache

struct CacheResult {
  FeaturesPtr features;
  CacheLevel level = CacheLevel::kMiss;
  // True if another caller's computation (or disk read) produced the value and
  // this caller waited for it; `level` is then that computation's level.
  bool coalesced = false;
};

// How long a caller is willing to wait for another caller's computation.
// `deadline` is wall-clock time (absl::Now), like a gRPC deadline.
// `is_cancelled` (optional) is polled every 20 ms while waiting, under the
// cache's lock: it must be cheap and must not call into the cache.
struct WaitOptions {
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> is_cancelled;
};

struct EmbeddingCacheOptions {
  // Memory tier. Bytes are CachedFeatures::ByteSize() plus a small fixed
  // overhead per entry and per key. A value larger than max_bytes is returned
  // but not kept in memory; max_entries = 0 disables the memory tier.
  size_t max_bytes = size_t{1} << 30;
  size_t max_entries = 4096;
  // Age after which an entry is a miss at every tier and is removed; measured
  // from when it was computed, with `clock`. InfiniteDuration = never.
  absl::Duration ttl = absl::InfiniteDuration();

  // Disk tier: a directory (created if missing) that survives restarts; empty
  // disables it. Bounded by the total size of its files; least recently used
  // files go first (recency survives restarts through file mtimes).
  std::string disk_dir;
  uint64_t disk_max_bytes = uint64_t{10} << 30;
  // Values queued for the background writer; past this, writes are dropped
  // (counted in disk_writes_dropped) rather than holding memory.
  size_t disk_max_pending_bytes = size_t{512} << 20;

  // Time source for TTLs (tests inject a fake); empty = absl::Now.
  std::function<absl::Time()> clock;
};

// Counters are totals since construction; gauges are current values.
struct EmbeddingCacheStats {
  uint64_t memory_hits = 0;       // the asked key was in memory
  uint64_t pixel_hits = 0;        // found by the decoded pixels' key
  uint64_t disk_hits = 0;         // read from the disk tier
  uint64_t misses = 0;            // computed
  uint64_t coalesced = 0;         // waited for another caller's flight
  uint64_t not_found = 0;         // Lookup found nothing
  uint64_t compute_failures = 0;  // compute returned an error (not cached)
  uint64_t wait_aborts = 0;       // a waiter's deadline passed or it was cancelled
  uint64_t evictions = 0;         // memory entries dropped by the LRU bounds
  uint64_t expirations = 0;       // entries dropped by the TTL (either tier)
  uint64_t memory_bytes = 0;      // gauge
  uint64_t memory_entries = 0;    // gauge
  uint64_t inflight = 0;          // gauge: computations running now
  uint64_t waiting = 0;           // gauge: callers waiting for one of them

  uint64_t disk_writes = 0;          // files written (entries and aliases)
  uint64_t disk_writes_dropped = 0;  // queue full or file larger than the bound
  uint64_t disk_evictions = 0;       // files deleted by the byte bound
  uint64_t disk_errors = 0;          // corrupt files + IO failures
  uint64_t disk_corrupt = 0;         // of which: files that failed verification
  uint64_t disk_bytes = 0;           // gauge
  uint64_t disk_files = 0;           // gauge
};

namespace embedding_cache_internal {
struct Flight;
class DiskStore;
}  // namespace embedding_cache_internal

class EmbeddingCache;

// Handed to a compute callable so that, after decoding, it can ask whether the
// same pixels are already cached (or being computed by another request):
//
//   cache.GetOrCompute(bytes_key, [&](PixelKeyProbe& probe) -> StatusOr<FeaturesPtr> {
//     ASSIGN_OR_RETURN(Image image, Decode(bytes));
//     ASSIGN_OR_RETURN(FeaturesPtr hit, probe.Find(KeyForPixels(image.rgb, ...)));
//     if (hit) return hit;             // the cache links bytes_key to it
//     return std::make_shared<CachedFeatures>(RunVit(image));
//   });
class PixelKeyProbe {
 public:
  // Returns the cached features for `pixel_key` (memory, then disk), nullptr on
  // a miss, or the waiter's DEADLINE_EXCEEDED/CANCELLED. If another flight is
  // computing the same pixels, waits for it. On a miss the key is attached to
  // the value the callable returns. Call at most once (FAILED_PRECONDITION).
  absl::StatusOr<FeaturesPtr> Find(const CacheKey& pixel_key);

 private:
  friend class EmbeddingCache;
  PixelKeyProbe(EmbeddingCache* cache, std::shared_ptr<embedding_cache_internal::Flight> flight,
                const WaitOptions* wait)
      : cache_(cache), flight_(std::move(flight)), wait_(wait) {}

  EmbeddingCache* cache_;
  std::shared_ptr<embedding_cache_internal::Flight> flight_;
  const WaitOptions* wait_;
  bool used_ = false;
  std::optional<CacheKey> key_;
  FeaturesPtr hit_;
  CacheLevel hit_level_ = CacheLevel::kMiss;
};

// Runs on a miss, in the calling thread, without cache locks held. Returns the
// probe's hit or a new value; must not call back into this cache except through
// the probe. An error is returned to the caller and not cached.
using ComputeFn = std::function<absl::StatusOr<FeaturesPtr>(PixelKeyProbe&)>;

class EmbeddingCache {
 public:
  // Fails if the disk directory cannot be created or written.
  static absl::StatusOr<std::unique_ptr<EmbeddingCache>> Create(EmbeddingCacheOptions options);
  // Finishes queued disk writes. No call may be running.
  ~EmbeddingCache();

  EmbeddingCache(const EmbeddingCache&) = delete;
  EmbeddingCache& operator=(const EmbeddingCache&) = delete;

  // Memory, then a flight in progress (waits), then disk, then `compute`.
  //
  // Failures: a compute error is returned to this caller and to every caller
  // waiting on the same flight, because it describes the input (a bad image
  // fails the same way for all). Exception: CANCELLED and DEADLINE_EXCEEDED
  // describe the computing caller's own request, so waiters retry instead (one
  // of them computes). A waiter whose own deadline passes or who is cancelled
  // gets DEADLINE_EXCEEDED / CANCELLED; the flight goes on for the others.
  absl::StatusOr<CacheResult> GetOrCompute(const CacheKey& bytes_key, const ComputeFn& compute,
                                           const WaitOptions& wait = {});

  // Memory, then a flight in progress (waits), then disk; NOT_FOUND if the key
  // is in none of them. For requests that carry only a content hash
  // (KeyForContentHash); works with any key.
  absl::StatusOr<CacheResult> Lookup(const CacheKey& key, const WaitOptions& wait = {});

  EmbeddingCacheStats Stats() const;

  // Blocks until every disk write queued so far is on disk (tests, shutdown).
  void FlushDiskWrites();

  const EmbeddingCacheOptions& options() const { return options_; }

 private:
  friend class PixelKeyProbe;
  using Flight = embedding_cache_internal::Flight;

  struct Node {
    FeaturesPtr value;
    CacheKey primary;  // the key its disk file is named by
    std::optional<CacheKey> pixel_key;
    std::vector<CacheKey> keys;  // every key that points here (primary first)
    size_t bytes = 0;            // value + entry overhead (keys counted apart)
    absl::Time created;
    absl::Time expires;
  };
  using NodeList = std::list<Node>;  // front = most recently used

  explicit EmbeddingCache(EmbeddingCacheOptions options);

  absl::Time Now() const { return options_.clock(); }
  bool Expired(absl::Time created, absl::Time now) const;

  // Everything *Locked runs with mu_ held.
  Node* FindLocked(const CacheKey& key, absl::Time now);
  Node* InsertLocked(FeaturesPtr value, const CacheKey& primary,
                     const std::optional<CacheKey>& pixel_key, absl::Time created);
  void LinkLocked(const CacheKey& key, NodeList::iterator node);
  void RemoveLocked(NodeList::iterator node);
  void EvictLocked();
  absl::Status WaitLocked(std::unique_lock<std::mutex>& lock, Flight& flight,
                          const WaitOptions& wait);
  // Single flight: the value of `key` from memory, else from a flight in
  // progress (waiting for it; `own`, the caller's own flight, is not waited
  // for), else kNowhere. A waiter's deadline or cancellation is the error; a
  // failed flight is returned as the error when `failures_are_final` and it
  // describes the image, else the search starts again.
  struct Joined {
    enum From { kNowhere, kMemory, kFlight } from = kNowhere;
    FeaturesPtr value;
    CacheLevel level = CacheLevel::kMemory;
  };
  absl::StatusOr<Joined> FindOrJoinLocked(std::unique_lock<std::mutex>& lock, const CacheKey& key,
                                          const WaitOptions& wait, const Flight* own,
                                          bool failures_are_final);
  // The caller's result for a memory hit or a joined flight (counted), nullopt
  // for kNowhere.
  std::optional<CacheResult> CountJoinedLocked(const Joined& joined);
  void FinishFlightLocked(Flight& flight, absl::Status status, FeaturesPtr value,
                          CacheLevel level);

  // Reads `key` from disk (following an alias), drops it if expired, and
  // puts it in memory under `key` too. nullptr on a miss.
  FeaturesPtr ReadDiskAndPromote(const CacheKey& key);
  // Links `key` to the node holding `value` (found through `via`), in memory
  // and on disk.
  void AliasLocked(const CacheKey& key, const CacheKey& via, const FeaturesPtr& value);

  const EmbeddingCacheOptions options_;
  std::unique_ptr<embedding_cache_internal::DiskStore> disk_;

  mutable std::mutex mu_;
  NodeList lru_;
  std::unordered_map<CacheKey, NodeList::iterator, CacheKeyHash> index_;
  std::unordered_map<CacheKey, std::shared_ptr<Flight>, CacheKeyHash> flights_;
  size_t bytes_ = 0;
  EmbeddingCacheStats stats_;  // the non-disk counters
};

}  // namespace vlm::vision
