// Noticing that an HTTP client went away while its request runs.
//
// cpp-httplib (0.11.4, Debian's) gives a handler no access to its connection,
// and a non-streamed response writes nothing until the end, so without help a
// vanished client's request runs to max_tokens or its deadline, holding an
// admission slot and a language sequence. Two pieces fix that:
//
//   FindConnectionSocket  finds the handler's own TCP socket in this process
//                         by its exact address pair (local addr:port, peer
//                         addr:port, which httplib does report): it walks
//                         /proc/self/fd and asks getsockname/getpeername of
//                         each entry. A TCP 4-tuple names at most one socket,
//                         so the match is exact. Cost: one readdir of
//                         /proc/self/fd plus about two syscalls per open fd
//                         (tens of microseconds for a few hundred fds).
//
//   ConnectionWatcher     one background thread that poll()s every watched
//                         socket for POLLRDHUP | POLLHUP | POLLERR: the peer
//                         closed (FIN), reset (RST) or the socket failed. It
//                         then runs the watch's callback once (e.g.
//                         Cancellation::Cancel).
//
// A watch polls a dup() of the socket, never the caller's descriptor number:
// the connection's owner may close its fd at any time without the watcher
// ever polling a recycled number. Only the watcher thread closes the dups.
// Data arriving on the socket (a pipelined next request) does not count as
// closing; a client that half-closes (shutdown(SHUT_WR)) after sending its
// request does, as most HTTP servers treat it.
//
// Lifetime: a Watch handle ends its watch on destruction; the destructor
// returns only once the callback is not running and will never run, so the
// callback may point at objects destroyed right after the Watch. A callback
// must not destroy its own Watch, and must be quick (it runs on the watcher
// thread, delaying every other watch). The watcher must outlive its Watches.
//
// Thread-safety: everything here may be called from any thread.
#ifndef VLM_SERVICES_GATEWAY_CONNECTION_WATCH_H_
#define VLM_SERVICES_GATEWAY_CONNECTION_WATCH_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace vlm::gateway {

// The descriptor (not owned, not duplicated) of this process's TCP socket
// whose local end is local_addr:local_port and whose peer is
// remote_addr:remote_port (numeric addresses as getnameinfo(NI_NUMERICHOST)
// writes them, as cpp-httplib's Request reports them). NOT_FOUND if none: for
// a connection known to be open (an HTTP handler's own), that means its peer
// reset it, since a reset socket has no peer address any more (ENOTCONN).
// INVALID_ARGUMENT if a port is unknown (<= 0).
absl::StatusOr<int> FindConnectionSocket(const std::string& local_addr, int local_port,
                                         const std::string& remote_addr, int remote_port);

class ConnectionWatcher {
 public:
  // Ends the watch on destruction (see the lifetime contract above). Move-only
  // through unique_ptr.
  class Watch {
   public:
    ~Watch();
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;

   private:
    friend class ConnectionWatcher;
    Watch(ConnectionWatcher* owner, uint64_t id) : owner_(owner), id_(id) {}
    ConnectionWatcher* const owner_;
    const uint64_t id_;
  };

  ConnectionWatcher();   // starts the watcher thread
  ~ConnectionWatcher();  // stops it; every Watch must be gone
  ConnectionWatcher(const ConnectionWatcher&) = delete;
  ConnectionWatcher& operator=(const ConnectionWatcher&) = delete;

  // Watches socket `fd` (duplicated at once; the caller keeps its own fd)
  // until the returned Watch is destroyed; `on_close` runs at most once, on
  // the watcher thread, when the peer closes or resets the connection.
  // Errors: the fd cannot be duplicated (EBADF, EMFILE).
  absl::StatusOr<std::unique_ptr<Watch>> Add(int fd, std::function<void()> on_close);

  // Connections being watched now (fired ones excluded).
  int watching() const;

 private:
  struct Entry {
    int fd = -1;  // the dup; closed by the watcher thread only
    std::function<void()> on_close;
    bool fired = false;    // the callback ran (or is running); fd closed after
    bool running = false;  // the callback is running now
  };

  void Remove(uint64_t id);
  void Loop();
  void Wake();

  mutable absl::Mutex mu_;
  absl::CondVar fired_cv_;  // an entry's callback returned
  std::map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::vector<int> to_close_ ABSL_GUARDED_BY(mu_);  // dups of removed watches
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int wake_fd_ = -1;  // eventfd: entries changed or stop
  std::thread thread_;
};

}  // namespace vlm::gateway

#endif  // VLM_SERVICES_GATEWAY_CONNECTION_WATCH_H_
