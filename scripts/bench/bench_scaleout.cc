// vlm-bench-scaleout: picture conversations over several language replicas
// behind one gateway, prefix-affinity routing against round robin, in one run.
//
// For each routing (--routings, default "affinity,round_robin") a fresh stack
// starts on loopback: vlm-vision, --language_replicas vlm-language replicas
// and vlm-gateway --language_routing=ROUTING. Each replica is warmed up
// directly (its decoder layers load on first use). Then --conversations
// picture conversations of --turns turns run, --concurrency at a time (each
// conversation's turns in order, each turn resending the history), and the
// table gives conversations/s, TTFT per turn (p50 / p95), how often a
// follow-up turn reached the replica that served its previous turn, and the
// share of the follow-up prompts served from the prefix cache.
//
//   vlm-bench-scaleout --model_dir ~/.cache/vlm/checkpoints/2b --language_replicas 2
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/integration/service_process.h"
#include "tests/integration/test_png.h"
#include "vlm/v1/gateway.grpc.pb.h"
#include "vlm/v1/language.grpc.pb.h"

ABSL_FLAG(std::string, model_dir, "",
          "checkpoint directory (default: $VLM_CACHE_DIR or ~/.cache/vlm, /checkpoints/2b)");
ABSL_FLAG(std::string, bin_dir, "", "build directory holding services/ (default: ../ of this binary)");
ABSL_FLAG(int, language_replicas, 2, "vlm-language replicas behind the gateway");
ABSL_FLAG(std::string, routings, "affinity,round_robin", "the gateway's --language_routing values compared");
ABSL_FLAG(int, conversations, 16, "picture conversations per routing");
ABSL_FLAG(int, concurrency, 4, "conversations running at once");
ABSL_FLAG(int, turns, 3, "turns per conversation");
ABSL_FLAG(int, max_tokens, 24, "completion tokens per turn (ignore_eos)");
ABSL_FLAG(int, image_side, 448, "side of each conversation's picture, pixels");
ABSL_FLAG(int, threads, 1, "intra-op threads of each service");
ABSL_FLAG(std::string, language_flags, "", "extra vlm-language flags, comma-separated");
ABSL_FLAG(int, timeout_s, 3600, "the whole run ends (exit 3) after this");

namespace {

using Clock = std::chrono::steady_clock;
using vlm::testing::ServiceProcess;

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  return v[i];
}

struct TurnResult {
  bool ok = false;
  std::string error;
  double ttft_ms = 0;
  int prompt_tokens = 0;
  int cached_tokens = 0;
  std::string replica;
  std::string text;
};

TurnResult StreamTurn(vlm::v1::VisionLanguage::Stub& stub, const vlm::v1::ChatRequest& request) {
  TurnResult r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  const Clock::time_point start = Clock::now();
  auto reader = stub.ChatStream(&ctx, request);
  vlm::v1::ChatChunk chunk;
  bool first = true;
  while (reader->Read(&chunk)) {
    if (first && (!chunk.text().empty() || chunk.has_usage())) {
      r.ttft_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
      first = false;
    }
    r.text += chunk.text();
    if (chunk.has_usage()) {
      r.prompt_tokens = chunk.usage().prompt_tokens();
      r.cached_tokens = chunk.usage().cached_prompt_tokens();
      r.replica = chunk.language().replica();
    }
  }
  const grpc::Status s = reader->Finish();
  r.ok = s.ok();
  if (!s.ok()) r.error = s.error_message();
  return r;
}

struct RoutingResult {
  std::string routing;
  std::string error;
  double seconds = 0;
  int conversations_done = 0;
  std::vector<std::vector<double>> ttft;  // per turn
  int followups = 0, same_replica = 0;
  int64_t followup_prompt = 0, followup_cached = 0;
};

