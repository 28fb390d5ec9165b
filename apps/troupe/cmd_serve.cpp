// troupe serve [--model DIR] [--port N] ...: every actor in one process.
#include "actors/serve.hpp"
#include "apps/troupe/commands.hpp"
#include "apps/troupe/gateway_flags.hpp"
#include "base/error.hpp"

#include <string>

namespace troupe::app {

Command add_serve(CLI::App& app) {
  auto o = std::make_shared<actors::ServeOptions>();
  auto kv_mib = std::make_shared<int64_t>(1024);
  auto host_mib = std::make_shared<int64_t>(0);
  auto restart_window_s = std::make_shared<int64_t>(60);
  auto long_tail = std::make_shared<bool>(false);
  auto lt = std::make_shared<actors::LongTailPolicy>();
  auto sp = std::make_shared<actors::ScaleRule>();
  sp->max_workers = 0;
  sp->queue_depth_high = 8;
  sp->kv_use_low = 0.2;
  auto scale_cooldown_s = std::make_shared<int64_t>(10);
  auto frame_port = std::make_shared<int>(-1);
  auto pool_mix = std::make_shared<std::string>();
  auto pool_ratios = std::make_shared<std::string>();
  auto gw = std::make_shared<GatewayFlags>();
  const auto share = [](bool lo_open, bool hi_open) { return interval(0, 1, lo_open, hi_open); };
  auto* cmd = app.add_subcommand("serve", "serve a model over an OpenAI-compatible HTTP API and, with --frame-port, troupe frames (all actors in one process)");
  cmd->add_option("--model", o->model_dir, "model directory (default: the embedded tiny random-weight model)");
  cmd->add_option("--served-model-name", o->served_model_name, "model id clients send (default: directory name)");
  cmd->add_option("--host", o->host, "address to listen on");
  cmd->add_option("--port", o->port, "HTTP port (0: any free port)");
  cmd->add_option("--frame-port", *frame_port,
                  "also serve troupe frames (docs/messages.md; `troupe client`, clients/) on this TCP port "
                  "(0: any free port; default: off)")
      ->check(CLI::Range(0, 65535));
  add_gateway_flags(cmd, *gw);
  auto* workers_opt =
      cmd->add_option("--workers", o->workers, "colocated engine workers")->check(CLI::Range(1, 4096));
  cmd->add_option("--max-running", o->max_running, "requests a worker runs at once (the rest wait, by priority)")
      ->check(CLI::Range(1, 1 << 20));
  auto* prefill_opt =
      cmd->add_option("--prefill-workers", o->prefill_workers, "prefill workers (disaggregated with --decode-workers)")
          ->check(CLI::Range(1, 4096))
          ->excludes(workers_opt);
  cmd->add_option("--decode-workers", o->decode_workers, "decode workers (disaggregated with --prefill-workers)")
      ->check(CLI::Range(1, 4096))
      ->excludes(workers_opt)
      ->needs(prefill_opt);
  prefill_opt->needs("--decode-workers");
  auto* kv_opt = cmd->add_option("--kv-memory-mib", *kv_mib, "device KV pool budget per worker, MiB (default 1024)")
                    ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--kv-memory-fraction", o->kv_fraction,
                  "instead of --kv-memory-mib: this share (0, 1] of the memory free after the weights loaded (the "
                  "GPU's; on the cpu backend available RAM), split among the workers the process may run")
      ->check(share(true, false))
      ->excludes(kv_opt);
  auto* mix_opt = cmd->add_option("--pool-mix", *pool_mix,
                                  "start the pools sized for these contexts TOKENS[:WEIGHT],... (e.g. "
                                  "4K:0.7,32K:0.25,128K:0.05; `troupe plan` prints the plan); default: pools "
                                  "start empty and grow on demand");
  cmd->add_option("--pool-ratios", *pool_ratios,
                  "start the pools at fixed shares of the budget, e.g. window=0.1,csa_entry=0.5,csa_index=0.2,"
                  "hca_entry=0.15,hca_ring=0.05")
      ->excludes(mix_opt);
  cmd->add_option("--cache-share", o->cache_share, "with --pool-mix: share of the pools kept for cached prefixes, [0, 1)")
      ->check(share(false, true))
      ->needs(mix_opt);
  cmd->add_option("--host-memory-mib", *host_mib, "host tier per worker, MiB (park, spill, cold pages of long sequences; on CUDA mapped pinned memory)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cmd->add_flag("!--no-cold-pages", o->cold_pages,
                "keep every page of a running sequence on the device (by default old pages move to the host tier, read in place: "
                "every entry pool on the CPU backend, the CSA entries on CUDA)");
  cmd->add_option("--step-tokens", o->step_tokens, "tokens per engine step")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--backend", o->backend, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--weights", o->weights,
                  "matrix type: auto (f32 on cpu, bf16 on cuda; a checkpoint's FP8 / FP4 matrices kept as they are "
                  "where the backend takes them: cpu), f32 or bf16 (every matrix; bf16 needs --backend cuda)")
      ->check(CLI::IsMember({"auto", "f32", "bf16"}));
  cmd->add_option("--drain-timeout", o->drain_timeout_s,
                  "on SIGTERM: seconds the requests in flight get to finish (new ones get 503); 0: stop at once")
      ->check(interval(0, 86400, false, false));
  cmd->add_option("--restart-max", o->restart.max_restarts, "restart policy: worker restarts allowed per window")
      ->check(CLI::Range(0, 1000));
  cmd->add_option("--restart-window", *restart_window_s, "restart policy: the window, seconds")
      ->check(CLI::Range(int64_t{1}, int64_t{86400}));
  // long_tail policy (off unless --long-tail)
  auto* lt_flag = cmd->add_flag("--long-tail", *long_tail,
                                "park the request with the largest projected KV under pressure (in the host tier: "
                                "needs --host-memory-mib)");
  cmd->add_option("--long-tail-pressure", lt->pressure_threshold, "long_tail: park above this KV use, (0, 1]")
      ->check(share(true, false))
      ->needs(lt_flag);
  cmd->add_option("--long-tail-resume", lt->resume_threshold,
                  "long_tail: resume when the KV use with the parked request would be below this, (0, 1]")
      ->check(share(true, false))
      ->needs(lt_flag);
  cmd->add_option("--long-tail-max-deferrals", lt->max_deferrals, "long_tail: parks of one request at most")
      ->check(CLI::Range(1, 1000))
      ->needs(lt_flag);
  cmd->add_option("--long-tail-min-share", lt->min_share,
                  "long_tail: park only a request holding this much of the pool, [0, 1)")
      ->check(share(false, true))
      ->needs(lt_flag);
  // scale policy (off unless --scale-max > 0)
  auto* scale_opt = cmd->add_option("--scale-max", sp->max_workers, "scale: most workers (0: no scale policy)")
                        ->check(CLI::Range(0, 4096));
  cmd->add_option("--scale-min", sp->min_workers, "scale: fewest workers")->check(CLI::Range(1, 4096))->needs(scale_opt);
  cmd->add_option("--scale-queue-high", sp->queue_depth_high, "scale: add a worker above this queue depth per worker")
      ->check(CLI::Range(int64_t{1}, int64_t{1000000}))
      ->needs(scale_opt);
  cmd->add_option("--scale-kv-high", sp->kv_use_high, "scale: add a worker above this KV use, (0, 1]")
      ->check(share(true, false))
      ->needs(scale_opt);
  cmd->add_option("--scale-kv-low", sp->kv_use_low, "scale: remove one below this KV use with an empty queue, [0, 1)")
      ->check(share(false, true))
      ->needs(scale_opt);
  cmd->add_option("--scale-cooldown", *scale_cooldown_s,
                  "scale: seconds between two scale events, and how long the low marks must hold before a removal")
      ->check(CLI::Range(int64_t{0}, int64_t{3600}))
      ->needs(scale_opt);
  cmd->add_flag("--test-hooks", o->test_hooks, "enable POST /admin/crash (fault injection for tests)");
  return [o, kv_mib, host_mib, restart_window_s, long_tail, lt, sp, scale_cooldown_s, frame_port, pool_mix, pool_ratios,
          gw] {
    gw->apply(*o);
    if (*frame_port >= 0) o->frame_port = static_cast<uint16_t>(*frame_port);
    if (!pool_mix->empty()) o->pool_mix = cache::parse_mix(*pool_mix, "--pool-mix");
    if (!pool_ratios->empty()) o->pool_ratios = cache::parse_ratios(*pool_ratios, "--pool-ratios");
    o->kv_bytes = static_cast<uint64_t>(*kv_mib) << 20;
    o->host_bytes = static_cast<uint64_t>(*host_mib) << 20;
    o->restart.window = std::chrono::seconds(*restart_window_s);
    if (*long_tail) {
      if (o->host_bytes == 0) {
        raise(ErrorCode::invalid_argument, "--long-tail parks requests in the host tier: give --host-memory-mib");
      }
      o->long_tail = *lt;
    }
    if (sp->max_workers > 0) {
      if (sp->min_workers > sp->max_workers) {
        raise(ErrorCode::invalid_argument, "--scale-min {} is above --scale-max {}", sp->min_workers, sp->max_workers);
      }
      if (sp->kv_use_low >= sp->kv_use_high) {
        raise(ErrorCode::invalid_argument, "--scale-kv-low {} must be below --scale-kv-high {}", sp->kv_use_low,
              sp->kv_use_high);
      }
      sp->cooldown = std::chrono::seconds(*scale_cooldown_s);
      o->scale = *sp;
    }
    return actors::serve_until_signal(*o);
  };
}

}  // namespace troupe::app
