// A service binary run as a child process for integration tests: started with
// flags, its "vlm: listening grpc=HOST:PORT metrics=HOST:PORT" line read from
// stdout, stopped with a signal. stdout and stderr go to files (never a pipe
// that could fill up), so a failing test can print the log's tail.
#ifndef VLM_TESTS_INTEGRATION_SERVICE_PROCESS_H_
#define VLM_TESTS_INTEGRATION_SERVICE_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace vlm::testing {

class ServiceProcess {
 public:
  // Starts `binary` with `flags`; output goes to `log_prefix`.out / .err.
  ServiceProcess(std::string binary, std::vector<std::string> flags, std::string log_prefix)
      : out_path_(log_prefix + ".out"), err_path_(log_prefix + ".err") {
    std::vector<std::string> args = {std::move(binary)};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
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
      ::execv(argv[0], argv.data());
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
    static const std::regex kLine(R"(vlm: listening grpc=(\S+):(\d+) metrics=(\S+):(\d+))");
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      std::ifstream in(out_path_);
      std::stringstream text;
      text << in.rdbuf();
      const std::string s = text.str();
      std::smatch m;
      if (std::regex_search(s, m, kLine)) {
        grpc_port = std::stoi(m[2]);
        metrics_port = std::stoi(m[4]);
        return true;
      }
      if (Exited()) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }

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

  // Sends `signo`; waits for the exit up to `timeout`; returns the exit code
  // (negative: the killing signal) or nullopt if still running.
  std::optional<int> Stop(int signo, absl::Duration timeout = absl::Seconds(30)) {
    if (!reaped_) ::kill(pid_, signo);
    const absl::Time deadline = absl::Now() + timeout;
    while (!Exited() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
    if (!reaped_) return std::nullopt;
    return exit_status_;
  }
  void Kill() {
    if (pid_ > 0 && !reaped_) Stop(SIGKILL);
  }

  std::string grpc_target() const { return "127.0.0.1:" + std::to_string(grpc_port); }

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

  int grpc_port = 0;
  int metrics_port = 0;

 private:
  std::string out_path_;
  std::string err_path_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int exit_status_ = 0;
};

}  // namespace vlm::testing

#endif  // VLM_TESTS_INTEGRATION_SERVICE_PROCESS_H_
