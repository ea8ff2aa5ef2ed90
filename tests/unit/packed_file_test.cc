// The packed-weight file (services/language/model/packed_file.h) under the
// decoder, on the tiny checkpoint:
//   - a first Load builds it, a second maps it and converts nothing (no layer,
//     no LM head), and the logits are bit-identical to packing in memory
//     (packed bf16, int8 and int4 forms), also under --resident_layers with drops;
//   - every bad file is rejected with its reason counted and the decoder
//     still loads and gives the same logits: truncated, corrupt header,
//     corrupt section (found lazily at the layer's first use), another
//     checkpoint's key, another layout version; and a directory that cannot
//     be written (read-only, full disk) leaves the layers packed in memory.
// Read-only directory: as root, this thread drops CAP_DAC_OVERRIDE (capset)
// so that a mode-0555 directory refuses it. Full disk: RLIMIT_FSIZE (the
// write fails with EFBIG, as a full disk fails with ENOSPC; both are
// RESOURCE_EXHAUSTED, counted as disk_full).
#include <fcntl.h>
#include <linux/capability.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/cpu_features.h"
#include "common/kernels/gemm.h"
#include "common/kernels/gemv_int8.h"
#include "common/metrics.h"
#include "services/language/model/decoder.h"
#include "services/language/model/packed_file.h"
#include "tests/unit/metrics_text.h"

namespace vlm::language {
namespace {

namespace fs = std::filesystem;

std::string TinyDir() {
  const char* v = std::getenv("VLM_BINARY_DIR");
  return std::string(v != nullptr && *v != '\0' ? v : ".") + "/tiny_checkpoint";
}

double Metric(const std::string& key) {
  return metrics_text::MetricValue(RenderMetrics(), key).value_or(0.0);
}
double Rejected(const std::string& reason) {
  return Metric("vlm_language_packed_file_rejected_total{reason=\"" + reason + "\"}");
}
double WriteFailures(const std::string& reason) {
  return Metric("vlm_language_packed_file_write_failures_total{reason=\"" + reason + "\"}");
}

TEST(PackedChecksumTest, IsXxh64) {
  // Reference values of XXH64 with seed 0 (xxHash's published algorithm).
  EXPECT_EQ(PackedChecksum("", 0), 0xef46db3751d8e999ull);
  EXPECT_EQ(PackedChecksum("abc", 3), 0x44bc2cf5ad770999ull);
  const std::string long_text = "Nobody inspects the spammish repetition";
  EXPECT_EQ(PackedChecksum(long_text.data(), long_text.size()), 0xfbcea83c8a378bf1ull);
  const std::string xs(1000, 'x');
  EXPECT_EQ(PackedChecksum(xs.data(), xs.size()), 0x4cb9a3b69cb700e1ull);
}

struct Loaded {
  std::unique_ptr<Decoder> decoder;
  at::Tensor logits;
};

class PackedFileTest : public ::testing::TestWithParam<WeightDType> {
 protected:
  void SetUp() override {
    std::string why;
    if (GetParam() == WeightDType::kBFloat16 &&
        kernels::DefaultGemmPath() == kernels::GemmPath::kTorch) {
      GTEST_SKIP() << "packed bf16 layers need AVX-512 BF16 or AMX";
    }
    if (GetParam() == WeightDType::kInt8 &&
        !kernels::GemvInt8PathSupported(kernels::DefaultGemvInt8Path(), &why)) {
      GTEST_SKIP() << why;
    }
    if (GetParam() == WeightDType::kInt4 && !GetCpuFeatures().fast_bf16_matmul()) {
      GTEST_SKIP() << "int4 layers need the bf16 compute dtype";
    }
    char tmpl[] = "/tmp/vlm_packed_test_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    dir_ = root_ + "/packed";
    reference_ = Load("", 0);  // packed in memory, as without the file
    ASSERT_NE(reference_.decoder, nullptr);
    EXPECT_EQ(reference_.decoder->packed_file_outcome().state, "unavailable");
  }
  void TearDown() override {
    if (!root_.empty()) {
      ::chmod(dir_.c_str(), 0755);
      std::error_code ec;
      fs::remove_all(root_, ec);
    }
  }

