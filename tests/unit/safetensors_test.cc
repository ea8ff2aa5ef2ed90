#include "common/safetensors.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"

namespace vlm {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

// ---------------------------------------------------------------------------
// Helpers: temp dirs, byte-level file construction, /proc inspection.

class TempDir {
 public:
  explicit TempDir(fs::path base = fs::temp_directory_path()) {
    std::string tmpl = (base / "vlm_safetensors_XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string LE64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

// A safetensors file: 8-byte little-endian header length, header, data.
std::string StFile(const std::string& header, const std::string& data) { return LE64(header.size()) + header + data; }

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Bytes(std::initializer_list<int> b) {
  std::string s;
  for (int x : b) s.push_back(static_cast<char>(x));
  return s;
}

std::string TensorBytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

// The /proc/self/smaps region holding `p`: its file and resident size.
struct Region {
  std::string path;
  uint64_t rss_kb = 0;
};
std::optional<Region> RegionOf(const void* p) {
  std::ifstream in("/proc/self/smaps");
  std::string line;
  const auto addr = reinterpret_cast<uintptr_t>(p);
  bool inside = false;
  Region region;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string first;
    fields >> first;
    if (first.find(':') == std::string::npos && first.find('-') != std::string::npos) {
      if (inside) return region;  // the next region starts: no Rss line?
      uintptr_t begin = std::stoull(first.substr(0, first.find('-')), nullptr, 16);
      uintptr_t end = std::stoull(first.substr(first.find('-') + 1), nullptr, 16);
      inside = begin <= addr && addr < end;
      if (inside) {
        std::string perms, offset, dev, inode;
        fields >> perms >> offset >> dev >> inode;
        std::getline(fields >> std::ws, region.path);
      }
    } else if (inside && first == "Rss:") {
      fields >> region.rss_kb;
      return region;
    }
  }
  return std::nullopt;
}

uint64_t ProcStatusKb(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stoull(line.substr(key.size() + 1));
  }
  return 0;
}

// Tensors of several dtypes and odd sizes, in insertion order.
std::vector<std::pair<std::string, at::Tensor>> SampleTensors() {
  at::manual_seed(7);
  return {
      {"model.embed_tokens.weight", at::randn({7, 5}).to(at::kBFloat16)},  // 70 bytes: unaligned for what follows
      {"model.layers.0.mlp.up_proj.weight", at::randn({3, 2, 3}).to(at::kHalf)},
      {"model.layers.0.input_layernorm.weight", at::randn({11})},
      {"model.visual.pos_ids", at::randint(-100000, 100000, {4, 3}, at::kLong)},
      {"model.visual.empty", at::empty({0, 3})},
      {"model.norm.scale", at::tensor(3.5f).reshape({})},
      {"model.visual.mask", at::randint(0, 2, {5}, at::kByte)},
      {"model.layers.1.self_attn.q_proj.weight", at::randn({9, 3}).to(at::kBFloat16)},
      {"lm_head.weight", at::randn({2, 13})},
  };
}

void ExpectSameTensors(const SafetensorsCheckpoint& ckpt, const std::vector<std::pair<std::string, at::Tensor>>& want) {
  ASSERT_EQ(ckpt.size(), want.size());
  for (const auto& [name, expected] : want) {
    SCOPED_TRACE(name);
    auto t = ckpt.Tensor(name);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->scalar_type(), expected.scalar_type());
    EXPECT_EQ(t->sizes(), expected.sizes());
    EXPECT_TRUE(at::equal(*t, expected));
    EXPECT_EQ(TensorBytes(*t), TensorBytes(expected));  // bit-identical, not just ==
    if (t->numel() == 0) continue;
    // Zero copy: the tensor's data is the file's bytes, inside its mapping.
    auto bytes = ckpt.Bytes(name);
    ASSERT_TRUE(bytes.ok());
    EXPECT_EQ(t->data_ptr(), static_cast<const void*>(bytes->data()));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data_ptr()) % t->element_size(), 0u);
    auto region = RegionOf(t->data_ptr());
    ASSERT_TRUE(region.has_value());
    const TensorInfo* info = *ckpt.Info(name);
    EXPECT_EQ(region->path, fs::canonical(ckpt.files()[info->file_index]).string());
  }
}

