// vlm-bench-language: the language service as a client sees it (issue 5,
// "Benchmark"). Starts the real vlm-language on loopback, once per
// configuration, and prints a table of medians:
//
//   process start -> health SERVING, RSS at SERVING (next to the weight bytes
//   of the configuration's form, and the difference) and after the first request,
//   time to first token for 1 image (448x448: pre-projector features, random
//   bf16 [784, 1024] x (1 + deepstack), grid (1, 28, 28)) + a 20-word prompt,
//   prefill tokens/s at 512 prompt tokens, decode tokens/s, and decode time per
//   token against the memory-bandwidth bound: weight bytes one decode step
//   reads (decoder layers + final norm + LM head, from the checkpoint headers)
//   divided by a read bandwidth measured by this process in the same run.
//
//   vlm-bench-language [--model_dir DIR]
//       [--configs ",--resident_layers=8"] [--threads 2] [--runs 3]
//
// Old path vs new in one run (the decoder's kernels, issue 11):
//   vlm-bench-language --configs "--matmul=torch;--matmul=kernels;--weight_dtype=int8"
// bf16, int8 and int4 decode in one table (issue 21's acceptance):
//   vlm-bench-language --configs ";--weight_dtype=int8;--weight_dtype=int4"
// Decode also runs in paired rounds (--paired_decode_rounds, default 5):
// every configuration's server stays up, and each round decodes once on each,
// back to back, so the ratio to the first bf16 configuration is taken seconds
// apart rather than minutes (the host's bandwidth drifts in between); the
// servers' memory adds up while they are all up (about 6 GiB for bf16, 4.3
// for int8, on the 2B).
// Each configuration's bound uses the bytes its decode step reads (for
// --weight_dtype=int8: int8 rows, row scales and group ratios of the
// projections and the LM head; --weight_dtype=int4: nibbles, row scales, group
// ratios and zero points of the projections, int8 for the leading
// --int4_int8_layers layers, the LM head in int4). --cliff "200:260:4" adds prefill time
// per token for every 4th prompt length in 200..260 and the largest ratio
// between neighbouring lengths (a length cliff shows up as a ratio >> 1).
// The prefix cache is off in every configuration (repeated prompts must
// prefill in full).
//
// Structured output (issue 24): --structured prints instead, from one server
// with --max_sequences=8, the schema's compile time (grammar + the first
// token masks, in this process over the checkpoint's tokenizer), the token
// mask's cost per decode step (fill + apply, over a walk of the schema), and
// decode tokens/s with the schema against without, for 1 and 8 concurrent
// streams (with / without: acceptance >= 0.9x):
//   vlm-bench-language --structured [--model_dir DIR] [--decode_tokens 64]
//
// Start-up and memory with the packed-weight file (issue 21), old path beside:
//   vlm-bench-language --startup [--startup_configs "bf16:;int8:--weight_dtype=int8;int4:--weight_dtype=int4"]
// prints, per configuration, with --packed_cache_dir= (old: convert in memory)
// and with a fresh packed-weight directory (new): the first start (the new one
// builds the file), then a start with the file present (page cache warm):
// process start -> SERVING, process start -> first token of the first request
// (a 20-word prompt sent at SERVING), RSS after that request next to the
// weight bytes of the form, and a second replica started beside the first
// (RSS, PSS, private bytes: with the file mapped, the replicas share its
// pages and the second adds only its private memory). The directory (one
// file per form, GBs on the 2B) is removed at the end.
//
// --model_dir defaults to the 2B-shaped checkpoint scripts/make_checkpoint.sh 2b
// writes: $VLM_CACHE_DIR/checkpoints/2b, else ~/.cache/vlm/checkpoints/2b.
// Each entry of --configs (separated by ';') is extra vlm-language flags
// (comma-separated); the empty entry is the default configuration. The
// servers write their packed-weight files (GBs on the 2B) to a temporary
// directory removed at exit, unless --packed_cache_dir names one to keep (the
// first start of each form then builds its file, later starts map it).
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "services/language/grammar/grammar_cache.h"
#include "services/language/grammar/tokenizer_vocabulary.h"
#include "services/language/sampling/sampler.h"
#include "services/language/text/tokenizer.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/kernels/quantize.h"
#include "common/kernels/quantize_int4.h"
#include "common/kernels/gemv_int4.h"
#include "common/kernels/gemv_int8.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "services/language/model/decoder.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "common/kernels/gemv.h"
#include "vlm/v1/language.grpc.pb.h"
#include "scripts/bench/read_bandwidth.h"
#include "scripts/bench/bench_util.h"

ABSL_FLAG(std::string, model_dir, "",
          "checkpoint directory (default: $VLM_CACHE_DIR/checkpoints/2b, else "
          "~/.cache/vlm/checkpoints/2b, where scripts/make_checkpoint.sh 2b puts it)");
ABSL_FLAG(std::string, server, "", "vlm-language binary (default: beside this one)");
ABSL_FLAG(std::string, configs, ";--resident_layers=8",
          "';'-separated configurations, each a ','-separated list of extra server flags");
ABSL_FLAG(int, threads, 2, "server intra-op threads (and bandwidth-measurement threads)");
ABSL_FLAG(int, runs, 3, "repetitions of each measurement (the median is printed)");
ABSL_FLAG(int, starts, 3, "process starts per configuration for start->SERVING and RSS");
ABSL_FLAG(int, prefill_tokens, 512, "prompt length of the prefill measurement");
ABSL_FLAG(int, decode_tokens, 64, "generated tokens of the decode measurement");
ABSL_FLAG(int64_t, bandwidth_mib, 1024, "buffer of the read-bandwidth measurement");
ABSL_FLAG(int, paired_decode_rounds, 5,
          "rounds of decode alternating between every configuration's server, all kept up "
          "(0: off, and each server stops after its own measurements)");
ABSL_FLAG(bool, structured, false,
          "measure structured output instead: schema compile time, mask cost, decode tokens/s "
          "with a JSON schema vs without at 1 and 8 streams");
ABSL_FLAG(bool, startup, false,
          "print the start-up / memory table (packed-weight file vs converting in memory) "
          "instead of the serving table");
