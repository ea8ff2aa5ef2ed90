// Decoder::Forward, the batched forward over a paged KV cache, on the tiny
// checkpoint against the independent float32 reference (tests/reference/
// text_ref.py goldens) and against itself:
//   - f32 logits within 1e-4 of the reference at every position, for one
//     chunk, random chunkings and decode chunks;
//   - chunking invariance: K/V of every block and the last logits
//     bit-identical however a prompt is cut (f32 and bf16);
//   - batch invariance: 1..8 sequences prefilling and decoding together,
//     joining and leaving between passes, bit-identical to each alone;
//   - prefix reuse: a sequence that reads another's blocks and prefills only
//     its suffix equals a cold run (text, images, cut mid-image, moved image);
//   - agreement with the Prefill/DecodeStep path (greedy tokens, 1e-5);
//   - row invariance of the projections on a 2B-shaped layer, M = 1..300;
//   - validation: INVALID_ARGUMENT naming the chunk and field.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "services/language/model/decoder.h"
#include "services/language/model/projector.h"
#include "common/kernels/row_ops.h"
#include "tests/unit/decoder_fixture.h"

namespace vlm::language {
namespace {

using decoder_fixture::Case;
using decoder_fixture::kCases;
using decoder_fixture::kF32Tolerance;
using decoder_fixture::Model;
using decoder_fixture::RowError;

// Every test here runs on the tiny checkpoint and its goldens.
Case ReadCase(const std::string& name) {
  return decoder_fixture::ReadCase(decoder_fixture::GoldenDir(), name);
}
Model Load(ComputeDType dtype, DecoderOptions options = {}) {
  return decoder_fixture::Load(decoder_fixture::TinyDir(), dtype, std::move(options));
}

// A sequence as the engine holds it: its tokens, MRoPE positions, projector
// rows of its images, its block table and how much of it is in the KV.
struct Seq {
  std::vector<int32_t> ids;
  at::Tensor positions;  // [3, len(ids)] int64
  ProjectedImages images;
  std::vector<int64_t> pad_before;  // image pad tokens before index i (size len + 1)
  std::vector<int32_t> table;
  int64_t done = 0;  // tokens in the KV
};

// ids with the images `grids` (in order) through the projector of `m`.
Seq MakeSeq(const Model& m, std::vector<int32_t> ids, const std::vector<GridThw>& grids,
            const at::Tensor& last_hidden, const std::vector<at::Tensor>& taps) {
  Seq s;
  s.ids = std::move(ids);
  auto pos = GetRopeIndex(s.ids, grids, m.config);
  EXPECT_TRUE(pos.ok()) << pos.status();
  if (pos.ok()) s.positions = pos->ToTensor();
  if (!grids.empty()) {
    auto images = m.projector->Forward(last_hidden, taps, grids);
    EXPECT_TRUE(images.ok()) << images.status();
    if (images.ok()) s.images = *std::move(images);
  }
  s.pad_before.assign(s.ids.size() + 1, 0);
  for (size_t i = 0; i < s.ids.size(); ++i) {
    s.pad_before[i + 1] = s.pad_before[i] + (s.ids[i] == m.config.image_token_id);
  }
  return s;
}

Seq MakeSeq(const Model& m, const Case& c, std::vector<int32_t> ids) {
  return MakeSeq(m, std::move(ids), c.grids, c.last_hidden, c.taps);
}

// Hands out fresh block ids of one storage.
struct Blocks {
  int32_t next = 0;
  void Reserve(Seq& s, int64_t tokens, int64_t block_size) {
    while (static_cast<int64_t>(s.table.size()) * block_size < tokens) s.table.push_back(next++);
  }
};

// The chunk of s covering tokens [start, start + n).
SequenceChunk Chunk(const Seq& s, int64_t start, int64_t n, bool decode, bool logits = true) {
  SequenceChunk c;
  c.token_ids = absl::MakeConstSpan(s.ids).subspan(start, n);
  c.start = start;
  c.block_table = s.table;
  c.positions = s.positions.narrow(1, start, n).contiguous();
  const int64_t p0 = s.pad_before[start], pads = s.pad_before[start + n] - p0;
  if (pads > 0) {
    c.image_embeds = s.images.image_embeds.narrow(0, p0, pads);
    for (const at::Tensor& t : s.images.deepstack) c.deepstack.push_back(t.narrow(0, p0, pads));
  }
  c.decode = decode;
  c.logits = logits;
  return c;
}

constexpr int64_t kBlocks = 512;

KvStorage NewKv(const Model& m, int64_t block_size, int64_t blocks = kBlocks) {
  auto kv = m.decoder->NewKvStorage(blocks, block_size);
  EXPECT_TRUE(kv.ok()) << kv.status();
  return kv.ok() ? *std::move(kv) : KvStorage();
}

at::Tensor Pass(const Model& m, KvStorage& kv, const std::vector<SequenceChunk>& chunks) {
  auto r = m.decoder->Forward(kv, chunks);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : at::Tensor();
}

// The K/V of s's first `length` tokens, per layer [tokens, Hkv, D] (K then V).
std::vector<at::Tensor> SeqKv(const KvStorage& kv, const Seq& s, int64_t length) {
  std::vector<at::Tensor> out;
  std::vector<int64_t> blocks(s.table.begin(), s.table.end());
  const at::Tensor index = at::tensor(blocks, at::TensorOptions().dtype(at::kLong));
  for (const auto* side : {&kv.k, &kv.v}) {
    for (const at::Tensor& t : *side) {
      // V [blocks, Hkv, bs, D] (K [blocks, Hkv, D, bs]) -> [blocks·bs, Hkv, D]
      // in token order
      at::Tensor b = side == &kv.k ? t.index_select(0, index).permute({0, 3, 1, 2})
                                   : t.index_select(0, index).transpose(1, 2);
      out.push_back(b.reshape({-1, b.size(2), b.size(3)}).narrow(0, 0, length));
    }
  }
  return out;
}

bool SameKv(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::equal(a[i], b[i])) return false;
  }
  return true;
}

