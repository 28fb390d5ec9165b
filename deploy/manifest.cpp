// Manifest YAML -> Topology. Two passes: the reading pass checks each field on
// its own (types, ranges, unknown and duplicate fields) and remembers where
// each field was; the checking pass checks the fields against each other
// (names that must exist, ports that must not collide, actors a policy needs).
#include "deploy/manifest.hpp"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <tuple>

#include "base/error.hpp"

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

constexpr int kMaxReplicas = 1024;
constexpr int kMaxDevices = 16;
// A StatefulSet name longer than 52 characters leaves no room for the
// controller-revision-hash label of its pods.
constexpr size_t kMaxObjectName = 52;

// ---------------------------------------------------------------------------
// Diagnostics and where fields were.

class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}

  void error(const YAML::Mark& mark, const std::string& field, std::string message) {
    Diagnostic d{file_, mark.line >= 0 ? mark.line + 1 : 0, mark.column >= 0 ? mark.column + 1 : 0, field,
                 std::move(message)};
    errors_.push_back(std::move(d));
  }
  // For checks across fields: the mark of `field`, else of its closest parent.
  void error_at(const std::string& field, std::string message) {
    std::string p = field;
    while (true) {
      auto it = marks_.find(p);
      if (it != marks_.end()) return error(it->second, field, std::move(message));
      auto cut = p.find_last_of(".[");
      if (cut == std::string::npos) break;
      p = p.substr(0, cut);
    }
    error(YAML::Mark(), field, std::move(message));
  }
  void remember(const std::string& field, const YAML::Mark& mark) { marks_.emplace(field, mark); }
  Source source_of(const std::string& field) const {
    auto it = marks_.find(field);
    if (it == marks_.end()) return {};
    return {it->second.line + 1, it->second.column + 1};
  }
  std::vector<Diagnostic> take_errors() { return std::move(errors_); }
  bool failed() const { return !errors_.empty(); }

 private:
  std::string file_;
  std::vector<Diagnostic> errors_;
  std::map<std::string, YAML::Mark> marks_;
};

std::string join(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}
std::string index(const std::string& path, size_t i) { return fmt::format("{}[{}]", path, i); }

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string suggestion(std::string_view word, const std::vector<std::string_view>& known) {
  std::string_view best;
  size_t best_d = 3;
  for (auto k : known) {
    size_t d = edit_distance(word, k);
    if (d < best_d) best_d = d, best = k;
  }
  return best.empty() ? "" : fmt::format(" (did you mean '{}'?)", best);
}

std::string list(const std::vector<std::string_view>& names) {
  std::string out;
  for (auto n : names) out += (out.empty() ? "" : ", ") + std::string(n);
  return out;
}

const char* kind_of(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Map: return "a mapping";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Null: return "empty";
    default: return "a scalar";
  }
}

// One YAML mapping read field by field. Unknown and duplicate keys are
// reported on construction; `get` returns an undefined node for absent keys.
class MapReader {
 public:
  MapReader(Reader& r, const YAML::Node& node, std::string path, std::vector<std::string_view> known)
      : r_(r), path_(std::move(path)), mark_(node.Mark()) {
    if (!node.IsMap()) {
      r_.error(node.Mark(), path_, fmt::format("must be a mapping of fields, not {}", kind_of(node)));
      return;
    }
    valid_ = true;
    for (const auto& kv : node) {
      const YAML::Node k = kv.first;
      const YAML::Node value = kv.second;
      if (!k.IsScalar()) {
        r_.error(k.Mark(), path_, "field names must be plain words");
        continue;
      }
      std::string key = k.Scalar();
      std::string field = join(path_, key);
      if (std::find(known.begin(), known.end(), key) == known.end()) {
        r_.error(k.Mark(), field,
                 fmt::format("unknown field{}; known fields here: {}", suggestion(key, known), list(known)));
        continue;
      }
      auto [pos, inserted] = entries_.emplace(key, std::make_pair(k, value));
      if (!inserted) {
        r_.error(k.Mark(), field,
                 fmt::format("duplicate field (first given on line {})", pos->second.first.Mark().line + 1));
        continue;
      }
      r_.remember(field, value.IsNull() ? k.Mark() : value.Mark());
    }
  }

  bool valid() const { return valid_; }
  const YAML::Mark& mark() const { return mark_; }
  const std::string& path() const { return path_; }
  std::string field(std::string_view key) const { return join(path_, key); }

