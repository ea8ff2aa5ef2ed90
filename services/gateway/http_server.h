// The gateway's HTTP front end (cpp-httplib), over the same ChatPipeline as
// gRPC vlm.v1.VisionLanguage:
//
//   POST /v1/chat/completions  OpenAI chat completions, JSON or SSE (stream: true)
//   GET  /v1/models            the served model
//   GET  /health               200 only while the gateway is SERVING (else 503)
//   GET  /, /app.js, /style.css  the web page (compiled into the binary)
//
// Authentication: with API keys configured, /v1/* need `Authorization: Bearer
// KEY` (401 otherwise); /health and the page stay open (the page holds no
// secret and asks for a key when the API answers 401).
//
// Errors are OpenAI error objects with the status of http_status.h. A body
// over max_body_bytes gets 413 before it is parsed.
//
// Streaming: the response commits to 200 + text/event-stream only when the
// first chunk exists, so errors before any token (validation, admission, image
// encoding, warm-up) keep their own status.
//
// A client that goes away cancels its request, streamed or not, in any phase
// (queued for admission, encoding, prefill, decoding): the language service
// frees the sequence and the admission permit is released. Each chat request's
// connection is watched (connection_watch.h: the peer's FIN or RST, seen by
// poll) for as long as the request runs; a failed SSE write cancels too.
//
// Metrics (on the gateway's /metrics): vlm_gateway_http_requests_total{route,
// status} (route: the API paths, "page" or "other"),
// vlm_gateway_http_sse_streams_open, vlm_gateway_http_client_gone_total
// (requests cancelled by a watched connection closing) and
// vlm_gateway_http_unwatched_requests_total (connections that could not be
// watched; expected 0), vlm_gateway_http_idle_closed_total (idle keep-alive
// connections closed to free a worker for a waiting one); the chat latencies are the pipeline's own
// (vlm_gateway_queue_seconds, ..., shared with gRPC).
//
// Keep-alive: an idle connection stays open `keep_alive` (default 75 s, longer
// than the idle timeouts of load balancers (60 s) and of HTTP clients' free
// sockets (undici, agentkeepalive: 4 s; httpx: 5 s)), so a client reusing a
// pooled connection never races the server closing it. Every response says
// `Keep-Alive: timeout=N, max=M`, which undici and node's http agent use to
// drop the socket a second before the server does; the M-th response on a
// connection says `Connection: close`. An open connection holds one of the
// `threads` workers, idle or not, so idle connections give way: when a new
// connection finds every worker taken, the longest-idle connection is closed
// (between requests, never inside one), and a response finished while
// connections wait for a worker says `Connection: close` and ends its
// connection. A new connection therefore waits only for a request in progress,
// never for an idle one (bound: the shortest running request, or a stream).
// Stop closes idle connections at once. (httplib polls an idle connection
// every 10 ms: about 100 wake-ups a second each while it is kept.)
//
// Thread-safety: Start/Stop from one thread; requests run on the server's pool.
#ifndef VLM_SERVICES_GATEWAY_HTTP_SERVER_H_
#define VLM_SERVICES_GATEWAY_HTTP_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/gateway/api_keys.h"
#include "services/gateway/chat_pipeline.h"

namespace vlm::gateway {

struct HttpServerOptions {
  std::string address = "0.0.0.0:8080";  // port 0 picks a free port
  std::string served_model_name = "qwen3-vl";
  int64_t max_body_bytes = 32 << 20;     // larger bodies get 413
  int threads = 64;                      // concurrent connections served (a stream holds one)
  absl::Duration keep_alive = absl::Seconds(75);  // idle connection kept; zero: one request each
  int keep_alive_max_requests = 1000;    // requests per connection; the last says Connection: close
  bool allow_remote_images = false;      // fetch http(s) image URLs
  int64_t max_remote_image_bytes = 20 << 20;
  absl::Duration remote_image_timeout = absl::Seconds(10);
};

class HttpServer {
 public:
  // Binds and serves on background threads. `pipeline` must outlive the
  // server; `api_keys` may be null (no authentication). Errors: bad address,
  // cannot bind.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(HttpServerOptions options,
                                                           const ChatPipeline* pipeline,
                                                           const ApiKeys* api_keys);
  ~HttpServer();  // Stop(absl::ZeroDuration())
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Stops accepting, gives running requests up to `grace` to finish, cancels
  // the rest, and returns once every request thread has ended. Idempotent.
  void Stop(absl::Duration grace);

  int port() const { return port_; }
  std::string address() const;  // host:port as bound

  struct Impl;

 private:
  HttpServer(std::unique_ptr<Impl> impl, std::string host, int port);

  std::unique_ptr<Impl> impl_;
  std::string host_;
  int port_;
};

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_HTTP_SERVER_H_