// Random cut of n tokens into chunks of 1..max_chunk.
std::vector<int64_t> RandomCuts(std::mt19937& rng, int64_t n, int64_t max_chunk) {
  std::vector<int64_t> sizes;
  for (int64_t done = 0; done < n;) {
    const int64_t k = std::min<int64_t>(n - done, 1 + rng() % max_chunk);
    sizes.push_back(k);
    done += k;
  }
  return sizes;
}

// Prefills s's first `prompt` tokens alone in chunks of `sizes`, then decodes
// the rest one token per pass; returns the logits of every chunk [chunks, vocab].
at::Tensor RunAlone(const Model& m, KvStorage& kv, Seq& s, int64_t prompt,
                    const std::vector<int64_t>& sizes) {
  std::vector<at::Tensor> rows;
  for (int64_t k : sizes) {
    rows.push_back(Pass(m, kv, {Chunk(s, s.done, k, false)}));
    s.done += k;
  }
  EXPECT_EQ(s.done, prompt);
  for (; s.done < static_cast<int64_t>(s.ids.size()); ++s.done) {
    rows.push_back(Pass(m, kv, {Chunk(s, s.done, 1, true)}));
  }
  return at::cat(rows, 0);
}

// --- fidelity ------------------------------------------------------------------

TEST(DecoderForwardF32Test, LogitsMatchReferenceForAnyChunkingAndDecodeChunks) {
  Model m = Load(ComputeDType::kFloat32);
  ASSERT_NE(m.decoder, nullptr);
  std::mt19937 rng(7);
  for (const char* name : kCases) {
    Case c = ReadCase(name);
    ASSERT_FALSE(c.ids.empty());
    const int64_t s_len = static_cast<int64_t>(c.ids.size());
    // Chunkings: whole prompt, single tokens (every position checked), random.
    const std::vector<std::pair<std::vector<int64_t>, int64_t>> runs = {
        {{s_len}, 16},
        {std::vector<int64_t>(s_len, 1), 4},
        {RandomCuts(rng, s_len, 9), 16},
        {RandomCuts(rng, s_len, 9), 4}};
    for (const auto& [sizes, block_size] : runs) {
      {
        KvStorage kv = NewKv(m, block_size);
        Blocks blocks;
        Seq s = MakeSeq(m, c, c.Full());
        blocks.Reserve(s, static_cast<int64_t>(s.ids.size()), block_size);
        at::Tensor got = RunAlone(m, kv, s, s_len, sizes);
        // Row j of `got` is the logits after the j-th chunk's last token.
        std::vector<int64_t> last;
        int64_t end = 0;
        for (int64_t k : sizes) last.push_back((end += k) - 1);
        for (int64_t p = s_len; p < static_cast<int64_t>(s.ids.size()); ++p) last.push_back(p);
        ASSERT_EQ(got.size(0), static_cast<int64_t>(last.size()));
        double worst = 0;
        for (size_t j = 0; j < last.size(); ++j) {
          const double e = RowError(got[j], c.logits[last[j]]);
          worst = std::max(worst, e);
          EXPECT_LE(e, kF32Tolerance) << name << " position " << last[j] << " block " << block_size;
        }
        if (sizes.size() == static_cast<size_t>(s_len)) {
          std::printf("  %s block %ld, single-token chunks + %ld decode chunks: worst relative "
                      "error %.2e over %zu positions\n",
                      name, static_cast<long>(block_size),
                      static_cast<long>(c.greedy.size() - 1), worst, last.size());
        }
      }
    }
  }
}

