// Keep-alive connections of the gateway's HTTP front end (vlm-gateway as a
// child process on loopback; no backends needed: /v1/models and a malformed
// chat body are answered by the gateway itself), over raw sockets so that
// every connection is exactly the one the test means:
//   - a connection idle longer than httplib's old 5 s timeout still serves
//     (and every response carries the Keep-Alive hint);
//   - the 1000th request of a connection says Connection: close;
//   - --http_threads idle connections do not starve a new one: the longest-idle
//     is closed and the new request is answered at once;
//   - a response finished while a connection waits for a worker says
//     Connection: close and frees the worker;
//   - SIGTERM does not wait for idle connections.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/integration/service_process.h"

namespace vlm {
namespace {

using testing::ServiceProcess;

constexpr char kGetModels[] = "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";

// One client connection; every read is bounded by `timeout`.
class Conn {
 public:
  Conn(int port, absl::Duration timeout = absl::Seconds(3)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    timeval tv{static_cast<time_t>(absl::ToInt64Seconds(timeout)), 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~Conn() { ::close(fd_); }
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;

  bool connected() const { return connected_; }
  bool Send(const std::string& s) {
    return ::send(fd_, s.data(), s.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(s.size());
  }
  // The next whole response (head and Content-Length body), or "" when the
  // connection ends or nothing comes within the timeout; `why` says which.
  std::string ReadResponse(std::string* why = nullptr) {
    for (;;) {
      const size_t head_end = buf_.find("\r\n\r\n");
      if (head_end != std::string::npos) {
        const std::string head = buf_.substr(0, head_end + 4);
        size_t length = 0;
        const size_t cl = Lower(head).find("content-length:");
        if (cl != std::string::npos) {
          const size_t eol = head.find("\r\n", cl);
          std::string v = head.substr(cl + 15, eol - cl - 15);
          (void)absl::SimpleAtoi(absl::StripAsciiWhitespace(v), &length);
        }
        if (buf_.size() >= head.size() + length) {
          std::string response = buf_.substr(0, head.size() + length);
          buf_.erase(0, response.size());
          return response;
        }
      }
      char chunk[4096];
      const ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
      if (n <= 0) {
        if (why != nullptr) *why = n == 0 ? "closed" : absl::StrCat("recv: ", std::strerror(errno));
        return "";
      }
      buf_.append(chunk, static_cast<size_t>(n));
    }
  }
  std::string Request(const std::string& request, std::string* why = nullptr) {
    if (!Send(request)) {
      if (why != nullptr) *why = "send failed";
      return "";
    }
    return ReadResponse(why);
  }
  // True when the server has closed the connection (EOF or reset within `wait`).
  bool ClosedByServer(absl::Duration wait) {
    timeval tv{0, static_cast<suseconds_t>(absl::ToInt64Microseconds(wait))};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char c;
    const ssize_t n = ::recv(fd_, &c, 1, 0);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
  }

  static std::string Lower(std::string s) {
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
  std::string buf_;
};

bool Is200(const std::string& response) { return absl::StartsWith(response, "HTTP/1.1 200 "); }
bool SaysClose(const std::string& response) {
  return absl::StrContains(Conn::Lower(response), "\r\nconnection: close\r\n");
}

// A gateway whose backends do not exist (127.0.0.1:1): its HTTP front end
// serves /v1/models and answers malformed chat bodies with 400 by itself.
class Gateway {
 public:
  explicit Gateway(std::vector<std::string> extra, const std::string& name) {
    std::vector<std::string> flags = {"--grpc_address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                                      "--http_address=127.0.0.1:0", "--language_target=127.0.0.1:1",
                                      "--vision_targets=127.0.0.1:1", "--drain_timeout_s=1"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    process_.emplace(VLM_GATEWAY_PATH, flags, testing::TestLogDir("http_keepalive_test") + "/" + name);
    testing::Eventually(
        [&] { return process_->Exited() || testing::GatewayHttpPort(process_->Stdout()) > 0; },
        absl::Seconds(30));
    port = testing::GatewayHttpPort(process_->Stdout());
  }
  ServiceProcess& process() { return *process_; }
  int port = 0;

 private:
  std::optional<ServiceProcess> process_;
};

TEST(HttpKeepAliveTest, IdleLongerThanFiveSecondsThenTheSameConnectionServes) {
  Gateway gw({}, "idle_gap");
  ASSERT_GT(gw.port, 0);
  Conn conn(gw.port);
  ASSERT_TRUE(conn.connected());
  std::string why;
  const std::string first = conn.Request(kGetModels, &why);
  ASSERT_TRUE(Is200(first)) << why << first;
  // The hint lets clients drop the socket before the server does.
  EXPECT_TRUE(absl::StrContains(first, "\r\nKeep-Alive: timeout=75, max=1000\r\n")) << first;
  EXPECT_FALSE(SaysClose(first)) << first;
  absl::SleepFor(absl::Seconds(6));  // httplib's default closed the connection after 5 s
  const std::string second = conn.Request(kGetModels, &why);
  EXPECT_TRUE(Is200(second)) << "the idle connection was closed: " << why;
}

TEST(HttpKeepAliveTest, TheLastRequestOfAConnectionSaysConnectionClose) {
  Gateway gw({}, "max_count");
  ASSERT_GT(gw.port, 0);
  Conn conn(gw.port);
  ASSERT_TRUE(conn.connected());
  std::string why;
  for (int i = 1; i <= 1000; ++i) {
    const std::string r = conn.Request(kGetModels, &why);
    ASSERT_TRUE(Is200(r)) << "request " << i << ": " << why;
    ASSERT_EQ(SaysClose(r), i == 1000) << "request " << i << ": " << r;
  }
  EXPECT_TRUE(conn.ClosedByServer(absl::Seconds(2)));
}

TEST(HttpKeepAliveTest, IdleConnectionsOnEveryWorkerDoNotStarveANewOne) {
  constexpr int kThreads = 4;
  Gateway gw({absl::StrCat("--http_threads=", kThreads)}, "starvation");
  ASSERT_GT(gw.port, 0);
  std::vector<std::unique_ptr<Conn>> idle;
  for (int i = 0; i < kThreads; ++i) {
    idle.push_back(std::make_unique<Conn>(gw.port));
    ASSERT_TRUE(Is200(idle.back()->Request(kGetModels))) << "connection " << i;
    absl::SleepFor(absl::Milliseconds(20));  // a distinct idle age each
  }
  // Every worker holds an idle connection. The new one is served at once (its
  // read times out after 3 s, well below the old 5 s wait and the 75 s timeout).
  Conn fresh(gw.port, absl::Seconds(3));
  std::string why;
  EXPECT_TRUE(Is200(fresh.Request(kGetModels, &why))) << "the new connection was starved: " << why;
  // The longest-idle connection gave its worker away; the others still serve.
  EXPECT_TRUE(idle[0]->ClosedByServer(absl::Seconds(1)));
  for (int i = 1; i < kThreads; ++i) {
    EXPECT_FALSE(idle[i]->ClosedByServer(absl::Milliseconds(50))) << "connection " << i;
  }
  // Fresh connections keep coming: each one takes an idle connection's worker.
  for (int i = 0; i < 2 * kThreads; ++i) {
    Conn another(gw.port, absl::Seconds(3));
    EXPECT_TRUE(Is200(another.Request(kGetModels, &why))) << "connection " << i << ": " << why;
  }
}

TEST(HttpKeepAliveTest, AResponseFinishedWhileAConnectionWaitsClosesItsConnection) {
  Gateway gw({"--http_threads=1"}, "busy_worker");
  ASSERT_GT(gw.port, 0);
  // The only worker is inside a request: its head is read, its body withheld.
  const std::string body = "{not json";
  Conn busy(gw.port);
  ASSERT_TRUE(busy.Send(absl::StrCat("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                                     "Content-Type: application/json\r\nContent-Length: ",
                                     body.size(), "\r\n\r\n", body.substr(0, 3))));
  absl::SleepFor(absl::Milliseconds(300));
  // A new connection waits for the worker: no idle connection to close.
  Conn waiting(gw.port, absl::Seconds(5));
  ASSERT_TRUE(waiting.Send(kGetModels));
  absl::SleepFor(absl::Milliseconds(300));
  // The request completes; its response ends the connection so the waiting one is served.
  ASSERT_TRUE(busy.Send(body.substr(3)));
  std::string why;
  const std::string answer = busy.ReadResponse(&why);
  EXPECT_TRUE(absl::StartsWith(answer, "HTTP/1.1 400 ")) << why << answer;
  EXPECT_TRUE(SaysClose(answer)) << answer;
  EXPECT_TRUE(busy.ClosedByServer(absl::Seconds(2)));
  EXPECT_TRUE(Is200(waiting.ReadResponse(&why))) << why;
}

TEST(HttpKeepAliveTest, SigtermDoesNotWaitForIdleConnections) {
  Gateway gw({}, "sigterm");
  ASSERT_GT(gw.port, 0);
  Conn idle(gw.port);
  ASSERT_TRUE(Is200(idle.Request(kGetModels)));
  Conn never_used(gw.port);
  ASSERT_TRUE(never_used.connected());
  absl::SleepFor(absl::Milliseconds(100));
  // Drain window 1 s; the idle connections would otherwise hold the HTTP
  // server for their 75 s keep-alive.
  const std::optional<int> code = gw.process().Stop(SIGTERM, absl::Seconds(20));
  ASSERT_TRUE(code.has_value()) << "the gateway did not exit within 20 s";
  EXPECT_EQ(*code, 0);
  EXPECT_TRUE(idle.ClosedByServer(absl::Seconds(1)));
}

}  // namespace
}  // namespace vlm
