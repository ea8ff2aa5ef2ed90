// The packed-weight file: the decoder's weights in the kernels' layout
// (packed bf16 panels, int8 rows + scales, ...), written once per checkpoint
// and form, then mapped read-only by every later start, which converts
// nothing. Its pages are the page cache's: replicas on a node share them, and
// a dropped layer is madvise(DONTNEED)-ed like the checkpoint's own pages.
//
// Contents: groups (a decoder layer, or the LM head), each a list of named
// flat byte arrays ("sections"); what the names mean is the layer store's
// business (layer_store.cc, one entry per projection form). Every section
// starts on a page boundary (64-byte alignment for the kernels, and a layer's
// pages can be dropped without touching its neighbours').
//
// Layout (little-endian):
//   [0, 4096)       header: magic "VLMPACK\0", layout version, file size,
//                   table offset/size/checksum, the key as text, and the
//                   header's own checksum (over every header byte before it)
//   [4096, table)   sections, each page-aligned
//   [table, size)   section table: group, name, offset, size, checksum
// Checksums are XXH64 (seed 0). The header and the table are verified at
// Open (a few KB); a section's checksum is verified lazily, by VerifyGroup,
// when its layer is first materialized in a process: that read is the page-in
// the layer needs anyway, whereas verifying every section at Open would read
// the whole file (GBs) before the first request and defeat the mapping. Once
// one process has verified every section, a marker beside the file lets later
// starts skip the hashing (a CPU-second or more on the 2B at start-up).
//
// Writing: PackedFileWriter writes "<name>.tmp.<pid>.<n>" in the directory,
// fsyncs it and renames it into place (readers see a whole file or none).
//
// Rejection reasons (Open's `reason`, the label of
// vlm_language_packed_file_rejected_total): "truncated" (shorter or longer
// than its header says), "corrupt" (bad magic, header or table checksum,
// malformed table), "foreign" (another checkpoint's or form's key),
// "layout_version" (written by another layout version), "section_checksum"
// (a section failed VerifyGroup), "io_error" (cannot be read or mapped).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vlm::language {

// Bumped whenever any form's section layout changes: older files are
// rejected ("layout_version") and rebuilt.
inline constexpr uint32_t kPackedLayoutVersion = 1;

// XXH64 of `size` bytes (seed 0).
uint64_t PackedChecksum(const void* data, uint64_t size);

// What a file must have been built from and for.
struct PackedFileKey {
  std::string checkpoint;  // PackedCheckpointId (tensor headers, files' size/mtime)
  std::string form;        // the projection form's layout, e.g. "packed/bf16-panels32"
  // Names the file, not part of the key: where the checkpoint lives
  // (PackedFileStem), so that a checkpoint rewritten in place, or a new
  // layout version, replaces its old file instead of adding one beside it.
  std::string stem;
  // One line, stored in the header and compared whole at Open.
  std::string Text() const;
  // "<stem>-<form with '/' as '-'>.vlmpack".
  std::string FileName() const;
};

// Counts a rejection (vlm_language_packed_file_rejected_total{reason}).
void CountPackedFileRejection(const std::string& reason);

class PackedFile {
 public:
  struct Section {
    int32_t group = 0;
    std::string name;
    uint64_t offset = 0, size = 0, checksum = 0;
  };

  // Maps `path` read-only and validates its header and table against `key`
  // (not the sections' bytes: VerifyGroup). On failure `*reason` is one of
  // the reasons above ("missing" when there is no file) and the status says why.
  static absl::StatusOr<std::shared_ptr<PackedFile>> Open(const std::string& path,
                                                          const PackedFileKey& key,
                                                          std::string* reason);
  ~PackedFile();

  // The section's bytes in the mapping (nullptr when absent).
  const Section* Find(int32_t group, std::string_view name) const;
  const uint8_t* data(const Section& s) const { return base_ + s.offset; }
  // Keeps the mapping alive (for views handed to the kernels).
  std::shared_ptr<const void> owner() const { return owner_; }
  bool HasGroup(int32_t group) const;

  // Checks the checksums of the group's sections once per process (later calls
  // return the first verdict); DATA_LOSS names the first bad section. When
  // every group has passed, writes the verified-once marker "<path>.verified"
  // (device, inode, size, mtime and ctime in ns, header checksum); a later
  // Open that finds a matching marker is trusted() and VerifyGroup returns OK
  // without hashing (any write to the file or a rebuild invalidates it).
  absl::Status VerifyGroup(int32_t group) const;
  bool trusted() const;
  // madvise over the group's pages: WILLNEED (read-ahead), touching one byte
  // per page (all mapped on return), DONTNEED (out of this process's RSS; the
  // page cache keeps them).
  void PrefetchGroup(int32_t group) const;
  void TouchGroup(int32_t group) const;
  void EvictGroup(int32_t group) const;

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  // Removes the file from its directory when it is still the one mapped (a
  // section failed its checksum): the next start rebuilds it.
  void Discard() const;

 private:
  PackedFile() = default;
  struct GroupState;
  std::string path_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  uint64_t inode_ = 0, device_ = 0;
  std::shared_ptr<const void> owner_;  // munmaps
  std::vector<Section> sections_;
  std::unique_ptr<GroupState> groups_;
};

class PackedFileWriter {
 public:
  // Creates `dir` if needed and opens a temporary file in it: FAILED_PRECONDITION
  // (or the errno's code) naming the directory when it is not writable.
  static absl::StatusOr<std::unique_ptr<PackedFileWriter>> Create(const std::string& dir,
                                                                  const PackedFileKey& key);
  ~PackedFileWriter();  // removes the temporary file unless Commit succeeded

  // Appends one section at the next page boundary; RESOURCE_EXHAUSTED on a
  // full disk (ENOSPC, EFBIG), else the errno's status.
  absl::Status Add(int32_t group, const std::string& name, const void* data, uint64_t size);
  // Writes table and header, fsyncs and renames onto the final name.
  absl::Status Commit();
  const std::string& path() const { return final_path_; }
  uint64_t bytes_written() const { return offset_; }

 private:
  PackedFileWriter() = default;
  absl::Status Write(const void* data, uint64_t size, uint64_t offset);
  int fd_ = -1;
  std::string dir_, tmp_path_, final_path_;
  PackedFileKey key_;
  uint64_t offset_ = 0;
  std::vector<PackedFile::Section> sections_;
  bool committed_ = false;
};

}  // namespace vlm::language