TEST(DecoderForwardF32Test, GreedyTokensAndLogitsMatchPrefillDecodeStepPath) {
  Model m = Load(ComputeDType::kFloat32);
  ASSERT_NE(m.decoder, nullptr);
  constexpr int kSteps = 16;
  for (const char* name : kCases) {
    Case c = ReadCase(name);
    // Old path: Prefill + DecodeStep, greedy.
    Seq s = MakeSeq(m, c, c.ids);
    auto seq = m.decoder->NewSequence(static_cast<int64_t>(c.ids.size()) + kSteps);
    ASSERT_TRUE(seq.ok());
    auto pos = GetRopeIndex(c.ids, c.grids, m.config);
    ASSERT_TRUE(pos.ok());
    PrefillInput in;
    in.token_ids = c.ids;
    in.image_embeds = s.images.image_embeds;
    in.deepstack = s.images.deepstack;
    in.positions = &*pos;
    auto logits = m.decoder->Prefill(**seq, in);
    ASSERT_TRUE(logits.ok()) << logits.status();
    std::vector<int32_t> old_tokens;
    std::vector<at::Tensor> old_logits;
    for (int i = 0; i < kSteps; ++i) {
      old_logits.push_back(*logits);
      old_tokens.push_back(static_cast<int32_t>(logits->argmax().item<int64_t>()));
      if (i + 1 < kSteps) {
        logits = m.decoder->DecodeStep(**seq, old_tokens.back());
        ASSERT_TRUE(logits.ok()) << logits.status();
      }
    }
    // Forward: prompt in chunks of 5, then decode chunks of its own greedy tokens.
    KvStorage kv = NewKv(m, 8);
    Blocks blocks;
    blocks.Reserve(s, static_cast<int64_t>(c.ids.size()) + kSteps, 8);
    std::vector<int32_t> tokens;
    double worst = 0;
    at::Tensor last;
    for (int64_t start = 0; start < static_cast<int64_t>(c.ids.size()); start += 5) {
      const int64_t n = std::min<int64_t>(5, c.ids.size() - start);
      last = Pass(m, kv, {Chunk(s, start, n, false)});
    }
    s.done = static_cast<int64_t>(c.ids.size());
    for (int i = 0; i < kSteps; ++i) {
      ASSERT_TRUE(last.defined());
      worst = std::max(worst, RowError(last[0], old_logits[i]));
      EXPECT_LE(RowError(last[0], old_logits[i]), 1e-5) << name << " step " << i;
      tokens.push_back(static_cast<int32_t>(last[0].argmax().item<int64_t>()));
      if (i + 1 == kSteps) break;
      s.ids.push_back(tokens.back());
      const int64_t p = s.done;
      const int64_t delta = pos->rope_delta;
      s.positions = at::cat({s.positions, at::full({3, 1}, p + delta, s.positions.options())}, 1);
      s.pad_before.push_back(s.pad_before.back());
      last = Pass(m, kv, {Chunk(s, p, 1, true)});
      ++s.done;
    }
    EXPECT_EQ(tokens, old_tokens) << name;
    std::printf("  %s: %d greedy tokens equal, worst relative logit difference %.2e\n", name,
                kSteps, worst);
  }
}

TEST(DecoderForwardBf16Test, TopOneMatchesReferenceWhereMarginIsClear) {
  Model m = Load(ComputeDType::kBFloat16);
  ASSERT_NE(m.decoder, nullptr);
  if (m.decoder->compute_dtype() != ComputeDType::kBFloat16) {
    GTEST_SKIP() << "no fast bf16 on this CPU: " << m.decoder->load_summary();
  }
  int64_t checked_total = 0;
  for (const char* name : kCases) {
    Case c = ReadCase(name);
    const int64_t s_len = static_cast<int64_t>(c.ids.size());
    KvStorage kv = NewKv(m, 16);
    Blocks blocks;
    Seq s = MakeSeq(m, c, c.Full());
    blocks.Reserve(s, static_cast<int64_t>(s.ids.size()), 16);
    // Single-token prefill chunks: a logits row at every prompt position.
    at::Tensor got = RunAlone(m, kv, s, s_len, std::vector<int64_t>(s_len, 1));
    ASSERT_EQ(got.sizes(), c.logits.sizes());
    at::Tensor vals = std::get<0>(c.logits.topk(2, -1));
    at::Tensor margin = vals.select(1, 0) - vals.select(1, 1);
    at::Tensor want = c.logits.argmax(-1), have = got.argmax(-1);
    int64_t checked = 0;
    for (int64_t i = 0; i < c.logits.size(0); ++i) {
      if (margin[i].item<double>() <= 0.5) continue;
      ++checked;
      EXPECT_EQ(have[i].item<int64_t>(), want[i].item<int64_t>()) << name << " position " << i;
    }
    checked_total += checked;
  }
  EXPECT_GT(checked_total, 30);
}

