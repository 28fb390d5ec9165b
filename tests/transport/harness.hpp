// Test helpers: collect a transport's events and wait for them.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "tests/transport/pattern.hpp"
#include "transport/transport.hpp"

namespace troupe::test {

using namespace std::chrono_literals;

// Keeps UCX on loopback in every test binary (STACK.md: tcp/eth0 otherwise).
inline const bool kUcxOnLoopback = [] {
  setenv("UCX_NET_DEVICES", "lo", 0);
  return true;
}();

// Everything a transport reported, in order, with a condition to wait on.
struct Inbox {
  struct Got {
    std::string peer;
    transport::Frame frame;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Got> frames;
  std::vector<std::string> ups;
  std::vector<std::pair<std::string, Error>> downs;
  std::vector<transport::FrameFault> faults;
  std::vector<std::chrono::steady_clock::time_point> down_times;
  // Optional: runs on the transport thread for each frame (e.g. echo).
  std::function<void(const std::string&, const transport::Frame&)> on_frame;

  transport::TransportEvents events() {
    transport::TransportEvents e;
    e.on_frame = [this](const std::string& p, transport::Frame f) {
      if (on_frame) on_frame(p, f);
      std::lock_guard lock(mu);
      frames.push_back({p, std::move(f)});
      cv.notify_all();
    };
    e.on_peer_up = [this](const std::string& p) {
      std::lock_guard lock(mu);
      ups.push_back(p);
      cv.notify_all();
    };
    e.on_peer_down = [this](const std::string& p, const Error& why) {
      std::lock_guard lock(mu);
      downs.emplace_back(p, why);
      down_times.push_back(std::chrono::steady_clock::now());
      cv.notify_all();
    };
    e.on_bad_frame = [this](const std::string&, const transport::FrameFault& f) {
      std::lock_guard lock(mu);
      faults.push_back(f);
      cv.notify_all();
    };
    return e;
  }

  // Frame i and how many have come, read under the lock: the transport thread may be appending
  // (a reference into `frames` dangles when the vector grows; ASan caught one in BadBytes).
  Got frame_at(size_t i) {
    std::lock_guard lock(mu);
    return frames.at(i);
  }
  size_t frame_count() {
    std::lock_guard lock(mu);
    return frames.size();
  }
  // The same for the peer-down reports.
  size_t down_count() {
    std::lock_guard lock(mu);
    return downs.size();
  }
  std::chrono::steady_clock::time_point down_time_at(size_t i) {
    std::lock_guard lock(mu);
    return down_times.at(i);
  }

  template <class Pred>
  bool wait(Pred pred, std::chrono::milliseconds timeout = 10s) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, timeout, [&] { return pred(); });
  }
  bool wait_frames(size_t n, std::chrono::milliseconds timeout = 10s) {
    return wait([&] { return frames.size() >= n; }, timeout);
  }
  bool wait_down(const std::string& peer, std::chrono::milliseconds timeout = 10s) {
    return wait(
        [&] {
          for (auto& d : downs) {
            if (d.first == peer) return true;
          }
          return false;
        },
        timeout);
  }
  bool wait_up(const std::string& peer, std::chrono::milliseconds timeout = 10s) {
    return wait([&] { return std::find(ups.begin(), ups.end(), peer) != ups.end(); }, timeout);
  }
};

}  // namespace troupe::test