// ---------------------------------------------------------------------------
// Round trips

TEST(SafetensorsTest, DTypeNamesAndSizes) {
  const std::vector<std::pair<std::string, size_t>> rows = {
      {"BOOL", 1}, {"U8", 1}, {"I8", 1},   {"I16", 2}, {"U16", 2}, {"F16", 2}, {"BF16", 2},
      {"I32", 4},  {"U32", 4}, {"F32", 4}, {"F64", 8}, {"I64", 8}, {"U64", 8}};
  for (const auto& [name, size] : rows) {
    auto d = ParseStDType(name);
    ASSERT_TRUE(d.ok()) << name;
    EXPECT_EQ(StDTypeName(*d), name);
    EXPECT_EQ(StDTypeSize(*d), size) << name;
  }
  EXPECT_FALSE(ParseStDType("bf16").ok());
  EXPECT_FALSE(ParseStDType("F8_E4M3").ok());
}

TEST(SafetensorsTest, ReadsAHandBuiltFile) {
  // Written byte by byte from the format description, independent of the writer.
  // "b" is F32 at data offset 2: not 4-aligned, so Tensor() must copy it.
  TempDir dir;
  std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]},)"
      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[2,10]},"c":{"dtype":"I64","shape":[1,1],"data_offsets":[16,24]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::string data = Bytes({0x80, 0x3f,                                       // bf16 1.0
                                  0x00, 0x00, 0xc0, 0x3f, 0x00, 0x00, 0x00, 0xc0,   // f32 1.5, -2
                                  0xee, 0xee, 0xee, 0xee, 0xee, 0xee,               // a gap (allowed)
                                  0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,   // i64 -2
                                  0x99});                                           // trailing byte (allowed)
  const std::string path = dir / "hand.safetensors";
  WriteBytes(path, StFile(header, data));
  auto ckpt = SafetensorsCheckpoint::Open(path);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->Names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ((*ckpt)->metadata().at("format"), "pt");
  EXPECT_EQ((*ckpt)->total_bytes(), 18u);
  auto a = (*ckpt)->Tensor("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->scalar_type(), at::kBFloat16);
  EXPECT_EQ(a->to(at::kFloat).item<float>(), 1.0f);
  auto b = (*ckpt)->Tensor("b");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->scalar_type(), at::kFloat);
  EXPECT_EQ(b->data_ptr<float>()[0], 1.5f);
  EXPECT_EQ(b->data_ptr<float>()[1], -2.0f);
  auto c = (*ckpt)->Tensor("c");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->sizes(), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(c->item<int64_t>(), -2);
  const TensorInfo* info = *(*ckpt)->Info("c");
  EXPECT_EQ(info->data_begin, 8 + header.size() + 16);
  EXPECT_EQ(info->nbytes(), 8u);
  EXPECT_EQ(info->numel(), 1u);
}

TEST(SafetensorsTest, WriterOutputFollowsTheFormatByteForByte) {
  TempDir dir;
  auto tensors = SampleTensors();
  SafetensorsWriter writer;
  for (const auto& [name, t] : tensors) ASSERT_TRUE(writer.Add(name, t).ok());
  writer.SetMetadata("format", "pt");
  const std::string path = dir / "model.safetensors";
  ASSERT_TRUE(writer.Write(path).ok());
  EXPECT_FALSE(fs::exists(path + ".tmp." + std::to_string(getpid())));

  // Decode independently of the reader.
  const std::string file = ReadBytes(path);
  ASSERT_GE(file.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(file[i]);
  EXPECT_EQ((8 + n) % 8, 0u) << "header padded to 8 bytes";
  const std::string header = file.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));  // padding is spaces
  const auto json = nlohmann::json::parse(header);
  EXPECT_EQ(json["__metadata__"], nlohmann::json({{"format", "pt"}}));
  EXPECT_EQ(json.size(), tensors.size() + 1);
  const char* names[] = {"BF16", "F16", "F32", "I64", "F32", "F32", "U8", "BF16", "F32"};
  uint64_t data_end = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    SCOPED_TRACE(name);
    const auto& e = json.at(name);
    EXPECT_EQ(e.at("dtype"), names[i]);
    EXPECT_EQ(e.at("shape").get<std::vector<int64_t>>(), t.sizes().vec());
    const uint64_t begin = e.at("data_offsets")[0], end = e.at("data_offsets")[1];
    EXPECT_EQ(begin % t.element_size(), 0u) << "aligned to its element size";
    EXPECT_EQ(file.substr(8 + n + begin, end - begin), TensorBytes(t));
    data_end = std::max(data_end, end);
  }
  EXPECT_EQ(file.size(), 8 + n + data_end) << "no trailing bytes";
}

