// vlm-bench-decoder: the language model core on a checkpoint, without the
// service: load time and RSS (lazy), prefill tokens/s, decode ms/token and its
// ratio to the memory-bandwidth bound (weight bytes read per token / read
// bandwidth measured in the same run). Prints a table of medians.
//
// Everything runs through Decoder::Forward over a paged KV cache. Then the
// batched tables: decode tokens/s for B sequences per pass (aggregate and per
// sequence, speedup over B = 1, the bandwidth bound B·bandwidth / weight
// bytes), a prompt prefilled in chunks and in one chunk, and one layer's
// attention through nn::AttentionHeadMajor and PagedAttention.
//
//   vlm-bench-decoder --checkpoint ~/.cache/vlm/checkpoints/2b --threads 2
#include <algorithm>
#include <cmath>
#include <functional>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/metrics.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/nn.h"
#include "common/omp_wait_policy.h"
#include "common/kernels/gemm.h"
#include "common/kernels/gemv_int8.h"
#include "common/kernels/quantize.h"
#include "services/language/model/decoder.h"
#include "common/kernels/gemv.h"
#include "common/kernels/paged_attention.h"
#include "services/language/model/projector.h"
#include "scripts/bench/read_bandwidth.h"
#include "scripts/bench/bench_util.h"

ABSL_FLAG(std::string, checkpoint, "", "model directory");
ABSL_FLAG(int, threads, 2, "intra-op threads");
ABSL_FLAG(std::string, dtype, "bf16", "compute dtype: bf16 or f32");
ABSL_FLAG(int, prompt_tokens, 128, "prefill length (random text ids)");
ABSL_FLAG(int, decode_tokens, 32, "decode steps");
ABSL_FLAG(int, resident_layers, 0, "layer residency bound (0: none)");
ABSL_FLAG(int, prefetch_layers, 1, "layers prefetched ahead");
ABSL_FLAG(bool, eager, false, "materialize every layer at load");
ABSL_FLAG(bool, gemv, true, "decode projections through vlm::Gemv");
ABSL_FLAG(bool, packed_head, true, "LM head on the packed GEMM (packed/int8 layers); false: Gemv");
ABSL_FLAG(int64_t, chunk, 512, "prompt tokens per prefill pass (0: the whole prompt in one)");
ABSL_FLAG(bool, single, true, "run the single-sequence table (one request: prefill, decode)");
ABSL_FLAG(std::string, batches, "1,2,4,8", "batched forward: sequences per decode pass");
ABSL_FLAG(int, context, 256, "batched forward: tokens in each sequence's KV before decoding");
ABSL_FLAG(int, forward_steps, 8, "batched forward: decode passes per batch size");
ABSL_FLAG(int, forward_prefill, 512, "prompt tokens for the prefill table, chunked vs one chunk (0: skip)");
ABSL_FLAG(int64_t, block_size, 16, "paged KV block size (tokens)");
ABSL_FLAG(bool, small_m, false,
          "only the decode-row kernel table: kernels::Gemm vs vlm::Gemv vs GemvInt8 at M = 1..8 "
          "on one layer's shapes (random weights from the config's sizes)");
ABSL_FLAG(bool, fidelity, false,
          "only quantized vs bf16 fidelity: logits cosine and greedy agreement (where the bf16 "
          "top-1 margin > --fidelity_margin) over a random prompt and a teacher-forced bf16 "
          "greedy continuation, one row per --fidelity_variants");
ABSL_FLAG(std::string, fidelity_variants, "int8,int4,int4_all,int4_head8",
          "--fidelity: forms to compare with bf16: bf16 (with --fidelity_reference), int8, int4 "
          "(the product's: LM head int4, one layer in seven, the first ones, int8), int4_all "
          "(every layer int4), int4_int8xN (the first N layers int8), int4_head8 (LM head int8), "
          "int4_head_bf16 (LM head packed bf16)");
ABSL_FLAG(std::string, fidelity_reference, "",
          "--fidelity: the bf16 reference from this checkpoint instead (same config), e.g. one "
          "holding the dequantized weights, which separates the kernels' error from rounding's");
ABSL_FLAG(double, fidelity_margin, 1.0, "--fidelity: bf16 top-1 margin counted as clear");
ABSL_FLAG(std::string, matmul, "auto", "decoder projections: auto, kernels or torch");
ABSL_FLAG(std::string, weight_dtype, "bf16", "decoder projection weights: bf16, int8 or int4");
ABSL_FLAG(bool, int8_prefill_gemm, true,
          "int8 layers: prefill rows on kernels::GemmInt8 (false: GemvInt8 like decode rows)");
ABSL_FLAG(bool, int8_lm_head, true,
          "with int8 weights (and --fidelity): the LM head in int8 too (false: packed bf16 head)");