ABSL_FLAG(std::string, startup_configs, "bf16:;int8:--weight_dtype=int8;int4:--weight_dtype=int4",
          "';'-separated NAME:FLAGS for --startup (FLAGS ','-separated vlm-language flags)");
ABSL_FLAG(std::string, packed_cache_dir, "",
          "the servers' --packed_cache_dir for the serving and --structured tables (default: a "
          "temporary directory under TMPDIR or /tmp, removed at exit, so a run leaves no "
          "packed-weight files behind; a configuration's own --packed_cache_dir wins). "
          "--startup always uses its own temporary directory");
ABSL_FLAG(std::string, startup_dir, "",
          "parent of the temporary packed-weight directory for --startup (default: TMPDIR or /tmp)");
ABSL_FLAG(std::string, cliff, "",
          "first:last:step prompt lengths for the prefill time-per-token scan (empty: off)");

extern char** environ;

namespace {

using vlm::v1::GenerateRequest;
using vlm::v1::GenerateResponse;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

using vlm::bench::Median;

// VmRSS of `pid` in MiB.
double RssMib(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return -1;
}

// Field `key` ("Pss:", "Private_Clean:", ...) of /proc/PID/smaps_rollup in MiB.
double SmapsMib(pid_t pid, const std::string& key) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/smaps_rollup"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(key.size())) / 1024.0;
  }
  return -1;
}

class Server {
 public:
  Server(const std::string& binary, std::vector<std::string> flags) {
    std::vector<std::string> args = {binary};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) return;
    const int devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
    started_ = Clock::now();
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      dup2(out[1], STDOUT_FILENO);
      dup2(devnull, STDERR_FILENO);
      execve(argv[0], argv.data(), environ);
      _exit(127);
    }
    close(out[1]);
    close(devnull);
    fd_ = out[0];
  }
  ~Server() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      int status;
      for (int i = 0; i < 100 && waitpid(pid_, &status, WNOHANG) == 0; ++i) {
        absl::SleepFor(absl::Milliseconds(50));
      }
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (fd_ >= 0) close(fd_);
  }

  // Waits for the listening line, then for health SERVING; returns the
  // seconds from fork to SERVING (negative on failure).
  double WaitServing(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    std::string buffer;
    static const std::regex kLine(R"(vlm: listening grpc=(\S+) )");
    std::smatch m;
    while (!std::regex_search(buffer, m, kLine)) {
      if (absl::Now() > deadline) return -1;
      pollfd pfd{fd_, POLLIN, 0};
      if (poll(&pfd, 1, 5) <= 0) continue;
      char chunk[512];
      const ssize_t n = read(fd_, chunk, sizeof(chunk));
      if (n <= 0) return -1;
      buffer.append(chunk, static_cast<size_t>(n));
    }
    target_ = m[1];
    channel_ = grpc::CreateChannel(target_, grpc::InsecureChannelCredentials());
    auto health = grpc::health::v1::Health::NewStub(channel_);
    while (absl::Now() < deadline) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      grpc::health::v1::HealthCheckRequest request;
      request.set_service("vlm.v1.Language");
      grpc::health::v1::HealthCheckResponse response;
      if (health->Check(&ctx, request, &response).ok() &&
          response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
        return Seconds(started_, Clock::now());
      }
      absl::SleepFor(absl::Milliseconds(2));
    }
    return -1;
  }

  pid_t pid() const { return pid_; }
  Clock::time_point started() const { return started_; }
  std::unique_ptr<vlm::v1::Language::Stub> Stub() { return vlm::v1::Language::NewStub(channel_); }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  Clock::time_point started_;
  std::string target_;
  std::shared_ptr<grpc::Channel> channel_;
};

struct Outcome {
  bool ok = false;
  std::string error;
  double client_first_s = 0;  // send -> first streamed message
  GenerateResponse last;
  int tokens = 0;
};

Outcome Run(vlm::v1::Language::Stub& stub, const GenerateRequest& request) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  Outcome out;
  const Clock::time_point sent = Clock::now();
  auto reader = stub.Generate(&ctx, request);
  GenerateResponse response;
  bool first = true;
  while (reader->Read(&response)) {
    if (first) out.client_first_s = Seconds(sent, Clock::now());
    first = false;
    out.tokens += response.token_ids_size();
    out.last = response;
  }
  grpc::Status status = reader->Finish();
  out.ok = status.ok();
  out.error = status.error_message();
  return out;
}

GenerateRequest Request(const std::string& text, int max_tokens) {
  GenerateRequest r;
  r.set_add_generation_prompt(true);
  auto* m = r.add_messages();
  m->set_role("user");
  m->add_content()->set_text(text);
  r.mutable_params()->set_max_tokens(max_tokens);
  r.mutable_params()->set_ignore_eos(true);
  r.mutable_params()->mutable_sampling()->set_temperature(0.0f);
  return r;
}

void RandomBf16(vlm::v1::Tensor* t, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  t->set_dtype(vlm::v1::DTYPE_BF16);
  t->add_shape(rows);
  t->add_shape(cols);
  std::string data(static_cast<size_t>(rows * cols) * 2, '\0');
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float v = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    bits += 0x7FFF + ((bits >> 16) & 1);
    const uint16_t b = static_cast<uint16_t>(bits >> 16);
    std::memcpy(&data[static_cast<size_t>(i) * 2], &b, 2);
  }
  t->set_data(std::move(data));
}

// 1 image of 448x448 (grid 1x28x28) + a 20-word question.
GenerateRequest ImageRequest(const vlm::ModelConfig& config, uint32_t seed) {
  GenerateRequest r = Request(
      "Describe this picture in detail: the colors, the shapes, the people, the objects, the "
      "text and the mood.",
      1);
  auto* image = r.mutable_messages(0)->add_content()->mutable_image();
  image->mutable_grid()->set_t(1);
  image->mutable_grid()->set_h(28);
  image->mutable_grid()->set_w(28);
  const int64_t hidden = config.vision.hidden_size;
  RandomBf16(image->mutable_last_hidden(), 784, hidden, seed);
  for (size_t k = 0; k < config.vision.deepstack_visual_indexes.size(); ++k) {
    RandomBf16(image->add_deepstack(), 784, hidden, seed + 1 + static_cast<uint32_t>(k));
  }
  return r;
}

