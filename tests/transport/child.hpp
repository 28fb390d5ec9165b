// A child process for multi-process tests: stdout piped (for the READY
// line), stderr to a file, killed with SIGKILL if the test process dies
// (PR_SET_PDEATHSIG) and reaped by the destructor.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace troupe::test {

class Child {
 public:
  Child(std::vector<std::string> argv, std::string stderr_path) : log_(std::move(stderr_path)) {
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
    pid_t parent = getpid();
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork");
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
      dup2(out[1], 1);
      int err = open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (err >= 0) dup2(err, 2);
      // Nothing else of ours: an inherited listening socket (UCX does not set
      // close-on-exec) would keep our port bound after we close it.
      close_range(3, ~0u, 0);
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
    close(out[1]);
    out_ = out[0];
  }
  Child(const Child&) = delete;
  ~Child() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) close(out_);
  }

  // Reads one line of the child's stdout (throws on timeout or EOF).
  std::string read_line(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    std::string line;
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      pollfd p{out_, POLLIN, 0};
      if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) <= 0) {
        throw std::runtime_error("child printed no line in time; log: " + log());
      }
      char ch;
      if (read(out_, &ch, 1) != 1) throw std::runtime_error("child exited early; log: " + log());
      if (ch == '\n') return line;
      line += ch;
    }
  }
  // The value of `key=` in a line like "READY tcp=123 ucx=ucx://..."
  static std::string field(const std::string& line, const std::string& key) {
    auto pos = line.find(key + "=");
    if (pos == std::string::npos) return {};
    auto end = line.find(' ', pos);
    return line.substr(pos + key.size() + 1, end == std::string::npos ? std::string::npos : end - pos - key.size() - 1);
  }

  void kill9() { kill(pid_, SIGKILL); }
  void terminate() { kill(pid_, SIGTERM); }
  // Exit status (waits); -signal when killed by a signal.
  int wait() {
    int st = 0;
    waitpid(pid_, &st, 0);
    reaped_ = true;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
  }
  bool alive() {
    if (reaped_) return false;
    int st = 0;
    pid_t r = waitpid(pid_, &st, WNOHANG);
    if (r == pid_) reaped_ = true;
    return r == 0;
  }
  std::string log() const {
    std::ifstream f(log_);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  }
  pid_t pid() const { return pid_; }

 private:
  std::string log_;
  pid_t pid_ = -1;
  int out_ = -1;
  bool reaped_ = false;
};

// The server under test; sanitized test binaries name the sanitized build.
#ifndef TROUPE_TEST_SERVER
#define TROUPE_TEST_SERVER "frame_test_server"
#endif
inline std::string server_binary() { return std::string(TROUPE_BINARY_DIR) + "/bin/" TROUPE_TEST_SERVER; }
// A log file of its own for each child (ctest runs tests in parallel).
inline std::string log_path(const std::string& name) {
  static int n = 0;
  std::string dir = std::string(TROUPE_BINARY_DIR) + "/Testing/logs";
  std::filesystem::create_directories(dir);
  return dir + "/" + name + "." + std::to_string(getpid()) + "." + std::to_string(n++) + ".log";
}

}  // namespace troupe::test
