// Reading YAML fields with their positions, for the manifest reader: every
// problem becomes a Diagnostic with the line, column and field path; readers
// return nothing (and report) when a value has the wrong type or range.
// Internal to deploy/.
#pragma once

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "deploy/manifest.hpp"

namespace troupe::deploy::detail {

// Collects the diagnostics of one manifest and remembers where each field
// was (by path), so checks across fields can point at the right line.
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

// Field paths: join("pools", "ratios") = "pools.ratios"; index("nodes", 1) = "nodes[1]".
std::string join(const std::string& path, std::string_view key);
std::string index(const std::string& path, size_t i);
// " (did you mean 'decode'?)" for a near miss among `known`, else "".
std::string suggestion(std::string_view word, const std::vector<std::string_view>& known);
// "a, b, c"
std::string list(const std::vector<std::string_view>& names);
// "a mapping", "a list", "a scalar", "empty"
const char* kind_of(const YAML::Node& n);

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

// ---------------------------------------------------------------------------
// Scalars: each reports its own type and range errors.

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

std::optional<std::string> read_string(Reader& r, const YAML::Node& n, const std::string& field);
std::optional<int64_t> read_int(Reader& r, const YAML::Node& n, const std::string& field, int64_t lo, int64_t hi);
std::optional<double> read_number(Reader& r, const YAML::Node& n, const std::string& field, Range range);
// A size: "64GiB", "512MiB", "40GB", "8Gi", or bytes.
std::optional<uint64_t> read_size(Reader& r, const YAML::Node& n, const std::string& field);
std::optional<std::string> read_choice(Reader& r, const YAML::Node& n, const std::string& field,
                                       const std::vector<std::string_view>& choices);
std::optional<std::string> read_dns_label(Reader& r, const YAML::Node& n, const std::string& field);
std::optional<uint16_t> read_port(Reader& r, const YAML::Node& n, const std::string& field);
// "FIRST-LAST"
std::optional<PortRange> read_port_range(Reader& r, const YAML::Node& n, const std::string& field);

std::optional<double> parse_number(const std::string& s);
std::optional<uint64_t> parse_size(const std::string& s);
// "host", "host:port", "[v6]", "[v6]:port"
std::optional<Endpoint> parse_endpoint(const std::string& s, uint16_t default_port);
bool is_dns_label(const std::string& s);
bool is_dns_subdomain(const std::string& s);

// Calls f(item, "field[i]", i) for each item of a list (reporting a non-list).
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

}  // namespace troupe::deploy::detail