ABSL_FLAG(std::string, tables, "decode,prefill,attention",
          "batched forward tables to print: decode, prefill, attention");

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double RssMb() {
  auto m = vlm::ReadProcessMemory();
  return m.ok() ? m->resident_bytes / 1048576.0 : -1;
}

std::string CpuModelName() {
  std::FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (f == nullptr) return "?";
  char line[512];
  std::string name = "?";
  while (std::fgets(line, sizeof line, f) != nullptr) {
    std::string l(line);
    if (l.rfind("model name", 0) == 0) {
      name = l.substr(l.find(':') + 2);
      if (!name.empty() && name.back() == '\n') name.pop_back();
      break;
    }
  }
  std::fclose(f);
  return name;
}

using vlm::bench::Median;

double Seconds(const std::function<void()>& f) {
  const double t = Now();
  f();
  return Now() - t;
}

// A text sequence's tokens [start, start + n) in one Forward pass (positions
// start..: text), logits of the last one; blocks from `table`.
absl::StatusOr<at::Tensor> Pass(const vlm::language::Decoder& d, vlm::language::KvStorage& kv,
                                absl::Span<const int32_t> ids, int64_t start, int64_t n,
                                absl::Span<const int32_t> table, bool decode) {
  vlm::language::SequenceChunk c;
  c.token_ids = ids.subspan(start, n);
  c.start = start;
  c.block_table = table;
  c.positions = at::arange(start, start + n, at::TensorOptions().dtype(at::kLong))
                    .unsqueeze(0)
                    .expand({3, n})
                    .contiguous();
  c.decode = decode;
  c.logits = true;
  absl::StatusOr<at::Tensor> logits = d.Forward(kv, {c});
  if (!logits.ok()) return logits.status();
  return (*logits)[0];
}

// A text prompt prefilled alone from cache index 0 in chunks of `chunk` tokens
// (0: one chunk); logits of its last token.
absl::StatusOr<at::Tensor> Prefill(const vlm::language::Decoder& d, vlm::language::KvStorage& kv,
                                   absl::Span<const int32_t> prompt,
                                   absl::Span<const int32_t> table, int64_t chunk) {
  const int64_t s = static_cast<int64_t>(prompt.size());
  if (chunk <= 0) chunk = s;
  absl::StatusOr<at::Tensor> last = absl::InvalidArgumentError("empty prompt");
  for (int64_t a = 0; a < s; a += chunk) {
    last = Pass(d, kv, prompt, a, std::min(chunk, s - a), table, false);
    if (!last.ok()) return last;
  }
  return last;
}

