// Copies between the device and host tiers off the engine thread, so they
// overlap compute: a copy thread issues each batch on the backend's copy queue
// (Backend::copy_queue: a copy stream of its own on CUDA, memcpy on the CPU
// backend) and waits for it. The engine issues copies out of device pages only
// after the compute that wrote them has been synchronized.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "cache/memory.hpp"
#include "kernels/backend.hpp"

namespace troupe::cache {

class CopyEngine {
 public:
  struct Copy {
    void* dst = nullptr;
    const void* src = nullptr;
    size_t bytes = 0;
    Tier to = Tier::host;  // host: device -> host; device: host -> device
  };
  using Ticket = uint64_t;

  explicit CopyEngine(kernels::Backend& backend);
  ~CopyEngine();  // finishes the queued copies, then stops the thread
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Queues a batch; the memory must stay valid until the ticket is done.
  Ticket submit(std::vector<Copy> copies);
  bool done(Ticket t) const;
  void wait(Ticket t);
  // Tickets finished since the last call, in submission order.
  std::vector<Ticket> take_finished();
  // Called on the copy thread after each batch (e.g. to wake the engine thread).
  void set_wake(std::function<void()> wake);
  uint64_t bytes_copied() const;
  size_t queued() const;

 private:
  void run();

  kernels::Backend& backend_;
  mutable std::mutex mu_;
  std::condition_variable cv_;       // work for the copy thread
  std::condition_variable done_cv_;  // a batch finished
  std::deque<std::pair<Ticket, std::vector<Copy>>> queue_;
  std::vector<Ticket> finished_;
  Ticket next_ = 1;
  Ticket done_upto_ = 0;  // batches run in order: every ticket <= this is done
  uint64_t bytes_ = 0;
  bool stop_ = false;
  std::function<void()> wake_;
  std::thread thread_;
};

}  // namespace troupe::cache
