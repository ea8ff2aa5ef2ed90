#include "services/vision/disk_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/vision/little_endian.h"

namespace vlm::vision::embedding_cache_internal {

namespace {

bool IsLowerHex(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

bool WriteFully(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// Returns the bytes read; less than `size` only at end of file or on error
// (errno set, *error true).
size_t ReadFully(int fd, char* out, size_t size, bool* error) {
  size_t done = 0;
  *error = false;
  while (done < size) {
    const ssize_t n = ::read(fd, out + done, size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      *error = true;
      break;
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return done;
}

// Bounds-checked little-endian reader over a payload.
class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  bool U8(uint8_t* v) {
    if (data_.size() < 1) return false;
    *v = static_cast<uint8_t>(data_[0]);
    data_.remove_prefix(1);
    return true;
  }
  bool U32(uint32_t* v) {
    uint64_t x;
    if (!Bytes(4, &x)) return false;
    *v = static_cast<uint32_t>(x);
    return true;
  }
  bool U64(uint64_t* v) { return Bytes(8, v); }
  bool I64(int64_t* v) {
    uint64_t x;
    if (!Bytes(8, &x)) return false;
    *v = static_cast<int64_t>(x);
    return true;
  }
  bool View(size_t n, std::string_view* v) {
    if (data_.size() < n) return false;
    *v = data_.substr(0, n);
    data_.remove_prefix(n);
    return true;
  }
  bool Key(CacheKey* key) {
    std::string_view v;
    if (!View(key->digest.size(), &v)) return false;
    std::memcpy(key->digest.data(), v.data(), v.size());
    return true;
  }
  bool AtEnd() const { return data_.empty(); }

 private:
  bool Bytes(int n, uint64_t* v) {
    if (data_.size() < static_cast<size_t>(n)) return false;
    uint64_t x = 0;
    for (int i = 0; i < n; ++i) x |= uint64_t{static_cast<uint8_t>(data_[i])} << (8 * i);
    data_.remove_prefix(n);
    *v = x;
    return true;
  }
  std::string_view data_;
};

// The entry payload as pieces: small owned strings and views of the tensor
// data, so that writing a large value copies nothing.
void EncodeEntry(const CachedFeatures& value, const std::optional<CacheKey>& pixel_key,
                 absl::Time created, std::vector<std::string>* owned,
                 std::vector<std::string_view>* pieces) {
  const size_t tensors = 1 + value.deepstack.size();
  owned->reserve(1 + tensors);  // views below point into these strings
  std::string meta;
  AppendI64(&meta, absl::ToUnixNanos(created));
  meta.push_back(pixel_key ? 1 : 0);
  const CacheKey pixel = pixel_key.value_or(CacheKey{});
  meta.append(reinterpret_cast<const char*>(pixel.digest.data()), pixel.digest.size());
  AppendU32(&meta, static_cast<uint32_t>(value.content_hash.size()));
  meta.append(value.content_hash);
  AppendI64(&meta, value.grid_t);
  AppendI64(&meta, value.grid_h);
  AppendI64(&meta, value.grid_w);
  AppendU32(&meta, static_cast<uint32_t>(tensors));
  owned->push_back(std::move(meta));
  pieces->push_back(owned->back());
  auto add = [&](const FeatureTensor& t) {
    std::string head;
    AppendU32(&head, static_cast<uint32_t>(t.dtype));
    AppendU32(&head, static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) AppendI64(&head, d);
    AppendU64(&head, t.data.size());
    owned->push_back(std::move(head));
    pieces->push_back(owned->back());
    pieces->push_back(t.data);
  };
  add(value.last_hidden);
  for (const FeatureTensor& t : value.deepstack) add(t);
}

bool DecodeTensor(Reader& r, FeatureTensor* t) {
  uint32_t dtype, rank;
  if (!r.U32(&dtype) || !r.U32(&rank) || rank == 0 || rank > 8) return false;
  t->dtype = static_cast<FeatureDType>(dtype);
  t->shape.resize(rank);
  for (int64_t& d : t->shape) {
    if (!r.I64(&d)) return false;
  }
  uint64_t length;
  std::string_view data;
  if (!r.U64(&length) || !r.View(length, &data)) return false;
  t->data.assign(data.data(), data.size());
  return true;
}

// nullptr if the payload is malformed (it passed the checksum, so only a
// writer bug or a foreign file gets here).
std::shared_ptr<CachedFeatures> DecodeEntry(std::string_view payload,
                                            std::optional<CacheKey>* pixel_key,
                                            absl::Time* created) {
  Reader r(payload);
  auto value = std::make_shared<CachedFeatures>();
  int64_t created_ns;
  uint8_t has_pixel;
  CacheKey pixel;
  uint32_t hash_length, tensors;
  std::string_view hash;
  if (!r.I64(&created_ns) || !r.U8(&has_pixel) || has_pixel > 1 || !r.Key(&pixel) ||
      !r.U32(&hash_length) || hash_length > 256 || !r.View(hash_length, &hash) ||
      !r.I64(&value->grid_t) || !r.I64(&value->grid_h) || !r.I64(&value->grid_w) ||
      !r.U32(&tensors) || tensors == 0 || tensors > 64) {
    return nullptr;
  }
  value->content_hash.assign(hash.data(), hash.size());
  if (!DecodeTensor(r, &value->last_hidden)) return nullptr;
  value->deepstack.resize(tensors - 1);
  for (FeatureTensor& t : value->deepstack) {
    if (!DecodeTensor(r, &t)) return nullptr;
  }
  if (!r.AtEnd() || !value->Validate().ok()) return nullptr;
  *pixel_key = has_pixel ? std::optional<CacheKey>(pixel) : std::nullopt;
  *created = absl::FromUnixNanos(created_ns);
  return value;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DiskStore>> DiskStore::Open(const std::string& dir,
                                                           uint64_t max_bytes,
                                                           size_t max_pending_bytes) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("embedding cache: cannot create disk directory ", dir, ": ", ec.message()));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "embedding cache: disk directory ", dir, " is not writable: ", std::strerror(errno)));
  }
  std::unique_ptr<DiskStore> store(new DiskStore(dir, max_bytes, max_pending_bytes));
  store->Scan();
  store->writer_ = std::thread([s = store.get()] { s->WriterLoop(); });
  return store;
}

DiskStore::~DiskStore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  if (writer_.joinable()) writer_.join();
}