// Decoder::Forward: batched decode, prefill, attention. `bw`: read bandwidth
// (bytes/s) measured in this run.
int RunForward(const vlm::language::Decoder& d, double bw) {
  using namespace vlm;
  using namespace vlm::language;
  std::vector<int> batches;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_batches), ',')) {
    int v = 0;
    if (absl::SimpleAtoi(b, &v) && v > 0) batches.push_back(v);
  }
  const int context = absl::GetFlag(FLAGS_context), steps = absl::GetFlag(FLAGS_forward_steps);
  const int64_t bs = absl::GetFlag(FLAGS_block_size);
  const std::string tables = absl::GetFlag(FLAGS_tables);
  auto want = [&](const char* t) { return tables.find(t) != std::string::npos; };
  if (batches.empty() || !want("decode")) batches = {1};
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int64_t per_seq = (context + steps + bs) / bs;  // blocks per sequence
  const int prefill_n = absl::GetFlag(FLAGS_forward_prefill);
  const int64_t blocks = std::max<int64_t>(per_seq * max_batch, (prefill_n + bs) / bs);
  auto kv = d.NewKvStorage(blocks, bs);
  if (!kv.ok()) {
    std::fprintf(stderr, "%s\n", kv.status().ToString().c_str());
    return 1;
  }
  std::mt19937 rng(2);
  auto text_positions = [](int64_t start, int64_t n) {
    return at::arange(start, start + n, at::TensorOptions().dtype(at::kLong))
        .unsqueeze(0)
        .expand({3, n})
        .contiguous();
  };
  const double weight_bytes = static_cast<double>(d.decode_weight_bytes());
  if (want("decode")) {
  std::printf("\n### Batched decode through Decoder::Forward (context %d per sequence, "
              "median of %d passes)\n\n",
              context, steps);
  std::printf("| B | pass ms | aggregate tok/s | per-sequence tok/s | speedup vs B=1 | bound "
              "tok/s (B·bw/bytes) | of bound |\n|---|---|---|---|---|---|---|\n");
  double base = 0;
  for (int b : batches) {
    std::vector<std::vector<int32_t>> ids(b), tables(b);
    std::vector<at::Tensor> positions(b);
    for (int i = 0; i < b; ++i) {
      ids[i].resize(context + steps);
      for (int32_t& id : ids[i]) id = static_cast<int32_t>(rng() % 150000);
      for (int64_t k = 0; k < per_seq; ++k) tables[i].push_back(static_cast<int32_t>(i * per_seq + k));
      positions[i] = text_positions(0, context + steps);
    }
    // Prefill every sequence's context (one pass per sequence; not timed).
    for (int i = 0; i < b; ++i) {
      SequenceChunk c;
      c.token_ids = absl::MakeConstSpan(ids[i]).subspan(0, context);
      c.block_table = tables[i];
      c.positions = positions[i].narrow(1, 0, context);
      auto r = d.Forward(*kv, {c});
      if (!r.ok()) {
        std::fprintf(stderr, "prefill: %s\n", r.status().ToString().c_str());
        return 1;
      }
    }
    std::vector<double> times;
    for (int s = 0; s < steps; ++s) {
      std::vector<SequenceChunk> chunks(b);
      for (int i = 0; i < b; ++i) {
        SequenceChunk& c = chunks[i];
        c.token_ids = absl::MakeConstSpan(ids[i]).subspan(context + s, 1);
        c.start = context + s;
        c.block_table = tables[i];
        c.positions = positions[i].narrow(1, context + s, 1).contiguous();
        c.decode = true;
        c.logits = true;
      }
      absl::StatusOr<at::Tensor> r;
      times.push_back(Seconds([&] { r = d.Forward(*kv, chunks); }));
      if (!r.ok()) {
        std::fprintf(stderr, "decode: %s\n", r.status().ToString().c_str());
        return 1;
      }
    }
    const double pass = Median(times);
    const double agg = b / pass;
    if (base == 0) base = agg;
    const double bound = b * bw / weight_bytes;
    std::printf("| %d | %.1f | %.2f | %.2f | %.2fx | %.2f | %.0f%% |\n", b, pass * 1e3, agg,
                1.0 / pass, agg / base, bound, 100.0 * agg / bound);
  }
  std::printf("\nweight bytes per pass %.1f MB, read bandwidth %.1f GB/s\n", weight_bytes / 1048576.0,
              bw / 1e9);
  }  // decode

  if (prefill_n > 0) {
    std::vector<int32_t> ids(prefill_n);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 150000);
    std::vector<int32_t> table;
    for (int64_t k = 0; k < (prefill_n + bs - 1) / bs; ++k) table.push_back(static_cast<int32_t>(k));
    const int64_t chunk = absl::GetFlag(FLAGS_chunk);
    std::vector<double> chunked_t, whole_t;
    for (int rep = 0; rep < 3 && want("prefill"); ++rep) {
      bool ok = true;
      chunked_t.push_back(Seconds([&] { ok = Prefill(d, *kv, ids, table, chunk).ok(); }));
      whole_t.push_back(Seconds([&] { ok = ok && Prefill(d, *kv, ids, table, 0).ok(); }));
      if (!ok) return 1;
    }
    if (want("prefill")) {
    const double o = Median(chunked_t), n = Median(whole_t);
    std::printf("\n### Prefill of %d tokens through Forward (median of 3)\n\n"
                "| path | s | tok/s |\n|---|---|---|\n",
                prefill_n);
    std::printf("| chunks of %ld | %.3f | %.1f |\n", static_cast<long>(chunk), o, prefill_n / o);
    std::printf("| one chunk | %.3f | %.1f |\n| one chunk / chunks | %.2fx | |\n", n,
                prefill_n / n, n / o);
    }  // prefill

    if (!want("attention")) return 0;
    // One layer's attention, 2B shapes from the config, compute dtype.
    const TextConfig& tc = d.config().text;
    const int64_t hq = tc.num_attention_heads, hkv = tc.num_key_value_heads, hd = tc.head_dim;
    const at::ScalarType dt =
        d.compute_dtype() == ComputeDType::kBFloat16 ? at::kBFloat16 : at::kFloat;
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    const int64_t nb = (prefill_n + bs - 1) / bs;
    // The paged layout: K [blocks, Hkv, D, bs], V [blocks, Hkv, bs, D].
    const at::Tensor kc = at::randn({nb, hkv, hd, bs}).to(dt), vc = at::randn({nb, hkv, bs, hd}).to(dt);
    const at::Tensor q = at::randn({prefill_n, hq, hd}).to(dt);
    // Head-major views of the same keys for nn::AttentionHeadMajor: [Hkv, S, D].
    const at::Tensor kh = kc.permute({1, 0, 3, 2}).reshape({hkv, nb * bs, hd}).narrow(1, 0, prefill_n).contiguous();
    const at::Tensor vh = vc.transpose(0, 1).reshape({hkv, nb * bs, hd}).narrow(1, 0, prefill_n).contiguous();
    const at::Tensor qh = q.transpose(0, 1).contiguous();
    nn::AttentionOptions ao;
    ao.scale = scale;
    ao.causal = true;
    ao.query_tile = 512;
    std::vector<PagedQueryRun> runs = {{0, prefill_n, 0, table}};
    PagedAttentionOptions po;
    po.scale = scale;
    std::vector<double> t_old, t_new, t_new_dec, t_scalar;
    const int64_t dec_len = std::min<int64_t>(context, prefill_n);
    std::vector<PagedQueryRun> dec_runs = {{0, 1, dec_len - 1, table}};
    const at::Tensor q1 = q.narrow(0, 0, 1).contiguous();
    for (int rep = 0; rep < 5; ++rep) {
      t_old.push_back(Seconds([&] { nn::AttentionHeadMajor(qh, kh, vh, ao); }));
      t_new.push_back(Seconds([&] { PagedAttention(q, kc, vc, runs, po); }));
      PagedAttentionOptions scalar = po;
      scalar.path = AttentionPath::kScalar;
      if (rep < 2) t_scalar.push_back(Seconds([&] { PagedAttention(q, kc, vc, runs, scalar); }));
      t_new_dec.push_back(Seconds([&] {
        for (int i = 0; i < 100; ++i) PagedAttention(q1, kc, vc, dec_runs, po);
      }) / 100);
    }
    std::printf("\n### Attention of one layer (%ld query heads, %ld KV heads, head_dim %ld, %s; "
                "median of 5)\n\n| case | old | new (PagedAttention %s) | new / old |\n"
                "|---|---|---|---|\n",
                static_cast<long>(hq), static_cast<long>(hkv), static_cast<long>(hd),
                c10::toString(dt), AttentionPathName(DefaultAttentionPath()));
    std::printf("| prefill %d causal (old: nn::AttentionHeadMajor) | %.2f ms | %.2f ms | %.2fx |\n",
                prefill_n, Median(t_old) * 1e3, Median(t_new) * 1e3, Median(t_new) / Median(t_old));
    std::printf("| prefill %d, scalar path | | %.2f ms | %.2fx |\n", prefill_n,
                Median(t_scalar) * 1e3, Median(t_scalar) / Median(t_old));
    std::printf("| decode, 1 query over %ld keys | | %.1f us | |\n", static_cast<long>(dec_len),
                Median(t_new_dec) * 1e6);
  }
  return 0;
}