// A text prompt of exactly `tokens` tokens (via CountTokens).
GenerateRequest PromptOfTokens(vlm::v1::Language::Stub& stub, int tokens, int max_tokens) {
  auto count = [&](int words) {
    std::string text = "Summarize:";
    for (int i = 0; i < words; ++i) text += " word";
    GenerateRequest r = Request(text, max_tokens);
    grpc::ClientContext ctx;
    vlm::v1::CountTokensResponse response;
    stub.CountTokens(&ctx, r, &response);
    return std::make_pair(r, response.usage().prompt_tokens());
  };
  const int base = count(0).second;
  auto [request, n] = count(std::max(0, tokens - base));
  if (n != tokens) std::fprintf(stderr, "note: prefill prompt has %d tokens\n", n);
  return request;
}

// /proc/cpuinfo's model name, "?" when unknown.
std::string CpuModelName() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      return line.substr(line.find(':') + 2);
    }
  }
  return "?";
}

// The projections' storage a configuration's flags select.
enum class LayerForm { kBf16, kInt8, kInt4 };
LayerForm FormOf(absl::string_view extra) {
  if (absl::StrContains(extra, "--weight_dtype=int8")) return LayerForm::kInt8;
  if (absl::StrContains(extra, "--weight_dtype=int4")) return LayerForm::kInt4;
  return LayerForm::kBf16;
}

// --int4_int8_layers in a configuration's flags (absent: the service's auto).
int Int4Int8LayersOf(absl::string_view extra) {
  constexpr absl::string_view kFlag = "--int4_int8_layers=";
  const size_t at = extra.find(kFlag);
  int n = vlm::language::kAutoInt4Int8Layers;
  if (at != absl::string_view::npos) {
    absl::string_view v = extra.substr(at + kFlag.size());
    v = v.substr(0, v.find_first_of(", "));
    if (!absl::SimpleAtoi(v, &n)) n = vlm::language::kAutoInt4Int8Layers;
  }
  return n;
}

// Weight bytes one decode step reads: the projections in `form` (int8: rows,
// row scales and group ratios; int4: nibbles, row scales, group ratios and
// zero points, with the first int8_layers layers in int8, -1: the service's
// one in seven), the LM head in the form's own precision (the service's: int8
// for int8 layers, int4 for int4), everything else as stored.
uint64_t DecodeWeightBytes(const std::string& dir, LayerForm form = LayerForm::kBf16,
                           int int8_layers = vlm::language::kAutoInt4Int8Layers) {
  auto checkpoint = vlm::SafetensorsCheckpoint::Open(dir);
  if (!checkpoint.ok()) return 0;
  {
    auto config = vlm::LoadModelConfig(dir);
    int8_layers =
        config.ok() ? vlm::language::Int4Int8Layers(int8_layers, config->text.num_hidden_layers) : 0;
  }
  // "...layers.<n>.": the decoder layer of a tensor name.
  auto layer_of = [](const std::string& name) {
    const size_t at = name.find("layers.");
    return at == std::string::npos ? -1 : std::atoi(name.c_str() + at + 7);
  };
  auto int4_bytes = [](const std::vector<int64_t>& shape) {
    const uint64_t n = static_cast<uint64_t>(shape[0]);
    const uint64_t groups = static_cast<uint64_t>(
        (shape[1] + vlm::kernels::kInt4Group - 1) / vlm::kernels::kInt4Group);
    return n * groups * (vlm::kernels::kInt4Group / 2 + sizeof(uint16_t) + 1) + n * sizeof(float);
  };
  auto int8_bytes = [](const std::vector<int64_t>& shape) {
    const uint64_t n = static_cast<uint64_t>(shape[0]);
    const uint64_t groups = static_cast<uint64_t>(
        (shape[1] + vlm::kernels::kInt8Group - 1) / vlm::kernels::kInt8Group);
    return n * groups * vlm::kernels::kInt8Group + n * sizeof(float) + n * groups * sizeof(uint16_t);
  };
  uint64_t bytes = 0, embed = 0, head = 0;
  for (const std::string& name : (*checkpoint)->Names()) {
    auto info = (*checkpoint)->Info(name);
    if (!info.ok()) continue;
    const std::vector<int64_t>& shape = (*info)->shape;
    const uint64_t as_stored = shape.size() != 2         ? (*info)->nbytes()
                               : form == LayerForm::kInt8 ? int8_bytes(shape)
                               : form == LayerForm::kInt4 ? int4_bytes(shape)
                                                          : (*info)->nbytes();
    if (name == "lm_head.weight") {
      head = as_stored;
    } else if (absl::StrContains(name, "embed_tokens")) {
      embed = as_stored;
    } else if (absl::StrContains(name, "language_model.") || name.rfind("model.layers.", 0) == 0 ||
               name == "model.norm.weight") {
      const bool projection = absl::StrContains(name, "_proj.weight") && shape.size() == 2;
      if (projection && form == LayerForm::kInt8) {
        bytes += int8_bytes(shape);
      } else if (projection && form == LayerForm::kInt4) {
        bytes += layer_of(name) < int8_layers ? int8_bytes(shape) : int4_bytes(shape);
      } else {
        bytes += (*info)->nbytes();
      }
    }
  }
  return bytes + (head > 0 ? head : embed);
}

// Read bandwidth with `threads` threads over a fresh buffer: best of 3 passes.
double ReadBandwidth(int threads) {
  return vlm::BestReadBandwidth(static_cast<size_t>(absl::GetFlag(FLAGS_bandwidth_mib)) << 20,
                                threads);
}

struct Column {
  std::string name;
  uint64_t bytes = 0;    // weight bytes one decode step reads
  double decode_ms = 0;  // per token
  std::vector<double> paired_ms_each;  // ms per token in each paired round that succeeded
  std::vector<double> paired_ratios;   // per round: reference ms / this ms
  std::vector<std::pair<std::string, std::string>> rows;
  void Add(const std::string& what, const std::string& value) { rows.emplace_back(what, value); }
};

