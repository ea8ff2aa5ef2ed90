// vlm-gateway: the public API vlm.v1.VisionLanguage in front of the vision
// replicas and the language service, and the same pipeline over HTTP: the
// OpenAI-compatible /v1/chat/completions and a web page (--http_address).
//
//   vlm-gateway --language_target=127.0.0.1:50053 --vision_targets=127.0.0.1:50052
//   vlm-gateway --language_targets=10.0.0.7:50051,10.0.0.8:50051 ...   # language replicas
//   vlm-gateway --vision_dns=vlm-vision-headless:50052   # Kubernetes headless Service
//   vlm-gateway --language_dns=vlm-language-headless:50051
//
// Every flag can also be set as VLM_<FLAG> in the environment.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <thread>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/server.h"
#include "common/tls.h"
#include "services/gateway/admission.h"
#include "services/gateway/backend_call.h"
#include "services/gateway/backend_health.h"
#include "services/gateway/gateway_service.h"
#include "services/gateway/http_server.h"
#include "services/gateway/language_router.h"
#include "services/gateway/router.h"
#include "vlm/v1/language.grpc.pb.h"

ABSL_FLAG(std::string, language_target, "127.0.0.1:50053",
          "the language service host:port (one replica; see --language_targets)");
ABSL_FLAG(std::string, language_targets, "",
          "language replicas, comma-separated host:port; replaces --language_target when set");
ABSL_FLAG(std::string, language_dns, "",
          "host:port whose DNS name lists the language replicas (e.g. a Kubernetes headless "
          "Service); re-resolved every --language_dns_refresh_s; replaces --language_targets");
ABSL_FLAG(double, language_dns_refresh_s, 5, "seconds between re-resolutions of --language_dns");
ABSL_FLAG(std::string, language_routing, "affinity",
          "affinity (each conversation to its prefix's replica, bounded load) or round_robin");
ABSL_FLAG(int, language_load_slack, 2,
          "a conversation leaves its home replica when the home carries more than this many "
          "sequences (running + waiting) beyond the least-loaded replica ...");
ABSL_FLAG(double, language_load_factor, 1.5,
          "... and more than this multiple of the least-loaded replica's sequences");
ABSL_FLAG(int, language_max_attempts, 3,
          "Generate calls per request: UNAVAILABLE before the first token moves it to the next "
          "replica in hash order");
ABSL_FLAG(int, language_info_refresh_ms, 500,
          "interval of the ReplicaInfo polls (model fingerprint, running and waiting sequences)");
ABSL_FLAG(std::string, vision_targets, "127.0.0.1:50052",
          "vision replicas, comma-separated host:port (ignored when --vision_dns is set)");
ABSL_FLAG(std::string, vision_dns, "",
          "host:port whose DNS name lists the vision replicas (e.g. a Kubernetes headless "
          "Service); re-resolved every --vision_dns_refresh_s");
ABSL_FLAG(double, vision_dns_refresh_s, 5, "seconds between re-resolutions of --vision_dns");
ABSL_FLAG(int, vision_max_attempts, 3,
          "Encode calls per image: on UNAVAILABLE the next replica in hash order is tried");
ABSL_FLAG(int, vision_retry_backoff_ms, 25, "wait before the second Encode call; doubles after");
ABSL_FLAG(int, backend_reconnect_max_ms, 1000,
          "longest wait between reconnection attempts to a backend (channels and health watches)");
// --- backend channels: TLS (common/tls.h) and keepalive -----------------------
ABSL_FLAG(std::string, backend_tls_ca, "",
          "PEM CA bundle that signed the backends' certificates; setting any --backend_tls_* "
          "flag makes the backend channels TLS");
ABSL_FLAG(std::string, backend_tls_cert, "",
          "PEM client certificate presented to the backends (mTLS), with --backend_tls_key");
ABSL_FLAG(std::string, backend_tls_key, "", "PEM private key of --backend_tls_cert");
ABSL_FLAG(std::string, backend_tls_server_name, "",
          "name the backends' certificates must carry (the targets are addresses, e.g. pod IPs)");
