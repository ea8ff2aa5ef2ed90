#include "common/safetensors.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian");

namespace vlm {
namespace {

using Json = nlohmann::json;

// Same bound as the reference implementation (MAX_HEADER_SIZE).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Nesting of objects/arrays in a header or index; real files use 3.
constexpr int kMaxJsonDepth = 32;
constexpr char kIndexName[] = "model.safetensors.index.json";
constexpr char kSingleName[] = "model.safetensors";
constexpr char kMetadataKey[] = "__metadata__";

struct DTypeRow {
  StDType dtype;
  const char* name;
  size_t size;
};
constexpr DTypeRow kDTypes[] = {
    {StDType::kBool, "BOOL", 1}, {StDType::kU8, "U8", 1},     {StDType::kI8, "I8", 1},
    {StDType::kI16, "I16", 2},   {StDType::kU16, "U16", 2},   {StDType::kF16, "F16", 2},
    {StDType::kBF16, "BF16", 2}, {StDType::kI32, "I32", 4},   {StDType::kU32, "U32", 4},
    {StDType::kF32, "F32", 4},   {StDType::kF64, "F64", 8},   {StDType::kI64, "I64", 8},
    {StDType::kU64, "U64", 8},
};

const DTypeRow& Row(StDType dtype) {
  for (const auto& row : kDTypes) {
    if (row.dtype == dtype) return row;
  }
  return kDTypes[0];  // unreachable for valid enum values
}

bool ToScalarType(StDType dtype, at::ScalarType* out) {
  switch (dtype) {
    case StDType::kBool: *out = at::kBool; return true;
    case StDType::kU8: *out = at::kByte; return true;
    case StDType::kI8: *out = at::kChar; return true;
    case StDType::kI16: *out = at::kShort; return true;
    case StDType::kF16: *out = at::kHalf; return true;
    case StDType::kBF16: *out = at::kBFloat16; return true;
    case StDType::kI32: *out = at::kInt; return true;
    case StDType::kF32: *out = at::kFloat; return true;
    case StDType::kF64: *out = at::kDouble; return true;
    case StDType::kI64: *out = at::kLong; return true;
    case StDType::kU16:
    case StDType::kU32:
    case StDType::kU64: return false;
  }
  return false;
}

bool FromScalarType(at::ScalarType type, StDType* out) {
  switch (type) {
    case at::kBool: *out = StDType::kBool; return true;
    case at::kByte: *out = StDType::kU8; return true;
    case at::kChar: *out = StDType::kI8; return true;
    case at::kShort: *out = StDType::kI16; return true;
    case at::kHalf: *out = StDType::kF16; return true;
    case at::kBFloat16: *out = StDType::kBF16; return true;
    case at::kInt: *out = StDType::kI32; return true;
    case at::kFloat: *out = StDType::kF32; return true;
    case at::kDouble: *out = StDType::kF64; return true;
    case at::kLong: *out = StDType::kI64; return true;
    default: return false;
  }
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// numel x element size with overflow detection; the result also fits int64.
absl::StatusOr<uint64_t> CheckedNbytes(const std::vector<int64_t>& shape, StDType dtype) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative dimension in shape ", ShapeString(shape)));
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) {
      return absl::InvalidArgumentError(absl::StrCat("shape ", ShapeString(shape), " overflows 64 bits"));
    }
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<uint64_t>(StDTypeSize(dtype)), &bytes) ||
      bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", ShapeString(shape), " x ", StDTypeName(dtype), " overflows 64 bits"));
  }
  return bytes;
}

// A JSON-quoted copy of `s` for messages; invalid UTF-8 is replaced, not thrown.
std::string Quote(const std::string& s) { return Json(s).dump(-1, ' ', false, Json::error_handler_t::replace); }

