// One sequence run through Decoder::Forward on its own, as the engine runs a
// lone request: its prompt in prefill chunks, then one decode pass per token,
// over a KvStorage of its own (blocks 0, 1, 2, ... in order). For tests that
// need "run this prompt, then decode these tokens" and compare logits.
#ifndef VLM_TESTS_UNIT_DECODER_TEST_UTIL_H_
#define VLM_TESTS_UNIT_DECODER_TEST_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include <ATen/ATen.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "services/language/model/decoder.h"
#include "services/language/model/mrope.h"

namespace vlm::language::decoder_test {

// A prompt: ids with image pads expanded, the projector rows of its images
// and its MRoPE positions.
struct PromptInput {
  absl::Span<const int32_t> token_ids;
  at::Tensor image_embeds;            // [P, hidden] for the P image pads (undefined when P = 0)
  std::vector<at::Tensor> deepstack;  // one [P, hidden] per level when P > 0
  // GetRopeIndex of the prompt; nullptr: text, token s at s + rope_delta().
  const RopeIndex* positions = nullptr;
  // true: logits of every prompt position ([S, vocab]), position p from a
  // pass whose chunk ends at p; false: of the last one ([vocab]).
  bool all_logits = false;
  int64_t chunk = 0;  // prompt tokens per prefill chunk; 0 = the whole prompt in one
};

class ForwardRun {
 public:
  // KV storage for `capacity` tokens in blocks of `block_size` tokens.
  ForwardRun(const Decoder& decoder, int64_t capacity, int64_t block_size = 16)
      : decoder_(decoder), capacity_(capacity) {
    absl::StatusOr<KvStorage> kv =
        decoder.NewKvStorage((std::max<int64_t>(capacity, 1) + block_size - 1) / block_size,
                             block_size);
    status_ = kv.status();
    if (kv.ok()) kv_ = *std::move(kv);
    table_.resize(kv_.num_blocks);
    std::iota(table_.begin(), table_.end(), 0);
  }

  int64_t length() const { return static_cast<int64_t>(ids_.size()); }  // tokens in the KV
  int64_t rope_delta() const { return rope_delta_; }
  const KvStorage& kv() const { return kv_; }

  // Appends the prompt. Errors: Forward's, or the prompt not fitting the capacity.
  absl::StatusOr<at::Tensor> Prefill(const PromptInput& in) {
    if (!status_.ok()) return status_;
    const int64_t s = static_cast<int64_t>(in.token_ids.size());
    const int64_t base = length();
    if (base + s > capacity_) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt of ", s, " tokens does not fit the capacity ", capacity_));
    }
    const at::Tensor positions =
        in.positions != nullptr
            ? in.positions->ToTensor()
            : at::arange(base + rope_delta_, base + rope_delta_ + s, at::kLong)
                  .unsqueeze(0)
                  .expand({3, s})
                  .contiguous();
    ids_.insert(ids_.end(), in.token_ids.begin(), in.token_ids.end());
    // pads[i]: image pads among the prompt's first i tokens.
    std::vector<int64_t> pads(s + 1, 0);
    for (int64_t i = 0; i < s; ++i) {
      pads[i + 1] = pads[i] + (in.token_ids[i] == decoder_.config().image_token_id);
    }
    // The prompt tokens [a, b) as one prefill chunk, logits of token b - 1.
    auto pass = [&](int64_t a, int64_t b) -> absl::StatusOr<at::Tensor> {
      SequenceChunk c;
      c.token_ids = in.token_ids.subspan(a, b - a);
      c.start = base + a;
      c.block_table = table_;
      c.positions = positions.narrow(1, a, b - a).contiguous();
      const int64_t p0 = pads[a], n = pads[b] - pads[a];
      if (n > 0) {
        c.image_embeds = in.image_embeds.narrow(0, p0, n);
        for (const at::Tensor& t : in.deepstack) c.deepstack.push_back(t.narrow(0, p0, n));
      }
      c.logits = true;
      absl::StatusOr<at::Tensor> logits = decoder_.Forward(kv_, {c});
      if (!logits.ok()) return logits.status();
      return (*logits)[0];
    };
    const int64_t chunk = in.chunk > 0 ? in.chunk : std::max<int64_t>(s, 1);
    std::vector<at::Tensor> rows;
    at::Tensor last;
    absl::Status failed = s == 0 ? pass(0, 0).status() : absl::OkStatus();
    for (int64_t a = 0; failed.ok() && a < s; a += chunk) {
      const int64_t b = std::min(s, a + chunk);
      // Positions inside the chunk first (their K/V are rewritten by the
      // whole chunk's pass with the same values), then the whole chunk.
      for (int64_t p = a + 1; in.all_logits && failed.ok() && p < b; ++p) {
        absl::StatusOr<at::Tensor> row = pass(a, p);
        if (row.ok()) rows.push_back(*std::move(row));
        failed = row.status();
      }
      if (!failed.ok()) break;
      absl::StatusOr<at::Tensor> row = pass(a, b);
      if (row.ok()) last = *std::move(row);
      failed = row.status();
      if (failed.ok() && in.all_logits) rows.push_back(last);
    }
    if (!failed.ok()) {
      ids_.resize(base);
      return failed;
    }
    if (in.positions != nullptr) rope_delta_ = in.positions->rope_delta;
    return in.all_logits ? at::stack(rows, 0) : last;
  }

  // Appends one generated token at position length() + rope_delta() on all
  // three axes; its logits [vocab].
  absl::StatusOr<at::Tensor> DecodeStep(int32_t id) {
    if (!status_.ok()) return status_;
    if (length() >= capacity_) {
      return absl::OutOfRangeError(absl::StrCat("the run is full: ", capacity_, " tokens"));
    }
    const int32_t ids[] = {id};
    SequenceChunk c;
    c.token_ids = ids;
    c.start = length();
    c.block_table = table_;
    c.positions = at::full({3, 1}, length() + rope_delta_, at::kLong);
    c.decode = true;
    c.logits = true;
    absl::StatusOr<at::Tensor> logits = decoder_.Forward(kv_, {c});
    if (!logits.ok()) return logits.status();
    ids_.push_back(id);
    return (*logits)[0];
  }

 private:
  const Decoder& decoder_;
  int64_t capacity_;
  absl::Status status_;
  KvStorage kv_;
  std::vector<int32_t> table_;
  std::vector<int32_t> ids_;  // tokens in the KV
  int64_t rope_delta_ = 0;
};

}  // namespace vlm::language::decoder_test

#endif  // VLM_TESTS_UNIT_DECODER_TEST_UTIL_H_