TEST(SafetensorsTest, SingleFileRoundTripIsZeroCopyAndBitExact) {
  TempDir dir;
  auto tensors = SampleTensors();
  SafetensorsWriter writer;
  for (const auto& [name, t] : tensors) ASSERT_TRUE(writer.Add(name, t).ok());
  writer.SetMetadata("format", "pt");
  writer.SetMetadata("seed", "7");
  ASSERT_TRUE(writer.WriteSharded(dir.path(), 1).ok());
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));

  for (const std::string& where : {dir.path(), dir / "model.safetensors"}) {
    auto ckpt = SafetensorsCheckpoint::Open(where);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    ExpectSameTensors(**ckpt, tensors);
    EXPECT_EQ((*ckpt)->files().size(), 1u);
    EXPECT_EQ((*ckpt)->metadata().at("seed"), "7");
    EXPECT_EQ((*ckpt)->total_bytes(), writer.total_bytes());
    auto names = (*ckpt)->Names();
    EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
    EXPECT_TRUE((*ckpt)->Has("lm_head.weight"));
    EXPECT_FALSE((*ckpt)->Has("lm_head"));
  }
}

TEST(SafetensorsTest, ThreeShardRoundTripFollowsTheIndex) {
  TempDir dir;
  auto tensors = SampleTensors();
  SafetensorsWriter writer;
  for (const auto& [name, t] : tensors) ASSERT_TRUE(writer.Add(name, t).ok());
  ASSERT_TRUE(writer.WriteSharded(dir.path(), 3).ok());

  const std::vector<std::string> shard_files = {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                                "model-00003-of-00003.safetensors"};
  const auto index = nlohmann::json::parse(ReadBytes(dir / "model.safetensors.index.json"));
  EXPECT_EQ(index.at("metadata").at("total_size").get<uint64_t>(), writer.total_bytes());
  const auto& weight_map = index.at("weight_map");
  EXPECT_EQ(weight_map.size(), tensors.size());
  std::map<std::string, int> per_shard;
  for (const auto& [name, file] : weight_map.items()) per_shard[file.get<std::string>()]++;
  ASSERT_EQ(per_shard.size(), 3u);
  for (const auto& f : shard_files) {
    EXPECT_GT(per_shard[f], 0) << f;
    EXPECT_TRUE(fs::exists(dir / f));
  }
  // Shards are runs of the insertion order.
  int last = 0;
  for (const auto& [name, t] : tensors) {
    const int shard = std::stoi(weight_map.at(name).get<std::string>().substr(6, 5));
    EXPECT_GE(shard, last);
    last = shard;
  }

  for (const std::string& where : {dir.path(), dir / "model.safetensors.index.json"}) {
    auto ckpt = SafetensorsCheckpoint::Open(where);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    EXPECT_EQ((*ckpt)->files().size(), 3u);
    ExpectSameTensors(**ckpt, tensors);
    for (const auto& [name, t] : tensors) {
      const TensorInfo* info = *(*ckpt)->Info(name);
      EXPECT_EQ(fs::path((*ckpt)->files()[info->file_index]).filename().string(), weight_map.at(name)) << name;
    }
  }
}

