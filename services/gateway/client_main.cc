// vlm-client: the command-line client of the gateway.
//
//   vlm-client --image cat.jpg "What is in this picture?"   # streams the answer
//   vlm-client --json --image cat.jpg "Describe it."          # the full response as JSON
//   vlm-client --json-schema invoice.schema.json --image inv.png "Extract the fields."
//   vlm-client health [--wait 60]                             # SERVING? (exit 0 if so)
//   vlm-client --target gw:443 --tls_ca ca.pem health          # connection options go anywhere
//
// Errors print "error: CODE: message" on stderr and exit non-zero
// (1: the call failed or the service is not serving, 2: bad usage).
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/grpc_status.h"
#include "common/tls.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "vlm/v1/gateway.grpc.pb.h"

namespace {

constexpr char kUsage[] = R"(usage:
  vlm-client [options] PROMPT...        chat: streams the answer to stdout
  vlm-client health [--wait SECONDS] [--service NAME]

connection options (before or after the subcommand):
  --target HOST:PORT       gateway address (default $VLM_TARGET or localhost:50051)
  --tls-ca PATH            PEM CA bundle of the gateway's certificate; any --tls-* option
                           makes the connection TLS (no --tls-ca: the system's roots)
  --tls-cert PATH          PEM client certificate (mTLS), with --tls-key
  --tls-key PATH           PEM private key of --tls-cert
  --tls-server-name NAME   name the gateway's certificate must carry (default: the target host)

chat options:
  --api-key KEY            sent as "authorization: Bearer KEY" (default $VLM_API_KEY)
  --image PATH             attach an image (JPEG, PNG, WebP); repeatable, in order
  --image-hash SHA256      attach an image sent before, by its content hash; repeatable
  --system TEXT            system prompt
  --max-tokens N           completion tokens at most
  --temperature F          0 = greedy
  --top-k N  --top-p F  --min-p F
  --repetition-penalty F  --presence-penalty F  --frequency-penalty F
  --seed N                 same seed + inputs => same output
  --stop TEXT              stop string; repeatable
  --json-schema FILE       constrain the answer to JSON valid under this JSON Schema
  --json-object            constrain the answer to a JSON object
  --regex PATTERN          constrain the answer to match this regular expression
  --min-pixels N  --max-pixels N   image resize bounds
  --deadline SECONDS       give up after this long (default 300)
  --request-id ID          echoed back in the response
  --json                   print the full response (unary Chat) as JSON, with the language
                           replica and route under "language"
  --stats                  after the streamed answer, print usage, timings and images to stderr
PROMPT "-" reads the prompt from stdin. Option values may also be given as --opt=value.
)";

int UsageError(const std::string& message) {
  std::fprintf(stderr, "vlm-client: %s\n\n%s", message.c_str(), kUsage);
  return 2;
}

int RpcError(const grpc::Status& status) {
  std::fprintf(stderr, "error: %s: %s\n", vlm::GrpcCodeName(status.error_code()),
               status.error_message().c_str());
  return 1;
}

// Command-line arguments: "--name value", "--name=value", flags, positionals.
class Args {
 public:
  Args(int argc, char** argv) : args_(argv + 1, argv + argc) {}

  bool Done() const { return i_ >= args_.size(); }
  const std::string& Peek() const { return args_[i_]; }

  // If the next argument is option `name` (dashes or underscores), consumes it
  // and its value.
  bool Value(const std::string& name, std::string* value, std::string* error) {
    std::string arg = Normalize(args_[i_]);
    const std::string want = Normalize("--" + name);
    if (arg == want) {
      if (i_ + 1 >= args_.size()) {
        *error = "--" + name + " needs a value";
        ++i_;
        return true;
      }
      *value = args_[i_ + 1];
      i_ += 2;
      return true;
    }
    if (arg.rfind(want + "=", 0) == 0) {
      *value = args_[i_].substr(args_[i_].find('=') + 1);
      ++i_;
      return true;
    }
    return false;
  }

  bool Flag(const std::string& name) {
    if (Normalize(args_[i_]) == Normalize("--" + name)) {
      ++i_;
      return true;
    }
    return false;
  }

  std::string Next() { return args_[i_++]; }

 private:
  // "--max_tokens" == "--max-tokens"; only the name part before '='.
  static std::string Normalize(std::string arg) {
    const size_t eq = arg.find('=');
    for (size_t k = 2; k < arg.size() && k < eq; ++k) {
      if (arg[k] == '_') arg[k] = '-';
    }
    return arg;
  }

