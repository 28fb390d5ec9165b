#include "deploy/k8s_render.hpp"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <regex>
#include <set>
#include <utility>
#include <variant>

namespace troupe::deploy {
namespace {

// A small ordered YAML value: yaml-cpp's Node would emit the string "true" or
// "8000" unquoted, which Kubernetes then reads as a bool or a number.
class Value {
 public:
  using Map = std::vector<std::pair<std::string, Value>>;
  using List = std::vector<Value>;

  Value() : v_(Map{}) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(int64_t n) : v_(n) {}
  Value(int n) : v_(static_cast<int64_t>(n)) {}
  Value(bool b) : v_(b) {}
  static Value map() { return Value(); }
  static Value list() {
    Value v;
    v.v_ = List{};
    return v;
  }
  static Value list(std::initializer_list<Value> items) {
    Value v = list();
    for (auto& i : items) v.push(i);
    return v;
  }
  // Sets a field (maps keep insertion order) and returns *this for chaining.
  Value& set(std::string key, Value value) {
    std::get<Map>(v_).emplace_back(std::move(key), std::move(value));
    return *this;
  }
  // Appends the fields of another map.
  Value& merge(const Value& other) {
    for (const auto& kv : std::get<Map>(other.v_)) std::get<Map>(v_).push_back(kv);
    return *this;
  }
  Value& push(Value value) {
    std::get<List>(v_).push_back(std::move(value));
    return *this;
  }
  bool empty() const {
    if (auto* m = std::get_if<Map>(&v_)) return m->empty();
    if (auto* l = std::get_if<List>(&v_)) return l->empty();
    return false;
  }

  void emit(YAML::Emitter& e) const {
    if (auto* s = std::get_if<std::string>(&v_)) {
      if (s->find('\n') != std::string::npos) {
        e << YAML::Literal << *s;
      } else if (ambiguous(*s)) {
        e << YAML::DoubleQuoted << *s;
      } else {
        e << *s;
      }
    } else if (auto* n = std::get_if<int64_t>(&v_)) {
      e << *n;
    } else if (auto* b = std::get_if<bool>(&v_)) {
      e << (*b ? "true" : "false");
    } else if (auto* m = std::get_if<Map>(&v_)) {
      if (m->empty()) {
        e << YAML::Flow << YAML::BeginMap << YAML::EndMap;
        return;
      }
      e << YAML::BeginMap;
      for (const auto& [k, v] : *m) {
        e << YAML::Key << k << YAML::Value;
        v.emit(e);
      }
      e << YAML::EndMap;
    } else if (auto* l = std::get_if<List>(&v_)) {
      if (l->empty()) {
        e << YAML::Flow << YAML::BeginSeq << YAML::EndSeq;
        return;
      }
      e << YAML::BeginSeq;
      for (const auto& v : *l) v.emit(e);
      e << YAML::EndSeq;
    }
  }

 private:
  // Strings a YAML 1.1 or 1.2 reader would take for a number, bool or null.
  static bool ambiguous(const std::string& s) {
    static const std::regex special(
        R"(^([-+]?[0-9][0-9_]*(\.[0-9_]*)?([eE][-+]?[0-9]+)?|[-+]?\.[0-9]+|0[xXoObB][0-9a-fA-F_]+|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)|y|Y|yes|Yes|YES|n|N|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF|null|Null|NULL|~|[0-9]+(:[0-9]+)+)$)");
    return s.empty() || std::regex_match(s, special);
  }

  std::variant<std::string, int64_t, bool, Map, List> v_;
};

std::string hash_hex(const std::string& text) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a, 64 bits
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return fmt::format("{:016x}", h);
}

class Renderer {
 public:
  explicit Renderer(const Topology& t) : t_(t) {}