TEST(SafetensorsTest, AddLazyFillsAtWriteTimeInPlace) {
  TempDir dir;
  int calls = 0;
  SafetensorsWriter writer;
  ASSERT_TRUE(writer
                  .AddLazy("lazy.i32", StDType::kI32, {3, 1000},
                           [&](uint8_t* dst) {
                             ++calls;
                             auto* v = reinterpret_cast<int32_t*>(dst);
                             for (int i = 0; i < 3000; ++i) v[i] = i * 7 - 5;
                           })
                  .ok());
  ASSERT_TRUE(writer.Add("eager", at::arange(5, at::kFloat)).ok());
  ASSERT_TRUE(writer.AddLazy("lazy.empty", StDType::kBF16, {0}, [&](uint8_t*) { ++calls; }).ok());
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(writer.total_bytes(), 12000u + 20u);
  ASSERT_TRUE(writer.Write(dir / "a.safetensors").ok());
  EXPECT_EQ(calls, 1);  // empty tensors have nothing to fill
  ASSERT_TRUE(writer.WriteSharded(dir / "sharded", 2).ok());
  EXPECT_EQ(calls, 2);
  for (const std::string& where : {dir / "a.safetensors", dir / "sharded"}) {
    auto ckpt = SafetensorsCheckpoint::Open(where);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    auto t = (*ckpt)->Tensor("lazy.i32");
    ASSERT_TRUE(t.ok());
    EXPECT_TRUE(at::equal(*t, (at::arange(3000, at::kInt) * 7 - 5).reshape({3, 1000})));
    EXPECT_TRUE(at::equal(*(*ckpt)->Tensor("eager"), at::arange(5, at::kFloat)));
    EXPECT_EQ((*ckpt)->Tensor("lazy.empty")->numel(), 0);
  }
}

TEST(SafetensorsTest, LazyWriteDoesNotHoldTheCheckpointInMemory) {
  std::ofstream clear("/proc/self/clear_refs");
  if (!clear) GTEST_SKIP() << "cannot reset the peak RSS";
  TempDir dir;
  constexpr int kTensors = 8;
  constexpr size_t kBytes = 16u << 20;  // 16 MiB each, 128 MiB in all
  SafetensorsWriter writer;
  for (int i = 0; i < kTensors; ++i) {
    ASSERT_TRUE(writer
                    .AddLazy("t" + std::to_string(i), StDType::kU8, {static_cast<int64_t>(kBytes)},
                             [i](uint8_t* dst) { std::memset(dst, i + 1, kBytes); })
                    .ok());
  }
  const uint64_t rss_before = ProcStatusKb("VmRSS");
  clear << "5" << std::flush;  // VmHWM := VmRSS
  ASSERT_TRUE(writer.Write(dir / "big.safetensors").ok());
  const uint64_t peak_growth_mb = (ProcStatusKb("VmHWM") - rss_before) / 1024;
  std::printf("lazy write of %d x 16 MiB: peak RSS growth %llu MiB\n", kTensors,
              static_cast<unsigned long long>(peak_growth_mb));
  EXPECT_LT(peak_growth_mb, 48u);  // one tensor at a time, not 128 MiB
  auto ckpt = SafetensorsCheckpoint::Open(dir / "big.safetensors");
  ASSERT_TRUE(ckpt.ok());
  auto bytes = (*ckpt)->Bytes("t5");
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ((*bytes)[0], 6);
  EXPECT_EQ((*bytes)[kBytes - 1], 6);
}

TEST(SafetensorsTest, TouchFaultsPagesInAndEvictDropsThem) {
  TempDir dir;
  SafetensorsWriter writer;
  at::Tensor big = at::arange(1 << 20, at::kFloat);  // 4 MiB
  ASSERT_TRUE(writer.Add("big", big).ok());
  ASSERT_TRUE(writer.Add("small", at::ones({3})).ok());
  ASSERT_TRUE(writer.Write(dir / "m.safetensors").ok());
  auto ckpt = SafetensorsCheckpoint::Open(dir / "m.safetensors");
  ASSERT_TRUE(ckpt.ok());
  auto t = (*ckpt)->Tensor("big");
  ASSERT_TRUE(t.ok());
  const void* p = t->data_ptr();

  ASSERT_TRUE((*ckpt)->Evict("big").ok());  // drop what parsing the header mapped
  EXPECT_LT(RegionOf(p)->rss_kb, 64u);
  ASSERT_TRUE((*ckpt)->Prefetch("big").ok());
  ASSERT_TRUE((*ckpt)->Touch("big").ok());
  const uint64_t touched = RegionOf(p)->rss_kb;
  EXPECT_GE(touched, 4096u);
  ASSERT_TRUE((*ckpt)->Evict("big").ok());
  const uint64_t evicted = RegionOf(p)->rss_kb;
  std::printf("mapping RSS: touched %llu KiB, evicted %llu KiB\n", static_cast<unsigned long long>(touched),
              static_cast<unsigned long long>(evicted));
  EXPECT_LT(evicted, 64u);
  // Evicted pages fault back in with the file's contents.
  EXPECT_TRUE(at::equal(*t, big));
  EXPECT_GE(RegionOf(p)->rss_kb, 4096u);
  ASSERT_TRUE((*ckpt)->Touch("small").ok());
  EXPECT_EQ((*ckpt)->Evict("nope").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*ckpt)->Touch("nope").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*ckpt)->Prefetch("nope").code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, TensorsKeepTheMappingAlive) {
  TempDir dir;
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("x", at::arange(1000, at::kFloat)).ok());
  ASSERT_TRUE(writer.Write(dir / "m.safetensors").ok());
  at::Tensor t;
  {
    auto ckpt = SafetensorsCheckpoint::Open(dir / "m.safetensors");
    ASSERT_TRUE(ckpt.ok());
    t = *(*ckpt)->Tensor("x");
  }
  fs::remove(dir / "m.safetensors");
  EXPECT_TRUE(RegionOf(t.data_ptr()).has_value());
  EXPECT_TRUE(at::equal(t, at::arange(1000, at::kFloat)));
}

