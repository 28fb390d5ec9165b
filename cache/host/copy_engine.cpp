#include "cache/host/copy_engine.hpp"

#include <utility>

namespace troupe::cache {

CopyEngine::CopyEngine(kernels::Backend& backend) : backend_(backend), thread_([this] { run(); }) {}

CopyEngine::~CopyEngine() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

CopyEngine::Ticket CopyEngine::submit(std::vector<Copy> copies) {
  Ticket t;
  {
    std::lock_guard lock(mu_);
    t = next_++;
    queue_.emplace_back(t, std::move(copies));
  }
  cv_.notify_one();
  return t;
}

bool CopyEngine::done(Ticket t) const {
  std::lock_guard lock(mu_);
  return t <= done_upto_;
}

void CopyEngine::wait(Ticket t) {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return t <= done_upto_; });
}

std::vector<CopyEngine::Ticket> CopyEngine::take_finished() {
  std::lock_guard lock(mu_);
  return std::exchange(finished_, {});
}

void CopyEngine::set_wake(std::function<void()> wake) {
  std::lock_guard lock(mu_);
  wake_ = std::move(wake);
}

uint64_t CopyEngine::bytes_copied() const {
  std::lock_guard lock(mu_);
  return bytes_;
}

size_t CopyEngine::queued() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

void CopyEngine::run() {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and drained
    auto [ticket, copies] = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    uint64_t bytes = 0;
    // The backend's copy queue: a copy stream beside the compute stream on CUDA,
    // plain memcpy on the CPU backend.
    for (const auto& c : copies) {
      backend_.copy_queue(c.dst, c.src, c.bytes, c.to == Tier::host);
      bytes += c.bytes;
    }
    backend_.copy_queue_wait();
    lock.lock();
    bytes_ += bytes;
    done_upto_ = ticket;
    finished_.push_back(ticket);
    auto wake = wake_;
    done_cv_.notify_all();
    if (wake) {
      lock.unlock();
      wake();
      lock.lock();
    }
  }
}

}  // namespace troupe::cache