  std::vector<K8sObject> render() {
    add_config_map();
    if (!t_.policies.scale.empty()) add_rbac();
    for (const auto& n : t_.nodes) {
      if (n.workload == Workload::stateful_set) add_headless_service(n);
    }
    add_gateway_service();
    for (const auto& n : t_.nodes) add_workload(n);
    for (const auto& n : t_.nodes) add_disruption_budget(n);
    add_network_policies();
    return std::move(out_);
  }

 private:
  Value metadata(const std::string& name, const Value& labels) const {
    Value m;
    m.set("name", name);
    if (!t_.kubernetes.namespace_name.empty()) m.set("namespace", t_.kubernetes.namespace_name);
    m.set("labels", labels);
    return m;
  }
  Value topology_labels() const {
    return Value().set("app.kubernetes.io/name", "troupe").set("app.kubernetes.io/instance", t_.name);
  }
  Value node_labels(const Node& n) const { return topology_labels().set("app.kubernetes.io/component", n.name); }
  Value gateway_selector() const {
    return Value().set("app.kubernetes.io/instance", t_.name).set("troupe.dev/gateway", "true");
  }
  Value node_selector(const Node& n) const {
    return Value().set("app.kubernetes.io/instance", t_.name).set("app.kubernetes.io/component", n.name);
  }

  void add(const std::string& api_version, const std::string& kind, const std::string& name, Value metadata_value,
           Value body_key_values) {
    Value doc;
    doc.set("apiVersion", api_version).set("kind", kind).set("metadata", std::move(metadata_value));
    doc.merge(body_key_values);  // spec, data, rules... after metadata
    YAML::Emitter e;
    e.SetIndent(2);
    doc.emit(e);
    out_.push_back({kind, name, std::string(e.c_str()) + "\n"});
  }

  std::string supervisor_account() const { return t_.name + "-supervisor"; }

  void add_config_map() {
    std::string text = t_.source_text;
    if (text.empty() || text.back() != '\n') text += '\n';
    add("v1", "ConfigMap", t_.name + "-manifest", metadata(t_.name + "-manifest", topology_labels()),
        Value().set("data", Value().set("manifest.yaml", text)));
  }

  void add_rbac() {
    const std::string name = supervisor_account();
    add("v1", "ServiceAccount", name, metadata(name, topology_labels()), Value());
    Value scaled = Value::list();
    for (const auto& s : t_.policies.scale) scaled.push(t_.object_name(*t_.find_node(s.node)));
    Value rules = Value::list();
    rules.push(Value()
                   .set("apiGroups", Value::list({"apps"}))
                   .set("resources", Value::list({"statefulsets/scale"}))
                   .set("resourceNames", scaled)
                   .set("verbs", Value::list({"get", "patch", "update"})));
    rules.push(Value()
                   .set("apiGroups", Value::list({"apps"}))
                   .set("resources", Value::list({"statefulsets"}))
                   .set("resourceNames", scaled)
                   .set("verbs", Value::list({"get"})));
    add("rbac.authorization.k8s.io/v1", "Role", name, metadata(name, topology_labels()), Value().set("rules", rules));
    Value subject = Value().set("kind", "ServiceAccount").set("name", name);
    if (!t_.kubernetes.namespace_name.empty()) subject.set("namespace", t_.kubernetes.namespace_name);
    add("rbac.authorization.k8s.io/v1", "RoleBinding", name, metadata(name, topology_labels()),
        Value()
            .set("roleRef", Value().set("apiGroup", "rbac.authorization.k8s.io").set("kind", "Role").set("name", name))
            .set("subjects", Value::list({subject})));
  }

  // Peers resolve each other before they are ready (readiness waits for the
  // peers), so the headless Service publishes not-ready addresses.
  void add_headless_service(const Node& n) {
    const std::string name = t_.object_name(n);
    Value ports = Value::list();
    ports.push(Value().set("name", "transport").set("port", int(n.ports.transport)).set("targetPort", "transport").set("protocol", "TCP"));
    ports.push(Value().set("name", "http").set("port", int(n.ports.http)).set("targetPort", "http").set("protocol", "TCP"));
    add("v1", "Service", name, metadata(name, node_labels(n)),
        Value().set("spec", Value()
                                .set("clusterIP", "None")
                                .set("publishNotReadyAddresses", true)
                                .set("selector", node_selector(n))
                                .set("ports", ports)));
  }