  std::vector<std::string> args_;
  size_t i_ = 0;
};

template <typename T>
bool ParseNumber(const std::string& text, T* out) {
  std::istringstream in(text);
  in >> *out;
  return !in.fail() && in.eof();
}

std::string DefaultTarget() {
  const char* env = std::getenv("VLM_TARGET");
  return env != nullptr && *env != '\0' ? env : "localhost:50051";
}

// Where and how to connect; the options are accepted before and after the subcommand.
struct Connection {
  std::string target = DefaultTarget();
  vlm::TlsChannelFiles tls;

  // Consumes the next argument if it is a connection option (`error` is set
  // when its value is missing).
  bool Parse(Args& args, std::string* error) {
    return args.Value("target", &target, error) || args.Value("tls-ca", &tls.ca, error) ||
           args.Value("tls-cert", &tls.cert, error) || args.Value("tls-key", &tls.key, error) ||
           args.Value("tls-server-name", &tls.server_name, error);
  }
};

// Null after printing the error (bad TLS files).
std::shared_ptr<grpc::Channel> MakeChannel(const Connection& connection) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      vlm::MakeChannelCredentials(connection.tls);
  if (!credentials.ok()) {
    std::fprintf(stderr, "vlm-client: %s\n", std::string(credentials.status().message()).c_str());
    return nullptr;
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  vlm::ApplyTlsChannelArgs(connection.tls, &args);
  return grpc::CreateCustomChannel(connection.target, *credentials, args);
}

// --- health ---------------------------------------------------------------

int Health(Args& args, Connection connection) {
  std::string service;
  double wait_s = 0;
  while (!args.Done()) {
    std::string value, error;
    if (connection.Parse(args, &error) || args.Value("service", &service, &error)) {
      if (!error.empty()) return UsageError(error);
      continue;
    }
    if (args.Value("wait", &value, &error)) {
      if (!error.empty()) return UsageError(error);
      if (!ParseNumber(value, &wait_s) || wait_s < 0) return UsageError("bad --wait " + value);
      continue;
    }
    if (args.Flag("help") || args.Flag("h")) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    return UsageError("unexpected argument " + args.Peek());
  }
  std::shared_ptr<grpc::Channel> channel = MakeChannel(connection);
  if (channel == nullptr) return 2;
  auto stub = grpc::health::v1::Health::NewStub(channel);
  const auto give_up = std::chrono::steady_clock::now() +
                       std::chrono::milliseconds(static_cast<int64_t>(wait_s * 1000));
  for (;;) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = stub->Check(&context, request, &response);
    const bool serving =
        status.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    if (serving || std::chrono::steady_clock::now() >= give_up) {
      if (!status.ok()) return RpcError(status);
      std::printf("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
                              response.status()).c_str());
      return serving ? 0 : 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// --- chat -----------------------------------------------------------------

std::optional<std::string> ReadFile(const std::string& path, std::string* error) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *error = "cannot read " + path;
    return std::nullopt;
  }
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

const char* FinishName(vlm::v1::FinishReason reason) {
  switch (reason) {
    case vlm::v1::FINISH_REASON_STOP: return "stop";
    case vlm::v1::FINISH_REASON_LENGTH: return "length";
    case vlm::v1::FINISH_REASON_CANCELLED: return "cancelled";
    default: return "unspecified";
  }
}

const char* CacheName(vlm::v1::CacheLevel level) {
  switch (level) {
    case vlm::v1::CACHE_LEVEL_MISS: return "miss";
    case vlm::v1::CACHE_LEVEL_MEMORY: return "hit (memory)";
    case vlm::v1::CACHE_LEVEL_PIXELS: return "hit (pixels)";
    case vlm::v1::CACHE_LEVEL_DISK: return "hit (disk)";
    default: return "unspecified";
  }
}

void PrintStats(const vlm::v1::ChatChunk& last) {
  const auto& u = last.usage();
  const auto& t = last.timings();
  std::fprintf(stderr,
               "[finish=%s prompt_tokens=%d image_tokens=%d cached_prompt_tokens=%d "
               "completion_tokens=%d]\n"
               "[ms: queue %.1f, vision %.1f, projector %.1f, prefill %.1f, first token %.1f, "
               "decode %.1f, total %.1f]\n",
               FinishName(last.finish_reason()), u.prompt_tokens(), u.image_tokens(),
               u.cached_prompt_tokens(), u.completion_tokens(), t.queue_ms(), t.vision_ms(), t.projector_ms(),
               t.prefill_ms(), t.first_token_ms(), t.decode_ms(), t.total_ms());
  if (last.has_language()) {
    std::fprintf(stderr, "[language replica %s, route %s, %d attempt(s)]\n",
                 last.language().replica().c_str(), last.language().route().c_str(),
                 last.language().attempts());
  }
  for (int i = 0; i < last.images_size(); ++i) {
    const auto& im = last.images(i);
    std::fprintf(stderr,
                 "[image %d: sha256 %s, cache %s, grid %lldx%lldx%lld, %d tokens, %.1f ms, "
                 "replica %s]\n",
                 i + 1, im.content_hash().c_str(), CacheName(im.cache()),
                 static_cast<long long>(im.grid().t()), static_cast<long long>(im.grid().h()),
                 static_cast<long long>(im.grid().w()), im.tokens(), im.vision_ms(),
                 im.replica().c_str());
  }
}

// What `vlm-client [options] PROMPT...` asks for.
struct ChatOptions {
  vlm::v1::ChatRequest request;
  vlm::v1::ChatMessage user;
  std::string system;
  std::vector<std::string> prompt_words;
  double deadline_s = 300;
  bool json = false;
  bool stats = false;
  std::string api_key;
};

// Reads the chat options and prompt words; an exit code when the command is
// done (usage error, --help), nullopt to go on.
std::optional<int> ParseChatArgs(Args& args, Connection& connection, ChatOptions* o) {
  auto* params = o->request.mutable_params();
  auto* sampling = params->mutable_sampling();
  while (!args.Done()) {
    std::string v, error;
    auto number_option = [&](const char* name, auto setter, auto type_tag) -> std::optional<int> {
      if (!args.Value(name, &v, &error)) return std::nullopt;
      if (!error.empty()) return UsageError(error);
      decltype(type_tag) x{};
      if (!ParseNumber(v, &x)) return UsageError(std::string("bad --") + name + " " + v);
      setter(x);
      return 0;
    };
    if (connection.Parse(args, &error) || args.Value("system", &o->system, &error) ||
        args.Value("request-id", o->request.mutable_request_id(), &error) ||
        args.Value("api-key", &o->api_key, &error)) {
      if (!error.empty()) return UsageError(error);
      continue;
    }
    if (args.Value("image", &v, &error)) {
      if (!error.empty()) return UsageError(error);
      std::optional<std::string> bytes = ReadFile(v, &error);
      if (!bytes) return UsageError(error);
      o->user.add_content()->mutable_image()->set_data(std::move(*bytes));
      continue;
    }
    if (args.Value("image-hash", &v, &error)) {
      if (!error.empty()) return UsageError(error);
      o->user.add_content()->mutable_image()->set_content_hash(v);
      continue;
    }
    if (args.Value("stop", &v, &error)) {
      if (!error.empty()) return UsageError(error);
      params->add_stop(v);
      continue;
    }
    if (args.Value("json-schema", &v, &error)) {
      if (!error.empty()) return UsageError(error);
      std::optional<std::string> schema = ReadFile(v, &error);
      if (!schema) return UsageError(error);
      params->set_json_schema(std::move(*schema));
      continue;
    }
    if (args.Value("regex", &v, &error)) {
      if (!error.empty()) return UsageError(error);
      params->set_regex(v);
      continue;
    }
    if (args.Flag("json-object")) {
      params->set_json_object(true);
      continue;
    }
    std::optional<int> r;
    if ((r = number_option("max-tokens", [&](int x) { params->set_max_tokens(x); }, int{})) ||
        (r = number_option("temperature", [&](float x) { sampling->set_temperature(x); }, float{})) ||
        (r = number_option("top-k", [&](int x) { sampling->set_top_k(x); }, int{})) ||
        (r = number_option("top-p", [&](float x) { sampling->set_top_p(x); }, float{})) ||
        (r = number_option("min-p", [&](float x) { sampling->set_min_p(x); }, float{})) ||
        (r = number_option("repetition-penalty",
                           [&](float x) { sampling->set_repetition_penalty(x); }, float{})) ||
        (r = number_option("presence-penalty",
                           [&](float x) { sampling->set_presence_penalty(x); }, float{})) ||
        (r = number_option("frequency-penalty",
                           [&](float x) { sampling->set_frequency_penalty(x); }, float{})) ||
        (r = number_option("seed", [&](uint64_t x) { sampling->set_seed(x); }, uint64_t{})) ||
        (r = number_option("min-pixels",
                           [&](int64_t x) { o->request.mutable_image_options()->set_min_pixels(x); },
                           int64_t{})) ||
        (r = number_option("max-pixels",
                           [&](int64_t x) { o->request.mutable_image_options()->set_max_pixels(x); },
                           int64_t{})) ||
        (r = number_option("deadline", [&](double x) { o->deadline_s = x; }, double{}))) {
      if (*r != 0) return *r;
      continue;
    }
    if (args.Flag("json")) {
      o->json = true;
      continue;
    }
    if (args.Flag("stats")) {
      o->stats = true;
      continue;
    }
    if (args.Flag("help") || args.Flag("h")) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (args.Peek() != "-" && args.Peek().rfind("-", 0) == 0 && args.Peek() != "--") {
      return UsageError("unknown option " + args.Peek());
    }
    if (args.Peek() == "--") {
      args.Next();
      while (!args.Done()) o->prompt_words.push_back(args.Next());
      break;
    }
    o->prompt_words.push_back(args.Next());
  }
  return std::nullopt;

}

int Chat(Args& args, Connection connection) {
  ChatOptions o;
  o.user.set_role("user");
  if (const char* key = std::getenv("VLM_API_KEY"); key != nullptr) o.api_key = key;
  if (std::optional<int> done = ParseChatArgs(args, connection, &o)) return *done;
  vlm::v1::ChatRequest& request = o.request;
  vlm::v1::ChatMessage& user = o.user;
  const std::vector<std::string>& prompt_words = o.prompt_words;
  const std::string& system = o.system;
  const std::string& api_key = o.api_key;
  const double deadline_s = o.deadline_s;
  const bool json = o.json;
  const bool stats = o.stats;

  std::string prompt;
  for (size_t i = 0; i < prompt_words.size(); ++i) {
    if (prompt_words[i] == "-") {
      prompt += std::string(std::istreambuf_iterator<char>(std::cin),
                            std::istreambuf_iterator<char>());
    } else {
      prompt += (i > 0 ? " " : "") + prompt_words[i];
    }
  }
  if (prompt.empty() && user.content_size() == 0) return UsageError("no prompt given");
  if (!prompt.empty()) user.add_content()->set_text(prompt);
  if (!system.empty()) {
    auto* message = request.add_messages();
    message->set_role("system");
    message->add_content()->set_text(system);
  }
  *request.add_messages() = std::move(user);

  std::shared_ptr<grpc::Channel> channel = MakeChannel(connection);
  if (channel == nullptr) return 2;
  auto stub = vlm::v1::VisionLanguage::NewStub(channel);
  grpc::ClientContext context;
  if (!api_key.empty()) context.AddMetadata("authorization", "Bearer " + api_key);
  if (deadline_s > 0) {
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::microseconds(static_cast<int64_t>(deadline_s * 1e6)));
  }

