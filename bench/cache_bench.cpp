// Cache and engine speed: radix match/insert, page lease/release, engine
// steps/s at several batch sizes (against a plain Model::forward loop over
// DenseStates, the peer measured in the same run), and the decode cost of the
// host tier at four times the context a capped device tier holds.
// Prints one JSON object per line; scripts/bench_cache.py writes docs/benchmarks.md.
//
// Usage: troupe_cache_bench [--model DIR] [--quick]
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <random>

#include "cache/radix/shadow_radix.hpp"
#include "engine/engine.hpp"
#include "model/forward.hpp"
#include "model/init.hpp"

using namespace troupe;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::vector<int32_t> random_ids(std::mt19937_64& rng, int64_t n, int64_t vocab) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return v;
}

void bench_pages(const cache::CacheGeometry& g) {
  cache::PoolSet set(g, cache::host_memory(true), uint64_t{256} << 20);
  std::vector<cache::PageId> held;
  std::mt19937_64 rng(1);
  const int64_t n = 2'000'000;
  const auto t = Clock::now();
  for (int64_t i = 0; i < n; ++i) {
    if (held.size() < 64 || (held.size() < 4096 && rng() % 2 == 0)) {
      held.push_back(set.lease(cache::PoolKind::csa_entry));
    } else {
      const size_t j = rng() % held.size();
      set.release(cache::PoolKind::csa_entry, held[j]);
      held[j] = held.back();
      held.pop_back();
    }
  }
  const double s = since(t);
  for (auto p : held) set.release(cache::PoolKind::csa_entry, p);
  std::cout << fmt::format(R"({{"bench":"pages","ops":{},"seconds":{:.4f},"ops_per_s":{:.0f}}})", n, s, n / s) << "\n";
}

void bench_radix(const cache::CacheGeometry& g, int64_t vocab) {
  cache::PoolSet set(g, cache::host_memory(true), uint64_t{2} << 30);
  cache::Tiers tiers(set, nullptr);
  cache::ShadowRadix tree(tiers);
  std::mt19937_64 rng(2);
  const int64_t P = g.page_tokens, pages = 64, seqs = 2000;
  // 20 system prompts of 16 pages, each request adds 48 pages of its own.
  std::vector<std::vector<int32_t>> systems;
  for (int i = 0; i < 20; ++i) systems.push_back(random_ids(rng, 16 * P, vocab));
  std::vector<std::vector<int32_t>> keys;
  for (int64_t i = 0; i < seqs; ++i) {
    auto k = systems[rng() % systems.size()];
    auto tail = random_ids(rng, (pages - 16) * P, vocab);
    k.insert(k.end(), tail.begin(), tail.end());
    keys.push_back(std::move(k));
  }
  std::vector<cache::TokenPage> tp(static_cast<size_t>(pages));
  auto t = Clock::now();
  for (const auto& k : keys) {
    for (auto& p : tp) {
      for (auto kind : cache::kEntryPools) {
        if (g.has(kind)) p.at(kind) = {set.lease(kind), cache::Tier::device};
      }
    }
    tree.insert(k, tp);
    for (auto& p : tp) {
      for (auto kind : cache::kEntryPools) {
        if (p.at(kind).valid()) set.release(kind, p.at(kind).id);
      }
    }
  }
  const double ins = since(t);
  t = Clock::now();
  int64_t matched = 0;
  const int64_t lookups = 20000;
  for (int64_t i = 0; i < lookups; ++i) matched += tree.match(keys[rng() % keys.size()], pages * P).matched;
  const double mat = since(t);
  std::cout << fmt::format(R"({{"bench":"radix","nodes":{},"inserts":{},"insert_s":{:.4f},"inserts_per_s":{:.0f},)"
                           R"("matches":{},"match_s":{:.4f},"matches_per_s":{:.0f},"match_tokens_per_s":{:.3g}}})",
                           tree.node_count(), seqs, ins, seqs / ins, lookups, mat, lookups / mat, matched / mat)
            << "\n";
}