TEST(SafetensorsTest, LookupErrorsNameTheTensor) {
  TempDir dir;
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("u16", StDType::kU16, {2}, Bytes({1, 0, 2, 0})).ok());
  ASSERT_TRUE(writer.Write(dir / "m.safetensors").ok());
  auto ckpt = SafetensorsCheckpoint::Open(dir / "m.safetensors");
  ASSERT_TRUE(ckpt.ok());
  auto missing = (*ckpt)->Tensor("model.missing");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("model.missing"));
  EXPECT_EQ((*ckpt)->Info("model.missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*ckpt)->Bytes("model.missing").status().code(), absl::StatusCode::kNotFound);
  auto u16 = (*ckpt)->Tensor("u16");
  EXPECT_EQ(u16.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(u16.status().message()), HasSubstr("\"u16\""));
  auto bytes = (*ckpt)->Bytes("u16");
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(std::string(bytes->begin(), bytes->end()), Bytes({1, 0, 2, 0}));
}

TEST(SafetensorsTest, WriterRejectsBadInput) {
  TempDir dir;
  SafetensorsWriter w;
  ASSERT_TRUE(w.Add("a", StDType::kF32, {2}, std::string(8, '\0')).ok());
  EXPECT_EQ(w.Add("a", StDType::kF32, {2}, std::string(8, '\0')).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(w.AddLazy("a", StDType::kF32, {2}, [](uint8_t*) {}).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_FALSE(w.Add("b", StDType::kF32, {3}, std::string(8, '\0')).ok());
  EXPECT_FALSE(w.Add("c", StDType::kF32, {-1}, "").ok());
  EXPECT_FALSE(w.Add("__metadata__", StDType::kU8, {0}, "").ok());
  EXPECT_FALSE(w.Add("", StDType::kU8, {0}, "").ok());
  EXPECT_FALSE(w.AddLazy("d", StDType::kF32, {int64_t{1} << 62, 8}, [](uint8_t*) {}).ok());
  EXPECT_FALSE(w.AddLazy("e", StDType::kF32, {1}, nullptr).ok());
  EXPECT_FALSE(w.Add("f", at::Tensor()).ok());
  EXPECT_FALSE(w.WriteSharded(dir / "x", 2).ok());  // one tensor, two shards
  EXPECT_FALSE(w.WriteSharded(dir / "y", 0).ok());
  EXPECT_EQ(w.total_bytes(), 8u);
  // A throwing fill fails the write and leaves no file behind.
  ASSERT_TRUE(w.AddLazy("boom", StDType::kU8, {1}, [](uint8_t*) { throw std::runtime_error("no data"); }).ok());
  auto s = w.Write(dir / "boom.safetensors");
  EXPECT_THAT(std::string(s.message()), HasSubstr("no data"));
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

// ---------------------------------------------------------------------------
// Corrupt inputs: every one is a non-OK status naming the file (and tensor).

struct CorruptFile {
  const char* name;
  std::string bytes;
  std::vector<std::string> needles;  // substrings the message must contain
};

std::string Entry(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return R"({"dtype":)" + dtype + R"(,"shape":)" + shape + R"(,"data_offsets":)" + offsets + "}";
}

std::vector<CorruptFile> CorruptFiles() {
  const std::string d8(8, '\x01'), d12(12, '\x01');
  std::string deep = R"({"w":)" + std::string(100, '[') + std::string(100, ']') + "}";
  return {
      {"empty_file", "", {"0 bytes"}},
      {"shorter_than_length", std::string("\x05\x00\x00", 3), {"3 bytes"}},
      {"header_length_past_eof", LE64(1000) + "{}", {"header length 1000", "past the end"}},
      {"header_length_huge", LE64(uint64_t{1} << 62) + "{}", {"exceeds the limit"}},
      {"header_length_zero", LE64(0) + d8, {"invalid JSON"}},
      {"invalid_json", StFile(R"({"w":{"dtype":"F32",)", d8), {"invalid JSON"}},
      {"not_an_object", StFile("[1,2,3]", d8), {"expected a JSON object", "array"}},
      {"unknown_dtype", StFile(R"({"w":)" + Entry(R"("F7")", "[2]", "[0,8]") + "}", d8),
       {"\"w\"", "unknown safetensors dtype \"F7\""}},
      {"dtype_not_string", StFile(R"({"w":)" + Entry("4", "[2]", "[0,8]") + "}", d8), {"\"w\"", "dtype"}},
      {"offsets_out_of_range", StFile(R"({"w":)" + Entry(R"("F32")", "[4]", "[0,16]") + "}", d8),
       {"\"w\"", "past the data section of 8 bytes"}},
      {"begin_after_end", StFile(R"({"w":)" + Entry(R"("F32")", "[2]", "[8,0]") + "}", d8),
       {"\"w\"", "begin 8 is after end 0"}},
      {"offsets_three_numbers", StFile(R"({"w":)" + Entry(R"("F32")", "[2]", "[0,4,8]") + "}", d8),
       {"\"w\"", "data_offsets"}},
      {"negative_offset", StFile(R"({"w":)" + Entry(R"("F32")", "[2]", "[-8,0]") + "}", d8), {"\"w\"", "negative"}},
      {"overlapping_tensors",
       StFile(R"({"a":)" + Entry(R"("F32")", "[2]", "[0,8]") + R"(,"b":)" + Entry(R"("F32")", "[2]", "[4,12]") + "}",
              d12),
       {"\"a\"", "\"b\"", "overlap"}},
      {"size_mismatch", StFile(R"({"w":)" + Entry(R"("F32")", "[3]", "[0,8]") + "}", d8),
       {"\"w\"", "span 8 bytes", "needs 12"}},
      {"shape_overflow",
       StFile(R"({"w":)" + Entry(R"("F32")", "[4294967296,4294967296,16]", "[0,8]") + "}", d8),
       {"\"w\"", "overflows"}},
      {"negative_dimension", StFile(R"({"w":)" + Entry(R"("F32")", "[-2]", "[0,8]") + "}", d8),
       {"\"w\"", "negative"}},
      {"fractional_dimension", StFile(R"({"w":)" + Entry(R"("F32")", "[2.5]", "[0,8]") + "}", d8),
       {"\"w\"", "non-negative integer"}},
      {"shape_not_array", StFile(R"({"w":)" + Entry(R"("F32")", "2", "[0,8]") + "}", d8), {"\"w\"", "shape"}},
      {"missing_offsets", StFile(R"({"w":{"dtype":"F32","shape":[2]}})", d8), {"\"w\"", "missing \"data_offsets\""}},
      {"entry_not_object", StFile(R"({"w":3})", d8), {"\"w\"", "must be an object"}},
      {"duplicate_tensor_names",
       StFile(R"({"w":)" + Entry(R"("F32")", "[2]", "[0,8]") + R"(,"w":)" + Entry(R"("F32")", "[1]", "[0,4]") + "}",
              d8),
       {"duplicate key \"w\""}},
      {"duplicate_field_in_entry", StFile(R"({"w":{"dtype":"F32","dtype":"I32","shape":[2],"data_offsets":[0,8]}})", d8),
       {"duplicate key \"w\" -> \"dtype\""}},
      {"metadata_not_strings",
       StFile(R"({"__metadata__":{"format":1},"w":)" + Entry(R"("F32")", "[2]", "[0,8]") + "}", d8),
       {"__metadata__", "format"}},
      {"metadata_not_object", StFile(R"({"__metadata__":[]})", d8), {"__metadata__", "object"}},
      {"deep_nesting", StFile(deep, d8), {"nested deeper"}},
  };
}

TEST(SafetensorsTest, CorruptFilesAreRejectedWithFileAndTensorNamed) {
  TempDir dir;
  for (const auto& c : CorruptFiles()) {
    SCOPED_TRACE(c.name);
    const std::string path = dir / (std::string(c.name) + ".safetensors");
    WriteBytes(path, c.bytes);
    auto ckpt = SafetensorsCheckpoint::Open(path);
    ASSERT_FALSE(ckpt.ok());
    EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument) << ckpt.status();
    const std::string message(ckpt.status().message());
    EXPECT_THAT(message, HasSubstr(path));
    for (const auto& needle : c.needles) EXPECT_THAT(message, HasSubstr(needle));
  }
}

TEST(SafetensorsTest, TruncatedFileNamesTheTensorPastTheEnd) {
  TempDir dir;
  SafetensorsWriter w;
  ASSERT_TRUE(w.Add("first", at::ones({4})).ok());
  ASSERT_TRUE(w.Add("second", at::ones({2}, at::kBFloat16)).ok());
  const std::string path = dir / "t.safetensors";
  ASSERT_TRUE(w.Write(path).ok());
  fs::resize_file(path, fs::file_size(path) - 1);
  auto ckpt = SafetensorsCheckpoint::Open(path);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_THAT(std::string(ckpt.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(ckpt.status().message()), HasSubstr("\"second\""));
  EXPECT_THAT(std::string(ckpt.status().message()), HasSubstr("truncated"));
}

TEST(SafetensorsTest, EveryTruncationAndRandomCorruptionFailsCleanly) {
  // Thousands of rewrites of one file: ext4 flushes each truncate+rewrite
  // (auto_da_alloc), so use memory-backed storage when there is some.
  TempDir dir(fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path());
  SafetensorsWriter w;
  for (const auto& [name, t] : SampleTensors()) ASSERT_TRUE(w.Add(name, t).ok());
  w.SetMetadata("format", "pt");
  const std::string good_path = dir / "good.safetensors";
  ASSERT_TRUE(w.Write(good_path).ok());
  const std::string good = ReadBytes(good_path);
  const std::string path = dir / "bad.safetensors";
  for (size_t len = 0; len < good.size(); ++len) {
    WriteBytes(path, good.substr(0, len));
    EXPECT_FALSE(SafetensorsCheckpoint::Open(path).ok()) << "truncated to " << len;
  }
  // Random byte edits: Open may succeed (e.g. a changed digit of a value) but
  // must never crash, and whatever it accepts must be readable.
  std::mt19937 rng(123);
  int accepted = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string bytes = good;
    const int edits = 1 + iter % 3;
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % std::min<size_t>(bytes.size(), iter % 2 ? 40 : bytes.size());
      bytes[at] = static_cast<char>(rng() % 2 ? rng() : "0123456789[]{},:\"-"[rng() % 18]);
    }
    WriteBytes(path, bytes);
    auto ckpt = SafetensorsCheckpoint::Open(path);
    if (!ckpt.ok()) {
      EXPECT_THAT(std::string(ckpt.status().message()), HasSubstr(path));
      continue;
    }
    ++accepted;
    for (const auto& name : (*ckpt)->Names()) {
      auto bytes_span = (*ckpt)->Bytes(name);
      ASSERT_TRUE(bytes_span.ok());
      uint64_t sum = 0;
      for (uint8_t b : *bytes_span) sum += b;
      (void)sum;
      auto t = (*ckpt)->Tensor(name);
      if (t.ok()) {
        EXPECT_EQ(static_cast<uint64_t>(t->nbytes()), bytes_span->size());
      }
    }
  }
  std::printf("random corruption: %d of 3000 variants still valid\n", accepted);
}

// Sharded checkpoints: the index and its shards must agree.

std::string Shard(const std::vector<std::string>& names) {
  std::string header = "{";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) header += ",";
    header += "\"" + names[i] + "\":" +
              Entry(R"("F32")", "[1]", "[" + std::to_string(4 * i) + "," + std::to_string(4 * i + 4) + "]");
  }
  header += "}";
  return StFile(header, std::string(4 * names.size(), '\0'));
}

