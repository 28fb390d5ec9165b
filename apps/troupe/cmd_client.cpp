// troupe client --connect HOST:PORT list-models
// troupe client --connect HOST:PORT generate (--prompt TEXT | --ids 1,2,3) [--max-tokens N] ...
//   Streams the text to stdout as it arrives; the finish line goes to stderr.
//   --abort-after N       abort after N tokens
//   --park-after N        park after N tokens, resume --resume-after-ms later
#include <fmt/format.h>

#include <charconv>
#include <iostream>
#include <thread>

#include "apps/troupe/commands.hpp"
#include "clients/client.hpp"

namespace troupe::app {

namespace {

struct ClientOpts {
  std::string connect = "127.0.0.1:7400";
  int timeout_s = 120;
  clients::GenerateOptions gen;
  std::string prompt;
  std::vector<uint32_t> ids;
  std::optional<uint64_t> seed;
  std::vector<std::string> logit_bias;  // TOKEN:BIAS
  uint32_t abort_after = 0, park_after = 0;
  int resume_after_ms = 200;
  bool print_ids = false;
};

int list_models(clients::Client& c) {
  auto models = c.list_models();
  if (!models) throw models.error();
  for (auto& m : *models) {
    std::cout << fmt::format("{}\towned_by={}\tmax_context={}\tvocab={}\n", m.id, m.owned_by, m.max_context, m.vocab_size);
  }
  return 0;
}

int generate(clients::Client& c, ClientOpts& o) {
  if (!o.ids.empty()) {
    o.gen.prompt = o.ids;
  } else {
    o.gen.prompt = o.prompt;
  }
  o.gen.seed = o.seed;
  if (o.print_ids) o.gen.return_token_ids = true;
  auto id = c.submit(o.gen);
  if (!id) throw id.error();
  uint32_t tokens = 0;
  bool parked = false;
  std::vector<uint32_t> all_ids;
  for (;;) {
    auto ev = c.next(*id, std::chrono::seconds(o.timeout_s));
    if (!ev) throw ev.error();
    if (auto* ch = std::get_if<clients::Chunk>(&*ev)) {
      std::cout << ch->text << std::flush;
      all_ids.insert(all_ids.end(), ch->token_ids.begin(), ch->token_ids.end());
      ++tokens;
      if (o.abort_after && tokens == o.abort_after) (void)c.abort(*id, "troupe client --abort-after");
      if (o.park_after && tokens == o.park_after && !parked) {
        parked = true;
        (void)c.park(*id, "troupe client --park-after");
      }
    } else if (auto* ack = std::get_if<clients::Acked>(&*ev)) {
      std::cerr << fmt::format("\n[{} acknowledged: {}]\n", ack->of, ack->detail);
      if (ack->of == "Park") {
        std::this_thread::sleep_for(std::chrono::milliseconds(o.resume_after_ms));
        (void)c.resume(*id);
      }
    } else if (auto* fin = std::get_if<clients::Finished>(&*ev)) {
      std::cout << "\n";
      if (o.print_ids) std::cout << fmt::format("ids: {}\n", fmt::join(all_ids, ","));
      std::cerr << fmt::format("[finish: {}; prompt {} tokens, completion {}, cached {}, parks {}]\n",
                               clients::to_string(fin->reason), fin->prompt_tokens, fin->completion_tokens,
                               fin->cached_tokens, fin->parks);
      return 0;
    } else {
      throw std::get<Error>(*ev);
    }
  }
}

}  // namespace

Command add_client(CLI::App& app) {
  auto o = std::make_shared<ClientOpts>();
  auto* cmd = app.add_subcommand("client", "talk troupe frames to a troupe endpoint over TCP");
  cmd->add_option("--connect", o->connect, "HOST:PORT of the endpoint");
  cmd->add_option("--timeout", o->timeout_s, "seconds to wait for each answer");
  cmd->require_subcommand(1);
  auto* lm = cmd->add_subcommand("list-models", "list the models the endpoint serves");
  auto* gen = cmd->add_subcommand("generate", "submit one request and stream its tokens");
  gen->add_option("--prompt", o->prompt, "prompt text");
  gen->add_option("--ids", o->ids, "prompt as token ids")->delimiter(',');
  gen->add_option("--model", o->gen.model, "model id (default: the server's)");
  gen->add_option("--max-tokens", o->gen.max_tokens, "tokens to generate");
  gen->add_option("--min-tokens", o->gen.min_tokens, "never stop before this many");
  gen->add_option("--temperature", o->gen.temperature, "0 = greedy");
  gen->add_option("--top-p", o->gen.top_p, "nucleus mass");
  gen->add_option("--top-k", o->gen.top_k, "0 = off");
  gen->add_option("--min-p", o->gen.min_p, "0 .. 1; 0 = off");
  gen->add_option("--json-schema", o->gen.json_schema,
                  "the answer is JSON under this JSON Schema (its text; '{}' any value, '{\"type\": \"object\"}' "
                  "an object)");
  gen->add_option("--regex", o->gen.regex,
                  "the answer is a text this regular expression (ECMAScript syntax) matches whole");
  gen->add_option("--ebnf", o->gen.ebnf, "the answer is a text this EBNF grammar (GBNF syntax) derives from its rule root");
  gen->add_option("--seed", o->seed, "sampling seed");
  gen->add_option("--repetition-penalty", o->gen.repetition_penalty, "> 0; 1 = off");
  gen->add_option("--frequency-penalty", o->gen.frequency_penalty, "-2 .. 2; 0 = off");
  gen->add_option("--presence-penalty", o->gen.presence_penalty, "-2 .. 2; 0 = off");
  gen->add_option("--logit-bias", o->logit_bias, "TOKEN:BIAS (bias in -100 .. 100), comma-separated")->delimiter(',');
  gen->add_option("--stop", o->gen.stop, "stop strings");
  gen->add_option("--stop-ids", o->gen.stop_token_ids, "stop token ids")->delimiter(',');
  gen->add_flag("--ignore-eos", o->gen.ignore_eos, "keep going past end-of-sequence");
  gen->add_flag("--return-token-ids", o->print_ids, "print the generated ids");
  gen->add_option("--priority", o->gen.priority, "larger runs first under pressure");
  gen->add_option("--abort-after", o->abort_after, "abort after this many tokens");
  gen->add_option("--park-after", o->park_after, "park after this many tokens, then resume");
  gen->add_option("--resume-after-ms", o->resume_after_ms, "delay before resuming a parked request");
  return [o, lm, gen] {
    auto colon = o->connect.rfind(':');
    unsigned port = 0;
    const char* p = o->connect.c_str() + (colon == std::string::npos ? 0 : colon + 1);
    auto [end, ec] = std::from_chars(p, o->connect.c_str() + o->connect.size(), port);
    if (colon == std::string::npos || ec != std::errc() || *end != '\0' || port == 0 || port > 65535) {
      raise(ErrorCode::invalid_argument, "--connect wants HOST:PORT, got {}", o->connect);
    }
    auto c = clients::Client::connect(o->connect.substr(0, colon), static_cast<uint16_t>(port));
    if (!c) throw c.error();
    if (lm->parsed()) return list_models(**c);
    if (gen->parsed()) {
      if (o->prompt.empty() && o->ids.empty()) raise(ErrorCode::invalid_argument, "generate needs --prompt or --ids");
      for (const auto& e : o->logit_bias) {
        const auto sep = e.find(':');
        uint32_t token = 0;
        float bias = 0;
        const char* t = e.c_str();
        const auto [t_end, t_ec] = std::from_chars(t, t + (sep == std::string::npos ? e.size() : sep), token);
        bool ok = sep != std::string::npos && t_ec == std::errc() && t_end == t + sep;
        if (ok) {
          const auto [b_end, b_ec] = std::from_chars(t + sep + 1, t + e.size(), bias);
          ok = b_ec == std::errc() && b_end == t + e.size() && sep + 1 < e.size();
        }
        if (!ok) raise(ErrorCode::invalid_argument, "--logit-bias wants TOKEN:BIAS, got '{}'", e);
        o->gen.logit_bias.emplace_back(token, bias);
      }
      return generate(**c, *o);
    }
    return 2;
  };
}

}  // namespace troupe::app