  void add_gateway_service() {
    Value port = Value()
                     .set("name", "http")
                     .set("port", int(t_.kubernetes.gateway_service_port))
                     .set("targetPort", "http")
                     .set("protocol", "TCP");
    add("v1", "Service", t_.name, metadata(t_.name, topology_labels().set("app.kubernetes.io/component", "gateway")),
        Value().set("spec", Value()
                                .set("type", t_.kubernetes.gateway_service_type)
                                .set("selector", gateway_selector())
                                .set("ports", Value::list({port}))));
  }

  Value env_field(const std::string& name, const std::string& path) const {
    return Value().set("name", name).set("valueFrom", Value().set("fieldRef", Value().set("fieldPath", path)));
  }
  Value env(const std::string& name, const std::string& value) const {
    return Value().set("name", name).set("value", value);
  }
  Value probe(const char* path, int period, int timeout, int failures) const {
    return Value()
        .set("httpGet", Value().set("path", path).set("port", "http"))
        .set("periodSeconds", period)
        .set("timeoutSeconds", timeout)
        .set("failureThreshold", failures);
  }

  Value pod_template(const Node& n) const {
    const bool stateful = n.workload == Workload::stateful_set;
    Value labels = node_labels(n);
    if (n.runs(ActorKind::gateway)) labels.set("troupe.dev/gateway", "true");

    Value envs = Value::list();
    envs.push(env_field("POD_NAME", "metadata.name"));
    envs.push(env_field("POD_NAMESPACE", "metadata.namespace"));
    if (stateful) {
      // StatefulSet pod <topology>-<node>-<i> carries the label pod-index=i
      // (Kubernetes >= 1.28); its manifest instance is <node>-<i>.
      envs.push(env_field("POD_INDEX", "metadata.labels['apps.kubernetes.io/pod-index']"));
      envs.push(env("NODE_NAME", n.name + "-$(POD_INDEX)"));
    } else {
      envs.push(env("NODE_NAME", n.name));
    }
    envs.push(env("TROUPE_DISCOVERY", "kubernetes"));
    envs.push(env("TROUPE_CACHE_DIR", kCacheDir));
    envs.push(env("HOME", "/tmp"));
    if (n.runs(ActorKind::gateway) && !t_.kubernetes.api_key_secret.empty()) {
      envs.push(Value().set("name", "TROUPE_API_KEY")
                    .set("valueFrom", Value().set("secretKeyRef", Value()
                                                                      .set("name", t_.kubernetes.api_key_secret)
                                                                      .set("key", "api-key"))));
    }
    envs.push(env("UCX_TCP_PORT_RANGE",
                  fmt::format("{}-{}", n.ports.transport_range.first, n.ports.transport_range.last)));

    Value ports = Value::list();
    ports.push(Value().set("name", "http").set("containerPort", int(n.ports.http)).set("protocol", "TCP"));
    ports.push(Value().set("name", "transport").set("containerPort", int(n.ports.transport)).set("protocol", "TCP"));

    Value requests, limits;
    if (!n.cpu.empty()) requests.set("cpu", n.cpu);
    if (!n.memory.empty()) {
      requests.set("memory", n.memory);
      limits.set("memory", n.memory);
    }
    if (n.devices > 0) {
      requests.set(t_.kubernetes.gpu_resource, int(n.devices));
      limits.set(t_.kubernetes.gpu_resource, int(n.devices));
    }
    Value resources;
    if (!requests.empty()) resources.set("requests", requests);
    if (!limits.empty()) resources.set("limits", limits);

    Value mounts = Value::list();
    mounts.push(Value().set("name", "manifest").set("mountPath", kManifestMountDir).set("readOnly", true));
    mounts.push(Value().set("name", "tmp").set("mountPath", "/tmp"));
    mounts.push(Value().set("name", "cache").set("mountPath", kCacheDir));
    mounts.push(Value().set("name", "shm").set("mountPath", "/dev/shm"));
    const bool model_volume = !t_.kubernetes.model_claim.empty();
    if (model_volume) {
      mounts.push(Value().set("name", "model").set("mountPath", t_.kubernetes.model_mount).set("readOnly", true));
    }

    Value container;
    container.set("name", "troupe")
        .set("image", t_.kubernetes.image)
        .set("imagePullPolicy", t_.kubernetes.image_pull_policy)
        .set("command", Value::list({"troupe", "run", "--manifest", kManifestFile, "--node", "$(NODE_NAME)"}))
        .set("env", envs)
        .set("ports", ports)
        // Liveness: the process answers (it serves HTTP before loading weights).
        // Readiness: every required peer connected, weights loaded, not draining.
        .set("startupProbe", probe(kLivenessPath, 10, 5, 180))
        .set("livenessProbe", probe(kLivenessPath, 10, 5, 6))
        .set("readinessProbe", probe(kReadinessPath, 5, 3, 2));
    if (n.runs(ActorKind::gateway)) {
      // Let the Service drop this pod before the drain stops admitting.
      container.set("lifecycle",
                    Value().set("preStop", Value().set("exec", Value().set("command", Value::list({"sleep", "5"})))));
    }
    if (!resources.empty()) container.set("resources", resources);
    container.set("securityContext", Value()
                                         .set("allowPrivilegeEscalation", false)
                                         .set("readOnlyRootFilesystem", true)
                                         .set("runAsNonRoot", true)
                                         .set("capabilities", Value().set("drop", Value::list({"ALL"}))))
        .set("volumeMounts", mounts);

    Value volumes = Value::list();
    volumes.push(Value().set("name", "manifest").set("configMap", Value().set("name", t_.name + "-manifest")));
    volumes.push(Value().set("name", "tmp").set("emptyDir", Value()));
    volumes.push(Value().set("name", "cache").set("emptyDir", Value()));
    volumes.push(Value().set("name", "shm").set("emptyDir", Value().set("medium", "Memory")));
    if (model_volume) {
      volumes.push(Value().set("name", "model").set(
          "persistentVolumeClaim", Value().set("claimName", t_.kubernetes.model_claim).set("readOnly", true)));
    }

    const bool supervisor = !t_.policies.scale.empty() && n.runs(ActorKind::router);
    Value spec;
    if (supervisor) spec.set("serviceAccountName", supervisor_account());
    spec.set("automountServiceAccountToken", supervisor)
        .set("enableServiceLinks", false)
        .set("terminationGracePeriodSeconds", t_.termination_grace_s())
        .set("securityContext", Value()
                                    .set("runAsNonRoot", true)
                                    .set("runAsUser", kRunAsUser)
                                    .set("runAsGroup", kRunAsUser)
                                    .set("fsGroup", kRunAsUser)
                                    .set("seccompProfile", Value().set("type", "RuntimeDefault")));
    if (n.devices > 0) {
      spec.set("tolerations", Value::list({Value()
                                               .set("key", t_.kubernetes.gpu_resource)
                                               .set("operator", "Exists")
                                               .set("effect", "NoSchedule")}));
    }
    spec.set("containers", Value::list({container})).set("volumes", volumes);

    return Value()
        .set("metadata", Value().set("labels", labels).set("annotations",
                                                           Value().set("troupe.dev/manifest-hash", hash_hex(t_.source_text))))
        .set("spec", spec);
  }

