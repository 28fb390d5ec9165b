// The models the cache tests run. $TROUPE_TEST_MODEL, when set, is used for
// both (any V4 model directory, e.g. a committed fixture); otherwise tiny
// random models are generated once into the build tree.
//
// shared_model(): `init-model --preset tiny --vocab 512` on RowWiseBackend
// (tests/cache/row_wise_backend.hpp), so cache results must equal DenseState
// runs exactly. plain_model(): the plain CPU backend, for the 1e-4 checks
// against runs batched differently; its model has 2 experts with top-2
// routing, leaving the router no choice: with 8 experts a near-tie between
// the 2nd and 3rd expert of one token among ~30,000 routing decisions turns
// the ~1e-6 difference batching makes (BLAS sums in another order) into
// another expert and a ~0.05 logits difference at that position, a property
// of comparing two float orders on a random model, not of the cache (the
// committed transformers fixtures are chosen free of such ties).
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
#include "tests/cache/row_wise_backend.hpp"

namespace troupe::test {

inline std::string generated_model(const std::string& name, int64_t experts) {
  if (const char* env = std::getenv("TROUPE_TEST_MODEL"); env != nullptr && *env != 0) return env;
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(TROUPE_BINARY_DIR) / "models" / name;
  if (!fs::exists(dir / "config.json")) {
    // Several test processes may get here at once: build aside, then rename.
    const fs::path tmp = dir.string() + ".tmp" + std::to_string(getpid());
    model::InitOptions o;
    o.preset = "tiny";
    o.vocab = 512;
    o.experts = experts;
    model::init_model(tmp.string(), o);
    std::error_code ec;
    fs::rename(tmp, dir, ec);
    if (ec) fs::remove_all(tmp);
  }
  return dir.string();
}

inline std::string test_model_dir() { return generated_model("tiny512", -1); }

struct TestModel {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<model::Model> model;
};

inline TestModel& shared_model() {
  static TestModel m = [] {
    TestModel t;
    t.backend = std::make_unique<RowWiseBackend>();
    t.model = model::Model::load(test_model_dir(), *t.backend);
    return t;
  }();
  return m;
}

inline TestModel& plain_model() {
  static TestModel m = [] {
    TestModel t;
    t.backend = kernels::make_cpu_backend();
    t.model = model::Model::load(generated_model("tiny512e2", 2), *t.backend);
    return t;
  }();
  return m;
}

// Logits [n, vocab] of running `ids` through one DenseState in a single call.
inline std::vector<float> dense_logits(model::Model& m, const std::vector<int32_t>& ids) {
  auto state = m.new_dense_state();
  model::Chunk c{state.get(), ids, model::LogitsWanted::all};
  return m.forward(std::span(&c, 1));
}

// Logits [n, vocab] of `ids` fed through one DenseState in chunks of `chunk`
// tokens, each call batched with `company` (another sequence's next tokens, or
// none): the same math in another floating-point order.
inline std::vector<float> dense_logits_chunked(model::Model& m, const std::vector<int32_t>& ids, size_t chunk,
                                               const std::vector<int32_t>& company = {}) {
  auto state = m.new_dense_state();
  auto other = m.new_dense_state();
  std::vector<float> out;
  const size_t V = static_cast<size_t>(m.config().vocab_size);
  for (size_t at = 0; at < ids.size(); at += chunk) {
    const size_t n = std::min(chunk, ids.size() - at);
    std::vector<model::Chunk> chunks{{state.get(), std::span(ids).subspan(at, n), model::LogitsWanted::all}};
    const auto o = static_cast<size_t>(other->length());
    if (o < company.size()) {
      chunks.push_back({other.get(), std::span(company).subspan(o, std::min(n, company.size() - o)), model::LogitsWanted::none});
    }
    auto rows = m.forward(chunks);
    out.insert(out.end(), rows.begin(), rows.begin() + static_cast<long>(n * V));
  }
  return out;
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