// In f32 a decode row and a one-token prefill row take the same kernels, so a
// block written while generating equals one a later prompt would prefill.
TEST(DecoderForwardF32Test, DecodeRowEqualsOneTokenPrefillRow) {
  Model m = Load(ComputeDType::kFloat32);
  ASSERT_NE(m.decoder, nullptr);
  Case c = ReadCase("one_image");
  const int64_t s_len = static_cast<int64_t>(c.ids.size());
  std::vector<at::Tensor> logits;
  std::vector<std::vector<at::Tensor>> kvs;
  for (bool decode : {true, false}) {
    KvStorage kv = NewKv(m, 8);
    Blocks blocks;
    Seq s = MakeSeq(m, c, c.Full());
    blocks.Reserve(s, static_cast<int64_t>(s.ids.size()), 8);
    Pass(m, kv, {Chunk(s, 0, s_len, false)});
    std::vector<at::Tensor> rows;
    for (int64_t p = s_len; p < s_len + 6; ++p) rows.push_back(Pass(m, kv, {Chunk(s, p, 1, decode)}));
    logits.push_back(at::cat(rows, 0));
    kvs.push_back(SeqKv(kv, s, s_len + 6));
  }
  EXPECT_TRUE(at::equal(logits[0], logits[1]));
  EXPECT_TRUE(SameKv(kvs[0], kvs[1]));
}

// --- invariance ------------------------------------------------------------------

const ComputeDType kDtypes[] = {ComputeDType::kFloat32, ComputeDType::kBFloat16};

TEST(DecoderForwardTest, KvAndLastLogitsDoNotDependOnChunking) {
  at::set_num_threads(2);  // row ops must stay row-invariant with threads
  std::mt19937 rng(11);
  for (ComputeDType dtype : kDtypes) {
    Model m = Load(dtype);
    ASSERT_NE(m.decoder, nullptr);
    for (const char* name : kCases) {
      Case c = ReadCase(name);
      const int64_t s_len = static_cast<int64_t>(c.ids.size());
      for (int64_t block_size : {4, 16}) {
        KvStorage kv0 = NewKv(m, block_size);
        Blocks b0;
        Seq whole = MakeSeq(m, c, c.ids);
        b0.Reserve(whole, s_len, block_size);
        const at::Tensor want = RunAlone(m, kv0, whole, s_len, {s_len});
        const std::vector<at::Tensor> want_kv = SeqKv(kv0, whole, s_len);
        // Single tokens once per dtype (the longest case), random cuts always.
        const bool singles = block_size == 4 && std::string(name) == "two_images";
        for (int trial = singles ? 0 : 1; trial < 3; ++trial) {
          const std::vector<int64_t> sizes =
              trial == 0 ? std::vector<int64_t>(s_len, 1) : RandomCuts(rng, s_len, 12);
          KvStorage kv = NewKv(m, block_size);
          Blocks b;
          b.next = 100;  // other block ids than the reference run
          Seq s = MakeSeq(m, c, c.ids);
          b.Reserve(s, s_len, block_size);
          at::Tensor got = RunAlone(m, kv, s, s_len, sizes);
          EXPECT_TRUE(at::equal(got[got.size(0) - 1], want[0]))
              << ComputeDTypeName(dtype) << " " << name << " trial " << trial;
          EXPECT_TRUE(SameKv(SeqKv(kv, s, s_len), want_kv))
              << ComputeDTypeName(dtype) << " " << name << " trial " << trial;
        }
      }
    }
  }
  at::set_num_threads(1);
}

// Sequences of a batch-invariance run: the three golden cases and random text.
std::vector<Seq> BatchSequences(const Model& m, std::mt19937& rng) {
  std::vector<Seq> seqs;
  for (const char* name : kCases) seqs.push_back(MakeSeq(m, ReadCase(name), ReadCase(name).Full()));
  while (seqs.size() < 8) {
    std::vector<int32_t> ids(5 + rng() % 40);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 150000);
    seqs.push_back(MakeSeq(m, ids, {}, at::Tensor(), {}));
  }
  return seqs;
}

