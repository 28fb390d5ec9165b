// The gateway puts a request's tokens back in order when two workers in two
// processes stream it (PD: the prefill worker's first token, the decode
// worker's rest) and their messages cross: a batch past a gap waits for the
// one before it, a Done waits for its last token, and tokens that never come
// make the request run again from what the client has. A scripted router
// plays the workers, so the order is exactly the one under test.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <mutex>
#include <nlohmann/json.hpp>

#include "actors/gateway/gateway.hpp"
#include "model/tokenizer/default_tokenizer.hpp"
#include "model/tokenizer/tokenizer.hpp"

namespace troupe::actors {
namespace {

using namespace std::chrono_literals;

// What the scripted router saw.
struct Seen {
  std::mutex mu;
  std::vector<Job> jobs;
};

caf::behavior idle_worker(caf::event_based_actor* self) {
  self->set_default_handler(caf::drop);
  return {[](abort_atom, RequestId) {}};
}

// A router whose "workers" answer each Job with `script(job, prefill, decode)`'s messages, in that order.
using Script = std::function<std::vector<caf::message>(const Job&, const caf::actor&, const caf::actor&)>;

caf::behavior scripted_router(caf::event_based_actor* self, std::shared_ptr<Seen> seen, Script script) {
  auto prefill = self->spawn(idle_worker);
  auto decode = self->spawn(idle_worker);
  self->attach_functor([prefill, decode] {
    caf::anon_send_exit(prefill, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(decode, caf::exit_reason::user_shutdown);
  });
  return {
      [=](const Job& job) {
        {
          std::lock_guard lock(seen->mu);
          seen->jobs.push_back(job);
        }
        for (auto& m : script(job, prefill, decode)) self->send(caf::actor_cast<caf::actor>(job.reply_to), m);
      },
      [](workers_atom) { return std::vector<WorkerLoad>{}; },
  };
}

// POST a body to 127.0.0.1:port; the whole response (status line, headers, body).
std::string post(uint16_t port, const std::string& path, const std::string& body) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return "";
  }
  const std::string req = "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          "Connection: close\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  (void)::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return out;
}

class GatewayOrder : public ::testing::Test {
 protected:
  void start(Script script, std::chrono::milliseconds gap_timeout = 10s) {
    cfg_.set("scheduler.max-threads", 2);
    cfg_.set("logger.verbosity", caf::atom("quiet"));
    system_ = std::make_unique<caf::actor_system>(cfg_);
    auto tok = std::shared_ptr<const tokenizer::Tokenizer>(tokenizer::Tokenizer::load(tokenizer::default_tokenizer_dir()));
    router_ = system_->spawn(scripted_router, seen_, std::move(script));
    GatewayConfig gc;
    gc.model_name = "m";
    gc.token_gap_timeout = gap_timeout;
    metrics_ = std::make_shared<MetricsRegistry>();
    gateway_ = spawn_gateway(*system_, gc, tok, router_, metrics_, &port_);
  }
  void TearDown() override {
    for (auto* a : {&gateway_, &router_}) {
      if (*a) caf::anon_send_exit(*a, caf::exit_reason::user_shutdown);
      *a = nullptr;
    }
    if (system_) system_->await_all_actors_done();
    system_.reset();
  }
  // The completion's token ids and finish reason (or the raw response on failure).
  std::pair<std::vector<int32_t>, std::string> complete(int max_tokens) {
    const auto body = nlohmann::json{{"model", "m"}, {"prompt", std::vector<int>{5, 6, 7}}, {"max_tokens", max_tokens},
                                     {"temperature", 0}, {"return_token_ids", true}}.dump();
    const std::string r = post(port_, "/v1/completions", body);
    const auto at = r.find("\r\n\r\n");
    EXPECT_NE(r.find(" 200 "), std::string::npos) << r;
    if (at == std::string::npos) return {{}, r};
    auto j = nlohmann::json::parse(r.substr(at + 4), nullptr, false);
    if (j.is_discarded() || !j.contains("choices")) return {{}, r};
    return {j["choices"][0]["token_ids"].get<std::vector<int32_t>>(), j["choices"][0]["finish_reason"]};
  }

  caf::actor_system_config cfg_;
  std::unique_ptr<caf::actor_system> system_;
  std::shared_ptr<Seen> seen_ = std::make_shared<Seen>();
  std::shared_ptr<MetricsRegistry> metrics_;
  caf::actor router_, gateway_;
  uint16_t port_ = 0;
};

TEST_F(GatewayOrder, the_decode_workers_tokens_and_done_before_the_prefill_workers_first_token) {
  start([](const Job& job, const caf::actor& prefill, const caf::actor& decode) {
    return std::vector<caf::message>{
        caf::make_message(Assigned{job.id, prefill, "prefill", 0}),
        caf::make_message(Assigned{job.id, decode, "decode", 1}),
        caf::make_message(token_batch(job.id, 3, {103, 104}, decode)),
        caf::make_message(token_batch(job.id, 1, {101, 102}, decode)),
        caf::make_message(Done{job.id, engine::FinishReason::length, {}, decode, 5}),
        caf::make_message(token_batch(job.id, 0, {100}, prefill)),  // overtaken on its way from another process
    };
  });
  auto [ids, reason] = complete(5);
  EXPECT_EQ(ids, (std::vector<int32_t>{100, 101, 102, 103, 104}));
  EXPECT_EQ(reason, "length");
  std::lock_guard lock(seen_->mu);
  EXPECT_EQ(seen_->jobs.size(), 1u);  // nothing ran twice
}

TEST_F(GatewayOrder, tokens_that_never_come_make_the_request_run_again_from_what_the_client_has) {
  start([](const Job& job, const caf::actor& prefill, const caf::actor& decode) {
    if (job.attempt == 0) {  // token 1 is lost with its process
      return std::vector<caf::message>{
          caf::make_message(token_batch(job.id, 0, {100}, prefill)),
          caf::make_message(token_batch(job.id, 2, {102, 103}, decode)),
          caf::make_message(Done{job.id, engine::FinishReason::length, {}, decode, 4}),
      };
    }
    // Run again from the one token the client has: its prompt carries it.
    std::vector<int32_t> rest;
    for (int64_t i = job.generated_before; i < 4; ++i) rest.push_back(static_cast<int32_t>(100 + i));
    return std::vector<caf::message>{
        caf::make_message(token_batch(job.id, job.generated_before, rest, decode)),
        caf::make_message(Done{job.id, engine::FinishReason::length, {}, decode, 4}),
    };
  }, 300ms);
  const auto t0 = std::chrono::steady_clock::now();
  auto [ids, reason] = complete(4);
  EXPECT_EQ(ids, (std::vector<int32_t>{100, 101, 102, 103}));
  EXPECT_EQ(reason, "length");
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 300ms);
  std::lock_guard lock(seen_->mu);
  ASSERT_EQ(seen_->jobs.size(), 2u);
  EXPECT_EQ(seen_->jobs[1].attempt, 1);
  EXPECT_EQ(seen_->jobs[1].generated_before, 1);
  EXPECT_EQ(seen_->jobs[1].prompt, (std::vector<int32_t>{5, 6, 7, 100}));
  EXPECT_EQ(seen_->jobs[1].sampling.max_tokens, 3);
}

}  // namespace
}  // namespace troupe::actors
