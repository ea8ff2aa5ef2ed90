// The gateway's request-lifecycle primitives: Cancellation (a callback that
// never runs on a destroyed object) and the connection watch (a vanished HTTP
// client's socket found in the process and noticed by poll).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "services/gateway/chat_pipeline.h"
#include "services/gateway/connection_watch.h"

namespace vlm::gateway {
namespace {

// --- Cancellation -------------------------------------------------------------

// What a registered callback points at (the pipeline's grpc::ClientContext).
struct Target {
  explicit Target(std::atomic<bool>* alive) : alive(alive) { alive->store(true); }
  ~Target() { alive->store(false); }
  std::atomic<bool>* alive;
  int pokes = 0;
};

TEST(CancellationTest, CancelRacingUnregisterNeverTouchesADestroyedObject) {
  // The pipeline's pattern: Register a callback on an object, Unregister, then
  // destroy the object, while another thread cancels. With an Unregister that
  // does not wait for a running callback, the callback sleeping below outlives
  // its target in nearly every iteration (ASan: heap-use-after-free).
  std::atomic<int> violations{0};
  std::atomic<int> ran{0};
  for (int i = 0; i < 300; ++i) {
    Cancellation cancellation;
    std::atomic<bool> alive{false};
    auto target = std::make_unique<Target>(&alive);
    Target* raw = target.get();
    const absl::Duration work = absl::Microseconds(i % 3 == 0 ? 0 : 200);
    cancellation.Register([raw, work, &alive, &violations, &ran] {
      absl::SleepFor(work);
      if (!alive.load()) {
        ++violations;
        return;  // do not write into freed memory in a build without ASan
      }
      ++raw->pokes;
      ++ran;
    });
    std::thread canceller([&] { cancellation.Cancel(); });
    // Mostly while the callback runs: once cancelled() is true, Cancel is in it.
    if (i % 2 == 0) {
      while (!cancellation.cancelled()) std::this_thread::yield();
    }
    cancellation.Unregister();
    target.reset();
    canceller.join();
  }
  EXPECT_EQ(violations.load(), 0);
  EXPECT_GT(ran.load(), 0);
}

TEST(CancellationTest, UnregisterWaitsForARunningCallback) {
  Cancellation cancellation;
  absl::Notification started;
  absl::Notification release;
  std::atomic<bool> callback_done{false};
  cancellation.Register([&] {
    started.Notify();
    release.WaitForNotification();
    callback_done.store(true);
  });
  std::thread canceller([&] { cancellation.Cancel(); });
  started.WaitForNotification();
  std::atomic<bool> unregistered{false};
  std::thread unregisterer([&] {
    cancellation.Unregister();
    unregistered.store(true);
    EXPECT_TRUE(callback_done.load());
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(unregistered.load()) << "Unregister returned while the callback ran";
  release.Notify();
  unregisterer.join();
  canceller.join();
  EXPECT_TRUE(unregistered.load());
}

TEST(CancellationTest, RegisterAfterCancelRunsAtOnceOnTheRegisteringThread) {
  Cancellation cancellation;
  cancellation.Cancel();
  std::thread::id where;
  cancellation.Register([&] { where = std::this_thread::get_id(); });
  EXPECT_EQ(where, std::this_thread::get_id());
  // It is not kept: a second Cancel runs nothing, Unregister returns at once.
  int calls = 0;
  cancellation.Register([&] { ++calls; });
  EXPECT_EQ(calls, 1);
  cancellation.Cancel();
  EXPECT_EQ(calls, 1);
  cancellation.Unregister();
}

TEST(CancellationTest, ManyCancellersRunTheCallbackOnce) {
  for (int i = 0; i < 50; ++i) {
    Cancellation cancellation;
    std::atomic<int> calls{0};
    cancellation.Register([&] { ++calls; });
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) threads.emplace_back([&] { cancellation.Cancel(); });
    for (std::thread& t : threads) t.join();
    cancellation.Unregister();
    EXPECT_EQ(calls.load(), 1);
  }
}

// --- connection watch ------------------------------------------------------------

class Loopback {
 public:
  Loopback() {
    listener_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    EXPECT_EQ(bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(listener_, 16), 0);
    socklen_t length = sizeof(addr);
    getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &length);
    port_ = ntohs(addr.sin_port);
  }
  ~Loopback() { close(listener_); }

  // A connected pair: {client fd, accepted server fd}; client port in *client_port.
  std::pair<int, int> Connect(int* client_port) {
    const int client = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port_));
    EXPECT_EQ(connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    socklen_t length = sizeof(addr);
    getsockname(client, reinterpret_cast<sockaddr*>(&addr), &length);
    *client_port = ntohs(addr.sin_port);
    const int server = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    EXPECT_GE(server, 0);
    return {client, server};
  }

  int port() const { return port_; }

