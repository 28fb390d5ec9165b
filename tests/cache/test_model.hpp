// The model the cache tests run: $TROUPE_TEST_MODEL when set (any V4 model
// directory, e.g. a committed fixture), else a tiny random model generated
// once into the build tree.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.hpp"
#include "model/forward.hpp"
#include "model/init.hpp"

namespace troupe::test {

inline std::string test_model_dir() {
  if (const char* env = std::getenv("TROUPE_TEST_MODEL"); env != nullptr && *env != 0) return env;
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(TROUPE_BINARY_DIR) / "models" / "tiny512";
  if (!fs::exists(dir / "config.json")) {
    // Several test processes may get here at once: build aside, then rename.
    const fs::path tmp = dir.string() + ".tmp" + std::to_string(getpid());
    model::InitOptions o;
    o.preset = "tiny";
    o.vocab = 512;
    model::init_model(tmp.string(), o);
    std::error_code ec;
    fs::rename(tmp, dir, ec);
    if (ec) fs::remove_all(tmp);
  }
  return dir.string();
}

// One model per test process.
struct TestModel {
  std::unique_ptr<kernels::Backend> backend = kernels::make_cpu_backend();
  std::unique_ptr<model::Model> model = model::Model::load(test_model_dir(), *backend);
};

inline TestModel& shared_model() {
  static TestModel m;
  return m;
}

// Logits [n, vocab] of running `ids` through one DenseState in a single call.
inline std::vector<float> dense_logits(model::Model& m, const std::vector<int32_t>& ids) {
  auto state = m.new_dense_state();
  model::Chunk c{state.get(), ids, model::LogitsWanted::all};
  return m.forward(std::span(&c, 1));
}

inline std::vector<int32_t> random_ids(std::mt19937_64& rng, int64_t n, int64_t vocab) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& x : ids) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return ids;
}

inline float max_abs_diff(const float* a, const float* b, size_t n) {
  float d = 0;
  for (size_t i = 0; i < n; ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

}  // namespace troupe::test
