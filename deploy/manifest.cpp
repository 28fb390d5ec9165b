// Manifest YAML -> Topology. Two passes: this reading pass checks each field on
// its own (types, ranges, unknown and duplicate fields) and remembers where
// each field was; the checking pass (manifest_check.cpp) checks the fields
// against each other.
#include "deploy/manifest.hpp"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <tuple>

#include "base/error.hpp"
#include "deploy/manifest_check.hpp"
#include "deploy/yaml_fields.hpp"

namespace troupe::deploy {

std::string Diagnostic::to_string() const {
  std::string where = line > 0 ? fmt::format("{}:{}:{}: ", file, line, column) : fmt::format("{}: ", file);
  return field.empty() ? where + message : fmt::format("{}{}: {}", where, field, message);
}

std::string ParsedManifest::report() const {
  std::string out;
  for (const auto& e : errors) out += e.to_string() + "\n";
  return out;
}

namespace {

using namespace detail;

constexpr int kMaxReplicas = 1024;
constexpr int kMaxDevices = 16;

// Every field of the format, by the mapping it belongs to ("[]": each item of
// a list). The reader accepts exactly these; docs/manifest.md documents them all.
const std::map<std::string, std::vector<std::string_view>>& field_table() {
  static const std::map<std::string, std::vector<std::string_view>> table = {
      {"", {"version", "name", "model", "discovery", "ports", "pools", "nodes", "policies", "drain", "kubernetes"}},
      {"model", {"path"}},
      {"ports", {"http", "transport", "transport_range"}},
      {"pools", {"memory_budget", "context_mix", "ratios", "host_tier"}},
      {"pools.context_mix[]", {"prompt_tokens", "output_tokens", "share"}},
      {"pools.ratios", {"swa", "csa_entries", "index_keys", "hca_entries", "inflight"}},
      {"nodes[]", {"name", "actors", "replicas", "devices", "address", "ports", "workload", "cpu", "memory"}},
      {"policies", {"restart", "long_tail", "scale", "disaggregation"}},
      {"policies.restart", {"max_restarts", "window_s"}},
      {"policies.long_tail", {"pressure_threshold", "resume_threshold", "max_deferrals"}},
      {"policies.scale[]",
       {"node", "min_workers", "max_workers", "queue_depth_high", "queue_depth_low", "kv_use_high", "kv_use_low",
        "outstanding_handoffs_high", "cooldown_s"}},
      {"policies.disaggregation", {"prefill", "decode", "handoff_transport", "handoff_timeout_s"}},
      {"drain", {"timeout_s"}},
      {"kubernetes",
       {"namespace", "image", "image_pull_policy", "cluster_domain", "gateway_service", "model_volume", "gpu_resource",
        "api_key_secret"}},
      {"kubernetes.gateway_service", {"type", "port"}},
      {"kubernetes.model_volume", {"claim", "mount"}},
  };
  return table;
}

const std::vector<std::string_view>& fields_of(const std::string& section) { return field_table().at(section); }

std::vector<std::string_view> actor_names() {
  std::vector<std::string_view> out;
  for (auto k : kAllActorKinds) out.emplace_back(to_string(k));
  return out;
}

// ---------------------------------------------------------------------------
// The reading pass.

class ManifestReader {
 public:
  explicit ManifestReader(Reader& r) : r_(r) {}