  // Loads the tiny decoder with packed_dir `dir` and runs a prompt of 12
  // tokens then two decode steps; the logits of the three logit rows.
  // int8_layers: DecoderOptions::int4_int8_layers (int4 form only; the
  // default on the tiny model's 4 layers: layer 0 int8, the rest int4).
  Loaded Load(const std::string& dir, int resident_layers, bool background = true,
              int int8_layers = kAutoInt4Int8Layers) {
    Loaded out;
    auto ckpt = SafetensorsCheckpoint::Open(TinyDir());
    EXPECT_TRUE(ckpt.ok()) << ckpt.status();
    auto config = LoadModelConfig(TinyDir());
    EXPECT_TRUE(config.ok()) << config.status();
    if (!ckpt.ok() || !config.ok()) return out;
    DecoderOptions o;
    o.matmul = MatmulPath::kKernels;
    o.weight_dtype = GetParam();
    // int4 layers with the int4 LM head: the head's own sections in the file
    // (the int8 head is covered by the int8 form).
    o.int4_lm_head = GetParam() == WeightDType::kInt4;
    o.int4_int8_layers = int8_layers;
    o.packed_dir = dir;
    o.layers.resident_layers = resident_layers;
    o.layers.background_materialize = background;
    auto d = Decoder::Load(std::shared_ptr<const SafetensorsCheckpoint>(*std::move(ckpt)), *config,
                           o);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return out;
    out.decoder = *std::move(d);
    const Decoder& dec = *out.decoder;
    auto kv = dec.NewKvStorage(4, 16);
    EXPECT_TRUE(kv.ok()) << kv.status();
    if (!kv.ok()) return out;
    std::vector<int32_t> ids;
    for (int i = 0; i < 14; ++i) ids.push_back(static_cast<int32_t>((i * 37 + 11) % 500));
    const std::vector<int32_t> table = {0, 1, 2, 3};
    std::vector<at::Tensor> rows;
    for (int step = 0; step < 3; ++step) {
      SequenceChunk c;
      const int64_t start = step == 0 ? 0 : 11 + step;
      const int64_t n = step == 0 ? 12 : 1;
      c.token_ids = absl::MakeConstSpan(ids).subspan(start, n);
      c.start = start;
      c.block_table = table;
      c.positions = at::arange(start, start + n, at::TensorOptions().dtype(at::kLong))
                        .unsqueeze(0)
                        .expand({3, n})
                        .contiguous();
      c.decode = step > 0;
      c.logits = true;
      const SequenceChunk chunks[] = {c};
      auto logits = dec.Forward(*kv, chunks);
      EXPECT_TRUE(logits.ok()) << logits.status();
      if (!logits.ok()) return out;
      rows.push_back(*logits);
    }
    out.logits = at::cat(rows, 0);
    return out;
  }

  std::string FilePath() const {
    for (const auto& e : fs::directory_iterator(dir_)) {
      if (e.path().extension() == ".vlmpack") return e.path().string();
    }
    return "";
  }

  // Builds the file with a first Load; its path.
  std::string Build() {
    Loaded first = Load(dir_, 0);
    EXPECT_NE(first.decoder, nullptr);
    if (first.decoder == nullptr) return "";
    EXPECT_EQ(first.decoder->packed_file_outcome().state, "built");
    EXPECT_TRUE(at::equal(first.logits, reference_.logits));
    return FilePath();
  }