// Parses JSON text that must be one object, rejecting duplicate keys at any
// depth (nlohmann keeps the last silently) and absurd nesting. `where` prefixes
// every message.
absl::StatusOr<Json> ParseJsonObject(std::string_view text, const std::string& where) {
  struct Level {
    std::set<std::string> keys;
    std::string last_key;
    bool is_object;
  };
  std::vector<Level> stack;
  std::string duplicate;  // path of the first duplicate key
  bool too_deep = false;
  auto callback = [&](int /*depth*/, Json::parse_event_t event, Json& parsed) -> bool {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        stack.push_back(Level{{}, {}, event == Json::parse_event_t::object_start});
        if (stack.size() > kMaxJsonDepth) too_deep = true;
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case Json::parse_event_t::key: {
        if (stack.empty() || !parsed.is_string()) break;
        std::string key = parsed.get<std::string>();
        if (!stack.back().keys.insert(key).second && duplicate.empty()) {
          std::vector<std::string> path;
          for (size_t i = 0; i + 1 < stack.size(); ++i) {
            if (stack[i].is_object) path.push_back(Quote(stack[i].last_key));
          }
          path.push_back(Quote(key));
          duplicate = absl::StrJoin(path, " -> ");
        }
        stack.back().last_key = std::move(key);
        break;
      }
      default:
        break;
    }
    return true;
  };
  Json json;
  try {
    json = Json::parse(text.begin(), text.end(), callback);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": invalid JSON: ", e.what()));
  }
  if (too_deep) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": JSON nested deeper than ", kMaxJsonDepth));
  }
  if (!json.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": expected a JSON object, got ", json.type_name()));
  }
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": duplicate key ", duplicate));
  }
  return json;
}

absl::StatusOr<uint64_t> JsonIndex(const Json& v, const char* what, const std::string& where) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", what, " is negative: ", v.dump()));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": ", what, " must be a non-negative integer, got ", v.dump()));
}

std::string PosixError(const std::string& what, const std::string& path, int err) {
  return absl::StrCat(what, " ", path, ": ", std::strerror(err));
}

absl::Status ErrnoStatus(const std::string& what, const std::string& path, int err) {
  if (err == ENOENT) return absl::NotFoundError(PosixError(what, path, err));
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(PosixError(what, path, err));
  return absl::InternalError(PosixError(what, path, err));
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t limit) {
  std::error_code ec;
  auto size = std::filesystem::file_size(path, ec);
  if (ec) {
    if (ec == std::errc::no_such_file_or_directory) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::InternalError(absl::StrCat(path, ": ", ec.message()));
  }
  if (size > limit) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", size, " bytes, more than the limit of ", limit));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InternalError(absl::StrCat(path, ": cannot open for reading"));
  std::string text(size, '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  if (static_cast<uint64_t>(in.gcount()) != size) return absl::InternalError(absl::StrCat(path, ": short read"));
  return text;
}

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// Loops over partial writes.
absl::Status PwriteAll(int fd, const void* data, size_t size, uint64_t offset, const std::string& path) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    ssize_t n = pwrite(fd, p, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("write", path, errno);
    }
    p += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

// Writes `text` to `path` through a temporary file and rename.
absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("create", tmp, errno);
  absl::Status status = PwriteAll(fd, text.data(), text.size(), 0, tmp);
  if (close(fd) != 0 && status.ok()) status = ErrnoStatus("close", tmp, errno);
  if (status.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) status = ErrnoStatus("rename to", path, errno);
  if (!status.ok()) unlink(tmp.c_str());
  return status;
}

}  // namespace

absl::StatusOr<StDType> ParseStDType(const std::string& name) {
  for (const auto& row : kDTypes) {
    if (name == row.name) return row.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown safetensors dtype ", Quote(name)));
}

const char* StDTypeName(StDType dtype) { return Row(dtype).name; }
size_t StDTypeSize(StDType dtype) { return Row(dtype).size; }

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);  // validated not to overflow
  return n;
}

// ---------------------------------------------------------------------------
// Reading