TEST(DecoderForwardTest, SequencesGiveIdenticalResultsAloneAndBatched) {
  at::set_num_threads(2);
  for (ComputeDType dtype : kDtypes) {
    Model m = Load(dtype);
    ASSERT_NE(m.decoder, nullptr);
    constexpr int64_t kBlock = 8;
    std::mt19937 rng(dtype == ComputeDType::kFloat32 ? 3 : 4);
    std::vector<Seq> seqs = BatchSequences(m, rng);
    // Each sequence: prompt = all but its last 6 tokens (random prefill
    // chunks), then 6 decode chunks.
    std::vector<int64_t> prompt;
    std::vector<std::vector<int64_t>> cuts;
    for (Seq& s : seqs) {
      prompt.push_back(static_cast<int64_t>(s.ids.size()) - 6);
      cuts.push_back(RandomCuts(rng, prompt.back(), 10));
    }
    // Alone.
    std::vector<at::Tensor> alone_logits;
    std::vector<std::vector<at::Tensor>> alone_kv;
    for (size_t i = 0; i < seqs.size(); ++i) {
      KvStorage kv = NewKv(m, kBlock);
      Blocks b;
      Seq s = seqs[i];
      b.Reserve(s, static_cast<int64_t>(s.ids.size()), kBlock);
      alone_logits.push_back(RunAlone(m, kv, s, prompt[i], cuts[i]));
      alone_kv.push_back(SeqKv(kv, s, static_cast<int64_t>(s.ids.size())));
    }
    // Batched: every pass takes the next step of a random subset of the
    // sequences that have joined (they join at random passes and leave when done).
    KvStorage kv = NewKv(m, kBlock);
    Blocks b;
    std::vector<Seq> run = seqs;
    for (Seq& s : run) b.Reserve(s, static_cast<int64_t>(s.ids.size()), kBlock);
    std::vector<size_t> step(seqs.size(), 0);
    std::vector<std::vector<at::Tensor>> rows(seqs.size());
    std::vector<int> join(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) join[i] = static_cast<int>(rng() % 12);
    int max_batch = 0, mixed_passes = 0;
    for (int pass = 0;; ++pass) {
      std::vector<SequenceChunk> chunks;
      std::vector<size_t> who;
      bool any_left = false;
      for (size_t i = 0; i < run.size(); ++i) {
        Seq& s = run[i];
        if (s.done == static_cast<int64_t>(s.ids.size())) continue;
        any_left = true;
        if (pass < join[i] || rng() % 4 == 0) continue;  // not yet joined / skips this pass
        const bool decode = step[i] >= cuts[i].size();
        const int64_t n = decode ? 1 : cuts[i][step[i]];
        chunks.push_back(Chunk(s, s.done, n, decode));
        who.push_back(i);
      }
      if (!any_left) break;
      if (chunks.empty()) continue;
      std::shuffle(chunks.begin(), chunks.end(), std::mt19937(pass));
      std::shuffle(who.begin(), who.end(), std::mt19937(pass));  // same permutation
      max_batch = std::max(max_batch, static_cast<int>(chunks.size()));
      bool has_decode = false, has_prefill = false;
      for (const SequenceChunk& ch : chunks) (ch.decode ? has_decode : has_prefill) = true;
      mixed_passes += has_decode && has_prefill;
      at::Tensor logits = Pass(m, kv, chunks);
      ASSERT_TRUE(logits.defined());
      ASSERT_EQ(logits.size(0), static_cast<int64_t>(chunks.size()));
      for (size_t j = 0; j < who.size(); ++j) {
        rows[who[j]].push_back(logits.narrow(0, j, 1));
        run[who[j]].done += static_cast<int64_t>(chunks[j].token_ids.size());
        ++step[who[j]];
      }
    }
    EXPECT_GE(max_batch, 5);
    EXPECT_GT(mixed_passes, 0);
    for (size_t i = 0; i < seqs.size(); ++i) {
      EXPECT_TRUE(at::equal(at::cat(rows[i], 0), alone_logits[i]))
          << ComputeDTypeName(dtype) << " sequence " << i;
      EXPECT_TRUE(SameKv(SeqKv(kv, run[i], static_cast<int64_t>(run[i].ids.size())), alone_kv[i]))
          << ComputeDTypeName(dtype) << " sequence " << i;
    }
    std::printf("  %s: %zu sequences, up to %d chunks per pass, %d passes mixing prefill and "
                "decode\n",
                ComputeDTypeName(dtype), seqs.size(), max_batch, mixed_passes);
  }
  at::set_num_threads(1);
}

// --- prefix reuse ---------------------------------------------------------------

