// Causal grouped-query attention over a paged KV cache (spec §5.2), for
// prompt rows and decode rows alike: the attention of the decoder's batched
// forward (decoder.h, "Batched forward over a paged KV cache").
//
// The query at cache index p attends keys 0..p of its sequence, read through
// the block table block by block from block 0, with an online softmax in
// float32: per block, scores = q·k·scale in f32, the running max, sum and
// output are rescaled when the max grows, keys > p are skipped (they
// contribute exactly 0). The arithmetic of one query depends only on q, the
// keys and values 0..p and the block size: never on which other queries
// share the call, how a prompt was cut into runs, or the thread count. The
// output is rounded once to q's dtype. It differs from the reference
// softmax(q·kᵀ)·v (which rounds scores and probabilities to bf16 in bf16
// compute) by float32 rounding only (tests state the tolerance).
//
// Grouped-query: the Hq / Hkv query heads of one KV head are processed
// together (each key block is converted once for all of them); work items are
// (run, KV head, tile of queries), spread over at::get_num_threads() threads.
//
// Paths: AVX-512 (F/BW/VL/DQ; head_dim a multiple of 16), vectorised over
// keys for scores and over head_dim for values; portable scalar loops.
// VLM_ATTENTION_PATH=avx512|scalar|auto picks the process default (an
// unsupported or unknown value is reported on stderr and ignored).
//
// Thread-safe; never writes the caches.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace vlm {

enum class AttentionPath { kAvx512, kScalar };

const char* AttentionPathName(AttentionPath path);  // "avx512", "scalar"
// Inverse of AttentionPathName; "auto" gives the best supported path.
absl::StatusOr<AttentionPath> ParseAttentionPath(std::string_view name);
bool AttentionPathSupported(AttentionPath path);
// VLM_ATTENTION_PATH at first use, else the best supported path.
AttentionPath DefaultAttentionPath();

// Rows [row, row + count) of q hold one sequence's queries at cache indices
// start .. start + count - 1; block_table[i] holds its cache indices
// [i·block_size, (i+1)·block_size), at least ceil((start + count) /
// block_size) entries.
struct PagedQueryRun {
  int64_t row = 0;
  int64_t count = 0;
  int64_t start = 0;
  absl::Span<const int32_t> block_table;
};

struct PagedAttentionOptions {
  double scale = 1.0;  // multiplies q·k (head_dim^-0.5)
  // Overrides DefaultAttentionPath(); an unusable path (CPU, head_dim) falls
  // back to scalar.
  std::optional<AttentionPath> path;
  // Queries of one run per work item (work split only; results do not depend on it).
  int64_t query_tile = 16;
};

// q: [R, Hq, D] float32 or bf16, contiguous; k_cache: [num_blocks, Hkv, D,
// block_size] (a block's keys dimension-major, so 16 keys' element c are one
// vector load), v_cache: [num_blocks, Hkv, block_size, D]; both in q's dtype,
// contiguous; Hq a multiple of Hkv. Returns [R, Hq, D] in q's dtype; rows no run covers are zero. Throws
// c10::Error for bad shapes, runs outside q or block ids outside the cache.
at::Tensor PagedAttention(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, absl::Span<const PagedQueryRun> runs,
                          const PagedAttentionOptions& options);

}  // namespace vlm