 private:
  int listener_ = -1;
  int port_ = 0;
};

// Closes with an RST, as a killed client or a proxy giving up does.
void ResetClose(int fd) {
  linger l{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  close(fd);
}

bool WaitFor(const std::atomic<int>& value, int expected, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (value.load() != expected && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(2));
  return value.load() == expected;
}

TEST(ConnectionWatchTest, FindsExactlyTheAcceptedSocketOfAnAddressPair) {
  Loopback loopback;
  int port_a = 0;
  int port_b = 0;
  auto [client_a, server_a] = loopback.Connect(&port_a);
  auto [client_b, server_b] = loopback.Connect(&port_b);
  EXPECT_EQ(FindConnectionSocket("127.0.0.1", loopback.port(), "127.0.0.1", port_a).value_or(-1),
            server_a);
  EXPECT_EQ(FindConnectionSocket("127.0.0.1", loopback.port(), "127.0.0.1", port_b).value_or(-1),
            server_b);
  // The client ends are the mirror image; an unknown peer or local address is none.
  EXPECT_EQ(FindConnectionSocket("127.0.0.1", port_a, "127.0.0.1", loopback.port()).value_or(-1),
            client_a);
  EXPECT_EQ(FindConnectionSocket("127.0.0.1", loopback.port(), "127.0.0.1", 1).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(FindConnectionSocket("127.0.0.2", loopback.port(), "127.0.0.1", port_a).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(FindConnectionSocket("127.0.0.1", -1, "", -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (int fd : {client_a, server_a, client_b, server_b}) close(fd);
}

TEST(ConnectionWatchTest, FiresOnResetAndOnCloseButNotOnDataOrSilence) {
  Loopback loopback;
  ConnectionWatcher watcher;
  int port = 0;
  auto [reset_client, reset_server] = loopback.Connect(&port);
  auto [fin_client, fin_server] = loopback.Connect(&port);
  auto [quiet_client, quiet_server] = loopback.Connect(&port);
  std::atomic<int> reset{0};
  std::atomic<int> fin{0};
  std::atomic<int> quiet{0};
  auto w1 = watcher.Add(reset_server, [&] { ++reset; });
  auto w2 = watcher.Add(fin_server, [&] { ++fin; });
  auto w3 = watcher.Add(quiet_server, [&] { ++quiet; });
  ASSERT_TRUE(w1.ok() && w2.ok() && w3.ok());
  EXPECT_EQ(watcher.watching(), 3);
  // A pipelined next request is data, not a close.
  ASSERT_EQ(write(quiet_client, "GET / HTTP/1.1\r\n\r\n", 18), 18);
  ResetClose(reset_client);
  close(fin_client);
  EXPECT_TRUE(WaitFor(reset, 1, absl::Seconds(5)));
  EXPECT_TRUE(WaitFor(fin, 1, absl::Seconds(5)));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(reset.load(), 1);  // once
  EXPECT_EQ(quiet.load(), 0);
  EXPECT_EQ(watcher.watching(), 1);
  w1->reset();
  w2->reset();
  w3->reset();
  EXPECT_EQ(watcher.watching(), 0);
  for (int fd : {reset_server, fin_server, quiet_client, quiet_server}) close(fd);
}

TEST(ConnectionWatchTest, WatchesItsOwnDuplicateAfterTheOwnerClosedTheSocket) {
  Loopback loopback;
  ConnectionWatcher watcher;
  int port = 0;
  auto [client, server] = loopback.Connect(&port);
  std::atomic<int> fired{0};
  auto watch = watcher.Add(server, [&] { ++fired; });
  ASSERT_TRUE(watch.ok());
  close(server);  // the server's number may now be reused; the watch is unaffected
  ResetClose(client);
  EXPECT_TRUE(WaitFor(fired, 1, absl::Seconds(5)));
  EXPECT_EQ(watcher.Add(-1, [] {}).status().code(), absl::StatusCode::kUnavailable);
}

TEST(ConnectionWatchTest, EndingAWatchWaitsForItsRunningCallback) {
  Loopback loopback;
  ConnectionWatcher watcher;
  for (int i = 0; i < 20; ++i) {
    int port = 0;
    auto [client, server] = loopback.Connect(&port);
    std::atomic<bool> alive{false};
    auto target = std::make_unique<Target>(&alive);
    std::atomic<int> violations{0};
    std::atomic<int> started{0};
    Target* raw = target.get();
    auto watch = watcher.Add(server, [&, raw] {
      ++started;
      absl::SleepFor(absl::Milliseconds(5));
      if (!alive.load()) {
        ++violations;
        return;
      }
      ++raw->pokes;
    });
    ASSERT_TRUE(watch.ok());
    ResetClose(client);
    if (i % 2 == 0) WaitFor(started, 1, absl::Seconds(5));  // mostly mid-callback
    watch->reset();
    target.reset();
    EXPECT_EQ(violations.load(), 0);
    close(server);
  }
}

TEST(ConnectionWatchTest, ManyThreadsAddAndEndWatchesWhileClientsVanish) {
  Loopback loopback;
  ConnectionWatcher watcher;
  std::atomic<int> fired{0};
  std::atomic<int> vanished{0};
  std::vector<std::thread> threads;
  absl::Mutex accept_mu;  // Connect accepts the pending connection: one at a time
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 40; ++i) {
        int port = 0;
        std::pair<int, int> pair;
        {
          absl::MutexLock lock(&accept_mu);
          pair = loopback.Connect(&port);
        }
        auto [client, server] = pair;
        Cancellation cancellation;
        auto watch = watcher.Add(server, [&] {
          ++fired;
          cancellation.Cancel();
        });
        ASSERT_TRUE(watch.ok());
        if ((i + t) % 2 == 0) {
          ResetClose(client);
          ++vanished;
          const absl::Time deadline = absl::Now() + absl::Seconds(5);
          while (!cancellation.cancelled() && absl::Now() < deadline) std::this_thread::yield();
          EXPECT_TRUE(cancellation.cancelled());
          watch->reset();
        } else {
          watch->reset();  // the request ended first
          close(client);
        }
        close(server);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(fired.load(), vanished.load());
  EXPECT_EQ(watcher.watching(), 0);
}

}  // namespace
}  // namespace vlm::gateway