// Indexes the files a previous process left, oldest mtime = least recently
// used, and deletes its unfinished temporary files. Other files are left alone.
void DiskStore::Scan() {
  struct Found {
    CacheKey key;
    uint64_t size;
    struct timespec mtime;
  };
  std::vector<Found> found;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const std::string path = it->path().string();
    if (name.rfind("tmp-", 0) == 0) {
      ::unlink(path.c_str());
      continue;
    }
    if (name.size() != 68 || name.compare(64, 4, ".emb") != 0 || !IsLowerHex(name.substr(0, 64))) {
      continue;
    }
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    Found f;
    f.key.digest = *ParseContentHash(name.substr(0, 64));
    f.size = static_cast<uint64_t>(st.st_size);
    f.mtime = st.st_mtim;
    found.push_back(f);
  }
  if (ec) ++errors_;
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    if (a.mtime.tv_sec != b.mtime.tv_sec) return a.mtime.tv_sec < b.mtime.tv_sec;
    return a.mtime.tv_nsec < b.mtime.tv_nsec;
  });
  std::lock_guard<std::mutex> lock(mu_);
  for (const Found& f : found) {
    lru_.push_front(f.key);
    files_[f.key] = FileInfo{f.size, lru_.begin()};
    bytes_ += f.size;
  }
  EvictLocked();
}

bool DiskStore::Known(const CacheKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return files_.count(key) != 0;
}

void DiskStore::ForgetLocked(const CacheKey& key) {
  auto it = files_.find(key);
  if (it == files_.end()) return;
  bytes_ -= it->second.size;
  lru_.erase(it->second.position);
  files_.erase(it);
}

// The file was missing when read; it may have been rewritten since.
void DiskStore::ForgetIfGone(const CacheKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (::access(PathFor(key).c_str(), F_OK) != 0) ForgetLocked(key);
}

void DiskStore::Drop(const CacheKey& key, bool corrupt) {
  std::lock_guard<std::mutex> lock(mu_);
  ::unlink(PathFor(key).c_str());
  ForgetLocked(key);
  if (corrupt) {
    ++corrupt_;
    ++errors_;
  }
}

void DiskStore::Remove(const CacheKey& key) { Drop(key, /*corrupt=*/false); }

