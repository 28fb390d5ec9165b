// fn(begin, end) over [0, n) split into `threads` contiguous ranges, one thread each
// (the caller's thread waits); one call on the caller's thread when threads <= 1.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace troupe {

template <class Fn>
void parallel_ranges(int64_t n, int64_t threads, Fn fn) {
  if (threads <= 1 || n <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t per = (n + threads - 1) / threads;
  for (int64_t t = 0; t < threads && t * per < n; ++t) pool.emplace_back(fn, t * per, std::min(n, (t + 1) * per));
  for (auto& th : pool) th.join();
}

// The machine's hardware threads (at least 1).
inline int64_t hardware_threads() { return std::max<int64_t>(1, std::thread::hardware_concurrency()); }

}  // namespace troupe
