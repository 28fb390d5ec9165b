// A small but real FrameHandler for tests until the gateway actor exists
// (the actor issue implements the real one): answers ListModels, streams a
// deterministic sequence of TokenChunks + Finish for a GenerateRequest,
// handles Abort/Park/Resume (Error not_found for unknown request ids),
// takes KV handoffs over a transport (KvOffer -> get + KvConfirm; KvPull put
// mode -> put + KvConfirm), and echoes every other frame unchanged. A frame
// whose request id has bit 62 set is echoed whatever its kind.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "transport/frame_server.hpp"

namespace troupe::test {

inline constexpr uint64_t kEchoBit = uint64_t{1} << 62;
inline constexpr uint32_t kTestVocab = 129280;
inline constexpr const char* kTestModel = "troupe-test";

// Token i of the deterministic stream for a prompt whose ids sum to `base`.
inline uint32_t test_token(uint64_t base, uint64_t seed, uint32_t i) {
  return static_cast<uint32_t>((base + seed * 31 + uint64_t{i} * 7919) % kTestVocab);
}

// FNV-1a 64 over bytes (KvConfirm.checksum).
uint64_t fnv1a(const std::byte* p, size_t n, uint64_t h = 0xcbf29ce484222325ull);

class TestService final : public transport::FrameHandler {
 public:
  explicit TestService(std::chrono::milliseconds token_interval = std::chrono::milliseconds(2));
  ~TestService() override;

  void on_open(const transport::ConnectionPtr& conn) override;
  void on_frame(const transport::ConnectionPtr& conn, transport::Frame frame) override;
  void on_close(const transport::ConnectionPtr& conn, const Error& why) override;

  size_t active_streams() const;
  uint64_t aborted_on_close() const;

 private:
  struct Stream {
    uint64_t base = 0, seed = 0;
    uint32_t next = 0, max_tokens = 0, min_tokens = 0, prompt_tokens = 0;
    std::vector<uint32_t> stop_ids;
    bool return_ids = false, parked = false;
    uint32_t parks = 0;
  };
  struct PerConn {
    transport::ConnectionPtr conn;
    std::map<uint64_t, Stream> streams;
    std::map<uint64_t, transport::RegionKey> leases;  // KvOffer lease id -> the peer's region we read
  };
  void generate(PerConn& pc, const transport::Frame& f);
  void control(PerConn& pc, const transport::Frame& f);
  void take_offer(const transport::ConnectionPtr& conn, const transport::Frame& f);
  void serve_pull(const transport::ConnectionPtr& conn, const transport::Frame& f);
  void release(PerConn& pc, const transport::Frame& f);
  void pump();

  std::chrono::milliseconds interval_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, PerConn> conns_;
  uint64_t aborted_on_close_ = 0;
  bool stop_ = false;
  std::thread pump_;
};

}  // namespace troupe::test