// The servers' packed-weight directory (--packed_cache_dir, else a temporary
// one that main removes at exit).
std::string g_packed_dir;

// Runs one configuration; `bandwidth` is raised to the best read bandwidth
// measured while its server is up (after the decode runs). With `keep`, the
// server is handed over there (for the paired decode rounds).
Column Measure(const std::string& binary, const std::string& dir, const std::string& extra,
               const vlm::ModelConfig& config, double* bandwidth,
               std::unique_ptr<Server>* keep = nullptr) {
  Column col;
  col.name = extra.empty() ? "default (lazy)" : extra;
  std::vector<std::string> flags = {
      "--model_dir=" + dir,
      "--grpc_address=127.0.0.1:0",
      "--metrics_address=",
      absl::StrCat("--intra_op_threads=", absl::GetFlag(FLAGS_threads)),
      "--max_context=4096",
      "--log_level=warning",
      "--prefix_cache=false",
      "--packed_cache_dir=" + g_packed_dir};
  for (absl::string_view f : absl::StrSplit(extra, ',', absl::SkipEmpty())) {
    flags.emplace_back(f);
  }
  const int runs = std::max(1, absl::GetFlag(FLAGS_runs));

  std::vector<double> start_s, rss_serving;
  std::unique_ptr<Server> server;
  for (int i = 0; i < std::max(1, absl::GetFlag(FLAGS_starts)); ++i) {
    server = std::make_unique<Server>(binary, flags);
    const double s = server->WaitServing(absl::Minutes(5));
    if (s < 0) {
      col.Add("error", "server did not become SERVING");
      return col;
    }
    start_s.push_back(s);
    rss_serving.push_back(RssMib(server->pid()));
  }
  col.Add("start -> SERVING (s)", absl::StrFormat("%.3f", Median(start_s)));
  col.Add("RSS at SERVING (MiB)", absl::StrFormat("%.0f", Median(rss_serving)));
  {
    // The KV pool is address space until blocks are used, so at SERVING the
    // process should hold little beyond its weights (the budget: + 400 MiB).
    const LayerForm form = FormOf(extra);
    const double weights = DecodeWeightBytes(dir, form, Int4Int8LayersOf(extra)) / 1048576.0;
    col.Add("weight bytes in this form (MiB)", absl::StrFormat("%.0f", weights));
    col.Add("RSS at SERVING - weight bytes (MiB)",
            absl::StrFormat("%.0f", Median(rss_serving) - weights));
  }

  auto stub = server->Stub();
  std::vector<double> ttft_client, ttft_server, projector;
  for (int i = 0; i <= runs; ++i) {
    Outcome o = Run(*stub, ImageRequest(config, 100 + i));
    if (!o.ok) {
      col.Add("error", "image request: " + o.error);
      return col;
    }
    if (i == 0) {
      col.Add("RSS after 1st request (MiB)", absl::StrFormat("%.0f", RssMib(server->pid())));
      col.Add("TTFT 1st request, cold layers (ms)",
              absl::StrFormat("%.0f", o.client_first_s * 1000));
      continue;
    }
    ttft_client.push_back(o.client_first_s * 1000);
    ttft_server.push_back(o.last.timings().first_token_ms());
    projector.push_back(o.last.timings().projector_ms());
  }
  col.Add("TTFT 1 image 448x448 + 20 words, client (ms)",
          absl::StrFormat("%.0f", Median(ttft_client)));
  col.Add("  of which projector (ms)", absl::StrFormat("%.0f", Median(projector)));
  col.Add("  server first_token_ms", absl::StrFormat("%.0f", Median(ttft_server)));

  const int prefill_tokens = absl::GetFlag(FLAGS_prefill_tokens);
  GenerateRequest prefill = PromptOfTokens(*stub, prefill_tokens, 1);
  std::vector<double> prefill_tps;
  for (int i = 0; i < runs; ++i) {
    Outcome o = Run(*stub, prefill);
    if (!o.ok) break;
    prefill_tps.push_back(o.last.usage().prompt_tokens() / (o.last.timings().prefill_ms() / 1000));
  }
  col.Add(absl::StrCat("prefill tokens/s at ", prefill_tokens),
          absl::StrFormat("%.0f", Median(prefill_tps)));

  const int decode_tokens = std::max(2, absl::GetFlag(FLAGS_decode_tokens));
  std::vector<double> ms_per_token;
  for (int i = 0; i < runs; ++i) {
    Outcome o = Run(*stub, Request("Write a long story about a lighthouse.", decode_tokens));
    if (!o.ok || o.tokens < 2) break;
    ms_per_token.push_back(o.last.timings().decode_ms() / (o.tokens - 1));
  }
  col.decode_ms = Median(ms_per_token);
  col.Add("decode tokens/s", absl::StrFormat("%.2f", col.decode_ms > 0 ? 1000 / col.decode_ms : 0));
  col.Add("decode ms/token", absl::StrFormat("%.1f", col.decode_ms));
  col.Add("RSS after the runs (MiB)", absl::StrFormat("%.0f", RssMib(server->pid())));

  // Prefill time per token over a range of prompt lengths (length cliffs).
  std::vector<int> lengths;
  {
    std::vector<std::string> parts = absl::StrSplit(absl::GetFlag(FLAGS_cliff), ':');
    int first = 0, last = 0, step = 1;
    if (parts.size() == 3 && absl::SimpleAtoi(parts[0], &first) &&
        absl::SimpleAtoi(parts[1], &last) && absl::SimpleAtoi(parts[2], &step) && step > 0) {
      for (int n = first; n <= last; n += step) lengths.push_back(n);
    }
  }
  if (!lengths.empty()) {
    std::vector<double> per_token;  // ms, median of `runs` at each length
    std::string series;
    for (int n : lengths) {
      GenerateRequest r = PromptOfTokens(*stub, n, 1);
      std::vector<double> ms;
      for (int i = 0; i < runs; ++i) {
        Outcome o = Run(*stub, r);
        if (!o.ok) break;
        ms.push_back(o.last.timings().prefill_ms() / o.last.usage().prompt_tokens());
      }
      per_token.push_back(Median(ms));
      absl::StrAppend(&series, series.empty() ? "" : " ", absl::StrFormat("%.3f", per_token.back()));
    }
    double worst = 1;
    int at = lengths[0];
    for (size_t i = 1; i < per_token.size(); ++i) {
      const double a = per_token[i - 1], b = per_token[i];
      if (a <= 0 || b <= 0) continue;
      const double ratio = std::max(a / b, b / a);
      if (ratio > worst) {
        worst = ratio;
        at = lengths[i];
      }
    }
    col.Add(absl::StrCat("prefill ms/token at ", absl::GetFlag(FLAGS_cliff)), series);
    col.Add("  max neighbour ratio (at length)", absl::StrFormat("%.2f (%d)", worst, at));
  }
  *bandwidth = std::max(*bandwidth, ReadBandwidth(absl::GetFlag(FLAGS_threads)));
  if (keep != nullptr) *keep = std::move(server);
  return col;
}

