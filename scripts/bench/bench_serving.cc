// vlm-bench-serving: the serving engine as a client sees it (issue 10,
// "Benchmark"). Starts the real vlm-vision, vlm-language and vlm-gateway on
// loopback ports, once per configuration of the language service, and
// measures through the gateway:
//
//   - aggregate decode tokens/s with 1, 2, 4, 8 concurrent streams (sum of
//     every stream's tokens after its first, over the time from the earliest
//     first token to the latest last token), the ratio to 1 stream, and the
//     memory-bandwidth bound: streams x read bandwidth / weight bytes of one
//     decode step (a batched step reads every weight once), the bandwidth
//     measured by this process in the same run;
//     Also the steady-state rate: tokens that arrived while every stream was
//     decoding (between the latest first token and the earliest last one), over
//     that window, which leaves out the other streams' prefill; and the language
//     engine's own decode-iteration time (vlm_language_iteration_seconds);
//   - time to first token p50 / p95 at each concurrency;
//   - a conversation about one 448x448 image, 3 turns (each turn resends the
//     history with the previous answers): TTFT per turn, turn2 / turn1.
//
// Configurations (--configs, ';'-separated "name:flag,flag"): by default the
// engine's defaults and a baseline without batching or prefix cache, in one
// run. Everything has deadlines; a watchdog ends the run after --timeout_s.
//
//   vlm-bench-serving --model_dir ~/.cache/vlm/checkpoints/2b
#include <grpcpp/grpcpp.h>
#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/safetensors.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "common/kernels/gemv.h"
#include "tests/integration/service_process.h"
#include "tests/integration/test_png.h"
#include "vlm/v1/gateway.grpc.pb.h"
#include "scripts/bench/read_bandwidth.h"

ABSL_FLAG(std::string, model_dir, "",
          "checkpoint directory (default: $VLM_CACHE_DIR or ~/.cache/vlm, /checkpoints/2b)");
ABSL_FLAG(std::string, bin_dir, "", "build directory holding services/ (default: ../ of this binary)");
ABSL_FLAG(std::string, configs,
          "engine:;baseline:--max_sequences=1,--prefix_cache=false",
          "';'-separated configurations, each name:comma-separated extra vlm-language flags");
ABSL_FLAG(std::string, streams, "1,2,4,8", "concurrencies measured");
ABSL_FLAG(int, max_tokens, 48, "completion tokens per stream");
ABSL_FLAG(int, rounds, 3,
          "rounds over all concurrencies, interleaved (medians of the rates; TTFT pooled)");
ABSL_FLAG(int, turns, 3, "turns of the image conversation");
ABSL_FLAG(int, threads, 2, "intra-op threads of the services (and bandwidth threads)");
ABSL_FLAG(int, timeout_s, 3600, "the whole run ends (exit 3) after this");

namespace {

using Clock = std::chrono::steady_clock;
using vlm::testing::ServiceProcess;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  return v[i];
}

uint64_t DecodeWeightBytes(const std::string& dir) {
  auto checkpoint = vlm::SafetensorsCheckpoint::Open(dir);
  if (!checkpoint.ok()) return 0;
  uint64_t bytes = 0, embed = 0, head = 0;
  for (const std::string& name : (*checkpoint)->Names()) {
    auto info = (*checkpoint)->Info(name);
    if (!info.ok()) continue;
    if (name == "lm_head.weight") {
      head = (*info)->nbytes();
    } else if (absl::StrContains(name, "embed_tokens")) {
      embed = (*info)->nbytes();
    } else if (absl::StrContains(name, "language_model.") || name.rfind("model.layers.", 0) == 0 ||
               name == "model.norm.weight") {
      bytes += (*info)->nbytes();
    }
  }
  return bytes + (head > 0 ? head : embed);
}

double ReadBandwidth(int threads) { return vlm::BestReadBandwidth(size_t{1} << 30, threads); }

struct StreamResult {
  bool ok = false;
  std::string error;
  Clock::time_point start, first, last;
  std::vector<Clock::time_point> token_times;  // one per generated token (logprobs entries)
  int tokens = 0;
  std::string text;
  int cached_prompt_tokens = 0;
};