  void read(const YAML::Node& doc, Topology& t) {
    MapReader top(r_, doc, "", fields_of(""));
    if (!top.valid()) return;
    if (auto v = read_int(r_, top.get("version"), "version", 1, 1000)) {
      if (*v != 1) r_.error(top.get("version").Mark(), "version", fmt::format("{} is not supported (this troupe reads version 1)", *v));
      t.version = static_cast<int32_t>(*v);
    }
    if (!top.has("name")) top.missing("name", "give the topology a name (a DNS label, e.g. 'troupe')");
    if (auto v = read_dns_label(r_, top.get("name"), "name")) t.name = *v;
    if (!top.has("model")) {
      top.missing("model", "give model.path: a model directory, or 'embedded' for the built-in tiny model");
    } else {
      read_model(top.get("model"), t.model);
    }
    if (auto v = read_choice(r_, top.get("discovery"), "discovery", {"static", "kubernetes"})) {
      t.discovery = *v == "kubernetes" ? Discovery::kubernetes : Discovery::static_addresses;
    }
    if (top.get("ports").IsDefined()) read_ports(top.get("ports"), "ports", t.ports);
    if (top.get("pools").IsDefined()) read_pools(top.get("pools"), t.pools);
    if (!top.has("nodes")) top.missing("nodes", "list the processes of the topology");
    nodes_given_ = top.get("nodes");
    if (top.get("policies").IsDefined()) read_policies(top.get("policies"), t.policies);
    if (top.get("drain").IsDefined()) {
      MapReader d(r_, top.get("drain"), "drain", fields_of("drain"));
      if (d.valid()) {
        if (auto v = read_number(r_, d.get("timeout_s"), d.field("timeout_s"), {0, 3600, true})) t.drain.timeout_s = *v;
      }
    }
    if (top.get("kubernetes").IsDefined()) read_kubernetes(top.get("kubernetes"), t.kubernetes);
    // Nodes last: their ports default to the topology's.
    for_each_item(r_, nodes_given_, "nodes", [&](const YAML::Node& n, const std::string& field, size_t) {
      Node node;
      node.ports = t.ports;
      read_node(n, field, node);
      t.nodes.push_back(std::move(node));
    });
    if (nodes_given_.IsDefined() && nodes_given_.IsSequence() && nodes_given_.size() == 0) {
      r_.error(nodes_given_.Mark(), "nodes", "is empty; list at least one node");
    }
  }

 private:
  void read_model(const YAML::Node& n, ModelSpec& m) {
    MapReader mr(r_, n, "model", fields_of("model"));
    if (!mr.valid()) return;
    if (!mr.has("path")) {
      mr.missing("path", "a model directory, or 'embedded' for the built-in tiny model");
      return;
    }
    if (auto v = read_string(r_, mr.get("path"), "model.path")) {
      if (v->empty()) r_.error(mr.get("path").Mark(), "model.path", "is empty; give a model directory or 'embedded'");
      m.path = *v;
    }
  }

  void read_ports(const YAML::Node& n, const std::string& path, Ports& p) {
    MapReader mr(r_, n, path, fields_of("ports"));
    if (!mr.valid()) return;
    if (auto v = read_port(r_, mr.get("http"), mr.field("http"))) p.http = *v;
    if (auto v = read_port(r_, mr.get("transport"), mr.field("transport"))) p.transport = *v;
    if (auto v = read_port_range(r_, mr.get("transport_range"), mr.field("transport_range"))) p.transport_range = *v;
  }