GenerateRequest DecodeRequest() {
  return Request("Write a long story about a lighthouse.",
                 std::max(2, absl::GetFlag(FLAGS_decode_tokens)));
}

// Paired decode: the host's read bandwidth moves by tens of percent within
// minutes, so decode rates measured a configuration at a time (minutes
// apart) compare badly. Each round runs one decode request on every
// configuration's server back to back (seconds apart) and measures the
// bandwidth; the ratio to the first bf16 configuration is taken within each
// round, and the rows print medians over the rounds.
void PairedDecode(const std::vector<std::unique_ptr<Server>>& servers,
                  std::vector<Column>* columns, const Column* reference, double* bandwidth) {
  const int rounds = absl::GetFlag(FLAGS_paired_decode_rounds);
  std::vector<std::vector<double>> ms(servers.size());
  std::vector<std::unique_ptr<vlm::v1::Language::Stub>> stubs;
  for (const auto& s : servers) stubs.push_back(s != nullptr ? s->Stub() : nullptr);
  for (int r = 0; r < rounds; ++r) {
    for (size_t c = 0; c < servers.size(); ++c) {
      if (stubs[c] == nullptr) {
        ms[c].push_back(0);
        continue;
      }
      Outcome o = Run(*stubs[c], DecodeRequest());
      ms[c].push_back(o.ok && o.tokens >= 2 ? o.last.timings().decode_ms() / (o.tokens - 1) : 0);
    }
    *bandwidth = std::max(*bandwidth, ReadBandwidth(absl::GetFlag(FLAGS_threads)));
  }
  // 0 marks a failed request (and every round of a server that is not up).
  const std::vector<double>* ref =
      reference != nullptr ? &ms[reference - columns->data()] : nullptr;
  for (size_t c = 0; c < servers.size(); ++c) {
    Column& col = (*columns)[c];
    for (size_t r = 0; r < ms[c].size(); ++r) {
      if (ms[c][r] <= 0) continue;
      col.paired_ms_each.push_back(ms[c][r]);
      if (ref != nullptr && (*ref)[r] > 0) col.paired_ratios.push_back((*ref)[r] / ms[c][r]);
    }
  }
}

// The schema of the structured-output measurement: an invoice with a free
// text field, so the model writes for a while inside the constraint.
constexpr char kBenchSchema[] = R"({"type": "object", "properties": {
  "vendor": {"type": "string", "maxLength": 40},
  "date": {"type": "string", "format": "date"},
  "total": {"type": "number", "minimum": 0},
  "currency": {"enum": ["EUR", "USD", "GBP", "CHF"]},
  "items": {"type": "array", "maxItems": 8, "items": {"type": "object", "properties": {
    "description": {"type": "string", "maxLength": 60},
    "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
    "price": {"type": "number", "minimum": 0}}, "required": ["description", "quantity", "price"]}},
  "notes": {"type": "string"}},
  "required": ["vendor", "date", "total", "currency", "items", "notes"]})";

// Completion tokens per stream: --decode_tokens, at least what the schema's
// shortest output needs (82 bytes + the stop token) and then some.
int StructuredTokens() { return std::max(128, absl::GetFlag(FLAGS_decode_tokens)); }

// Decode tokens/s summed over `streams` concurrent generations (each its
// completion tokens after the first over its decode time), median of runs.
double DecodeRate(vlm::v1::Language::Stub& stub, int streams, bool schema, int runs) {
  std::vector<double> rates;
  for (int r = 0; r < runs; ++r) {
    std::vector<Outcome> outcomes(streams);
    std::vector<std::thread> threads;
    for (int i = 0; i < streams; ++i) {
      threads.emplace_back([&, i] {
        GenerateRequest request = Request(
            "Extract the invoice as JSON: ACME GmbH, 2025-03-14, 3 boxes of screws at 4.50 EUR, "
            "2 hammers at 12.00 EUR, delivered to the Berlin warehouse; write detailed notes.",
            StructuredTokens());
        request.mutable_params()->mutable_sampling()->set_temperature(0.7f);
        request.mutable_params()->mutable_sampling()->set_seed(static_cast<uint64_t>(r * 64 + i));
        if (schema) {
          request.mutable_params()->set_ignore_eos(false);
          request.mutable_params()->set_json_schema(kBenchSchema);
        }
        outcomes[i] = Run(stub, request);
      });
    }
    for (std::thread& t : threads) t.join();
    double rate = 0;
    for (const Outcome& o : outcomes) {
      if (!o.ok) {
        std::fprintf(stderr, "generation failed: %s\n", o.error.c_str());
        return 0;
      }
      const double ms = o.last.timings().decode_ms();
      if (o.tokens >= 2 && ms > 0) rate += (o.tokens - 1) / (ms / 1000);
    }
    rates.push_back(rate);
  }
  return Median(rates);
}