// Indices [begin, end) of the k-th image pad run of ids.
std::pair<int64_t, int64_t> ImageRun(const std::vector<int32_t>& ids, int64_t pad, int k) {
  int64_t i = 0;
  for (int run = 0;; ++run) {
    while (i < static_cast<int64_t>(ids.size()) && ids[i] != pad) ++i;
    int64_t j = i;
    while (j < static_cast<int64_t>(ids.size()) && ids[j] == pad) ++j;
    if (run == k || j >= static_cast<int64_t>(ids.size())) return {i, j};
    i = j;
  }
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(DecoderForwardTest, PrefixHitGivesTheSameLogitsAndKvAsAColdRun) {
  // Blocks of 2 tokens: the golden prompts put their first image at index 4.
  constexpr int64_t kBlock = 2, kChunk = 8, kDecode = 4;
  const std::vector<int32_t> tail = {1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008};
  for (ComputeDType dtype : kDtypes) {
    Model m = Load(dtype);
    ASSERT_NE(m.decoder, nullptr);
    const int64_t pad = m.config.image_token_id;
    Case text = ReadCase("text"), one = ReadCase("one_image"), two = ReadCase("two_images");
    const auto [b1, e1] = ImageRun(one.ids, pad, 0);
    const auto [b2, e2] = ImageRun(two.ids, pad, 1);
    ASSERT_GT(e1, b1 + 2);
    ASSERT_GE(b1, 1 + kBlock);
    auto prefix = [](const std::vector<int32_t>& v, int64_t n) {
      return std::vector<int32_t>(v.begin(), v.begin() + n);
    };
    struct Scenario {
      std::string what;
      const Case* x;
      std::vector<int32_t> y;  // Y's tokens (X's images, complete)
      int64_t shared_blocks;   // X's blocks Y's table starts with
    };
    const int64_t mid = (b1 + (e1 - b1) / 2) / kBlock;  // block edge inside the image
    const std::vector<Scenario> scenarios = {
        {"text-only history", &text, Concat(prefix(text.ids, 20), tail), 20 / kBlock},
        {"one image in the prefix", &one, Concat(prefix(one.ids, e1 + 3), tail), (e1 + 3) / kBlock},
        {"two images in the prefix", &two, Concat(prefix(two.ids, e2 + 3), tail), (e2 + 3) / kBlock},
        {"hit ending mid-image", &one, Concat(prefix(one.ids, e1 + 2), tail), mid},
        {"image at another position", &one,
         Concat(Concat(prefix(one.ids, b1 - 1), {2001, 2002, 2003}),
                std::vector<int32_t>(one.ids.begin() + b1 - 1, one.ids.end())),
         (b1 - 1) / kBlock},
    };
    ASSERT_GT(mid * kBlock, b1);
    ASSERT_LT(mid * kBlock, e1);
    for (const Scenario& sc : scenarios) {
      const std::string what = std::string(ComputeDTypeName(dtype)) + " " + sc.what;
      const int64_t start = sc.shared_blocks * kBlock;
      ASSERT_GT(start, 0) << what;
      // Y's prompt: all but the last kDecode tokens, which are decoded.
      const int64_t y_prompt = static_cast<int64_t>(sc.y.size()) - kDecode;
      auto run_y = [&](KvStorage& kv, Seq& y, Blocks& blocks, int64_t from) {
        blocks.Reserve(y, static_cast<int64_t>(y.ids.size()), kBlock);
        std::vector<int64_t> sizes;
        for (int64_t i = from; i < y_prompt; i += kChunk) sizes.push_back(std::min(kChunk, y_prompt - i));
        y.done = from;
        return RunAlone(m, kv, y, y_prompt, sizes);
      };
      // Warm: X prefilled first; Y's table starts with X's first blocks.
      KvStorage warm_kv = NewKv(m, kBlock);
      Blocks warm_blocks;
      Seq x = MakeSeq(m, *sc.x, sc.x->ids);
      warm_blocks.Reserve(x, static_cast<int64_t>(x.ids.size()), kBlock);
      std::vector<int64_t> x_sizes;
      for (int64_t i = 0; i < static_cast<int64_t>(x.ids.size()); i += kChunk) {
        x_sizes.push_back(std::min<int64_t>(kChunk, x.ids.size() - i));
      }
      RunAlone(m, warm_kv, x, static_cast<int64_t>(x.ids.size()), x_sizes);
      Seq warm = MakeSeq(m, *sc.x, sc.y);
      warm.table.assign(x.table.begin(), x.table.begin() + sc.shared_blocks);
      at::Tensor warm_logits = run_y(warm_kv, warm, warm_blocks, start);
      // Cold: Y alone from token 0.
      KvStorage cold_kv = NewKv(m, kBlock);
      Blocks cold_blocks;
      Seq cold = MakeSeq(m, *sc.x, sc.y);
      at::Tensor cold_logits = run_y(cold_kv, cold, cold_blocks, 0);
      // The last prompt logits and every decode step, and all of Y's K/V.
      const int64_t n = kDecode + 1;
      ASSERT_GE(warm_logits.size(0), n) << what;
      EXPECT_TRUE(at::equal(warm_logits.narrow(0, warm_logits.size(0) - n, n),
                            cold_logits.narrow(0, cold_logits.size(0) - n, n)))
          << what;
      const int64_t len = static_cast<int64_t>(sc.y.size());
      EXPECT_TRUE(SameKv(SeqKv(warm_kv, warm, len), SeqKv(cold_kv, cold, len))) << what;
      std::printf("  %s: %ld of %ld tokens reused (blocks of %ld)\n", what.c_str(),
                  static_cast<long>(start), static_cast<long>(len), static_cast<long>(kBlock));
    }
  }
}

// --- projections ----------------------------------------------------------------

// RowLinear's rows do not depend on how many rows share the call, for M up to
// 300 on the 2B's gate/up shape (in 2048, out 6144) and the tiny model's
// shapes, 1 and 2 threads. Small shapes: every M = 1..300. The 2B shape: every
// M = 1..48, then every 7th (1.1 TFLOP per sweep in f32 otherwise). f32 runs
// on kernels::GemmF32 and must hold whatever OpenBLAS's kernels are (CI runs
// this again with OPENBLAS_CORETYPE=Haswell); bf16 on the padded at::linear.
TEST(RowLinearTest, RowResultsDoNotDependOnRowCount) {
  at::manual_seed(5);
  struct Shape {
    int64_t in, out;
  };
  const Shape shapes[] = {{2048, 6144}, {64, 128}, {128, 64}, {64, 64}, {32, 64}};
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    for (const Shape& sh : shapes) {
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
        const bool large = sh.in * sh.out > 1000000;
        const at::Tensor x = at::randn({300, sh.in}).to(dtype);
        const at::Tensor w = (at::randn({sh.out, sh.in}) * 0.05).to(dtype);
        const at::Tensor all = RowLinear(x, w);
        std::vector<int64_t> differ;
        int64_t checked = 0;
        for (int64_t rows = 1; rows <= 300; rows += large && rows >= 48 ? 7 : 1) {
          ++checked;
          if (!at::equal(RowLinear(x.narrow(0, 0, rows), w), all.narrow(0, 0, rows))) {
            differ.push_back(rows);
          }
        }
        EXPECT_TRUE(differ.empty()) << c10::toString(dtype) << " [" << sh.out << ", " << sh.in
                                    << "] threads " << threads << ": " << differ.size() << " of "
                                    << checked << " row counts differ, first M = " << differ[0];
      }
    }
  }
  // The 2B's other projection shapes in bf16 (o_proj/q_proj, k/v_proj,
  // down_proj), 2 threads: M = 1..24, then every 11th.
  at::set_num_threads(2);
  const Shape others[] = {{2048, 2048}, {2048, 1024}, {6144, 2048}};
  for (const Shape& sh : others) {
    const at::Tensor x = at::randn({300, sh.in}).to(at::kBFloat16);
    const at::Tensor w = (at::randn({sh.out, sh.in}) * 0.05).to(at::kBFloat16);
    const at::Tensor all = RowLinear(x, w);
    for (int64_t rows = 1; rows <= 300; rows += rows >= 24 ? 11 : 1) {
      EXPECT_TRUE(at::equal(RowLinear(x.narrow(0, 0, rows), w), all.narrow(0, 0, rows)))
          << "bf16 [" << sh.out << ", " << sh.in << "] M = " << rows;
    }
  }
  at::set_num_threads(1);
}

