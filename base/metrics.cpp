#include "base/metrics.hpp"

#include <fmt/format.h>

#include <cmath>

#include "base/check.hpp"

namespace troupe {
namespace {

std::string render_labels(const Labels& labels, const std::string& extra = "") {
  std::string s;
  for (const auto& [k, v] : labels) {
    std::string escaped;
    for (char c : v) {
      if (c == '\\' || c == '"') escaped.push_back('\\');
      if (c == '\n') {
        escaped += "\\n";
        continue;
      }
      escaped.push_back(c);
    }
    s += (s.empty() ? "" : ",") + k + "=\"" + escaped + "\"";
  }
  if (!extra.empty()) s += (s.empty() ? "" : ",") + extra;
  return s.empty() ? "" : "{" + s + "}";
}

std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::abs(v) < 1e15) return fmt::format("{}", static_cast<int64_t>(v));
  return fmt::format("{}", v);
}

}  // namespace

void Counter::inc(double v) {
  std::lock_guard<std::mutex> l(mu_);
  v_ += v;
}
double Counter::value() const {
  std::lock_guard<std::mutex> l(mu_);
  return v_;
}
void Gauge::set(double v) {
  std::lock_guard<std::mutex> l(mu_);
  v_ = v;
}
void Gauge::add(double v) {
  std::lock_guard<std::mutex> l(mu_);
  v_ += v;
}
double Gauge::value() const {
  std::lock_guard<std::mutex> l(mu_);
  return v_;
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  std::lock_guard<std::mutex> l(mu_);
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

Histogram::Snapshot Histogram::snapshot() const {
  std::lock_guard<std::mutex> l(mu_);
  Snapshot s{bounds_, {}, sum_, count_};
  uint64_t acc = 0;
  for (auto c : counts_) s.cumulative.push_back(acc += c);
  return s;
}

double Histogram::quantile(double q) const {
  auto s = snapshot();
  if (s.count == 0) return 0;
  const auto rank = static_cast<uint64_t>(std::ceil(q * static_cast<double>(s.count)));
  for (size_t i = 0; i < s.bounds.size(); ++i) {
    if (s.cumulative[i] >= rank) return s.bounds[i];
  }
  return INFINITY;
}

std::vector<double> MetricsRegistry::latency_buckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

MetricsRegistry::Family& MetricsRegistry::family(const std::string& name, Type type, const std::string& help) {
  auto [it, inserted] = families_.try_emplace(name);
  if (inserted) {
    it->second.type = type;
    it->second.help = help;
  }
  TROUPE_CHECK(it->second.type == type, "metric " + name + " registered with two types");
  return it->second;
}

Counter& MetricsRegistry::counter(const std::string& name, const std::string& help, const Labels& labels) {
  std::lock_guard<std::mutex> l(mu_);
  auto& f = family(name, Type::counter, help);
  auto& slot = f.counters[render_labels(labels)];
  if (!slot) slot = std::make_unique<Counter>();
  return *slot;
}

Gauge& MetricsRegistry::gauge(const std::string& name, const std::string& help, const Labels& labels) {
  std::lock_guard<std::mutex> l(mu_);
  auto& f = family(name, Type::gauge, help);
  auto& slot = f.gauges[render_labels(labels)];
  if (!slot) slot = std::make_unique<Gauge>();
  return *slot;
}

Histogram& MetricsRegistry::histogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                                      const Labels& labels) {
  std::lock_guard<std::mutex> l(mu_);
  auto& f = family(name, Type::histogram, help);
  auto& slot = f.histograms[render_labels(labels)];
  if (!slot) slot = std::make_unique<Histogram>(std::move(bounds));
  return *slot;
}

std::string MetricsRegistry::render() const {
  std::lock_guard<std::mutex> l(mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    const char* type = f.type == Type::counter ? "counter" : f.type == Type::gauge ? "gauge" : "histogram";
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, f.help, name, type);
    for (const auto& [labels, c] : f.counters) out += fmt::format("{}{} {}\n", name, labels, number(c->value()));
    for (const auto& [labels, g] : f.gauges) out += fmt::format("{}{} {}\n", name, labels, number(g->value()));
    for (const auto& [labels, h] : f.histograms) {
      auto s = h->snapshot();
      // labels is "{a=...}" or "": splice `le` in.
      const std::string inner = labels.empty() ? "" : labels.substr(1, labels.size() - 2) + ",";
      for (size_t i = 0; i < s.bounds.size(); ++i) {
        out += fmt::format("{}_bucket{{{}le=\"{}\"}} {}\n", name, inner, number(s.bounds[i]), s.cumulative[i]);
      }
      out += fmt::format("{}_bucket{{{}le=\"+Inf\"}} {}\n", name, inner, s.count);
      out += fmt::format("{}_sum{} {}\n{}_count{} {}\n", name, labels, number(s.sum), name, labels, s.count);
    }
  }
  return out;
}

}  // namespace troupe
