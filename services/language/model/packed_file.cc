#include "services/language/model/packed_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>

#include <prometheus/counter.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/kernels/thread_pool.h"
#include "common/metrics.h"

namespace vlm::language {
namespace {

constexpr char kMagic[8] = {'V', 'L', 'M', 'P', 'A', 'C', 'K', '\0'};
constexpr uint64_t kHeaderBytes = 4096;
constexpr uint64_t kFixedHeader = 48;  // magic .. table checksum
constexpr uint64_t kPage = 4096;

uint64_t RoundUp(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif

// Maps every page of [p, p + size) (read faults, from the page cache or the
// disk) in one call where the kernel can; else false.
bool PopulateRead(const uint8_t* p, uint64_t size) {
  return size == 0 || ::madvise(const_cast<uint8_t*>(p), size, MADV_POPULATE_READ) == 0;
}

// --- XXH64 (the published algorithm, seed 0) --------------------------------
constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull, kP2 = 0xC2B2AE3D27D4EB4Full,
                   kP3 = 0x165667B19E3779F9ull, kP4 = 0x85EBCA77C2B2AE63ull,
                   kP5 = 0x27D4EB2F165667C5ull;
inline uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t Read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline uint32_t Read32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t Round(uint64_t acc, uint64_t input) {
  acc += input * kP2;
  return Rotl(acc, 31) * kP1;
}
inline uint64_t Merge(uint64_t acc, uint64_t val) {
  acc ^= Round(0, val);
  return acc * kP1 + kP4;
}

void Put32(std::string* out, uint32_t v) { out->append(reinterpret_cast<const char*>(&v), 4); }
void Put64(std::string* out, uint64_t v) { out->append(reinterpret_cast<const char*>(&v), 8); }

struct RejectionMetrics {
  prometheus::Family<prometheus::Counter>* family;
};

prometheus::Family<prometheus::Counter>& RejectedFamily() {
  static prometheus::Family<prometheus::Counter>* family =
      &prometheus::BuildCounter()
           .Name("vlm_language_packed_file_rejected_total")
           .Help("Packed-weight files found but not trusted, by reason (truncated, corrupt, "
                 "foreign, layout_version, section_checksum, io_error)")
           .Register(MetricsRegistry());
  return *family;
}

absl::Status ErrnoStatus(const std::string& what, int err) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOSPC:
    case EFBIG:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case ENOENT:
      return absl::NotFoundError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace

uint64_t PackedChecksum(const void* data, uint64_t size) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  const uint8_t* const end = p + size;
  uint64_t h;
  if (size >= 32) {
    uint64_t v1 = kP1 + kP2, v2 = kP2, v3 = 0, v4 = 0 - kP1;
    const uint8_t* const limit = end - 32;
    do {
      v1 = Round(v1, Read64(p));
      v2 = Round(v2, Read64(p + 8));
      v3 = Round(v3, Read64(p + 16));
      v4 = Round(v4, Read64(p + 24));
      p += 32;
    } while (p <= limit);
    h = Rotl(v1, 1) + Rotl(v2, 7) + Rotl(v3, 12) + Rotl(v4, 18);
    h = Merge(h, v1);
    h = Merge(h, v2);
    h = Merge(h, v3);
    h = Merge(h, v4);
  } else {
    h = kP5;
  }
  h += size;
  while (p + 8 <= end) {
    h ^= Round(0, Read64(p));
    h = Rotl(h, 27) * kP1 + kP4;
    p += 8;
  }
  if (p + 4 <= end) {
    h ^= static_cast<uint64_t>(Read32(p)) * kP1;
    h = Rotl(h, 23) * kP2 + kP3;
    p += 4;
  }
  while (p < end) {
    h ^= *p * kP5;
    h = Rotl(h, 11) * kP1;
    ++p;
  }
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

std::string PackedFileKey::Text() const {
  return absl::StrCat("checkpoint=", checkpoint, ";form=", form);
}

std::string PackedFileKey::FileName() const {
  return absl::StrCat(stem.empty() ? checkpoint.substr(0, 16) : stem, "-",
                      absl::StrReplaceAll(form, {{"/", "-"}}), ".vlmpack");
}

void CountPackedFileRejection(const std::string& reason) {
  RejectedFamily().Add({{"reason", reason}}).Increment();
}

// ---------------------------------------------------------------------------
// PackedFile
// ---------------------------------------------------------------------------

struct PackedFile::GroupState {
  struct Group {
    uint64_t begin = 0, end = 0;  // page-aligned byte range of its sections
    std::vector<size_t> sections;
    bool verified = false;
    absl::Status verdict;
  };
  std::mutex mu;
  std::map<int32_t, Group> groups;
  size_t verified_ok = 0;  // groups whose sections all matched in this process
  bool trusted = false;    // a verified-once marker matched at Open
  std::string marker;      // what the marker holds for this very file
  uint64_t header_checksum = 0;
};

namespace {

// The verified-once marker "<file>.verified": written when one process has
// checked every section's checksum, it names the file by device, inode,
// size, modification and change times (ns) and header checksum. Any write to
// the file (a partial rewrite, a corrupting edit) changes its times and a
// rebuild makes a new inode, so a matching marker means the bytes are the ones
// that were verified; later starts then skip hashing GBs before the first
// token and only page the layers in.
std::string MarkerPath(const std::string& path) { return path + ".verified"; }

std::string MarkerText(const struct stat& st, uint64_t header_checksum) {
  return absl::StrCat("vlmpack-verified-v1 dev=", static_cast<uint64_t>(st.st_dev),
                      " ino=", static_cast<uint64_t>(st.st_ino),
                      " size=", static_cast<int64_t>(st.st_size),
                      " mtime=", static_cast<int64_t>(st.st_mtim.tv_sec), ".",
                      static_cast<int64_t>(st.st_mtim.tv_nsec),
                      " ctime=", static_cast<int64_t>(st.st_ctim.tv_sec), ".",
                      static_cast<int64_t>(st.st_ctim.tv_nsec), " header=", header_checksum, "\n");
}

std::string ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  std::string text(256, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  return text;
}

// Best effort (a read-only directory keeps verifying at every start).
void WriteMarker(const std::string& path, const std::string& text) {
  const std::string tmp = absl::StrCat(MarkerPath(path), ".tmp.", ::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return;
    out << text;
    if (!out.flush()) {
      ::unlink(tmp.c_str());
      return;
    }
  }
  if (::rename(tmp.c_str(), MarkerPath(path).c_str()) != 0) ::unlink(tmp.c_str());
}

}  // namespace

PackedFile::~PackedFile() = default;

absl::StatusOr<std::shared_ptr<PackedFile>> PackedFile::Open(const std::string& path,
                                                             const PackedFileKey& key,
                                                             std::string* reason) {
  const auto reject = [&](const char* why, const std::string& message) {
    *reason = why;
    return absl::FailedPreconditionError(absl::StrCat(path, ": ", message));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    *reason = err == ENOENT ? "missing" : "io_error";
    return ErrnoStatus(absl::StrCat("open ", path), err);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    *reason = "io_error";
    return ErrnoStatus(absl::StrCat("stat ", path), err);
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kHeaderBytes) {
    ::close(fd);
    return reject("truncated", absl::StrCat(size, " bytes, shorter than its header"));
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (map == MAP_FAILED) {
    *reason = "io_error";
    return ErrnoStatus(absl::StrCat("mmap ", path), map_err);
  }
  std::shared_ptr<PackedFile> file(new PackedFile());
  file->path_ = path;
  file->base_ = static_cast<const uint8_t*>(map);
  file->size_ = size;
  file->inode_ = st.st_ino;
  file->device_ = st.st_dev;
  file->owner_ = std::shared_ptr<const void>(map, [size](const void* p) {
    ::munmap(const_cast<void*>(p), size);
  });
  file->groups_ = std::make_unique<GroupState>();
  const uint8_t* h = file->base_;
  // The header is read-ahead-sized; the kernel maps only what is touched.
  if (std::memcmp(h, kMagic, sizeof(kMagic)) != 0) {
    return reject("corrupt", "not a packed-weight file (bad magic)");
  }
  const uint32_t version = Read32(h + 8);
  if (version != kPackedLayoutVersion) {
    return reject("layout_version", absl::StrCat("layout version ", version, ", this build reads ",
                                                 kPackedLayoutVersion));
  }
  const uint32_t key_len = Read32(h + 12);
  if (key_len > kHeaderBytes - kFixedHeader - 8) {
    return reject("corrupt", absl::StrCat("header key of ", key_len, " bytes"));
  }
  const uint64_t header_used = kFixedHeader + key_len;
  if (Read64(h + header_used) != PackedChecksum(h, header_used)) {
    return reject("corrupt", "header checksum mismatch");
  }
  const uint64_t declared = Read64(h + 16), table_offset = Read64(h + 24),
                 table_size = Read64(h + 32), table_checksum = Read64(h + 40);
  if (declared != size) {
    return reject("truncated", absl::StrCat(size, " bytes, its header says ", declared));
  }
  const std::string found_key(reinterpret_cast<const char*>(h + kFixedHeader), key_len);
  if (found_key != key.Text()) {
    return reject("foreign", absl::StrCat("built for \"", found_key, "\", this start needs \"",
                                          key.Text(), "\""));
  }
  if (table_offset < kHeaderBytes || table_offset > size || table_size != size - table_offset) {
    return reject("corrupt", "section table outside the file");
  }
  if (PackedChecksum(h + table_offset, table_size) != table_checksum) {
    return reject("corrupt", "section table checksum mismatch");
  }
  const uint8_t* t = h + table_offset;
  const uint8_t* const t_end = t + table_size;
  if (t_end - t < 4) return reject("corrupt", "empty section table");
  const uint32_t count = Read32(t);
  t += 4;
  for (uint32_t i = 0; i < count; ++i) {
    if (t_end - t < 32) return reject("corrupt", "section table ends early");
    Section s;
    s.group = static_cast<int32_t>(Read32(t));
    const uint32_t name_len = Read32(t + 4);
    s.offset = Read64(t + 8);
    s.size = Read64(t + 16);
    s.checksum = Read64(t + 24);
    t += 32;
    if (static_cast<uint64_t>(t_end - t) < name_len) {
      return reject("corrupt", "section name past the table");
    }
    s.name.assign(reinterpret_cast<const char*>(t), name_len);
    t += name_len;
    if (s.offset < kHeaderBytes || s.offset % kPage != 0 || s.offset > table_offset ||
        s.size > table_offset - s.offset) {
      return reject("corrupt", absl::StrCat("section ", s.group, "/", s.name,
                                            " outside the data area"));
    }
    GroupState::Group& g = file->groups_->groups[s.group];
    if (g.sections.empty()) {
      g.begin = s.offset;
      g.end = s.offset;
    }
    g.begin = std::min(g.begin, s.offset);
    g.end = std::max(g.end, RoundUp(s.offset + s.size, kPage));
    g.sections.push_back(file->sections_.size());
    file->sections_.push_back(std::move(s));
  }
  file->groups_->header_checksum = Read64(h + header_used);
  file->groups_->marker = MarkerText(st, file->groups_->header_checksum);
  file->groups_->trusted = ReadSmallFile(MarkerPath(path)) == file->groups_->marker;
  return file;
}

bool PackedFile::trusted() const { return groups_->trusted; }

const PackedFile::Section* PackedFile::Find(int32_t group, std::string_view name) const {
  auto it = groups_->groups.find(group);
  if (it == groups_->groups.end()) return nullptr;
  for (size_t i : it->second.sections) {
    if (sections_[i].name == name) return &sections_[i];
  }
  return nullptr;
}

bool PackedFile::HasGroup(int32_t group) const { return groups_->groups.count(group) > 0; }

absl::Status PackedFile::VerifyGroup(int32_t group) const {
  GroupState::Group* g = nullptr;
  {
    std::lock_guard<std::mutex> lock(groups_->mu);
    auto it = groups_->groups.find(group);
    if (it == groups_->groups.end()) {
      return absl::NotFoundError(absl::StrCat(path_, ": no group ", group));
    }
    g = &it->second;
    if (g->verified) return g->verdict;
    if (groups_->trusted) {
      g->verified = true;
      return g->verdict;
    }
  }
  // Sections of a group hash in parallel: the read is the layer's page-in
  // (its page tables filled in one call first where the kernel can: cheaper
  // than a fault per page).
  PopulateRead(base_ + g->begin, std::min(g->end, size_) - g->begin);
  const std::vector<size_t>& ids = g->sections;
  std::vector<char> bad(ids.size(), 0);
  kernels::ParallelFor(static_cast<int64_t>(ids.size()), 0, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Section& s = sections_[ids[i]];
      bad[i] = PackedChecksum(base_ + s.offset, s.size) != s.checksum;
    }
  });
  absl::Status verdict;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (bad[i]) {
      const Section& s = sections_[ids[i]];
      verdict = absl::DataLossError(absl::StrCat(path_, ": section ", s.group, "/", s.name,
                                                 " checksum mismatch"));
      break;
    }
  }
  bool all_verified = false;
  {
    std::lock_guard<std::mutex> lock(groups_->mu);
    if (g->verified) return g->verdict;  // another thread verified it meanwhile
    g->verified = true;
    g->verdict = verdict;
    if (verdict.ok()) all_verified = ++groups_->verified_ok == groups_->groups.size();
  }
  if (all_verified) {
    // Only for the file as it was at Open: same inode, not written since.
    struct stat st {};
    if (::stat(path_.c_str(), &st) == 0 &&
        MarkerText(st, groups_->header_checksum) == groups_->marker) {
      WriteMarker(path_, groups_->marker);
    }
  }
  return verdict;
}

void PackedFile::PrefetchGroup(int32_t group) const {
  auto it = groups_->groups.find(group);
  if (it == groups_->groups.end() || it->second.end <= it->second.begin) return;
  ::madvise(const_cast<uint8_t*>(base_) + it->second.begin, it->second.end - it->second.begin,
            MADV_WILLNEED);
}

void PackedFile::TouchGroup(int32_t group) const {
  auto it = groups_->groups.find(group);
  if (it == groups_->groups.end()) return;
  const uint64_t end = std::min(it->second.end, size_);
  if (end > it->second.begin && PopulateRead(base_ + it->second.begin, end - it->second.begin)) {
    return;
  }
  uint64_t sum = 0;
  for (uint64_t o = it->second.begin; o < std::min(it->second.end, size_); o += kPage) {
    sum += *reinterpret_cast<const volatile uint8_t*>(base_ + o);
  }
  static std::atomic<uint64_t> sink{0};
  sink.fetch_add(sum, std::memory_order_relaxed);
}

void PackedFile::EvictGroup(int32_t group) const {
  auto it = groups_->groups.find(group);
  if (it == groups_->groups.end() || it->second.end <= it->second.begin) return;
  ::madvise(const_cast<uint8_t*>(base_) + it->second.begin,
            std::min(it->second.end, size_) - it->second.begin, MADV_DONTNEED);
}

void PackedFile::Discard() const {
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0 && st.st_ino == inode_ && st.st_dev == device_) {
    ::unlink(path_.c_str());
  }
  ::unlink(MarkerPath(path_).c_str());
}

