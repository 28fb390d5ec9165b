#include "tests/tokenizer/support.hpp"

#include <fstream>
#include <sstream>
#include <stdexcept>

namespace troupe::tokenizer::testing {

std::string shipped_dir() { return std::string(TROUPE_SOURCE_DIR) + "/model/tokenizer/data/deepseek-v4"; }

const Tokenizer& deepseek() {
  static const auto tok = Tokenizer::load(shipped_dir());
  return *tok;
}

std::string fixture_path(const std::string& name) {
  return std::string(TROUPE_SOURCE_DIR) + "/tests/fixtures/tokenizer/" + name;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> read_lines(const std::string& path) {
  const std::string all = read_file(path);
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < all.size()) {
    size_t nl = all.find('\n', start);
    if (nl == std::string::npos) nl = all.size();
    lines.push_back(all.substr(start, nl - start));
    start = nl + 1;
  }
  return lines;
}

std::vector<nlohmann::json> read_jsonl(const std::string& name) {
  std::vector<nlohmann::json> rows;
  for (const auto& line : read_lines(fixture_path(name))) {
    if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
  }
  return rows;
}

std::vector<int32_t> parse_ids(const std::string& line) {
  std::vector<int32_t> ids;
  std::istringstream in(line);
  int64_t v;
  while (in >> v) ids.push_back(static_cast<int32_t>(v));
  return ids;
}

std::string hex(std::string_view bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
    out += ' ';
  }
  return out;
}

}  // namespace troupe::tokenizer::testing