  // The value of `key`; undefined when absent. A key given with no value is
  // reported here (it is almost always a mistake) and treated as absent.
  YAML::Node get(std::string_view key) const {
    auto it = entries_.find(std::string(key));
    if (it == entries_.end()) return YAML::Node(YAML::NodeType::Undefined);
    if (it->second.second.IsNull()) {
      r_.error(it->second.first.Mark(), field(key), "has no value");
      return YAML::Node(YAML::NodeType::Undefined);
    }
    return it->second.second;
  }
  bool has(std::string_view key) const { return entries_.count(std::string(key)) > 0; }
  YAML::Mark key_mark(std::string_view key) const {
    auto it = entries_.find(std::string(key));
    return it == entries_.end() ? mark_ : it->second.first.Mark();
  }
  // Reports a missing required field at the mapping.
  void missing(std::string_view key, std::string_view what) const {
    r_.error(mark_, field(key), fmt::format("missing; {}", what));
  }

 private:
  Reader& r_;
  std::string path_;
  YAML::Mark mark_;
  bool valid_ = false;
  std::map<std::string, std::pair<YAML::Node, YAML::Node>> entries_;
};

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
       {"namespace", "image", "image_pull_policy", "cluster_domain", "gateway_service", "model_volume", "gpu_resource"}},
      {"kubernetes.gateway_service", {"type", "port"}},
      {"kubernetes.model_volume", {"claim", "mount"}},
  };
  return table;
}

const std::vector<std::string_view>& fields_of(const std::string& section) { return field_table().at(section); }

// ---------------------------------------------------------------------------
// Scalars.

std::optional<std::string> read_string(Reader& r, const YAML::Node& n, const std::string& field) {
  if (!n.IsDefined()) return std::nullopt;
  if (!n.IsScalar()) {
    r.error(n.Mark(), field, fmt::format("must be a string, not {}", kind_of(n)));
    return std::nullopt;
  }
  return n.Scalar();
}

std::optional<int64_t> read_int(Reader& r, const YAML::Node& n, const std::string& field, int64_t lo, int64_t hi) {
  if (!n.IsDefined()) return std::nullopt;
  if (!n.IsScalar()) {
    r.error(n.Mark(), field, fmt::format("must be an integer, not {}", kind_of(n)));
    return std::nullopt;
  }
  const std::string& s = n.Scalar();
  static const std::regex integer(R"(^[+-]?[0-9]+$)");
  if (!std::regex_match(s, integer)) {
    r.error(n.Mark(), field, fmt::format("must be an integer, not '{}'", s));
    return std::nullopt;
  }
  int64_t v = 0;
  try {
    v = std::stoll(s);
  } catch (const std::exception&) {
    r.error(n.Mark(), field, fmt::format("{} is out of range [{}, {}]", s, lo, hi));
    return std::nullopt;
  }
  if (v < lo || v > hi) {
    r.error(n.Mark(), field, fmt::format("{} is out of range [{}, {}]", v, lo, hi));
    return std::nullopt;
  }
  return v;
}

