#include "deploy/topology.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace troupe::deploy {

const char* to_string(ActorKind kind) {
  switch (kind) {
    case ActorKind::gateway: return "gateway";
    case ActorKind::router: return "router";
    case ActorKind::prefill: return "prefill";
    case ActorKind::decode: return "decode";
    case ActorKind::cache_shard: return "cache_shard";
    case ActorKind::offload: return "offload";
    case ActorKind::stage: return "stage";
  }
  return "?";
}

std::optional<ActorKind> actor_kind_from(std::string_view name) {
  for (auto k : kAllActorKinds) {
    if (name == to_string(k)) return k;
  }
  return std::nullopt;
}

const char* to_string(Discovery d) { return d == Discovery::kubernetes ? "kubernetes" : "static"; }
const char* to_string(Workload w) { return w == Workload::deployment ? "deployment" : "statefulset"; }
const char* to_string(HandoffTransport t) { return t == HandoffTransport::tcp ? "tcp" : "ucx"; }

std::string Endpoint::to_string() const {
  return host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
}

bool Node::runs(ActorKind kind) const { return std::find(actors.begin(), actors.end(), kind) != actors.end(); }

const Node* Topology::find_node(std::string_view name) const {
  for (const auto& n : nodes) {
    if (n.name == name) return &n;
  }
  return nullptr;
}

const ScalePolicy* Topology::scale_rule(std::string_view node) const {
  for (const auto& s : policies.scale) {
    if (s.node == node) return &s;
  }
  return nullptr;
}

int32_t Topology::slots(const Node& node) const {
  const ScalePolicy* s = scale_rule(node.name);
  return s ? std::max(s->max_workers, node.replicas) : node.replicas;
}

std::vector<Instance> Topology::instances() const {
  std::vector<Instance> out;
  for (const auto& n : nodes) {
    if (n.workload == Workload::deployment) {
      out.push_back({&n, -1, n.name});
      continue;
    }
    for (int32_t i = 0; i < slots(n); ++i) out.push_back({&n, i, fmt::format("{}-{}", n.name, i)});
  }
  return out;
}

std::optional<Instance> Topology::find_instance(std::string_view name) const {
  for (const auto& n : nodes) {
    if (name == n.name && (n.workload == Workload::deployment || slots(n) == 1)) {
      return Instance{&n, n.workload == Workload::deployment ? -1 : 0,
                      n.workload == Workload::deployment ? n.name : n.name + "-0"};
    }
  }
  for (auto& inst : instances()) {
    if (inst.name == name) return inst;
  }
  return std::nullopt;
}

std::string Topology::object_name(const Node& node) const { return fmt::format("{}-{}", name, node.name); }

Endpoint Topology::transport_endpoint(const Instance& instance, Discovery discovery,
                                      std::string_view pod_namespace) const {
  const Node& n = *instance.node;
  if (discovery == Discovery::static_addresses) {
    const size_t i = static_cast<size_t>(std::max(instance.ordinal, 0));
    return i < n.addresses.size() ? n.addresses[i] : Endpoint{};
  }
  const std::string ns = kubernetes.namespace_name.empty() ? std::string(pod_namespace) : kubernetes.namespace_name;
  const std::string svc = object_name(n);
  return {fmt::format("{}-{}.{}.{}.svc.{}", svc, std::max(instance.ordinal, 0), svc, ns, kubernetes.cluster_domain),
          n.ports.transport};
}

uint16_t Topology::http_port(const Instance& instance) const {
  const Node& n = *instance.node;
  if (instance.ordinal <= 0 || static_cast<size_t>(instance.ordinal) >= n.addresses.size()) return n.ports.http;
  const std::string& host = n.addresses[static_cast<size_t>(instance.ordinal)].host;
  int k = 0;
  for (int32_t j = 0; j < instance.ordinal; ++j) k += n.addresses[static_cast<size_t>(j)].host == host ? 1 : 0;
  return static_cast<uint16_t>(n.ports.http + k);
}

std::vector<std::string> Topology::required_peers(const Instance& instance) const {
  std::vector<std::string> out;
  const Node* router = nullptr;
  for (const auto& n : nodes) {
    if (n.runs(ActorKind::router)) router = &n;
  }
  if (!router) return out;
  if (instance.node != router) {
    out.push_back(router->name + "-0");
    return out;
  }
  for (const auto& n : nodes) {
    if (&n == router || !n.is_worker()) continue;
    const ScalePolicy* s = scale_rule(n.name);
    const int32_t needed = s ? s->min_workers : n.replicas;
    for (int32_t i = 0; i < needed; ++i) out.push_back(fmt::format("{}-{}", n.name, i));
  }
  return out;
}

int64_t Topology::termination_grace_s() const { return static_cast<int64_t>(std::ceil(drain.timeout_s)) + 15; }

Discovery effective_discovery(const Topology& topology) {
  if (const char* e = std::getenv("TROUPE_DISCOVERY")) {
    if (std::string_view(e) == "kubernetes") return Discovery::kubernetes;
    if (std::string_view(e) == "static") return Discovery::static_addresses;
  }
  return topology.discovery;
}

}  // namespace troupe::deploy
