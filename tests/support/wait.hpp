// Polls a condition for tests that watch actors or processes from outside.
#pragma once

#include <chrono>
#include <functional>
#include <thread>

namespace troupe::testing {

// Whether `pred` became true within `timeout` (checked every 2 ms, and once more at the end).
inline bool wait_until(const std::function<bool()>& pred,
                       std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return pred();
}

}  // namespace troupe::testing