class MappedFile {
 public:
  static absl::StatusOr<std::shared_ptr<MappedFile>> Open(const std::string& path) {
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus("open", path, errno);
    struct stat st;
    if (fstat(fd, &st) != 0) {
      int err = errno;
      close(fd);
      return ErrnoStatus("stat", path, err);
    }
    if (!S_ISREG(st.st_mode)) {
      close(fd);
      return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
    }
    std::shared_ptr<MappedFile> file(new MappedFile(path, static_cast<uint64_t>(st.st_size)));
    if (file->size_ > 0) {
      void* p = mmap(nullptr, file->size_, PROT_READ, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        int err = errno;
        close(fd);
        return ErrnoStatus("mmap", path, err);
      }
      file->data_ = static_cast<const uint8_t*>(p);
    }
    close(fd);  // the mapping keeps the file open
    return file;
  }
  ~MappedFile() {
    if (data_ != nullptr) munmap(const_cast<uint8_t*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  MappedFile(std::string path, uint64_t size) : path_(std::move(path)), size_(size) {}
  std::string path_;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// Builds a SafetensorsCheckpoint: header parsing and cross-file checks.
class SafetensorsLoader {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> OpenSingle(const std::string& path) {
    std::unique_ptr<SafetensorsCheckpoint> ckpt(new SafetensorsCheckpoint());
    auto infos = AddFile(ckpt.get(), path);
    if (!infos.ok()) return infos.status();
    for (auto& info : *infos) {
      std::string name = info.name;
      ckpt->tensors_.emplace(std::move(name), std::move(info));
    }
    return ckpt;
  }

  static absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> OpenIndex(const std::string& index_path) {
    auto text = ReadSmallFile(index_path, kMaxHeaderBytes);
    if (!text.ok()) return text.status();
    auto index = ParseJsonObject(*text, index_path);
    if (!index.ok()) return index.status();
    auto it = index->find("weight_map");
    if (it == index->end()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": missing \"weight_map\""));
    }
    if (!it->is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": \"weight_map\" must be an object, got ", it->type_name()));
    }
    // shard file name -> tensors the index puts there
    std::map<std::string, std::set<std::string>> shards;
    for (const auto& [name, shard] : it->items()) {
      if (!shard.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor ", Quote(name),
                                                       ": shard must be a string, got ", shard.dump()));
      }
      std::string file = shard.get<std::string>();
      if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
          file.find('\0') != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor ", Quote(name), ": shard ",
                                                       Quote(file), " is not a plain file name"));
      }
      if (name == kMetadataKey) {
        return absl::InvalidArgumentError(absl::StrCat(index_path, ": \"weight_map\" names ", kMetadataKey));
      }
      shards[file].insert(name);
    }
    const std::string dir = std::filesystem::path(index_path).parent_path().string();
    std::unique_ptr<SafetensorsCheckpoint> ckpt(new SafetensorsCheckpoint());
    for (const auto& [file, names] : shards) {
      const std::string path = dir.empty() ? file : absl::StrCat(dir, "/", file);
      auto infos = AddFile(ckpt.get(), path);
      if (!infos.ok()) {
        if (absl::IsNotFound(infos.status())) {
          return absl::NotFoundError(absl::StrCat(index_path, ": names shard ", Quote(file), " (tensor ",
                                                  Quote(*names.begin()), "), which is missing: ",
                                                  infos.status().message()));
        }
        return infos.status();
      }
      std::set<std::string> present;
      for (auto& info : *infos) {
        if (names.count(info.name) == 0) {
          auto mapped = it->find(info.name);
          return absl::InvalidArgumentError(absl::StrCat(
              path, ": tensor ", Quote(info.name), " is not in this shard according to ", index_path,
              mapped == it->end() ? std::string(" (the index does not list it)")
                                  : absl::StrCat(" (the index maps it to ", mapped->dump(), ")")));
        }
        present.insert(info.name);
        std::string name = info.name;
        ckpt->tensors_.emplace(std::move(name), std::move(info));
      }
      for (const auto& name : names) {
        if (present.count(name) == 0) {
          return absl::InvalidArgumentError(absl::StrCat(index_path, ": maps tensor ", Quote(name), " to ", path,
                                                         ", which does not hold it"));
        }
      }
    }
    return ckpt;
  }

 private:
  // Maps and validates one file; appends it to ckpt's files and merges its
  // metadata. Returns its tensors with file_index set.
  static absl::StatusOr<std::vector<TensorInfo>> AddFile(SafetensorsCheckpoint* ckpt, const std::string& path) {
    auto mapped = MappedFile::Open(path);
    if (!mapped.ok()) return mapped.status();
    const MappedFile& file = **mapped;
    const int file_index = static_cast<int>(ckpt->files_.size());
    std::map<std::string, std::string> metadata;
    auto infos = ParseHeader(file, file_index, &metadata);
    if (!infos.ok()) return infos.status();
    ckpt->files_.push_back(path);
    ckpt->maps_.push_back(*mapped);
    for (auto& [k, v] : metadata) ckpt->metadata_.emplace(k, v);  // first file wins
    return infos;
  }

  // One tensor's header entry: dtype, shape and data_offsets, checked against
  // the data section (offsets relative to data_start, data_size bytes).
  static absl::StatusOr<TensorInfo> ParseTensorEntry(const std::string& name,
                                                     const Json& entry,
                                                     const std::string& where, int file_index,
                                                     uint64_t data_start, uint64_t data_size) {
    TensorInfo info;
    info.name = name;
    info.file_index = file_index;

    auto dtype_it = entry.find("dtype");
    if (dtype_it == entry.end()) return absl::InvalidArgumentError(absl::StrCat(where, ": missing \"dtype\""));
    if (!dtype_it->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": \"dtype\" must be a string, got ", dtype_it->dump()));
    }
    auto dtype = ParseStDType(dtype_it->get<std::string>());
    if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", dtype.status().message()));
    info.dtype = *dtype;

    auto shape_it = entry.find("shape");
    if (shape_it == entry.end()) return absl::InvalidArgumentError(absl::StrCat(where, ": missing \"shape\""));
    if (!shape_it->is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": \"shape\" must be an array, got ", shape_it->dump()));
    }
    for (const auto& d : *shape_it) {
      auto dim = JsonIndex(d, "shape dimension", where);
      if (!dim.ok()) return dim.status();
      if (*dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": shape dimension ", *dim, " is too large"));
      }
      info.shape.push_back(static_cast<int64_t>(*dim));
    }

    auto off_it = entry.find("data_offsets");
    if (off_it == entry.end()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": missing \"data_offsets\""));
    }
    if (!off_it->is_array() || off_it->size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": \"data_offsets\" must be [begin, end], got ", off_it->dump()));
    }
    auto begin = JsonIndex((*off_it)[0], "data_offsets begin", where);
    if (!begin.ok()) return begin.status();
    auto end = JsonIndex((*off_it)[1], "data_offsets end", where);
    if (!end.ok()) return end.status();
    if (*begin > *end) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": data_offsets begin ", *begin, " is after end ", *end));
    }
    if (*end > data_size) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": data_offsets [", *begin, ", ", *end,
                                                     "] run past the data section of ", data_size,
                                                     " bytes (file truncated?)"));
    }
    auto nbytes = CheckedNbytes(info.shape, info.dtype);
    if (!nbytes.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", nbytes.status().message()));
    if (*end - *begin != *nbytes) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": data_offsets span ", *end - *begin,
                                                     " bytes but shape ", ShapeString(info.shape), " x ",
                                                     StDTypeName(info.dtype), " needs ", *nbytes));
    }
    info.data_begin = data_start + *begin;
    info.data_end = data_start + *end;
    return info;
  }

  static absl::Status CheckNoOverlap(const std::vector<TensorInfo>& infos, const std::string& path,
                                     uint64_t data_start) {
    // No byte may belong to two tensors. Empty tensors own no bytes.
    std::vector<const TensorInfo*> by_offset;
    for (const auto& info : infos) {
      if (info.nbytes() > 0) by_offset.push_back(&info);
    }
    std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
      return a->data_begin != b->data_begin ? a->data_begin < b->data_begin : a->data_end < b->data_end;
    });
    const TensorInfo* reach = nullptr;  // the tensor ending furthest so far
    for (const TensorInfo* info : by_offset) {
      if (reach != nullptr && info->data_begin < reach->data_end) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": tensors ", Quote(reach->name), " [", reach->data_begin - data_start, ", ",
            reach->data_end - data_start, ") and ", Quote(info->name), " [", info->data_begin - data_start, ", ",
            info->data_end - data_start, ") overlap"));
      }
      if (reach == nullptr || info->data_end > reach->data_end) reach = info;
    }
    return absl::OkStatus();
  }

  static absl::StatusOr<std::vector<TensorInfo>> ParseHeader(const MappedFile& file, int file_index,
                                                             std::map<std::string, std::string>* metadata) {
    const std::string& path = file.path();
    const uint64_t size = file.size();
    if (size < 8) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": file is ", size, " bytes, too short for the 8-byte header length"));
    }
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | file.data()[i];
    if (header_len > kMaxHeaderBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": header length ", header_len, " exceeds the limit of ", kMaxHeaderBytes));
    }
    if (header_len > size - 8) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": header length ", header_len,
                                                     " runs past the end of the file (", size, " bytes)"));
    }
    const uint64_t data_start = 8 + header_len;
    const uint64_t data_size = size - data_start;
    std::string_view text(reinterpret_cast<const char*>(file.data()) + 8, header_len);
    auto header = ParseJsonObject(text, absl::StrCat(path, ": header"));
    if (!header.ok()) return header.status();

    std::vector<TensorInfo> infos;
    for (const auto& [name, entry] : header->items()) {
      const std::string where = absl::StrCat(path, ": tensor ", Quote(name));
      if (name == kMetadataKey) {
        if (!entry.is_object()) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": ", kMetadataKey, " must be an object, got ", entry.type_name()));
        }
        for (const auto& [k, v] : entry.items()) {
          if (!v.is_string()) {
            return absl::InvalidArgumentError(
                absl::StrCat(path, ": ", kMetadataKey, " ", Quote(k), " must be a string, got ", v.dump()));
          }
          (*metadata)[k] = v.get<std::string>();
        }
        continue;
      }
      if (!entry.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": entry must be an object, got ", entry.type_name()));
      }
      absl::StatusOr<TensorInfo> info =
          ParseTensorEntry(name, entry, where, file_index, data_start, data_size);
      if (!info.ok()) return info.status();
      infos.push_back(*std::move(info));
    }

    if (absl::Status s = CheckNoOverlap(infos, path, data_start); !s.ok()) return s;
    return infos;
  }
};

absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> SafetensorsCheckpoint::Open(const std::string& path) {
  std::error_code ec;
  auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) {
    return absl::NotFoundError(absl::StrCat(path, ": no such file or directory"));
  }
  if (std::filesystem::is_directory(status)) {
    const std::string index = absl::StrCat(path, "/", kIndexName);
    if (std::filesystem::exists(index, ec)) return SafetensorsLoader::OpenIndex(index);
    const std::string single = absl::StrCat(path, "/", kSingleName);
    if (std::filesystem::exists(single, ec)) return SafetensorsLoader::OpenSingle(single);
    return absl::NotFoundError(
        absl::StrCat(path, ": directory has neither ", kIndexName, " nor ", kSingleName));
  }
  const std::string_view suffix = ".json";
  if (path.size() >= suffix.size() && path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0) {
    return SafetensorsLoader::OpenIndex(path);
  }
  return SafetensorsLoader::OpenSingle(path);
}

SafetensorsCheckpoint::~SafetensorsCheckpoint() = default;

bool SafetensorsCheckpoint::Has(const std::string& name) const { return tensors_.count(name) > 0; }

absl::StatusOr<const TensorInfo*> SafetensorsCheckpoint::Info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor ", Quote(name), " not found in ",
                                            files_.empty() ? std::string("an empty checkpoint")
                                                           : absl::StrJoin(files_, ", ")));
  }
  return &it->second;
}

