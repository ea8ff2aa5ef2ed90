#include "services/vision/embedding_cache.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/vision/disk_store.h"

namespace vlm::vision {
namespace {

// Memory accounting beyond the value itself: list node, index slots, flight
// bookkeeping. Rough but fixed, so bounds stay predictable.
constexpr size_t kEntryOverheadBytes = 256;
constexpr size_t kKeyOverheadBytes = 96;
// Aliases (other containers of one picture) per entry; more are not linked.
constexpr size_t kMaxKeysPerEntry = 16;
constexpr absl::Duration kCancelPollInterval = absl::Milliseconds(20);

// Waiters retry after these: they describe the computing caller's request,
// not the image.
bool IsCallerSpecific(const absl::Status& status) {
  return absl::IsCancelled(status) || absl::IsDeadlineExceeded(status);
}

}  // namespace

namespace embedding_cache_internal {

// One computation (or disk read) in progress, registered in flights_ under the
// bytes key and, once probed, the pixel key. Fields are guarded by the cache's
// mutex; waiters sleep on `cv` with that mutex.
struct Flight {
  std::vector<CacheKey> keys;
  bool done = false;
  absl::Status status;
  FeaturesPtr value;
  CacheLevel level = CacheLevel::kMiss;
  std::condition_variable cv;
};

}  // namespace embedding_cache_internal

// ----------------------------------------------------------------------------
// The cache

using embedding_cache_internal::DiskStore;

absl::StatusOr<std::unique_ptr<EmbeddingCache>> EmbeddingCache::Create(
    EmbeddingCacheOptions options) {
  if (!options.clock) options.clock = [] { return absl::Now(); };
  if (options.ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("embedding cache: ttl must be positive (or infinite)");
  }
  std::unique_ptr<DiskStore> disk;
  if (!options.disk_dir.empty()) {
    absl::StatusOr<std::unique_ptr<DiskStore>> opened =
        DiskStore::Open(options.disk_dir, options.disk_max_bytes, options.disk_max_pending_bytes);
    if (!opened.ok()) return opened.status();
    disk = *std::move(opened);
  }
  std::unique_ptr<EmbeddingCache> cache(new EmbeddingCache(std::move(options)));
  cache->disk_ = std::move(disk);
  return cache;
}

EmbeddingCache::EmbeddingCache(EmbeddingCacheOptions options) : options_(std::move(options)) {}

EmbeddingCache::~EmbeddingCache() = default;  // DiskStore drains its queue

bool EmbeddingCache::Expired(absl::Time created, absl::Time now) const {
  return options_.ttl != absl::InfiniteDuration() && now - created >= options_.ttl;
}

EmbeddingCache::Node* EmbeddingCache::FindLocked(const CacheKey& key, absl::Time now) {
  auto it = index_.find(key);
  if (it == index_.end()) return nullptr;
  NodeList::iterator node = it->second;
  if (Expired(node->created, now)) {
    RemoveLocked(node);
    ++stats_.expirations;
    return nullptr;
  }
  lru_.splice(lru_.begin(), lru_, node);
  return &*node;
}

void EmbeddingCache::LinkLocked(const CacheKey& key, NodeList::iterator node) {
  auto it = index_.find(key);
  if (it != index_.end()) {
    if (it->second == node) return;
    if (node->keys.size() >= kMaxKeysPerEntry) return;
    // The key moves to the newer node; an older node left without keys goes.
    NodeList::iterator old = it->second;
    old->keys.erase(std::find(old->keys.begin(), old->keys.end(), key));
    bytes_ -= kKeyOverheadBytes;
    index_.erase(it);
    if (old->keys.empty()) RemoveLocked(old);
  } else if (node->keys.size() >= kMaxKeysPerEntry) {
    return;
  }
  index_.emplace(key, node);
  node->keys.push_back(key);
  bytes_ += kKeyOverheadBytes;
}

void EmbeddingCache::RemoveLocked(NodeList::iterator node) {
  for (const CacheKey& key : node->keys) index_.erase(key);
  bytes_ -= node->bytes + node->keys.size() * kKeyOverheadBytes;
  lru_.erase(node);
}

// Never evicts the front node: whoever just inserted or touched it holds it,
// and it fits alone (InsertLocked checks).
void EmbeddingCache::EvictLocked() {
  while ((bytes_ > options_.max_bytes || lru_.size() > options_.max_entries) && lru_.size() > 1) {
    RemoveLocked(std::prev(lru_.end()));
    ++stats_.evictions;
  }
}

EmbeddingCache::Node* EmbeddingCache::InsertLocked(FeaturesPtr value, const CacheKey& primary,
                                                   const std::optional<CacheKey>& pixel_key,
                                                   absl::Time created) {
  const size_t bytes = value->ByteSize() + kEntryOverheadBytes;
  if (options_.max_entries == 0 || bytes + kMaxKeysPerEntry * kKeyOverheadBytes > options_.max_bytes) {
    return nullptr;
  }
  Node fresh;
  fresh.value = std::move(value);
  fresh.primary = primary;
  fresh.pixel_key = pixel_key;
  fresh.bytes = bytes;
  fresh.created = created;
  lru_.push_front(std::move(fresh));
  bytes_ += bytes;
  LinkLocked(primary, lru_.begin());
  if (pixel_key) LinkLocked(*pixel_key, lru_.begin());
  EvictLocked();
  return &lru_.front();
}

absl::Status EmbeddingCache::WaitLocked(std::unique_lock<std::mutex>& lock, Flight& flight,
                                        const WaitOptions& wait) {
  ++stats_.waiting;
  struct Done {
    uint64_t& waiting;
    ~Done() { --waiting; }
  } done{stats_.waiting};
  while (!flight.done) {
    if (wait.is_cancelled && wait.is_cancelled()) {
      ++stats_.wait_aborts;
      return absl::CancelledError("cancelled while waiting for the same image's encode");
    }
    const absl::Time now = absl::Now();
    if (now >= wait.deadline) {
      ++stats_.wait_aborts;
      return absl::DeadlineExceededError("deadline passed while waiting for the same image's encode");
    }
    absl::Time until = wait.deadline;
    if (wait.is_cancelled) until = std::min(until, now + kCancelPollInterval);
    if (until == absl::InfiniteFuture()) {
      flight.cv.wait(lock);
    } else {
      flight.cv.wait_until(lock, absl::ToChronoTime(std::min(until, now + absl::Hours(1))));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<EmbeddingCache::Joined> EmbeddingCache::FindOrJoinLocked(
    std::unique_lock<std::mutex>& lock, const CacheKey& key, const WaitOptions& wait,
    const Flight* own, bool failures_are_final) {
  while (true) {
    if (Node* node = FindLocked(key, Now())) return Joined{Joined::kMemory, node->value};
    auto it = flights_.find(key);
    if (it == flights_.end() || it->second.get() == own) return Joined{};
    std::shared_ptr<Flight> other = it->second;
    if (absl::Status waited = WaitLocked(lock, *other, wait); !waited.ok()) return waited;
    if (other->status.ok()) return Joined{Joined::kFlight, other->value, other->level};
    if (failures_are_final && !IsCallerSpecific(other->status)) return other->status;
    // That flight failed and is gone (or its caller gave up): look again,
    // perhaps to become the one computing.
  }
}

std::optional<CacheResult> EmbeddingCache::CountJoinedLocked(const Joined& joined) {
  switch (joined.from) {
    case Joined::kNowhere:
      return std::nullopt;
    case Joined::kMemory:
      ++stats_.memory_hits;
      return CacheResult{joined.value, CacheLevel::kMemory, false};
    case Joined::kFlight:
      ++stats_.coalesced;
      return CacheResult{joined.value, joined.level, true};
  }
  return std::nullopt;
}

void EmbeddingCache::FinishFlightLocked(Flight& flight, absl::Status status, FeaturesPtr value,
                                        CacheLevel level) {
  for (const CacheKey& key : flight.keys) {
    auto it = flights_.find(key);
    if (it != flights_.end() && it->second.get() == &flight) flights_.erase(it);
  }
  --stats_.inflight;
  if (!status.ok()) {
    ++stats_.compute_failures;
  } else if (level == CacheLevel::kMiss) {
    ++stats_.misses;
  } else if (level == CacheLevel::kPixels) {
    ++stats_.pixel_hits;
  } else if (level == CacheLevel::kDisk) {
    ++stats_.disk_hits;
  }
  flight.status = std::move(status);
  flight.value = std::move(value);
  flight.level = level;
  flight.done = true;
  flight.cv.notify_all();
}

FeaturesPtr EmbeddingCache::ReadDiskAndPromote(const CacheKey& key) {
  std::optional<DiskStore::Loaded> loaded = disk_->Read(key);
  if (!loaded) return nullptr;
  if (Expired(loaded->created, Now())) {
    disk_->Remove(loaded->primary);
    if (key != loaded->primary) disk_->Remove(key);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.expirations;
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (InsertLocked(loaded->value, loaded->primary, loaded->pixel_key, loaded->created) != nullptr &&
      key != loaded->primary) {
    LinkLocked(key, lru_.begin());
    EvictLocked();
  }
  return loaded->value;
}

absl::StatusOr<FeaturesPtr> PixelKeyProbe::Find(const CacheKey& pixel_key) {
  if (used_) return absl::FailedPreconditionError("PixelKeyProbe::Find called twice");
  used_ = true;
  EmbeddingCache& cache = *cache_;
  auto hit = [&](FeaturesPtr value, CacheLevel level) {
    key_ = pixel_key;
    hit_ = std::move(value);
    hit_level_ = level;
    return hit_;
  };
  {
    std::unique_lock<std::mutex> lock(cache.mu_);
    // A failed flight on these pixels may still encode for us: not a failure here.
    absl::StatusOr<EmbeddingCache::Joined> joined =
        cache.FindOrJoinLocked(lock, pixel_key, *wait_, flight_.get(), /*failures_are_final=*/false);
    if (!joined.ok()) return joined.status();
    if (joined->from != EmbeddingCache::Joined::kNowhere) {
      return hit(joined->value, CacheLevel::kPixels);
    }
    cache.flights_.emplace(pixel_key, flight_);
    flight_->keys.push_back(pixel_key);
  }
  key_ = pixel_key;
  if (cache.disk_) {
    if (FeaturesPtr value = cache.ReadDiskAndPromote(pixel_key)) {
      return hit(std::move(value), CacheLevel::kDisk);
    }
  }
  return FeaturesPtr();
}

namespace {

absl::StatusOr<FeaturesPtr> RunCompute(const ComputeFn& compute, PixelKeyProbe& probe) {
  if (!compute) return absl::InternalError("embedding cache: no compute function");
  // The flight must finish even if the callable throws, or its waiters hang.
  try {
    return compute(probe);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("embedding cache: compute threw: ", e.what()));
  } catch (...) {
    return absl::InternalError("embedding cache: compute threw");
  }
}

}  // namespace

absl::StatusOr<CacheResult> EmbeddingCache::GetOrCompute(const CacheKey& key,
                                                         const ComputeFn& compute,
                                                         const WaitOptions& wait) {
  std::unique_lock<std::mutex> lock(mu_);
  // Another caller's failure describes the image (except its own cancellation
  // or deadline): it is this caller's answer too.
  absl::StatusOr<Joined> joined =
      FindOrJoinLocked(lock, key, wait, /*own=*/nullptr, /*failures_are_final=*/true);
  if (!joined.ok()) return joined.status();
  if (std::optional<CacheResult> found = CountJoinedLocked(*joined)) return *found;
  auto flight = std::make_shared<Flight>();
  flight->keys.push_back(key);
  flights_.emplace(key, flight);
  ++stats_.inflight;
  lock.unlock();

  // This caller leads the flight: disk, then the callable.
  FeaturesPtr value;
  CacheLevel level = CacheLevel::kMiss;
  absl::Status status;
  std::optional<CacheKey> pixel_key;
  bool via_probe = false;
  if (disk_) {
    value = ReadDiskAndPromote(key);
    if (value) level = CacheLevel::kDisk;
  }
  if (!value) {
    PixelKeyProbe probe(this, flight, &wait);
    absl::StatusOr<FeaturesPtr> computed = RunCompute(compute, probe);
    pixel_key = probe.key_;
    if (!computed.ok()) {
      status = computed.status();
    } else if (*computed == nullptr) {
      status = absl::InternalError("embedding cache: compute returned no value");
    } else if (probe.hit_ != nullptr && *computed == probe.hit_) {
      value = *std::move(computed);
      level = probe.hit_level_;
      via_probe = true;
    } else if (absl::Status valid = (*computed)->Validate(); !valid.ok()) {
      status = absl::InternalError(
          absl::StrCat("embedding cache: compute returned malformed features: ", valid.message()));
    } else {
      value = *std::move(computed);
    }
  }

  const absl::Time now = Now();
  std::optional<CacheKey> disk_entry_pixel;  // write an entry named `key`
  bool write_entry = false;
  std::optional<CacheKey> alias_target;  // write an alias `key` -> target
  lock.lock();
  // A disk hit on the bytes key was promoted under it already.
  if (status.ok() && (level == CacheLevel::kMiss || via_probe)) {
    Node* linked = nullptr;
    if (via_probe) {
      // Same pixels: point this bytes key at the entry the probe found.
      auto it = index_.find(*pixel_key);
      if (it != index_.end() && it->second->value == value) {
        lru_.splice(lru_.begin(), lru_, it->second);
        LinkLocked(key, lru_.begin());
        EvictLocked();
        linked = &lru_.front();
        alias_target = linked->primary;
      }
    }
    if (linked == nullptr) {  // a new value (or the probed entry is gone)
      InsertLocked(value, key, pixel_key, now);
      write_entry = true;
      disk_entry_pixel = pixel_key;
    }
  }
  FinishFlightLocked(*flight, status, value, level);
  lock.unlock();

  if (disk_ && status.ok()) {
    if (write_entry) {
      disk_->WriteEntry(key, disk_entry_pixel, value, now);
      if (disk_entry_pixel) disk_->WriteAlias(*disk_entry_pixel, key);
    } else if (alias_target && *alias_target != key) {
      disk_->WriteAlias(key, *alias_target);
    }
  }
  if (!status.ok()) return status;
  return CacheResult{std::move(value), level, false};
}

absl::StatusOr<CacheResult> EmbeddingCache::Lookup(const CacheKey& key, const WaitOptions& wait) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    // A failed flight is gone once it finished: look again (disk, then not found).
    absl::StatusOr<Joined> joined =
        FindOrJoinLocked(lock, key, wait, /*own=*/nullptr, /*failures_are_final=*/false);
    if (!joined.ok()) return joined.status();
    if (std::optional<CacheResult> found = CountJoinedLocked(*joined)) return *found;
  }
  if (disk_) {
    if (FeaturesPtr value = ReadDiskAndPromote(key)) {
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.disk_hits;
      return CacheResult{std::move(value), CacheLevel::kDisk, false};
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.not_found;
  return absl::NotFoundError("no cached features for this image and options");
}

EmbeddingCacheStats EmbeddingCache::Stats() const {
  EmbeddingCacheStats stats;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats = stats_;
    stats.memory_bytes = bytes_;
    stats.memory_entries = lru_.size();
  }
  if (disk_) {
    const DiskStore::Stats disk = disk_->GetStats();
    stats.disk_writes = disk.writes;
    stats.disk_writes_dropped = disk.writes_dropped;
    stats.disk_evictions = disk.evictions;
    stats.disk_errors = disk.errors;
    stats.disk_corrupt = disk.corrupt;
    stats.disk_bytes = disk.bytes;
    stats.disk_files = disk.files;
  }
  return stats;
}

void EmbeddingCache::FlushDiskWrites() {
  if (disk_) disk_->Flush();
}

}  // namespace vlm::vision