// ---------------------------------------------------------------------------
// PackedFileWriter
// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<PackedFileWriter>> PackedFileWriter::Create(
    const std::string& dir, const PackedFileKey& key) {
  if (dir.empty()) return absl::FailedPreconditionError("no packed-weight directory");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("packed-weight directory ", dir, " cannot be created: ", ec.message()));
  }
  static std::atomic<int> counter{0};
  std::unique_ptr<PackedFileWriter> w(new PackedFileWriter());
  w->dir_ = dir;
  w->key_ = key;
  w->final_path_ = (std::filesystem::path(dir) / key.FileName()).string();
  w->tmp_path_ = absl::StrCat(w->final_path_, ".tmp.", ::getpid(), ".", counter++);
  w->fd_ = ::open(w->tmp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (w->fd_ < 0) {
    const int err = errno;
    return ErrnoStatus(absl::StrCat("packed-weight directory ", dir, " is not writable (create ",
                                    w->tmp_path_, ")"),
                       err);
  }
  w->offset_ = kHeaderBytes;
  return w;
}

PackedFileWriter::~PackedFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !tmp_path_.empty()) ::unlink(tmp_path_.c_str());
}

absl::Status PackedFileWriter::Write(const void* data, uint64_t size, uint64_t offset) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::pwrite(fd_, p, std::min<uint64_t>(size, 1ull << 30), offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(absl::StrCat("write ", tmp_path_), errno);
    }
    if (n == 0) return ErrnoStatus(absl::StrCat("write ", tmp_path_), ENOSPC);
    p += n;
    offset += static_cast<uint64_t>(n);
    size -= static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status PackedFileWriter::Add(int32_t group, const std::string& name, const void* data,
                                   uint64_t size) {
  if (fd_ < 0 || committed_) return absl::FailedPreconditionError("packed file already closed");
  PackedFile::Section s;
  s.group = group;
  s.name = name;
  s.offset = RoundUp(offset_, kPage);
  s.size = size;
  s.checksum = PackedChecksum(data, size);
  if (absl::Status st = Write(data, size, s.offset); !st.ok()) return st;
  offset_ = s.offset + size;
  sections_.push_back(std::move(s));
  return absl::OkStatus();
}