int StructuredBench(const std::string& binary, const std::string& dir) {
  const int runs = std::max(1, absl::GetFlag(FLAGS_runs));
  // In this process: vocabulary, compile, first masks, mask cost per step.
  auto tokenizer = vlm::language::Tokenizer::Load(dir);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "%s\n", tokenizer.status().ToString().c_str());
    return 1;
  }
  Clock::time_point t0 = Clock::now();
  auto vocab = vlm::grammar::VocabularyFromTokenizer(**tokenizer);
  if (!vocab.ok()) {
    std::fprintf(stderr, "%s\n", vocab.status().ToString().c_str());
    return 1;
  }
  const double vocab_ms = Seconds(t0, Clock::now()) * 1000;
  std::vector<double> compile_ms, warm_ms;
  std::shared_ptr<const vlm::grammar::CompiledGrammar> compiled;
  for (int r = 0; r < runs; ++r) {
    vlm::grammar::GrammarCache cache(*vocab, 4);  // cold each run
    t0 = Clock::now();
    auto g = cache.Get(vlm::grammar::GrammarKind::kJsonSchema, kBenchSchema);
    if (!g.ok()) {
      std::fprintf(stderr, "%s\n", g.status().ToString().c_str());
      return 1;
    }
    compile_ms.push_back(Seconds(t0, Clock::now()) * 1000);
    // The first masks of a schema walk the vocabulary once per new state.
    vlm::grammar::Matcher m(*g);
    std::vector<uint32_t> mask((*vocab)->mask_words());
    t0 = Clock::now();
    m.FillMask(mask.data());
    warm_ms.push_back(Seconds(t0, Clock::now()) * 1000);
    compiled = *g;
  }
  // Mask cost per step, warm cache: a greedy walk over random logits of
  // the model's row width (fill + apply), as the engine does per token.
  std::vector<double> step_us;
  {
    vlm::grammar::Matcher m(compiled);
    std::vector<uint32_t> mask((*vocab)->mask_words());
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> logits(152064);
    vlm::language::SamplingConfig sc;
    sc.temperature = 0.7f;
    sc.seed = 1;
    vlm::language::Sampler sampler(sc, (*vocab)->size(), {});
    for (int pass = 0; pass < 2; ++pass) {  // the first pass warms the cache
      m.Reset();
      step_us.clear();
      for (int i = 0; i < 400 && !m.IsTerminated(); ++i) {
        for (float& v : logits) v = normal(rng);
        const Clock::time_point a = Clock::now();
        m.FillMask(mask.data());
        std::vector<float> row = logits;
        vlm::language::MaskDisallowed(absl::MakeSpan(row), mask.data(), (*vocab)->size());
        step_us.push_back(Seconds(a, Clock::now()) * 1e6);
        const int32_t id = sampler.Sample(logits, nullptr, 0, mask.data(), (*vocab)->size());
        if (!m.AcceptToken(id)) break;
      }
    }
  }
  // The in-process rows first: they need no server.
  std::printf("vlm-bench-language --structured: %s, %d threads, medians of %d runs, %d decode "
              "tokens per stream at most\n\n", dir.c_str(), absl::GetFlag(FLAGS_threads), runs,
              StructuredTokens());
  std::printf("| metric | value |\n|---|---|\n");
  std::printf("| grammar vocabulary from the tokenizer (ms, once per process) | %.1f |\n", vocab_ms);
  std::printf("| schema compile: grammar + automaton (ms) | %.2f |\n", Median(compile_ms));
  std::printf("| schema automaton: states / byte classes | %d / %d |\n",
              compiled->grammar().num_states(), compiled->grammar().num_byte_classes());
  std::printf("| first token mask of the schema (ms, cold mask cache) | %.2f |\n", Median(warm_ms));
  std::printf("| token mask per decode step, warm: median / p90 (us) | %.0f / %.0f |\n",
              Median(step_us), [&] {
                std::vector<double> v = step_us;
                std::sort(v.begin(), v.end());
                return v.empty() ? 0.0 : v[v.size() * 9 / 10];
              }());
  std::fflush(stdout);
  // The server: decode with and without the schema.
  std::vector<std::string> flags = {
      "--grpc_address=127.0.0.1:0", "--metrics_address=", absl::StrCat("--model_dir=", dir),
      absl::StrCat("--intra_op_threads=", absl::GetFlag(FLAGS_threads)), "--max_context=4096",
      "--log_level=warning", "--max_sequences=8", "--packed_cache_dir=" + g_packed_dir};
  Server server(binary, flags);
  if (server.WaitServing(absl::Minutes(5)) < 0) {
    std::fprintf(stderr, "vlm-language did not become SERVING\n");
    return 1;
  }
  auto stub = server.Stub();
  Run(*stub, Request("warm up", 4));
  struct Row {
    int streams;
    double without, with;
  };
  std::vector<Row> rows;
  for (int streams : {1, 8}) {
    Row row{streams, 0, 0};
    // One round each first: a schema's first requests fill its token-mask
    // cache (a vocabulary walk per new automaton state); served schemas
    // repeat, so the figures are those of a warm cache.
    DecodeRate(*stub, streams, false, 1);
    DecodeRate(*stub, streams, true, 1);
    row.without = DecodeRate(*stub, streams, false, runs);
    row.with = DecodeRate(*stub, streams, true, runs);
    rows.push_back(row);
  }
  for (const Row& r : rows) {
    const double step_ms = r.without > 0 ? 1000.0 * r.streams / r.without : 0;
    std::printf("| decode tokens/s, %d stream%s: without schema / with schema | %.1f / %.1f |\n",
                r.streams, r.streams > 1 ? "s" : "", r.without, r.with);
    std::printf("| with / without, %d stream%s (acceptance >= 0.90) | %.2fx |\n", r.streams,
                r.streams > 1 ? "s" : "", r.without > 0 ? r.with / r.without : 0.0);
    // The engine fills the batch's masks side by side on the kernels' pool
    // (one sequence per thread), within the step.
    const double mask_ms = Median(step_us) / 1000.0 *
                           std::ceil(static_cast<double>(r.streams) /
                                     std::max(1, std::min(r.streams, absl::GetFlag(FLAGS_threads))));
    std::printf("| masks per step as a share of a %d-stream decode step (%.1f ms) | %.1f%% |\n",
                r.streams, step_ms, step_ms > 0 ? 100.0 * mask_ms / step_ms : 0.0);
  }
  return 0;
}