  void add_workload(const Node& n) {
    const std::string name = t_.object_name(n);
    Value selector = Value().set("matchLabels", node_selector(n));
    if (n.workload == Workload::stateful_set) {
      add("apps/v1", "StatefulSet", name, metadata(name, node_labels(n)),
          Value().set("spec", Value()
                                  .set("serviceName", name)
                                  .set("replicas", int(n.replicas))
                                  // Any start order: peers wait for each other, not for ordinals.
                                  .set("podManagementPolicy", "Parallel")
                                  .set("updateStrategy", Value().set("type", "RollingUpdate"))
                                  .set("selector", selector)
                                  .set("template", pod_template(n))));
    } else {
      add("apps/v1", "Deployment", name, metadata(name, node_labels(n)),
          Value().set("spec", Value()
                                  .set("replicas", int(n.replicas))
                                  .set("strategy", Value().set("type", "RollingUpdate").set(
                                                       "rollingUpdate", Value().set("maxUnavailable", 0).set("maxSurge", 1)))
                                  .set("selector", selector)
                                  .set("template", pod_template(n))));
    }
  }

  void add_disruption_budget(const Node& n) {
    const std::string name = t_.object_name(n);
    add("policy/v1", "PodDisruptionBudget", name, metadata(name, node_labels(n)),
        Value().set("spec", Value().set("maxUnavailable", 1).set("selector", Value().set("matchLabels", node_selector(n)))));
  }

