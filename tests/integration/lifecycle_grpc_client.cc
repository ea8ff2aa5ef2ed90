// A gRPC client of the gateway that vanishes: it starts an endless ChatStream
// (8192 tokens, ignore_eos), reads chunks for VANISH_MS milliseconds, sets
// SO_LINGER {1, 0} on its sockets to the gateway, prints what it received and
// dies (_exit): the kernel then resets its connections (RST), as for a
// crashed client. Used by lifecycle_test.
//
// Usage: lifecycle_grpc_client HOST:PORT VANISH_MS
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <dirent.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "tests/integration/chat_request.h"
#include "vlm/v1/gateway.grpc.pb.h"

namespace {

// Sets SO_LINGER {1, 0} on every TCP socket of this process whose peer port is `port`.
int ArmResets(int port) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  int armed = 0;
  while (dirent* entry = readdir(dir)) {
    const int fd = std::atoi(entry->d_name);
    if (fd <= 2) continue;
    sockaddr_storage peer{};
    socklen_t length = sizeof(peer);
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &length) != 0) continue;
    int peer_port = -1;
    if (peer.ss_family == AF_INET) peer_port = ntohs(reinterpret_cast<sockaddr_in*>(&peer)->sin_port);
    if (peer.ss_family == AF_INET6) {
      peer_port = ntohs(reinterpret_cast<sockaddr_in6*>(&peer)->sin6_port);
    }
    if (peer_port != port) continue;
    linger l{1, 0};
    if (setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l)) == 0) ++armed;
  }
  closedir(dir);
  return armed;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s HOST:PORT VANISH_MS\n", argv[0]);
    return 2;
  }
  const std::string target = argv[1];
  const int vanish_ms = std::atoi(argv[2]);
  const int port = std::atoi(target.substr(target.rfind(':') + 1).c_str());
  auto stub = vlm::v1::VisionLanguage::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  std::atomic<int> chunks{0};
  std::atomic<bool> ended{false};
  std::thread reader([&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    auto stream = stub->ChatStream(&context, vlm::testing::EndlessChat(8192));
    vlm::v1::ChatChunk chunk;
    while (stream->Read(&chunk)) ++chunks;
    ended = true;  // not expected: the gateway ended the stream first
    stream->Finish();
  });
  reader.detach();
  std::this_thread::sleep_for(std::chrono::milliseconds(vanish_ms));
  const int armed = ArmResets(port);
  std::printf("chunks=%d reset_sockets=%d ended=%d\n", chunks.load(), armed, ended ? 1 : 0);
  std::fflush(stdout);
  _exit(0);
}
