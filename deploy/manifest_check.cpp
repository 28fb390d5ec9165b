// The checking pass of the manifest reader: fields against each other (names
// that must exist, ports that must not collide, actors a policy needs).
#include <fmt/format.h>

#include <cmath>
#include <map>
#include <set>

#include "deploy/manifest_check.hpp"

namespace troupe::deploy::detail {
namespace {

// A StatefulSet name longer than 52 characters leaves no room for the
// controller-revision-hash label of its pods.
constexpr size_t kMaxObjectName = 52;

}  // namespace

void check_topology(Reader& r, Topology& t, bool disaggregation_given) {
  // Node names: unique; object names short enough for Kubernetes.
  std::map<std::string, size_t> seen;
  for (size_t i = 0; i < t.nodes.size(); ++i) {
    const Node& n = t.nodes[i];
    const std::string f = index("nodes", i);
    if (n.name.empty()) continue;
    auto [it, inserted] = seen.emplace(n.name, i);
    if (!inserted) {
      r.error_at(f + ".name", fmt::format("duplicate node name '{}' (also nodes[{}], line {})", n.name, it->second,
                                          t.nodes[it->second].source.line));
    }
    if (!t.name.empty() && t.object_name(n).size() > kMaxObjectName) {
      r.error_at(f + ".name", fmt::format("'{}-{}' is longer than {} characters; shorten the topology or node name",
                                          t.name, n.name, kMaxObjectName));
    }
  }

  // Roles: who runs what.
  std::vector<size_t> routers, gateways, prefill, decode;
  for (size_t i = 0; i < t.nodes.size(); ++i) {
    const Node& n = t.nodes[i];
    const std::string f = index("nodes", i);
    if (n.runs(ActorKind::router)) routers.push_back(i);
    if (n.runs(ActorKind::gateway)) gateways.push_back(i);
    if (n.runs(ActorKind::prefill)) prefill.push_back(i);
    if (n.runs(ActorKind::decode)) decode.push_back(i);
    if (n.actors.empty()) continue;
    if (n.is_worker() && !n.runs(ActorKind::cache_shard)) {
      r.error_at(f + ".actors", fmt::format("node '{}' runs {} but no cache_shard (prefill and decode lease their KV "
                                            "pages from a cache_shard in the same process)",
                                            n.name, n.runs(ActorKind::prefill) ? "prefill" : "decode"));
    }
    if (n.runs(ActorKind::stage) && !n.is_worker()) {
      r.error_at(f + ".actors", fmt::format("node '{}' runs stage but neither prefill nor decode", n.name));
    }
    if (n.workload == Workload::deployment &&
        !std::all_of(n.actors.begin(), n.actors.end(), [](ActorKind k) { return k == ActorKind::gateway; })) {
      r.error_at(f + ".workload", fmt::format("node '{}' is a deployment but runs more than gateway; only gateway-only "
                                              "nodes may be deployments (peers dial every other node by name)",
                                              n.name));
    }
    if (n.devices > 0 && !n.is_worker()) {
      r.error_at(f + ".devices", fmt::format("node '{}' has devices but runs neither prefill nor decode", n.name));
    }
    if (n.ports.http == n.ports.transport) {
      r.error_at(f + ".ports", fmt::format("node '{}': http and transport are both port {}", n.name, n.ports.http));
    }
    for (uint16_t p : {n.ports.http, n.ports.transport}) {
      if (n.ports.transport_range.contains(p)) {
        r.error_at(f + ".ports", fmt::format("node '{}': port {} lies inside transport_range {}-{}", n.name, p,
                                             n.ports.transport_range.first, n.ports.transport_range.last));
      }
    }
  }
  if (!t.nodes.empty()) {
    if (routers.empty()) r.error_at("nodes", "no node runs router; exactly one must");
    if (routers.size() > 1) {
      r.error_at(index("nodes", routers[1]) + ".actors",
                 fmt::format("router runs on nodes '{}' and '{}'; exactly one node runs it", t.nodes[routers[0]].name,
                             t.nodes[routers[1]].name));
    }
    if (gateways.empty()) r.error_at("nodes", "no node runs gateway; at least one must");
    if (prefill.empty()) r.error_at("nodes", "no node runs prefill; at least one must");
    if (decode.empty()) r.error_at("nodes", "no node runs decode; at least one must");
  }

  // Scale rules.
  std::set<std::string> scaled;
  for (size_t i = 0; i < t.policies.scale.size(); ++i) {
    ScalePolicy& s = t.policies.scale[i];
    const std::string f = index("policies.scale", i);
    if (s.min_workers > s.max_workers) {
      r.error_at(f + ".min_workers", fmt::format("min_workers {} is above max_workers {}", s.min_workers, s.max_workers));
    }
    if (s.queue_depth_low >= s.queue_depth_high) {
      r.error_at(f + ".queue_depth_low", fmt::format("queue_depth_low {} must be below queue_depth_high {}",
                                                     s.queue_depth_low, s.queue_depth_high));
    }
    if (s.kv_use_low >= s.kv_use_high) {
      r.error_at(f + ".kv_use_low", fmt::format("kv_use_low {} must be below kv_use_high {}", s.kv_use_low, s.kv_use_high));
    }
    if (s.node.empty()) continue;
    const Node* n = t.find_node(s.node);
    if (!n) {
      r.error_at(f + ".node", fmt::format("no node named '{}'{}", s.node, [&] {
                   std::vector<std::string_view> names;
                   for (auto& x : t.nodes) names.emplace_back(x.name);
                   return suggestion(s.node, names);
                 }()));
      continue;
    }
    if (!scaled.insert(s.node).second) r.error_at(f + ".node", fmt::format("node '{}' has two scale rules", s.node));
    if (!n->is_worker()) r.error_at(f + ".node", fmt::format("node '{}' runs neither prefill nor decode; only workers scale", s.node));
    if (n->runs(ActorKind::router)) r.error_at(f + ".node", fmt::format("node '{}' runs the router, which never scales", s.node));
    if (n->workload == Workload::deployment) r.error_at(f + ".node", fmt::format("node '{}' is a deployment", s.node));
    if (n->replicas < s.min_workers || n->replicas > s.max_workers) {
      r.error_at(f + ".node", fmt::format("node '{}' starts {} replicas, outside min_workers..max_workers {}..{}", s.node,
                                          n->replicas, s.min_workers, s.max_workers));
    }
  }
  for (size_t i : routers) {
    if (t.slots(t.nodes[i]) != 1) {
      r.error_at(index("nodes", i) + ".replicas", fmt::format("node '{}' runs the router and must have one replica", t.nodes[i].name));
    }
  }

  // Disaggregation groups: given, or derived from the actors.
  auto& d = t.policies.disaggregation;
  if (!disaggregation_given) {
    d.derived = true;
    for (size_t i : prefill) d.prefill.push_back(t.nodes[i].name);
    for (size_t i : decode) d.decode.push_back(t.nodes[i].name);
  } else {
    auto check_group = [&](const std::vector<std::string>& names, const char* key, ActorKind needs) {
      std::set<std::string> once;
      for (size_t j = 0; j < names.size(); ++j) {
        const std::string f = fmt::format("policies.disaggregation.{}[{}]", key, j);
        const Node* n = t.find_node(names[j]);
        if (!n) {
          std::vector<std::string_view> all;
          for (auto& x : t.nodes) all.emplace_back(x.name);
          r.error_at(f, fmt::format("no node named '{}'{}", names[j], suggestion(names[j], all)));
        } else if (!n->runs(needs)) {
          r.error_at(f, fmt::format("node '{}' does not run {}", names[j], to_string(needs)));
        }
        if (!once.insert(names[j]).second) r.error_at(f, fmt::format("node '{}' is listed twice", names[j]));
      }
      for (auto& n : t.nodes) {
        if (n.runs(needs) && !once.count(n.name)) {
          r.error_at(fmt::format("policies.disaggregation.{}", key),
                     fmt::format("node '{}' runs {} but is not listed here", n.name, to_string(needs)));
        }
      }
    };
    check_group(d.prefill, "prefill", ActorKind::prefill);
    check_group(d.decode, "decode", ActorKind::decode);
  }

  // long_tail parks state in the offload actor's host tier.
  if (t.policies.long_tail) {
    const auto& l = *t.policies.long_tail;
    if (l.resume_threshold >= l.pressure_threshold) {
      r.error_at("policies.long_tail.resume_threshold",
                 fmt::format("resume_threshold {} must be below pressure_threshold {}", l.resume_threshold, l.pressure_threshold));
    }
    for (size_t i : decode) {
      if (!t.nodes[i].runs(ActorKind::offload)) {
        r.error_at(index("nodes", i) + ".actors",
                   fmt::format("policies.long_tail parks requests in the host tier, but decode node '{}' runs no offload",
                               t.nodes[i].name));
      }
    }
    if (t.pools.host_tier == 0) r.error_at("policies.long_tail", "needs pools.host_tier (a size) to park requests in");
  }

  // Pools.
  if (!t.pools.context_mix.empty() && t.pools.ratios) {
    r.error_at("pools.ratios", "give pools.context_mix (the planner sizes the pools) or pools.ratios (fixed shares), not both");
  }
  if (!t.pools.context_mix.empty()) {
    double sum = 0;
    for (auto& c : t.pools.context_mix) sum += c.share;
    if (std::abs(sum - 1) > 1e-6) r.error_at("pools.context_mix", fmt::format("shares sum to {}, not 1", sum));
  }
  if (t.pools.ratios) {
    const auto& q = *t.pools.ratios;
    double sum = q.swa + q.csa_entries + q.index_keys + q.hca_entries + q.inflight;
    if (std::abs(sum - 1) > 1e-6) r.error_at("pools.ratios", fmt::format("ratios sum to {}, not 1", sum));
  }

  // Kubernetes: the weights must come from under the claim's mount.
  if (!t.kubernetes.model_claim.empty() && !t.model.embedded() && !t.model.path.empty()) {
    const std::string& m = t.kubernetes.model_mount;
    if (t.model.path.rfind(m + "/", 0) != 0) {
      r.error_at("model.path", fmt::format("'{}' is not under kubernetes.model_volume.mount '{}'", t.model.path, m));
    }
  }

  // Addresses: static discovery needs one per instance slot; never two
  // processes on one host port.
  struct Use {
    std::string what;
    PortRange ports;
  };
  std::map<std::string, std::vector<Use>> by_host;
  for (size_t i = 0; i < t.nodes.size(); ++i) {
    const Node& n = t.nodes[i];
    const std::string f = index("nodes", i);
    const int32_t slots = t.slots(n);
    if (n.addresses.empty()) {
      if (t.discovery == Discovery::static_addresses && !n.name.empty()) {
        r.error_at(f, fmt::format("node '{}' has no address; discovery is static (give address: HOST:PORT, or set "
                                  "discovery: kubernetes)",
                                  n.name));
      }
      continue;
    }
    if (n.workload == Workload::deployment) {
      r.error_at(f + ".address", fmt::format("node '{}' is a deployment and has no static address", n.name));
      continue;
    }
    if (static_cast<int32_t>(n.addresses.size()) != slots) {
      r.error_at(f + ".address", fmt::format("node '{}' has {} instance slot{} but {} address{}", n.name, slots,
                                             slots == 1 ? "" : "s", n.addresses.size(),
                                             n.addresses.size() == 1 ? "" : "es"));
    }
    for (size_t j = 0; j < n.addresses.size(); ++j) {
      const Endpoint& e = n.addresses[j];
      const std::string who = fmt::format("{}-{}", n.name, j);
      const bool listed = r.source_of(f + ".address[0]").line > 0;  // given as a list
      const std::string fa = listed ? index(f + ".address", j) : f + ".address";
      // Slots of one node on one host: the k-th serves HTTP on ports.http + k
      // (Topology::http_port) and they share the transport_range.
      const uint16_t http = t.http_port(Instance{&n, static_cast<int32_t>(j), who});
      bool shares = false;
      for (size_t k = 0; k < j; ++k) shares = shares || n.addresses[k].host == e.host;
      std::vector<Use> mine = {{who + " http", {http, http}}, {who + " transport", {e.port, e.port}}};
      if (!shares) mine.push_back({who + " transport_range", n.ports.transport_range});
      if (http != n.ports.http && (http == e.port || n.ports.transport_range.contains(http))) {
        r.error_at(fa, fmt::format("{}: http port {} (ports.http + {}, slots on one host) collides with a transport "
                                   "port or the transport_range", who, http, http - n.ports.http));
      }
      if (e.port == n.ports.http || n.ports.transport_range.contains(e.port)) {
        r.error_at(fa, fmt::format("{}: transport port {} collides with its own http port or transport_range", who, e.port));
      }
      auto& uses = by_host[e.host];
      for (const auto& u : mine) {
        for (const auto& o : uses) {
          if (u.ports.overlaps(o.ports)) {
            r.error_at(fa, fmt::format("{} ({}) collides with {} on host {}; give each process on one host its own "
                                       "ports (a node's ports: block)",
                                       u.what,
                                       u.ports.first == u.ports.last ? std::to_string(u.ports.first)
                                                                     : fmt::format("{}-{}", u.ports.first, u.ports.last),
                                       o.what, e.host));
            break;
          }
        }
      }
      uses.insert(uses.end(), mine.begin(), mine.end());
    }
  }
}

}  // namespace troupe::deploy::detail