// --- validation ---------------------------------------------------------------

TEST(DecoderForwardTest, RejectsBadChunksNamingChunkAndField) {
  Model m = Load(ComputeDType::kFloat32);
  ASSERT_NE(m.decoder, nullptr);
  Case c = ReadCase("one_image");
  KvStorage kv = NewKv(m, 8, 64);
  Blocks blocks;
  Seq s = MakeSeq(m, c, c.ids);
  blocks.Reserve(s, static_cast<int64_t>(s.ids.size()), 8);
  Seq t = MakeSeq(m, {1, 2, 3}, {}, at::Tensor(), {});
  blocks.Reserve(t, 3, 8);
  const SequenceChunk good = Chunk(t, 0, 3, false);
  auto expect_invalid = [&](SequenceChunk bad, const std::string& needle) {
    auto r = m.decoder->Forward(kv, {good, bad});
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find("chunk 1: "), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status();
  };
  const int64_t n = static_cast<int64_t>(s.ids.size());
  const SequenceChunk whole = Chunk(s, 0, n, false);
  std::vector<int32_t> ids = s.ids;
  {  // ids outside the vocabulary, video pad
    SequenceChunk ch = whole;
    ids[2] = 200000;
    ch.token_ids = ids;
    expect_invalid(ch, "token_ids[2] = 200000");
    ids[2] = static_cast<int32_t>(m.config.video_token_id);
    expect_invalid(ch, "video");
  }
  {  // empty chunk; decode chunk with 2 tokens
    SequenceChunk ch = whole;
    ch.token_ids = {};
    expect_invalid(ch, "token_ids is empty");
    ch = Chunk(t, 0, 2, true);
    ch.block_table = s.table;
    expect_invalid(ch, "decode chunk has exactly 1");
  }
  {  // image rows, deepstack, positions of the wrong shape
    SequenceChunk ch = whole;
    ch.image_embeds = ch.image_embeds.narrow(0, 0, 3);
    expect_invalid(ch, "image_embeds");
    ch = whole;
    ch.image_embeds = at::Tensor();
    expect_invalid(ch, "image_embeds");
    ch = whole;
    ch.deepstack.pop_back();
    expect_invalid(ch, "deepstack");
    ch = whole;
    ch.deepstack[0] = ch.deepstack[0].narrow(1, 0, 8);
    expect_invalid(ch, "deepstack[0]");
    ch = whole;
    ch.positions = ch.positions.narrow(1, 0, n - 1);
    expect_invalid(ch, "positions");
    ch.positions = at::Tensor();
    expect_invalid(ch, "positions");
    ch = Chunk(s, 0, 4, false);  // text-only cut: image rows given anyway
    ch.image_embeds = s.images.image_embeds.narrow(0, 0, 1);
    expect_invalid(ch, "image_embeds");
  }
  {  // block table too short, ids outside the storage, a block written twice
    SequenceChunk ch = whole;
    ch.block_table = absl::MakeConstSpan(s.table).subspan(0, 1);
    expect_invalid(ch, "block_table has 1 entries");
    std::vector<int32_t> table = s.table;
    table[1] = 64;
    ch.block_table = table;
    expect_invalid(ch, "block_table[1] = 64");
    table[1] = -1;
    expect_invalid(ch, "block_table[1] = -1");
    table = s.table;
    table[0] = t.table[0];
    ch.block_table = table;
    expect_invalid(ch, "also written by chunk 0");
  }
  {  // start beyond the context
    SequenceChunk ch = Chunk(t, 0, 1, true);
    ch.start = m.decoder->max_context();
    expect_invalid(ch, "outside the context");
  }
  // A KV storage of another geometry.
  KvStorage wrong = NewKv(m, 8, 4);
  wrong.k.pop_back();
  auto r = m.decoder->Forward(wrong, {good});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ(m.decoder->NewKvStorage(0, 16).status().code(), absl::StatusCode::kInvalidArgument);
  // The storage still works after the rejections.
  auto ok = m.decoder->Forward(kv, {whole});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_LE(RowError((*ok)[0], c.logits[n - 1]), kF32Tolerance);
  // A generated image-pad token is a plain decode token (no image row).
  Seq g;
  g.ids = {1, 2, static_cast<int32_t>(m.config.image_token_id)};
  g.positions = at::arange(3, at::TensorOptions().dtype(at::kLong)).unsqueeze(0).repeat({3, 1});
  g.pad_before = {0, 0, 0, 0};
  blocks.Reserve(g, 3, 8);
  ASSERT_TRUE(m.decoder->Forward(kv, {Chunk(g, 0, 2, false)}).ok());
  auto generated = m.decoder->Forward(kv, {Chunk(g, 2, 1, true)});
  EXPECT_TRUE(generated.ok()) << generated.status();
  // No chunk: nothing to do.
  auto none = m.decoder->Forward(kv, {});
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->defined());
}

TEST(DecoderForwardTest, KvStorageSizesFollowTheModel) {
  Model m = Load(ComputeDType::kBFloat16);
  ASSERT_NE(m.decoder, nullptr);
  const TextConfig& t = m.config.text;
  const uint64_t elem = m.decoder->compute_dtype() == ComputeDType::kBFloat16 ? 2 : 4;
  EXPECT_EQ(m.decoder->kv_bytes_per_token(),
            2ull * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * elem);
  KvStorage kv = NewKv(m, 16, 10);
  EXPECT_EQ(kv.bytes(), 160 * m.decoder->kv_bytes_per_token());
  ASSERT_EQ(static_cast<int64_t>(kv.k.size()), t.num_hidden_layers);
  EXPECT_EQ(kv.k[0].sizes().vec(),
            (std::vector<int64_t>{10, t.num_key_value_heads, t.head_dim, 16}));
  EXPECT_EQ(kv.v[0].sizes().vec(),
            (std::vector<int64_t>{10, t.num_key_value_heads, 16, t.head_dim}));
}

}  // namespace
}  // namespace vlm::language
