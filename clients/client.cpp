#include "clients/client.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "messages/kinds.hpp"
#include "transport/tcp.hpp"

namespace troupe::clients {

using messages::Frame;
using messages::FrameBuilder;

const char* to_string(FinishReason r) {
  switch (r) {
    case FinishReason::stop: return "stop";
    case FinishReason::length: return "length";
    case FinishReason::aborted: return "aborted";
    case FinishReason::error: return "error";
  }
  return "?";
}

Expected<std::unique_ptr<Client>> Client::connect(const std::string& host, uint16_t port,
                                                  std::chrono::milliseconds timeout) {
  // Answers are small; anything near this limit is a broken server.
  messages::FrameLimits limits;
  limits.max_body_bytes = 64u << 20;
  auto s = transport::TcpFrameSocket::connect(host, port, timeout, limits);
  if (!s) return s.error();
  return std::unique_ptr<Client>(new Client(std::move(*s)));
}

Client::Client(std::unique_ptr<transport::TcpFrameSocket> socket) : socket_(std::move(socket)) {
  reader_ = std::thread([this] { read_loop(); });
}

Client::~Client() {
  socket_->close();
  reader_.join();
}

bool Client::connected() const {
  std::lock_guard lock(mu_);
  return !closed_;
}

void Client::read_loop() {
  for (;;) {
    auto f = socket_->receive(std::chrono::hours(24));
    if (!f && f.error().code() == ErrorCode::deadline_exceeded) continue;
    std::lock_guard lock(mu_);
    if (!f) {
      closed_ = f.error();
      cv_.notify_all();
      return;
    }
    auto it = inbox_.find(f->request_id());
    if (it == inbox_.end()) {
      spdlog::debug("client: frame for request {} that is not ours, ignored", f->request_id());
      continue;
    }
    it->second.push_back(std::move(*f));
    cv_.notify_all();
  }
}

Status Client::send(const Frame& frame) {
  if (auto s = socket_->send(frame); !s) return s;
  return messages::Ok{};
}

Expected<Frame> Client::wait_frame(uint64_t request_id, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  auto it = inbox_.find(request_id);
  if (it == inbox_.end()) return Error(ErrorCode::not_found, fmt::format("request {} is not open", request_id));
  bool ready = cv_.wait_for(lock, timeout, [&] { return !it->second.empty() || closed_; });
  if (!it->second.empty()) {
    Frame f = std::move(it->second.front());
    it->second.pop_front();
    return f;
  }
  if (closed_) return Error(ErrorCode::unavailable, fmt::format("connection closed: {}", closed_->what()));
  (void)ready;
  return Error(ErrorCode::deadline_exceeded, fmt::format("no answer for request {} in time", request_id));
}

Expected<uint64_t> Client::submit(const GenerateOptions& o) {
  FrameBuilder<msg::GenerateRequest> b;
  auto r = b.root();
  r.setModel(o.model);
  if (auto* text = std::get_if<std::string>(&o.prompt)) {
    r.getPrompt().setText(messages::wire_text(*text));
  } else if (auto* ids = std::get_if<std::vector<uint32_t>>(&o.prompt)) {
    auto l = r.getPrompt().initTokenIds(ids->size());
    for (size_t i = 0; i < ids->size(); ++i) l.set(i, (*ids)[i]);
  } else {
    auto& turns = std::get<std::vector<ChatTurn>>(o.prompt);
    auto l = r.getPrompt().initChat(turns.size());
    for (size_t i = 0; i < turns.size(); ++i) {
      l[i].setRole(turns[i].role);
      l[i].setContent(messages::wire_text(turns[i].content));
    }
  }
  auto s = r.initSampling();
  s.setTemperature(o.temperature);
  s.setTopP(o.top_p);
  s.setTopK(o.top_k);
  s.setMinP(o.min_p);
  s.setJsonSchema(messages::wire_text(o.json_schema));
  s.setRegex(messages::wire_text(o.regex));
  s.setEbnf(messages::wire_text(o.ebnf));
  if (o.seed) s.getSeed().setValue(*o.seed);
  s.setRepetitionPenalty(o.repetition_penalty);
  s.setFrequencyPenalty(o.frequency_penalty);
  s.setPresencePenalty(o.presence_penalty);
  auto bias = s.initLogitBias(static_cast<unsigned>(o.logit_bias.size()));
  for (size_t i = 0; i < o.logit_bias.size(); ++i) {
    bias[static_cast<unsigned>(i)].setToken(o.logit_bias[i].first);
    bias[static_cast<unsigned>(i)].setBias(o.logit_bias[i].second);
  }
  r.setMaxTokens(o.max_tokens);
  r.setMinTokens(o.min_tokens);
  auto stops = r.initStopStrings(o.stop.size());
  for (size_t i = 0; i < o.stop.size(); ++i) stops.set(i, o.stop[i]);
  auto stop_ids = r.initStopTokenIds(o.stop_token_ids.size());
  for (size_t i = 0; i < o.stop_token_ids.size(); ++i) stop_ids.set(i, o.stop_token_ids[i]);
  r.setIgnoreEos(o.ignore_eos);
  r.setReturnTokenIds(o.return_token_ids);
  r.setPriority(o.priority);
  if (o.deadline) {
    r.setDeadlineUnixNanos(std::chrono::duration_cast<std::chrono::nanoseconds>(o.deadline->time_since_epoch()).count());
  }
  r.setUser(o.user);
  uint64_t id;
  {
    std::lock_guard lock(mu_);
    if (closed_) return Error(ErrorCode::unavailable, fmt::format("connection closed: {}", closed_->what()));
    id = next_id_++;
    inbox_[id];
  }
  if (auto st = send(b.finish(id)); !st) return st.error();
  return id;
}

Expected<Event> Client::next(uint64_t request_id, std::chrono::milliseconds timeout) {
  auto f = wait_frame(request_id, timeout);
  if (!f) return f.error();
  auto end_stream = [&] {
    std::lock_guard lock(mu_);
    inbox_.erase(request_id);
  };
  switch (f->kind()) {
    case msg::Kind::TOKEN_CHUNK: {
      auto v = messages::open<msg::TokenChunk>(*f);
      if (!v) return v.fault().error;
      Chunk c;
      c.index = v->root().getIndex();
      for (auto id : v->root().getTokenIds()) c.token_ids.push_back(id);
      c.text = messages::text(v->root().getText());
      return Event(std::move(c));
    }
    case msg::Kind::FINISH: {
      end_stream();
      auto v = messages::open<msg::Finish>(*f);
      if (!v) return v.fault().error;
      auto r = v->root();
      Finished fin;
      fin.reason = static_cast<FinishReason>(static_cast<int>(r.getReason()));
      fin.prompt_tokens = r.getPromptTokens();
      fin.completion_tokens = r.getCompletionTokens();
      fin.cached_tokens = r.getCachedTokens();
      fin.parks = r.getParks();
      fin.matched_stop = messages::text(r.getMatchedStop());
      return Event(std::move(fin));
    }
    case msg::Kind::ACK: {
      auto v = messages::open<msg::Ack>(*f);
      if (!v) return v.fault().error;
      return Event(Acked{messages::kind_name(v->root().getOfKind()), v->root().getDetail().cStr()});
    }
    case msg::Kind::ERROR: {
      auto v = messages::open<msg::Error>(*f);
      if (!v) return v.fault().error;
      // An Error about a control frame (abort/park/resume of a finished
      // request) does not end the stream; one about the request does.
      auto about = v->root().getFrameKind();
      if (about == msg::Kind::GENERATE_REQUEST || about == msg::Kind::NONE) end_stream();
      return Event(Error(messages::from_wire(v->root().getCode()), v->root().getMessage().cStr()));
    }
    default:
      return Error(ErrorCode::invalid_argument,
                   fmt::format("unexpected {} frame for request {}", messages::kind_name(f->kind()), request_id));
  }
}

Expected<Generation> Client::generate(const GenerateOptions& options, const std::function<void(const Chunk&)>& on_chunk,
                                      std::chrono::milliseconds timeout) {
  auto id = submit(options);
  if (!id) return id.error();
  Generation g;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    auto ev = next(*id, std::max(left, std::chrono::milliseconds(0)));
    if (!ev) {
      if (ev.error().code() == ErrorCode::deadline_exceeded) (void)abort(*id, "client timeout");
      return ev.error();
    }
    if (auto* c = std::get_if<Chunk>(&*ev)) {
      g.text += c->text;
      g.token_ids.insert(g.token_ids.end(), c->token_ids.begin(), c->token_ids.end());
      if (on_chunk) on_chunk(*c);
    } else if (auto* fin = std::get_if<Finished>(&*ev)) {
      g.finish = *fin;
      return g;
    } else if (auto* e = std::get_if<Error>(&*ev)) {
      return *e;
    }
  }
}