  void read_pools(const YAML::Node& n, Pools& p) {
    MapReader mr(r_, n, "pools", fields_of("pools"));
    if (!mr.valid()) return;
    if (YAML::Node b = mr.get("memory_budget"); b.IsDefined()) {
      auto s = read_string(r_, b, "pools.memory_budget");
      if (s) {
        if (auto f = parse_number(*s)) {
          if (*f > 0 && *f <= 1) {
            p.memory_budget = {0, *f};
          } else {
            r_.error(b.Mark(), "pools.memory_budget",
                     fmt::format("{} is neither a fraction in (0, 1] nor a size with a unit (e.g. 40GiB)", *s));
          }
        } else if (auto bytes = parse_size(*s); bytes && *bytes > 0) {
          p.memory_budget = {*bytes, 0};
        } else {
          r_.error(b.Mark(), "pools.memory_budget",
                   fmt::format("'{}' is neither a fraction in (0, 1] nor a size (e.g. 40GiB)", *s));
        }
      }
    }
    for_each_item(r_, mr.get("context_mix"), "pools.context_mix", [&](const YAML::Node& c, const std::string& f, size_t) {
      MapReader cr(r_, c, f, fields_of("pools.context_mix[]"));
      if (!cr.valid()) return;
      ContextClass cc;
      for (auto key : {"prompt_tokens", "output_tokens", "share"}) {
        if (!cr.has(key)) cr.missing(key, "each context class gives prompt_tokens, output_tokens and share");
      }
      if (auto v = read_int(r_, cr.get("prompt_tokens"), cr.field("prompt_tokens"), 1, int64_t{1} << 40)) cc.prompt_tokens = *v;
      if (auto v = read_int(r_, cr.get("output_tokens"), cr.field("output_tokens"), 1, int64_t{1} << 40)) cc.output_tokens = *v;
      if (auto v = read_number(r_, cr.get("share"), cr.field("share"), {0, 1, true})) cc.share = *v;
      p.context_mix.push_back(cc);
    });
    if (YAML::Node rn = mr.get("ratios"); rn.IsDefined()) {
      MapReader rr(r_, rn, "pools.ratios", fields_of("pools.ratios"));
      if (rr.valid()) {
        PoolRatios q;
        const Range unit{0, 1};
        if (auto v = read_number(r_, rr.get("swa"), rr.field("swa"), unit)) q.swa = *v;
        if (auto v = read_number(r_, rr.get("csa_entries"), rr.field("csa_entries"), unit)) q.csa_entries = *v;
        if (auto v = read_number(r_, rr.get("index_keys"), rr.field("index_keys"), unit)) q.index_keys = *v;
        if (auto v = read_number(r_, rr.get("hca_entries"), rr.field("hca_entries"), unit)) q.hca_entries = *v;
        if (auto v = read_number(r_, rr.get("inflight"), rr.field("inflight"), unit)) q.inflight = *v;
        p.ratios = q;
      }
    }
    if (auto v = read_size(r_, mr.get("host_tier"), "pools.host_tier")) p.host_tier = *v;
  }