absl::StatusOr<at::Tensor> SafetensorsCheckpoint::Tensor(const std::string& name) const {
  auto info = Info(name);
  if (!info.ok()) return info.status();
  const TensorInfo& t = **info;
  at::ScalarType type;
  if (!ToScalarType(t.dtype, &type)) {
    return absl::UnimplementedError(absl::StrCat(files_[t.file_index], ": tensor ", Quote(name), ": dtype ",
                                                 StDTypeName(t.dtype), " has no LibTorch equivalent"));
  }
  const std::shared_ptr<MappedFile>& file = maps_[t.file_index];
  const uint8_t* data = file->data() + t.data_begin;
  try {
    const auto options = at::TensorOptions().dtype(type);
    if (reinterpret_cast<uintptr_t>(data) % StDTypeSize(t.dtype) != 0) {
      at::Tensor copy = at::empty(t.shape, options);
      if (t.nbytes() > 0) std::memcpy(copy.data_ptr(), data, t.nbytes());
      return copy;
    }
    std::shared_ptr<MappedFile> keep_alive = file;
    return at::from_blob(const_cast<uint8_t*>(data), t.shape, [keep_alive](void*) {}, options);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(files_[t.file_index], ": tensor ", Quote(name), ": ",
                                            e.what_without_backtrace()));
  }
}

