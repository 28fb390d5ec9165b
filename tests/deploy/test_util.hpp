// Helpers shared by the deploy tests: files of the source tree, running bin/troupe.
#pragma once

#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
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

struct RunResult {
  int status = -1;
  std::string output;  // stdout and stderr
};

// Runs bin/troupe with arguments (already shell-quoted where needed).
inline RunResult run_troupe(const std::string& args) {
  const std::string cmd = std::string(TROUPE_BINARY_DIR) + "/bin/troupe " + args + " 2>&1";
  RunResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

}  // namespace troupe::deploy::test
