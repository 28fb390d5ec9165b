// A tiny "--name value" / "--flag" parser for test and bench executables
// (CLI11 costs minutes of compile time under the sanitizers on 2 cores).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace troupe::test {

class Args {
 public:
  Args(int argc, char** argv) : v_(argv + 1, argv + argc) {}
  // The value after `name`, or `fallback`.
  std::string get(const std::string& name, const std::string& fallback = "") const {
    for (size_t i = 0; i + 1 < v_.size(); ++i) {
      if (v_[i] == name) return v_[i + 1];
    }
    return fallback;
  }
  long long num(const std::string& name, long long fallback) const {
    auto s = get(name);
    return s.empty() ? fallback : std::atoll(s.c_str());
  }
  // Every value given for `name` (repeatable options).
  std::vector<std::string> all(const std::string& name) const {
    std::vector<std::string> out;
    for (size_t i = 0; i + 1 < v_.size(); ++i) {
      if (v_[i] == name) out.push_back(v_[i + 1]);
    }
    return out;
  }
  bool flag(const std::string& name) const {
    for (auto& a : v_) {
      if (a == name) return true;
    }
    return false;
  }

 private:
  std::vector<std::string> v_;
};

}  // namespace troupe::test