struct CorruptSharded {
  const char* name;
  std::string index;
  std::map<std::string, std::string> shards;
  std::vector<std::string> needles;
  std::string named_file;  // file whose path the message must hold
  absl::StatusCode code = absl::StatusCode::kInvalidArgument;
};

TEST(SafetensorsTest, CorruptShardedCheckpointsAreRejected) {
  const std::string s1 = "model-00001-of-00002.safetensors", s2 = "model-00002-of-00002.safetensors";
  const std::string index_name = "model.safetensors.index.json";
  auto index = [](const std::string& weight_map) { return R"({"metadata":{"total_size":8},"weight_map":)" + weight_map + "}"; };
  const std::vector<CorruptSharded> cases = {
      {"missing_shard", index(R"({"a":")" + s1 + R"(","b":")" + s2 + R"("})"), {{s1, Shard({"a"})}},
       {s2, "missing"}, index_name, absl::StatusCode::kNotFound},
      {"tensor_absent_from_shard", index(R"({"a":")" + s1 + R"(","b":")" + s1 + R"("})"), {{s1, Shard({"a"})}},
       {"\"b\"", "does not hold it"}, index_name},
      {"index_invalid_json", R"({"weight_map":{"a":)", {{s1, Shard({"a"})}}, {"invalid JSON"}, index_name},
      {"index_not_object", "[]", {{s1, Shard({"a"})}}, {"expected a JSON object"}, index_name},
      {"index_without_weight_map", R"({"metadata":{}})", {{s1, Shard({"a"})}}, {"weight_map"}, index_name},
      {"weight_map_not_object", index("[]"), {{s1, Shard({"a"})}}, {"weight_map", "object"}, index_name},
      {"shard_name_not_string", index(R"({"a":1})"), {{s1, Shard({"a"})}}, {"\"a\"", "string"}, index_name},
      {"shard_outside_dir", index(R"({"a":"../evil.safetensors"})"), {{s1, Shard({"a"})}},
       {"\"a\"", "not a plain file name"}, index_name},
      {"duplicate_in_weight_map", index(R"({"a":")" + s1 + R"(","a":")" + s2 + R"("})"),
       {{s1, Shard({"a"})}, {s2, Shard({"a"})}}, {"duplicate key \"weight_map\" -> \"a\""}, index_name},
      {"shard_tensor_not_in_index", index(R"({"a":")" + s1 + R"("})"), {{s1, Shard({"a", "extra"})}},
       {"\"extra\"", "does not list it"}, s1},
      {"tensor_in_two_shards", index(R"({"a":")" + s1 + R"(","b":")" + s2 + R"("})"),
       {{s1, Shard({"a", "b"})}, {s2, Shard({"b"})}}, {"\"b\"", s2}, s1},
      {"corrupt_shard", index(R"({"a":")" + s1 + R"("})"), {{s1, StFile("{nope", "")}}, {"invalid JSON"}, s1},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    TempDir dir;
    WriteBytes(dir / index_name, c.index);
    for (const auto& [file, bytes] : c.shards) WriteBytes(dir / file, bytes);
    auto ckpt = SafetensorsCheckpoint::Open(dir.path());
    ASSERT_FALSE(ckpt.ok());
    EXPECT_EQ(ckpt.status().code(), c.code) << ckpt.status();
    const std::string message(ckpt.status().message());
    EXPECT_THAT(message, HasSubstr(dir / c.named_file));
    for (const auto& needle : c.needles) EXPECT_THAT(message, HasSubstr(needle));
  }
}

TEST(SafetensorsTest, MissingPathsAreNotFound) {
  TempDir dir;
  auto none = SafetensorsCheckpoint::Open(dir / "nothing.safetensors");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(none.status().message()), HasSubstr(dir / "nothing.safetensors"));
  auto empty_dir = SafetensorsCheckpoint::Open(dir.path());
  EXPECT_EQ(empty_dir.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(empty_dir.status().message()), HasSubstr("model.safetensors"));
}

}  // namespace
}  // namespace vlm