void DiskStore::Touch(const CacheKey& key) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(key);
    if (it == files_.end()) return;
    lru_.splice(lru_.begin(), lru_, it->second.position);
  }
  // Recency for the next process; a failure only costs eviction order.
  ::utimensat(AT_FDCWD, PathFor(key).c_str(), nullptr, 0);
}

void DiskStore::TrackLocked(const CacheKey& key, uint64_t size) {
  auto it = files_.find(key);
  if (it != files_.end()) {
    bytes_ -= it->second.size;
    it->second.size = size;
    lru_.splice(lru_.begin(), lru_, it->second.position);
  } else {
    lru_.push_front(key);
    files_[key] = FileInfo{size, lru_.begin()};
  }
  bytes_ += size;
  EvictLocked();
}

// Never evicts the most recent file: it fits alone (checked before writing).
void DiskStore::EvictLocked() {
  while (bytes_ > max_bytes_ && lru_.size() > 1) {
    const CacheKey victim = lru_.back();
    auto it = files_.find(victim);
    ::unlink(PathFor(victim).c_str());
    bytes_ -= it->second.size;
    files_.erase(it);
    lru_.pop_back();
    ++evictions_;
  }
}

DiskStore::ReadStatus DiskStore::ReadFile(const CacheKey& key, Kind* kind, std::string* payload) {
  const int fd = ::open(PathFor(key).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? ReadStatus::kMissing : ReadStatus::kIoError;
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) return ReadStatus::kIoError;
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kHeaderSize) return ReadStatus::kCorrupt;

  char header[kHeaderSize];
  bool error;
  if (ReadFully(fd, header, kHeaderSize, &error) != kHeaderSize) {
    return error ? ReadStatus::kIoError : ReadStatus::kCorrupt;
  }
  Reader r(std::string_view(header, kHeaderSize));
  std::string_view magic;
  uint32_t version, raw_kind;
  CacheKey stored_key;
  uint64_t length;
  std::string_view checksum;
  r.View(sizeof(kMagic), &magic);
  r.U32(&version);
  r.U32(&raw_kind);
  r.Key(&stored_key);
  r.U64(&length);
  r.View(32, &checksum);
  if (magic != std::string_view(kMagic, sizeof(kMagic)) || version != kVersion ||
      (raw_kind != static_cast<uint32_t>(Kind::kEntry) &&
       raw_kind != static_cast<uint32_t>(Kind::kAlias)) ||
      stored_key != key || length != size - kHeaderSize) {
    return ReadStatus::kCorrupt;
  }
  payload->resize(length);
  if (ReadFully(fd, payload->data(), length, &error) != length) {
    return error ? ReadStatus::kIoError : ReadStatus::kCorrupt;
  }
  const Sha256Digest actual = Sha256(*payload);
  if (std::memcmp(actual.data(), checksum.data(), actual.size()) != 0) return ReadStatus::kCorrupt;
  *kind = static_cast<Kind>(raw_kind);
  return ReadStatus::kOk;
}

std::optional<DiskStore::Loaded> DiskStore::Read(const CacheKey& key) {
  if (!Known(key)) return std::nullopt;  // no syscall for the common miss
  Kind kind;
  std::string payload;
  auto read = [&](const CacheKey& k) -> bool {
    switch (ReadFile(k, &kind, &payload)) {
      case ReadStatus::kOk:
        return true;
      case ReadStatus::kMissing:
        ForgetIfGone(k);
        return false;
      case ReadStatus::kCorrupt:
        Drop(k, /*corrupt=*/true);
        return false;
      case ReadStatus::kIoError: {
        std::lock_guard<std::mutex> lock(mu_);
        ++errors_;
        return false;
      }
    }
    return false;
  };
  if (!read(key)) return std::nullopt;

  Loaded loaded;
  loaded.primary = key;
  if (kind == Kind::kAlias) {
    Reader r(payload);
    if (!r.Key(&loaded.primary) || !r.AtEnd() || loaded.primary == key) {
      Drop(key, /*corrupt=*/true);
      return std::nullopt;
    }
    // A dangling alias (its entry was evicted) is simply stale.
    if (!Known(loaded.primary) || !read(loaded.primary)) {
      Remove(key);
      return std::nullopt;
    }
    if (kind != Kind::kEntry) {  // not written by this version: stale
      Remove(key);
      return std::nullopt;
    }
  }
  loaded.value = DecodeEntry(payload, &loaded.pixel_key, &loaded.created);
  if (!loaded.value) {
    Drop(loaded.primary, /*corrupt=*/true);
    if (loaded.primary != key) Remove(key);
    return std::nullopt;
  }
  Touch(key);
  if (loaded.primary != key) Touch(loaded.primary);
  return loaded;
}