  void read_policies(const YAML::Node& n, Policies& p) {
    MapReader mr(r_, n, "policies", fields_of("policies"));
    if (!mr.valid()) return;
    if (YAML::Node rn = mr.get("restart"); rn.IsDefined()) {
      MapReader rr(r_, rn, "policies.restart", fields_of("policies.restart"));
      if (rr.valid()) {
        if (auto v = read_int(r_, rr.get("max_restarts"), rr.field("max_restarts"), 0, 1000)) p.restart.max_restarts = static_cast<int32_t>(*v);
        if (auto v = read_number(r_, rr.get("window_s"), rr.field("window_s"), {0, 86400, true})) p.restart.window_s = *v;
      }
    }
    if (YAML::Node ln = mr.get("long_tail"); ln.IsDefined()) {
      MapReader lr(r_, ln, "policies.long_tail", fields_of("policies.long_tail"));
      if (lr.valid()) {
        LongTailPolicy l;
        if (auto v = read_number(r_, lr.get("pressure_threshold"), lr.field("pressure_threshold"), {0, 1, true})) l.pressure_threshold = *v;
        if (auto v = read_number(r_, lr.get("resume_threshold"), lr.field("resume_threshold"), {0, 1, true, true})) l.resume_threshold = *v;
        if (auto v = read_int(r_, lr.get("max_deferrals"), lr.field("max_deferrals"), 1, 1000)) l.max_deferrals = static_cast<int32_t>(*v);
        p.long_tail = l;
      }
    }
    for_each_item(r_, mr.get("scale"), "policies.scale", [&](const YAML::Node& s, const std::string& f, size_t) {
      MapReader sr(r_, s, f, fields_of("policies.scale[]"));
      if (!sr.valid()) return;
      ScalePolicy sp;
      sp.source = r_.source_of(f);
      if (!sr.has("node")) sr.missing("node", "name the node whose workers this rule adds and removes");
      if (auto v = read_string(r_, sr.get("node"), sr.field("node"))) sp.node = *v;
      if (!sr.has("max_workers")) sr.missing("max_workers", "the most instances this rule may run");
      if (auto v = read_int(r_, sr.get("min_workers"), sr.field("min_workers"), 1, kMaxReplicas)) sp.min_workers = static_cast<int32_t>(*v);
      if (auto v = read_int(r_, sr.get("max_workers"), sr.field("max_workers"), 1, kMaxReplicas)) sp.max_workers = static_cast<int32_t>(*v);
      if (auto v = read_int(r_, sr.get("queue_depth_high"), sr.field("queue_depth_high"), 1, 1000000)) sp.queue_depth_high = static_cast<int32_t>(*v);
      if (auto v = read_int(r_, sr.get("queue_depth_low"), sr.field("queue_depth_low"), 0, 1000000)) sp.queue_depth_low = static_cast<int32_t>(*v);
      if (auto v = read_number(r_, sr.get("kv_use_high"), sr.field("kv_use_high"), {0, 1, true})) sp.kv_use_high = *v;
      if (auto v = read_number(r_, sr.get("kv_use_low"), sr.field("kv_use_low"), {0, 1, false, true})) sp.kv_use_low = *v;
      if (auto v = read_int(r_, sr.get("outstanding_handoffs_high"), sr.field("outstanding_handoffs_high"), 1, 1000000)) sp.outstanding_handoffs_high = static_cast<int32_t>(*v);
      if (auto v = read_number(r_, sr.get("cooldown_s"), sr.field("cooldown_s"), {0, 3600})) sp.cooldown_s = *v;
      p.scale.push_back(std::move(sp));
    });
    if (YAML::Node dn = mr.get("disaggregation"); dn.IsDefined()) {
      MapReader dr(r_, dn, "policies.disaggregation", fields_of("policies.disaggregation"));
      if (dr.valid()) {
        auto& d = p.disaggregation;
        d.derived = false;
        for (auto key : {"prefill", "decode"}) {
          if (!dr.has(key)) dr.missing(key, fmt::format("list the nodes that {}", key));
          auto& names = std::string_view(key) == "prefill" ? d.prefill : d.decode;
          for_each_item(r_, dr.get(key), dr.field(key), [&](const YAML::Node& item, const std::string& f, size_t) {
            if (auto v = read_string(r_, item, f)) names.push_back(*v);
          });
        }
        if (auto v = read_choice(r_, dr.get("handoff_transport"), dr.field("handoff_transport"), {"ucx", "tcp"})) {
          d.handoff_transport = *v == "tcp" ? HandoffTransport::tcp : HandoffTransport::ucx;
        }
        if (auto v = read_number(r_, dr.get("handoff_timeout_s"), dr.field("handoff_timeout_s"), {0, 3600, true})) d.handoff_timeout_s = *v;
        disaggregation_given_ = true;
      }
    }
  }