ABSL_FLAG(int, backend_keepalive_ms, 20000,
          "keepalive ping interval towards the backends; a backend whose ack takes longer than "
          "--backend_keepalive_timeout_ms is treated as unreachable (0 disables; min 1000)");
ABSL_FLAG(int, backend_keepalive_timeout_ms, 10000, "wait for a keepalive ack, milliseconds");
ABSL_FLAG(int, max_inflight, 8, "chat requests running at once");
ABSL_FLAG(int, max_queue, 32,
          "chat requests waiting for a slot; beyond it requests get RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_images_per_request, 8, "images per chat request");
ABSL_FLAG(int64_t, max_image_bytes, 20 << 20, "bytes of one encoded image");
ABSL_FLAG(int64_t, max_text_bytes, 256 << 10,
          "bytes of all text of a request (message text and stop strings)");
ABSL_FLAG(int, max_messages, 256, "messages per chat request");
ABSL_FLAG(int, max_tokens_limit, 8192, "largest params.max_tokens accepted");
ABSL_FLAG(int, default_max_tokens, 1024,
          "params.max_tokens when the client leaves it unset (0: up to the context length)");
ABSL_FLAG(int, max_stop_strings, 16, "stop strings per request");
ABSL_FLAG(int, max_n, 8, "most choices (OpenAI n) one request may ask for");
ABSL_FLAG(double, default_deadline_s, 300,
          "deadline of a request whose client sets none (0: no deadline)");
ABSL_FLAG(int, spatial_merge_size, 2,
          "the model's spatial_merge_size (image tokens = t*h*w / merge^2 in responses)");

// --- HTTP front end (OpenAI-compatible API, web page) and API keys ----------
ABSL_FLAG(std::string, http_address, "0.0.0.0:8080",
          "OpenAI-compatible HTTP API and web page (port 0 picks one; \"\" disables)");
ABSL_FLAG(std::string, api_keys_file, "",
          "file with one API key per line; when set, HTTP /v1/* and gRPC chat calls need "
          "'Authorization: Bearer KEY'");
ABSL_FLAG(std::string, served_model_name, "",
          "model id of /v1/models and responses (default: the base name of --model_dir)");
ABSL_FLAG(std::string, model_dir, "",
          "the checkpoint directory the backends serve; only its name is used (model id)");
ABSL_FLAG(int64_t, max_http_body_bytes, 32 << 20, "largest HTTP request body; larger: 413");
ABSL_FLAG(int, http_threads, 64, "HTTP connections served at once (an SSE stream holds one)");
ABSL_FLAG(int, http_keep_alive_s, 75,
          "seconds an idle HTTP keep-alive connection stays open (sent as Keep-Alive: timeout=N; "
          "idle connections are closed early when new ones need their worker; 0: one request "
          "per connection)");
ABSL_FLAG(bool, allow_remote_images, false,
          "fetch http(s):// image URLs of HTTP requests (off: refused with 400)");
ABSL_FLAG(double, remote_image_timeout_s, 10,
          "time limit for fetching all remote images of a request (fetched in parallel)");

namespace {

using namespace vlm::gateway;  // NOLINT: the binary of this namespace

constexpr char kComponent[] = "gateway";

// The model id: --served_model_name, else the checkpoint directory's name.
std::string ServedModelName() {
  std::string name = absl::GetFlag(FLAGS_served_model_name);
  if (!name.empty()) return name;
  std::string dir = absl::GetFlag(FLAGS_model_dir);
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  name = dir.substr(dir.find_last_of('/') + 1);
  return name.empty() ? "qwen3-vl" : name;
}


// Backend channels: reconnect backoff, keepalive, optional TLS.
absl::StatusOr<ChannelOptions> ChannelOptionsFromFlags() {
  ChannelOptions channel;
  channel.max_reconnect_backoff = absl::Milliseconds(absl::GetFlag(FLAGS_backend_reconnect_max_ms));
  const int keepalive_ms = absl::GetFlag(FLAGS_backend_keepalive_ms);
  const int keepalive_timeout_ms = absl::GetFlag(FLAGS_backend_keepalive_timeout_ms);
  if ((keepalive_ms != 0 && keepalive_ms < 1000) || keepalive_timeout_ms < 1) {
    return absl::InvalidArgumentError(
        "need --backend_keepalive_ms 0 or >= 1000 and --backend_keepalive_timeout_ms >= 1");
  }
  channel.keepalive_time = absl::Milliseconds(keepalive_ms);
  channel.keepalive_timeout = absl::Milliseconds(keepalive_timeout_ms);
  vlm::TlsChannelFiles backend_tls;
  backend_tls.ca = absl::GetFlag(FLAGS_backend_tls_ca);
  backend_tls.cert = absl::GetFlag(FLAGS_backend_tls_cert);
  backend_tls.key = absl::GetFlag(FLAGS_backend_tls_key);
  backend_tls.server_name = absl::GetFlag(FLAGS_backend_tls_server_name);
  backend_tls.refresh = absl::Seconds(absl::GetFlag(FLAGS_tls_refresh_s));
  if (backend_tls.enabled()) {
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
        vlm::MakeChannelCredentials(backend_tls);
    if (!credentials.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad --backend_tls_* flags: ", credentials.status().ToString()));
    }
    channel.credentials = *credentials;
    channel.tls_server_name = backend_tls.server_name;
  }
  vlm::LogInfo(kComponent, "backend channels", {{"tls", vlm::DescribeTls(backend_tls)}});
  return channel;
}

absl::StatusOr<VisionRouterOptions> RouterOptionsFromFlags(const ChannelOptions& channel,
                                                           const HealthWatchOptions& health) {
  VisionRouterOptions router_options;
  router_options.dns_target = absl::GetFlag(FLAGS_vision_dns);
  if (router_options.dns_target.empty()) {
    absl::StatusOr<std::vector<std::string>> targets =
        ParseTargetList(absl::GetFlag(FLAGS_vision_targets));
    if (!targets.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad --vision_targets: ", targets.status().ToString()));
    }
    router_options.static_targets = *targets;
  }
  router_options.dns_refresh = absl::Seconds(absl::GetFlag(FLAGS_vision_dns_refresh_s));
  router_options.max_attempts = absl::GetFlag(FLAGS_vision_max_attempts);
  router_options.retry_backoff = absl::Milliseconds(absl::GetFlag(FLAGS_vision_retry_backoff_ms));
  router_options.channel = channel;
  router_options.health = health;
  return router_options;
}

absl::StatusOr<LanguageRouterOptions> LanguageRouterOptionsFromFlags(
    const ChannelOptions& channel, const HealthWatchOptions& health) {
  LanguageRouterOptions options;
  options.dns_target = absl::GetFlag(FLAGS_language_dns);
  if (options.dns_target.empty()) {
    const std::string list = absl::GetFlag(FLAGS_language_targets).empty()
                                 ? absl::GetFlag(FLAGS_language_target)
                                 : absl::GetFlag(FLAGS_language_targets);
    absl::StatusOr<std::vector<std::string>> targets = ParseTargetList(list);
    if (!targets.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad --language_targets: ", targets.status().ToString()));
    }
    options.static_targets = *targets;
  }
  absl::StatusOr<LanguageRouting> routing =
      ParseLanguageRouting(absl::GetFlag(FLAGS_language_routing));
  if (!routing.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad --language_routing: ", routing.status().message()));
  }
  options.routing = *routing;
  options.dns_refresh = absl::Seconds(absl::GetFlag(FLAGS_language_dns_refresh_s));
  options.bound.slack = absl::GetFlag(FLAGS_language_load_slack);
  options.bound.factor = absl::GetFlag(FLAGS_language_load_factor);
  options.max_attempts = absl::GetFlag(FLAGS_language_max_attempts);
  options.info_refresh = absl::Milliseconds(absl::GetFlag(FLAGS_language_info_refresh_ms));
  options.channel = channel;
  options.health = health;
  return options;
}

absl::StatusOr<GatewayOptions> GatewayOptionsFromFlags() {
  GatewayOptions options;
  options.limits.max_messages = absl::GetFlag(FLAGS_max_messages);
  options.limits.max_images_per_request = absl::GetFlag(FLAGS_max_images_per_request);
  options.limits.max_image_bytes = absl::GetFlag(FLAGS_max_image_bytes);
  options.limits.max_text_bytes = absl::GetFlag(FLAGS_max_text_bytes);
  options.limits.max_tokens_limit = absl::GetFlag(FLAGS_max_tokens_limit);
  options.limits.max_stop_strings = absl::GetFlag(FLAGS_max_stop_strings);
  options.limits.image_cost = vlm::gateway::ImageCostModelFromFlags();
  options.spatial_merge_size = absl::GetFlag(FLAGS_spatial_merge_size);
  options.default_max_tokens = absl::GetFlag(FLAGS_default_max_tokens);
  options.max_n = absl::GetFlag(FLAGS_max_n);
  const double default_deadline_s = absl::GetFlag(FLAGS_default_deadline_s);
  options.default_deadline =
      default_deadline_s > 0 ? absl::Seconds(default_deadline_s) : absl::InfiniteDuration();
  if (options.spatial_merge_size < 1 || options.default_max_tokens < 0 || options.max_n < 1 ||
      options.default_max_tokens > options.limits.max_tokens_limit) {
    return absl::InvalidArgumentError(
        "need spatial_merge_size >= 1, max_n >= 1 and 0 <= default_max_tokens <= max_tokens_limit");
  }
  return options;
}

// The keys of --api_keys_file, or nullptr when unset (no keys required).
absl::StatusOr<std::unique_ptr<ApiKeys>> ApiKeysFromFlags() {
  const std::string path = absl::GetFlag(FLAGS_api_keys_file);
  if (path.empty()) return std::unique_ptr<ApiKeys>();
  absl::StatusOr<ApiKeys> keys = ApiKeys::LoadFile(path);
  if (!keys.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("bad --api_keys_file: ", keys.status().ToString()));
  }
  return std::make_unique<ApiKeys>(*std::move(keys));
}

// The OpenAI-compatible HTTP front end on --http_address, or nullptr when it is "".
absl::StatusOr<std::unique_ptr<HttpServer>> StartHttpFromFlags(const GatewayOptions& options,
                                                               ChatPipeline* pipeline,
                                                               const ApiKeys* api_keys) {
  const std::string address = absl::GetFlag(FLAGS_http_address);
  if (address.empty()) return std::unique_ptr<HttpServer>();
  HttpServerOptions http_options;
  http_options.address = address;
  http_options.served_model_name = ServedModelName();
  http_options.max_body_bytes = absl::GetFlag(FLAGS_max_http_body_bytes);
  http_options.threads = absl::GetFlag(FLAGS_http_threads);
  if (absl::GetFlag(FLAGS_http_keep_alive_s) < 0) {
    return absl::InvalidArgumentError("--http_keep_alive_s must be >= 0");
  }
  http_options.keep_alive = absl::Seconds(absl::GetFlag(FLAGS_http_keep_alive_s));
  http_options.allow_remote_images = absl::GetFlag(FLAGS_allow_remote_images);
  http_options.max_remote_image_bytes = options.limits.max_image_bytes;
  http_options.remote_image_timeout = absl::Seconds(absl::GetFlag(FLAGS_remote_image_timeout_s));
  absl::StatusOr<std::unique_ptr<HttpServer>> started =
      HttpServer::Start(http_options, pipeline, api_keys);
  if (!started.ok()) return started.status();
  vlm::Log(vlm::LogLevel::kInfo, kComponent, "http listening",
           {{"address", (*started)->address()}, {"model", http_options.served_model_name},
            {"api_keys", api_keys ? static_cast<int>(api_keys->size()) : 0}});
  std::printf("vlm: http=%s\n", (*started)->address().c_str());
  std::fflush(stdout);
  return started;
}

// Waits for the gRPC server to finish (a signal drains it); HTTP requests
// drain in the same window, counted from the signal.
absl::Status ServeUntilDrained(vlm::Server& server, HttpServer* http) {
  std::atomic<bool> waited{false};
  absl::Time drain_started = absl::InfiniteFuture();
  std::thread drain_watch([&] {
    while (!waited && !server.readiness().draining()) absl::SleepFor(absl::Milliseconds(20));
    drain_started = absl::Now();
  });
  absl::Status done = server.Wait();
  waited = true;
  drain_watch.join();
  if (http != nullptr) {
    http->Stop(std::max(absl::ZeroDuration(),
                        drain_started + absl::Seconds(absl::GetFlag(FLAGS_drain_timeout_s)) -
                            absl::Now()));
  }
  return done;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetFlag(&FLAGS_grpc_address, "0.0.0.0:50051");
  absl::SetFlag(&FLAGS_metrics_address, "0.0.0.0:9090");
  vlm::ParseCommandLine(argc, argv,
                        "vlm-gateway: the public vlm.v1.VisionLanguage API over the vision and "
                        "language services");
  vlm::LogEffectiveConfiguration(kComponent);
  auto bad_flags = [](const absl::Status& status) {
    vlm::LogError(kComponent, "bad flags", {{"error", status.ToString()}});
    return 2;
  };
  absl::StatusOr<ChannelOptions> channel = ChannelOptionsFromFlags();
  if (!channel.ok()) return bad_flags(channel.status());
  HealthWatchOptions health_options;
  health_options.retry_max = channel->max_reconnect_backoff;
  absl::StatusOr<VisionRouterOptions> router_options =
      RouterOptionsFromFlags(*channel, health_options);
  if (!router_options.ok()) return bad_flags(router_options.status());
  absl::StatusOr<LanguageRouterOptions> language_options =
      LanguageRouterOptionsFromFlags(*channel, health_options);
  if (!language_options.ok()) return bad_flags(language_options.status());
  absl::StatusOr<GatewayOptions> options = GatewayOptionsFromFlags();
  if (!options.ok()) return bad_flags(options.status());
  absl::StatusOr<std::unique_ptr<ApiKeys>> api_keys = ApiKeysFromFlags();
  if (!api_keys.ok()) return bad_flags(api_keys.status());

  const std::string name = GatewayService::kServiceName;
  vlm::Server server(vlm::ServerOptions::FromFlags());
  BackendHealth health(&server.readiness(), name);
  absl::StatusOr<std::unique_ptr<VisionRouter>> router =
      VisionRouter::Create(*router_options, [&health] { health.Update(); });
  if (!router.ok()) {
    vlm::LogError(kComponent, "cannot set up the vision replicas",
                  {{"error", router.status().ToString()}});
    return 2;
  }
  absl::StatusOr<std::unique_ptr<LanguageRouter>> language =
      LanguageRouter::Create(*language_options, [&health] { health.Update(); });
  if (!language.ok()) {
    vlm::LogError(kComponent, "cannot set up the language replicas",
                  {{"error", language.status().ToString()}});
    return 2;
  }
  Admission admission(absl::GetFlag(FLAGS_max_inflight), absl::GetFlag(FLAGS_max_queue),
                      GatewayService::AdmissionGauges());
  // One pipeline, two front ends (gRPC and HTTP); optional API keys for both.
  ChatPipeline pipeline(*options, &server.readiness(), &admission, router->get(),
                        language->get());
  GatewayService service(&pipeline, api_keys->get());
  server.AddService(&service, name, "waiting for the backends' health");
  if (absl::Status s = server.Start(); !s.ok()) {
    vlm::LogError(kComponent, "cannot start", {{"error", s.ToString()}});
    return 1;
  }
  absl::StatusOr<std::unique_ptr<HttpServer>> http =
      StartHttpFromFlags(*options, &pipeline, api_keys->get());
  if (!http.ok()) {
    vlm::LogError(kComponent, "cannot start HTTP", {{"error", http.status().ToString()}});
    server.Shutdown(http.status());
    server.Wait().IgnoreError();  // the start failure above is what this exit reports
    return 1;
  }
  VisionRouter* router_ptr = router->get();
  LanguageRouter* language_ptr = language->get();
  health.Start([language_ptr] { return language_ptr->Replicas(); },
               [router_ptr] { return router_ptr->Replicas(); });
  absl::Status done = ServeUntilDrained(server, http->get());
  health.Stop();
  language->reset();
  router->reset();
  return done.ok() ? 0 : 1;
}