// --startup: one server start and its first request.
struct StartRun {
  double serving_s = -1;      // process start -> SERVING
  double first_token_s = -1;  // process start -> first token of the first request
  double rss_mib = -1;        // after the first request
};

StartRun StartAndAsk(const std::string& binary, const std::vector<std::string>& flags,
                     std::unique_ptr<Server>* keep) {
  StartRun r;
  auto server = std::make_unique<Server>(binary, flags);
  r.serving_s = server->WaitServing(absl::Minutes(10));
  if (r.serving_s < 0) return r;
  auto stub = server->Stub();
  const GenerateRequest request = Request(
      "Describe a quiet harbour town at dawn: the boats, the gulls, the light on the water, "
      "the smell of the sea.",
      1);
  Outcome o = Run(*stub, request);
  if (!o.ok) {
    std::fprintf(stderr, "first request failed: %s\n", o.error.c_str());
    return r;
  }
  r.first_token_s = r.serving_s + o.client_first_s;
  r.rss_mib = RssMib(server->pid());
  if (keep != nullptr) *keep = std::move(server);
  return r;
}

std::string CpuKind() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

uint64_t DirectoryBytes(const std::string& dir) {
  uint64_t bytes = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".vlmpack") bytes += e.file_size(ec);
  }
  return bytes;
}