  void read_kubernetes(const YAML::Node& n, KubernetesSpec& k) {
    MapReader mr(r_, n, "kubernetes", fields_of("kubernetes"));
    if (!mr.valid()) return;
    if (auto v = read_dns_label(r_, mr.get("namespace"), "kubernetes.namespace")) k.namespace_name = *v;
    if (auto v = read_dns_label(r_, mr.get("api_key_secret"), "kubernetes.api_key_secret")) k.api_key_secret = *v;
    if (auto v = read_string(r_, mr.get("image"), "kubernetes.image")) {
      static const std::regex image(R"(^[A-Za-z0-9][A-Za-z0-9._/:@-]*$)");
      if (std::regex_match(*v, image)) {
        k.image = *v;
      } else {
        r_.error(mr.get("image").Mark(), "kubernetes.image", fmt::format("'{}' is not an image reference", *v));
      }
    }
    if (auto v = read_choice(r_, mr.get("image_pull_policy"), "kubernetes.image_pull_policy", {"Always", "IfNotPresent", "Never"})) k.image_pull_policy = *v;
    if (auto v = read_string(r_, mr.get("cluster_domain"), "kubernetes.cluster_domain")) {
      if (is_dns_subdomain(*v)) {
        k.cluster_domain = *v;
      } else {
        r_.error(mr.get("cluster_domain").Mark(), "kubernetes.cluster_domain", fmt::format("'{}' is not a DNS domain", *v));
      }
    }
    if (YAML::Node g = mr.get("gateway_service"); g.IsDefined()) {
      MapReader gr(r_, g, "kubernetes.gateway_service", fields_of("kubernetes.gateway_service"));
      if (gr.valid()) {
        if (auto v = read_choice(r_, gr.get("type"), gr.field("type"), {"ClusterIP", "NodePort", "LoadBalancer"})) k.gateway_service_type = *v;
        if (auto v = read_port(r_, gr.get("port"), gr.field("port"))) k.gateway_service_port = *v;
      }
    }
    if (YAML::Node m = mr.get("model_volume"); m.IsDefined()) {
      MapReader vr(r_, m, "kubernetes.model_volume", fields_of("kubernetes.model_volume"));
      if (vr.valid()) {
        if (!vr.has("claim")) vr.missing("claim", "the PersistentVolumeClaim that holds the weights");
        if (auto v = read_string(r_, vr.get("claim"), vr.field("claim"))) {
          if (is_dns_subdomain(*v)) {
            k.model_claim = *v;
          } else {
            r_.error(vr.get("claim").Mark(), vr.field("claim"), fmt::format("'{}' is not a valid claim name", *v));
          }
        }
        if (auto v = read_string(r_, vr.get("mount"), vr.field("mount"))) {
          if (v->size() > 1 && (*v)[0] == '/') {
            k.model_mount = v->back() == '/' ? v->substr(0, v->size() - 1) : *v;
          } else {
            r_.error(vr.get("mount").Mark(), vr.field("mount"), fmt::format("'{}' is not an absolute directory", *v));
          }
        }
      }
    }
    if (auto v = read_string(r_, mr.get("gpu_resource"), "kubernetes.gpu_resource")) {
      static const std::regex res(R"(^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$)");
      if (std::regex_match(*v, res)) {
        k.gpu_resource = *v;
      } else {
        r_.error(mr.get("gpu_resource").Mark(), "kubernetes.gpu_resource", fmt::format("'{}' is not an extended resource name (vendor.example/name)", *v));
      }
    }
  }

  void read_node(const YAML::Node& n, const std::string& path, Node& node) {
    MapReader mr(r_, n, path, fields_of("nodes[]"));
    if (!mr.valid()) return;
    node.source = r_.source_of(path);
    if (!mr.has("name")) mr.missing("name", "every node has a name");
    if (auto v = read_dns_label(r_, mr.get("name"), mr.field("name"))) node.name = *v;
    if (!mr.has("actors")) mr.missing("actors", fmt::format("list the actors this node runs ({})", list(actor_names())));
    const auto known = actor_names();
    for_each_item(r_, mr.get("actors"), mr.field("actors"), [&](const YAML::Node& a, const std::string& f, size_t) {
      auto s = read_string(r_, a, f);
      if (!s) return;
      if (*s == "node" || *s == "supervisor") {
        r_.error(a.Mark(), f, fmt::format("'{}' runs in every process; do not list it", *s));
        return;
      }
      auto kind = actor_kind_from(*s);
      if (!kind) {
        r_.error(a.Mark(), f, fmt::format("unknown actor '{}'{} (known: {})", *s, suggestion(*s, known), list(known)));
        return;
      }
      if (node.runs(*kind)) {
        r_.error(a.Mark(), f, fmt::format("actor '{}' is listed twice", *s));
        return;
      }
      node.actors.push_back(*kind);
    });
    if (mr.get("actors").IsDefined() && mr.get("actors").IsSequence() && mr.get("actors").size() == 0) {
      r_.error(mr.get("actors").Mark(), mr.field("actors"), "is empty; a node runs at least one actor");
    }
    if (auto v = read_int(r_, mr.get("replicas"), mr.field("replicas"), 1, kMaxReplicas)) node.replicas = static_cast<int32_t>(*v);
    if (auto v = read_int(r_, mr.get("devices"), mr.field("devices"), 0, kMaxDevices)) node.devices = static_cast<int32_t>(*v);
    if (mr.get("ports").IsDefined()) read_ports(mr.get("ports"), mr.field("ports"), node.ports);
    if (YAML::Node a = mr.get("address"); a.IsDefined()) {
      auto add = [&](const YAML::Node& item, const std::string& f) {
        auto s = read_string(r_, item, f);
        if (!s) return;
        auto e = parse_endpoint(*s, node.ports.transport);
        if (!e) {
          r_.error(item.Mark(), f, fmt::format("'{}' is not HOST or HOST:PORT", *s));
          return;
        }
        node.addresses.push_back(*e);
      };
      if (a.IsSequence()) {
        for_each_item(r_, a, mr.field("address"), [&](const YAML::Node& item, const std::string& f, size_t) { add(item, f); });
      } else {
        add(a, mr.field("address"));
      }
    }
    if (auto v = read_choice(r_, mr.get("workload"), mr.field("workload"), {"statefulset", "deployment"})) {
      node.workload = *v == "deployment" ? Workload::deployment : Workload::stateful_set;
    }
    static const std::regex quantity(R"(^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$)");
    for (auto key : {"cpu", "memory"}) {
      if (auto v = read_string(r_, mr.get(key), mr.field(key))) {
        if (std::regex_match(*v, quantity)) {
          (std::string_view(key) == "cpu" ? node.cpu : node.memory) = *v;
        } else {
          r_.error(mr.get(key).Mark(), mr.field(key), fmt::format("'{}' is not a Kubernetes quantity (e.g. 8, 500m, 64Gi)", *v));
        }
      }
    }
  }

