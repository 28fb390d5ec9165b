// Helpers shared by the deploy tests: files of the source tree, expectations.
#pragma once

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace troupe::deploy::test {

inline std::string source(const std::string& rel) { return std::string(TROUPE_SOURCE_DIR) + "/" + rel; }

inline std::vector<std::string> files_in(const std::string& rel_dir) {
  std::vector<std::string> out;
  for (auto& e : std::filesystem::directory_iterator(source(rel_dir))) {
    if (e.path().extension() == ".yaml") out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The text after "# expect: " on a bad manifest's first line.
inline std::string expectation(const std::string& path) {
  std::string first = read_text(path).substr(0, read_text(path).find('\n'));
  const std::string tag = "# expect: ";
  return first.rfind(tag, 0) == 0 ? first.substr(tag.size()) : "";
}

}  // namespace troupe::deploy::test