StreamResult Chat(vlm::v1::VisionLanguage::Stub& stub, const vlm::v1::ChatRequest& request) {
  StreamResult r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  r.start = Clock::now();
  auto reader = stub.ChatStream(&ctx, request);
  vlm::v1::ChatChunk chunk;
  while (reader->Read(&chunk)) {
    const Clock::time_point now = Clock::now();
    if (!chunk.text().empty() || chunk.logprobs_size() > 0 || chunk.has_usage()) {
      if (r.first == Clock::time_point{}) r.first = now;
      r.last = now;
    }
    for (int i = 0; i < chunk.logprobs_size(); ++i) r.token_times.push_back(now);
    r.text += chunk.text();
    if (chunk.has_usage()) {
      r.tokens = chunk.usage().completion_tokens();
      r.cached_prompt_tokens = chunk.usage().cached_prompt_tokens();
    }
  }
  grpc::Status s = reader->Finish();
  r.ok = s.ok();
  if (!s.ok()) r.error = s.error_message();
  return r;
}

vlm::v1::ChatRequest TextChat(const std::string& text, int max_tokens) {
  vlm::v1::ChatRequest request;
  auto* m = request.add_messages();
  m->set_role("user");
  m->add_content()->set_text(text);
  request.mutable_params()->set_max_tokens(max_tokens);
  request.mutable_params()->set_ignore_eos(true);
  request.mutable_params()->set_logprobs(true);  // one entry per token: arrival times per token
  request.mutable_params()->mutable_sampling()->set_temperature(0.0f);
  return request;
}

struct ConcurrencyRow {
  int streams = 0;
  double tokens_per_s = 0;  // median over rounds
  double steady_tokens_per_s = 0;  // median over rounds: while every stream decodes
  double decode_iteration_ms = 0;  // the engine's mean decode-only iteration, all rounds
  double ttft_p50_ms = 0, ttft_p95_ms = 0;
  int failures = 0;
  std::vector<double> round_rates;  // aggregate tok/s of each round, in order (0: none)
};
struct TurnRow {
  std::vector<double> ttft_ms;
  std::vector<int> cached;
};
struct ConfigResult {
  std::string name, flags;
  std::vector<ConcurrencyRow> rows;
  TurnRow turns;
  std::string error;
};

// Sum and count of the language engine's decode-only iterations, from its /metrics.
struct IterationTotals {
  double seconds = 0;
  double count = 0;
};
IterationTotals ScrapeDecodeIterations(const std::string& host, int port) {
  IterationTotals t;
  httplib::Client client(host, port);
  client.set_read_timeout(5, 0);
  httplib::Result res = client.Get("/metrics");
  if (!res || res->status != 200) return t;
  for (absl::string_view line : absl::StrSplit(res->body, '\n')) {
    if (!absl::StrContains(line, "phase=\"decode\"")) continue;
    const size_t space = line.rfind(' ');
    double v = 0;
    if (space == absl::string_view::npos || !absl::SimpleAtod(line.substr(space + 1), &v)) continue;
    if (absl::StartsWith(line, "vlm_language_iteration_seconds_sum")) t.seconds = v;
    if (absl::StartsWith(line, "vlm_language_iteration_seconds_count")) t.count = v;
  }
  return t;
}

bool WaitServing(const std::string& target, absl::Duration timeout) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse resp;
    if (stub->Check(&ctx, req, &resp).ok() &&
        resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  return false;
}

