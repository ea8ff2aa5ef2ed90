// The serving engine's model runner: executes what the scheduler decided and
// decides nothing itself. It owns the paged KV storage; which blocks belong to
// which sequence comes with every chunk (SequenceChunk::block_table).
//
// The engine calls a runner from its one thread only; implementations need no
// locking. DecoderRunner adapts the real Projector + Decoder; tests use fakes.
#pragma once

#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "services/language/model/decoder.h"
#include "services/language/engine/generator.h"
#include "services/language/model/projector.h"

namespace vlm::language {

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  // Projector rows of one image, in merged raster order:
  // image_embeds [ImageTokenCount(grid), hidden] and one such tensor per
  // deepstack level. Images are always projected one at a time, so an image's
  // rows do not depend on which other images a request carries.
  virtual absl::StatusOr<ProjectedImages> ProjectImage(const ImageFeatures& image) = 0;
  // One forward pass (Decoder::Forward's contract, decoder.h): writes the
  // chunks' K/V and returns float32 logits [R, vocab] of the chunks with
  // logits = true, in order.
  virtual absl::StatusOr<at::Tensor> Forward(absl::Span<const SequenceChunk> chunks) = 0;
};

// ModelRunner over the real projector and decoder (not owned; both outlive it).
class DecoderRunner final : public ModelRunner {
 public:
  // Allocates the KV storage: num_blocks blocks of block_size tokens.
  static absl::StatusOr<std::unique_ptr<DecoderRunner>> Create(const Projector* projector,
                                                               const Decoder* decoder,
                                                               int64_t num_blocks,
                                                               int64_t block_size);
  absl::StatusOr<ProjectedImages> ProjectImage(const ImageFeatures& image) override;
  absl::StatusOr<at::Tensor> Forward(absl::Span<const SequenceChunk> chunks) override;
  uint64_t kv_bytes() const { return kv_.bytes(); }

 private:
  DecoderRunner(const Projector* projector, const Decoder* decoder, KvStorage kv)
      : projector_(projector), decoder_(decoder), kv_(std::move(kv)) {}
  const Projector* projector_;
  const Decoder* decoder_;
  KvStorage kv_;
};

}  // namespace vlm::language
