// libFuzzer target: safetensors header parsing and sharded-index parsing,
// through SafetensorsCheckpoint::Open on real files (the reader mmaps them).
//
// Input: byte 0 selects the mode, the rest is the payload.
//   even: the payload is a whole .safetensors file.
//   odd:  the payload is model.safetensors.index.json, in a directory that
//         also holds two valid shards written once per process:
//         a.safetensors {x: F32 [2], y: BF16 [3]} and b.safetensors {z: U8 [4]}.
// Files go to a private temporary directory (under $TMPDIR or /tmp), removed
// at exit. Properties of an opened checkpoint: every tensor's bytes lie inside
// its file and number numel x dtype size; Bytes, Tensor (for dtypes LibTorch
// has), Touch, Prefetch and Evict work on every name Names() lists.
#include <ATen/ATen.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/safetensors.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

namespace fs = std::filesystem;

struct Workspace {
  fs::path single;  // holds model.safetensors
  fs::path sharded;  // holds the two shards and the fuzzed index
};

void WriteFile(const fs::path& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  FUZZ_CHECK(out.good(), "cannot write %s", path.c_str());
}

const Workspace& SharedWorkspace() {
  static const Workspace* ws = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
                        "/vlm-safetensors-fuzz-XXXXXX";
    FUZZ_CHECK(mkdtemp(templ.data()) != nullptr, "mkdtemp %s failed", templ.c_str());
    static std::string root = templ;
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(root, ec);
    });
    auto* w = new Workspace{fs::path(root) / "single", fs::path(root) / "sharded"};
    fs::create_directories(w->single);
    fs::create_directories(w->sharded);
    vlm::SafetensorsWriter a;
    FUZZ_CHECK(a.Add("x", vlm::StDType::kF32, {2}, std::string(8, '\1')).ok(), "add x");
    FUZZ_CHECK(a.Add("y", vlm::StDType::kBF16, {3}, std::string(6, '\2')).ok(), "add y");
    FUZZ_CHECK(a.Write((w->sharded / "a.safetensors").string()).ok(), "write a");
    vlm::SafetensorsWriter b;
    FUZZ_CHECK(b.Add("z", vlm::StDType::kU8, {4}, std::string(4, '\3')).ok(), "add z");
    FUZZ_CHECK(b.Write((w->sharded / "b.safetensors").string()).ok(), "write b");
    return w;
  }();
  return *ws;
}

bool TorchHasDType(vlm::StDType d) {
  return d != vlm::StDType::kU16 && d != vlm::StDType::kU32 && d != vlm::StDType::kU64;
}

void Exercise(const vlm::SafetensorsCheckpoint& ckpt) {
  for (const std::string& name : ckpt.Names()) {
    auto info = ckpt.Info(name);
    FUZZ_CHECK(info.ok(), "Info(%s) failed for a listed name", name.c_str());
    const vlm::TensorInfo& t = **info;
    FUZZ_CHECK(t.data_begin <= t.data_end, "%s: begin > end", name.c_str());
    FUZZ_CHECK(t.file_index >= 0 && t.file_index < static_cast<int>(ckpt.files().size()),
               "%s: file index %d", name.c_str(), t.file_index);
    std::error_code ec;
    const uintmax_t file_size = fs::file_size(ckpt.files()[t.file_index], ec);
    FUZZ_CHECK(!ec && t.data_end <= file_size, "%s: end %llu past the file (%ju bytes)",
               name.c_str(), static_cast<unsigned long long>(t.data_end), file_size);
    FUZZ_CHECK(t.nbytes() == t.numel() * vlm::StDTypeSize(t.dtype), "%s: %llu bytes for %llu "
               "elements", name.c_str(), static_cast<unsigned long long>(t.nbytes()),
               static_cast<unsigned long long>(t.numel()));
    auto bytes = ckpt.Bytes(name);
    FUZZ_CHECK(bytes.ok() && bytes->size() == t.nbytes(), "Bytes(%s)", name.c_str());
    uint8_t sum = 0;
    for (uint8_t v : *bytes) sum ^= v;  // every byte is readable
    (void)sum;
    if (TorchHasDType(t.dtype)) {
      auto tensor = ckpt.Tensor(name);
      FUZZ_CHECK(tensor.ok(), "Tensor(%s): %s", name.c_str(), tensor.status().ToString().c_str());
      FUZZ_CHECK(static_cast<uint64_t>(tensor->numel()) == t.numel(), "Tensor(%s) numel",
                 name.c_str());
    }
    FUZZ_CHECK(ckpt.Touch(name).ok() && ckpt.Prefetch(name).ok() && ckpt.Evict(name).ok(),
               "page management of %s failed", name.c_str());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Workspace& ws = SharedWorkspace();
  if (size == 0) return 0;
  std::string path;
  if ((data[0] & 1) == 0) {
    path = (ws.single / "model.safetensors").string();
    WriteFile(path, data + 1, size - 1);
  } else {
    WriteFile(ws.sharded / "model.safetensors.index.json", data + 1, size - 1);
    path = ws.sharded.string();
  }
  auto ckpt = vlm::SafetensorsCheckpoint::Open(path);
  if (ckpt.ok()) Exercise(**ckpt);
  return 0;
}
