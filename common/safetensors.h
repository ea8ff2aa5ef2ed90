// Safetensors checkpoints over mmap: a single file or shards joined by
// model.safetensors.index.json. Every header is validated before any tensor is
// handed out; tensors are zero-copy, read-only views of the mapping.
//
// Thread-safety: a SafetensorsCheckpoint is immutable after Open and may be
// shared by threads. Tensors returned by Tensor() keep the mapping alive.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
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
  // model.safetensors) or a single .safetensors file path.
  static absl::StatusOr<std::unique_ptr<SafetensorsCheckpoint>> Open(const std::string& path);
  ~SafetensorsCheckpoint();

  bool Has(const std::string& name) const;
  // Header facts of one tensor; NOT_FOUND naming the tensor if absent.
  absl::StatusOr<const TensorInfo*> Info(const std::string& name) const;
  // A zero-copy at::Tensor over the mapping (read-only: never write in place).
  // Only float dtypes and integer dtypes LibTorch knows are supported.
  absl::StatusOr<at::Tensor> Tensor(const std::string& name) const;
  // The tensor's raw bytes in the mapping.
  absl::StatusOr<absl::Span<const uint8_t>> Bytes(const std::string& name) const;

  // Page management for lazy loading: WILLNEED prefetch / touch every page /
  // DONTNEED drop. Applied to the whole pages the tensor covers.
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
// header padding as the reference library does).
class SafetensorsWriter {
 public:
  // Adds a tensor by raw little-endian bytes; bytes.size() must match shape x dtype.
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
  // dir (tensors split in insertion order by size). num_shards == 1 writes
  // model.safetensors and no index.
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
  std::map<std::string, std::string> metadata_;
};

}  // namespace vlm