// One decoder layer's projections for M rows on each kernel (random weights of
// the model's shapes, so the timing is the kernels' alone): the numbers that
// decide whether decode rows can share the prefill GEMM's packed weights.
int RunSmallM(const vlm::TextConfig& c, double bw) {
  using namespace vlm;
  namespace k = vlm::kernels;
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim, inter = c.intermediate_size;
  auto rnd = [](int64_t n, int64_t kk) { return (at::randn({n, kk}) * 0.02).to(at::kBFloat16); };
  const at::Tensor wq = rnd(q, h), wk = rnd(kv, h), wv = rnd(kv, h), wo = rnd(h, q),
                   wg = rnd(inter, h), wu = rnd(inter, h), wd = rnd(h, inter);
  const at::Tensor wqkv = at::cat({wq, wk, wv}, 0);
  auto pqkv = k::PackedWeight::Pack(wqkv), po = k::PackedWeight::Pack(wo),
       pgu = k::PackedWeight::PackGateUp(wg, wu), pd = k::PackedWeight::Pack(wd);
  auto qqkv = k::QuantizeInt8(wqkv), qo = k::QuantizeInt8(wo), qg = k::QuantizeInt8(wg),
       qu = k::QuantizeInt8(wu), qd = k::QuantizeInt8(wd);
  if (!pqkv.ok() || !po.ok() || !pgu.ok() || !pd.ok() || !qqkv.ok() || !qo.ok() || !qg.ok() ||
      !qu.ok() || !qd.ok()) {
    std::fprintf(stderr, "pack/quantize failed\n");
    return 1;
  }
  const double bf16_bytes = 2.0 * (wqkv.numel() + wo.numel() + 2 * wg.numel() + wd.numel());
  const double int8_bytes = static_cast<double>(qqkv->bytes() + qo->bytes() + qg->bytes() +
                                                qu->bytes() + qd->bytes());
  std::printf("\n### Decode-row kernels, one layer's projections (hidden %ld, q|k|v %ld, "
              "intermediate %ld; median of 15; %s)\n\n",
              static_cast<long>(h), static_cast<long>(q + 2 * kv), static_cast<long>(inter),
              k::GemmPathName(k::DefaultGemmPath()));
  std::printf("| M | Gemv bf16 ms | Gemm bf16 (packed) ms | Gemm / Gemv | GemvInt8 ms | int8 / Gemv "
              "| bf16 bound ms | int8 bound ms |\n|---|---|---|---|---|---|---|---|\n");
  for (int64_t m : {1, 2, 4, 8}) {
    const at::Tensor x = at::randn({m, h}).to(at::kBFloat16);
    const at::Tensor xo = at::randn({m, q}).to(at::kBFloat16);
    const at::Tensor xd = at::randn({m, inter}).to(at::kBFloat16);
    std::vector<double> tg, tk, ti;
    for (int rep = 0; rep < 16; ++rep) {
      const double a = Seconds([&] {
        at::Tensor yq, yk, yv, yo, yg, yu, yd;
        at::Tensor* ys[] = {&yq, &yk, &yv};
        const at::Tensor ws[] = {wq, wk, wv};
        (void)GemvMulti(x, ws, ys);
        (void)Gemv(xo, wo, &yo);
        at::Tensor* ys2[] = {&yg, &yu};
        const at::Tensor ws2[] = {wg, wu};
        (void)GemvMulti(x, ws2, ys2);
        (void)Gemv(xd, wd, &yd);
      });
      const double b = Seconds([&] {
        (void)k::Gemm(x, *pqkv);
        (void)k::Gemm(xo, *po);
        k::GemmOptions so;
        so.activation = k::Activation::kSiluMul;
        (void)k::Gemm(x, *pgu, so);
        (void)k::Gemm(xd, *pd);
      });
      const double i8 = Seconds([&] {
        at::Tensor yqkv, yo, yg, yu, yd;
        (void)k::GemvInt8(x, *qqkv, &yqkv);
        (void)k::GemvInt8(xo, *qo, &yo);
        (void)k::GemvInt8(x, *qg, &yg);
        (void)k::GemvInt8(x, *qu, &yu);
        (void)k::GemvInt8(xd, *qd, &yd);
      });
      if (rep == 0) continue;  // warm-up
      tg.push_back(a);
      tk.push_back(b);
      ti.push_back(i8);
    }
    const double g = Median(tg), kk = Median(tk), i8 = Median(ti);
    std::printf("| %ld | %.3f | %.3f | %.2fx | %.3f | %.2fx | %.3f | %.3f |\n",
                static_cast<long>(m), g * 1e3, kk * 1e3, kk / g, i8 * 1e3, i8 / g,
                bf16_bytes / bw * 1e3, int8_bytes / bw * 1e3);
  }
  std::printf("\nread bandwidth %.1f GB/s; CPU: %s\n", bw / 1e9, CpuModelName().c_str());
  return 0;
}