// A number in a range; `lo_open` / `hi_open` exclude the bound.
struct Range {
  double lo, hi;
  bool lo_open = false, hi_open = false;
  bool contains(double v) const {
    return (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  }
  std::string to_string() const {
    return fmt::format("{}{}, {}{}", lo_open ? "(" : "[", lo, hi, hi_open ? ")" : "]");
  }
};

std::optional<double> parse_number(const std::string& s) {
  static const std::regex number(R"(^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$)");
  if (!std::regex_match(s, number)) return std::nullopt;
  return std::stod(s);
}

std::optional<double> read_number(Reader& r, const YAML::Node& n, const std::string& field, Range range) {
  if (!n.IsDefined()) return std::nullopt;
  if (!n.IsScalar()) {
    r.error(n.Mark(), field, fmt::format("must be a number, not {}", kind_of(n)));
    return std::nullopt;
  }
  auto v = parse_number(n.Scalar());
  if (!v) {
    r.error(n.Mark(), field, fmt::format("must be a number, not '{}'", n.Scalar()));
    return std::nullopt;
  }
  if (!range.contains(*v)) {
    r.error(n.Mark(), field, fmt::format("{} is out of range {}", n.Scalar(), range.to_string()));
    return std::nullopt;
  }
  return v;
}

// "64GiB", "512MiB", "40GB", "8Gi", "1048576" (bytes).
std::optional<uint64_t> parse_size(const std::string& s) {
  static const std::regex size(R"(^([0-9]+(\.[0-9]+)?)\s*([KMGT]i?B?|B)?$)");
  std::smatch m;
  if (!std::regex_match(s, m, size)) return std::nullopt;
  double v = std::stod(m[1].str());
  std::string unit = m[3].str();
  double scale = 1;
  if (!unit.empty() && unit != "B") {
    const bool binary = unit.size() > 1 && unit[1] == 'i';
    const double base = binary ? 1024.0 : 1000.0;
    const int power = std::string_view("KMGT").find(unit[0]) + 1;
    scale = std::pow(base, power);
  }
  double bytes = v * scale;
  if (bytes > 1.8e19) return std::nullopt;
  return static_cast<uint64_t>(bytes);
}

std::optional<uint64_t> read_size(Reader& r, const YAML::Node& n, const std::string& field) {
  if (!n.IsDefined()) return std::nullopt;
  auto s = read_string(r, n, field);
  if (!s) return std::nullopt;
  auto v = parse_size(*s);
  if (!v) {
    r.error(n.Mark(), field, fmt::format("'{}' is not a size (examples: 64GiB, 512MiB, 40GB)", *s));
    return std::nullopt;
  }
  return v;
}

std::optional<std::string> read_choice(Reader& r, const YAML::Node& n, const std::string& field,
                                       const std::vector<std::string_view>& choices) {
  auto s = read_string(r, n, field);
  if (!s) return std::nullopt;
  if (std::find(choices.begin(), choices.end(), *s) == choices.end()) {
    r.error(n.Mark(), field, fmt::format("'{}' is not one of: {}{}", *s, list(choices), suggestion(*s, choices)));
    return std::nullopt;
  }
  return s;
}

bool is_dns_label(const std::string& s) {
  static const std::regex label(R"(^[a-z]([-a-z0-9]*[a-z0-9])?$)");
  return s.size() <= 63 && std::regex_match(s, label);
}

bool is_dns_subdomain(const std::string& s) {
  static const std::regex sub(R"(^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$)");
  return s.size() <= 253 && std::regex_match(s, sub);
}

std::optional<std::string> read_dns_label(Reader& r, const YAML::Node& n, const std::string& field) {
  auto s = read_string(r, n, field);
  if (!s) return std::nullopt;
  if (!is_dns_label(*s)) {
    r.error(n.Mark(), field,
            fmt::format("'{}' is not a valid name: lower-case letters, digits and '-', starting with a letter, "
                        "at most 63 characters",
                        *s));
    return std::nullopt;
  }
  return s;
}

std::optional<uint16_t> read_port(Reader& r, const YAML::Node& n, const std::string& field) {
  auto v = read_int(r, n, field, 1, 65535);
  if (!v) return std::nullopt;
  return static_cast<uint16_t>(*v);
}

std::optional<PortRange> read_port_range(Reader& r, const YAML::Node& n, const std::string& field) {
  auto s = read_string(r, n, field);
  if (!s) return std::nullopt;
  static const std::regex range(R"(^([0-9]{1,5})-([0-9]{1,5})$)");
  std::smatch m;
  if (std::regex_match(*s, m, range)) {
    int first = std::stoi(m[1].str()), last = std::stoi(m[2].str());
    if (first >= 1 && last <= 65535 && first <= last) {
      return PortRange{static_cast<uint16_t>(first), static_cast<uint16_t>(last)};
    }
  }
  r.error(n.Mark(), field, fmt::format("'{}' is not a port range FIRST-LAST with 1 <= FIRST <= LAST <= 65535", *s));
  return std::nullopt;
}

std::optional<Endpoint> parse_endpoint(const std::string& s, uint16_t default_port) {
  static const std::regex v6(R"(^\[([0-9a-fA-F:.]+)\](:([0-9]{1,5}))?$)");
  static const std::regex host(R"(^([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?)(:([0-9]{1,5}))?$)");
  std::smatch m;
  std::string h, p;
  if (std::regex_match(s, m, v6)) {
    h = m[1].str(), p = m[3].str();
  } else if (std::regex_match(s, m, host)) {
    h = m[1].str(), p = m[4].str();
  } else {
    return std::nullopt;
  }
  int port = p.empty() ? default_port : std::stoi(p);
  if (port < 1 || port > 65535) return std::nullopt;
  return Endpoint{h, static_cast<uint16_t>(port)};
}

template <class F>
void for_each_item(Reader& r, const YAML::Node& n, const std::string& field, F&& f) {
  if (!n.IsDefined()) return;
  if (!n.IsSequence()) {
    r.error(n.Mark(), field, fmt::format("must be a list, not {}", kind_of(n)));
    return;
  }
  for (size_t i = 0; i < n.size(); ++i) {
    r.remember(index(field, i), n[i].Mark());
    f(n[i], index(field, i), i);
  }
}

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

// ---------------------------------------------------------------------------
// The checking pass: fields against each other.

void check(Reader& r, Topology& t, bool disaggregation_given) {
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
      std::vector<Use> mine = {{who + " http", {n.ports.http, n.ports.http}},
                               {who + " transport", {e.port, e.port}},
                               {who + " transport_range", n.ports.transport_range}};
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
      if (!r.failed()) check(r, t, mr.disaggregation_given_);
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
