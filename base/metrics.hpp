// Prometheus metrics: counters, gauges and histograms with labels, rendered in
// the text exposition format. Thread-safe; handles stay valid for the life of
// the registry. One name per concept (docs/architecture.md): the manifest's
// `long_tail` policy counts in `troupe_long_tail_parked_total`.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace troupe {

using Labels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void inc(double v = 1.0);
  double value() const;

 private:
  mutable std::mutex mu_;
  double v_ = 0;
};

class Gauge {
 public:
  void set(double v);
  void add(double v);
  double value() const;

 private:
  mutable std::mutex mu_;
  double v_ = 0;
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // per bound, then +Inf
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot snapshot() const;
  double quantile(double q) const;  // from the buckets (upper bound of the bucket holding q)

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;
  double sum_ = 0;
  uint64_t count_ = 0;
};

class MetricsRegistry {
 public:
  Counter& counter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge& gauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram& histogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                       const Labels& labels = {});
  std::string render() const;  // text exposition format 0.0.4

  // Latency buckets in seconds, 1 ms .. 60 s.
  static std::vector<double> latency_buckets();

 private:
  enum class Type { counter, gauge, histogram };
  struct Family {
    Type type;
    std::string help;
    std::map<std::string, std::unique_ptr<Counter>> counters;  // key: rendered labels
    std::map<std::string, std::unique_ptr<Gauge>> gauges;
    std::map<std::string, std::unique_ptr<Histogram>> histograms;
  };
  Family& family(const std::string& name, Type type, const std::string& help);
  mutable std::mutex mu_;
  std::map<std::string, Family> families_;
};

}  // namespace troupe
