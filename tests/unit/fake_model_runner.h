// A ModelRunner without a network, for tests of the serving engine: it keeps
// one 64-bit "K/V" value per cache slot, a mix of the token id, its three
// MRoPE positions and (for image pads) its projector row; the logits of a
// chunk's last token are a pseudo-random function of every value the chunk's
// block table reaches in [0, start + n). So a wrong block table, a prefix hit
// on the wrong blocks, wrong positions or wrong image rows all change the
// tokens, exactly as they would with the real decoder.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "services/language/engine/model_runner.h"

namespace vlm::language::testing {

class FakeModelRunner final : public ModelRunner {
 public:
  FakeModelRunner(int64_t num_blocks, int64_t block_size, int64_t merge = 2,
                  int64_t vocab = 1000, int pass_delay_ms = 0)
      : block_size_(block_size), merge_(merge), vocab_(vocab), pass_delay_ms_(pass_delay_ms),
        kv_(static_cast<size_t>(num_blocks * block_size), 0) {}

  absl::StatusOr<ProjectedImages> ProjectImage(const ImageFeatures& image) override {
    const int64_t n = image.grid[0] * image.grid[1] * image.grid[2] / (merge_ * merge_);
    const double base = image.last_hidden.to(at::kDouble).sum().item<double>();
    ProjectedImages out;
    out.image_embeds = (at::arange(n, at::kFloat) + static_cast<float>(base)).reshape({n, 1});
    out.deepstack.push_back(out.image_embeds * 2);
    absl::MutexLock lock(&mu_);
    ++projections_;
    return out;
  }

  absl::StatusOr<at::Tensor> Forward(absl::Span<const SequenceChunk> chunks) override {
    if (pass_delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pass_delay_ms_));
    std::vector<at::Tensor> rows;
    int64_t prefill = 0, decode = 0;
    for (size_t c = 0; c < chunks.size(); ++c) {
      const SequenceChunk& chunk = chunks[c];
      const int64_t n = static_cast<int64_t>(chunk.token_ids.size());
      const int64_t end = chunk.start + n;
      if (static_cast<int64_t>(chunk.block_table.size()) * block_size_ < end) {
        return absl::InvalidArgumentError(absl::StrCat("chunk ", c, " block_table too short"));
      }
      if (chunk.positions.size(1) != n) {
        return absl::InvalidArgumentError(absl::StrCat("chunk ", c, " positions"));
      }
      const at::Tensor pos = chunk.positions.contiguous();
      const int64_t* p = pos.data_ptr<int64_t>();
      const at::Tensor img = chunk.image_embeds.defined() ? chunk.image_embeds.contiguous()
                                                          : at::Tensor();
      const at::Tensor deep = chunk.deepstack.empty() ? at::Tensor()
                                                      : chunk.deepstack[0].contiguous();
      int64_t v = 0;
      for (int64_t i = 0; i < n; ++i) {
        uint64_t h = Mix(static_cast<uint64_t>(chunk.token_ids[i]) + 1);
        for (int a = 0; a < 3; ++a) h = Mix(h ^ static_cast<uint64_t>(p[a * n + i] + 17 * a));
        if (chunk.token_ids[i] == kImagePad) {
          if (!img.defined() || v >= img.size(0)) {
            return absl::InvalidArgumentError(absl::StrCat("chunk ", c, " image rows short"));
          }
          float a = img.data_ptr<float>()[v], b = deep.data_ptr<float>()[v];
          uint32_t ba, bb;
          std::memcpy(&ba, &a, 4);
          std::memcpy(&bb, &b, 4);
          h = Mix(h ^ ba ^ (static_cast<uint64_t>(bb) << 32));
          ++v;
        }
        kv_[Slot(chunk.block_table, chunk.start + i)] = h;
      }
      if (img.defined() && v != img.size(0)) {
        return absl::InvalidArgumentError(absl::StrCat("chunk ", c, " has extra image rows"));
      }
      (chunk.decode ? decode : prefill) += n;
      if (chunk.logits) {
        uint64_t h = 0;
        for (int64_t i = 0; i < end; ++i) h = Mix(h ^ kv_[Slot(chunk.block_table, i)]);
        at::Tensor row = at::empty({vocab_}, at::kFloat);
        float* r = row.data_ptr<float>();
        for (int64_t j = 0; j < vocab_; ++j) {
          r[j] = static_cast<float>(Mix(h ^ static_cast<uint64_t>(j)) % 1000) / 100.0f;
        }
        rows.push_back(row);
      }
    }
    absl::MutexLock lock(&mu_);
    prefill_rows_ += prefill;
    decode_rows_ += decode;
    max_chunks_ = std::max<int64_t>(max_chunks_, static_cast<int64_t>(chunks.size()));
    ++passes_;
    if (rows.empty()) return at::Tensor();
    return at::stack(rows);
  }

  static constexpr int32_t kImagePad = 151655;

  int64_t prefill_rows() const { absl::MutexLock l(&mu_); return prefill_rows_; }
  int64_t decode_rows() const { absl::MutexLock l(&mu_); return decode_rows_; }
  int64_t projections() const { absl::MutexLock l(&mu_); return projections_; }
  int64_t max_chunks() const { absl::MutexLock l(&mu_); return max_chunks_; }

 private:
  static uint64_t Mix(uint64_t x) {  // splitmix64 finalizer
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }
  size_t Slot(absl::Span<const int32_t> table, int64_t index) const {
    return static_cast<size_t>(table[index / block_size_] * block_size_ + index % block_size_);
  }

  int64_t block_size_, merge_, vocab_;
  int pass_delay_ms_;
  std::vector<uint64_t> kv_;
  mutable absl::Mutex mu_;
  int64_t prefill_rows_ = 0, decode_rows_ = 0, projections_ = 0, max_chunks_ = 0, passes_ = 0;
};

}  // namespace vlm::language::testing