  // A Load after a bad file: rebuilt (reason counted), same logits.
  void ExpectRebuiltAfter(const std::string& reason) {
    const double before = Rejected(reason);
    Loaded again = Load(dir_, 0);
    ASSERT_NE(again.decoder, nullptr);
    EXPECT_EQ(again.decoder->packed_file_outcome().state, "built");
    EXPECT_EQ(again.decoder->packed_file_outcome().reason.rfind(reason + ":", 0), 0u)
        << again.decoder->packed_file_outcome().reason;
    EXPECT_EQ(Rejected(reason), before + 1);
    EXPECT_TRUE(at::equal(again.logits, reference_.logits));
    Loaded mapped = Load(dir_, 0);  // the rewritten file is trusted
    ASSERT_NE(mapped.decoder, nullptr);
    EXPECT_EQ(mapped.decoder->packed_file_outcome().state, "mapped");
  }

  std::string root_, dir_;
  Loaded reference_;
};

TEST_P(PackedFileTest, BuiltOnFirstLoadMappedOnSecondWithIdenticalLogits) {
  Loaded first = Load(dir_, 0);
  ASSERT_NE(first.decoder, nullptr);
  EXPECT_EQ(first.decoder->packed_file_outcome().state, "built");
  const std::string path = FilePath();
  ASSERT_FALSE(path.empty());
  // Only the final file (the temporary one was renamed) and, every section
  // having been checked by this first process, its verified-once marker.
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir_)) (void)e, ++entries;
  EXPECT_EQ(entries, 2);
  EXPECT_TRUE(fs::exists(path + ".verified"));
  ASSERT_NE(first.decoder->layers().packed_file(), nullptr);
  EXPECT_FALSE(first.decoder->layers().packed_file()->trusted());

  Loaded second = Load(dir_, 0);
  ASSERT_NE(second.decoder, nullptr);
  EXPECT_EQ(second.decoder->packed_file_outcome().state, "mapped");
  EXPECT_EQ(second.decoder->layers().conversions(), 0);  // nothing converted
  EXPECT_EQ(second.decoder->head_conversions(), 0);
  ASSERT_NE(second.decoder->layers().packed_file(), nullptr);
  EXPECT_TRUE(second.decoder->layers().packed_file()->trusted());  // no hashing at this start
  EXPECT_NE(second.decoder->load_summary().find("mapped from the packed file"), std::string::npos)
      << second.decoder->load_summary();
  EXPECT_EQ(Metric("vlm_language_packed_file{state=\"mapped\"}"), 1);
  EXPECT_TRUE(at::equal(first.logits, reference_.logits));
  EXPECT_TRUE(at::equal(second.logits, reference_.logits));
  EXPECT_GT(reference_.decoder->layers().conversions(), 0);
}

TEST_P(PackedFileTest, ResidentBoundDropsMappedLayersWithIdenticalLogits) {
  Build();
  Loaded bounded = Load(dir_, 1, /*background=*/false);
  ASSERT_NE(bounded.decoder, nullptr);
  const LayerStore& layers = bounded.decoder->layers();
  EXPECT_EQ(bounded.decoder->packed_file_outcome().state, "mapped");
  EXPECT_GT(layers.evictions(), 0);
  EXPECT_LE(layers.resident_layers(), 2);
  EXPECT_EQ(layers.conversions(), 0);
  EXPECT_TRUE(at::equal(bounded.logits, reference_.logits));
}

// int4 with another count of int8 layers is another layout: its own file,
// built beside the first, and both map afterwards with their own logits.
TEST_P(PackedFileTest, Int4WithOtherInt8LayersHasItsOwnFile) {
  if (GetParam() != WeightDType::kInt4) GTEST_SKIP() << "int8 leading layers are an int4 option";
  const std::string first = Build();
  ASSERT_FALSE(first.empty());
  Loaded in_memory = Load("", 0, true, 2);
  ASSERT_NE(in_memory.decoder, nullptr);
  EXPECT_FALSE(at::equal(in_memory.logits, reference_.logits));  // layer 1 is int8 now
  Loaded built = Load(dir_, 0, true, 2);
  ASSERT_NE(built.decoder, nullptr);
  EXPECT_EQ(built.decoder->packed_file_outcome().state, "built");
  EXPECT_NE(built.decoder->packed_file_outcome().path, first);
  EXPECT_NE(built.decoder->packed_file_outcome().path.find("int8x2"), std::string::npos);
  EXPECT_TRUE(at::equal(built.logits, in_memory.logits));
  Loaded mapped = Load(dir_, 0, true, 2);
  ASSERT_NE(mapped.decoder, nullptr);
  EXPECT_EQ(mapped.decoder->packed_file_outcome().state, "mapped");
  EXPECT_TRUE(at::equal(mapped.logits, in_memory.logits));
  Loaded again = Load(dir_, 0);  // the default's file is untouched
  ASSERT_NE(again.decoder, nullptr);
  EXPECT_EQ(again.decoder->packed_file_outcome().state, "mapped");
  EXPECT_TRUE(at::equal(again.logits, reference_.logits));
}

