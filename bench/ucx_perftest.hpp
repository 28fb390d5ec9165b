// Shared by the UCX benches (transport_bench, kv_handoff_bench): child
// processes with pipes, and ucx_perftest run as the peer in the same run.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace troupe::bench {

struct Spawned {
  pid_t pid = -1;
  int out = -1, in = -1;  // the child's stdout (read) and stdin (write)
};

inline Spawned spawn(std::vector<std::string> argv) {
  int out[2], in[2];
  if (pipe(out) != 0 || pipe(in) != 0) throw std::runtime_error("pipe");
  Spawned s;
  s.pid = fork();
  if (s.pid == 0) {
    dup2(out[1], 1);
    dup2(in[0], 0);
    close(out[0]);
    close(in[1]);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  close(out[1]);
  close(in[0]);
  s.out = out[0];
  s.in = in[1];
  return s;
}

inline std::string read_all(int fd) {
  std::string s;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) s.append(buf, static_cast<size_t>(n));
  return s;
}

inline std::string read_line(int fd) {
  std::string s;
  char c;
  while (read(fd, &c, 1) == 1 && c != '\n') s += c;
  return s;
}

inline std::string human(size_t b) {
  if (b >= (1u << 20)) return fmt::format("{} MiB", b >> 20);
  if (b >= 1024) return fmt::format("{} KiB", b >> 10);
  return fmt::format("{} B", b);
}

// ucx_perftest overall bandwidth (bytes/s) and message rate for one test.
struct Rate {
  double bytes_per_s = 0, msgs_per_s = 0;
};

// One ucx_perftest server + client on 127.0.0.1 (error mode PEER, -e); `am`:
// a 32-byte active-message header (-H 32); `sleep`: wakeup mode (-I -E sleep).
inline Rate perftest_once(const std::string& bin, const std::string& test, size_t size, size_t iters, bool am,
                          bool sleep) {
  static std::mt19937 rng(std::random_device{}());
  std::string port = std::to_string(20000 + rng() % 20000);
  auto server = spawn({bin, "-p", port});
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::vector<std::string> args = {bin, "127.0.0.1", "-p", port, "-t", test, "-s", std::to_string(size), "-n",
                                   std::to_string(iters), "-w", std::to_string(std::max<size_t>(iters / 10, 2)), "-e",
                                   "-f", "-v"};
  if (am) {
    args.push_back("-H");
    args.push_back("32");
  }
  if (sleep) {  // wakeup mode, as troupe's progress thread
    for (const char* a : {"-I", "-E", "sleep"}) args.push_back(a);
  }
  auto client = spawn(args);
  std::string out = read_all(client.out);
  waitpid(client.pid, nullptr, 0);
  kill(server.pid, SIGKILL);
  waitpid(server.pid, nullptr, 0);
  for (int fd : {server.out, server.in, client.out, client.in}) close(fd);
  // Last line: iterations,p50_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr (bw in MB = 2^20)
  std::istringstream ls(out);
  std::string line, last;
  while (std::getline(ls, line)) {
    auto first = line.find_first_not_of(' ');
    if (first != std::string::npos && std::isdigit(static_cast<unsigned char>(line[first]))) last = line;
  }
  std::vector<double> v;
  std::istringstream fs(last);
  std::string cell;
  while (std::getline(fs, cell, ',')) v.push_back(std::atof(cell.c_str()));
  if (v.size() < 8) return {};
  return {v[5] * 1048576.0, v[7]};
}

// Retries when the client could not reach the server (slow start under load).
inline Rate perftest(const std::string& bin, const std::string& test, size_t size, size_t iters, bool am = false,
                     bool sleep = false) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    Rate r = perftest_once(bin, test, size, iters, am, sleep);
    if (r.bytes_per_s > 0) return r;
  }
  spdlog::warn("ucx_perftest {} -s {}: no result after 3 attempts", test, size);
  return {};
}

}  // namespace troupe::bench