  void add_network_policies() {
    // Transport ports between the topology's pods.
    std::set<std::pair<uint16_t, uint16_t>> transport;
    std::set<uint16_t> gateway_http;
    for (const auto& n : t_.nodes) {
      transport.insert({n.ports.transport, n.ports.transport});
      transport.insert({n.ports.transport_range.first, n.ports.transport_range.last});
      if (n.runs(ActorKind::gateway)) gateway_http.insert(n.ports.http);
    }
    Value peer_ports = Value::list();
    for (auto [first, last] : transport) {
      Value p = Value().set("protocol", "TCP").set("port", int(first));
      if (last != first) p.set("endPort", int(last));
      peer_ports.push(p);
    }
    Value from_peers = Value::list({Value().set("podSelector", Value().set("matchLabels", topology_labels()))});
    add("networking.k8s.io/v1", "NetworkPolicy", t_.name + "-peers", metadata(t_.name + "-peers", topology_labels()),
        Value().set("spec", Value()
                                .set("podSelector", Value().set("matchLabels", topology_labels()))
                                .set("policyTypes", Value::list({"Ingress"}))
                                .set("ingress", Value::list({Value().set("from", from_peers).set("ports", peer_ports)}))));
    // The gateway port from anywhere, to gateway pods only.
    Value http_ports = Value::list();
    for (auto p : gateway_http) http_ports.push(Value().set("protocol", "TCP").set("port", int(p)));
    add("networking.k8s.io/v1", "NetworkPolicy", t_.name + "-gateway", metadata(t_.name + "-gateway", topology_labels()),
        Value().set("spec", Value()
                                .set("podSelector", Value().set("matchLabels", gateway_selector()))
                                .set("policyTypes", Value::list({"Ingress"}))
                                .set("ingress", Value::list({Value().set("ports", http_ports)}))));
  }

  const Topology& t_;
  std::vector<K8sObject> out_;
};

}  // namespace

std::string K8sObject::file_name() const {
  std::string k = kind;
  std::transform(k.begin(), k.end(), k.begin(), [](unsigned char c) { return std::tolower(c); });
  return fmt::format("{}-{}.yaml", k, name);
}

std::vector<K8sObject> render_k8s(const Topology& topology) { return Renderer(topology).render(); }

std::string to_yaml_stream(const std::vector<K8sObject>& objects) {
  std::string out;
  for (const auto& o : objects) out += "---\n" + o.yaml;
  return out;
}

std::string kustomization(const std::vector<K8sObject>& objects) {
  std::string out = "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n";
  for (const auto& o : objects) out += "- " + o.file_name() + "\n";
  return out;
}

}  // namespace troupe::deploy
