#include "services/gateway/http_server.h"

#include <dirent.h>
#include <fcntl.h>
#include <httplib.h>
#include <netinet/in.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/metrics.h"
#include "services/gateway/connection_watch.h"
#include "services/gateway/http_status.h"
#include "services/gateway/openai_protocol.h"
#include "services/gateway/remote_image.h"
#include "services/gateway/web_assets.h"

namespace vlm::gateway {
namespace {

constexpr char kJson[] = "application/json";
constexpr char kChatRoute[] = "/v1/chat/completions";
constexpr char kModelsRoute[] = "/v1/models";

struct HttpMetrics {
  prometheus::Family<prometheus::Counter>& requests =
      prometheus::BuildCounter()
          .Name("vlm_gateway_http_requests_total")
          .Help("HTTP requests answered by the gateway, by route and status.")
          .Register(MetricsRegistry());
  prometheus::Gauge& sse_open = prometheus::BuildGauge()
                                    .Name("vlm_gateway_http_sse_streams_open")
                                    .Help("Server-sent-event streams open right now.")
                                    .Register(MetricsRegistry())
                                    .Add({});
  prometheus::Counter& client_gone =
      prometheus::BuildCounter()
          .Name("vlm_gateway_http_client_gone_total")
          .Help("Chat requests cancelled because their client closed or reset the connection.")
          .Register(MetricsRegistry())
          .Add({});
  prometheus::Counter& unwatched =
      prometheus::BuildCounter()
          .Name("vlm_gateway_http_unwatched_requests_total")
          .Help("Chat requests whose connection could not be watched for the client leaving.")
          .Register(MetricsRegistry())
          .Add({});
  prometheus::Counter& idle_closed =
      prometheus::BuildCounter()
          .Name("vlm_gateway_http_idle_closed_total")
          .Help("Keep-alive connections closed between requests to free a worker for a waiting one.")
          .Register(MetricsRegistry())
          .Add({});
};

HttpMetrics& Metrics() {
  static HttpMetrics* metrics = new HttpMetrics();
  return *metrics;
}

// A bounded label set: unknown paths are "other".
std::string RouteLabel(const std::string& path) {
  if (path == kChatRoute || path == kModelsRoute || path == "/health") return path;
  if (FindWebAsset(path) != nullptr) return "page";
  return "other";
}

std::string NewCompletionId() {
  thread_local absl::BitGen gen;
  return absl::StrFormat("%016x%08x", absl::Uniform<uint64_t>(gen), absl::Uniform<uint32_t>(gen));
}

void SendError(httplib::Response& res, const ApiError& error) {
  res.status = HttpStatusForCode(error.code);
  if (ShouldRetryAfter(error.code)) res.set_header("Retry-After", "1");
  res.set_content(ErrorJson(error), kJson);
}

std::string SseEvent(const std::string& data) { return absl::StrCat("data: ", data, "\n\n"); }

// One streamed completion: the pipeline runs on `worker` and queues SSE
// events; the connection's thread writes them.
struct SseStream {
  absl::Mutex mu;
  std::deque<std::string> events ABSL_GUARDED_BY(mu);
  bool finished ABSL_GUARDED_BY(mu) = false;
  grpc::Status status ABSL_GUARDED_BY(mu);
  Cancellation cancellation;
  // Declared after `cancellation`, which its callback cancels: destroyed first.
  std::unique_ptr<ConnectionWatcher::Watch> watch;
  std::thread worker;

  void Push(std::string event) {
    absl::MutexLock lock(&mu);
    events.push_back(std::move(event));
  }
};

class SseSink final : public ChatSink {
 public:
  SseSink(SseStream* stream, const ChunkFormatter* format) : stream_(stream), format_(format) {}
  bool OnDelta(v1::ChatChunk& chunk) override {
    Start(chunk.index());
    stream_->Push(SseEvent(format_->DeltaChunk(chunk)));
    return !stream_->cancellation.cancelled();
  }
  bool OnFinal(v1::ChatChunk& chunk) override {
    Start(chunk.index());
    for (std::string& c : format_->FinalChunks(chunk)) stream_->Push(SseEvent(c));
    return !stream_->cancellation.cancelled();
  }

