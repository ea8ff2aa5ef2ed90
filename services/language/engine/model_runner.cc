#include "services/language/engine/model_runner.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/torch_util.h"

namespace vlm::language {
namespace {

// Clears the upper halves of the vector registers after a kernel that may
// return with them dirty (a 256/512-bit kernel without vzeroupper): otherwise
// every later legacy-SSE instruction of the thread pays a transition penalty;
// measured, the sampler and detokenizer then ran ~20x slower (55 ms instead
// of 2 ms per token over a 151936-wide row). Cheap enough to run after every
// model call. The proper place is the exit of such a kernel; this is the one
// guard at the model boundary until every kernel cleans up after itself.
void ClearUpperVectorState() {
#if defined(__x86_64__)
  static const bool has_avx = __builtin_cpu_supports("avx");
  if (has_avx) asm volatile("vzeroupper" ::: "memory");
#endif
}

}  // namespace

absl::StatusOr<std::unique_ptr<DecoderRunner>> DecoderRunner::Create(const Projector* projector,
                                                                     const Decoder* decoder,
                                                                     int64_t num_blocks,
                                                                     int64_t block_size) {
  absl::StatusOr<KvStorage> kv = decoder->NewKvStorage(num_blocks, block_size);
  if (!kv.ok()) return kv.status();
  return std::unique_ptr<DecoderRunner>(new DecoderRunner(projector, decoder, *std::move(kv)));
}

absl::StatusOr<ProjectedImages> DecoderRunner::ProjectImage(const ImageFeatures& image) {
  try {
    const at::ScalarType dtype = ScalarTypeOf(projector_->compute_dtype());
    std::vector<at::Tensor> deepstack;
    for (const at::Tensor& d : image.deepstack) deepstack.push_back(d.to(dtype));
    const GridThw grids[] = {image.grid};
    absl::StatusOr<ProjectedImages> out =
        projector_->Forward(image.last_hidden.to(dtype), deepstack, grids);
    ClearUpperVectorState();
    return out;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("projecting an image: ", e.what_without_backtrace()));
  }
}

absl::StatusOr<at::Tensor> DecoderRunner::Forward(absl::Span<const SequenceChunk> chunks) {
  absl::StatusOr<at::Tensor> logits = decoder_->Forward(kv_, chunks);
  ClearUpperVectorState();
  return logits;
}

}  // namespace vlm::language
