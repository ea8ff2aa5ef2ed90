// Safetensors checkpoints over mmap: a single file or shards joined by
// model.safetensors.index.json. Every header is validated before any tensor is
// handed out; tensors are zero-copy, read-only views of the mapping.
//
// Validation (every error names the file, and the tensor where there is one):
// header length <= 100'000'000 and within the file; the header is one JSON
// object without duplicate keys; each entry has a string dtype this format
// knows, a shape of non-negative integers and data_offsets [begin, end] with
// begin <= end inside the data section, end - begin == numel x dtype size; no
// two tensors share a byte; `__metadata__` maps strings to strings. Gaps
// between tensors and trailing bytes after the last one are accepted.
// Sharded checkpoints: the index is a JSON object with a `weight_map` object
// (tensor -> shard file name, no directories); every shard it names must exist
// and hold exactly the tensors the index maps to it: a shard tensor the index
// does not map to that shard is an error (catches stale or mixed shards).
//
// Thread-safety: a SafetensorsCheckpoint is immutable after Open and may be
// shared by threads. Tensors returned by Tensor() keep the mapping alive.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace at {
class Tensor;
}

namespace vlm {

// Element types of the safetensors format.
enum class StDType { kBool, kU8, kI8, kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kF64, kI64, kU64 };

// "BF16" -> kBF16 etc.; error for an unknown name.
absl::StatusOr<StDType> ParseStDType(const std::string& name);
const char* StDTypeName(StDType dtype);
size_t StDTypeSize(StDType dtype);

struct TensorInfo {
  std::string name;
  StDType dtype;
  std::vector<int64_t> shape;
  uint64_t data_begin = 0;  // absolute offset in its file
  uint64_t data_end = 0;    // one past the last byte
  int file_index = 0;       // index into SafetensorsCheckpoint::files()
  uint64_t numel() const;
  uint64_t nbytes() const { return data_end - data_begin; }
};

// One mapped file. Owns the mapping; unmapped when the last user is gone.
class MappedFile;

class SafetensorsCheckpoint {
 public:
  // Opens a model directory (model.safetensors.index.json if present, else
  // model.safetensors), an index .json file, or a single .safetensors file.
  // NOT_FOUND for missing files, INVALID_ARGUMENT for malformed ones.
  static absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> Open(const std::string& path);
  ~SafetensorsCheckpoint();

  bool Has(const std::string& name) const;
  // Header facts of one tensor; NOT_FOUND naming the tensor if absent.
  absl::StatusOr<const TensorInfo*> Info(const std::string& name) const;
  // A zero-copy at::Tensor over the mapping (read-only: never write in place;
  // the pages are PROT_READ and a write faults). The tensor keeps the mapping
  // alive. Only dtypes LibTorch knows are supported (not U16/U32/U64). A tensor
  // whose bytes are not aligned to its element size is returned as a copy.
  absl::StatusOr<at::Tensor> Tensor(const std::string& name) const;
  // The tensor's raw bytes in the mapping.
  absl::StatusOr<absl::Span<const uint8_t>> Bytes(const std::string& name) const;

  // Page management for lazy loading, applied to the whole pages the tensor
  // covers (so neighbours sharing a boundary page are affected too):
  // Prefetch = madvise(WILLNEED), asynchronous read-ahead; Touch = read one
  // byte per page so every page is mapped on return; Evict = madvise(DONTNEED):
  // the pages leave this process's RSS (they stay in the page cache and fault
  // back in on the next access).
  absl::Status Prefetch(const std::string& name) const;
  absl::Status Touch(const std::string& name) const;
  absl::Status Evict(const std::string& name) const;

  // Sorted tensor names.
  std::vector<std::string> Names() const;
  const std::vector<std::string>& files() const { return files_; }
  uint64_t total_bytes() const;  // sum of tensor bytes
  size_t size() const { return tensors_.size(); }
  // __metadata__ of each file, merged (first file wins on conflict).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsCheckpoint() = default;
  std::vector<std::string> files_;
  std::vector<std::shared_ptr<MappedFile>> maps_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  friend class SafetensorsLoader;
};

// Writes safetensors files for tools and tests (header + data, 8-byte aligned
// header padding as the reference library does). Within a file, tensors are
// laid out by decreasing element size (then insertion order) so every tensor is
// aligned to its element size. Files are written to "<path>.tmp.<pid>" and
// renamed into place; lazy tensors are filled straight into the output file's
// pages, so a checkpoint never sits in memory. Not thread-safe.
class SafetensorsWriter {
 public:
  // Adds a tensor by raw little-endian bytes; bytes.size() must match shape x
  // dtype. Names must be unique and not "__metadata__".
  absl::Status Add(const std::string& name, StDType dtype, std::vector<int64_t> shape,
                   std::string bytes);
  absl::Status Add(const std::string& name, const at::Tensor& tensor);  // contiguous copy
  // Adds a tensor whose bytes are produced at write time by `fill(dst)` (dst
  // holds shape x dtype bytes): multi-GB checkpoints never sit in memory.
  absl::Status AddLazy(const std::string& name, StDType dtype, std::vector<int64_t> shape,
                       std::function<void(uint8_t* dst)> fill);
  void SetMetadata(const std::string& key, const std::string& value);
  // Writes one file with every added tensor.
  absl::Status Write(const std::string& path) const;
  // Writes `num_shards` files model-0000k-of-0000N.safetensors + the index into
  // dir (created if missing; tensors split in insertion order into runs of
  // about total/N bytes, each shard non-empty). The index (written last) holds
  // metadata.total_size (sum of tensor bytes) and weight_map. num_shards == 1
  // writes model.safetensors and no index (an existing index is left alone).
  absl::Status WriteSharded(const std::string& dir, int num_shards) const;
  uint64_t total_bytes() const;

 private:
  struct Entry {
    std::string name;
    StDType dtype;
    std::vector<int64_t> shape;
    std::string bytes;                    // or, when empty,
    std::function<void(uint8_t*)> fill;  // produces the bytes at write time
    uint64_t nbytes = 0;
  };
  std::vector<Entry> entries_;
  std::set<std::string> names_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace vlm