absl::StatusOr<absl::Span<const uint8_t>> SafetensorsCheckpoint::Bytes(const std::string& name) const {
  auto info = Info(name);
  if (!info.ok()) return info.status();
  const TensorInfo& t = **info;
  return absl::Span<const uint8_t>(maps_[t.file_index]->data() + t.data_begin, t.nbytes());
}

namespace {

// The page-aligned range [*start, *start + *len) of `file` covering [begin, end).
void PageRange(const MappedFile& file, uint64_t begin, uint64_t end, uint8_t** start, size_t* len) {
  const uint64_t page = PageSize();
  const uint64_t first = begin / page * page;
  const uint64_t last = (end + page - 1) / page * page;
  *start = const_cast<uint8_t*>(file.data()) + first;
  *len = static_cast<size_t>(last - first);
}

// madvise over the whole pages a tensor covers; errors name file and tensor.
absl::Status AdvisePages(const MappedFile& file, const std::string& path, const TensorInfo& t,
                         int advice, const char* what) {
  if (t.nbytes() == 0) return absl::OkStatus();
  uint8_t* start;
  size_t len;
  PageRange(file, t.data_begin, t.data_end, &start, &len);
  if (madvise(start, len, advice) != 0) {
    return absl::InternalError(
        absl::StrCat(PosixError(what, path, errno), " (tensor ", Quote(t.name), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SafetensorsCheckpoint::Prefetch(const std::string& name) const {
  auto info = Info(name);
  if (!info.ok()) return info.status();
  const TensorInfo& t = **info;
  return AdvisePages(*maps_[t.file_index], files_[t.file_index], t, MADV_WILLNEED,
                     "madvise(WILLNEED)");
}

absl::Status SafetensorsCheckpoint::Touch(const std::string& name) const {
  auto info = Info(name);
  if (!info.ok()) return info.status();
  const TensorInfo& t = **info;
  if (t.nbytes() == 0) return absl::OkStatus();
  const uint64_t page = PageSize();
  const volatile uint8_t* base = maps_[t.file_index]->data();
  uint8_t sink = 0;
  for (uint64_t off = t.data_begin / page * page; off < t.data_end; off += page) sink ^= base[off];
  (void)sink;
  return absl::OkStatus();
}

absl::Status SafetensorsCheckpoint::Evict(const std::string& name) const {
  auto info = Info(name);
  if (!info.ok()) return info.status();
  const TensorInfo& t = **info;
  return AdvisePages(*maps_[t.file_index], files_[t.file_index], t, MADV_DONTNEED,
                     "madvise(DONTNEED)");
}

std::vector<std::string> SafetensorsCheckpoint::Names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, info] : tensors_) names.push_back(name);
  return names;
}

uint64_t SafetensorsCheckpoint::total_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, info] : tensors_) total += info.nbytes();
  return total;
}

// ---------------------------------------------------------------------------
// Writing

namespace {

absl::Status CheckNewName(const std::string& name, const std::set<std::string>& names) {
  if (name.empty()) return absl::InvalidArgumentError("tensor name is empty");
  if (name == kMetadataKey) return absl::InvalidArgumentError(absl::StrCat("tensor name ", kMetadataKey, " is reserved"));
  if (names.count(name) > 0) return absl::AlreadyExistsError(absl::StrCat("tensor ", Quote(name), " added twice"));
  return absl::OkStatus();
}

}  // namespace

