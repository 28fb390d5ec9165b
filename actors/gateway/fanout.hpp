// A request with several choices (n > 1, or a completions batch of prompts) runs as
// one request per choice; FanOut is the client's responder seen from each of them.
// Whole responses are merged into one (choices renumbered, usage summed); streams are
// interleaved event by event with each choice's index, one "[DONE]" and one usage event
// at the end. The first error answers the client and stops the other choices; a client
// that goes away stops them all.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "actors/gateway/http_server.hpp"

namespace troupe::gateway {

class FanOut : public std::enable_shared_from_this<FanOut> {
 public:
  // `choices` children, `n` choices per prompt; `include_usage` as a stream request asked.
  static std::shared_ptr<FanOut> make(std::shared_ptr<Responder> client, int32_t choices, int32_t n,
                                      bool include_usage);
  // The responder choice `index` answers through.
  std::shared_ptr<Responder> child(int32_t index);
  // True once the client has its answer (an error, or everything): admit no more choices.
  bool finished() const;
  // Every choice is admitted: a stream starts now (not at the first choice's admission, so
  // that a later choice's admission error is still an HTTP error, not a stream event).
  void admitted();

  // From the children (the gateway's thread), and their close callbacks (any thread).
  void respond(int32_t index, int status, const std::string& content_type, std::string body,
               std::map<std::string, std::string> headers);
  void start_stream(int32_t index, int status, const std::string& content_type);
  void send(int32_t index, std::string chunk);
  void end(int32_t index);
  void on_close(int32_t index, std::function<void()> callback);
  bool closed() const { return client_->closed(); }

 private:
  FanOut(std::shared_ptr<Responder> client, int32_t choices, int32_t n, bool include_usage);
  bool mark_done_locked(int32_t index);  // false: it had answered already
  void stop_others_locked(int32_t except, std::vector<std::function<void()>>& out);
  void fail_locked(int32_t index, int status, const std::string& content_type, const std::string& body,
                   std::map<std::string, std::string> headers, std::vector<std::function<void()>>& stop);

  std::shared_ptr<Responder> client_;
  const int32_t choices_, n_;
  const bool include_usage_;
  mutable std::mutex mu_;
  bool done_ = false;            // the client has its answer
  bool client_streaming_ = false;
  bool admitting_ = true;
  int stream_status_ = 0;        // a start_stream asked for while admitting
  std::string stream_type_;
  int32_t answered_ = 0;         // children that responded or ended
  std::vector<bool> child_done_;
  std::vector<std::string> bodies_;
  std::vector<std::function<void()>> stop_;  // each child's close callback: aborts it
  std::string id_;               // the merged stream's id (the first event's)
  nlohmann::json header_;        // the first event's id, object, created, model: the usage event's
  nlohmann::json usage_;
};

}  // namespace troupe::gateway
