#include "actors/gateway/fanout.hpp"

#include <algorithm>

#include "actors/gateway/openai.hpp"

namespace troupe::gateway {
namespace {

class ChildResponder : public Responder {
 public:
  ChildResponder(std::shared_ptr<FanOut> group, int32_t index) : group_(std::move(group)), index_(index) {}
  void respond(int status, const std::string& content_type, std::string body,
               std::map<std::string, std::string> extra_headers) override {
    group_->respond(index_, status, content_type, std::move(body), std::move(extra_headers));
  }
  void start_stream(int status, const std::string& content_type) override {
    group_->start_stream(index_, status, content_type);
  }
  void send(std::string chunk) override { group_->send(index_, std::move(chunk)); }
  void end() override { group_->end(index_); }
  bool closed() const override { return group_->closed(); }
  void on_close(std::function<void()> callback) override { group_->on_close(index_, std::move(callback)); }

 private:
  std::shared_ptr<FanOut> group_;
  const int32_t index_;
};

void run(std::vector<std::function<void()>>& callbacks) {
  for (auto& f : callbacks) {
    if (f) f();
  }
}

}  // namespace

std::shared_ptr<FanOut> FanOut::make(std::shared_ptr<Responder> client, int32_t choices, int32_t n,
                                     bool include_usage) {
  std::shared_ptr<FanOut> f(new FanOut(std::move(client), choices, n, include_usage));
  std::weak_ptr<FanOut> weak = f;
  f->client_->on_close([weak] {  // the client went away: stop every choice still running
    auto self = weak.lock();
    if (!self) return;
    std::vector<std::function<void()>> stop;
    {
      std::lock_guard lock(self->mu_);
      self->done_ = true;
      self->stop_others_locked(-1, stop);
    }
    run(stop);
  });
  return f;
}

FanOut::FanOut(std::shared_ptr<Responder> client, int32_t choices, int32_t n, bool include_usage)
    : client_(std::move(client)),
      choices_(choices),
      n_(n),
      include_usage_(include_usage),
      child_done_(static_cast<size_t>(choices), false),
      bodies_(static_cast<size_t>(choices)),
      stop_(static_cast<size_t>(choices)) {}

std::shared_ptr<Responder> FanOut::child(int32_t index) {
  return std::make_shared<ChildResponder>(shared_from_this(), index);
}

bool FanOut::finished() const {
  std::lock_guard lock(mu_);
  return done_;
}

void FanOut::on_close(int32_t index, std::function<void()> callback) {
  bool now = false;
  {
    std::lock_guard lock(mu_);
    if (done_ && !child_done_[static_cast<size_t>(index)]) {
      now = true;  // the group already ended: stop this one at once
    } else {
      stop_[static_cast<size_t>(index)] = callback;
    }
  }
  if (now && callback) callback();
}

bool FanOut::mark_done_locked(int32_t index) {
  const auto i = static_cast<size_t>(index);
  if (child_done_[i]) return false;
  child_done_[i] = true;
  stop_[i] = nullptr;
  ++answered_;
  return true;
}

void FanOut::stop_others_locked(int32_t except, std::vector<std::function<void()>>& out) {
  for (int32_t i = 0; i < choices_; ++i) {
    if (i == except || child_done_[static_cast<size_t>(i)]) continue;
    if (stop_[static_cast<size_t>(i)]) out.push_back(std::move(stop_[static_cast<size_t>(i)]));
    stop_[static_cast<size_t>(i)] = nullptr;
  }
}

void FanOut::fail_locked(int32_t index, int status, const std::string& content_type, const std::string& body,
                         std::map<std::string, std::string> headers, std::vector<std::function<void()>>& stop) {
  done_ = true;
  stop_others_locked(index, stop);
  if (client_streaming_) {  // the stream has begun: the error as its last event
    client_->send("data: " + body + "\n\ndata: [DONE]\n\n");
    client_->end();
  } else {
    client_->respond(status, content_type, body, std::move(headers));
  }
}

void FanOut::respond(int32_t index, int status, const std::string& content_type, std::string body,
                     std::map<std::string, std::string> headers) {
  std::vector<std::function<void()>> stop;
  {
    std::lock_guard lock(mu_);
    if (!mark_done_locked(index) || done_) return;
    const auto i = static_cast<size_t>(index);
    if (status != 200) {
      fail_locked(index, status, content_type, body, std::move(headers), stop);
    } else {
      bodies_[i] = std::move(body);
      if (answered_ == choices_) {
        done_ = true;
        client_->respond(200, content_type, merge_bodies(bodies_, n_), std::move(headers));
      }
    }
  }
  run(stop);
}

void FanOut::start_stream(int32_t, int status, const std::string& content_type) {
  std::lock_guard lock(mu_);
  if (done_ || client_streaming_) return;
  if (admitting_) {
    stream_status_ = status;
    stream_type_ = content_type;
    return;
  }
  client_streaming_ = true;
  client_->start_stream(status, content_type);
}

void FanOut::admitted() {
  std::lock_guard lock(mu_);
  admitting_ = false;
  if (done_ || client_streaming_ || stream_status_ == 0) return;
  client_streaming_ = true;
  client_->start_stream(stream_status_, stream_type_);
}

void FanOut::send(int32_t index, std::string chunk) {
  std::vector<std::function<void()>> stop;
  {
    std::lock_guard lock(mu_);
    if (done_ || child_done_[static_cast<size_t>(index)]) return;
    std::string error;
    std::string events = reindex_events(chunk, index, id_, index % std::max(n_, 1) == 0, usage_, error);
    if (header_.is_null() && !events.empty()) {  // the merged stream takes the first event's id, model, ...
      auto j = nlohmann::json::parse(events.substr(6, events.find("\n\n") - 6), nullptr, false);
      if (j.is_object()) {
        header_ = nlohmann::json::object();
        for (const char* k : {"id", "object", "created", "model"}) {
          if (j.contains(k)) header_[k] = j[k];
        }
        if (j.contains("id") && j["id"].is_string()) id_ = j["id"].get<std::string>();
      }
    }
    if (!events.empty()) client_->send(std::move(events));
    if (!error.empty()) {  // a choice's stream ended in an error event: the group's does too
      mark_done_locked(index);
      fail_locked(index, 500, "application/json", error, {}, stop);
    }
  }
  run(stop);
}

void FanOut::end(int32_t index) {
  std::lock_guard lock(mu_);
  if (!mark_done_locked(index) || done_ || answered_ < choices_) return;
  done_ = true;
  std::string tail;
  if (include_usage_ && !usage_.is_null()) {
    nlohmann::json u = header_.is_null() ? nlohmann::json::object() : header_;
    u["choices"] = nlohmann::json::array();
    u["usage"] = usage_;
    tail += "data: " + dump_json(u) + "\n\n";
  }
  client_->send(tail + "data: [DONE]\n\n");
  client_->end();
}

}  // namespace troupe::gateway
