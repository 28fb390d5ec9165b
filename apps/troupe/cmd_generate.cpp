// troupe generate --model DIR --ids 5,17,300 --max-tokens N [--out FILE.npy]
// Runs a prompt through the serving engine (paged pools, radix prefix cache, chunked
// prefill, the decode path) without HTTP, and prints the sampled ids, one line per run.
// --out writes the logits rows of the first run: row t is the distribution after token t
// of prompt + generated (the last generated token is not fed), [prompt + N - 1, vocab].
// --repeat runs the same request again after each finishes: later runs start from the
// prefix cache, and with greedy sampling must sample the same ids.
#include <iostream>
#include <map>

#include "apps/troupe/commands.hpp"
#include "apps/troupe/model_args.hpp"
#include "base/error.hpp"
#include "base/npy.hpp"
#include "engine/engine.hpp"
#include "model/forward.hpp"

namespace troupe::app {

Command add_generate(CLI::App& app) {
  struct Opts {
    std::string model, ids, out;
    BackendArgs backend;
    int32_t max_tokens = 16;
    int64_t step_tokens = 512, max_chunk = 0, page_tokens = 0;
    float temperature = 0.0f;
    uint64_t seed = 0;
    bool ignore_eos = false;
    int repeat = 1;
    int decode_batch = -1;
    bool stats = false;
  };
  auto o = std::make_shared<Opts>();
  auto* cmd = app.add_subcommand("generate", "sample from a prompt of token ids through the serving engine (no HTTP)");
  cmd->add_option("--model", o->model, "model directory (config.json + safetensors)")->required();
  cmd->add_option("--ids", o->ids, "the prompt: comma-separated token ids")->required();
  cmd->add_option("--max-tokens", o->max_tokens, "tokens to sample")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--out", o->out, "write the first run's logits rows as .npy");
  add_backend_options(cmd, o->backend);
  cmd->add_option("--step-tokens", o->step_tokens, "tokens per engine step")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--max-chunk", o->max_chunk, "prefill tokens per step for the request (0: the step budget)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  cmd->add_option("--page-tokens", o->page_tokens, "tokens per cache page (0: the default)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  cmd->add_option("--decode-batch", o->decode_batch,
                  "decode steps through model::Decoder for up to this many sequences (-1: the backend's default, "
                  "64 with CUDA graphs, 0 on the CPU; 0: off)")
      ->check(CLI::Range(-1, 4096));
  cmd->add_option("--temperature", o->temperature, "0: greedy")->check(CLI::Range(0.0f, 2.0f));
  cmd->add_option("--seed", o->seed, "sampling seed");
  cmd->add_flag("--ignore-eos", o->ignore_eos, "EOS ids are ordinary tokens (always sample --max-tokens)");
  cmd->add_flag("--stats", o->stats, "print the engine's counters to stderr at the end");
  cmd->add_option("--repeat", o->repeat, "runs of the request, one after another (later ones from the prefix cache)")
      ->check(CLI::Range(1, 100));
  return [o] {
    const auto prompt = parse_token_ids(o->ids);
    auto loaded = load_model(o->model, o->backend, prompt);
    auto& model = loaded.model;
    const int64_t V = model->config().vocab_size;
    engine::EngineOptions eo;
    eo.step_tokens = o->step_tokens;
    eo.page_tokens = o->page_tokens;
    eo.decode_batch = o->decode_batch;
    engine::Engine eng(*model, eo);
    for (int run = 0; run < o->repeat; ++run) {
      engine::Request r;
      r.prompt = prompt;
      r.sampling.temperature = o->temperature;
      r.sampling.seed = o->seed;
      r.sampling.max_tokens = o->max_tokens;
      r.sampling.ignore_eos = o->ignore_eos;
      r.max_chunk_tokens = o->max_chunk;
      const bool rows_wanted = run == 0 && !o->out.empty();
      r.logits = rows_wanted ? engine::LogitsMode::all : engine::LogitsMode::none;
      eng.submit(std::move(r));
      eng.run_until_idle();
      std::vector<int32_t> generated;
      std::map<int64_t, std::vector<float>> rows;
      for (auto& e : eng.take_events()) {
        if (e.kind == engine::EventKind::token) {
          generated.push_back(e.token);
          if (!e.logits.empty()) rows[e.position - 1] = std::move(e.logits);
        } else if (e.kind == engine::EventKind::logits) {
          const auto n = static_cast<int64_t>(e.logits.size()) / V;
          for (int64_t i = 0; i < n; ++i) {
            rows[e.position + i].assign(e.logits.begin() + i * V, e.logits.begin() + (i + 1) * V);
          }
        } else if (e.kind == engine::EventKind::finished && e.reason == engine::FinishReason::error) {
          raise(e.code, "the request failed: {}", e.message);
        }
      }
      for (size_t i = 0; i < generated.size(); ++i) std::cout << (i ? "," : "") << generated[i];
      std::cout << "\n";
      if (rows_wanted) {
        const auto n = static_cast<int64_t>(prompt.size() + generated.size()) - 1;
        std::vector<float> all;
        all.reserve(static_cast<size_t>(n * V));
        for (int64_t t = 0; t < n; ++t) {
          auto it = rows.find(t);
          if (it == rows.end()) raise(ErrorCode::internal, "the engine gave no logits row for position {}", t);
          all.insert(all.end(), it->second.begin(), it->second.end());
        }
        write_npy_f32(o->out, all.data(), {n, V});
      }
    }
    if (o->stats) {
      const auto st = eng.stats();
      std::cerr << "engine: " << st.steps << " steps, " << st.prefill_tokens << " prefill and " << st.decode_tokens
                << " decode tokens, " << st.decoder_steps << " decoder steps (" << st.graph_replays
                << " graph replays), " << st.cached_tokens << " tokens from the prefix cache\n";
    }
    return 0;
  };
}

}  // namespace troupe::app
