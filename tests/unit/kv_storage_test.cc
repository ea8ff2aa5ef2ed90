// The paged KV storage (Decoder::NewKvStorage) on the tiny checkpoint:
//   - it is reserved, not committed: no page is resident after creation, and
//     a forward pass commits exactly the pages of the blocks it writes;
//   - nothing reads a slot before it is written in a way that shows: with
//     every unwritten slot holding NaN instead of zeros (a block's earlier
//     owner could leave anything), the logits and the written K/V are
//     bit-identical, for prompts ending mid-block and decode steps.
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "services/language/model/decoder.h"
#include "tests/unit/decoder_fixture.h"

namespace vlm::language {
namespace {

using decoder_fixture::Model;

// Resident pages of each block of `t` (its dim 0), by mincore.
std::vector<int64_t> ResidentPagesPerBlock(const at::Tensor& t) {
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t bytes = static_cast<int64_t>(t.nbytes());
  std::vector<unsigned char> vec((bytes + page - 1) / page);
  EXPECT_EQ(mincore(t.data_ptr(), static_cast<size_t>(bytes), vec.data()), 0);
  const int64_t block_bytes = bytes / t.size(0);
  std::vector<int64_t> out(t.size(0), 0);
  for (size_t p = 0; p < vec.size(); ++p) {
    if (vec[p] & 1) ++out[static_cast<int64_t>(p) * page / block_bytes];
  }
  return out;
}

bool TransparentHugePagesAlways() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(in, line);
  return line.find("[always]") != std::string::npos;
}

// A text-only sequence: ids, MRoPE positions (t = h = w = index), block table.
struct Text {
  std::vector<int32_t> ids;
  at::Tensor positions;
  std::vector<int32_t> table;
};

Text MakeText(int64_t n, std::vector<int32_t> table) {
  Text t;
  for (int64_t i = 0; i < n; ++i) t.ids.push_back(static_cast<int32_t>(100 + (i * 37) % 5000));
  t.positions = at::arange(n, at::kLong).repeat({3, 1}).contiguous();
  t.table = std::move(table);
  return t;
}

SequenceChunk Chunk(const Text& t, int64_t start, int64_t n, bool decode) {
  SequenceChunk c;
  c.token_ids = absl::MakeConstSpan(t.ids).subspan(start, n);
  c.start = start;
  c.block_table = t.table;
  c.positions = t.positions.narrow(1, start, n).contiguous();
  c.decode = decode;
  c.logits = true;
  return c;
}

TEST(KvStorageTest, PagesAreCommittedOnlyForTheBlocksWritten) {
  Model m = decoder_fixture::Load(decoder_fixture::TinyDir(), ComputeDType::kFloat32);
  ASSERT_NE(m.decoder, nullptr);
  auto kv = m.decoder->NewKvStorage(1024, 16);
  ASSERT_TRUE(kv.ok()) << kv.status();
  const int64_t page = sysconf(_SC_PAGESIZE);
  for (const auto* side : {&kv->k, &kv->v}) {
    for (const at::Tensor& t : *side) {
      ASSERT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % page, 0u);
      const std::vector<int64_t> resident = ResidentPagesPerBlock(t);
      EXPECT_EQ(std::accumulate(resident.begin(), resident.end(), int64_t{0}), 0)
          << "a new storage commits nothing";
    }
  }
  // 40 tokens in blocks 700, 3 and 512 (the last one half written).
  const Text text = MakeText(40, {700, 3, 512});
  auto logits = m.decoder->Forward(*kv, {Chunk(text, 0, 40, false)});
  ASSERT_TRUE(logits.ok()) << logits.status();
  const bool huge = TransparentHugePagesAlways();
  const int64_t block_bytes = kv->k[0].nbytes() / 1024;
  for (const auto* side : {&kv->k, &kv->v}) {
    for (const at::Tensor& t : *side) {
      const std::vector<int64_t> resident = ResidentPagesPerBlock(t);
      const int64_t total = std::accumulate(resident.begin(), resident.end(), int64_t{0});
      const int64_t pages_per_block = (block_bytes + page - 1) / page;
      for (int32_t b : text.table) EXPECT_EQ(resident[b], pages_per_block) << "block " << b;
      if (huge) {
        // THP "always": a first write may commit a whole 2 MiB page.
        EXPECT_LE(total * page, 3 * (int64_t{2} << 20));
      } else {
        EXPECT_EQ(total, 3 * pages_per_block) << "only the written blocks";
      }
    }
  }
}

TEST(KvStorageTest, UnwrittenSlotsHoldingNaNChangeNothing) {
  for (ComputeDType dtype : {ComputeDType::kFloat32, ComputeDType::kBFloat16}) {
    SCOPED_TRACE(dtype == ComputeDType::kFloat32 ? "f32" : "bf16");
    Model m = decoder_fixture::Load(decoder_fixture::TinyDir(), dtype);
    ASSERT_NE(m.decoder, nullptr);
    auto fresh = m.decoder->NewKvStorage(16, 16);
    auto poisoned = m.decoder->NewKvStorage(16, 16);
    ASSERT_TRUE(fresh.ok() && poisoned.ok());
    for (auto* side : {&poisoned->k, &poisoned->v}) {
      for (at::Tensor& t : *side) t.fill_(std::numeric_limits<float>::quiet_NaN());
    }
    // Two sequences in one pass: a 37-token prompt cut 20 + 17 (ending
    // mid-block) then 6 decode steps, and a 5-token prompt then decode steps
    // (one partly written block).
    const Text a = MakeText(43, {5, 9, 2});
    const Text b = MakeText(11, {12});
    auto run = [&](KvStorage& kv) {
      std::vector<at::Tensor> out;
      auto pass = [&](std::vector<SequenceChunk> chunks) {
        auto r = m.decoder->Forward(kv, chunks);
        EXPECT_TRUE(r.ok()) << r.status();
        if (r.ok()) out.push_back(*r);
      };
      pass({Chunk(a, 0, 20, false), Chunk(b, 0, 5, false)});
      pass({Chunk(a, 20, 17, false), Chunk(b, 5, 1, true)});
      for (int64_t i = 0; i < 5; ++i) pass({Chunk(a, 37 + i, 1, true), Chunk(b, 6 + i, 1, true)});
      pass({Chunk(a, 42, 1, true)});
      return out;
    };
    const std::vector<at::Tensor> want = run(*fresh);
    const std::vector<at::Tensor> got = run(*poisoned);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(at::isfinite(got[i]).all().item<bool>()) << "pass " << i;
      EXPECT_TRUE(at::equal(got[i], want[i])) << "pass " << i;
    }
    // The written slots are the same too (a's 43 tokens, b's 11).
    for (size_t l = 0; l < fresh->k.size(); ++l) {
      for (const auto& [table, len] : {std::pair{a.table, int64_t{43}}, std::pair{b.table, int64_t{11}}}) {
        for (int64_t p = 0; p < len; ++p) {
          const int64_t block = table[p / 16], slot = p % 16;
          EXPECT_TRUE(at::equal(poisoned->k[l][block].select(2, slot), fresh->k[l][block].select(2, slot)))
              << "layer " << l << " K token " << p;
          EXPECT_TRUE(at::equal(poisoned->v[l][block].select(1, slot), fresh->v[l][block].select(1, slot)))
              << "layer " << l << " V token " << p;
        }
      }
    }
  }
}

}  // namespace
}  // namespace vlm::language