// Every replica's decoder layers are materialized by one short generation.
void WarmUp(const std::string& target) {
  auto stub = vlm::v1::Language::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  vlm::v1::GenerateRequest request;
  auto* m = request.add_messages();
  m->set_role("user");
  m->add_content()->set_text("Warm up.");
  request.mutable_params()->set_max_tokens(4);
  request.set_add_generation_prompt(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
  auto reader = stub->Generate(&ctx, request);
  vlm::v1::GenerateResponse r;
  while (reader->Read(&r)) {
  }
  reader->Finish().IgnoreError();
}

RoutingResult RunRouting(const std::string& bin, const std::string& model_dir,
                         const std::string& log_dir, const std::string& routing, int seed_base) {
  RoutingResult result;
  result.routing = routing;
  const int turns = absl::GetFlag(FLAGS_turns);
  result.ttft.resize(turns);
  const std::string threads = absl::StrCat("--intra_op_threads=", absl::GetFlag(FLAGS_threads));
  ServiceProcess vision(bin + "/services/vision/vlm-vision",
                        {"--model_dir=" + model_dir, "--grpc_address=127.0.0.1:0",
                         "--metrics_address=127.0.0.1:0", threads},
                        log_dir + "/vision-" + routing);
  std::vector<std::unique_ptr<ServiceProcess>> languages;
  std::vector<std::string> targets;
  for (int i = 0; i < absl::GetFlag(FLAGS_language_replicas); ++i) {
    std::vector<std::string> flags = {"--model_dir=" + model_dir, "--grpc_address=127.0.0.1:0",
                                      "--metrics_address=127.0.0.1:0", threads, "--max_queue=64"};
    for (absl::string_view f :
         absl::StrSplit(absl::GetFlag(FLAGS_language_flags), ',', absl::SkipEmpty())) {
      flags.emplace_back(f);
    }
    languages.push_back(std::make_unique<ServiceProcess>(
        bin + "/services/language/vlm-language", flags,
        absl::StrCat(log_dir, "/language-", routing, "-", i)));
  }
  if (!vision.WaitListening(absl::Minutes(2))) {
    result.error = "vision did not start: " + vision.LogTail(5);
    return result;
  }
  for (auto& l : languages) {
    if (!l->WaitListening(absl::Minutes(2)) || !l->WaitServing("", absl::Minutes(5))) {
      result.error = "a language replica did not start: " + l->LogTail(5);
      return result;
    }
    targets.push_back(l->grpc_target());
  }
  ServiceProcess gateway(bin + "/services/gateway/vlm-gateway",
                         {"--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                          "--http_address=", "--language_targets=" + absl::StrJoin(targets, ","),
                          "--language_routing=" + routing, "--vision_targets=" + vision.grpc_target(),
                          "--max_inflight=64", "--max_queue=256"},
                         log_dir + "/gateway-" + routing);
  if (!gateway.WaitListening(absl::Minutes(1)) || !gateway.WaitServing("", absl::Minutes(5))) {
    result.error = "gateway not serving: " + gateway.LogTail(5);
    return result;
  }
  for (const std::string& t : targets) WarmUp(t);
  auto stub = vlm::v1::VisionLanguage::NewStub(
      grpc::CreateChannel(gateway.grpc_target(), grpc::InsecureChannelCredentials()));

  const int conversations = absl::GetFlag(FLAGS_conversations);
  const int side = absl::GetFlag(FLAGS_image_side);
  const char* questions[] = {"What colours dominate?", "Is there any text in it?",
                             "Summarize in one line.", "Anything else?"};
  std::atomic<int> next{0};
  absl::Mutex mu;
  auto worker = [&] {
    for (int c = next.fetch_add(1); c < conversations; c = next.fetch_add(1)) {
      vlm::v1::ChatRequest chat;
      auto* system = chat.add_messages();
      system->set_role("system");
      system->add_content()->set_text("You describe pictures carefully.");
      auto* user = chat.add_messages();
      user->set_role("user");
      user->add_content()->mutable_image()->set_data(
          vlm::testing::PatternPng(side, side, seed_base + c));
      user->add_content()->set_text(absl::StrCat("Describe picture ", c, "."));
      chat.mutable_params()->set_max_tokens(absl::GetFlag(FLAGS_max_tokens));
      chat.mutable_params()->set_ignore_eos(true);
      chat.mutable_params()->mutable_sampling()->set_temperature(0.0f);
      TurnResult previous;
      bool ok = true;
      for (int turn = 0; turn < turns && ok; ++turn) {
        TurnResult r = StreamTurn(*stub, chat);
        absl::MutexLock lock(&mu);
        if (!r.ok) {
          if (result.error.empty()) result.error = absl::StrCat("turn ", turn + 1, ": ", r.error);
          ok = false;
          break;
        }
        result.ttft[turn].push_back(r.ttft_ms);
        if (turn > 0) {
          ++result.followups;
          result.same_replica += r.replica == previous.replica;
          result.followup_prompt += previous.prompt_tokens;
          result.followup_cached += r.cached_tokens;
        }
        auto* answer = chat.add_messages();
        answer->set_role("assistant");
        answer->add_content()->set_text(r.text);
        auto* question = chat.add_messages();
        question->set_role("user");
        question->add_content()->set_text(questions[turn % 4]);
        previous = std::move(r);
      }
      if (ok) {
        absl::MutexLock lock(&mu);
        ++result.conversations_done;
      }
    }
  };
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> workers;
  for (int i = 0; i < absl::GetFlag(FLAGS_concurrency); ++i) workers.emplace_back(worker);
  for (auto& t : workers) t.join();
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::fprintf(stderr, "[%s] %d conversations in %.1f s\n", routing.c_str(),
               result.conversations_done, result.seconds);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(absl::GetFlag(FLAGS_timeout_s)));
    std::fprintf(stderr, "vlm-bench-scaleout: --timeout_s reached; stopping\n");
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
  const std::string log_dir = bin + "/bench_scaleout_logs";
  std::system(("mkdir -p " + log_dir).c_str());

  std::vector<RoutingResult> results;
  int seed = 1;
  for (absl::string_view routing :
       absl::StrSplit(absl::GetFlag(FLAGS_routings), ',', absl::SkipEmpty())) {
    // Distinct pictures per routing: no run profits from another's caches.
    results.push_back(RunRouting(bin, model_dir, log_dir, std::string(routing), seed));
    seed += 1000;
  }

  const int turns = absl::GetFlag(FLAGS_turns);
  std::printf("\nvlm-bench-scaleout: %s; %d language replicas, 1 vision replica, %d threads each; "
              "%d picture conversations (%dx%d) of %d turns, %d at a time, %d completion tokens "
              "per turn\n\n",
              model_dir.c_str(), absl::GetFlag(FLAGS_language_replicas), absl::GetFlag(FLAGS_threads),
              absl::GetFlag(FLAGS_conversations), absl::GetFlag(FLAGS_image_side),
              absl::GetFlag(FLAGS_image_side), turns, absl::GetFlag(FLAGS_concurrency),
              absl::GetFlag(FLAGS_max_tokens));
  std::string header = "| routing | conversations/s |";
  std::string rule = "|---|---|";
  for (int t = 1; t <= turns; ++t) {
    absl::StrAppend(&header, " turn ", t, " TTFT p50 / p95 ms |");
    absl::StrAppend(&rule, "---|");
  }
  absl::StrAppend(&header, " follow-ups on the previous replica | cached / previous prompt |");
  absl::StrAppend(&rule, "---|---|");
  std::printf("%s\n%s\n", header.c_str(), rule.c_str());
  for (const RoutingResult& r : results) {
    std::string row = absl::StrFormat("| %s | %.3f |", r.routing,
                                      r.seconds > 0 ? r.conversations_done / r.seconds : 0.0);
    for (int t = 0; t < turns; ++t) {
      absl::StrAppend(&row, absl::StrFormat(" %.0f / %.0f |", Percentile(r.ttft[t], 0.5),
                                            Percentile(r.ttft[t], 0.95)));
    }
    absl::StrAppend(&row, absl::StrFormat(
                              " %d / %d | %.2f |", r.same_replica, r.followups,
                              r.followup_prompt > 0 ? static_cast<double>(r.followup_cached) /
                                                          r.followup_prompt
                                                    : 0.0));
    std::printf("%s\n", row.c_str());
  }
  if (results.size() >= 2 && !results[0].ttft.empty() && turns >= 2) {
    const double a = Percentile(results[0].ttft[1], 0.5), b = Percentile(results[1].ttft[1], 0.5);
    std::printf("\nturn-2 TTFT p50, %s / %s: %.3f\n", results[0].routing.c_str(),
                results[1].routing.c_str(), b > 0 ? a / b : 0.0);
  }
  for (const RoutingResult& r : results) {
    if (!r.error.empty()) std::printf("%s: error: %s\n", r.routing.c_str(), r.error.c_str());
  }
  return 0;
}
