// troupe run --manifest FILE --node NAME: the actors of one node of a topology.
#include "actors/run.hpp"
#include "apps/troupe/commands.hpp"
#include "apps/troupe/gateway_flags.hpp"

namespace troupe::app {

Command add_run(CLI::App& app) {
  auto o = std::make_shared<actors::RunOptions>();
  auto* cmd = app.add_subcommand("run", "run the actors of one node of a topology manifest (docs/manifest.md)");
  cmd->add_option("--manifest", o->manifest, "topology manifest (YAML)")->required();
  cmd->add_option("--node", o->node, "instance to run: NODE-ORDINAL (decode-1), or NODE when it has one slot")
      ->required();
  cmd->add_option("--backend", o->backend, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--step-tokens", o->step_tokens, "tokens per engine step")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--max-running", o->max_running, "requests a worker runs at once")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--http-port", o->http_port,
                  "HTTP port instead of the node's ports.http (several slots of one node on one host; 0: any free)")
      ->check(CLI::Range(0, 65535));
  // A gateway node's HTTP API (ignored by other nodes).
  auto gw = std::make_shared<GatewayFlags>();
  add_gateway_flags(cmd, *gw);
  return [o, gw] {
    gw->apply(*o);
    return actors::run_until_signal(*o);
  };
}

}  // namespace troupe::app