 private:
  // Each choice (n > 1) opens with its role chunk.
  void Start(int index) {
    if (!started_.insert(index).second) return;
    stream_->Push(SseEvent(format_->RoleChunk(index)));
  }
  SseStream* stream_;
  const ChunkFormatter* format_;
  std::set<int> started_;
};

// --- keep-alive connections and the worker pool ------------------------------
//
// httplib (0.11) serves a connection on one worker from accept to close and
// waits for the next request inside the library, so an idle keep-alive
// connection holds its worker for the whole keep-alive timeout. The pool below
// knows each connection's socket (found at accept by its inode, and held as a
// duplicate so that the number cannot be reused under us) and whether it is
// between requests, so it can end idle connections when a new connection
// needs their worker: shutdown() of the socket wakes httplib's wait, which
// then reads end-of-file and closes the connection.

struct Connection {
  int fd = -1;  // our duplicate of the accepted socket (closed when the connection ends)
  ino_t inode = 0;
  // Guarded by ConnectionPool::mu_:
  bool running = false;      // a worker serves it
  bool in_request = false;   // between reading a request's head and the end of its response
  bool closing = false;      // shut down (or told Connection: close)
  absl::Time idle_since = absl::InfinitePast();
};

// The socket inode of `fd`, or 0 when it is no socket.
ino_t SocketInode(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return 0;
  return st.st_ino;
}

int LocalPort(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return -1;
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return -1;
}

bool HasPeer(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  return getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
}

thread_local Connection* current_connection = nullptr;  // the worker's connection

class ConnectionPool final : public httplib::TaskQueue {
 public:
  ConnectionPool(int threads, int port) : port_(port) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Work(); });
  }
  ~ConnectionPool() override = default;

  // On httplib's accept thread, right after accept(): finds the new socket,
  // queues its task and, when no worker is free, closes an idle connection.
  void enqueue(std::function<void()> fn) override {
    std::shared_ptr<Connection> conn = Adopt();
    absl::MutexLock lock(&mu_);
    jobs_.push_back({std::move(fn), std::move(conn)});
    if (StarvedLocked()) CloseIdleLocked(/*all=*/false);
  }

  void shutdown() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      CloseIdleLocked(/*all=*/true);
    }
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

  // Handler hooks, on the connection's own worker.
  void RequestStarted() {
    Connection* c = current_connection;
    if (c == nullptr) return;
    absl::MutexLock lock(&mu_);
    c->in_request = true;
  }
  // Before the response head is written: true when this connection should
  // end after the response (connections wait for a worker, or the server stops).
  bool ShouldCloseAfterResponse() {
    Connection* c = current_connection;
    if (c == nullptr) return false;
    absl::MutexLock lock(&mu_);
    MaybeCloseLocked(c);
    return c->closing;
  }
  // After the response is written.
  void RequestFinished() {
    Connection* c = current_connection;
    if (c == nullptr) return;
    absl::MutexLock lock(&mu_);
    c->in_request = false;
    c->idle_since = absl::Now();
    MaybeCloseLocked(c);
    if (c->closing) ::shutdown(c->fd, SHUT_RDWR);
  }

 private:
  struct Job {
    std::function<void()> fn;
    std::shared_ptr<Connection> conn;  // null when the socket was not found
  };

  // Connections queued that no worker is free to take (a worker whose
  // connection is already closing counts as free: it is about to be).
  bool StarvedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    size_t closing = 0;
    for (const auto& [inode, c] : conns_) closing += c->running && c->closing ? 1 : 0;
    return busy_ - closing + jobs_.size() > threads_.size();
  }

  // Marks `c` to end after its response when the server stops or
  // connections wait for a worker.
  void MaybeCloseLocked(Connection* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (c->closing) return;
    if (stopping_) {
      c->closing = true;
    } else if (StarvedLocked()) {
      c->closing = true;
      Metrics().idle_closed.Increment();
    }
  }

  // The accepted socket: a TCP socket on our port with a peer, not known yet.
  // The accept thread is the only one adding connections, so at most one
  // such socket is new; of several (a failed earlier lookup) the newest inode wins.
  std::shared_ptr<Connection> Adopt() {
    std::set<ino_t> known;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [inode, c] : conns_) known.insert(inode);
    }
    DIR* dir = opendir("/proc/self/fd");
    if (dir == nullptr) return nullptr;
    int best_fd = -1;
    ino_t best_inode = 0;
    const int self = dirfd(dir);
    while (dirent* e = readdir(dir)) {
      if (e->d_name[0] == '.') continue;
      const int fd = std::atoi(e->d_name);
      if (fd == self) continue;
      const ino_t inode = SocketInode(fd);
      if (inode == 0 || inode <= best_inode || known.count(inode) != 0) continue;
      if (LocalPort(fd) != port_ || !HasPeer(fd)) continue;
      best_fd = fd;
      best_inode = inode;
    }
    closedir(dir);
    if (best_fd < 0) return nullptr;
    auto conn = std::make_shared<Connection>();
    conn->fd = fcntl(best_fd, F_DUPFD_CLOEXEC, 0);
    if (conn->fd < 0) return nullptr;
    conn->inode = best_inode;
    conn->idle_since = absl::Now();
    absl::MutexLock lock(&mu_);
    conns_[best_inode] = conn;
    return conn;
  }

  // Closes the longest-idle connection between requests (all of them when
  // `all`) whose socket holds no unread request bytes.
  void CloseIdleLocked(bool all) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Connection*> idle;
    for (const auto& [inode, c] : conns_) {
      if (!c->running || c->in_request || c->closing) continue;
      int unread = 0;
      if (ioctl(c->fd, FIONREAD, &unread) == 0 && unread > 0) continue;  // a request arriving
      idle.push_back(c.get());
    }
    std::sort(idle.begin(), idle.end(),
              [](const Connection* a, const Connection* b) { return a->idle_since < b->idle_since; });
    for (Connection* c : idle) {
      c->closing = true;
      ::shutdown(c->fd, SHUT_RDWR);
      if (!all) {
        Metrics().idle_closed.Increment();
        return;
      }
    }
  }

  void Work() {
    for (;;) {
      Job job;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](ConnectionPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
              return !p->jobs_.empty() || p->stopping_;
            },
            this));
        if (jobs_.empty()) return;  // stopping, nothing queued
        job = std::move(jobs_.front());
        jobs_.pop_front();
        ++busy_;
        if (job.conn != nullptr) {
          job.conn->running = true;
          job.conn->idle_since = absl::Now();
          if (stopping_) {
            job.conn->closing = true;
            ::shutdown(job.conn->fd, SHUT_RDWR);
          }
        }
      }
      current_connection = job.conn.get();
      job.fn();  // serves the connection until httplib closes it
      current_connection = nullptr;
      absl::MutexLock lock(&mu_);
      --busy_;
      if (job.conn != nullptr) {
        conns_.erase(job.conn->inode);
        close(job.conn->fd);
      }
    }
  }

  const int port_;
  std::vector<std::thread> threads_;
  absl::Mutex mu_;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<ino_t, std::shared_ptr<Connection>> conns_ ABSL_GUARDED_BY(mu_);
  size_t busy_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

