#include "services/vision/embedding_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <limits>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

namespace vlm::vision {
namespace {

// Memory accounting beyond the value itself: list node, index slots, flight
// bookkeeping. Rough but fixed, so bounds stay predictable.
constexpr size_t kEntryOverheadBytes = 256;
constexpr size_t kKeyOverheadBytes = 96;
// Aliases (other containers of one picture) per entry; more are not linked.
constexpr size_t kMaxKeysPerEntry = 16;
constexpr absl::Duration kCancelPollInterval = absl::Milliseconds(20);

void AppendU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void AppendU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void AppendI64(std::string* out, int64_t v) { AppendU64(out, static_cast<uint64_t>(v)); }

void HashContext(Sha256Hasher& hasher, const CacheKeyContext& context) {
  std::string fields;
  AppendI64(&fields, context.min_pixels);
  AppendI64(&fields, context.max_pixels);
  AppendU64(&fields, context.model_fingerprint.size());
  hasher.Update(fields);
  hasher.Update(context.model_fingerprint);
}

// Waiters retry after these: they describe the computing caller's request,
// not the image.
bool IsCallerSpecific(const absl::Status& status) {
  return absl::IsCancelled(status) || absl::IsDeadlineExceeded(status);
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

// ----------------------------------------------------------------------------
// Values

size_t FeatureDTypeSize(FeatureDType dtype) {
  switch (dtype) {
    case FeatureDType::kBF16:
    case FeatureDType::kF16:
      return 2;
    case FeatureDType::kF32:
      return 4;
  }
  return 0;
}

int64_t FeatureTensor::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

size_t CachedFeatures::ByteSize() const {
  size_t n = sizeof(CachedFeatures) + content_hash.size();
  auto add = [&n](const FeatureTensor& t) {
    n += t.data.size() + t.shape.size() * sizeof(int64_t);
  };
  add(last_hidden);
  for (const FeatureTensor& t : deepstack) {
    n += sizeof(FeatureTensor);
    add(t);
  }
  return n;
}

absl::Status CachedFeatures::Validate() const {
  if (grid_t <= 0 || grid_h <= 0 || grid_w <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("grid must be positive, got ", grid_t, "x", grid_h, "x", grid_w));
  }
  auto check = [](const FeatureTensor& t, const std::string& name) -> absl::Status {
    const size_t element = FeatureDTypeSize(t.dtype);
    if (element == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": unknown dtype ", static_cast<uint32_t>(t.dtype)));
    }
    if (t.shape.empty() || t.shape.size() > 8) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": rank ", t.shape.size(), " not in 1..8"));
    }
    const int64_t n = t.NumElements();
    if (n < 0 || static_cast<uint64_t>(n) > std::numeric_limits<size_t>::max() / element ||
        static_cast<size_t>(n) * element != t.data.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", t.data.size(), " data bytes do not match the shape"));
    }
    return absl::OkStatus();
  };
  if (absl::Status s = check(last_hidden, "last_hidden"); !s.ok()) return s;
  for (size_t i = 0; i < deepstack.size(); ++i) {
    if (absl::Status s = check(deepstack[i], absl::StrCat("deepstack[", i, "]")); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// ----------------------------------------------------------------------------
// Keys

size_t CacheKeyHash::operator()(const CacheKey& key) const {
  size_t h;
  std::memcpy(&h, key.digest.data(), sizeof(h));
  return h;
}

absl::StatusOr<Sha256Digest> ParseContentHash(std::string_view hex) {
  Sha256Digest digest;
  if (hex.size() != 2 * digest.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("content hash must be 64 hex characters, got ", hex.size()));
  }
  for (size_t i = 0; i < digest.size(); ++i) {
    const int hi = HexValue(hex[2 * i]);
    const int lo = HexValue(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return absl::InvalidArgumentError("content hash is not hexadecimal");
    digest[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return digest;
}

CacheKey KeyForContentHash(const Sha256Digest& content_hash, const CacheKeyContext& context) {
  static constexpr std::string_view kDomain("vlm.embedding_cache.bytes.v1\0", 29);
  Sha256Hasher hasher;
  hasher.Update(kDomain);
  hasher.Update(content_hash.data(), content_hash.size());
  HashContext(hasher, context);
  return CacheKey{hasher.Finish()};
}

CacheKey KeyForImageBytes(std::string_view image_bytes, const CacheKeyContext& context) {
  return KeyForContentHash(Sha256(image_bytes), context);
}

CacheKey KeyForPixels(std::string_view rgb, int64_t width, int64_t height,
                      const CacheKeyContext& context) {
  static constexpr std::string_view kDomain("vlm.embedding_cache.pixels.v1\0", 30);
  Sha256Hasher hasher;
  hasher.Update(kDomain);
  std::string fields;
  AppendI64(&fields, width);
  AppendI64(&fields, height);
  hasher.Update(fields);
  HashContext(hasher, context);
  fields.clear();
  AppendU64(&fields, rgb.size());
  hasher.Update(fields);
  hasher.Update(rgb);
  return CacheKey{hasher.Finish()};
}

const char* CacheLevelName(CacheLevel level) {
  switch (level) {
    case CacheLevel::kMiss:
      return "miss";
    case CacheLevel::kMemory:
      return "memory";
    case CacheLevel::kPixels:
      return "pixels";
    case CacheLevel::kDisk:
      return "disk";
  }
  return "unknown";
}

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

// ----------------------------------------------------------------------------
// Disk tier
//
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
  void AddStats(EmbeddingCacheStats* stats) const;

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

void DiskStore::AddStats(EmbeddingCacheStats* stats) const {
  std::lock_guard<std::mutex> lock(mu_);
  stats->disk_writes = writes_;
  stats->disk_writes_dropped = writes_dropped_;
  stats->disk_evictions = evictions_;
  stats->disk_errors = errors_;
  stats->disk_corrupt = corrupt_;
  stats->disk_bytes = bytes_;
  stats->disk_files = files_.size();
}

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
    while (true) {
      if (EmbeddingCache::Node* node = cache.FindLocked(pixel_key, cache.Now())) {
        return hit(node->value, CacheLevel::kPixels);
      }
      auto it = cache.flights_.find(pixel_key);
      if (it == cache.flights_.end() || it->second == flight_) break;
      std::shared_ptr<embedding_cache_internal::Flight> other = it->second;
      absl::Status waited = cache.WaitLocked(lock, *other, *wait_);
      if (!waited.ok()) return waited;
      if (other->status.ok()) return hit(other->value, CacheLevel::kPixels);
      // That flight failed; these pixels may still encode for us.
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
  while (true) {
    if (Node* node = FindLocked(key, Now())) {
      ++stats_.memory_hits;
      return CacheResult{node->value, CacheLevel::kMemory, false};
    }
    auto it = flights_.find(key);
    if (it == flights_.end()) break;
    std::shared_ptr<Flight> other = it->second;
    if (absl::Status waited = WaitLocked(lock, *other, wait); !waited.ok()) return waited;
    if (other->status.ok()) {
      ++stats_.coalesced;
      return CacheResult{other->value, other->level, true};
    }
    if (!IsCallerSpecific(other->status)) return other->status;
    // The computing caller gave up; try again, perhaps as the one computing.
  }
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
    while (true) {
      if (Node* node = FindLocked(key, Now())) {
        ++stats_.memory_hits;
        return CacheResult{node->value, CacheLevel::kMemory, false};
      }
      auto it = flights_.find(key);
      if (it == flights_.end()) break;
      std::shared_ptr<Flight> other = it->second;
      if (absl::Status waited = WaitLocked(lock, *other, wait); !waited.ok()) return waited;
      if (other->status.ok()) {
        ++stats_.coalesced;
        return CacheResult{other->value, other->level, true};
      }
      // That flight failed and is gone: look again.
    }
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
  if (disk_) disk_->AddStats(&stats);
  return stats;
}

void EmbeddingCache::FlushDiskWrites() {
  if (disk_) disk_->Flush();
}

}  // namespace vlm::vision
