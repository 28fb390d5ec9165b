#include "deploy/yaml_fields.hpp"

#include <cmath>
#include <cstdlib>
#include <regex>

namespace troupe::deploy::detail {

std::string join(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}
std::string index(const std::string& path, size_t i) { return fmt::format("{}[{}]", path, i); }

static size_t edit_distance(std::string_view a, std::string_view b) {
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

std::optional<double> parse_number(const std::string& s) {
  static const std::regex number(R"(^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$)");
  if (!std::regex_match(s, number)) return std::nullopt;
  // strtod, not stod: past a double's range it gives +-HUGE_VAL (reported out of range by the caller) and
  // below it a value near 0, where stod threw out_of_range past every diagnostic.
  return std::strtod(s.c_str(), nullptr);
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
  double v = std::strtod(m[1].str().c_str(), nullptr);  // +inf past a double: refused below
  std::string unit = m[3].str();
  double scale = 1;
  if (!unit.empty() && unit != "B") {
    const bool binary = unit.size() > 1 && unit[1] == 'i';
    const double base = binary ? 1024.0 : 1000.0;
    const int power = std::string_view("KMGT").find(unit[0]) + 1;
    scale = std::pow(base, power);
  }
  double bytes = v * scale;
  if (!(bytes <= 1.8e19)) return std::nullopt;  // (also +inf)
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

}  // namespace troupe::deploy::detail