struct HttpServer::Impl {
  HttpServerOptions options;
  const ChatPipeline* pipeline = nullptr;
  const ApiKeys* api_keys = nullptr;
  int64_t created = 0;  // /v1/models "created": the server's start
  // Before `http`: destroyed after it, when no request (and so no Watch) is left.
  ConnectionWatcher watcher;
  httplib::Server http;
  std::thread thread;
  int port = 0;                     // as bound, before the pool is made
  ConnectionPool* pool = nullptr;   // owned by `http` while it listens

  // Requests running (chat only) and their cancellations, for Stop().
  absl::Mutex mu;
  std::set<Cancellation*> running ABSL_GUARDED_BY(mu);
  bool stopped ABSL_GUARDED_BY(mu) = false;

  void Track(Cancellation* c) {
    absl::MutexLock lock(&mu);
    running.insert(c);
  }
  void Untrack(Cancellation* c) {
    absl::MutexLock lock(&mu);
    running.erase(c);
  }

  bool Authorized(const httplib::Request& req, httplib::Response& res) const {
    if (api_keys == nullptr) return true;
    absl::Status s = api_keys->CheckAuthorization(req.get_header_value("Authorization"));
    if (s.ok()) return true;
    SendError(res, ApiErrorFromStatus(grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                                                   std::string(s.message()))));
    res.set_header("WWW-Authenticate", "Bearer");
    return false;
  }

  // Watches the request's connection and cancels `cancellation` when the
  // client closes or resets it; a connection already reset is cancelled at
  // once. Null when there is nothing (more) to watch.
  std::unique_ptr<ConnectionWatcher::Watch> WatchClient(const httplib::Request& req,
                                                        Cancellation* cancellation) {
    absl::StatusOr<int> fd =
        FindConnectionSocket(req.local_addr, req.local_port, req.remote_addr, req.remote_port);
    if (fd.ok()) {
      absl::StatusOr<std::unique_ptr<ConnectionWatcher::Watch>> watch =
          watcher.Add(*fd, [cancellation] {
            if (!cancellation->cancelled()) Metrics().client_gone.Increment();
            cancellation->Cancel();
          });
      if (watch.ok()) return *std::move(watch);
      fd = watch.status();
    }
    // This handler's socket is open, so only a reset hides its peer's address:
    // httplib's getpeername failed (remote_port -1, the reset came before the
    // request was parsed) or no open socket has the address pair any more.
    if (req.remote_port < 0 || fd.status().code() == absl::StatusCode::kNotFound) {
      Metrics().client_gone.Increment();
      cancellation->Cancel();
      return nullptr;
    }
    Metrics().unwatched.Increment();
    Log(LogLevel::kWarning, "gateway", "connection not watched",
        {{"error", fd.status().ToString()}});
    return nullptr;
  }

  std::optional<ApiError> FetchRemoteImages(OpenAiChatRequest* parsed) const;
  void Chat(const httplib::Request& req, httplib::Response& res);
  void Install();
};

