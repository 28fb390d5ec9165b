// The topology of a deployment: which processes (nodes) exist, where they are,
// which actors each runs, the model, the pools and the supervision policies.
// A manifest (YAML, docs/manifest.md) is parsed and validated into a Topology
// by deploy/manifest.hpp; the actor layer (`troupe run --manifest F --node N`)
// and the Kubernetes renderer (deploy/k8s_render.hpp) only ever see a valid one.
//
// Names: a manifest `nodes:` entry is a Node (on Kubernetes: a role, one
// StatefulSet). A Node has instance slots `<node>-<ordinal>`, one process each;
// `troupe run --node decode-1` runs slot 1 of node `decode`.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::deploy {

// The actors a manifest may place on a node. `node` (the CAF/transport bridge)
// and `supervisor` run in every process and are never listed.
enum class ActorKind : uint8_t { gateway, router, prefill, decode, cache_shard, offload, stage };
inline constexpr ActorKind kAllActorKinds[] = {ActorKind::gateway, ActorKind::router,      ActorKind::prefill,
                                               ActorKind::decode,  ActorKind::cache_shard, ActorKind::offload,
                                               ActorKind::stage};
const char* to_string(ActorKind kind);
std::optional<ActorKind> actor_kind_from(std::string_view name);

// How a process finds its peers. `static`: the addresses in the manifest.
// `kubernetes`: `<topology>-<node>-<ordinal>.<topology>-<node>.<namespace>.svc.<cluster_domain>`
// (a StatefulSet pod behind its headless Service). The environment variable
// TROUPE_DISCOVERY overrides the manifest (the renderer sets it to kubernetes).
enum class Discovery : uint8_t { static_addresses, kubernetes };
const char* to_string(Discovery d);

// Kubernetes workload of a node. A Deployment has no stable pod names, so it is
// allowed only for nodes that run nothing but `gateway`: gateways dial the
// router and get their replies on the connections they opened; no peer dials them.
enum class Workload : uint8_t { stateful_set, deployment };
const char* to_string(Workload w);

// Transport of the KV handoff between prefill and decode groups.
enum class HandoffTransport : uint8_t { ucx, tcp };
const char* to_string(HandoffTransport t);

// Where a value came from in the manifest (1-based; 0 when defaulted), so
// errors found after parsing (e.g. at run time) can still name the line.
struct Source {
  int line = 0;
  int column = 0;
};

struct Endpoint {
  std::string host;
  uint16_t port = 0;
  std::string to_string() const;  // host:port ([v6]:port)
};

struct PortRange {
  uint16_t first = 0;
  uint16_t last = 0;  // inclusive
  bool contains(uint16_t p) const { return p >= first && p <= last; }
  bool overlaps(const PortRange& o) const { return first <= o.last && o.first <= last; }
};

// Every process listens on `http` (gateway: the OpenAI API; every node:
// /health and /metrics) and on `transport` (UCX listener). UCX's TCP lanes
// use `transport_range` (UCX_TCP_PORT_RANGE), so a NetworkPolicy can admit them.
struct Ports {
  uint16_t http = 8000;
  uint16_t transport = 7400;
  PortRange transport_range{7401, 7463};
};

struct ModelSpec {
  std::string path;  // a model directory, or "embedded" (the built-in tiny random-weight model)
  bool embedded() const { return path == "embedded"; }
};

// Bytes of KV pools per device (per process on the CPU backend): either an
// absolute size or a fraction of the memory left after the weights.
struct MemoryBudget {
  uint64_t bytes = 0;      // used when non-zero
  double fraction = 0.9;   // used when bytes == 0
};

// One class of expected requests: the planner sizes the pools for the mix.
struct ContextClass {
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;
  double share = 0;  // of requests; the shares of a mix sum to 1
};

// Fixed shares of the KV budget per pool (the five kinds of state), instead of
// the planner's; they sum to 1.
struct PoolRatios {
  double swa = 0, csa_entries = 0, index_keys = 0, hca_entries = 0, inflight = 0;
};

struct Pools {
  MemoryBudget memory_budget;
  std::vector<ContextClass> context_mix;  // empty: the planner's default mix
  std::optional<PoolRatios> ratios;       // set: fixed shares, no planner (exclusive with context_mix)
  uint64_t host_tier = 0;                 // bytes of pinned host memory per process for offload/park
};

// restart: one-for-one with a budget; more than max_restarts within window_s
// escalates (the worker's node is reported failed).
struct RestartPolicy {
  int32_t max_restarts = 3;
  double window_s = 60;
};

// long_tail: above pressure_threshold (KV use of a decode worker, 0..1] the
// request with the largest projected KV is parked; parked requests resume
// when use falls below resume_threshold; after max_deferrals parks a request
// fails with a clear error.
struct LongTailPolicy {
  double pressure_threshold = 0.9;
  double resume_threshold = 0.7;
  int32_t max_deferrals = 3;
};