absl::Status PackedFileWriter::Commit() {
  if (fd_ < 0 || committed_) return absl::FailedPreconditionError("packed file already closed");
  std::string table;
  Put32(&table, static_cast<uint32_t>(sections_.size()));
  for (const PackedFile::Section& s : sections_) {
    Put32(&table, static_cast<uint32_t>(s.group));
    Put32(&table, static_cast<uint32_t>(s.name.size()));
    Put64(&table, s.offset);
    Put64(&table, s.size);
    Put64(&table, s.checksum);
    table += s.name;
  }
  const uint64_t table_offset = RoundUp(offset_, kPage);
  const std::string key = key_.Text();
  if (key.size() > kHeaderBytes - kFixedHeader - 8) {
    return absl::InvalidArgumentError("packed-file key too long");
  }
  std::string header(kMagic, sizeof(kMagic));
  Put32(&header, kPackedLayoutVersion);
  Put32(&header, static_cast<uint32_t>(key.size()));
  Put64(&header, table_offset + table.size());
  Put64(&header, table_offset);
  Put64(&header, table.size());
  Put64(&header, PackedChecksum(table.data(), table.size()));
  header += key;
  Put64(&header, PackedChecksum(header.data(), header.size()));
  header.resize(kHeaderBytes, '\0');
  if (absl::Status s = Write(table.data(), table.size(), table_offset); !s.ok()) return s;
  if (absl::Status s = Write(header.data(), header.size(), 0); !s.ok()) return s;
  if (::fsync(fd_) != 0) return ErrnoStatus(absl::StrCat("fsync ", tmp_path_), errno);
  if (::close(fd_) != 0) {
    fd_ = -1;
    return ErrnoStatus(absl::StrCat("close ", tmp_path_), errno);
  }
  fd_ = -1;
  if (::rename(tmp_path_.c_str(), final_path_.c_str()) != 0) {
    return ErrnoStatus(absl::StrCat("rename ", tmp_path_, " to ", final_path_), errno);
  }
  committed_ = true;
  const int dfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // the rename itself survives a crash
    ::close(dfd);
  }
  return absl::OkStatus();
}

}  // namespace vlm::language