 public:
  bool disaggregation_given_ = false;

 private:
  Reader& r_;
  YAML::Node nodes_given_;
};

}  // namespace

std::vector<std::string> manifest_fields() {
  std::vector<std::string> out;
  for (const auto& [section, fields] : field_table()) {
    for (auto f : fields) out.push_back(section.empty() ? std::string(f) : section + "." + std::string(f));
  }
  return out;
}

ParsedManifest parse_manifest(std::string_view yaml_text, std::string source_name) {
  Reader r(source_name);
  ParsedManifest out;
  std::vector<YAML::Node> docs;
  try {
    docs = YAML::LoadAll(std::string(yaml_text));
  } catch (const YAML::ParserException& e) {
    r.error(e.mark, "", fmt::format("YAML syntax error: {}", e.msg));
    out.errors = r.take_errors();
    return out;
  }
  if (docs.empty() || docs[0].IsNull()) {
    r.error(YAML::Mark(), "", "the manifest is empty");
  } else if (docs.size() > 1) {
    r.error(docs[1].Mark(), "", "the manifest holds more than one YAML document; give one");
  } else {
    Topology t;
    t.source_path = source_name;
    t.source_text = std::string(yaml_text);
    ManifestReader mr(r);
    try {
      mr.read(docs[0], t);
      if (!r.failed()) check_topology(r, t, mr.disaggregation_given_);
    } catch (const YAML::Exception& e) {
      r.error(e.mark, "", fmt::format("cannot read this YAML: {}", e.msg));
    }
    if (!r.failed()) out.topology = std::move(t);
  }
  out.errors = r.take_errors();
  // In file order; the two passes find them out of order.
  std::stable_sort(out.errors.begin(), out.errors.end(), [](const Diagnostic& a, const Diagnostic& b) {
    return std::tie(a.line, a.column) < std::tie(b.line, b.column);
  });
  return out;
}

ParsedManifest load_manifest(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    ParsedManifest out;
    out.errors.push_back({path, 0, 0, "", "cannot read the manifest (no such file, or not readable)"});
    return out;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_manifest(ss.str(), path);
}

Topology load_manifest_or_throw(const std::string& path) {
  auto parsed = load_manifest(path);
  if (!parsed.ok()) {
    std::string report = parsed.report();
    if (!report.empty() && report.back() == '\n') report.pop_back();
    raise(ErrorCode::invalid_file, "the manifest has {} error{}:\n{}", parsed.errors.size(),
          parsed.errors.size() == 1 ? "" : "s", report);
  }
  return std::move(*parsed.topology);
}

}  // namespace troupe::deploy
