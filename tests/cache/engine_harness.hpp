// Helpers for engine tests: collect events per request and check them
// against DenseState runs of the same tokens.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <random>

#include "engine/engine.hpp"
#include "tests/cache/test_model.hpp"

namespace troupe::test {

struct Run {
  std::vector<int32_t> prompt;
  std::vector<int32_t> generated;
  std::map<int64_t, std::vector<float>> rows;  // position -> logits row (LogitsMode::all, prompt or sampled)
  std::vector<engine::EventKind> kinds;
  bool finished = false;
  engine::Event last;
};

class Harness {
 public:
  Harness(model::Model& m, engine::EngineOptions o) : m_(m), engine_(m, o) {}
  engine::Engine& engine() { return engine_; }

  engine::RequestId submit(engine::Request r) {
    auto prompt = r.prompt;
    const auto id = engine_.submit(std::move(r));
    runs_[id].prompt = std::move(prompt);
    return id;
  }
  // Moves queued events into the runs.
  void collect() {
    const int64_t V = m_.config().vocab_size;
    for (auto& e : engine_.take_events()) {
      Run& r = runs_[e.id];
      r.kinds.push_back(e.kind);
      if (e.kind == engine::EventKind::token) {
        r.generated.push_back(e.token);
        if (!e.logits.empty()) r.rows[e.position - 1] = e.logits;
      } else if (e.kind == engine::EventKind::logits) {
        const int64_t n = static_cast<int64_t>(e.logits.size()) / V;
        for (int64_t i = 0; i < n; ++i) {
          r.rows[e.position + i].assign(e.logits.begin() + i * V, e.logits.begin() + (i + 1) * V);
        }
      } else if (e.kind == engine::EventKind::finished) {
        r.finished = true;
        r.last = e;
      }
    }
  }
  void run() {
    engine_.run_until_idle();
    collect();
  }
  Run& operator[](engine::RequestId id) { return runs_[id]; }
  std::map<engine::RequestId, Run>& runs() { return runs_; }

  // Every row the engine computed equals a DenseState run of the same tokens
  // in one call (tol 0: the same bits; the CPU backend is batch-invariant, so
  // no chunking or batch company may change a row); rows cover
  // [cached, length - 1) without gaps.
  void expect_dense_logits(engine::RequestId id, float tol = 0.0f) {
    const Run& r = runs_[id];
    std::vector<int32_t> all = r.prompt;
    all.insert(all.end(), r.generated.begin(), r.generated.end());
    if (!r.generated.empty()) all.pop_back();  // the last token is not fed
    ASSERT_FALSE(r.rows.empty()) << "request " << id;
    const auto want = dense_logits(m_, all);
    const int64_t V = m_.config().vocab_size;
    int64_t expect = r.rows.begin()->first;
    EXPECT_EQ(expect, r.last.usage.cached_tokens) << "request " << id;
    float worst = 0;
    int64_t first_bad = -1, bad = 0;
    for (const auto& [pos, row] : r.rows) {
      ASSERT_EQ(pos, expect) << "request " << id << ": rows have a gap";
      ++expect;
      ASSERT_LT(pos, static_cast<int64_t>(all.size()));
      const float d = max_abs_diff(row.data(), want.data() + pos * V, static_cast<size_t>(V));
      if (d > tol) {
        if (first_bad < 0) first_bad = pos;
        ++bad;
      }
      worst = std::max(worst, d);
    }
    EXPECT_EQ(expect, static_cast<int64_t>(all.size())) << "request " << id;
    EXPECT_LE(worst, tol) << "request " << id << " (" << all.size() << " tokens, cached "
                          << r.last.usage.cached_tokens << "): " << bad << " positions differ, the first at "
                          << first_bad;
  }

  // No page is in use that no holder references; with `empty`, nothing at all.
  void expect_no_leaks(bool empty) {
    for (auto tier : {cache::Tier::device, cache::Tier::host}) {
      const auto audit = engine_.audit(tier);
      for (cache::PoolKind k : cache::kAllPools) {
        const auto& a = audit[static_cast<size_t>(cache::index(k))];
        EXPECT_EQ(a.leaked, 0) << cache::to_string(tier) << " " << cache::to_string(k);
        if (empty) {
          EXPECT_EQ(a.in_use, 0) << cache::to_string(tier) << " " << cache::to_string(k);
        }
      }
    }
  }

 private:
  model::Model& m_;
  engine::Engine engine_;
  std::map<engine::RequestId, Run> runs_;
};

inline engine::Request greedy(std::vector<int32_t> prompt, int32_t max_tokens,
                              engine::LogitsMode mode = engine::LogitsMode::all) {
  engine::Request r;
  r.prompt = std::move(prompt);
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  r.logits = mode;
  return r;
}

}  // namespace troupe::test