TEST_P(PackedFileTest, TruncatedFileIsRebuilt) {
  const std::string path = Build();
  ASSERT_FALSE(path.empty());
  fs::resize_file(path, fs::file_size(path) / 2);
  ExpectRebuiltAfter("truncated");
}

TEST_P(PackedFileTest, CorruptHeaderIsRebuilt) {
  const std::string path = Build();
  ASSERT_FALSE(path.empty());
  ASSERT_TRUE(fs::exists(path + ".verified"));  // the write below must invalidate it
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(60);  // inside the key text, covered by the header checksum
    f.put('#');
  }
  ExpectRebuiltAfter("corrupt");
}

TEST_P(PackedFileTest, CorruptSectionConvertsThatLayerAndDiscardsTheFile) {
  const std::string path = Build();
  ASSERT_FALSE(path.empty());
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(4096 + 1);  // layer 0's first section
    const char c = static_cast<char>(f.get());
    f.seekp(4096 + 1);
    f.put(static_cast<char>(c ^ 0x5a));
  }
  const double before = Rejected("section_checksum");
  Loaded loaded = Load(dir_, 0);
  ASSERT_NE(loaded.decoder, nullptr);
  EXPECT_EQ(loaded.decoder->packed_file_outcome().state, "mapped");  // the header is sound
  EXPECT_EQ(Rejected("section_checksum"), before + 1);
  EXPECT_EQ(loaded.decoder->layers().conversions(), 1);  // layer 0 only, from the checkpoint
  EXPECT_TRUE(at::equal(loaded.logits, reference_.logits));
  ASSERT_NE(loaded.decoder->layers().packed_file(), nullptr);
  EXPECT_FALSE(loaded.decoder->layers().packed_file()->trusted());
  EXPECT_FALSE(fs::exists(path));  // discarded: the next start rebuilds it
  EXPECT_FALSE(fs::exists(path + ".verified"));
  Loaded next = Load(dir_, 0);
  ASSERT_NE(next.decoder, nullptr);
  EXPECT_EQ(next.decoder->packed_file_outcome().state, "built");
}

TEST_P(PackedFileTest, AnotherCheckpointsFileIsRebuilt) {
  const std::string path = Build();
  ASSERT_FALSE(path.empty());
  // A well-formed file under this name but keyed to another checkpoint.
  PackedFileKey foreign;
  foreign.checkpoint = std::string(64, 'f');
  foreign.form = GetParam() == WeightDType::kInt8 ? "int8/g32-i512" : "packed/bf16-panels32";
  foreign.stem = "other";
  auto writer = PackedFileWriter::Create(root_ + "/other", foreign);
  ASSERT_TRUE(writer.ok()) << writer.status();
  const std::string bytes(5000, '\1');
  ASSERT_TRUE((*writer)->Add(0, "input_layernorm", bytes.data(), bytes.size()).ok());
  ASSERT_TRUE((*writer)->Commit().ok());
  fs::rename((*writer)->path(), path);
  ExpectRebuiltAfter("foreign");
}