// Decode steps/s of `batch` sequences: the engine, and Model::forward over
// DenseStates (the peer), measured in alternating rounds so that load from
// other processes hits both alike.
void bench_engine(model::Model& m, int batch, int64_t prompt, int steps) {
  std::mt19937_64 rng(3);
  const int64_t V = m.config().vocab_size;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < batch; ++i) prompts.push_back(random_ids(rng, prompt, V));
  // Peer: prefill, then decode calls of the whole batch.
  std::vector<std::unique_ptr<model::SequenceState>> st;
  std::vector<model::Chunk> chunks;
  for (auto& p : prompts) {
    st.push_back(m.new_dense_state());
    chunks.push_back({st.back().get(), p, model::LogitsWanted::last});
  }
  auto logits = m.forward(chunks);
  std::vector<int32_t> next(static_cast<size_t>(batch));
  auto argmax = [&] {
    for (int i = 0; i < batch; ++i) {
      const float* row = logits.data() + static_cast<size_t>(i) * static_cast<size_t>(V);
      next[static_cast<size_t>(i)] = static_cast<int32_t>(std::max_element(row, row + V) - row);
    }
  };
  argmax();
  // The engine: same prompts, greedy.
  engine::EngineOptions o;
  o.step_tokens = std::max<int64_t>(prompt * batch, 512);
  engine::Engine e(m, o);
  for (auto& p : prompts) {
    engine::Request r;
    r.prompt = p;
    r.sampling.max_tokens = steps + 2;
    r.sampling.ignore_eos = true;
    e.submit(std::move(r));
  }
  e.step();  // prefill (one call) and the first tokens
  double peer = 0, mine = 0;
  const int round = 4;
  for (int done = 0; done < steps; done += round) {
    auto t = Clock::now();
    for (int s = 0; s < round; ++s) {
      for (int i = 0; i < batch; ++i) {
        chunks[static_cast<size_t>(i)] = {st[static_cast<size_t>(i)].get(), std::span(&next[static_cast<size_t>(i)], 1),
                                          model::LogitsWanted::last};
      }
      logits = m.forward(chunks);
      argmax();
    }
    peer += since(t);
    t = Clock::now();
    for (int s = 0; s < round; ++s) e.step();
    mine += since(t);
  }
  std::cout << fmt::format(R"({{"bench":"engine","batch":{},"prompt":{},"steps":{},"engine_s":{:.4f},"engine_steps_per_s":{:.1f},)"
                           R"("engine_tokens_per_s":{:.0f},"forward_s":{:.4f},"forward_steps_per_s":{:.1f},"ratio":{:.3f}}})",
                           batch, prompt, steps, mine, steps / mine, steps * batch / mine, peer, steps / peer, peer / mine)
            << "\n";
}

// Decode speed of one sequence at four times the context a capped device tier
// holds: with the host tier (cold pages) against an uncapped device tier,
// stepping the two engines in turn.
void bench_offload(model::Model& m, int decode) {
  std::mt19937_64 rng(4);
  const int64_t V = m.config().vocab_size;
  auto capped = [](bool host) {
    engine::EngineOptions o;
    o.step_tokens = 512;
    o.slab_bytes = 64 << 10;
    o.device_bytes = 9 * o.slab_bytes;
    o.host_bytes = host ? uint64_t{256} << 20 : 0;
    o.prefix_cache = false;
    return o;
  };
  const auto long_prompt = random_ids(rng, 40000, V);
  int64_t reached = 0;
  {
    engine::Engine e(m, capped(false));
    engine::Request r;
    r.prompt = long_prompt;
    r.sampling.max_tokens = 1;
    e.submit(std::move(r));
    e.run_until_idle();
    for (auto& ev : e.take_events()) {
      if (ev.kind == engine::EventKind::finished) reached = ev.usage.computed_tokens;
    }
  }
  const int64_t context = 4 * reached;
  engine::EngineOptions roomy;
  roomy.prefix_cache = false;
  roomy.step_tokens = 512;
  engine::Engine uncapped(m, roomy), host(m, capped(true));
  for (auto* e : {&uncapped, &host}) {
    engine::Request r;
    r.prompt.assign(long_prompt.begin(), long_prompt.begin() + context);
    r.sampling.max_tokens = decode + 2;
    r.sampling.ignore_eos = true;
    e->submit(std::move(r));
    while (e->stats().decode_tokens == 0) e->step();  // prefill and the first token
  }
  double t_uncapped = 0, t_host = 0;
  for (int s = 0; s < decode; ++s) {
    auto t = Clock::now();
    uncapped.step();
    t_uncapped += since(t);
    t = Clock::now();
    host.step();
    t_host += since(t);
  }
  std::cout << fmt::format(R"({{"bench":"offload","device_bytes":{},"context_without_host":{},"context":{},)"
                           R"("cold_pages":{},"decode_steps_per_s_uncapped":{:.1f},"decode_steps_per_s_host_tier":{:.1f},"ratio":{:.3f}}})",
                           capped(true).device_bytes, reached, context, host.stats().cold_pages, decode / t_uncapped,
                           decode / t_host, t_uncapped / t_host)
            << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--model") == 0 && i + 1 < argc) dir = argv[++i];
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
  }
  if (dir.empty()) {
    dir = (std::filesystem::path(TROUPE_BINARY_DIR) / "models" / "tiny512").string();
    if (!std::filesystem::exists(std::filesystem::path(dir) / "config.json")) {
      model::InitOptions o;
      o.vocab = 512;
      model::init_model(dir, o);
    }
  }
  auto backend = kernels::make_cpu_backend();
  auto m = model::Model::load(dir, *backend);
  const auto g = cache::CacheGeometry::of(m->config());
  bench_pages(g);
  bench_radix(g, m->config().vocab_size);
  for (int batch : {1, 8, 64}) bench_engine(*m, batch, 64, quick ? 8 : 32);
  bench_offload(*m, quick ? 8 : 32);
  return 0;
}
