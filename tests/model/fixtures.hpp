// Golden fixtures made by tools/make_golden.py (transformers on the GPU machine).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/mapped_file.hpp"
#include "base/npy.hpp"

namespace troupe::testing {

struct Fixture {
  std::string name;
  std::string dir;
  std::vector<int32_t> ids;
  std::vector<float> logits;  // [tokens, vocab]
  int64_t vocab = 0;
  nlohmann::json meta;
};

inline std::string fixtures_dir() { return std::string(TROUPE_SOURCE_DIR) + "/tests/fixtures/model"; }

inline Fixture load_fixture(const std::string& name) {
  Fixture f;
  f.name = name;
  f.dir = fixtures_dir() + "/" + name;
  for (int64_t id : read_npy(f.dir + "/ids.npy").as_i64()) f.ids.push_back(static_cast<int32_t>(id));
  auto logits = read_npy(f.dir + "/logits.npy");
  f.vocab = logits.shape.at(1);
  f.logits = logits.as_f32();
  f.meta = nlohmann::json::parse(read_text_file(f.dir + "/meta.json"));
  return f;
}

inline std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(fixtures_dir())) {
    if (std::filesystem::exists(e.path() / "logits.npy")) names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

inline double max_abs_diff(const float* a, const float* b, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, static_cast<double>(std::abs(a[i] - b[i])));
  return m;
}

}  // namespace troupe::testing