absl::Status SafetensorsWriter::Add(const std::string& name, StDType dtype, std::vector<int64_t> shape,
                                    std::string bytes) {
  if (auto s = CheckNewName(name, names_); !s.ok()) return s;
  auto nbytes = CheckedNbytes(shape, dtype);
  if (!nbytes.ok()) return absl::InvalidArgumentError(absl::StrCat("tensor ", Quote(name), ": ", nbytes.status().message()));
  if (bytes.size() != *nbytes) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", Quote(name), ": ", bytes.size(), " bytes given but shape ",
                                                   ShapeString(shape), " x ", StDTypeName(dtype), " needs ", *nbytes));
  }
  names_.insert(name);
  entries_.push_back(Entry{name, dtype, std::move(shape), std::move(bytes), nullptr, *nbytes});
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Add(const std::string& name, const at::Tensor& tensor) {
  StDType dtype;
  if (!tensor.defined() || !FromScalarType(tensor.scalar_type(), &dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", Quote(name), ": unsupported or undefined tensor type"));
  }
  try {
    at::Tensor t = tensor.cpu().contiguous();
    std::string bytes(t.nbytes(), '\0');
    if (!bytes.empty()) std::memcpy(bytes.data(), t.data_ptr(), bytes.size());
    return Add(name, dtype, t.sizes().vec(), std::move(bytes));
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("tensor ", Quote(name), ": ", e.what_without_backtrace()));
  }
}

absl::Status SafetensorsWriter::AddLazy(const std::string& name, StDType dtype, std::vector<int64_t> shape,
                                        std::function<void(uint8_t* dst)> fill) {
  if (auto s = CheckNewName(name, names_); !s.ok()) return s;
  if (!fill) return absl::InvalidArgumentError(absl::StrCat("tensor ", Quote(name), ": no fill function"));
  auto nbytes = CheckedNbytes(shape, dtype);
  if (!nbytes.ok()) return absl::InvalidArgumentError(absl::StrCat("tensor ", Quote(name), ": ", nbytes.status().message()));
  names_.insert(name);
  entries_.push_back(Entry{name, dtype, std::move(shape), std::string(), std::move(fill), *nbytes});
  return absl::OkStatus();
}

void SafetensorsWriter::SetMetadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

uint64_t SafetensorsWriter::total_bytes() const {
  uint64_t total = 0;
  for (const auto& e : entries_) total += e.nbytes;
  return total;
}