// One quantized form of the decoder for --fidelity: weights and LM head.
struct FidelityVariant {
  std::string name;
  vlm::language::WeightDType weights;
  bool int8_head = true, int4_head = false;
  int int8_layers = vlm::language::kAutoInt4Int8Layers;  // int4: leading int8 layers
};

// --fidelity_variants: bf16 (against --fidelity_reference), int8 (int8 head
// unless --int8_lm_head=false), int4 (the product default: int4 head, the
// first AutoInt4Int8Layers layers int8), int4_all (every layer int4),
// int4_int8xN (the first N layers int8), int4_head8 (int8 head),
// int4_head_bf16 (packed bf16 head).
absl::StatusOr<std::vector<FidelityVariant>> ParseFidelityVariants(const std::string& list) {
  using vlm::language::WeightDType;
  constexpr int kAuto = vlm::language::kAutoInt4Int8Layers;
  std::vector<FidelityVariant> out;
  for (absl::string_view v : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    int layers = 0;
    if (v == "bf16") {
      out.push_back({"bf16", WeightDType::kBFloat16});
    } else if (v == "int8") {
      out.push_back({"int8", WeightDType::kInt8, absl::GetFlag(FLAGS_int8_lm_head)});
    } else if (v == "int4") {
      out.push_back({"int4 (head int4, 1 layer in 7 int8)", WeightDType::kInt4, true, true, kAuto});
    } else if (v == "int4_all") {
      out.push_back({"int4 (head int4, every layer int4)", WeightDType::kInt4, true, true, 0});
    } else if (absl::ConsumePrefix(&v, "int4_int8x") && absl::SimpleAtoi(v, &layers) && layers > 0) {
      out.push_back({absl::StrCat("int4 (head int4, layers 0-", layers - 1, " int8)"),
                     WeightDType::kInt4, true, true, layers});
    } else if (v == "int4_head8") {
      out.push_back({"int4 (head int8, 1 layer in 7 int8)", WeightDType::kInt4, true, false, kAuto});
    } else if (v == "int4_head_bf16") {
      out.push_back({"int4 (head bf16, 1 layer in 7 int8)", WeightDType::kInt4, false, false, kAuto});
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown fidelity variant ", v));
    }
  }
  return out;
}

