// troupe serve [--model DIR] [--port N] ...: every actor in one process.
#include "actors/serve.hpp"
#include "apps/troupe/commands.hpp"

#include <cmath>
#include <cstdlib>
#include <string>

namespace troupe::app {

Command add_serve(CLI::App& app) {
  auto o = std::make_shared<actors::ServeOptions>();
  auto kv_mib = std::make_shared<int64_t>(1024);
  auto host_mib = std::make_shared<int64_t>(0);
  auto body_mib = std::make_shared<double>(8);
  auto restart_window_s = std::make_shared<int64_t>(60);
  auto long_tail = std::make_shared<bool>(false);
  auto lt = std::make_shared<actors::LongTailPolicy>();
  auto sp = std::make_shared<actors::ScaleRule>();
  sp->max_workers = 0;
  sp->queue_depth_high = 8;
  sp->kv_use_low = 0.2;
  auto scale_cooldown_s = std::make_shared<int64_t>(10);
  auto frame_port = std::make_shared<int>(-1);
  // CLI11's Range lets NaN through (no comparison fails): a finite positive size, at most 1 TiB.
  const CLI::Validator positive_mib(
      [](std::string& in) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(in.c_str(), &end);
        if (end == in.c_str() || *end != '\0' || !std::isfinite(v) || v <= 0 || v > 1048576.0) {
          return "must be a number of MiB above 0 and at most 1048576, got " + in;
        }
        return "";
      },
      "MIB");
  auto* cmd = app.add_subcommand("serve", "serve a model over an OpenAI-compatible HTTP API and, with --frame-port, troupe frames (all actors in one process)");
  cmd->add_option("--model", o->model_dir, "model directory (default: the embedded tiny random-weight model)");
  cmd->add_option("--served-model-name", o->served_model_name, "model id clients send (default: directory name)");
  cmd->add_option("--host", o->host, "address to listen on");
  cmd->add_option("--port", o->port, "HTTP port (0: any free port)");
  cmd->add_option("--frame-port", *frame_port,
                  "also serve troupe frames (docs/messages.md; `troupe client`, clients/) on this TCP port "
                  "(0: any free port; default: off)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", o->api_key, "require 'Authorization: Bearer KEY' on /v1/*");
  cmd->add_option("--workers", o->workers, "colocated engine workers")->check(CLI::Range(1, 4096));
  cmd->add_option("--max-running", o->max_running, "requests a worker runs at once (the rest wait, by priority)")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--prefill-workers", o->prefill_workers, "prefill workers (disaggregated with --decode-workers)")
      ->check(CLI::Range(0, 4096));
  cmd->add_option("--decode-workers", o->decode_workers, "decode workers")->check(CLI::Range(0, 4096));
  cmd->add_option("--kv-memory-mib", *kv_mib, "device KV pool budget per worker, MiB")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--host-memory-mib", *host_mib, "host tier per worker, MiB (park, spill)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cmd->add_flag("!--no-cold-pages", o->cold_pages,
                "keep every page of a running sequence on the device (as a GPU without mapped host memory must)");
  cmd->add_option("--max-model-len", o->max_model_len, "prompt + completion token limit");
  cmd->add_option("--step-tokens", o->step_tokens, "tokens per engine step")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--backend", o->backend, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--weights", o->weights,
                  "matrix type: auto (f32 on cpu, bf16 on cuda; a checkpoint's FP8 / FP4 matrices kept as they are "
                  "where the backend takes them: cpu), f32 or bf16 (every matrix; bf16 needs --backend cuda)")
      ->check(CLI::IsMember({"auto", "f32", "bf16"}));
  cmd->add_option("--read-timeout", o->read_timeout_s, "seconds a client has to send a whole request");
  cmd->add_option("--max-body-mib", *body_mib, "largest request body, MiB (larger ones get 413)")
      ->check(positive_mib);
  cmd->add_option("--drain-timeout", o->drain_timeout_s,
                  "on SIGTERM: seconds the requests in flight get to finish (new ones get 503); 0: stop at once");
  cmd->add_option("--restart-max", o->restart.max_restarts, "restart policy: worker restarts allowed per window");
  cmd->add_option("--restart-window", *restart_window_s, "restart policy: the window, seconds");
  // long_tail policy (off unless --long-tail)
  cmd->add_flag("--long-tail", *long_tail, "park the request with the largest projected KV under pressure");
  cmd->add_option("--long-tail-pressure", lt->pressure_threshold, "long_tail: park above this KV use (0..1)");
  cmd->add_option("--long-tail-resume", lt->resume_threshold, "long_tail: resume below this KV use (0..1)");
  cmd->add_option("--long-tail-max-deferrals", lt->max_deferrals, "long_tail: parks of one request at most");
  cmd->add_option("--long-tail-min-share", lt->min_share, "long_tail: park only a request holding this much of the pool");
  // scale policy (off unless --scale-max > 0)
  cmd->add_option("--scale-min", sp->min_workers, "scale: fewest workers");
  cmd->add_option("--scale-max", sp->max_workers, "scale: most workers (0: no scale policy)");
  cmd->add_option("--scale-queue-high", sp->queue_depth_high, "scale: add a worker above this queue depth per worker");
  cmd->add_option("--scale-kv-high", sp->kv_use_high, "scale: add a worker above this KV use");
  cmd->add_option("--scale-kv-low", sp->kv_use_low, "scale: remove one below this KV use with an empty queue");
  cmd->add_option("--scale-cooldown", *scale_cooldown_s, "scale: seconds between two scale events, and how long the low marks must hold before a removal");
  cmd->add_flag("--test-hooks", o->test_hooks, "enable POST /admin/crash (fault injection for tests)");
  return [o, kv_mib, host_mib, body_mib, restart_window_s, long_tail, lt, sp, scale_cooldown_s, frame_port] {
    if (*frame_port >= 0) o->frame_port = static_cast<uint16_t>(*frame_port);
    o->kv_bytes = static_cast<uint64_t>(*kv_mib) << 20;
    o->host_bytes = static_cast<uint64_t>(*host_mib) << 20;
    o->max_body_bytes = static_cast<size_t>(*body_mib * (1 << 20));
    o->restart.window = std::chrono::seconds(*restart_window_s);
    if (*long_tail) o->long_tail = *lt;
    if (sp->max_workers > 0) {
      sp->cooldown = std::chrono::seconds(*scale_cooldown_s);
      o->scale = *sp;
    }
    return actors::serve_until_signal(*o);
  };
}

}  // namespace troupe::app