namespace {
template <class T>
Frame control_frame(uint64_t id, const std::string& reason) {
  FrameBuilder<T> b;
  if constexpr (!std::is_same_v<T, msg::Resume>) b.root().setReason(reason);
  return b.finish(id);
}
}  // namespace

Status Client::abort(uint64_t id, const std::string& reason) { return send(control_frame<msg::Abort>(id, reason)); }
Status Client::park(uint64_t id, const std::string& reason) { return send(control_frame<msg::Park>(id, reason)); }
Status Client::resume(uint64_t id) { return send(control_frame<msg::Resume>(id, "")); }

Expected<std::vector<ModelInfo>> Client::list_models(std::chrono::milliseconds timeout) {
  uint64_t id;
  {
    std::lock_guard lock(mu_);
    id = next_id_++;
    inbox_[id];
  }
  if (auto s = send(FrameBuilder<msg::ListModels>().finish(id)); !s) return s.error();
  auto f = wait_frame(id, timeout);
  {
    std::lock_guard lock(mu_);
    inbox_.erase(id);
  }
  if (!f) return f.error();
  if (f->kind() == msg::Kind::ERROR) {
    auto v = messages::open<msg::Error>(*f);
    return Error(messages::from_wire(v->root().getCode()), v->root().getMessage().cStr());
  }
  auto v = messages::open<msg::ModelList>(*f);
  if (!v) return v.fault().error;
  std::vector<ModelInfo> out;
  for (auto m : v->root().getModels()) {
    out.push_back({m.getId().cStr(), m.getOwnedBy().cStr(), m.getMaxContext(), m.getVocabSize()});
  }
  return out;
}

}  // namespace troupe::clients
