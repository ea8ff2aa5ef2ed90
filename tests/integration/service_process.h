// The process harness of the integration tests: a service binary run as a
// child process, started with flags (and extra environment), its
// "vlm: listening grpc=HOST:PORT metrics=HOST:PORT" line read from stdout,
// its grpc.health.v1 status polled until SERVING, signalled (SIGTERM,
// SIGKILL, SIGSTOP/SIGCONT) and reaped. stdout and stderr
// go to files (never a pipe that could fill up), so a failing test can print
// the log's tail. The child gets SIGKILL if the test process dies, and the
// destructor kills and reaps it, so no test leaves a process behind.
//
// Not thread-safe: one thread drives a ServiceProcess.
#ifndef VLM_TESTS_INTEGRATION_SERVICE_PROCESS_H_
#define VLM_TESTS_INTEGRATION_SERVICE_PROCESS_H_

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"

extern char** environ;

namespace vlm::testing {

// A directory for the logs of `suite` under $VLM_BINARY_DIR/tests (ctest sets
// it), else under $TMPDIR or /tmp; created if missing. Ends without '/'.
inline std::string TestLogDir(const std::string& suite) {
  const char* binary_dir = std::getenv("VLM_BINARY_DIR");
  const char* tmp = std::getenv("TMPDIR");
  const std::string root = binary_dir != nullptr ? std::string(binary_dir) + "/tests"
                           : tmp != nullptr      ? std::string(tmp)
                                                 : std::string("/tmp");
  const std::string dir = root + "/" + suite + "_logs";
  ::mkdir(root.c_str(), 0755);
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

// The whole file at `path` ("" if unreadable).
inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The HTTP port a gateway printed as "vlm: http=HOST:PORT" in `stdout_text`;
// 0 while it has printed none.
inline int GatewayHttpPort(const std::string& stdout_text) {
  static const std::regex kLine(R"(vlm: http=(\S+):(\d+))");
  std::smatch m;
  return std::regex_search(stdout_text, m, kLine) ? std::stoi(m[2]) : 0;
}

// Polls `condition` every 20 ms until it holds or `timeout` passes; returns its last value.
inline bool Eventually(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return condition();
}

// The grpc.health.v1 status of `service` ("" is the whole server) at `target`
// ("host:port", plaintext): "SERVING", "NOT_SERVING", ... or "error: <message>"
// when the call fails, e.g. because nothing answered within `deadline`.
inline std::string HealthStatus(const std::string& target, const std::string& service = "",
                                absl::Duration deadline = absl::Seconds(2)) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&ctx, request, &response);
  if (!status.ok()) return "error: " + status.error_message();
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
}

class ServiceProcess {
 public:
  // Starts `binary` with `flags`; output goes to `log_prefix`.out / .err.
  // `env` ("NAME=value") is added to this process's environment.
  ServiceProcess(std::string binary, std::vector<std::string> flags, std::string log_prefix,
                 std::vector<std::string> env = {})
      : out_path_(log_prefix + ".out"), err_path_(log_prefix + ".err") {
    std::vector<std::string> args = {std::move(binary)};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());  // the first NAME= wins in getenv
    envp.push_back(nullptr);
    const int out = ::open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const int err = ::open(err_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ == 0) {
      // Only async-signal-safe calls between fork and exec.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the test
      if (::getppid() != parent) ::_exit(127);
      ::dup2(out, STDOUT_FILENO);
      ::dup2(err, STDERR_FILENO);
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
    ::close(out);
    ::close(err);
  }

  ~ServiceProcess() { Kill(); }
  ServiceProcess(const ServiceProcess&) = delete;
  ServiceProcess& operator=(const ServiceProcess&) = delete;

  pid_t pid() const { return pid_; }

  // Waits for the listening line; false if the process exits first or on timeout.
  bool WaitListening(absl::Duration timeout = absl::Seconds(60)) {
    static const std::regex kLine(R"(vlm: listening grpc=(\S+):(\d+) metrics=(\S+?)(?::(\d+))?\s)");
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      const std::string s = Stdout();
      std::smatch m;
      if (std::regex_search(s, m, kLine)) {
        grpc_host = m[1];
        grpc_port = std::stoi(m[2]);
        metrics_host = m[3];
        metrics_port = m[4].matched ? std::stoi(m[4]) : 0;
        return true;
      }
      if (Exited()) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }

  // The health status of `service` on this process's gRPC port (see HealthStatus).
  std::string Health(const std::string& service = "",
                     absl::Duration deadline = absl::Seconds(2)) const {
    return HealthStatus(grpc_target(), service, deadline);
  }

  // Waits (after WaitListening) until `service` is SERVING; false if the
  // process exits first or on timeout.
  bool WaitServing(const std::string& service = "", absl::Duration timeout = absl::Seconds(60)) {
    return Eventually([&] { return Exited() || Health(service) == "SERVING"; }, timeout) &&
           !Exited();
  }

  // True while the process runs (not yet exited).
  bool Alive() { return !Exited(); }

  // True once the process has exited (it is then reaped).
  bool Exited() {
    if (reaped_) return true;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      reaped_ = true;
      exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      return true;
    }
    return false;
  }

  // Sends `signo` (e.g. SIGSTOP, SIGCONT) without waiting; false if already reaped.
  bool Signal(int signo) { return !reaped_ && ::kill(pid_, signo) == 0; }

  // Waits up to `timeout` for the exit; returns the exit code (negative: the
  // killing signal) or nullopt if still running.
  std::optional<int> WaitExit(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (!Exited() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
    if (!reaped_) return std::nullopt;
    return exit_status_;
  }

  // Sends `signo` and waits for the exit (see WaitExit).
  std::optional<int> Stop(int signo, absl::Duration timeout = absl::Seconds(30)) {
    if (!reaped_) {
      ::kill(pid_, signo);
      if (signo != SIGCONT) ::kill(pid_, SIGCONT);  // a stopped process must run to exit
    }
    return WaitExit(timeout);
  }
  void Kill() {
    if (pid_ > 0 && !reaped_) Stop(SIGKILL);
  }

  std::string grpc_target() const {
    return (grpc_host.empty() ? std::string("127.0.0.1") : grpc_host) + ":" +
           std::to_string(grpc_port);
  }

  // Everything written to stdout so far.
  std::string Stdout() const {
    std::ifstream in(out_path_);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  // The last `lines` lines of stderr.
  std::string LogTail(int lines = 30) const {
    std::ifstream in(err_path_);
    std::vector<std::string> all;
    for (std::string line; std::getline(in, line);) all.push_back(line);
    std::string tail;
    for (size_t i = all.size() > static_cast<size_t>(lines) ? all.size() - lines : 0; i < all.size();
         ++i) {
      tail += all[i] + "\n";
    }
    return tail;
  }

  std::string grpc_host;
  int grpc_port = 0;
  std::string metrics_host;
  int metrics_port = 0;  // 0 when the service runs without its HTTP server

 private:
  std::string out_path_;
  std::string err_path_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int exit_status_ = 0;
};

}  // namespace vlm::testing

#endif  // VLM_TESTS_INTEGRATION_SERVICE_PROCESS_H_