namespace {

struct WriteEntry {
  const std::string* name;
  StDType dtype;
  const std::vector<int64_t>* shape;
  const std::string* bytes;
  const std::function<void(uint8_t*)>* fill;
  uint64_t nbytes;
};

absl::Status WriteSafetensorsFile(const std::string& path, std::vector<WriteEntry> entries,
                                  const std::map<std::string, std::string>& metadata) {
  // Larger elements first keeps every tensor aligned to its element size.
  std::stable_sort(entries.begin(), entries.end(), [](const WriteEntry& a, const WriteEntry& b) {
    return StDTypeSize(a.dtype) > StDTypeSize(b.dtype);
  });
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::vector<uint64_t> offsets;
  uint64_t data_size = 0;
  for (const auto& e : entries) {
    offsets.push_back(data_size);
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = StDTypeName(e.dtype);
    entry["shape"] = *e.shape;
    entry["data_offsets"] = {data_size, data_size + e.nbytes};
    header[*e.name] = std::move(entry);
    data_size += e.nbytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // names or metadata that are not UTF-8
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot encode header: ", e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t data_start = 8 + text.size();
  const uint64_t total = data_start + data_size;

  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  int fd = open(tmp.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("create", tmp, errno);
  auto fail = [&](absl::Status status) {
    close(fd);
    unlink(tmp.c_str());
    return status;
  };
  // Reserve the space now: a full disk must be an error, not SIGBUS in fill().
  if (int err = posix_fallocate(fd, 0, static_cast<off_t>(total)); err != 0) {
    return fail(ErrnoStatus("allocate space for", tmp, err));
  }
  uint8_t len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  if (auto s = PwriteAll(fd, len_bytes, 8, 0, tmp); !s.ok()) return fail(s);
  if (auto s = PwriteAll(fd, text.data(), text.size(), 8, tmp); !s.ok()) return fail(s);
  const uint64_t page = PageSize();
  for (size_t i = 0; i < entries.size(); ++i) {
    const WriteEntry& e = entries[i];
    const uint64_t offset = data_start + offsets[i];
    if (e.nbytes == 0) continue;
    if (*e.fill == nullptr) {
      if (auto s = PwriteAll(fd, e.bytes->data(), e.bytes->size(), offset, tmp); !s.ok()) return fail(s);
      continue;
    }
    // Fill straight into the file's pages; unmapping lets the kernel write
    // them back and drop them, so memory stays bounded by the page cache.
    const uint64_t map_offset = offset / page * page;
    const size_t map_len = static_cast<size_t>(offset - map_offset + e.nbytes);
    void* p = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(map_offset));
    if (p == MAP_FAILED) return fail(ErrnoStatus("mmap", tmp, errno));
    std::string error;
    try {
      (*e.fill)(static_cast<uint8_t*>(p) + (offset - map_offset));
    } catch (const std::exception& ex) {
      error = ex.what();
    } catch (...) {
      error = "unknown exception";
    }
    munmap(p, map_len);
    if (!error.empty()) {
      return fail(absl::InternalError(absl::StrCat(path, ": tensor ", Quote(*e.name), ": fill failed: ", error)));
    }
  }
  if (close(fd) != 0) {
    int err = errno;
    unlink(tmp.c_str());
    return ErrnoStatus("close", tmp, err);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    unlink(tmp.c_str());
    return ErrnoStatus("rename to", path, err);
  }
  return absl::OkStatus();
}

WriteEntry ToWriteEntry(const std::string& name, StDType dtype, const std::vector<int64_t>& shape,
                        const std::string& bytes, const std::function<void(uint8_t*)>& fill, uint64_t nbytes) {
  return WriteEntry{&name, dtype, &shape, &bytes, &fill, nbytes};
}

}  // namespace

absl::Status SafetensorsWriter::Write(const std::string& path) const {
  std::vector<WriteEntry> entries;
  for (const auto& e : entries_) entries.push_back(ToWriteEntry(e.name, e.dtype, e.shape, e.bytes, e.fill, e.nbytes));
  return WriteSafetensorsFile(path, std::move(entries), metadata_);
}

absl::Status SafetensorsWriter::WriteSharded(const std::string& dir, int num_shards) const {
  if (num_shards < 1) return absl::InvalidArgumentError(absl::StrCat("num_shards must be >= 1, got ", num_shards));
  if (num_shards > 1 && static_cast<size_t>(num_shards) > entries_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot split ", entries_.size(), " tensors into ", num_shards, " non-empty shards"));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("create directory ", dir, ": ", ec.message()));
  if (num_shards == 1) return Write(absl::StrCat(dir, "/", kSingleName));

  // Runs of consecutive tensors of about total/N bytes; every shard non-empty.
  const uint64_t total = total_bytes();
  const size_t n = entries_.size();
  std::vector<int> shard_of(n);
  int shard = 0;
  uint64_t cumulative = 0;
  size_t in_shard = 0;
  for (size_t i = 0; i < n; ++i) {
    const size_t left = n - i;
    const size_t shards_left = static_cast<size_t>(num_shards - 1 - shard);
    const long double target = static_cast<long double>(total) * (shard + 1) / num_shards;
    if (in_shard > 0 && shards_left > 0 && (left == shards_left || cumulative >= target)) {
      ++shard;
      in_shard = 0;
    }
    shard_of[i] = shard;
    cumulative += entries_[i].nbytes;
    ++in_shard;
  }

  nlohmann::json weight_map = nlohmann::json::object();
  for (int k = 0; k < num_shards; ++k) {
    const std::string file = absl::StrFormat("model-%05d-of-%05d.safetensors", k + 1, num_shards);
    std::vector<WriteEntry> entries;
    for (size_t i = 0; i < n; ++i) {
      if (shard_of[i] != k) continue;
      const Entry& e = entries_[i];
      entries.push_back(ToWriteEntry(e.name, e.dtype, e.shape, e.bytes, e.fill, e.nbytes));
      weight_map[e.name] = file;
    }
    if (auto s = WriteSafetensorsFile(absl::StrCat(dir, "/", file), std::move(entries), metadata_); !s.ok()) {
      return s;
    }
  }
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", std::move(weight_map)}};
  std::string text;
  try {
    text = index.dump(2) + "\n";
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(dir, "/", kIndexName, ": cannot encode index: ", e.what()));
  }
  return WriteTextFile(absl::StrCat(dir, "/", kIndexName), text);
}

}  // namespace vlm
