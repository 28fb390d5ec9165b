// troupe serve [--model DIR] [--port N] ...: every actor in one process.
#include "actors/serve.hpp"
#include "apps/troupe/commands.hpp"

namespace troupe::app {

Command add_serve(CLI::App& app) {
  auto o = std::make_shared<actors::ServeOptions>();
  auto kv_mib = std::make_shared<uint64_t>(1024);
  auto host_mib = std::make_shared<uint64_t>(0);
  auto* cmd = app.add_subcommand("serve", "serve a model over an OpenAI-compatible HTTP API (all actors in one process)");
  cmd->add_option("--model", o->model_dir, "model directory (default: the embedded tiny random-weight model)");
  cmd->add_option("--served-model-name", o->served_model_name, "model id clients send (default: directory name)");
  cmd->add_option("--host", o->host, "address to listen on");
  cmd->add_option("--port", o->port, "HTTP port (0: any free port)");
  cmd->add_option("--api-key", o->api_key, "require 'Authorization: Bearer KEY' on /v1/*");
  cmd->add_option("--workers", o->workers, "colocated engine workers");
  cmd->add_option("--prefill-workers", o->prefill_workers, "prefill workers (disaggregated with --decode-workers)");
  cmd->add_option("--decode-workers", o->decode_workers, "decode workers");
  cmd->add_option("--kv-memory-mib", *kv_mib, "device KV pool budget per worker, MiB");
  cmd->add_option("--host-memory-mib", *host_mib, "host tier per worker, MiB (park, spill)");
  cmd->add_option("--max-model-len", o->max_model_len, "prompt + completion token limit");
  cmd->add_option("--step-tokens", o->step_tokens, "tokens per engine step");
  cmd->add_option("--backend", o->backend, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--read-timeout", o->read_timeout_s, "seconds a client has to send a whole request");
  return [o, kv_mib, host_mib] {
    o->kv_bytes = *kv_mib << 20;
    o->host_bytes = *host_mib << 20;
    return actors::serve_until_signal(*o);
  };
}

}  // namespace troupe::app
