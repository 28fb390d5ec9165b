// The C++ client library and `troupe client` against a server process
// running the test service over real frames and TCP.
#include <gtest/gtest.h>

#include <thread>

#include "clients/client.hpp"
#include "tests/transport/child.hpp"
#include "tests/transport/test_service.hpp"

namespace troupe::test {
namespace {

using namespace std::chrono_literals;
using clients::Client;
using clients::GenerateOptions;

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<Child>(std::vector<std::string>{server_binary(), "--token-interval-ms", "1"},
                                      log_path("client_test_server"));
    port_ = static_cast<uint16_t>(std::stoi(Child::field(server_->read_line(), "tcp")));
    auto c = Client::connect("127.0.0.1", port_);
    ASSERT_TRUE(c.ok()) << c.error().what();
    client_ = std::move(*c);
  }
  std::unique_ptr<Child> server_;
  uint16_t port_ = 0;
  std::unique_ptr<Client> client_;
};

std::vector<uint32_t> expected_tokens(uint64_t base, uint64_t seed, uint32_t n) {
  std::vector<uint32_t> v;
  for (uint32_t i = 0; i < n; ++i) v.push_back(test_token(base, seed, i));
  return v;
}

TEST_F(ClientTest, list_models) {
  auto m = client_->list_models();
  ASSERT_TRUE(m.ok()) << m.error().what();
  ASSERT_EQ(m->size(), 1u);
  EXPECT_EQ((*m)[0].id, kTestModel);
  EXPECT_EQ((*m)[0].vocab_size, kTestVocab);
}

TEST_F(ClientTest, generate_streams_the_deterministic_sequence) {
  GenerateOptions o;
  o.prompt = std::vector<uint32_t>{1, 2, 3};
  o.max_tokens = 20;
  o.return_token_ids = true;
  o.seed = 9;
  std::vector<uint32_t> indices;
  auto g = client_->generate(o, [&](const clients::Chunk& c) { indices.push_back(c.index); });
  ASSERT_TRUE(g.ok()) << g.error().what();
  EXPECT_EQ(g->token_ids, expected_tokens(6, 9, 20));
  EXPECT_EQ(g->finish.reason, clients::FinishReason::length);
  EXPECT_EQ(g->finish.completion_tokens, 20u);
  EXPECT_EQ(g->finish.prompt_tokens, 3u);
  for (uint32_t i = 0; i < 20; ++i) EXPECT_EQ(indices[i], i);
  EXPECT_EQ(g->text.substr(0, 1), "t");
}

TEST_F(ClientTest, stop_token_ends_the_stream_with_reason_stop) {
  GenerateOptions o;
  o.prompt = std::vector<uint32_t>{10};
  o.max_tokens = 50;
  o.stop_token_ids = {test_token(10, 0, 4)};
  o.return_token_ids = true;
  auto g = client_->generate(o);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->finish.reason, clients::FinishReason::stop);
  EXPECT_EQ(g->token_ids.size(), 5u);
}

TEST_F(ClientTest, bad_requests_get_errors) {
  GenerateOptions o;
  o.prompt = std::string("hi");
  o.max_tokens = 0;
  auto g = client_->generate(o);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.error().code(), ErrorCode::invalid_argument);
  o.max_tokens = 4;
  o.model = "gpt-17";
  g = client_->generate(o);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.error().code(), ErrorCode::not_found);
  o.model = "";
  o.prompt = std::string();
  EXPECT_EQ(client_->generate(o).error().code(), ErrorCode::invalid_argument);
  // The connection still works.
  o.prompt = std::vector<clients::ChatTurn>{{"user", "hello"}};
  EXPECT_TRUE(client_->generate(o).ok());
}

