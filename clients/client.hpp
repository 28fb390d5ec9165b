// The message-level client: talks troupe frames over TCP to a troupe
// endpoint (the gateway's FrameServer). Submit generations and stream their
// tokens, abort, park, resume, list models. `troupe client` is built on it;
// clients/python/troupe_client.py is the same thing in Python.
//
// Threading: one reader thread per Client routes incoming frames to their
// request. All methods are thread-safe; next() for one request id should be
// called from one thread at a time.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "base/error.hpp"
#include "messages/frame.hpp"

namespace troupe::transport {
class TcpFrameSocket;
}

namespace troupe::clients {

using messages::Status;

struct ChatTurn {
  std::string role;  // "system", "user", "assistant", "tool"
  std::string content;
};

// GenerateRequest, in plain C++ (messages/generate.capnp documents each field).
struct GenerateOptions {
  std::string model;  // empty: the server's default model
  std::variant<std::string, std::vector<uint32_t>, std::vector<ChatTurn>> prompt;
  float temperature = 1.0f;
  float top_p = 1.0f;
  uint32_t top_k = 0;
  float min_p = 0.0f;  // 0: off
  std::string json_schema;  // the answer is JSON under this schema; empty: free text
  std::string regex;        // the answer is a text this regular expression matches whole; empty: none
  std::string ebnf;         // the answer is a text this EBNF grammar derives from `root`; empty: none
  std::optional<uint64_t> seed;
  float repetition_penalty = 1.0f;
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  std::vector<std::pair<uint32_t, float>> logit_bias;  // (token, bias in [-100, 100])
  uint32_t max_tokens = 16;
  uint32_t min_tokens = 0;
  std::vector<std::string> stop;
  std::vector<uint32_t> stop_token_ids;
  bool ignore_eos = false;
  bool return_token_ids = false;
  int32_t priority = 0;
  std::optional<std::chrono::system_clock::time_point> deadline;
  std::string user;
};

// Events of one request's stream, in order.
struct Chunk {
  uint32_t index = 0;
  std::vector<uint32_t> token_ids;
  std::string text;
};
enum class FinishReason { stop, length, aborted, error };
const char* to_string(FinishReason r);
struct Finished {  // the last event of a stream
  FinishReason reason = FinishReason::stop;
  uint32_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0, parks = 0;
  std::string matched_stop;
};
struct Acked {  // answer to park/resume
  std::string of;  // "Park", "Resume"
  std::string detail;
};
using Event = std::variant<Chunk, Finished, Acked, Error>;

struct ModelInfo {
  std::string id, owned_by;
  uint32_t max_context = 0, vocab_size = 0;
};

// A whole generation, collected.
struct Generation {
  std::string text;
  std::vector<uint32_t> token_ids;
  Finished finish;
};

class Client {
 public:
  static Expected<std::unique_ptr<Client>> connect(const std::string& host, uint16_t port,
                                                   std::chrono::milliseconds timeout = std::chrono::seconds(5));
  // Closes the connection; blocked next() calls return unavailable.
  ~Client();

  // Sends a GenerateRequest; returns its request id. Its events follow via next().
  Expected<uint64_t> submit(const GenerateOptions& options);
  // The next event of a request: a Chunk, then eventually one Finished (or
  // an Error, which also ends the stream). deadline_exceeded on timeout.
  Expected<Event> next(uint64_t request_id, std::chrono::milliseconds timeout);
  // Submit and collect until Finished; on_chunk sees each chunk as it arrives.
  Expected<Generation> generate(const GenerateOptions& options, const std::function<void(const Chunk&)>& on_chunk = {},
                                std::chrono::milliseconds timeout = std::chrono::seconds(120));

  // Control of a running request; the answer arrives on its stream
  // (abort: Finished{aborted}; park/resume: Acked; unknown id: Error not_found).
  Status abort(uint64_t request_id, const std::string& reason = "");
  Status park(uint64_t request_id, const std::string& reason = "");
  Status resume(uint64_t request_id);

  Expected<std::vector<ModelInfo>> list_models(std::chrono::milliseconds timeout = std::chrono::seconds(10));

  bool connected() const;

 private:
  explicit Client(std::unique_ptr<transport::TcpFrameSocket> socket);
  void read_loop();
  Status send(const messages::Frame& frame);
  Expected<messages::Frame> wait_frame(uint64_t request_id, std::chrono::milliseconds timeout);

  std::unique_ptr<transport::TcpFrameSocket> socket_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::deque<messages::Frame>> inbox_;  // request id -> frames not yet consumed
  std::optional<Error> closed_;
  uint64_t next_id_ = 1;
  std::thread reader_;
};

}  // namespace troupe::clients