std::optional<ApiError> HttpServer::Impl::FetchRemoteImages(OpenAiChatRequest* parsed) const {
  RemoteImageOptions fetch;
  fetch.max_bytes = options.max_remote_image_bytes;
  fetch.timeout = std::min(options.remote_image_timeout, pipeline->options().default_deadline);
  fetch.max_images = pipeline->options().limits.max_images_per_request;
  return vlm::gateway::FetchRemoteImages(fetch, parsed);
}

void HttpServer::Impl::Chat(const httplib::Request& req, httplib::Response& res) {
  if (!Authorized(req, res)) return;
  OpenAiChatRequest parsed;
  ParseOptions parse;
  parse.served_model_name = options.served_model_name;
  parse.allow_remote_images = options.allow_remote_images;
  if (auto e = ParseChatCompletionRequest(req.body, parse, &parsed)) return SendError(res, *e);
  if (auto e = FetchRemoteImages(&parsed)) return SendError(res, *e);

  const std::string id = NewCompletionId();
  parsed.request.set_request_id(id);
  res.set_header("X-Request-Id", id);
  auto format = std::make_shared<ChunkFormatter>(
      absl::StrCat("chatcmpl-", id), absl::ToUnixSeconds(absl::Now()), parsed.model,
      parsed.logprobs, parsed.include_usage);
  format->set_tool_calls(parsed.tool_calls);

  if (!parsed.stream) {
    // Nothing is written until the end, so only the watch notices a client
    // that leaves: it cancels the generation and frees the slots.
    Cancellation cancellation;
    const std::unique_ptr<ConnectionWatcher::Watch> watch = WatchClient(req, &cancellation);
    Track(&cancellation);
    ChatCall call;
    call.front_end = "http";
    call.cancellation = &cancellation;
    v1::ChatResponse response;
    CollectingSink sink(&response);
    const grpc::Status status = pipeline->Run(call, parsed.request, &sink);
    Untrack(&cancellation);
    if (!status.ok()) return SendError(res, ApiErrorFromStatus(status, &parsed.request));
    res.set_content(format->Completion(response), kJson);
    return;
  }

  // Streaming: the pipeline runs on its own thread; this one waits for the
  // first event (commit to SSE) or an early error (a plain error response).
  auto stream = std::make_shared<SseStream>();
  // A client that leaves is noticed at once, also before the first event
  // and during a long prefill, when nothing is written.
  stream->watch = WatchClient(req, &stream->cancellation);
  Track(&stream->cancellation);
  // The request, to name an image's param in errors; its image bytes go to the pipeline.
  auto request = std::make_shared<const v1::ChatRequest>(std::move(parsed.request));
  stream->worker = std::thread([this, stream, format, request] {
    SseSink sink(stream.get(), format.get());
    ChatCall call;
    call.front_end = "http_stream";
    call.cancellation = &stream->cancellation;
    grpc::Status status = pipeline->Run(call, *request, &sink);
    absl::MutexLock lock(&stream->mu);
    stream->status = std::move(status);
    stream->finished = true;
  });
  bool early_error = false;
  grpc::Status status;
  {
    absl::MutexLock lock(&stream->mu);
    stream->mu.Await(absl::Condition(
        +[](SseStream* s) ABSL_SHARED_LOCKS_REQUIRED(s->mu) { return !s->events.empty() || s->finished; },
        stream.get()));
    early_error = stream->events.empty();
    status = stream->status;
  }
  if (early_error) {
    stream->worker.join();
    stream->watch.reset();
    Untrack(&stream->cancellation);
    return SendError(res, ApiErrorFromStatus(status, request.get()));
  }

  Metrics().sse_open.Increment();
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [stream, request](size_t, httplib::DataSink& sink) {
        std::deque<std::string> batch;
        bool done = false;
        grpc::Status final_status;
        {
          absl::MutexLock lock(&stream->mu);
          stream->mu.AwaitWithTimeout(
              absl::Condition(
                  +[](SseStream* s) ABSL_SHARED_LOCKS_REQUIRED(s->mu) {
                    return !s->events.empty() || s->finished;
                  },
                  stream.get()),
              absl::Seconds(10));
          batch.swap(stream->events);
          done = stream->finished;
          final_status = stream->status;
        }
        // A comment line while nothing happens (a long prefill): SSE clients
        // ignore it, and a failed write shows that the client left.
        if (batch.empty() && !done) batch.push_back(": keep-alive\n\n");
        if (done) {
          if (!final_status.ok()) {
            batch.push_back(SseEvent(ErrorJson(ApiErrorFromStatus(final_status, request.get()))));
          }
          batch.push_back("data: [DONE]\n\n");
        }
        for (const std::string& event : batch) {
          if (!sink.write(event.data(), event.size())) {
            stream->cancellation.Cancel();
            return false;
          }
        }
        if (done) sink.done();
        return true;
      },
      [this, stream](bool success) {
        if (!success) stream->cancellation.Cancel();
        if (stream->worker.joinable()) stream->worker.join();
        // Before httplib shuts the socket down or reads the next request.
        stream->watch.reset();
        Untrack(&stream->cancellation);
        Metrics().sse_open.Decrement();
      });
}