// One sequence through a decoder: `prompt` ids prefilled, then one decode
// pass per further id of `ids`; the logits at every pass's last position.
absl::StatusOr<std::vector<at::Tensor>> SequenceLogits(const vlm::language::Decoder& d,
                                                       std::vector<int32_t>& ids, int prompt,
                                                       int steps, bool extend_greedy) {
  using namespace vlm::language;
  const int64_t bs = 16;
  std::vector<int32_t> table;
  for (int32_t b = 0; b < (prompt + steps + bs) / bs; ++b) table.push_back(b);
  auto kv = d.NewKvStorage(static_cast<int64_t>(table.size()), bs);
  if (!kv.ok()) return kv.status();
  std::vector<at::Tensor> out;
  for (int step = 0; step <= steps; ++step) {
    const int64_t start = step == 0 ? 0 : prompt + step - 1, n = step == 0 ? prompt : 1;
    SequenceChunk c;
    c.token_ids = absl::MakeConstSpan(ids).subspan(start, n);
    c.start = start;
    c.block_table = table;
    c.positions = at::arange(start, start + n, at::TensorOptions().dtype(at::kLong))
                      .unsqueeze(0).expand({3, n}).contiguous();
    c.decode = step > 0;
    c.logits = true;
    auto l = d.Forward(*kv, {c});
    if (!l.ok()) return l.status();
    out.push_back((*l)[0].to(at::kDouble));
    if (extend_greedy && step < steps) ids.push_back(static_cast<int32_t>(out.back().argmax().item<int64_t>()));
  }
  return out;
}

// Quantized forms against bf16 (kernels) on the same checkpoint: per position
// logits cosine, greedy agreement overall and where the bf16 top-1 margin
// exceeds --fidelity_margin (each form teacher-forced on the bf16 greedy
// continuation), and the weight bytes a decode step reads.
int RunFidelity(std::shared_ptr<const vlm::SafetensorsCheckpoint> checkpoint,
                const vlm::ModelConfig& config) {
  using namespace vlm;
  using namespace vlm::language;
  auto variants = ParseFidelityVariants(absl::GetFlag(FLAGS_fidelity_variants));
  if (!variants.ok()) {
    std::fprintf(stderr, "%s\n", variants.status().ToString().c_str());
    return 2;
  }
  DecoderOptions o;
  o.compute_dtype = ComputeDType::kBFloat16;
  o.int8_prefill_gemm = absl::GetFlag(FLAGS_int8_prefill_gemm);
  std::shared_ptr<const SafetensorsCheckpoint> reference = checkpoint;
  if (const std::string dir = absl::GetFlag(FLAGS_fidelity_reference); !dir.empty()) {
    auto r = SafetensorsCheckpoint::Open(dir);
    if (!r.ok()) {
      std::fprintf(stderr, "reference: %s\n", r.status().ToString().c_str());
      return 1;
    }
    reference = *std::move(r);
  }
  auto bf16 = Decoder::Load(reference, config, o);
  if (!bf16.ok()) {
    std::fprintf(stderr, "load: %s\n", bf16.status().ToString().c_str());
    return 1;
  }
  std::printf("%s\n", (*bf16)->load_summary().c_str());
  const int prompt = absl::GetFlag(FLAGS_prompt_tokens), steps = absl::GetFlag(FLAGS_decode_tokens);
  const double threshold = absl::GetFlag(FLAGS_fidelity_margin);
  std::mt19937 rng(9);
  std::vector<int32_t> ids(prompt);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % std::min<int64_t>(150000, (*bf16)->vocab_size()));
  auto want = SequenceLogits(**bf16, ids, prompt, steps, true);
  if (!want.ok()) {
    std::fprintf(stderr, "bf16 forward: %s\n", want.status().ToString().c_str());
    return 1;
  }
  const double bf16_bytes = static_cast<double>((*bf16)->decode_weight_bytes());
  bf16->reset();
  std::string rows;
  for (const FidelityVariant& v : *variants) {
    o.weight_dtype = v.weights;
    o.int8_lm_head = v.int8_head;
    o.int4_lm_head = v.int4_head;
    o.int4_int8_layers = v.int8_layers;
    auto d = Decoder::Load(checkpoint, config, o);
    if (!d.ok()) {
      std::fprintf(stderr, "load %s: %s\n", v.name.c_str(), d.status().ToString().c_str());
      return 1;
    }
    std::printf("%s\n", (*d)->load_summary().c_str());
    auto got = SequenceLogits(**d, ids, prompt, steps, false);
    if (!got.ok()) {
      std::fprintf(stderr, "forward %s: %s\n", v.name.c_str(), got.status().ToString().c_str());
      return 1;
    }
    double cos_min = 1, cos_sum = 0;
    int clear = 0, agree = 0, agree_all = 0;
    for (size_t i = 0; i < want->size(); ++i) {
      const at::Tensor& x = (*want)[i];
      const at::Tensor& y = (*got)[i];
      const double c = (x * y).sum().item<double>() / (x.norm().item<double>() * y.norm().item<double>());
      cos_min = std::min(cos_min, c);
      cos_sum += c;
      auto top = x.topk(2);
      const double margin = std::get<0>(top)[0].item<double>() - std::get<0>(top)[1].item<double>();
      const bool same = y.argmax().item<int64_t>() == std::get<1>(top)[0].item<int64_t>();
      agree_all += same;
      if (margin > threshold) {
        ++clear;
        agree += same;
      }
    }
    const double bytes = static_cast<double>((*d)->decode_weight_bytes());
    absl::StrAppend(&rows, absl::StrFormat("| %s | %.6f | %.6f | %d / %zu | %d | %d | %.3f (%.2fx fewer) |\n",
                                           v.name, cos_min, cos_sum / want->size(), agree_all,
                                           want->size(), clear, agree, bytes / 1e9, bf16_bytes / bytes));
  }
  std::printf("\n### Quantized vs bf16 logits (%s), %d prompt tokens + %d teacher-forced greedy "
              "steps, bf16 decode step reads %.3f GB\n\n"
              "| weights | cosine min | cosine mean | greedy equal (all) | bf16 margin > %g | greedy "
              "equal there | GB read per decode step |\n|---|---|---|---|---|---|---|\n%s",
              absl::GetFlag(FLAGS_checkpoint).c_str(), prompt, steps, bf16_bytes / 1e9, threshold,
              rows.c_str());
  return 0;
}