void DiskStore::WriteEntry(const CacheKey& primary, const std::optional<CacheKey>& pixel_key,
                           FeaturesPtr value, absl::Time created) {
  Job job;
  job.kind = Kind::kEntry;
  job.key = primary;
  job.pixel_key = pixel_key;
  job.pending_bytes = value->ByteSize();
  job.value = std::move(value);
  job.created = created;
  Enqueue(std::move(job));
}

void DiskStore::WriteAlias(const CacheKey& alias, const CacheKey& target) {
  Job job;
  job.kind = Kind::kAlias;
  job.key = alias;
  job.target = target;
  job.pending_bytes = kHeaderSize + target.digest.size();
  Enqueue(std::move(job));
}

void DiskStore::Enqueue(Job job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ || pending_bytes_ + job.pending_bytes > max_pending_bytes_) {
      ++writes_dropped_;
      return;
    }
    pending_bytes_ += job.pending_bytes;
    queue_.push_back(std::move(job));
  }
  work_cv_.notify_one();
}

void DiskStore::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [this] { return queue_.empty() && !writing_; });
}

// Drains the queue before exiting, so a destroyed cache leaves its writes.
void DiskStore::WriterLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) break;  // stop_ and nothing left
    Job job = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    lock.unlock();
    Process(job);
    job.value.reset();
    lock.lock();
    pending_bytes_ -= job.pending_bytes;
    writing_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
}

void DiskStore::Process(const Job& job) {
  // An alias never replaces a file: if `key` is an entry (its write was queued
  // earlier), replacing it could leave aliases pointing at aliases. Only this
  // thread creates files, so the check holds until the rename.
  if (job.kind == Kind::kAlias && Known(job.key)) return;
  std::vector<std::string> owned;
  std::vector<std::string_view> pieces;
  if (job.kind == Kind::kEntry) {
    EncodeEntry(*job.value, job.pixel_key, job.created, &owned, &pieces);
  } else {
    pieces.emplace_back(reinterpret_cast<const char*>(job.target.digest.data()),
                        job.target.digest.size());
  }
  WriteFile(job.key, job.kind, pieces);
}

bool DiskStore::WriteFile(const CacheKey& key, Kind kind,
                          const std::vector<std::string_view>& pieces) {
  uint64_t length = 0;
  Sha256Hasher hasher;
  for (std::string_view p : pieces) {
    length += p.size();
    hasher.Update(p);
  }
  const uint64_t file_size = kHeaderSize + length;
  uint64_t tmp_id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (file_size > max_bytes_) {
      ++writes_dropped_;
      return false;
    }
    tmp_id = tmp_counter_++;
  }
  std::string header(kMagic, sizeof(kMagic));
  AppendU32(&header, kVersion);
  AppendU32(&header, static_cast<uint32_t>(kind));
  header.append(reinterpret_cast<const char*>(key.digest.data()), key.digest.size());
  AppendU64(&header, length);
  const Sha256Digest checksum = hasher.Finish();
  header.append(reinterpret_cast<const char*>(checksum.data()), checksum.size());

  const std::string tmp =
      absl::StrCat(dir_, "/tmp-", key.Hex(), "-", ::getpid(), "-", tmp_id);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  bool ok = fd >= 0;
  if (ok) {
    ok = WriteFully(fd, header);
    for (size_t i = 0; ok && i < pieces.size(); ++i) ok = WriteFully(fd, pieces[i]);
    ok = (::close(fd) == 0) && ok;
  }
  // No fsync: after a power loss a torn file fails verification and is dropped.
  std::lock_guard<std::mutex> lock(mu_);
  if (ok) ok = ::rename(tmp.c_str(), PathFor(key).c_str()) == 0;
  if (!ok) {
    if (fd >= 0) ::unlink(tmp.c_str());
    ++errors_;
    return false;
  }
  ++writes_;
  TrackLocked(key, file_size);
  return true;
}

DiskStore::Stats DiskStore::GetStats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return Stats{writes_, writes_dropped_, evictions_, errors_, corrupt_, bytes_, files_.size()};
}

}  // namespace vlm::vision::embedding_cache_internal