// scale: one rule per scaled node (prefill or decode). Up when any high mark
// is crossed; down when every low mark holds; at most once per cooldown_s.
struct ScalePolicy {
  std::string node;
  int32_t min_workers = 1;
  int32_t max_workers = 1;
  int32_t queue_depth_high = 32;
  int32_t queue_depth_low = 0;
  double kv_use_high = 0.85;
  double kv_use_low = 0.3;
  int32_t outstanding_handoffs_high = 16;
  double cooldown_s = 60;
  Source source;
};

// disaggregation: which nodes prefill and which decode, and how the KV moves.
// When absent it is derived: nodes running prefill / nodes running decode.
struct DisaggregationPolicy {
  std::vector<std::string> prefill;
  std::vector<std::string> decode;
  HandoffTransport handoff_transport = HandoffTransport::ucx;
  double handoff_timeout_s = 30;
  bool derived = false;  // true when the manifest did not give it
};

struct Policies {
  RestartPolicy restart;
  std::optional<LongTailPolicy> long_tail;  // absent: never park
  std::vector<ScalePolicy> scale;           // empty: fixed replicas
  DisaggregationPolicy disaggregation;
};

// SIGTERM and scale-down: stop admitting, finish or migrate in-flight
// requests, exit 0 within timeout_s.
struct Drain {
  double timeout_s = 120;
};

struct KubernetesSpec {
  std::string namespace_name;               // empty: left to kubectl / kustomize
  std::string image = "troupe:0.1.0";
  std::string image_pull_policy = "IfNotPresent";
  std::string cluster_domain = "cluster.local";
  std::string gateway_service_type = "ClusterIP";  // ClusterIP | NodePort | LoadBalancer
  uint16_t gateway_service_port = 80;
  std::string model_claim;                  // PersistentVolumeClaim with the weights (read-only)
  std::string model_mount = "/models";      // where the claim is mounted; model.path lies under it
  std::string gpu_resource = "nvidia.com/gpu";
  std::string api_key_secret;               // Secret whose key `api-key` the gateways require (TROUPE_API_KEY); empty: none
};

struct Node {
  std::string name;
  std::vector<ActorKind> actors;
  int32_t replicas = 1;    // instances started; with a scale rule, min_workers..max_workers
  int32_t devices = 0;     // GPUs per instance; 0: the CPU backend
  std::vector<Endpoint> addresses;  // static discovery: one per instance slot (slot i -> addresses[i])
  Ports ports;             // the topology's ports, overridden per node
  Workload workload = Workload::stateful_set;
  std::string cpu;         // Kubernetes CPU request (quantity), optional
  std::string memory;      // Kubernetes memory request and limit (quantity), optional
  Source source;

  bool runs(ActorKind kind) const;
  bool is_worker() const { return runs(ActorKind::prefill) || runs(ActorKind::decode); }
};

// One process: slot `ordinal` of `node`. A Deployment node has one name for
// all its replicas (ordinal -1): its pods are interchangeable.
struct Instance {
  const Node* node = nullptr;
  int32_t ordinal = 0;
  std::string name;  // "<node>-<ordinal>", or "<node>" for a Deployment node
};

struct Topology {
  int32_t version = 1;
  std::string name;           // DNS label; prefix of every Kubernetes object
  std::string source_path;    // the manifest file ("<string>" when parsed from text)
  std::string source_text;    // the manifest as written (goes into the ConfigMap)
  ModelSpec model;
  Discovery discovery = Discovery::static_addresses;
  Ports ports;
  Pools pools;
  std::vector<Node> nodes;
  Policies policies;
  Drain drain;
  KubernetesSpec kubernetes;

  const Node* find_node(std::string_view name) const;
  const ScalePolicy* scale_rule(std::string_view node) const;
  // Instance slots of a node: replicas, or max_workers when a scale rule covers it.
  int32_t slots(const Node& node) const;
  // Every instance slot of every node, in manifest order.
  std::vector<Instance> instances() const;
  // `--node` argument -> instance: "decode-1", or "front" for a node with one
  // slot (or a Deployment node). Empty when there is no such instance.
  std::optional<Instance> find_instance(std::string_view name) const;
  // The transport endpoint of an instance under the given discovery; the
  // namespace is the pod's own (POD_NAMESPACE) on Kubernetes.
  Endpoint transport_endpoint(const Instance& instance, Discovery discovery,
                              std::string_view pod_namespace = "default") const;
  // The HTTP port of an instance: the node's ports.http, plus k for the k-th
  // of the node's slots that share one static host (several slots of a
  // scaled node on one machine; they share its transport_range).
  uint16_t http_port(const Instance& instance) const;
  // Instances that must be connected before `instance` reports ready: every
  // process needs the router; the router needs the first min_workers (or
  // replicas) slots of every prefill and decode node. /health answers 200 only
  // when these peers are connected and the weights are loaded.
  std::vector<std::string> required_peers(const Instance& instance) const;
  // Names of Kubernetes objects: "<topology>-<node>".
  std::string object_name(const Node& node) const;
  // Seconds Kubernetes waits after SIGTERM: the drain timeout plus a margin.
  int64_t termination_grace_s() const;
};

// TROUPE_DISCOVERY ("static" | "kubernetes") when set, else the manifest's.
Discovery effective_discovery(const Topology& topology);

}  // namespace troupe::deploy