int StartupTable(const std::string& binary, const std::string& dir) {
  std::string parent = absl::GetFlag(FLAGS_startup_dir);
  if (parent.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    parent = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  }
  std::string tmpl = parent + "/vlm-bench-packed-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) {
    std::fprintf(stderr, "cannot create a directory under %s\n", parent.c_str());
    return 1;
  }
  const std::string packed_dir = tmpl;
  std::vector<Column> columns;
  for (absl::string_view entry : absl::StrSplit(absl::GetFlag(FLAGS_startup_configs), ';',
                                                absl::SkipEmpty())) {
    const size_t colon = entry.find(':');
    const std::string name(entry.substr(0, colon));
    const std::string extra(colon == absl::string_view::npos ? "" : entry.substr(colon + 1));
    std::vector<std::string> base = {
        "--model_dir=" + dir, "--grpc_address=127.0.0.1:0", "--metrics_address=",
        absl::StrCat("--intra_op_threads=", absl::GetFlag(FLAGS_threads)), "--log_level=warning"};
    for (absl::string_view f : absl::StrSplit(extra, ',', absl::SkipEmpty())) base.emplace_back(f);
    const LayerForm form = FormOf(extra);
    const double weights = DecodeWeightBytes(dir, form, Int4Int8LayersOf(extra)) / 1048576.0;
    for (const bool packed : {false, true}) {
      Column col;
      col.name = absl::StrCat(name, packed ? ", packed file" : ", old (--packed_cache_dir=)");
      std::vector<std::string> flags = base;
      flags.push_back(absl::StrCat("--packed_cache_dir=", packed ? packed_dir : ""));
      std::fprintf(stderr, "%s: first start\n", col.name.c_str());
      const uint64_t dir_before = DirectoryBytes(packed_dir);
      const StartRun first = StartAndAsk(binary, flags, nullptr);
      const uint64_t file_bytes = DirectoryBytes(packed_dir) - dir_before;
      std::fprintf(stderr, "%s: second start and a replica\n", col.name.c_str());
      std::unique_ptr<Server> one, two;
      const StartRun warm = StartAndAsk(binary, flags, &one);
      const StartRun replica = StartAndAsk(binary, flags, &two);
      const auto f = [](double v, const char* fmt) {
        return v < 0 ? std::string("failed") : absl::StrFormat(fmt, v);
      };
      col.Add("1st start (new: builds the file): start -> SERVING (s)", f(first.serving_s, "%.2f"));
      col.Add("1st start: start -> first token (s)", f(first.first_token_s, "%.2f"));
      col.Add("start -> SERVING, file present, page cache warm (s)", f(warm.serving_s, "%.2f"));
      col.Add("start -> first token of the 1st request (s) [<= 3]", f(warm.first_token_s, "%.2f"));
      col.Add("RSS after the 1st request (MiB)", f(warm.rss_mib, "%.0f"));
      col.Add("weight bytes of the form (MiB)", absl::StrFormat("%.0f", weights));
      col.Add("RSS - weight bytes (MiB) [<= 500]",
              warm.rss_mib < 0 ? "failed" : absl::StrFormat("%.0f", warm.rss_mib - weights));
      if (two != nullptr && one != nullptr) {
        col.Add("2nd replica: RSS after its 1st request (MiB)", f(replica.rss_mib, "%.0f"));
        col.Add("2nd replica: PSS (MiB)", f(SmapsMib(two->pid(), "Pss:"), "%.0f"));
        col.Add("2nd replica: private (MiB)",
                f(SmapsMib(two->pid(), "Private_Clean:") + SmapsMib(two->pid(), "Private_Dirty:"),
                  "%.0f"));
        col.Add("1st replica: PSS with both up (MiB)", f(SmapsMib(one->pid(), "Pss:"), "%.0f"));
      } else {
        col.Add("2nd replica", "failed");
      }
      col.Add("packed-weight file (MiB)",
              packed ? absl::StrFormat("%.0f", file_bytes / 1048576.0) : "-");
      columns.push_back(std::move(col));
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(packed_dir, ec);
  std::printf("vlm-bench-language --startup: %s, %d threads, CPU %s\n", dir.c_str(),
              absl::GetFlag(FLAGS_threads), CpuKind().c_str());
  std::printf("(one start per cell; run the command again for a spread)\n\n| metric |");
  for (const Column& c : columns) std::printf(" %s |", c.name.c_str());
  std::printf("\n|---|");
  for (size_t i = 0; i < columns.size(); ++i) std::printf("---|");
  std::printf("\n");
  for (size_t r = 0; !columns.empty() && r < columns[0].rows.size(); ++r) {
    std::printf("| %s |", columns[0].rows[r].first.c_str());
    for (const Column& c : columns) {
      std::printf(" %s |", r < c.rows.size() ? c.rows[r].second.c_str() : "-");
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::string dir = absl::GetFlag(FLAGS_model_dir);
  if (dir.empty()) {
    const char* cache = std::getenv("VLM_CACHE_DIR");
    const char* home = std::getenv("HOME");
    dir = (cache != nullptr && *cache != '\0')
              ? std::string(cache) + "/checkpoints/2b"
              : std::string(home != nullptr ? home : "/root") + "/.cache/vlm/checkpoints/2b";
  }
  std::string binary = absl::GetFlag(FLAGS_server);
  if (binary.empty()) {
    char self[4096];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    self[n > 0 ? n : 0] = '\0';
    std::string path(self);
    binary = path.substr(0, path.rfind('/')) + "/../services/language/vlm-language";
  }
  if (absl::GetFlag(FLAGS_startup)) {
    auto config = vlm::LoadModelConfig(dir);
    if (!config.ok()) {
      std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
      return 1;
    }
    return StartupTable(binary, dir);
  }
  g_packed_dir = absl::GetFlag(FLAGS_packed_cache_dir);
  std::string temporary_dir;
  if (g_packed_dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
                       "/vlm-bench-language-packed-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) {
      std::fprintf(stderr, "cannot create %s: %s\n", tmpl.c_str(), std::strerror(errno));
      return 1;
    }
    g_packed_dir = temporary_dir = tmpl;
  }
  // Removes the temporary packed-weight directory on every return below.
  struct RemoveAtExit {
    std::string dir;
    ~RemoveAtExit() {
      std::error_code ec;
      if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    }
  } remove_at_exit{temporary_dir};
  if (absl::GetFlag(FLAGS_structured)) return StructuredBench(binary, dir);
  auto config = vlm::LoadModelConfig(dir);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 1;
  }
  const uint64_t bytes = DecodeWeightBytes(dir);
  double bandwidth = ReadBandwidth(absl::GetFlag(FLAGS_threads));

  std::vector<Column> columns;
  std::vector<std::unique_ptr<Server>> servers;
  const bool paired = absl::GetFlag(FLAGS_paired_decode_rounds) > 0;
  for (absl::string_view extra : absl::StrSplit(absl::GetFlag(FLAGS_configs), ';')) {
    servers.emplace_back();
    columns.push_back(Measure(binary, dir, std::string(extra), *config, &bandwidth,
                              paired ? &servers.back() : nullptr));
    // The service's int8 and int4 forms put the LM head in int8 and int4
    // (DecoderOptions::int8_lm_head, int4_lm_head).
    const LayerForm form = FormOf(extra);
    columns.back().bytes = DecodeWeightBytes(dir, form, Int4Int8LayersOf(extra));
  }
  // The bound uses the best bandwidth seen in this run (contention only lowers it).
  const Column* first_bf16 = nullptr;
  for (const Column& c : columns) {
    if (c.bytes == bytes && c.decode_ms > 0 && first_bf16 == nullptr) first_bf16 = &c;
  }
  if (paired) PairedDecode(servers, &columns, first_bf16, &bandwidth);
  servers.clear();
  for (Column& c : columns) {
    if (c.decode_ms <= 0) continue;
    const double bound_ms = static_cast<double>(c.bytes) / bandwidth * 1000;
    c.Add("decode weight bytes (MiB)", absl::StrFormat("%.1f", c.bytes / 1048576.0));
    c.Add("bandwidth bound ms/token", absl::StrFormat("%.1f", bound_ms));
    c.Add("decode / bound", absl::StrFormat("%.2fx", c.decode_ms / bound_ms));
    if (first_bf16 != nullptr) {
      c.Add(absl::StrCat("decode speed vs ", first_bf16->name),
            absl::StrFormat("%.2fx", first_bf16->decode_ms / c.decode_ms));
    }
    if (paired) {
      const int rounds = absl::GetFlag(FLAGS_paired_decode_rounds);
      const double paired_ms = Median(c.paired_ms_each);
      c.Add(absl::StrCat("paired decode ms/token (median of ", rounds, " rounds)"),
            absl::StrFormat("%.1f", paired_ms));
      c.Add("paired decode / bound",
            paired_ms > 0 ? absl::StrFormat("%.2fx", paired_ms / bound_ms) : "-");
      if (first_bf16 != nullptr) {
        std::string each;
        for (double r : c.paired_ratios) {
          absl::StrAppend(&each, each.empty() ? "" : " ", absl::StrFormat("%.2f", r));
        }
        c.Add(absl::StrCat("paired decode speed vs ", first_bf16->name, ": median (each round)"),
              c.paired_ratios.empty()
                  ? "-"
                  : absl::StrFormat("%.2fx (%s)", Median(c.paired_ratios), each));
      }
    }
  }

  std::printf("vlm-bench-language: %s, %d threads, medians of %d runs (%d starts)\n", dir.c_str(),
              absl::GetFlag(FLAGS_threads), absl::GetFlag(FLAGS_runs),
              absl::GetFlag(FLAGS_starts));
  std::printf("CPU: %s (int8 gemv %s, int4 gemv %s, gemm %s)\n", CpuModelName().c_str(),
              vlm::kernels::GemvInt8PathName(vlm::kernels::DefaultGemvInt8Path()),
              vlm::kernels::GemvInt4PathName(vlm::kernels::DefaultGemvInt4Path()),
              vlm::kernels::GemmPathName(vlm::kernels::DefaultGemmPath()));
  std::printf("weight bytes read per decode step: %.1f MiB; read bandwidth (best of the run): "
              "%.1f GB/s\n\n",
              bytes / 1048576.0, bandwidth / 1e9);
  std::printf("| metric |");
  for (const Column& c : columns) std::printf(" %s |", c.name.c_str());
  std::printf("\n|---|");
  for (size_t i = 0; i < columns.size(); ++i) std::printf("---|");
  std::printf("\n");
  for (size_t r = 0; r < columns[0].rows.size(); ++r) {
    std::printf("| %s |", columns[0].rows[r].first.c_str());
    for (const Column& c : columns) {
      std::printf(" %s |", r < c.rows.size() ? c.rows[r].second.c_str() : "-");
    }
    std::printf("\n");
  }
  return 0;
}
