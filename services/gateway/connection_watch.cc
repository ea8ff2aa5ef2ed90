#include "services/gateway/connection_watch.h"

#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace vlm::gateway {
namespace {

// The numeric address and port of `addr` as cpp-httplib writes them
// (getnameinfo NI_NUMERICHOST); false for non-IP families.
bool NumericAddress(const sockaddr_storage& addr, socklen_t length, std::string* ip, int* port) {
  if (addr.ss_family == AF_INET) {
    *port = ntohs(reinterpret_cast<const sockaddr_in*>(&addr)->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    *port = ntohs(reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
  } else {
    return false;
  }
  std::array<char, NI_MAXHOST> host{};
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), length, host.data(),
                  static_cast<socklen_t>(host.size()), nullptr, 0, NI_NUMERICHOST) != 0) {
    return false;
  }
  *ip = host.data();
  return true;
}

// Whether `fd` is a TCP socket with exactly these two ends.
bool IsConnection(int fd, const std::string& local_addr, int local_port,
                  const std::string& remote_addr, int remote_port) {
  sockaddr_storage addr{};
  socklen_t length = sizeof(addr);
  // Cheapest test first: most descriptors are not sockets, or not on this port.
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) return false;
  if (addr.ss_family != AF_INET && addr.ss_family != AF_INET6) return false;
  const int port = ntohs(addr.ss_family == AF_INET
                             ? reinterpret_cast<const sockaddr_in*>(&addr)->sin_port
                             : reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_port);
  if (port != local_port) return false;
  int type = 0;
  socklen_t type_length = sizeof(type);
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_length) != 0 || type != SOCK_STREAM) {
    return false;
  }
  std::string ip;
  int ignored = 0;
  if (!NumericAddress(addr, length, &ip, &ignored) || ip != local_addr) return false;
  sockaddr_storage peer{};
  socklen_t peer_length = sizeof(peer);
  // A listening socket has no peer (ENOTCONN).
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_length) != 0) return false;
  int peer_port = 0;
  return NumericAddress(peer, peer_length, &ip, &peer_port) && peer_port == remote_port &&
         ip == remote_addr;
}

}  // namespace

absl::StatusOr<int> FindConnectionSocket(const std::string& local_addr, int local_port,
                                         const std::string& remote_addr, int remote_port) {
  if (local_port <= 0 || remote_port <= 0) {
    return absl::InvalidArgumentError("the connection's addresses are unknown");
  }
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot list /proc/self/fd: ", std::strerror(errno)));
  }
  const int own = dirfd(dir);
  int found = -1;
  while (dirent* entry = readdir(dir)) {
    int fd = -1;
    if (!absl::SimpleAtoi(entry->d_name, &fd) || fd == own) continue;
    if (IsConnection(fd, local_addr, local_port, remote_addr, remote_port)) {
      found = fd;
      break;
    }
  }
  closedir(dir);
  if (found < 0) {
    return absl::NotFoundError(absl::StrCat("no socket ", local_addr, ":", local_port, " <- ",
                                            remote_addr, ":", remote_port, " in this process"));
  }
  return found;
}

ConnectionWatcher::Watch::~Watch() { owner_->Remove(id_); }

ConnectionWatcher::ConnectionWatcher() {
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    // Without a wake-up descriptor the loop still works, polling every 50 ms.
    Log(LogLevel::kWarning, "gateway", "eventfd failed",
        {{"error", std::string(std::strerror(errno))}});
  }
  thread_ = std::thread([this] { Loop(); });
}

ConnectionWatcher::~ConnectionWatcher() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  Wake();
  thread_.join();
  absl::MutexLock lock(&mu_);
  for (int fd : to_close_) close(fd);
  for (auto& [id, entry] : entries_) {
    if (!entry.fired) close(entry.fd);
  }
  if (wake_fd_ >= 0) close(wake_fd_);
}

absl::StatusOr<std::unique_ptr<ConnectionWatcher::Watch>> ConnectionWatcher::Add(
    int fd, std::function<void()> on_close) {
  const int dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (dup < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot duplicate socket ", fd, ": ", std::strerror(errno)));
  }
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    id = next_id_++;
    Entry& entry = entries_[id];
    entry.fd = dup;
    entry.on_close = std::move(on_close);
  }
  Wake();
  return std::unique_ptr<Watch>(new Watch(this, id));
}

int ConnectionWatcher::watching() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [id, entry] : entries_) n += entry.fired ? 0 : 1;
  return n;
}

void ConnectionWatcher::Remove(uint64_t id) {
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end()) return;
    while (it->second.running) fired_cv_.Wait(&mu_);
    if (!it->second.fired) to_close_.push_back(it->second.fd);
    entries_.erase(it);
  }
  Wake();
}

void ConnectionWatcher::Wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
}

void ConnectionWatcher::Loop() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  while (true) {
    fds.clear();
    ids.clear();
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      // Closed here, never while a poll() may hold their numbers.
      for (int fd : to_close_) close(fd);
      to_close_.clear();
      if (wake_fd_ >= 0) fds.push_back({wake_fd_, POLLIN, 0});
      for (const auto& [id, entry] : entries_) {
        if (entry.fired) continue;
        fds.push_back({entry.fd, POLLRDHUP, 0});
        ids.push_back(id);
      }
    }
    const int n = poll(fds.data(), fds.size(), wake_fd_ >= 0 ? -1 : 50);
    if (n < 0) {
      if (errno != EINTR) absl::SleepFor(absl::Milliseconds(10));
      continue;
    }
    size_t first = 0;
    if (wake_fd_ >= 0) {
      first = 1;
      if (fds[0].revents != 0) {
        uint64_t count = 0;
        [[maybe_unused]] ssize_t r = read(wake_fd_, &count, sizeof(count));
      }
    }
    for (size_t i = first; i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) == 0) continue;
      const uint64_t id = ids[i - first];
      std::function<void()> on_close;
      {
        absl::MutexLock lock(&mu_);
        auto it = entries_.find(id);
        if (it == entries_.end() || it->second.fired) continue;  // removed meanwhile
        it->second.fired = true;
        it->second.running = true;
        on_close = it->second.on_close;
      }
      if (on_close) on_close();
      absl::MutexLock lock(&mu_);
      auto it = entries_.find(id);  // still there: Remove waits for !running
      close(it->second.fd);
      it->second.fd = -1;
      it->second.running = false;
      fired_cv_.SignalAll();
    }
  }
}

}  // namespace vlm::gateway