  if (json) {
    vlm::v1::ChatResponse response;
    const grpc::Status status = stub->Chat(&context, request, &response);
    if (!status.ok()) return RpcError(status);
    google::protobuf::util::JsonPrintOptions options;
    options.add_whitespace = true;
    options.preserve_proto_field_names = true;
    std::string out;
    (void)google::protobuf::util::MessageToJsonString(response, &out, options);
    std::fputs(out.c_str(), stdout);
    if (out.empty() || out.back() != '\n') std::fputc('\n', stdout);
    return 0;
  }

  auto reader = stub->ChatStream(&context, request);
  vlm::v1::ChatChunk chunk;
  vlm::v1::ChatChunk last;
  std::string text;
  while (reader->Read(&chunk)) {
    std::fwrite(chunk.text().data(), 1, chunk.text().size(), stdout);
    std::fflush(stdout);
    text += chunk.text();
    if (chunk.finish_reason() != vlm::v1::FINISH_REASON_UNSPECIFIED) last = chunk;
  }
  const grpc::Status status = reader->Finish();
  if (!text.empty() && text.back() != '\n') std::fputc('\n', stdout);
  std::fflush(stdout);
  if (!status.ok()) return RpcError(status);
  if (stats) PrintStats(last);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args(argc, argv);
  // Connection options may come first: `vlm-client --target X health`.
  Connection connection;
  while (!args.Done()) {
    std::string error;
    if (!connection.Parse(args, &error)) break;
    if (!error.empty()) return UsageError(error);
  }
  if (!args.Done() && args.Peek() == "health") {
    args.Next();
    return Health(args, connection);
  }
  if (args.Done()) return UsageError("no prompt given");
  return Chat(args, connection);
}