ConfigResult RunConfig(const std::string& bin, const std::string& model_dir,
                       const std::string& log_dir, const std::string& vision_target,
                       const std::string& name, const std::string& flags, int image_seed) {
  ConfigResult result;
  result.name = name;
  result.flags = flags;
  const std::string threads = absl::StrCat("--intra_op_threads=", absl::GetFlag(FLAGS_threads));
  std::vector<std::string> language_flags = {"--model_dir=" + model_dir,
                                             "--grpc_address=127.0.0.1:0",
                                             "--metrics_address=127.0.0.1:0", threads,
                                             "--max_queue=64"};
  for (absl::string_view f : absl::StrSplit(flags, ',', absl::SkipEmpty())) {
    language_flags.emplace_back(f);
  }
  ServiceProcess language(bin + "/services/language/vlm-language", language_flags,
                          log_dir + "/language-" + name);
  if (!language.WaitListening(absl::Minutes(2))) {
    result.error = "language did not start: " + language.LogTail(5);
    return result;
  }
  ServiceProcess gateway(bin + "/services/gateway/vlm-gateway",
                         {"--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                          "--http_address=127.0.0.1:0",
                          "--language_target=" + language.grpc_target(),
                          "--vision_targets=" + vision_target, "--max_inflight=16",
                          "--max_queue=64"},
                         log_dir + "/gateway-" + name);
  if (!gateway.WaitListening(absl::Minutes(1)) ||
      !WaitServing(gateway.grpc_target(), absl::Minutes(5))) {
    result.error = "gateway not serving: " + gateway.LogTail(5) + language.LogTail(5);
    return result;
  }
  auto stub = vlm::v1::VisionLanguage::NewStub(
      grpc::CreateChannel(gateway.grpc_target(), grpc::InsecureChannelCredentials()));
  // Warm-up: the decoder's layers are materialized on first use.
  Chat(*stub, TextChat(absl::StrCat("Warm up ", name, "."), 8));

  const int max_tokens = absl::GetFlag(FLAGS_max_tokens);
  // Rounds are interleaved (1, 2, 4, 8, 1, 2, 4, 8, ...) rather than grouped
  // by concurrency: the memory bandwidth a shared host gives this machine
  // drifts over minutes (28-56 GB/s seen in one session), and grouping would
  // turn that drift into a difference between concurrencies.
  std::vector<ConcurrencyRow> rows;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_streams), ',', absl::SkipEmpty())) {
    ConcurrencyRow row;
    if (absl::SimpleAtoi(s, &row.streams) && row.streams >= 1) rows.push_back(row);
  }
  std::vector<std::vector<double>> rates(rows.size()), steady(rows.size()), ttft(rows.size());
  std::vector<IterationTotals> iterations(rows.size());
  int round_id = 0;
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    for (size_t c = 0; c < rows.size(); ++c, ++round_id) {
      ConcurrencyRow& row = rows[c];
      const IterationTotals before =
          ScrapeDecodeIterations(language.metrics_host, language.metrics_port);
      std::vector<StreamResult> results(row.streams);
      std::vector<std::thread> threads_v;
      for (int i = 0; i < row.streams; ++i) {
        threads_v.emplace_back([&, i] {
          // A distinct opening per stream and round: no prefix is shared.
          results[i] = Chat(*stub, TextChat(absl::StrCat("Round ", round_id, " stream ", i,
                                                         ": write a long story about a lighthouse "
                                                         "keeper and the sea."),
                                            max_tokens));
        });
      }
      for (auto& t : threads_v) t.join();
      const IterationTotals after =
          ScrapeDecodeIterations(language.metrics_host, language.metrics_port);
      iterations[c].count += after.count - before.count;
      iterations[c].seconds += after.seconds - before.seconds;
      Clock::time_point first = Clock::time_point::max(), last{};
      int64_t after_first = 0;
      for (const StreamResult& r : results) {
        if (!r.ok || r.tokens < 1) {
          ++row.failures;
          if (result.error.empty()) result.error = r.error;
          continue;
        }
        first = std::min(first, r.first);
        last = std::max(last, r.last);
        after_first += r.tokens - 1;
        ttft[c].push_back(Seconds(r.start, r.first) * 1000);
      }
      if (last > first) rates[c].push_back(static_cast<double>(after_first) / Seconds(first, last));
      row.round_rates.push_back(last > first ? rates[c].back() : 0.0);
      // Steady state: from the latest first token to the earliest last token.
      Clock::time_point all_in = Clock::time_point{}, first_out = Clock::time_point::max();
      for (const StreamResult& r : results) {
        if (!r.ok || r.token_times.size() < 2) continue;
        all_in = std::max(all_in, r.token_times.front());
        first_out = std::min(first_out, r.token_times.back());
      }
      if (first_out > all_in) {
        int64_t inside = 0;
        for (const StreamResult& r : results) {
          for (const Clock::time_point& t : r.token_times) inside += t > all_in && t <= first_out;
        }
        steady[c].push_back(static_cast<double>(inside) / Seconds(all_in, first_out));
      }
      std::fprintf(stderr, "[%s] round %d, %d streams: %.1f tok/s\n", name.c_str(), round + 1,
                   row.streams, rates[c].empty() ? 0.0 : rates[c].back());
    }
  }
  for (size_t c = 0; c < rows.size(); ++c) {
    ConcurrencyRow& row = rows[c];
    if (iterations[c].count > 0) {
      row.decode_iteration_ms = 1000 * iterations[c].seconds / iterations[c].count;
    }
    row.steady_tokens_per_s = Percentile(steady[c], 0.5);
    row.tokens_per_s = Percentile(rates[c], 0.5);
    row.ttft_p50_ms = Percentile(ttft[c], 0.5);
    row.ttft_p95_ms = Percentile(ttft[c], 0.95);
    result.rows.push_back(row);
    std::fprintf(stderr, "[%s] %d streams: %.1f tok/s, TTFT p50 %.0f ms\n", name.c_str(),
                 row.streams, row.tokens_per_s, row.ttft_p50_ms);
  }

  // The image conversation.
  vlm::v1::ChatRequest chat;
  auto* first_turn = chat.add_messages();
  first_turn->set_role("user");
  first_turn->add_content()->mutable_image()->set_data(vlm::testing::PatternPng(448, 448, image_seed));
  first_turn->add_content()->set_text("Describe this picture.");
  chat.mutable_params()->set_max_tokens(24);
  chat.mutable_params()->set_ignore_eos(true);
  chat.mutable_params()->mutable_sampling()->set_temperature(0.0f);
  const char* questions[] = {"What colours dominate?", "Is there any text in it?",
                             "Summarize in one line.", "Anything else?"};
  for (int turn = 0; turn < absl::GetFlag(FLAGS_turns); ++turn) {
    StreamResult r = Chat(*stub, chat);
    if (!r.ok) {
      result.error = "turn " + std::to_string(turn + 1) + ": " + r.error;
      break;
    }
    result.turns.ttft_ms.push_back(Seconds(r.start, r.first) * 1000);
    result.turns.cached.push_back(r.cached_prompt_tokens);
    auto* answer = chat.add_messages();
    answer->set_role("assistant");
    answer->add_content()->set_text(r.text);
    auto* next = chat.add_messages();
    next->set_role("user");
    next->add_content()->set_text(questions[turn % 4]);
  }
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s)));
    std::fprintf(stderr, "vlm-bench-serving: --timeout_s reached; stopping\n");
    std::_Exit(3);
  }).detach();

  std::string model_dir = absl::GetFlag(FLAGS_model_dir);
  if (model_dir.empty()) {
    const char* cache = std::getenv("VLM_CACHE_DIR");
    const char* home = std::getenv("HOME");
    model_dir = cache ? std::string(cache) + "/checkpoints/2b"
                      : std::string(home ? home : "/root") + "/.cache/vlm/checkpoints/2b";
  }
  std::string bin = absl::GetFlag(FLAGS_bin_dir);
  if (bin.empty()) {
    char self[4096];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    std::string path(self, n > 0 ? n : 0);
    bin = path.substr(0, path.rfind('/')) + "/..";
  }
  const std::string log_dir = bin + "/bench_serving_logs";
  std::system(("mkdir -p " + log_dir).c_str());

  const int threads = absl::GetFlag(FLAGS_threads);
  const uint64_t weight_bytes = DecodeWeightBytes(model_dir);
  if (weight_bytes == 0) {
    std::fprintf(stderr, "cannot read the checkpoint at %s\n", model_dir.c_str());
    return 2;
  }
  double bandwidth = ReadBandwidth(threads);

  ServiceProcess vision(bin + "/services/vision/vlm-vision",
                        {"--model_dir=" + model_dir, "--grpc_address=127.0.0.1:0",
                         "--metrics_address=127.0.0.1:0",
                         absl::StrCat("--intra_op_threads=", threads)},
                        log_dir + "/vision");
  if (!vision.WaitListening(absl::Minutes(2)) ||
      !WaitServing(vision.grpc_target(), absl::Minutes(5))) {
    std::fprintf(stderr, "vision did not start: %s\n", vision.LogTail(10).c_str());
    return 1;
  }

  std::vector<ConfigResult> results;
  int seed = 1;
  for (absl::string_view config : absl::StrSplit(absl::GetFlag(FLAGS_configs), ';',
                                                 absl::SkipEmpty())) {
    std::pair<std::string, std::string> nf = absl::StrSplit(config, absl::MaxSplits(':', 1));
    results.push_back(RunConfig(bin, model_dir, log_dir, vision.grpc_target(), nf.first,
                                nf.second, seed++));
    bandwidth = std::max(bandwidth, ReadBandwidth(threads));
  }

  const double bound_1 = bandwidth / static_cast<double>(weight_bytes);
  std::printf("\nvlm-bench-serving: %s, through vlm-gateway; %d completion tokens per stream, "
              "greedy, %d rounds interleaved over the concurrencies (medians)\n",
              model_dir.c_str(), absl::GetFlag(FLAGS_max_tokens), absl::GetFlag(FLAGS_rounds));
  std::printf("decode weight bytes per step %.0f MiB; read bandwidth %.1f GB/s (best of the run, "
              "%d threads) => bound %.1f steps/s\n\n",
              weight_bytes / 1048576.0, bandwidth / 1e9, threads, bound_1);
  std::printf("aggregate: every stream's tokens after its first, from the earliest first token "
              "to the latest last one (includes the other streams' prefill); steady: only while "
              "every stream decodes; iteration: the engine's mean decode-only iteration\n\n");
  std::printf("| config | streams | decode tok/s (aggregate) | x 1 stream | steady tok/s | "
              "x 1 stream | decode iteration ms | bound tok/s | TTFT p50 ms | TTFT p95 ms | "
              "failed |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  auto ratio = [](double v, double one) {
    return one > 0 ? absl::StrFormat("%.2f", v / one) : std::string("-");
  };
  for (const ConfigResult& r : results) {
    double one = 0, one_steady = 0;
    for (const ConcurrencyRow& row : r.rows) {
      if (row.streams == 1) one = row.tokens_per_s, one_steady = row.steady_tokens_per_s;
    }
    for (const ConcurrencyRow& row : r.rows) {
      // No steady window: the streams never all decoded at once (one at a time).
      const bool steady = row.steady_tokens_per_s > 0;
      std::printf("| %s | %d | %.1f | %s | %s | %s | %.0f | %.1f | %.0f | %.0f | %d |\n",
                  r.name.c_str(), row.streams, row.tokens_per_s,
                  ratio(row.tokens_per_s, one).c_str(),
                  steady ? absl::StrFormat("%.1f", row.steady_tokens_per_s).c_str() : "-",
                  steady ? ratio(row.steady_tokens_per_s, one_steady).c_str() : "-",
                  row.decode_iteration_ms,
                  bound_1 * row.streams, row.ttft_p50_ms, row.ttft_p95_ms, row.failures);
    }
  }
  // Within a round the concurrencies ran minutes apart at most, so their
  // ratio is the least touched by the host's bandwidth drift.
  std::printf("\nper round: aggregate tok/s of N streams / 1 stream in the same round\n\n"
              "| config | streams | each round | median |\n|---|---|---|---|\n");
  for (const ConfigResult& r : results) {
    const ConcurrencyRow* one = nullptr;
    for (const ConcurrencyRow& row : r.rows) {
      if (row.streams == 1) one = &row;
    }
    if (one == nullptr) continue;
    for (const ConcurrencyRow& row : r.rows) {
      if (row.streams == 1) continue;
      std::vector<double> ratios;
      std::string each;
      for (size_t k = 0; k < row.round_rates.size() && k < one->round_rates.size(); ++k) {
        if (row.round_rates[k] <= 0 || one->round_rates[k] <= 0) continue;
        ratios.push_back(row.round_rates[k] / one->round_rates[k]);
        absl::StrAppend(&each, each.empty() ? "" : ", ", absl::StrFormat("%.2f", ratios.back()));
      }
      std::printf("| %s | %d | %s | %s |\n", r.name.c_str(), row.streams, each.c_str(),
                  ratios.empty() ? "-" : absl::StrFormat("%.2f", Percentile(ratios, 0.5)).c_str());
    }
  }
  std::printf("\n| config | turn | TTFT ms | / turn 1 | cached prompt tokens |\n|---|---|---|---|---|\n");
  for (const ConfigResult& r : results) {
    for (size_t t = 0; t < r.turns.ttft_ms.size(); ++t) {
      std::printf("| %s | %zu | %.0f | %.3f | %d |\n", r.name.c_str(), t + 1, r.turns.ttft_ms[t],
                  r.turns.ttft_ms[t] / r.turns.ttft_ms[0], r.turns.cached[t]);
    }
  }
  for (const ConfigResult& r : results) {
    std::printf("config %s: language flags \"%s\"%s%s\n", r.name.c_str(), r.flags.c_str(),
                r.error.empty() ? "" : "; error: ", r.error.c_str());
  }
  return 0;
}