void HttpServer::Impl::Install() {
  http.new_task_queue = [this] {
    pool = new ConnectionPool(options.threads, port);
    return pool;
  };
  // Keep-alive (see http_server.h). httplib waits the same timeout for a new
  // connection's first request; without keep-alive that wait stays 5 s.
  const int64_t keep_alive_s = absl::ToInt64Seconds(options.keep_alive);
  http.set_keep_alive_timeout(keep_alive_s > 0 ? keep_alive_s : 5);
  http.set_keep_alive_max_count(
      keep_alive_s > 0 ? static_cast<size_t>(std::max(1, options.keep_alive_max_requests)) : 1);
  // A request's head is read: the connection is busy until its response ends.
  http.set_pre_routing_handler([this](const httplib::Request&, httplib::Response&) {
    if (pool != nullptr) pool->RequestStarted();
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Connections wait for a worker, or the server stops: this response ends its connection.
  http.set_post_routing_handler([this](const httplib::Request&, httplib::Response& res) {
    if (pool == nullptr || !pool->ShouldCloseAfterResponse()) return;
    res.headers.erase("Keep-Alive");
    if (!res.has_header("Connection")) res.set_header("Connection", "close");
  });
  // As for /metrics: no SO_REUSEPORT, so two processes cannot share a port silently.
  http.set_socket_options([](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // Small writes (SSE events, short answers) go out at once, not after the
  // peer's delayed ACK (about 40 ms per response without it).
  http.set_tcp_nodelay(true);
  http.set_payload_max_length(static_cast<size_t>(options.max_body_bytes));
  // A 50 MB upload over a slow link must not be cut by the 5 s default.
  http.set_read_timeout(60, 0);

  http.Post(kChatRoute, [this](const httplib::Request& req, httplib::Response& res) {
    Chat(req, res);
  });
  http.Get(kModelsRoute, [this](const httplib::Request& req, httplib::Response& res) {
    if (!Authorized(req, res)) return;
    nlohmann::json model = {{"id", options.served_model_name},
                            {"object", "model"},
                            {"created", created},
                            {"owned_by", "vlm"}};
    res.set_content(DumpJson({{"object", "list"}, {"data", nlohmann::json::array({model})}}),
                    kJson);
  });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    absl::Status s = pipeline->readiness()->Check(ChatPipeline::kServiceName);
    if (s.ok()) {
      res.set_content("{\"status\":\"SERVING\"}", kJson);
    } else {
      res.status = 503;
      res.set_content(DumpJson({{"status", "NOT_SERVING"}, {"reason", s.message()}}), kJson);
    }
  });
  http.Get("/favicon.ico", [](const httplib::Request&, httplib::Response& res) { res.status = 204; });
  http.Get(R"(/|/[A-Za-z0-9_.-]+\.(js|css|html))",
           [](const httplib::Request& req, httplib::Response& res) {
             const WebAsset* asset = FindWebAsset(req.path == "/" ? "/index.html" : req.path);
             if (asset == nullptr) {
               res.status = 404;
               return;
             }
             res.set_header("Cache-Control", "no-cache");
             res.set_content(std::string(asset->body), std::string(asset->content_type).c_str());
           });

  // Statuses httplib sets itself (404 no route, 413 too large, 400 bad
  // request line ...) get an OpenAI error body too.
  http.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty() || res.status == 204) return;
    ApiError e;
    switch (res.status) {
      case 413:
        e.code = grpc::StatusCode::INVALID_ARGUMENT;
        e.message = absl::StrCat("the request body is larger than ", options.max_body_bytes,
                                 " bytes (--max_http_body_bytes)");
        e.error_code = "request_too_large";
        break;
      case 404:
        e.code = grpc::StatusCode::NOT_FOUND;
        e.message = absl::StrCat("no route ", req.method, " ", req.path);
        break;
      case 405:
        e.code = grpc::StatusCode::INVALID_ARGUMENT;
        e.message = absl::StrCat("method ", req.method, " not allowed on ", req.path);
        break;
      default:
        e.code = res.status < 500 ? grpc::StatusCode::INVALID_ARGUMENT : grpc::StatusCode::INTERNAL;
        e.message = absl::StrCat("HTTP ", res.status);
    }
    res.set_content(ErrorJson(e), kJson);
  });

  http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    HttpMetrics& m = Metrics();
    const std::string route = RouteLabel(req.path);
    m.requests.Add({{"route", route}, {"status", std::to_string(res.status)}}).Increment();
    // Called once the response is written: the connection is idle again.
    if (pool != nullptr) pool->RequestFinished();
  });
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl, std::string host, int port)
    : impl_(std::move(impl)), host_(std::move(host)), port_(port) {}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(HttpServerOptions options,
                                                              const ChatPipeline* pipeline,
                                                              const ApiKeys* api_keys) {
  absl::StatusOr<std::pair<std::string, int>> host_port = ParseHostPort(options.address);
  if (!host_port.ok()) return host_port.status();
  auto [host, port] = *host_port;
  Metrics();

  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  impl->pipeline = pipeline;
  impl->api_keys = api_keys;
  impl->created = absl::ToUnixSeconds(absl::Now());
  impl->Install();
  httplib::Server& http = impl->http;
  if (port == 0) {
    port = http.bind_to_any_port(host);
  } else if (!http.bind_to_port(host, port)) {
    port = -1;
  }
  if (port <= 0) {
    return absl::UnavailableError(absl::StrCat("HTTP server cannot bind ", impl->options.address,
                                               " (address in use or not local?)"));
  }
  impl->port = port;
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->http.listen_after_bind(); });
  for (int i = 0; i < 5000 && !http.is_running(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl), host, port));
}

HttpServer::~HttpServer() { Stop(absl::ZeroDuration()); }

void HttpServer::Stop(absl::Duration grace) {
  if (impl_ == nullptr) return;
  {
    absl::MutexLock lock(&impl_->mu);
    if (impl_->stopped) return;
    impl_->stopped = true;
    impl_->mu.AwaitWithTimeout(absl::Condition(
                                   +[](Impl* i) ABSL_SHARED_LOCKS_REQUIRED(i->mu) {
                                     return i->running.empty();
                                   },
                                   impl_.get()),
                               grace);
    for (Cancellation* c : impl_->running) c->Cancel();
  }
  impl_->http.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

std::string HttpServer::address() const {
  return host_.find(':') != std::string::npos ? absl::StrCat("[", host_, "]:", port_)
                                              : absl::StrCat(host_, ":", port_);
}

}  // namespace vlm::gateway