int Run() {
  using namespace vlm;
  using namespace vlm::language;
  const std::string dir = absl::GetFlag(FLAGS_checkpoint);
  at::set_num_threads(absl::GetFlag(FLAGS_threads));
  const double rss0 = RssMb();
  const double t0 = Now();
  auto config = LoadModelConfig(dir);
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  if (!config.ok() || !ckpt.ok()) {
    std::fprintf(stderr, "%s %s\n", config.status().ToString().c_str(), ckpt.status().ToString().c_str());
    return 1;
  }
  std::shared_ptr<const SafetensorsCheckpoint> checkpoint(*std::move(ckpt));
  const ComputeDType dtype =
      absl::GetFlag(FLAGS_dtype) == "f32" ? ComputeDType::kFloat32 : ComputeDType::kBFloat16;
  ProjectorOptions po;
  po.compute_dtype = dtype;
  auto projector = Projector::Load(*checkpoint, *config, po);
  if (!projector.ok() || !(*projector)->WarmUp().ok()) {
    std::fprintf(stderr, "projector: %s\n", projector.status().ToString().c_str());
    return 1;
  }
  const double t_projector = Now();
  if (absl::GetFlag(FLAGS_small_m)) {
    std::vector<uint8_t> buffer(size_t{1} << 30, 1);
    std::vector<double> bws;
    for (int i = 0; i < 4; ++i) {
      bws.push_back(MeasureReadBandwidth(buffer.data(), buffer.size(), absl::GetFlag(FLAGS_threads)));
    }
    return RunSmallM(config->text, *std::max_element(bws.begin(), bws.end()));
  }
  if (absl::GetFlag(FLAGS_fidelity)) return RunFidelity(checkpoint, *config);
  DecoderOptions o;
  o.compute_dtype = dtype;
  o.use_gemv = absl::GetFlag(FLAGS_gemv);
  o.packed_head = absl::GetFlag(FLAGS_packed_head);
  {
    auto matmul = ParseMatmulPath(absl::GetFlag(FLAGS_matmul));
    auto weights = ParseWeightDType(absl::GetFlag(FLAGS_weight_dtype));
    if (!matmul.ok() || !weights.ok()) {
      std::fprintf(stderr, "%s %s\n", matmul.status().ToString().c_str(),
                   weights.status().ToString().c_str());
      return 2;
    }
    o.matmul = *matmul;
    o.weight_dtype = *weights;
    o.int8_lm_head = absl::GetFlag(FLAGS_int8_lm_head);
    o.int8_prefill_gemm = absl::GetFlag(FLAGS_int8_prefill_gemm);
  }
  o.layers.eager_load = absl::GetFlag(FLAGS_eager);
  o.layers.resident_layers = absl::GetFlag(FLAGS_resident_layers);
  o.layers.prefetch_layers = absl::GetFlag(FLAGS_prefetch_layers);
  auto decoder = Decoder::Load(checkpoint, *config, o);
  if (!decoder.ok()) {
    std::fprintf(stderr, "decoder: %s\n", decoder.status().ToString().c_str());
    return 1;
  }
  Decoder& d = **decoder;
  const double t_loaded = Now();
  const double rss_loaded = RssMb();
  std::printf("%s\n%s\n", (*projector)->load_summary().c_str(), d.load_summary().c_str());

  const int n_prompt = absl::GetFlag(FLAGS_prompt_tokens);
  const int n_decode = absl::GetFlag(FLAGS_decode_tokens);
  std::mt19937 rng(1);
  std::vector<int32_t> ids(n_prompt);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 150000);
  // One request alone, as the engine runs it: its own blocks, the prompt in
  // --chunk passes, then one decode pass per token.
  const int64_t bs = absl::GetFlag(FLAGS_block_size);
  std::vector<int32_t> table;
  for (int64_t b = 0; b * bs < n_prompt + n_decode + 1; ++b) table.push_back(static_cast<int32_t>(b));
  auto kv = d.NewKvStorage(static_cast<int64_t>(table.size()), bs);
  if (!kv.ok()) {
    std::fprintf(stderr, "%s\n", kv.status().ToString().c_str());
    return 1;
  }

  if (!absl::GetFlag(FLAGS_single)) {
    std::vector<uint8_t> buffer(size_t{1} << 30, 1);
    MeasureReadBandwidth(buffer.data(), buffer.size(), absl::GetFlag(FLAGS_threads));
    std::vector<double> bws;
    for (int i = 0; i < 3; ++i) {
      bws.push_back(MeasureReadBandwidth(buffer.data(), buffer.size(), absl::GetFlag(FLAGS_threads)));
    }
    std::printf("CPU: %s\n", CpuModelName().c_str());
    const int rc = RunForward(d, *std::max_element(bws.begin(), bws.end()));
    return rc;
  }
  // First request: prefill (cold layers) + decode.
  double t = Now();
  auto logits = Prefill(d, *kv, ids, table, absl::GetFlag(FLAGS_chunk));
  const double prefill_cold = Now() - t;
  if (!logits.ok()) {
    std::fprintf(stderr, "prefill: %s\n", logits.status().ToString().c_str());
    return 1;
  }
  std::vector<double> steps;
  for (int i = 0; i < n_decode; ++i) {
    const int32_t next = static_cast<int32_t>(logits->argmax().item<int64_t>() % 150000);
    ids.push_back(next);
    t = Now();
    logits = Pass(d, *kv, ids, n_prompt + i, 1, table, /*decode=*/true);
    steps.push_back(Now() - t);
    if (!logits.ok()) return 1;
  }
  const double rss_after = RssMb();
  // Warm prefill of the same prompt (from cache index 0 again).
  t = Now();
  if (!Prefill(d, *kv, absl::MakeConstSpan(ids).subspan(0, n_prompt), table,
               absl::GetFlag(FLAGS_chunk)).ok()) {
    return 1;
  }
  const double prefill_warm = Now() - t;

  // Read bandwidth with the same threads over a 1 GiB buffer.
  std::vector<uint8_t> buffer(size_t{1} << 30, 1);
  MeasureReadBandwidth(buffer.data(), buffer.size(), absl::GetFlag(FLAGS_threads));
  std::vector<double> bws;
  for (int i = 0; i < 3; ++i) {
    bws.push_back(MeasureReadBandwidth(buffer.data(), buffer.size(), absl::GetFlag(FLAGS_threads)));
  }
  const double bw = Median(bws);
  const double bytes = static_cast<double>(d.decode_weight_bytes());
  const double bound_ms = bytes / bw * 1e3;
  // Steady state: skip the first 2 steps (page-in, first touch of the head).
  std::vector<double> steady(steps.begin() + std::min<size_t>(2, steps.size()), steps.end());
  const double step_ms = Median(steady) * 1e3;

  std::printf("\n| metric | value |\n|---|---|\n");
  std::printf("| threads | %d |\n", absl::GetFlag(FLAGS_threads));
  std::printf("| projector load + warm-up | %.3f s |\n", t_projector - t0);
  std::printf("| decoder load (%s) | %.3f s |\n", o.layers.eager_load ? "eager" : "lazy",
              t_loaded - t_projector);
  std::printf("| RSS before / after load | %.0f / %.0f MB |\n", rss0, rss_loaded);
  std::printf("| prefill %d tokens, cold / warm | %.3f / %.3f s (%.1f tok/s warm) |\n", n_prompt,
              prefill_cold, prefill_warm, n_prompt / prefill_warm);
  std::printf("| first decode step | %.1f ms |\n", steps.empty() ? 0 : steps[0] * 1e3);
  std::printf("| decode step (median of %zu) | %.1f ms (%.2f tok/s) |\n", steady.size(), step_ms,
              1e3 / step_ms);
  std::printf("| weight bytes per decode step | %.1f MB |\n", bytes / 1048576.0);
  std::printf("| read bandwidth (%d threads) | %.1f GB/s |\n", absl::GetFlag(FLAGS_threads), bw / 1e9);
  std::printf("| bandwidth bound | %.1f ms |\n", bound_ms);
  std::printf("| decode / bound | %.2fx |\n", step_ms / bound_ms);
  std::printf("| RSS after first request | %.0f MB |\n", rss_after);
  std::printf("| layers resident / materializations | %d / %ld |\n", d.layers().resident_layers(),
              static_cast<long>(d.layers().materializations()));
  std::printf("CPU: %s\n", CpuModelName().c_str());
  return RunForward(d, bw);
}

}  // namespace

int main(int argc, char** argv) {
  vlm::EnsureOmpWaitPolicy(argv);  // as the language service runs: see omp_wait_policy.h
  absl::ParseCommandLine(argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // tables appear as they are measured
  return Run();
}