TEST_F(ClientTest, abort_ends_a_stream_with_reason_aborted) {
  GenerateOptions o;
  o.prompt = std::string("a long one");
  o.max_tokens = 100000;
  auto id = client_->submit(o);
  ASSERT_TRUE(id.ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(std::holds_alternative<clients::Chunk>(*client_->next(*id, 5s)));
  ASSERT_TRUE(client_->abort(*id).ok());
  for (;;) {
    auto ev = client_->next(*id, 5s);
    ASSERT_TRUE(ev.ok()) << ev.error().what();
    if (auto* f = std::get_if<clients::Finished>(&*ev)) {
      EXPECT_EQ(f->reason, clients::FinishReason::aborted);
      break;
    }
  }
}

TEST_F(ClientTest, park_pauses_and_resume_continues_the_stream) {
  GenerateOptions o;
  o.prompt = std::string("park me");
  o.max_tokens = 40;
  auto id = client_->submit(o);
  ASSERT_TRUE(id.ok());
  std::vector<uint32_t> idx;
  auto ev = client_->next(*id, 5s);
  idx.push_back(std::get<clients::Chunk>(*ev).index);
  ASSERT_TRUE(client_->park(*id).ok());
  for (;;) {  // chunks already on the wire, then the Ack
    ev = client_->next(*id, 5s);
    ASSERT_TRUE(ev.ok());
    if (std::holds_alternative<clients::Acked>(*ev)) break;
    idx.push_back(std::get<clients::Chunk>(*ev).index);
  }
  EXPECT_EQ(std::get<clients::Acked>(*ev).of, "Park");
  auto quiet = client_->next(*id, 200ms);
  ASSERT_FALSE(quiet.ok());
  EXPECT_EQ(quiet.error().code(), ErrorCode::deadline_exceeded);
  ASSERT_TRUE(client_->resume(*id).ok());
  ev = client_->next(*id, 5s);
  EXPECT_EQ(std::get<clients::Acked>(*ev).of, "Resume");
  for (;;) {
    ev = client_->next(*id, 5s);
    ASSERT_TRUE(ev.ok());
    if (auto* f = std::get_if<clients::Finished>(&*ev)) {
      EXPECT_EQ(f->completion_tokens, 40u);
      EXPECT_EQ(f->parks, 1u);
      break;
    }
    idx.push_back(std::get<clients::Chunk>(*ev).index);
  }
  ASSERT_EQ(idx.size(), 40u);
  for (uint32_t i = 0; i < 40; ++i) EXPECT_EQ(idx[i], i);
}

TEST_F(ClientTest, concurrent_streams_on_one_connection) {
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < 5; ++k) {
        GenerateOptions o;
        o.prompt = std::vector<uint32_t>{static_cast<uint32_t>(t), static_cast<uint32_t>(k)};
        o.max_tokens = 10;
        o.return_token_ids = true;
        auto g = client_->generate(o);
        if (g.ok() && g->token_ids == expected_tokens(t + k, 0, 10)) ++ok;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok, 40);
}

TEST_F(ClientTest, a_dead_server_is_an_error_not_a_hang) {
  GenerateOptions o;
  o.prompt = std::string("x");
  o.max_tokens = 100000;
  auto id = client_->submit(o);
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(client_->next(*id, 5s).ok());
  server_->kill9();
  for (;;) {
    auto ev = client_->next(*id, 5s);
    if (!ev.ok()) {
      EXPECT_EQ(ev.error().code(), ErrorCode::unavailable);
      break;
    }
  }
  EXPECT_FALSE(client_->connected());
  EXPECT_FALSE(client_->submit(o).ok());
}

TEST_F(ClientTest, troupe_client_cli_streams_and_lists) {
  std::string troupe = std::string(TROUPE_BINARY_DIR) + "/bin/troupe";
  std::string at = "127.0.0.1:" + std::to_string(port_);
  Child gen({troupe, "client", "--connect", at, "generate", "--ids", "1,2,3", "--max-tokens", "5", "--seed", "9",
             "--return-token-ids"},
            log_path("client_cli"));
  std::string line;
  while ((line = gen.read_line()).rfind("ids: ", 0) != 0) {
  }
  auto want = expected_tokens(6, 9, 5);
  EXPECT_EQ(line, fmt::format("ids: {}", fmt::join(want, ",")));
  EXPECT_EQ(gen.wait(), 0);
  EXPECT_NE(gen.log().find("[finish: length; prompt 3 tokens, completion 5"), std::string::npos) << gen.log();

  Child lm({troupe, "client", "--connect", at, "list-models"}, log_path("client_cli_lm"));
  EXPECT_EQ(lm.read_line().rfind(kTestModel, 0), 0u);
  EXPECT_EQ(lm.wait(), 0);

  Child bad({troupe, "client", "--connect", at, "generate", "--prompt", "x", "--model", "nope"}, log_path("client_cli_bad"));
  EXPECT_EQ(bad.wait(), 1);
  EXPECT_NE(bad.log().find("not served here"), std::string::npos) << bad.log();
}

}  // namespace
}  // namespace troupe::test