TEST_P(PackedFileTest, OtherLayoutVersionIsRebuilt) {
  const std::string path = Build();
  ASSERT_FALSE(path.empty());
  {
    // Version 0 with a valid header checksum: only the version is wrong.
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    std::string header(4096, '\0');
    f.read(header.data(), header.size());
    uint32_t version = 0, key_len = 0;
    std::memcpy(&key_len, header.data() + 12, 4);
    std::memcpy(header.data() + 8, &version, 4);
    const uint64_t sum = PackedChecksum(header.data(), 48 + key_len);
    std::memcpy(header.data() + 48 + key_len, &sum, 8);
    f.seekp(0);
    f.write(header.data(), header.size());
  }
  ExpectRebuiltAfter("layout_version");
}

// Drops CAP_DAC_OVERRIDE (and friends) from this thread's effective set while alive.
class WithoutDacOverride {
 public:
  WithoutDacOverride() {
    header_.version = _LINUX_CAPABILITY_VERSION_3;
    header_.pid = 0;
    if (syscall(SYS_capget, &header_, saved_) != 0) return;
    __user_cap_data_struct reduced[2] = {saved_[0], saved_[1]};
    reduced[0].effective &= ~((1u << CAP_DAC_OVERRIDE) | (1u << CAP_DAC_READ_SEARCH) |
                              (1u << CAP_FOWNER));
    active_ = syscall(SYS_capset, &header_, reduced) == 0;
  }
  ~WithoutDacOverride() {
    if (active_) syscall(SYS_capset, &header_, saved_);
  }

 private:
  __user_cap_header_struct header_{};
  __user_cap_data_struct saved_[2]{};
  bool active_ = false;
};

TEST_P(PackedFileTest, ReadOnlyDirectoryPacksInMemory) {
  fs::create_directories(dir_);
  ASSERT_EQ(::chmod(dir_.c_str(), 0555), 0);
  WithoutDacOverride no_override;
  const std::string probe = dir_ + "/probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT, 0644);
  if (fd >= 0) {
    ::close(fd);
    ::unlink(probe.c_str());
    GTEST_SKIP() << "this process can write into a mode-0555 directory";
  }
  const double before = WriteFailures("unwritable");
  Loaded loaded = Load(dir_, 0);
  ASSERT_NE(loaded.decoder, nullptr);
  EXPECT_EQ(loaded.decoder->packed_file_outcome().state, "unavailable");
  EXPECT_EQ(loaded.decoder->packed_file_outcome().reason.rfind("unwritable:", 0), 0u)
      << loaded.decoder->packed_file_outcome().reason;
  EXPECT_EQ(WriteFailures("unwritable"), before + 1);
  EXPECT_TRUE(at::equal(loaded.logits, reference_.logits));
}

TEST_P(PackedFileTest, FullDiskPacksInMemoryAndLeavesNoTemporaryFile) {
  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  struct sigaction ignore {}, old {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGXFSZ, &ignore, &old), 0);
  struct rlimit small = saved;
  small.rlim_cur = 64 * 1024;  // the header and a few sections fit, not the layers
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const double before = WriteFailures("disk_full");
  Loaded loaded = Load(dir_, 0);
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::sigaction(SIGXFSZ, &old, nullptr);
  ASSERT_NE(loaded.decoder, nullptr);
  EXPECT_EQ(loaded.decoder->packed_file_outcome().state, "unavailable");
  EXPECT_EQ(loaded.decoder->packed_file_outcome().reason.rfind("disk_full:", 0), 0u)
      << loaded.decoder->packed_file_outcome().reason;
  EXPECT_EQ(WriteFailures("disk_full"), before + 1);
  EXPECT_TRUE(fs::is_empty(dir_));  // the partial temporary file is removed
  EXPECT_TRUE(at::equal(loaded.logits, reference_.logits));
}

INSTANTIATE_TEST_SUITE_P(Forms, PackedFileTest,
                         ::testing::Values(WeightDType::kBFloat16, WeightDType::kInt8,
                                           WeightDType::kInt4),
                         [](const auto& info) {
                           return std::string(info.param == WeightDType::kInt8   ? "Int8"
                                              : info.param == WeightDType::kInt4 ? "Int4"
                                                                                 : "PackedBf16");
                         });

}  // namespace
}  // namespace vlm::language
